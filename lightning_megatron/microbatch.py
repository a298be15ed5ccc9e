"""The microbatch contract that the strategy, the module, the data pipeline and the attention core all read.

A leaf: nothing here imports the rest of `lightning_megatron`, so every room can import it without a circle.

A microbatch is a dict of tensors in one of three layouts, told apart by its keys:
- padded rows: `input_ids`, `labels`, `loss_mask`, `position_ids`, each `[b, s]`; causal attention per row.
- packed THD: the same keys with `b == 1`, plus `cu_seqlens` (int32 `[n + 1]`, from 0 to `s`: where each sequence
  starts) and `max_seqlen` (the longest slot; a Python int, so that nothing is read back from the device, or a
  tensor); optionally `cu_seqlens_padded` when each sequence sits in a larger slot (the tokens of a
  slot past its sequence then see only themselves and give zeros). A token attends to the earlier tokens of its own
  sequence only. Megatron-Core's MTP roll reads `cu_seqlens` alone, so MTP training wants the padding inside each
  sequence's segment (as `SFTDataModule` packs) rather than `cu_seqlens_padded`.
- "may attend" structure (trees): `subtree_end`, integer `[b, s]` in DFS pre-order: key `k` is visible to query `q`
  iff `k <= q < subtree_end[k]` (exclusive end). A causal row is `subtree_end = s` everywhere, a packed row is the
  end of each token's sequence, a pad that attends only to itself has its own index + 1.

`cu_seqlens`, `cu_seqlens_padded` and `max_seqlen` always describe the whole row, also after the context-parallel
split (Megatron-Core's `PackedSeqParams` convention: rotary embeddings, MTP's `roll_tensor` and the attention core
divide by the CP size themselves). `subtree_end` travels to the core attention as Megatron's `attention_mask` (an
integer tensor, so activation recompute can save it); a bool `attention_mask` keeps its meaning (True = masked).
"""

from __future__ import annotations

from typing import Any

import torch

Microbatch = dict[str, torch.Tensor]
LossOutput = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]

# Per-token [b, s] entries: the context-parallel split cuts these along s.
SEQUENCE_KEYS = ("input_ids", "labels", "loss_mask", "position_ids")
CU_SEQLENS = "cu_seqlens"
CU_SEQLENS_PADDED = "cu_seqlens_padded"
MAX_SEQLEN = "max_seqlen"
SUBTREE_END = "subtree_end"


