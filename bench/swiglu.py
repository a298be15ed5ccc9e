"""The MLP's SwiGLU forward + backward at the widths of Qwen3-0.6B, 4B and 8B: Megatron-Core's unfused ops against the
fused one.

Without `bias_activation_fusion` (off by default) Megatron-Core's `MLP` runs SwiGLU as SiLU, an add of
`glu_linear_offset` and a product, and autograd's backward as two products, SiLU's gradient and a concatenation:
seven kernels over [tokens, ffn] per MLP per microbatch; `_compat/fast_swiglu.py` makes the fusion the default on
CUDA and computes it with one `torch.compile`d kernel each way. This measures both, and upstream's own fused path, so
a GPU session can judge the default (`run_h200.sh`'s `sizes_swiglu` step measures the whole step with it on and off).

Per model shape (`common.QWEN3_0_6B`, `QWEN3_4B`, `QWEN3_8B`), over `--tokens` x `--micro-batch` tokens (a packed
row of 4096 by default), bf16, fc1's output [s, b, 2 ffn] as `MLP.forward` hands it over. Per arm, on the same input
and output gradient:

- `upstream`: Megatron-Core's unfused SwiGLU as `MLP.forward`'s `glu` computes it (mlp.py:319-333), what runs
  without the adjustment;
- `compiled`: `fast_swiglu.swiglu` with the compiled kernels, what the adjustment runs on CUDA;
- `eager`: the same math uncompiled (`fast_swiglu.EAGER`);
- `megatron_fused`: Megatron-Core's own `bias_swiglu_impl` (`fusions/fused_bias_swiglu.py`, plain `torch.compile`),
  what a config that sets `bias_activation_fusion` ran before the adjustment.

Reported per arm (`norms.measure_arm`): the forward + backward wall time per call, the GPU time per call (forward
alone too) and the kernels run, and the largest absolute difference of the output and the input gradient to the
float32 reference (upstream's ops on the float32 values) beside its largest magnitude. Per model: the SwiGLU GPU
time a microbatch spends (every layer's MLP, the 0.6B step's MTP layer too), per arm, and compiled over upstream.
Without CUDA (`--tiny` on a CPU) the compiled arms are skipped with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import QWEN3_0_6B, QWEN3_4B, QWEN3_8B, emit, environment
from bench.norms import measure_arms, over_upstream, parse_comparison_args
from lightning_megatron._compat.fast_swiglu import EAGER, swiglu

SHAPES = {"qwen3_0.6b": QWEN3_0_6B, "qwen3_4b": QWEN3_4B, "qwen3_8b": QWEN3_8B}
MTP_LAYERS = {"qwen3_0.6b": 1}  # the issue-41 steps: the 0.6B one joint SFT + MTP, the 4B and 8B ones without MTP
TINY_SHAPE = dict(num_layers=2, intermediate_size=32)
ARMS = ("upstream", "compiled", "eager", "megatron_fused")
RESULTS = ("output", "input_grad")

SwiGLU = Callable[[torch.Tensor], torch.Tensor]


def megatron_unfused(x: torch.Tensor) -> torch.Tensor:
    """`MLP.forward`'s `glu` (mlp.py:324-331) with Qwen3's config: SiLU of the gate times the linear half plus
    `glu_linear_offset` (0.0, still an add kernel)."""
    gate, linear = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * (linear + 0.0)


def arms() -> dict[str, SwiGLU | str]:
    """Each arm's SwiGLU, or why it cannot run here."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    without_cuda = "needs CUDA: the adjustment compiles SwiGLU on CUDA only"
    on_cuda = torch.cuda.is_available()
    return {
        "upstream": megatron_unfused,
        "compiled": swiglu if on_cuda else without_cuda,
        "eager": lambda x: swiglu(x, kernels=EAGER),
        "megatron_fused": (lambda x: bias_swiglu_impl(x, None)) if on_cuda
        else "needs CUDA: measured where the adjustment would replace it",
    }


def _forward_backward(apply: SwiGLU, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    output = apply(x)
    output.backward(grad)
    return [output.detach(), x.grad]


def measure_swiglu(tokens: int, micro_batch: int, width: int, dtype: torch.dtype, device: torch.device,
                   warmup: int, repeats: int) -> dict[str, Any]:
    """Every arm on fc1's output [tokens, micro_batch, 2 width]: times, kernels, and each result's largest
    difference to the float32 reference."""
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(tokens, micro_batch, 2 * width, generator=generator) * 2).to(device, dtype)
    grad = torch.randn(tokens, micro_batch, width, generator=generator).to(device, dtype)
    reference = _forward_backward(megatron_unfused, x.float(), grad.float())

    @torch.no_grad()
    def forward(apply: SwiGLU) -> torch.Tensor:
        return apply(x)

    return {"shape": list(x.shape), "width": width,
            "arms": measure_arms(arms(), lambda apply: _forward_backward(apply, x, grad), forward,
                                 dict(zip(RESULTS, reference, strict=True)), warmup, repeats)}


def per_microbatch(measured: dict[str, Any], calls: int) -> dict[str, Any]:
    """SwiGLU's GPU time a microbatch spends, `calls` MLPs, per arm with GPU times, and compiled over upstream."""
    totals = {arm: calls * figures["forward_backward_gpu_us"] / 1e3 for arm, figures in measured["arms"].items()
              if figures.get("forward_backward_gpu_us") is not None}
    return over_upstream(calls, totals)


def main() -> None:
    args, device, dtype = parse_comparison_args(__doc__, list(SHAPES))
    shapes = {"tiny": TINY_SHAPE} if args.tiny else {name: SHAPES[name] for name in args.shapes}
    results: dict[str, Any] = {}
    for name, shape in shapes.items():
        measured = measure_swiglu(args.tokens, args.micro_batch, shape["intermediate_size"], dtype, device,
                                  args.warmup, args.repeats)
        calls = shape["num_layers"] + MTP_LAYERS.get(name, 0)
        results[name] = {"layers": shape["num_layers"], "mlps": calls, **measured,
                         "per_microbatch": per_microbatch(measured, calls)}
    emit({"benchmark": "swiglu", **environment(), "tokens": args.tokens, "micro_batch": args.micro_batch,
          "dtype": str(dtype).removeprefix("torch."), "warmup": args.warmup, "repeats": args.repeats,
          "shapes": results}, args.out)


if __name__ == "__main__":
    main()
