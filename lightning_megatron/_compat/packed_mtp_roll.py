"""Megatron-Core 0.19's MTP roll of packed (THD) rows: one Python step per sequence, host syncs, and under context
parallelism four point-to-point messages per sequence.

The MTP layers shift input ids, position ids, labels and the loss mask one token left within each packed sequence
(`roll_tensor` -> `_roll_tensor_packed_seq`, `transformer/multi_token_prediction.py:236`), several times per forward.
Upstream slices the row with `cu_seqlens` entries (`:261`, `:283`: a host read, hence a device sync, per boundary)
and, with CP > 1, exchanges each sequence's chunk boundaries with the neighbouring ranks in its own isend/irecv round
(`:315-321`). A row of many short sequences thus pays per sequence what a full row pays once.

The replacement computes for every token, with tensor ops on the device, whether it ends its sequence (CP = 1) or
one of its two load-balanced chunks (CP > 1: rank `r` holds chunks `r` and `2 * cp - 1 - r` of each sequence), takes
its left neighbour's value otherwise, and exchanges the first token of every chunk of every sequence in one round of
the same messages upstream sends per sequence. Values are only moved, never computed, so the result is identical;
tokens past the last boundary keep their values, as upstream leaves them.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist

from lightning_megatron._compat._adjustment import Adjustment, Patches


def _rolls_one_sequence_at_a_time() -> bool:
    from megatron.core.transformer import multi_token_prediction

    return "for i in range(len(cu_seqlens) - 1)" in inspect.getsource(multi_token_prediction._roll_tensor_packed_seq)


def _exchange_chunk_heads(first_of_front: torch.Tensor, first_of_back: torch.Tensor, cp_group: Any
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's boundary exchange for all sequences at once: returns what follows each front chunk (the next
    rank's front chunk head; the own back chunk head on the last rank) and what follows each back chunk (the previous
    rank's back chunk head; nothing, zeros, on rank 0)."""
    ranks = dist.get_process_group_ranks(cp_group)
    rank = dist.get_rank(group=cp_group)
    after_front, after_back = torch.empty_like(first_of_front), torch.empty_like(first_of_back)
    requests = []
    if rank != 0:
        requests.append(dist.isend(first_of_front, dst=ranks[rank - 1]))
        requests.append(dist.irecv(after_back, src=ranks[rank - 1]))
    else:
        after_back.zero_()
    if rank != len(ranks) - 1:
        requests.append(dist.irecv(after_front, src=ranks[rank + 1]))
        requests.append(dist.isend(first_of_back, dst=ranks[rank + 1]))
    else:
        after_front.copy_(first_of_back)
    for request in requests:
        request.wait()
    return after_front, after_back


def roll_packed_sequences(tensor: torch.Tensor, shifts: int, dims: int, packed_seq_params: Any,
                          cp_group: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's `_roll_tensor_packed_seq` (same arguments and result) for the whole row at once."""
    assert dims == -1 or dims == tensor.dim() - 1, "Packed sequence roll only supports the last dimension."
    assert shifts == -1, "Packed sequence roll only supports a single-token left shift."
    cu_seqlens = packed_seq_params.cu_seqlens_q
    assert cu_seqlens is not None, "Packed sequence parameters must provide cu_seqlens_q."
    cp_size = cp_group.size() if cp_group is not None else 1
    bounds = cu_seqlens.to(tensor.device).long() // cp_size  # this rank's part of each sequence
    position = torch.arange(tensor.size(-1), device=tensor.device)
    sequence = torch.searchsorted(bounds[1:], position, right=True).clamp(max=bounds.numel() - 2)
    start, end = bounds[:-1][sequence], bounds[1:][sequence]
    in_sequence = (position >= start) & (position < end)
    rolled = torch.roll(tensor, shifts=-1, dims=-1)
    if cp_size == 1:
        rolled = rolled.masked_fill(position == end - 1, 0)
    else:
        chunk_starts = torch.stack([bounds[:-1], (bounds[:-1] + bounds[1:]) // 2]).clamp(max=tensor.size(-1) - 1)
        first_of_front, first_of_back = (tensor[..., chunk_starts[i]].contiguous() for i in range(2))
        after_front, after_back = _exchange_chunk_heads(first_of_front, first_of_back, cp_group)
        rolled = torch.where(position == (start + end) // 2 - 1, after_front[..., sequence], rolled)
        rolled = torch.where(position == end - 1, after_back[..., sequence], rolled)
    rolled = torch.where(in_sequence, rolled, tensor)
    return rolled, rolled.sum()


def _install_vectorized_packed_roll(patches: Patches) -> None:
    from megatron.core.transformer import multi_token_prediction

    patches.setattr(multi_token_prediction, "_roll_tensor_packed_seq", roll_packed_sequences)


ADJUSTMENTS = (
    Adjustment(
        "megatron_core.vectorized_packed_mtp_roll",
        "transformer/multi_token_prediction.py:236-339 _roll_tensor_packed_seq reads cu_seqlens on the host and "
        "rolls (with CP > 1: exchanges boundaries) one packed sequence at a time",
        _rolls_one_sequence_at_a_time,
        _install_vectorized_packed_roll,
    ),
)
