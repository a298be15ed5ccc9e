"""Micro-batch layouts: one sequence per row padded to ``seq_length``, or several sequences packed into one row (THD).

Both layouts give ``input_ids``, ``labels`` (the next token), ``loss_mask`` (1 where the label is a response token)
and ``position_ids``. A label never crosses the end of its sequence: the last token of every sequence, and every
padding token, has ``loss_mask`` 0 (its label is the pad id, a valid id that is never trained on). Packed rows add
``cu_seqlens`` and ``max_seqlen`` for variable-length attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch.utils.data import Dataset

from lightning_megatron.data.tokenize import TokenizedExample
from lightning_megatron.microbatch import SEQUENCE_KEYS


def sequence_alignment(context_parallel_size: int) -> int:
    """The multiple every packed sequence's length is padded to: Megatron's context-parallel layout cuts each
    sequence into ``2 * cp`` equal chunks."""
    return 2 * context_parallel_size if context_parallel_size > 1 else 1


def pad_example(example: TokenizedExample, seq_length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One sequence, padded at the right end to ``seq_length``."""
    if len(example) > seq_length:
        raise ValueError(f"{example.source}: {len(example)} tokens do not fit seq_length={seq_length}")
    sample = _empty_row(seq_length, pad_id)
    _write_sequence(sample, example, 0)
    sample["position_ids"] = torch.arange(seq_length, dtype=torch.int64)
    return sample


def first_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Greedy first-fit in the given order: each length goes into the first bin with room left, else a new bin.

    Deterministic (same lengths, same bins), and it keeps nearby rows together. Returns the indices per bin.
    The first bin with room is found in a max-tree over the bins' room (O(log n) a length), so a million rows take
    seconds, not the hours a scan of every open bin would.
    """
    size = 1
    while size < max(1, len(lengths)):
        size *= 2
    room = [0] * (2 * size)  # room[size + b]: what bin b has left (0 before it opens); room[i]: max of the children
    bins: list[list[int]] = []
    for index, length in enumerate(lengths):
        length = int(length)
        if length > capacity:
            raise ValueError(f"a sequence of {length} tokens does not fit in {capacity}")
        if room[1] >= length:
            node = 1
            while node < size:
                node = 2 * node if room[2 * node] >= length else 2 * node + 1
            target = node - size
        else:
            target = len(bins)
            bins.append([])
            node = size + target
            room[node] = capacity
        bins[target].append(index)
        room[node] -= length
        node //= 2
        while node:
            best = max(room[2 * node], room[2 * node + 1])
            if room[node] == best:
                break
            room[node] = best
            node //= 2
    return bins


def pack_examples(
    examples: Sequence[TokenizedExample], seq_length: int, pad_id: int, alignment: int = 1
) -> dict[str, torch.Tensor]:
    """Concatenate ``examples`` into one row of ``seq_length`` tokens.

    Each sequence is padded to a multiple of ``alignment`` and its positions count from 0; what is left at the end
    becomes one more padding segment, so ``cu_seqlens`` (int32, ``[n + 1]``) always ends at ``seq_length``.
    """
    sample = _empty_row(seq_length, pad_id)
    position_ids = torch.zeros(seq_length, dtype=torch.int64)
    boundaries = [0]
    for example in examples:
        start = boundaries[-1]
        span = -(-len(example) // alignment) * alignment
        if start + span > seq_length:
            raise ValueError(f"the sequences do not fit seq_length={seq_length}")
        _write_sequence(sample, example, start)
        position_ids[start : start + span] = torch.arange(span)
        boundaries.append(start + span)
    if boundaries[-1] < seq_length:
        position_ids[boundaries[-1] :] = torch.arange(seq_length - boundaries[-1])
        boundaries.append(seq_length)
    cu_seqlens = torch.tensor(boundaries, dtype=torch.int32)
    sample["position_ids"] = position_ids
    sample["cu_seqlens"] = cu_seqlens
    sample["max_seqlen"] = (cu_seqlens[1:] - cu_seqlens[:-1]).max()
    return sample


class PaddedSFTDataset(Dataset):
    """One sequence per sample, padded to ``seq_length``; the default collate stacks them into ``[b, s]``."""

    def __init__(self, examples: Sequence[TokenizedExample], seq_length: int, pad_id: int) -> None:
        self.examples, self.seq_length, self.pad_id = examples, seq_length, pad_id

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return pad_example(self.examples[index], self.seq_length, self.pad_id)


class PackedSFTDataset(Dataset):
    """Sequences packed by :func:`first_fit` (in file order) into rows of ``seq_length``; use :func:`collate_packed`.

    ``bins``: the packing plan when it is already known (the tokenized-data cache stores it); each bin is a sequence
    of indices into ``examples``.
    """

    def __init__(self, examples: Sequence[TokenizedExample], seq_length: int, pad_id: int, alignment: int = 1,
                 bins: Sequence[Sequence[int]] | None = None) -> None:
        self.examples, self.seq_length, self.pad_id, self.alignment = examples, seq_length, pad_id, alignment
        if bins is None:
            bins = first_fit([-(-len(example) // alignment) * alignment for example in examples], seq_length)
        self.bins = bins

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        members = [self.examples[int(i)] for i in self.bins[index]]
        return pack_examples(members, self.seq_length, self.pad_id, self.alignment)


def collate_packed(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A packed micro-batch is one row: ``[1, s]`` tensors, ``cu_seqlens`` ``[n + 1]``, ``max_seqlen`` a Python int
    (read here on the CPU, so that the training step never reads it back from the GPU)."""
    if len(samples) != 1:
        raise ValueError(f"a packed micro-batch holds one row, got {len(samples)}: use micro_batch_size=1")
    (sample,) = samples
    return {key: value.unsqueeze(0) if key in SEQUENCE_KEYS else int(value) if key == "max_seqlen" else value
            for key, value in sample.items()}


