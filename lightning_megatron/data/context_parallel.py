"""The context-parallel split of a micro-batch: Megatron's load-balanced ("zig-zag") layout, per sequence.

Causal attention makes late tokens costlier than early ones, so Megatron cuts each sequence into ``2 * cp`` equal
chunks and gives rank ``r`` chunks ``r`` and ``2 * cp - 1 - r``. The loss mask and labels must be cut exactly like
the input ids, or the loss would be taken on the wrong tokens; a packed row is cut sequence by sequence (each
segment of ``cu_seqlens``), never as one long row.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_megatron.data.packing import SEQUENCE_KEYS


def split_for_context_parallel(batch: dict[str, Any], cp_rank: int, cp_size: int) -> dict[str, Any]:
    """The part of ``batch`` that context-parallel rank ``cp_rank`` of ``cp_size`` holds.

    ``input_ids``, ``labels``, ``loss_mask`` and ``position_ids`` (``[b, s]``) are cut along ``s``: each row
    (padded batch) or each segment of ``cu_seqlens`` (packed batch, ``b == 1``) must have a length divisible by
    ``2 * cp_size``. ``cu_seqlens`` and ``max_seqlen`` are divided by ``cp_size`` (the local layout); other entries
    are passed through. Megatron's ``PackedSeqParams`` and its MTP ``roll_tensor`` take the *global* cu_seqlens
    (``_roll_tensor_packed_seq`` divides by the CP size itself), so read those from the batch before the split.
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size) with cp_size >= 1, got cp_rank={cp_rank}, cp_size={cp_size}")
    if cp_size == 1:
        return dict(batch)
    seq_length = batch["input_ids"].shape[1]
    cu_seqlens = batch.get("cu_seqlens")
    if cu_seqlens is None:
        boundaries = [0, seq_length]
    else:
        boundaries = [int(b) for b in cu_seqlens]
        if boundaries[0] != 0 or boundaries[-1] != seq_length:
            raise ValueError(f"cu_seqlens must run from 0 to the row length {seq_length}, got {boundaries}")
    index = _rank_positions(boundaries, cp_rank, cp_size).to(batch["input_ids"].device)
    split = dict(batch)
    for key in SEQUENCE_KEYS:
        if key in batch:
            split[key] = batch[key].index_select(1, index)
    if cu_seqlens is not None:
        split["cu_seqlens"] = cu_seqlens // cp_size
    if "max_seqlen" in batch:
        split["max_seqlen"] = batch["max_seqlen"] // cp_size
    return split


def _rank_positions(boundaries: list[int], cp_rank: int, cp_size: int) -> torch.Tensor:
    """Positions rank ``cp_rank`` keeps, in order: per sequence, chunk ``cp_rank`` then chunk ``2cp-1-cp_rank``."""
    pieces = []
    for start, end in zip(boundaries[:-1], boundaries[1:]):
        length = end - start
        if length % (2 * cp_size) != 0:
            raise ValueError(
                f"a sequence of {length} tokens (positions {start}..{end}) cannot be cut into 2 * cp_size = "
                f"{2 * cp_size} equal chunks; pad every sequence to a multiple of {2 * cp_size} "
                "(SFTDataModule does when context_parallel_size > 1)"
            )
        chunk = length // (2 * cp_size)
        for chunk_index in (cp_rank, 2 * cp_size - 1 - cp_rank):
            pieces.append(torch.arange(start + chunk_index * chunk, start + (chunk_index + 1) * chunk))
    return torch.cat(pieces)
