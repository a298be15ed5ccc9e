"""Megatron-Core's unfused RoPE without Transformer Engine, forward and backward from one kernel each that Inductor
generates.

Without TE's fused RoPE, `apply_rotary_pos_emb` (`models/common/embeddings/rope_utils.py:271`) applies
`_apply_rotary_pos_emb_bshd` (`:92-137`) to the queries and the keys of every layer and MTP layer, and
`packed_rope.py` sends packed rows there too. Each call runs about ten small kernels forward (cos, sin, the `mscale`
multiplies and casts, `_rotate_half`'s chunk, neg and cat, two multiplies, the add, the final cat with the empty
pass-through part) and as many backward. On an H100 profile of a Qwen3-0.6B step (rows of 4096, 14 microbatches, 28
layers) its `CatArrayBatchedCopy` (1568 calls, 42 ms) and the bf16 multiply/add kernels (~100 ms, RoPE's among
others) were among the top kernels of a 1.2 s step.

The adjustment puts `apply_rotary_pos_emb_bshd` in the module's place (callers look it up there at call time:
`apply_rotary_pos_emb` `:330`, upstream's THD path `:244`, `packed_rope.apply_rotary_pos_emb_thd`). On a CUDA tensor
in the usual layout (t [s, b, heads, dim] or packed [t, 1, heads, dim], float32 freqs [s, 1, 1, rot_dim] without a
gradient, no interleaving) it is `RotaryFunction`: the forward `t * cos + rotate_half(t) * sin` and the gradient
`g * cos + rotate_half^T(g * sin)` (`rotate_half^T(u) = cat(u2, -u1)`) are each a `torch.compile`d function of plain
torch ops, cos and sin computed inside from the float32 freqs, the pass-through part (partial rotary: rot_dim < dim)
copied as it is, which Inductor turns into one pointwise kernel each (the pass-through part's copy may be a second;
on the CPU backend with Triton's scheduling it is). `compiled.py` makes a compiled copy per [b, heads, dim], so the
queries and keys have one each, the rows dynamic; a call first met inside a CUDA graph capture runs the same math
eagerly; a compile that fails is logged once, and every call then runs upstream's code. Each kernel computes cos and
sin of its features' angles itself (once per head, not read from a table): it reads t and freqs and writes its
result, where upstream's kernels move about six times as many bytes. The kernels compute in float32 and round once;
upstream rounds cos and sin, both products and their sum to the tensor's dtype, so in bf16 the results differ by a
few bf16 roundings (`tests/_compat/test_fast_rope.py` bounds them); in float32 the eager math is upstream's, bit for
bit. Only freqs is kept for the backward, as upstream keeps its cos and sin.

Everything else runs upstream's function: interleaved rotary (`rotary_interleaved`, DeepSeek's
`mla_rotary_interleaved`), the deprecated `multi_latent_attention`, CPU tensors, dtypes other than bf16, fp16 and
fp32, freqs with a gradient or of another shape (mRoPE's and Qwen3-VL's per-row [s, b, 1, dim] with b > 1), a tensor
`mscale`. Modules that imported `_apply_rotary_pos_emb_bshd` by name while the adjustment was applied
(megatron-bridge's Qwen3-VL, Ernie-VL and Exaone RoPE) keep this function; after a revert it runs upstream's code
there too (`STATE`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_megatron._compat import compiled
from lightning_megatron._compat._adjustment import Adjustment, Patches
from lightning_megatron._compat.compiled import State, triton_available
from lightning_megatron._compat.no_te import no_transformer_engine

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

STATE = State("RoPE: torch.compile failed (%s); RoPE runs Megatron-Core's unfused code from now on",
              logging.getLogger(__name__))
"""Whether the replacement takes the compiled path: the adjustment is applied and nothing refused it."""


# the math: what the compiled kernels are made from, and what runs where they cannot --------------------------------


def _cos_sin(freqs: torch.Tensor, mscale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cos(freqs) * mscale, torch.sin(freqs) * mscale


def _with_rest(rotated: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The rotated halves cast to x's dtype, then x's features past them (partial rotary) as they are: no empty
    part for a full rotary, whose kernel then writes the two halves alone."""
    parts = [part.to(x.dtype) for part in rotated]
    rot_dim = 2 * rotated[0].shape[-1]
    if rot_dim < x.shape[-1]:
        parts.append(x[..., rot_dim:])
    return torch.cat(parts, dim=-1)


def rope_forward(t: torch.Tensor, freqs: torch.Tensor, mscale: float) -> torch.Tensor:
    """`t`'s first rot_dim = freqs.shape[-1] features rotated, `t * cos + rotate_half(t) * sin` with
    `rotate_half(x) = cat(-x2, x1)` (halves of rot_dim), in float32 and cast to t's dtype; the rest as it is."""
    half = freqs.shape[-1] // 2
    cos, sin = _cos_sin(freqs, mscale)
    first, second = t[..., :half].float(), t[..., half:2 * half].float()
    return _with_rest((first * cos[..., :half] - second * sin[..., :half],
                       second * cos[..., half:] + first * sin[..., half:]), t)


def rope_backward(grad: torch.Tensor, freqs: torch.Tensor, mscale: float) -> torch.Tensor:
    """The loss's gradient by `t` from its gradient by `rope_forward`'s output: `g * cos + rotate_half^T(g * sin)`
    with `rotate_half^T(u) = cat(u2, -u1)`, in float32 and cast to the gradient's dtype; the pass-through part's as
    it is."""
    half = freqs.shape[-1] // 2
    cos, sin = _cos_sin(freqs, mscale)
    first, second = grad[..., :half].float(), grad[..., half:2 * half].float()
    return _with_rest((first * cos[..., :half] + second * sin[..., half:],
                       second * cos[..., half:] - first * sin[..., :half]), grad)