class PromptDataset(Dataset):
    """Prediction prompts, unpadded, each with its index; :func:`prompt_collate` pads a batch at the right end."""

    def __init__(self, prompts: list[torch.Tensor]) -> None:
        self.prompts = prompts

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        return index, self.prompts[index]


def prompt_collate(pad_id: int) -> partial:
    """Collate prompts into left-aligned ``input_ids`` ``[b, longest]`` (pad id after each), ``prompt_lengths`` and
    the prompts' dataset ``indices`` (a distributed sampler hands each rank its own, in no order it promises)."""
    return partial(_collate_prompts, pad_id=pad_id)


def _collate_prompts(items: list[tuple[int, torch.Tensor]], pad_id: int) -> dict[str, torch.Tensor]:
    lengths = torch.tensor([prompt.numel() for _, prompt in items], dtype=torch.int64)
    input_ids = torch.full((len(items), int(lengths.max())), pad_id, dtype=torch.int64)
    for row, (_, prompt) in enumerate(items):
        input_ids[row, : prompt.numel()] = prompt
    indices = torch.tensor([index for index, _ in items], dtype=torch.int64)
    return {"input_ids": input_ids, "prompt_lengths": lengths, "indices": indices}


def _empty_row(seq_length: int, pad_id: int) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.full((seq_length,), pad_id, dtype=torch.int64),
        "labels": torch.full((seq_length,), pad_id, dtype=torch.int64),
        "loss_mask": torch.zeros(seq_length, dtype=torch.float32),
    }


def _write_sequence(sample: dict[str, torch.Tensor], example: TokenizedExample, start: int) -> None:
    """Write one sequence at ``start``: its ids, the next token as label, and the response mask of that label."""
    n = len(example)
    sample["input_ids"][start : start + n] = example.input_ids
    sample["labels"][start : start + n - 1] = example.input_ids[1:]
    sample["loss_mask"][start : start + n - 1] = example.response_mask[1:].float()
