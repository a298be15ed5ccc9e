"""Megatron-Core's RMSNorms without Transformer Engine, forward and backward from kernels Inductor generates.

Without TE, megatron-core's local spec builds every RMSNorm through `WrappedTorchNorm` as a `torch.nn.RMSNorm`
(megatron/core/transformer/torch_norm.py:63,69). On CUDA its backward reduces the weight gradient with
`GammaBetaBackwardCUDAKernelTemplate` (torch's aten/src/ATen/native/cuda/layer_norm_kernel.cu), slow where rows
are many and short, as Qwen3's per-head q/k norms are (tokens x heads rows of head_dim 128). One H200 step of
Qwen3-0.6B joint SFT + MTP (rows of 4096, bf16, torch 2.11; `bench/results/h200_2026-12-04/packing_profile.md`)
spent 114 ms of its 1.14 s of GPU work in that kernel over 1582 calls (14 microbatches x (28 layers x 4 norms + the
final one)), 36 ms in the input gradient's and 30 ms in the forward's: 16% of the GPU's time, as much as the largest
GEMMs. TE's `TENorm` has fused kernels for all three; torch 2.14 has them too where `nvidia-cutlass-dsl` is installed
(its CuTe-DSL override of `aten::_fused_rms_norm_backward`), and there this adjustment steps aside.

The adjustment keeps every norm a `torch.nn.RMSNorm` (or `gated_delta_net.ZeroCenteredRMSNorm`, Qwen3.5's `1 +
weight` norm): `WrappedTorchNorm` builds it as before, then its class becomes a subclass that changes `forward` only
(`FastRMSNorm`, `FastZeroCenteredRMSNorm`), so parameters, names, state dicts, sequence-parallel marks, checkpoints
and the bridges' mappings are untouched. On a CUDA tensor that forward is `RMSNormFunction` over the rows flattened to
[M, N] (a view where the layout allows, e.g. the key heads' strided slice of the fused QKV output, so nothing more is
kept for the backward than torch's norm keeps): the forward, the input gradient and the weight gradient are each a
`torch.compile`d function of plain torch ops, written as torch's own decomposition of its fused RMSNorm computes them
(torch/_decomp/decompositions.py: float32 inside, cast back), which Inductor turns into fused Triton kernels (a row
reduction forward, one for the input gradient, a reduction over the rows split across blocks for the weight
gradient). The compiled functions take no part in autograd (the Function holds it), so grad mode, frozen weights and
inputs without gradients make no new graphs; the rows are marked dynamic and `dynamic=False` keeps the width static,
so each function compiles once per width, dtype and row stride, whatever the sequence length, micro-batch or
validation shape, and each width has a compiled copy of its own (dynamo's recompile limit, 8 graphs per function,
then never counts the widths of all the models one process trains; `compiled.py`, shared with `fast_rope.py`).

Why all three kernels, rather than torch's fused forward and input gradient with only the weight's reduction replaced
(`aten::_fused_rms_norm_backward` with the weight's output masked off): in that profile those two took 19 and 23 us
a call where their memory traffic (about 20 and 30 MB a call on average) needs 5-8 us at the H200's ~4 TB/s, against
the weight gradient's 72 us for 20 MB; Qwen3.5's `1 + weight` scale cannot go through torch's kernels without being
rounded to bf16 first; and one path serves both norms. Unmeasured: `bench/norms.py` times this path, torch's, and
that alternative (`aten_compiled_weight_grad`) at the real shapes, for the GPU session to choose.

Compiling happens at a width's first call, in the first training step: before any CUDA graph capture, since the
whole-iteration graph's eager warm-up step and the frozen trunk's eager warm-up calls come first. A call inside a
capture whose signature has not run compiled yet takes the eager functions (a compile cannot run inside a capture).
A compile that fails (no Triton, no C compiler for Triton's launcher) is logged once, and every norm then runs
torch's kernels. The CPU, and any tensor off CUDA, keeps torch's norm.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_megatron._compat import compiled
from lightning_megatron._compat._adjustment import Adjustment, Patches
from lightning_megatron._compat.compiled import State, triton_available
from lightning_megatron._compat.gated_delta_net import ZeroCenteredRMSNorm
from lightning_megatron._compat.no_te import no_transformer_engine

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

STATE = State("RMSNorm: torch.compile failed (%s); the norms run torch's kernels from now on",
              logging.getLogger(__name__))
"""Whether the swapped classes take the compiled path: the adjustment is applied and nothing refused it."""


# the math: what the compiled kernels are made from, and what runs where they cannot --------------------------------


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float,
                     offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `x` [M, N] normalised and scaled by `weight + offset`, in float32 and cast to x's dtype, as torch's
    RMSNorm (offset 0) and `ZeroCenteredRMSNorm` (offset 1) compute them; and each row's 1/rms [M, 1] (float32)."""
    hidden = x.float()
    rstd = torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return (hidden * rstd * (weight.float() + offset)).to(x.dtype), rstd