def check_microbatch(microbatch: Microbatch, context_parallel_size: int = 1, sequence_parallel_size: int = 1) -> None:
    """Raise, naming the field and the fix, on a microbatch the attention core, the CP split and sequence parallelism
    (`sequence_parallel_size`: the TP size under `sequence_parallel`, 1 without) cannot serve."""
    input_ids = microbatch.get("input_ids")
    if input_ids is None or input_ids.dim() != 2:
        raise ValueError("input_ids: every microbatch needs a [micro_batch_size, seq_length] input_ids tensor")
    rows, seq_length = input_ids.shape
    for key in (*SEQUENCE_KEYS, SUBTREE_END):
        if key in microbatch and microbatch[key].shape != input_ids.shape:
            raise ValueError(f"{key}: shape {tuple(microbatch[key].shape)} differs from input_ids "
                             f"{tuple(input_ids.shape)}; every per-token entry must be [b, s]")
    alignment = 2 * context_parallel_size
    packed = CU_SEQLENS in microbatch
    if packed:
        if rows != 1:
            raise ValueError(f"cu_seqlens: a packed microbatch is one row, got {rows}; use micro_batch_size: 1")
        for key in (CU_SEQLENS, CU_SEQLENS_PADDED):
            if key in microbatch:
                _check_boundaries(key, microbatch[key], seq_length, exact_end=key == CU_SEQLENS_PADDED
                                  or CU_SEQLENS_PADDED not in microbatch)
        slots = microbatch.get(CU_SEQLENS_PADDED, microbatch[CU_SEQLENS])
        if CU_SEQLENS_PADDED in microbatch and len(slots) != len(microbatch[CU_SEQLENS]):
            raise ValueError("cu_seqlens_padded: needs as many entries as cu_seqlens (one slot per sequence)")
        if context_parallel_size > 1:
            lengths = (slots[1:] - slots[:-1]).tolist()
            bad = [length for length in lengths if length % alignment]
            if bad:
                raise ValueError(
                    f"cu_seqlens: sequence lengths {bad} are not multiples of 2 x context_parallel_size = {alignment};"
                    f" pad every packed sequence to a multiple of {alignment} (SFTDataModule does when it knows "
                    "context_parallel_size)"
                )
    elif context_parallel_size > 1 and seq_length % alignment:
        raise ValueError(f"seq_length: {seq_length} is not a multiple of 2 x context_parallel_size = {alignment}; "
                         f"pad the rows to a multiple of {alignment}")
    if sequence_parallel_size > 1 and seq_length % (context_parallel_size * sequence_parallel_size):
        cut = f" of each context-parallel rank (context_parallel_size: {context_parallel_size})" * (
            context_parallel_size > 1)
        raise ValueError(f"seq_length: {seq_length}: sequence_parallel splits the tokens{cut} over "
                         f"tensor_model_parallel_size = {sequence_parallel_size} ranks; use a seq_length that is a "
                         f"multiple of {context_parallel_size * sequence_parallel_size}, or sequence_parallel: false")
    if SUBTREE_END in microbatch:
        if packed:
            raise ValueError("subtree_end: a tree row carries its structure in subtree_end alone; drop cu_seqlens")
        if context_parallel_size > 1:
            raise ValueError("subtree_end: tree rows need context_parallel_size: 1")
        subtree_end = microbatch[SUBTREE_END]
        if subtree_end.dtype.is_floating_point or subtree_end.dtype == torch.bool:
            raise ValueError(f"subtree_end: must be an integer tensor, got {subtree_end.dtype}")
        index = torch.arange(seq_length, device=subtree_end.device)
        if bool(((subtree_end <= index) | (subtree_end > seq_length)).any()):
            raise ValueError("subtree_end: every entry must satisfy own index < subtree_end <= seq_length "
                             "(a token always sees itself)")


def _check_boundaries(key: str, boundaries: torch.Tensor, seq_length: int, *, exact_end: bool) -> None:
    values = boundaries.tolist()
    if boundaries.dim() != 1 or len(values) < 2 or values[0] != 0:
        raise ValueError(f"{key}: must be a 1-D tensor starting at 0, got {values}")
    if any(end < start for start, end in zip(values[:-1], values[1:])):
        raise ValueError(f"{key}: must not decrease, got {values}")
    if exact_end and values[-1] != seq_length:
        raise ValueError(f"{key}: ends at {values[-1]} but the row has {seq_length} tokens; the last boundary must "
                         "be the row length (add a padding segment for the tokens left over)")
    if values[-1] > seq_length:
        raise ValueError(f"{key}: ends at {values[-1]}, past the row's {seq_length} tokens")


