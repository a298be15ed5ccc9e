"""The gated DeltaNet layer alone: `fla`'s Triton kernels against the PyTorch path of `_compat.gated_delta_net`.

One GatedDeltaNet layer (megatron-core `ssm/gated_delta_net`) of Qwen3.5-2B's shape (`common.QWEN3_5_2B`: hidden
2048, 16 key and 16 value heads of 128, convolution width 4), built by megatron-bridge from a one-layer config-only
checkpoint with Megatron's random initialization, bf16 on the GPU; forward and backward (a fixed random gradient of
the output) over micro-batch x seq tokens, 2 x 2048 by default (the rows `bench/families.py` trains on), timed as
the median of `--repeats` synchronised calls after `--warmup` (fla's first calls compile and autotune its kernels):

- `fla`: the layer as megatron-core runs it where `fla` imports (`fla-core`, the `gdn` extra);
- `pytorch`: the same layer, weights and input under `gated_delta_net.torch_kernels` (the causal conv1d, the
  l2norm and the chunked delta rule in PyTorch: what a machine without fla runs).

Reported per path: time, TFLOP/s on Megatron-LM's count of the layer (`flops.attention_macs`: projections, the
convolution and the delta rule as four e_v x e_v products per value head and token; three passes), the peak memory
the calls added; `pytorch_over_fla` step time; and the largest difference between the paths of the output, the
input gradient and the input projection's weight gradient, each beside the PyTorch value's largest magnitude
(bf16: differences of a few 2^-8 of it are rounding). Without `fla` (no wheel installed, or no GPU: its kernels are
Triton) only the PyTorch path runs and `fla` says why. Where fla imports but refuses its backward on this machine
(`_compat.gated_delta_net.fla_unusable`: Triton 3.4.0-3.7.1 on Hopper without tilelang, the GPU machine's torch 2.11),
the forward alone is still compared (`forward_s` of both paths, `pytorch_over_fla_forward`, the output difference):
its kernels are the ones a Triton upgrade would enable. `--tiny`: the tiny Qwen3.5's first layer in fp32 (a CPU).
"""

from __future__ import annotations

import argparse
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    QWEN3_5_2B,
    TINY_SCRATCH_BYTES,
    emit,
    environment,
    fresh_memory,
    make_config_only_checkpoint,
    median_seconds,
    parse_with_tiny,
    scratch_dir,
    start_single_process,
)
from bench.flops import ModelShape, attention_macs

TINY = dict(micro_batch=2, seq=64, warmup=1, repeats=2, precision="fp32")
GIB = 1024**3


def fla_unavailable() -> str | None:
    """Why fla's kernels cannot run here (None: they can)."""
    from lightning_megatron._compat.gated_delta_net import fla_missing, fla_unusable

    if fla_missing():
        return ("fla is not importable: install the fla-core wheel (and einops) with pip, e.g. from the wheels "
                "bench/run_h200.sh installs when carried")
    if not torch.cuda.is_available():
        return "no CUDA device: fla's kernels are Triton"
    return fla_unusable()


def build_layer(checkpoint: Path, dtype: torch.dtype) -> torch.nn.Module:
    """Decoder layer 0's GatedDeltaNet of `checkpoint` (a config-only one), randomly initialised on the device."""
    from lightning_megatron.bridges import create_bridge
    from lightning_megatron.options import ModelOptions

    chunk = create_bridge("megatron-bridge", checkpoint).build(
        ModelOptions(mtp=False, random_weights=True, params_dtype=dtype))[0]
    return chunk.decoder.layers[0].self_attention


def measure_path(layer: torch.nn.Module, hidden: torch.Tensor, grad_output: torch.Tensor, warmup: int,
                 repeats: int, flops: float) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """One path's timing and peak memory, and its output, input gradient and input projection weight gradient."""

    def forward_backward() -> list[torch.Tensor]:
        layer.zero_grad(set_to_none=True)
        hidden.grad = None
        output, _ = layer(hidden, attention_mask=None)
        output.backward(grad_output)
        return [output.detach(), hidden.grad, layer.in_proj.weight.grad]

    for _ in range(warmup):
        forward_backward()
    fresh_memory()
    start = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    seconds = median_seconds(forward_backward, repeats)
    peak = (torch.cuda.max_memory_allocated() - start) / GIB if torch.cuda.is_available() else None
    values = [value.float().clone() for value in forward_backward()]
    return {"forward_backward_s": seconds, "tflop_per_s": flops / seconds / 1e12, "peak_memory_gib": peak}, values