def rms_norm_input_grad(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                        offset: float) -> torch.Tensor:
    """The loss's gradient by the rows `x` from its gradient by the output: torch's decomposition of
    `_fused_rms_norm_backward`, in float32, cast to x's dtype."""
    normed = x.float() * rstd
    grad_normed = grad.float() * (weight.float() + offset)
    total = (normed * grad_normed).sum(-1, keepdim=True)
    return ((grad_normed - normed / x.shape[-1] * total) * rstd).to(x.dtype)


def rms_norm_weight_grad(grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """The loss's gradient by the weight [N] (float32): the output's gradient times the normalised rows, summed
    over the rows (the same for `weight + offset`)."""
    return (grad.float() * (x.float() * rstd)).sum(0)


# the compiled kernels ---------------------------------------------------------------------------------------------


class CompiledKernel(compiled.CompiledKernel):
    """One of the functions above through `torch.compile` (`compiled.CompiledKernel`), one compiled copy per width;
    a failed compile sends every norm back to torch's kernels (`STATE`)."""

    state = STATE


@dataclass(frozen=True)
class Kernels:
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]] = rms_norm_forward
    input_grad: Callable[..., torch.Tensor] = rms_norm_input_grad
    weight_grad: Callable[..., torch.Tensor] = rms_norm_weight_grad


EAGER = Kernels()
COMPILED = Kernels(CompiledKernel(rms_norm_forward), CompiledKernel(rms_norm_input_grad),
                   CompiledKernel(rms_norm_weight_grad))


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm of rows [M, N] by `weight + offset` with `kernels`' forward and gradients: autograd stays here, so the
    kernels are plain functions (one compiled graph whatever needs a gradient); the weight's gradient is made only
    when the weight trains (LoRA and MTP-only freeze the norms)."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                kernels: Kernels) -> torch.Tensor:
        output, rstd = kernels.forward(rows, weight, eps, offset)
        ctx.save_for_backward(rows, weight, rstd)
        ctx.offset, ctx.kernels = offset, kernels
        return output

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, weight, rstd = ctx.saved_tensors
        grad = grad.contiguous()
        wants_rows, wants_weight = ctx.needs_input_grad[:2]
        grad_rows = ctx.kernels.input_grad(grad, rows, weight, rstd, ctx.offset) if wants_rows else None
        grad_weight = ctx.kernels.weight_grad(grad, rows, rstd).to(weight.dtype) if wants_weight else None
        return grad_rows, grad_weight, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
             kernels: Kernels = COMPILED) -> torch.Tensor:
    """RMSNorm of `x` over its last dimension by `weight + offset` through `RMSNormFunction` (`kernels`: the
    compiled ones by default, `EAGER` for the same math without compiling)."""
    rows = x.reshape(-1, x.shape[-1])  # a view where the strides allow one
    return RMSNormFunction.apply(rows, weight, eps, offset, kernels).reshape(x.shape)


# the modules ------------------------------------------------------------------------------------------------------