def packed_row_bounds(cu_seqlens: torch.Tensor, seq_length: int, cu_seqlens_padded: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position of a packed row of `seq_length` tokens: the start and (exclusive) end of its sequence, and
    whether it belongs to one. A position in a slot past its sequence (`cu_seqlens_padded`), or past the last
    boundary, belongs to none: its start and end enclose only itself."""
    position = torch.arange(seq_length, device=cu_seqlens.device)
    starts = (cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded).to(position.device).long()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(position.device).long()
    sequence = torch.bucketize(position, starts[1:], right=True).clamp(max=len(lengths) - 1)
    start = starts[:-1][sequence]
    end = start + lengths[sequence]
    member = (position >= start) & (position < end)
    return torch.where(member, start, position), torch.where(member, end, position + 1), member


def context_parallel_positions(boundaries: list[int], cp_rank: int, cp_size: int) -> torch.Tensor:
    """Positions (in the whole row) that context-parallel rank `cp_rank` holds, in its local order: Megatron's
    load-balanced layout cuts each sequence (each segment of `boundaries`) into `2 * cp_size` equal chunks and
    gives rank `r` chunk `r` then chunk `2 * cp_size - 1 - r`."""
    pieces = []
    for start, end in zip(boundaries[:-1], boundaries[1:]):
        length = end - start
        if length % (2 * cp_size) != 0:
            raise ValueError(
                f"a sequence of {length} tokens (positions {start}..{end}) cannot be cut into 2 x "
                f"context_parallel_size = {2 * cp_size} equal chunks; pad every sequence to a multiple of "
                f"{2 * cp_size} (SFTDataModule does when context_parallel_size > 1)"
            )
        chunk = length // (2 * cp_size)
        for chunk_index in (cp_rank, 2 * cp_size - 1 - cp_rank):
            pieces.append(torch.arange(start + chunk_index * chunk, start + (chunk_index + 1) * chunk))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def model_inputs(microbatch: Microbatch) -> dict[str, Any]:
    """The keyword arguments of a Megatron-Core `GPTModel` call for a microbatch in any layout: `packed_seq_params`
    (global `cu_seqlens`) for a packed row, `attention_mask = subtree_end` for a tree row, neither for padded rows."""
    inputs: dict[str, Any] = {
        "input_ids": microbatch["input_ids"],
        "position_ids": microbatch["position_ids"],
        "attention_mask": microbatch.get(SUBTREE_END),
        "labels": microbatch["labels"],
        "loss_mask": microbatch["loss_mask"],
    }
    if CU_SEQLENS in microbatch:
        inputs["packed_seq_params"] = packed_seq_params(microbatch)
    return inputs


def packed_seq_params(microbatch: Microbatch) -> Any:
    """Megatron-Core's THD `PackedSeqParams` of a packed microbatch (whole-row boundaries, int32).

    Megatron wants `max_seqlen` as a host integer (the rotary length). A Python int `max_seqlen` in the microbatch
    (the packing collates make one on the CPU) is taken as it is; otherwise it is computed from the slots, and
    `int()` of a device tensor waits for the GPU to drain: once per microbatch, it cost 0.17 s of a 1.64 s packed
    step on the H200 (`bench/packing_profile.py`, `packed_host_max`)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = microbatch[CU_SEQLENS].to(torch.int32)
    padded = microbatch.get(CU_SEQLENS_PADDED)
    padded = None if padded is None else padded.to(torch.int32)
    max_seqlen = microbatch.get(MAX_SEQLEN)
    if not isinstance(max_seqlen, int):  # read back from the device when the data did not say it on the host
        slots = cu_seqlens if padded is None else padded
        max_seqlen = int((slots[1:] - slots[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded, max_seqlen_q=max_seqlen,
                           max_seqlen_kv=max_seqlen)


def with_fixed_sequence_count(microbatch: Microbatch, sequences: int, max_seqlen: int) -> Microbatch:
    """A packed microbatch whose `cu_seqlens` (and `cu_seqlens_padded`) hold exactly `sequences + 1` boundaries and
    whose `max_seqlen` is the host int `max_seqlen`: static shapes for a captured CUDA graph.

    The added sequences are empty and sit at the row's end (the last boundary repeated): no token belongs to them,
    so attention, RoPE, MTP's roll and the loss are what they were. `max_seqlen` is only the rotary length; it must
    be at least the longest sequence and, for a row of several sequences, below the row length (a rotary table as
    long as the row reads each sequence's offset, Megatron-Core's `has_packed_freqs`)."""
    boundaries = microbatch[CU_SEQLENS]
    missing = sequences + 1 - len(boundaries)
    if missing < 0:
        raise ValueError(f"cu_seqlens: {len(boundaries) - 1} sequences in the row, more than the fixed count "
                         f"{sequences}; raise the count")
    fixed = dict(microbatch)
    for key in (CU_SEQLENS, CU_SEQLENS_PADDED):
        if key in microbatch:
            fixed[key] = torch.cat([microbatch[key], microbatch[key][-1:].expand(missing)])
    fixed[MAX_SEQLEN] = max_seqlen
    return fixed


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
