"""Megatron-Core 0.19's unfused RoPE for packed (THD) rows: one Python step per sequence, and host syncs.

Without Transformer Engine's fused THD kernel, `apply_rotary_pos_emb` (`models/common/embeddings/rope_utils.py:338`)
calls `_apply_rotary_pos_emb_thd` (`:189`), which reads `cu_seqlens` on the host (`.tolist()` `:222`, `.item()`
`:224`, and `.item()` per sequence `:239`: a device sync each) and then applies RoPE one sequence at a time (`:256`,
about ten kernels per sequence), for the queries and the keys of every layer and of the MTP layers. A packed row of
many short sequences thus runs far below a full row, although the attention itself is as fast.

The replacement computes, with tensor ops on the device, each token's index into `freqs` (its position in its
sequence, in Megatron's load-balanced context-parallel layout when CP > 1: rank `r` holds chunks `r` and
`2 * cp - 1 - r` of each sequence; plus its sequence's `cu_seqlens` offset when `freqs` covers the whole packed
batch), gathers `freqs` once and applies upstream's `_apply_rotary_pos_emb_bshd` once to the whole row. Every
element goes through the same elementwise math as upstream, so the result is bit-identical; nothing is read back to
the host. The gathered `freqs` are the same for the queries and keys of every layer of a microbatch (the same
`cu_seqlens` and `freqs` tensors), so the last gather is kept and reused while both are unchanged: the dozen small
index kernels then run once per microbatch instead of twice per layer (on the H200 profile they were most of the
extra kernel launches of a packed row over a full row). `cu_seqlens` must describe the row as upstream requires (local lengths summing to the row, each even when
CP > 1); `lightning_megatron.microbatch.check_microbatch` refuses other microbatches before the first step.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch

from lightning_megatron._compat._adjustment import Adjustment, Patches


def _loops_over_sequences_without_fused_kernel() -> bool:
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils.fused_apply_rotary_pos_emb_thd is None and \
        "for x in sequence_splits" in inspect.getsource(rope_utils._apply_rotary_pos_emb_thd)


def _thd_freqs_index(cu_seqlens: torch.Tensor, tokens: int, freqs_length: int, cp_size: int, cp_rank: int
                     ) -> torch.Tensor:
    """Index into `freqs` (dim 0) of each of this CP rank's `tokens` packed tokens, as upstream's
    `_get_thd_freqs_on_this_cp_rank` slices it per sequence; `cu_seqlens` are the whole row's boundaries."""
    cu_seqlens = cu_seqlens.long()
    local_lengths = (cu_seqlens[1:] - cu_seqlens[:-1]) // cp_size
    local_ends = local_lengths.cumsum(0)
    token = torch.arange(tokens, device=cu_seqlens.device)
    sequence = torch.searchsorted(local_ends, token, right=True)
    length = local_lengths[sequence]
    in_sequence = token - (local_ends[sequence] - length)
    if cp_size > 1:
        chunk = length // 2
        second_chunk = in_sequence >= chunk
        # chunk cp_rank, then chunk 2 * cp_size - 1 - cp_rank, which starts at cp_size * length - (cp_rank + 1) * chunk
        # and holds this rank's tokens from in_sequence = chunk on
        in_sequence = torch.where(second_chunk, cp_size * length - (cp_rank + 2) * chunk + in_sequence,
                                  cp_rank * chunk + in_sequence)
    # freqs of the whole packed batch (upstream's `has_packed_freqs`): each sequence starts at its cu_seqlens offset
    covers_batch = cu_seqlens[-1] == freqs_length
    return in_sequence + cu_seqlens[:-1][sequence] * covers_batch


_last_gather: tuple | None = None  # (cu_seqlens, its version, freqs, its version, tokens, cp, gathered freqs)


def _gathered_freqs(cu_seqlens: torch.Tensor, freqs: torch.Tensor, tokens: int, cp_size: int, cp_rank: int
                    ) -> torch.Tensor:
    """`freqs` of each of this rank's `tokens` packed tokens; the last result again for the same (unchanged)
    `cu_seqlens` and `freqs` tensors."""
    global _last_gather
    key = (cu_seqlens, cu_seqlens._version, freqs, freqs._version, tokens, cp_size, cp_rank)
    if _last_gather is not None and len(_last_gather) == len(key) + 1 and all(
            a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(_last_gather, key)):
        return _last_gather[-1]
    index = _thd_freqs_index(cu_seqlens, tokens, freqs.size(0), cp_size, cp_rank)
    gathered = freqs.index_select(0, index.to(freqs.device))
    _last_gather = (*key, gathered)
    return gathered


def forget_last_gather() -> None:
    """Drop the kept gather (a CUDA graph capture makes its own, in the graph's memory)."""
    global _last_gather
    _last_gather = None


def apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor,
                             rotary_interleaved: bool = False, mla_rotary_interleaved: bool = False,
                             mscale: float = 1.0, cp_group: Any = None,
                             multi_latent_attention: bool | None = None) -> torch.Tensor:
    """Upstream's `_apply_rotary_pos_emb_thd` (same arguments and result) for the whole row at once."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    if multi_latent_attention is not None:
        warnings.warn("multi_latent_attention is deprecated. Please use mla_rotary_interleaved instead.",
                      DeprecationWarning)
        mla_rotary_interleaved = multi_latent_attention
    if cp_group is None:
        raise ValueError("cp_group must be provided for THD format RoPE")
    return _apply_rotary_pos_emb_bshd(
        t.unsqueeze(1),
        _gathered_freqs(cu_seqlens, freqs, t.size(0), cp_group.size(), cp_group.rank()),
        rotary_interleaved=rotary_interleaved,
        mla_rotary_interleaved=mla_rotary_interleaved,
        mscale=mscale,
    ).squeeze(1)


def _install_vectorized_thd_rope(patches: Patches) -> None:
    from megatron.core.models.common.embeddings import rope_utils

    patches.setattr(rope_utils, "_apply_rotary_pos_emb_thd", apply_rotary_pos_emb_thd)


ADJUSTMENTS = (
    Adjustment(
        "megatron_core.vectorized_thd_rope",
        "models/common/embeddings/rope_utils.py:222-256 _apply_rotary_pos_emb_thd (no TE fused THD RoPE) syncs "
        "with the host and applies RoPE one packed sequence at a time, in every layer",
        _loops_over_sequences_without_fused_kernel,
        _install_vectorized_thd_rope,
    ),
)