class _CompiledForward:
    """The forward of an RMSNorm through `rms_norm` on CUDA while the adjustment is active; torch's otherwise."""

    offset = 0.0
    normalized_shape: tuple[int, ...]
    weight: torch.nn.Parameter | None
    eps: float | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._takes_compiled_path(x):
            return rms_norm(x, self.weight, self.eps, self.offset)
        return super().forward(x)  # type: ignore[misc]

    def _takes_compiled_path(self, x: torch.Tensor) -> bool:
        return (STATE.compiles and x.is_cuda and x.dtype in _DTYPES and x.numel() > 0
                and self.weight is not None and self.eps is not None and len(self.normalized_shape) == 1
                and self.weight.device == x.device)


class FastRMSNorm(_CompiledForward, torch.nn.RMSNorm):
    """`torch.nn.RMSNorm` whose CUDA forward and backward are Inductor's kernels (module docstring)."""


class FastZeroCenteredRMSNorm(_CompiledForward, ZeroCenteredRMSNorm):
    """`ZeroCenteredRMSNorm` (scale `1 + weight`) whose CUDA forward and backward are Inductor's kernels."""

    offset = 1.0


FAST_CLASSES: dict[type, type] = {torch.nn.RMSNorm: FastRMSNorm, ZeroCenteredRMSNorm: FastZeroCenteredRMSNorm}


# the adjustment ---------------------------------------------------------------------------------------------------


def torch_rms_norm_has_fused_dsl_kernels() -> bool:
    """Whether torch itself routes its fused RMSNorm backward to CuTe-DSL kernels (torch 2.14's `torch._native`,
    where `nvidia-cutlass-dsl` and `apache-tvm-ffi` are installed): upstream's fix of the slow weight gradient."""
    try:
        from torch._native import registry
        return "_fused_rms_norm_backward" in registry.get_dsl_operations("cutedsl")
    except (ImportError, AttributeError):
        return False


OPT_IN = "LIGHTNING_MEGATRON_FAST_RMS_NORM"
"""On by default (unset or 1); 0 keeps torch's norms. On the H200 (2026-12-05, torch 2.11) `bench/norms.py` measured
the compiled norms at 0.27x torch's time per microbatch at Qwen3-0.6B's shapes and 0.56x at 4B / 8B, and every GPU
test of this file passed (`bench/results/h200_2026-12-05c/`: bf16 equality at those shapes, a norm first met inside
a capture, tiny fits through both kinds of CUDA graph training as with torch's norms)."""


def opted_in() -> bool:
    """`LIGHTNING_MEGATRON_FAST_RMS_NORM`: unset or 1 applies the adjustment (where its condition holds), 0 leaves
    torch's norms, anything else is refused (`compiled.switched_on`)."""
    return compiled.switched_on(OPT_IN, "torch's norms",
                                "RMSNorms from compiled kernels on a GPU without Transformer Engine")


def _torch_rms_norm_is_slow_here() -> bool:
    return (opted_in() and torch.cuda.is_available() and no_transformer_engine()
            and triton_available() and not torch_rms_norm_has_fused_dsl_kernels())


def _install_fast_rms_norm(patches: Patches) -> None:
    """The norm `WrappedTorchNorm` builds (with whatever else is adjusted: sequence-parallel marks, the zero-centred
    norm), its class swapped for the one with the compiled forward; instances made before a revert go back to torch's
    forward with it (`STATE.active`)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    previous_new = WrappedTorchNorm.__new__

    def new(cls: type, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> Any:
        norm = previous_new(cls, config, hidden_size, *args, **kwargs)
        fast = FAST_CLASSES.get(type(norm))
        if fast is not None:
            norm.__class__ = fast
        return norm

    patches.setattr(WrappedTorchNorm, "__new__", staticmethod(new))
    STATE.active = True
    patches.on_revert(STATE.deactivate)


ADJUSTMENTS = (
    Adjustment(
        "megatron_core.fast_rms_norm",
        "megatron/core/transformer/torch_norm.py:63,69 builds torch.nn.RMSNorm (no Apex/TE), whose CUDA backward "
        "reduces the weight gradient with GammaBetaBackwardCUDAKernelTemplate (torch's "
        "aten/src/ATen/native/cuda/layer_norm_kernel.cu): 10% of a Qwen3-0.6B step's GPU time on an H200",
        _torch_rms_norm_is_slow_here,
        _install_fast_rms_norm,
    ),
)
