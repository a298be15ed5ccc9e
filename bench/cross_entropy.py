"""The language-model cross-entropy forward + backward at the logits of Qwen3-0.6B and 8B: Megatron-Core's fused
("native") cross-entropy against the compiled one.

Without Transformer Engine, megatron-bridge's `cross_entropy_fusion_impl='native'` computes every main-head and MTP
loss with `fused_vocab_parallel_cross_entropy` (an fp32 copy of the logits, its softmax kept for the backward);
`_compat/fast_cross_entropy.py` replaces it with three `torch.compile`d passes, the bf16 gradient made in the forward,
and a compiled backward that scales that gradient in place.
This measures both, so a GPU session can judge the default.

Per model shape (`common.QWEN3_0_6B`, `QWEN3_8B`: both a vocabulary of 151936, TP=1), bf16 logits
[`--tokens`, `--micro-batch`, vocab] of spread 3 and random targets, the backward from a random weight per token (a
loss mask's). Per arm, on the same inputs:

- `upstream`: Megatron-Core's `fused_vocab_parallel_cross_entropy`, what runs without the adjustment;
- `compiled`: `fast_cross_entropy.cross_entropy` with the compiled kernels, what the adjustment runs on CUDA;
- `eager`: the same math uncompiled (`fast_cross_entropy.EAGER`: what a call runs where it cannot compile).

Reported per arm (`norms.measure_arm`): the forward + backward wall time per call, the GPU time per call (forward
alone too) and the kernels run, and the largest absolute difference of the loss and the logits' gradient to the
float32 reference (Megatron-Core's unfused cross-entropy on the float32 values) beside its largest magnitude. Per
model: the cross-entropy's GPU time per microbatch (the main head and the MTP head: two calls), per arm, and
compiled over upstream. Without CUDA (`--tiny` on a CPU) the compiled arm is skipped with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from bench.common import QWEN3_0_6B, QWEN3_8B, emit, environment
from bench.norms import measure_arms, over_upstream, parse_comparison_args
from lightning_megatron._compat import fast_cross_entropy
from lightning_megatron._compat.fast_cross_entropy import EAGER, cross_entropy
from lightning_megatron.distributed import init_single_process

SHAPES = {"qwen3_0.6b": QWEN3_0_6B, "qwen3_8b": QWEN3_8B}
TINY_VOCAB = 512
ARMS = ("upstream", "compiled", "eager")
RESULTS = ("loss", "grad")
CALLS_PER_MICROBATCH = 2  # the main head's loss and the MTP head's

Loss = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]


def arms() -> dict[str, Loss | str]:
    """Each arm's cross-entropy, or why it cannot run here."""
    with fast_cross_entropy.ADJUSTMENTS[0].suspended():
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy as upstream
    return {
        "upstream": upstream,
        "compiled": cross_entropy if torch.cuda.is_available()
        else "needs CUDA: the adjustment compiles the cross-entropy on CUDA only",
        "eager": lambda logits, target, group: cross_entropy(logits, target, group, EAGER),
    }


def _kept(logits: torch.Tensor) -> torch.Tensor:
    """What to hand a loss: upstream's functions subtract the max from float32 logits in place, so those get a copy
    (bf16 ones they upcast into a copy themselves)."""
    return logits.clone() if logits.dtype == torch.float32 else logits


def _forward_backward(loss: Loss, logits: torch.Tensor, target: torch.Tensor,
                      weight: torch.Tensor) -> list[torch.Tensor]:
    leaf = logits.detach().requires_grad_()
    value = loss(_kept(leaf), target, dist.group.WORLD)
    (grad,) = torch.autograd.grad((value * weight).sum(), leaf)
    return [value.detach(), grad]


def measure_cross_entropy(tokens: int, micro_batch: int, vocab: int, dtype: torch.dtype, device: torch.device,
                          warmup: int, repeats: int) -> dict[str, Any]:
    """Every arm on one microbatch's logits: times, kernels, and each result's largest difference to the float32
    reference."""
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(tokens, micro_batch, vocab, generator=generator)).to(device, dtype)
    target = torch.randint(0, vocab, (tokens, micro_batch), generator=generator).to(device)
    weight = torch.rand(tokens, micro_batch, generator=generator).to(device)
    reference = _forward_backward(lambda x, t, group: vocab_parallel_cross_entropy(x, t, tp_group=group),
                                  logits.float(), target, weight)

    @torch.no_grad()
    def forward(loss: Loss) -> torch.Tensor:
        return loss(_kept(logits), target, dist.group.WORLD)

    arms_measured = measure_arms(arms(), lambda loss: _forward_backward(loss, logits, target, weight), forward,
                                 dict(zip(RESULTS, reference, strict=True)), warmup, repeats)
    return {"shape": list(logits.shape), "arms": arms_measured}


def per_microbatch(measured: dict[str, Any]) -> dict[str, Any]:
    """The cross-entropy's GPU time a microbatch spends (main head and MTP head), per arm with GPU times, and
    compiled over upstream."""
    totals = {arm: CALLS_PER_MICROBATCH * measured["arms"][arm]["forward_backward_gpu_us"] / 1e3 for arm in ARMS
              if measured["arms"][arm].get("forward_backward_gpu_us") is not None}
    return over_upstream(CALLS_PER_MICROBATCH, totals)


def main() -> None:
    args, device, dtype = parse_comparison_args(__doc__, list(SHAPES))
    init_single_process()
    vocabularies = {"tiny": TINY_VOCAB} if args.tiny else {name: SHAPES[name]["vocab_size"] for name in args.shapes}
    results: dict[str, Any] = {}
    for name, vocab in vocabularies.items():
        measured = measure_cross_entropy(args.tokens, args.micro_batch, vocab, dtype, device, args.warmup,
                                         args.repeats)
        results[name] = {"vocab_size": vocab, "logits": measured, "per_microbatch": per_microbatch(measured)}
    emit({"benchmark": "cross_entropy", **environment(), "tokens": args.tokens, "micro_batch": args.micro_batch,
          "dtype": str(dtype).removeprefix("torch."), "warmup": args.warmup, "repeats": args.repeats,
          "shapes": results}, args.out)


if __name__ == "__main__":
    main()
