"""RMSNorm forward + backward at the norm shapes of Qwen3-0.6B, 4B and 8B: torch's norm against the compiled one.

Issue 41's profile of a Qwen3-0.6B step (`bench/results/h200_2026-12-04/packing_profile.md`) found 16% of the GPU's
time in torch's RMSNorm kernels, most of it the weight gradient's reduction; `_compat/fast_rms_norm.py` replaces
them with `torch.compile`d functions. This measures both, so a GPU session can decide to keep it on by default.

Per model shape (`common.QWEN3_0_6B`, `QWEN3_4B`, `QWEN3_8B`) and per norm of a layer, over `--tokens` x
`--micro-batch` tokens (a packed row of 4096 by default), bf16, laid out as Megatron-Core hands them over: the
hidden state [s, b, hidden], the query heads [s, b, heads, 128] (a copy out of the fused QKV output) and the key
heads [s, b, kv heads, 128] (a strided view of it). Per arm, on the same input, weight and output gradient:

- `torch`: `torch.nn.RMSNorm`'s functional (`F.rms_norm`), what Megatron-Core builds without Transformer Engine;
- `compiled`: `fast_rms_norm.rms_norm` with the compiled kernels, what the adjustment runs on CUDA;
- `eager`: the same math uncompiled (`fast_rms_norm.EAGER`: what a call runs where it cannot compile);
- `aten_compiled_weight_grad`: torch's fused forward and input-gradient kernels (`aten::_fused_rms_norm`,
  `_fused_rms_norm_backward` with the weight's gradient masked off) and the compiled weight-gradient reduction:
  the alternative that keeps torch's kernels where they may be fast enough (skipped where the aten ops are absent).

Reported per arm: the forward + backward wall time per call (median of `--repeats` synchronised calls: the host's
share included), the GPU time per call (the summed durations of the kernels under torch.profiler over `--repeats`
calls; forward alone too) and the kernels run, and for the output, the input gradient and the weight gradient the
largest absolute difference to the float32 reference (the same bf16 values through `F.rms_norm` in float32) beside
that reference's largest magnitude. Per model: the norms' GPU time per microbatch, layers x (2 hidden + query + key)
+ the final norm (the MTP layer's few left out), torch's and compiled, their ratio and what a microbatch saves.
Without CUDA (`--tiny` on a CPU) the compiled arms are skipped with the reason and no GPU times are reported.
"""

from __future__ import annotations

import argparse
import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import QWEN3_0_6B, QWEN3_4B, QWEN3_8B, emit, environment, median_seconds, parse_with_tiny
from lightning_megatron._compat.fast_rms_norm import COMPILED, EAGER, rms_norm

EPS = 1e-6
SHAPES = {"qwen3_0.6b": QWEN3_0_6B, "qwen3_4b": QWEN3_4B, "qwen3_8b": QWEN3_8B}
TINY_SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
TINY = dict(tokens=32, warmup=1, repeats=2, precision="fp32")
ARMS = ("torch", "compiled", "eager", "aten_compiled_weight_grad")
RESULTS = ("output", "input_grad", "weight_grad")

Norm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class _AtenWithCompiledWeightGrad(torch.autograd.Function):
    """torch's fused RMSNorm kernels for the output and the input gradient, the compiled reduction for the weight's."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        output, rstd = torch.ops.aten._fused_rms_norm(rows, [rows.shape[-1]], weight, EPS)
        ctx.save_for_backward(rows, weight, rstd)
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, weight, rstd = ctx.saved_tensors
        grad = grad.contiguous()
        grad_rows, _ = torch.ops.aten._fused_rms_norm_backward(grad, rows, [rows.shape[-1]], rstd, weight,
                                                               [True, False])
        return grad_rows, COMPILED.weight_grad(grad, rows, rstd).to(weight.dtype)


def _aten_with_compiled_weight_grad(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _AtenWithCompiledWeightGrad.apply(x.reshape(-1, x.shape[-1]), weight).reshape(x.shape)


def arms() -> dict[str, Norm | str]:
    """Each arm's norm, or why it cannot run here."""
    on_cuda = torch.cuda.is_available()
    without_cuda = "needs CUDA: the adjustment compiles the norms on CUDA only"
    return {
        "torch": lambda x, weight: F.rms_norm(x, (x.shape[-1],), weight, EPS),
        "compiled": (lambda x, weight: rms_norm(x, weight, EPS)) if on_cuda else without_cuda,
        "eager": lambda x, weight: rms_norm(x, weight, EPS, kernels=EAGER),
        "aten_compiled_weight_grad": (without_cuda if not on_cuda
                                      else _aten_with_compiled_weight_grad
                                      if hasattr(torch.ops.aten, "_fused_rms_norm_backward")
                                      else "this torch has no aten::_fused_rms_norm_backward"),
    }