# the compiled kernels ---------------------------------------------------------------------------------------------


class CompiledKernel(compiled.CompiledKernel):
    """One of the functions above through `torch.compile` (`compiled.CompiledKernel`), one compiled copy per
    [b, heads, dim]; a failed compile sends every call back to upstream's code (`STATE`)."""

    state = STATE


@dataclass(frozen=True)
class Kernels:
    forward: Callable[..., torch.Tensor] = rope_forward
    backward: Callable[..., torch.Tensor] = rope_backward


EAGER = Kernels()
COMPILED = Kernels(CompiledKernel(rope_forward), CompiledKernel(rope_backward))


class RotaryFunction(torch.autograd.Function):
    """RoPE of `t` by `freqs` with `kernels`' forward and gradient: autograd stays here, so the kernels are plain
    functions (one compiled graph whether or not t needs a gradient); freqs takes none (callers check)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, freqs: torch.Tensor, mscale: float, kernels: Kernels) -> torch.Tensor:
        ctx.save_for_backward(freqs)
        ctx.mscale, ctx.kernels = mscale, kernels
        return kernels.forward(t, freqs, mscale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (freqs,) = ctx.saved_tensors
        return ctx.kernels.backward(grad.contiguous(), freqs, ctx.mscale), None, None, None


def rope(t: torch.Tensor, freqs: torch.Tensor, mscale: float = 1.0, kernels: Kernels = COMPILED) -> torch.Tensor:
    """Non-interleaved RoPE of `t` [s, b, heads, dim] by `freqs` [s, 1, 1, rot_dim] (no gradient) through
    `RotaryFunction` (`kernels`: the compiled ones by default, `EAGER` for the same math without compiling)."""
    return RotaryFunction.apply(t, freqs, float(mscale), kernels)


def takes_compiled_path(t: torch.Tensor, freqs: torch.Tensor, mscale: Any) -> bool:
    """Whether `rope` computes what upstream's `_apply_rotary_pos_emb_bshd` does for these arguments (without
    interleaving) on CUDA: freqs broadcast over the batch and heads, no gradient by freqs, a plain number `mscale`."""
    return (STATE.compiles and t.is_cuda and t.dtype in _DTYPES and t.dim() == 4 and t.numel() > 0
            and isinstance(mscale, (int, float)) and freqs.device == t.device and freqs.dtype == torch.float32
            and not freqs.requires_grad and freqs.dim() == 4 and freqs.shape[0] == t.shape[0]
            and freqs.shape[1] == freqs.shape[2] == 1 and freqs.shape[3] % 2 == 0 and 0 < freqs.shape[3] <= t.shape[3])


# the adjustment ---------------------------------------------------------------------------------------------------


OPT_IN = "LIGHTNING_MEGATRON_FAST_ROPE"
"""On by default (unset or 1); 0 keeps Megatron-Core's unfused RoPE. On an H200, forward + backward took 2.7-2.9x less
GPU time than upstream's at the Qwen3-0.6B/8B query and key shapes (`bench/results/h200_2026-12-06/rope.json`)."""


def opted_in() -> bool:
    """`LIGHTNING_MEGATRON_FAST_ROPE`: unset or 1 applies the adjustment (where its condition holds), 0 leaves
    Megatron-Core's unfused RoPE, anything else is refused (`compiled.switched_on`)."""
    return compiled.switched_on(OPT_IN, "Megatron-Core's unfused RoPE",
                                "RoPE from compiled kernels on a GPU without Transformer Engine")


def _rotates_half_unfused() -> bool:
    from megatron.core.models.common.embeddings import rope_utils

    return "t = (t * cos_) + (_rotate_half(t, rotary_interleaved) * sin_)" in inspect.getsource(
        rope_utils._apply_rotary_pos_emb_bshd)


def _unfused_rope_is_slow_here() -> bool:
    return (opted_in() and torch.cuda.is_available() and no_transformer_engine() and triton_available()
            and _rotates_half_unfused())


def _install_fast_rope(patches: Patches) -> None:
    from megatron.core.models.common.embeddings import rope_utils

    upstream = rope_utils._apply_rotary_pos_emb_bshd

    def apply_rotary_pos_emb_bshd(t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False,
                                  mla_rotary_interleaved: bool = False, mscale: float = 1.0,
                                  multi_latent_attention: bool | None = None) -> torch.Tensor:
        """Upstream's `_apply_rotary_pos_emb_bshd` (same arguments and result, to the dtype's rounding), through
        the compiled kernels where `takes_compiled_path`."""
        if (not rotary_interleaved and not mla_rotary_interleaved and multi_latent_attention is None
                and takes_compiled_path(t, freqs, mscale)):
            return rope(t, freqs, mscale)
        return upstream(t, freqs, rotary_interleaved=rotary_interleaved, mla_rotary_interleaved=mla_rotary_interleaved,
                        mscale=mscale, multi_latent_attention=multi_latent_attention)

    patches.setattr(rope_utils, "_apply_rotary_pos_emb_bshd", apply_rotary_pos_emb_bshd)
    STATE.active = True
    patches.on_revert(STATE.deactivate)


ADJUSTMENTS = (
    Adjustment(
        "megatron_core.fast_rope",
        "megatron/core/models/common/embeddings/rope_utils.py:92-137 _apply_rotary_pos_emb_bshd (no TE fused RoPE) "
        "runs about ten small kernels per call forward and as many backward, for the queries and keys of every layer",
        _unfused_rope_is_slow_here,
        _install_fast_rope,
    ),
)
