"""RoPE forward + backward at the query and key shapes of Qwen3-0.6B and 8B: Megatron-Core's unfused RoPE against
the compiled one.

Without Transformer Engine, Megatron-Core applies RoPE with about ten small kernels each way per call
(`rope_utils._apply_rotary_pos_emb_bshd`), for the queries and the keys of every layer; `_compat/fast_rope.py`
replaces them with one `torch.compile`d kernel each way. This measures both, so a GPU session can judge the default.

Per model shape (`common.QWEN3_0_6B`, `QWEN3_8B`), over `--tokens` x `--micro-batch` tokens (a packed row of 4096 by
default), bf16, the query heads [s, b, heads, 128] (a copy out of the fused QKV output) and the key heads
[s, b, kv heads, 128] (a strided view of it) as `norms.layer_inputs` makes them, rotated by Megatron's table of
Qwen3's rope_theta (float32 [s, 1, 1, 128]). Per arm, on the same input and output gradient:

- `upstream`: Megatron-Core's `_apply_rotary_pos_emb_bshd`, what runs without the adjustment;
- `compiled`: `fast_rope.rope` with the compiled kernels, what the adjustment runs on CUDA;
- `eager`: the same math uncompiled (`fast_rope.EAGER`: what a call runs where it cannot compile).

Reported per arm: the forward + backward wall time per call (median of `--repeats` synchronised calls), the GPU time
per call (kernels summed under torch.profiler; forward alone too) and the kernels run, and the largest absolute
difference of the output and the gradient to the float32 reference (upstream's function on the float32 values)
beside its largest magnitude. Per model: RoPE's GPU time per microbatch, layers x (query + key), per arm, and
compiled over upstream. Without CUDA (`--tiny` on a CPU) the compiled arm is skipped with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from bench.common import QWEN3_0_6B, QWEN3_8B, emit, environment
from bench.norms import TINY_SHAPE, layer_inputs, measure_arms, over_upstream, parse_comparison_args
from lightning_megatron._compat import fast_rope
from lightning_megatron._compat.fast_rope import EAGER, rope

SHAPES = {"qwen3_0.6b": QWEN3_0_6B, "qwen3_8b": QWEN3_8B}
ARMS = ("upstream", "compiled", "eager")
RESULTS = ("output", "grad")
THETA = 1e6  # Qwen3's rope_theta

Rope = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def rope_table(tokens: int, head_dim: int, device: torch.device) -> torch.Tensor:
    """Megatron's RoPE table [tokens, 1, 1, head_dim] (`RotaryEmbedding`: positions times the inverse frequencies,
    twice), float32."""
    inverse = 1.0 / THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(tokens, dtype=torch.float32), inverse)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :].to(device)


def arms() -> dict[str, Rope | str]:
    """Each arm's RoPE, or why it cannot run here."""
    from megatron.core.models.common.embeddings import rope_utils

    with fast_rope.ADJUSTMENTS[0].suspended():
        upstream = rope_utils._apply_rotary_pos_emb_bshd
    return {
        "upstream": lambda t, freqs: upstream(t, freqs),
        "compiled": (lambda t, freqs: rope(t, freqs)) if torch.cuda.is_available()
        else "needs CUDA: the adjustment compiles RoPE on CUDA only",
        "eager": lambda t, freqs: rope(t, freqs, kernels=EAGER),
    }


def _forward_backward(apply: Rope, t: torch.Tensor, freqs: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    t = t.detach().requires_grad_()
    output = apply(t, freqs)
    output.backward(grad)
    return [output.detach(), t.grad]


def measure_rope(t: torch.Tensor, warmup: int, repeats: int) -> dict[str, Any]:
    """Every arm on `t`'s RoPE: times, kernels, and each result's largest difference to the float32 reference."""
    freqs = rope_table(t.shape[0], t.shape[-1], t.device)
    grad = torch.randn(t.shape, generator=torch.Generator().manual_seed(1)).to(t.device, t.dtype)
    arms_here = arms()
    reference = _forward_backward(arms_here["upstream"], t.float(), freqs, grad.float())
    result: dict[str, Any] = {"shape": list(t.shape), "contiguous": t.is_contiguous()}

    @torch.no_grad()
    def forward(apply: Rope) -> torch.Tensor:
        return apply(t, freqs)

    result["arms"] = measure_arms(arms_here, lambda apply: _forward_backward(apply, t, freqs, grad), forward,
                                  dict(zip(RESULTS, reference, strict=True)), warmup, repeats)
    return result


def per_microbatch(heads: dict[str, dict[str, Any]], layers: int) -> dict[str, Any]:
    """RoPE's GPU time a microbatch spends, each layer's queries and keys, per arm with GPU times, and compiled
    over upstream."""
    totals = {arm: layers * sum(heads[name]["arms"][arm]["forward_backward_gpu_us"] for name in heads) / 1e3
              for arm in ARMS if all(heads[name]["arms"][arm].get("forward_backward_gpu_us") is not None
                                     for name in heads)}
    return over_upstream({name: layers for name in heads}, totals)


def main() -> None:
    args, device, dtype = parse_comparison_args(__doc__, list(SHAPES))
    shapes = {"tiny": TINY_SHAPE} if args.tiny else {name: SHAPES[name] for name in args.shapes}
    results: dict[str, Any] = {}
    for name, shape in shapes.items():
        inputs = layer_inputs(shape, args.tokens, args.micro_batch, dtype, device)
        heads = {head: measure_rope(inputs[head], args.warmup, args.repeats) for head in ("query", "key")}
        results[name] = {"layers": shape["num_layers"], "heads": heads,
                         "per_microbatch": per_microbatch(heads, shape["num_layers"])}
    emit({"benchmark": "rope", **environment(), "tokens": args.tokens, "micro_batch": args.micro_batch,
          "dtype": str(dtype).removeprefix("torch."), "rope_theta": THETA, "warmup": args.warmup,
          "repeats": args.repeats, "shapes": results}, args.out)


if __name__ == "__main__":
    main()