def layer_inputs(shape: dict[str, Any], tokens: int, micro_batch: int, dtype: torch.dtype,
                 device: torch.device) -> dict[str, torch.Tensor]:
    """A layer's norm inputs as Megatron-Core's attention makes them (attention.py `get_query_key_value_tensors`):
    the hidden state, and the query and key heads split out of the fused QKV projection's output."""
    generator = torch.Generator().manual_seed(0)
    heads, groups, head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    per_group = heads // groups
    mixed = torch.randn(tokens, micro_batch, groups, (per_group + 2) * head_dim, generator=generator)
    query, key, _ = torch.split(mixed.to(device, dtype), [per_group * head_dim, head_dim, head_dim], dim=3)
    hidden = torch.randn(tokens, micro_batch, shape["hidden_size"], generator=generator).to(device, dtype)
    return {"hidden": hidden, "query": query.reshape(tokens, micro_batch, heads, head_dim), "key": key}


def _forward_backward(norm: Norm, x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    weight.grad = None
    output = norm(x, weight)
    output.backward(grad)
    return [output.detach(), x.grad, weight.grad]


def gpu_microseconds(action: Callable[[], Any], repeats: int) -> tuple[float | None, dict[str, int]]:
    """The summed durations of the kernels `action` runs, per call, over `repeats` calls under torch.profiler, and
    the kernels (name: count per call); (None, {}) without CUDA."""
    if not torch.cuda.is_available():
        return None, {}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            action()
        torch.cuda.synchronize()
    kernels = [event for event in prof.events() if event.device_type == DeviceType.CUDA
               and not event.is_user_annotation]
    names = Counter(event.name[:100] for event in kernels)
    return (sum(event.time_range.elapsed_us() for event in kernels) / repeats,
            {name: count // repeats for name, count in names.most_common(8)})


def measure_arm(step: Callable[[], list[torch.Tensor]], forward: Callable[[], Any],
                reference: dict[str, torch.Tensor], warmup: int, repeats: int) -> dict[str, Any]:
    """One arm of a kernel comparison (here and `rope.py`): `step` (forward + backward, returning the results named
    as in `reference`, its float32 values) and `forward` warmed up (the first calls compile and autotune the
    compiled arms' kernels), then their wall and GPU times per call, the kernels run, and each result's largest
    difference to the reference beside the reference's largest magnitude."""
    for _ in range(warmup):
        step()
        forward()
    gpu_us, kernels = gpu_microseconds(step, repeats)
    forward_gpu_us, _ = gpu_microseconds(forward, repeats)
    values = step()
    return {
        "forward_backward_wall_us": median_seconds(step, repeats) * 1e6,
        "forward_backward_gpu_us": gpu_us, "forward_gpu_us": forward_gpu_us, "kernels": kernels,
        "max_abs_diff": {key: float((value.float() - expected).abs().max())
                         for (key, expected), value in zip(reference.items(), values, strict=True)},
        "reference_max_abs": {key: float(expected.abs().max()) for key, expected in reference.items()},
    }


def measure_arms(arms: dict[str, Any], forward_backward: Callable[[Any], list[torch.Tensor]],
                 forward: Callable[[Any], Any], reference: dict[str, torch.Tensor], warmup: int,
                 repeats: int) -> dict[str, Any]:
    """Every arm of a kernel comparison (here, `rope.py`, `cross_entropy.py`) through `measure_arm`: each arm's
    function (or why it cannot run here) handed to `forward_backward` and `forward`."""
    measured: dict[str, Any] = {}
    for name, arm in arms.items():
        if isinstance(arm, str):
            measured[name] = {"skipped": arm}
            continue
        measured[name] = measure_arm(functools.partial(forward_backward, arm), functools.partial(forward, arm),
                                     reference, warmup, repeats)
    return measured


def over_upstream(calls: Any, totals: dict[str, float]) -> dict[str, Any]:
    """A comparison's GPU time a microbatch spends per arm (`totals`, ms), and where both ran the compiled arm over
    upstream's (`rope.py`, `cross_entropy.py`)."""
    summary: dict[str, Any] = {"calls": calls, "gpu_ms": totals}
    if "upstream" in totals and "compiled" in totals:
        summary["compiled_over_upstream"] = totals["compiled"] / totals["upstream"]
        summary["compiled_saves_ms"] = totals["upstream"] - totals["compiled"]
    return summary


def measure_norm(x: torch.Tensor, warmup: int, repeats: int) -> dict[str, Any]:
    """Every arm on `x`'s norm: times, kernels, and each result's largest difference to the float32 reference."""
    generator = torch.Generator().manual_seed(1)
    width = x.shape[-1]
    weight = (1 + 0.1 * torch.randn(width, generator=generator)).to(x.device, x.dtype).requires_grad_()
    grad = torch.randn(x.shape, generator=generator).to(x.device, x.dtype)
    reference_weight = weight.detach().float().requires_grad_()
    reference = [value.float() for value in _forward_backward(
        lambda rows, scale: F.rms_norm(rows, (width,), scale, EPS), x.float(), reference_weight, grad.float())]
    result: dict[str, Any] = {"shape": list(x.shape), "rows": x.numel() // width, "width": width,
                              "contiguous": x.is_contiguous()}

    @torch.no_grad()
    def forward(norm: Norm) -> torch.Tensor:
        return norm(x, weight)

    result["arms"] = measure_arms(arms(), lambda norm: _forward_backward(norm, x, weight, grad), forward,
                                  dict(zip(RESULTS, reference, strict=True)), warmup, repeats)
    return result


def per_microbatch(norms: dict[str, dict[str, Any]], layers: int) -> dict[str, Any]:
    """The norms' GPU time a microbatch spends: each layer's hidden norms (input, post-attention), query and key
    norms, and the final norm; per arm with GPU times, and compiled over torch."""
    calls = {"hidden": 2 * layers + 1, "query": layers, "key": layers}
    totals = {}
    for arm in ARMS:
        times = [norms[norm]["arms"][arm].get("forward_backward_gpu_us") for norm in calls]
        if all(time is not None for time in times):
            totals[arm] = sum(count * time for count, time in zip(calls.values(), times)) / 1e3
    summary: dict[str, Any] = {"calls": calls, "gpu_ms": totals}
    if "torch" in totals and "compiled" in totals:
        summary["compiled_over_torch"] = totals["compiled"] / totals["torch"]
        summary["compiled_saves_ms"] = totals["torch"] - totals["compiled"]
    return summary


def parse_comparison_args(description: str,
                          shapes: list[str]) -> tuple[argparse.Namespace, torch.device, torch.dtype]:
    """A kernel comparison's command line (here and `rope.py`): the model shapes, the row, the repeats, the
    precision, `--tiny` (a tiny shape in fp32, one CPU thread); and the device and dtype it runs on."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny shape in fp32, CPU-sized")
    parser.add_argument("--shapes", nargs="+", choices=shapes, default=shapes)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of a row (the sequence dimension)")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    args = parse_with_tiny(parser, TINY)
    if args.tiny:
        torch.set_num_threads(1)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return args, device, torch.bfloat16 if args.precision == "bf16" else torch.float32


def main() -> None:
    args, device, dtype = parse_comparison_args(__doc__, list(SHAPES))
    shapes = {"tiny": TINY_SHAPE} if args.tiny else {name: SHAPES[name] for name in args.shapes}
    results: dict[str, Any] = {}
    for name, shape in shapes.items():
        norms = {norm: measure_norm(x, args.warmup, args.repeats)
                 for norm, x in layer_inputs(shape, args.tokens, args.micro_batch, dtype, device).items()}
        results[name] = {"layers": shape["num_layers"], "norms": norms,
                         "per_microbatch": per_microbatch(norms, shape["num_layers"])}
    emit({"benchmark": "norms", **environment(), "tokens": args.tokens, "micro_batch": args.micro_batch,
          "dtype": str(dtype).removeprefix("torch."), "eps": EPS, "warmup": args.warmup, "repeats": args.repeats,
          "shapes": results}, args.out)


if __name__ == "__main__":
    main()