def measure_forward(layer: torch.nn.Module, hidden: torch.Tensor, warmup: int, repeats: int,
                    flops: float) -> tuple[dict[str, Any], torch.Tensor]:
    """One path's forward alone (no autograd graph): its time, TFLOP/s on the forward's third of `flops`, output."""

    @torch.no_grad()
    def forward() -> torch.Tensor:
        return layer(hidden, attention_mask=None)[0]

    for _ in range(warmup):
        forward()
    seconds = median_seconds(forward, repeats)
    return {"forward_s": seconds, "forward_tflop_per_s": flops / 3 / seconds / 1e12}, forward().float().clone()


def compare_kernels(config: dict[str, Any], workdir: Path, *, tiny: bool, micro_batch: int, seq: int, warmup: int,
                    repeats: int, dtype: torch.dtype) -> dict[str, Any]:
    """fla's kernels against the PyTorch path on one GatedDeltaNet layer of `config`'s shape (module docstring)."""
    from lightning_megatron._compat import gated_delta_net

    checkpoint = make_config_only_checkpoint(
        workdir / "gdn_layer", {**config, "num_layers": 1, "layer_types": ["linear_attention"]}, tied=True,
        tiny=tiny, family="qwen3_5_text")
    shape = ModelShape.from_hf_checkpoint(checkpoint)
    layer = build_layer(checkpoint, dtype)
    device = next(layer.parameters()).device
    generator = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(seq, micro_batch, shape.hidden, generator=generator, device=device, dtype=dtype)
    grad_output = torch.randn(seq, micro_batch, shape.hidden, generator=generator, device=device, dtype=dtype)
    hidden.requires_grad_()
    flops = 2.0 * 3 * seq * micro_batch * attention_macs(shape, full=False)
    result: dict[str, Any] = {
        "layer": {"hidden": shape.hidden, **{key: getattr(shape.linear_attention, key) for key in
                                             ("key_heads", "value_heads", "key_head_dim", "value_head_dim",
                                              "conv_kernel")}},
        "micro_batch": micro_batch, "seq": seq, "dtype": str(dtype).removeprefix("torch."),
        "model_tflop_per_call": flops / 1e12, "warmup": warmup, "repeats": repeats,
    }
    with gated_delta_net.torch_kernels(layer):
        result["pytorch"], reference = measure_path(layer, hidden, grad_output, warmup, repeats, flops)
    skipped = fla_unavailable()
    if skipped is not None and not gated_delta_net.fla_missing() and torch.cuda.is_available():
        with gated_delta_net.torch_kernels(layer):
            forward, reference_output = measure_forward(layer, hidden, warmup, repeats, flops)
        result["pytorch"].update(forward)
        try:
            with gated_delta_net.fla_kernels(layer):
                result["fla"], fast_output = measure_forward(layer, hidden, warmup, repeats, flops)
        except Exception as error:  # the PyTorch figures stay; the table says why fla has none
            result["fla"] = {"skipped": f"{skipped}; its forward failed too: {error!r}"[:400]}
            return result
        result["fla"].update(version=metadata.version("fla-core"), backward_skipped=skipped)
        result["pytorch_over_fla_forward"] = result["pytorch"]["forward_s"] / result["fla"]["forward_s"]
        result["difference"] = {"output": {"max_abs": float((fast_output - reference_output).abs().max()),
                                           "pytorch_max_abs": float(reference_output.abs().max())}}
        return result
    if skipped is not None:
        result["fla"] = {"skipped": skipped}
        return result
    result["fla"], fast = measure_path(layer, hidden, grad_output, warmup, repeats, flops)
    result["fla"]["version"] = metadata.version("fla-core")
    result["pytorch_over_fla"] = result["pytorch"]["forward_backward_s"] / result["fla"]["forward_backward_s"]
    names = ("output", "input_grad", "in_proj_weight_grad")
    result["difference"] = {name: {"max_abs": float((fla_value - torch_value).abs().max()),
                                   "pytorch_max_abs": float(torch_value.abs().max())}
                            for name, fla_value, torch_value in zip(names, fast, reference, strict=True)}
    return result


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tiny Qwen3.5's layer, fp32, CPU-sized")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    return parse_with_tiny(parser, TINY)


def main() -> None:
    args = _parse_args()
    start_single_process(tiny=args.tiny)
    with scratch_dir("gdn_", TINY_SCRATCH_BYTES) as workdir:  # a config-only checkpoint
        result = compare_kernels(QWEN3_5_2B, workdir, tiny=args.tiny, micro_batch=args.micro_batch, seq=args.seq,
                                 warmup=args.warmup, repeats=args.repeats,
                                 dtype=torch.bfloat16 if args.precision == "bf16" else torch.float32)
    emit({"benchmark": "gdn", **environment(), **result}, args.out)


if __name__ == "__main__":
    main()
