"""The context-parallel split of a micro-batch: Megatron's load-balanced ("zig-zag") layout, per sequence.

Causal attention makes late tokens costlier than early ones, so Megatron cuts each sequence into ``2 * cp`` equal
chunks and gives rank ``r`` chunks ``r`` and ``2 * cp - 1 - r``. The loss mask and labels must be cut exactly like
the input ids, or the loss would be taken on the wrong tokens; a packed row is cut sequence by sequence (each
segment of ``cu_seqlens``), never as one long row.
"""

from __future__ import annotations

from typing import Any

from lightning_megatron.layout import CU_SEQLENS, CU_SEQLENS_PADDED, SEQUENCE_KEYS, context_parallel_positions


def split_for_context_parallel(batch: dict[str, Any], cp_rank: int, cp_size: int) -> dict[str, Any]:
    """The part of ``batch`` that context-parallel rank ``cp_rank`` of ``cp_size`` holds.

    ``input_ids``, ``labels``, ``loss_mask`` and ``position_ids`` (``[b, s]``) are cut along ``s``: each row
    (padded batch) or each segment of ``cu_seqlens`` (``cu_seqlens_padded`` when given; packed batch, ``b == 1``)
    must have a length divisible by ``2 * cp_size``. ``cu_seqlens``, ``cu_seqlens_padded`` and ``max_seqlen`` keep
    describing the whole row, as Megatron-Core's ``PackedSeqParams`` expects them on every CP rank (its rotary
    embedding, its MTP ``roll_tensor`` and the attention core divide by the CP size themselves).
    """
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size) with cp_size >= 1, got cp_rank={cp_rank}, cp_size={cp_size}")
    if cp_size == 1:
        return dict(batch)
    seq_length = batch["input_ids"].shape[1]
    slots = batch.get(CU_SEQLENS_PADDED, batch.get(CU_SEQLENS))
    if slots is None:
        boundaries = [0, seq_length]
    else:
        boundaries = [int(b) for b in slots]
        if boundaries[0] != 0 or boundaries[-1] != seq_length:
            raise ValueError(f"cu_seqlens must run from 0 to the row length {seq_length}, got {boundaries}")
    index = context_parallel_positions(boundaries, cp_rank, cp_size).to(batch["input_ids"].device)
    split = dict(batch)
    for key in SEQUENCE_KEYS:
        if key in batch:
            split[key] = batch[key].index_select(1, index)
    return split
