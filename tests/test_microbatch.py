"""The microbatch's context-parallel split (against a direct computation and Megatron-Core's own helper) and a
packed microbatch's `max_seqlen`, kept on the host so that `packed_seq_params` reads nothing back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_megatron.data import TokenizedExample
from lightning_megatron.data.packing import collate_packed, pack_examples
from lightning_megatron.microbatch import packed_seq_params, split_for_context_parallel


def _owner(offset: int, length: int, cp_size: int) -> int:
    """The CP rank that holds ``offset`` of a sequence of ``length``: chunk c goes to c, or to 2cp-1-c."""
    chunk = offset // (length // (2 * cp_size))
    return chunk if chunk < cp_size else 2 * cp_size - 1 - chunk


def _expected_pieces(row: list[Any], boundaries: list[int], cp_size: int) -> list[list[Any]]:
    """Each rank's elements, built position by position: within a sequence a rank's first chunk comes before its
    mirrored chunk, so walking the row in order and appending to the owner's list gives the local order."""
    pieces: list[list[Any]] = [[] for _ in range(cp_size)]
    for start, end in zip(boundaries[:-1], boundaries[1:]):
        for position in range(start, end):
            pieces[_owner(position - start, end - start, cp_size)].append(row[position])
    return pieces


def _reassemble(pieces: list[dict[str, torch.Tensor]], key: str, cp_size: int) -> torch.Tensor:
    """Put the ranks' pieces back with each rank's local boundaries (the row's divided by the CP size): halves go
    to chunks r and 2cp-1-r."""
    rows = pieces[0][key].shape[0]
    segments = []
    local_cu = pieces[0].get("cu_seqlens", torch.tensor([0, pieces[0][key].shape[1] * cp_size])) // cp_size
    for i in range(len(local_cu) - 1):
        start, end = int(local_cu[i]), int(local_cu[i + 1])
        half = (end - start) // 2
        chunks: list[torch.Tensor | None] = [None] * (2 * cp_size)
        for rank, piece in enumerate(pieces):
            chunks[rank] = piece[key][:, start : start + half]
            chunks[2 * cp_size - 1 - rank] = piece[key][:, start + half : end]
        segments.append(torch.cat(chunks, dim=1))
    result = torch.cat(segments, dim=1)
    assert result.shape[0] == rows
    return result


def _batch(rows: int, seq_length: int, cu_seqlens: list[int] | None = None) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows * seq_length)
    input_ids = torch.arange(rows * seq_length).reshape(rows, seq_length)
    batch = {
        "input_ids": input_ids,
        "labels": input_ids + 1000,
        "loss_mask": torch.randint(0, 2, (rows, seq_length), generator=generator).float(),
        "position_ids": torch.arange(seq_length).expand(rows, seq_length).clone(),
    }
    if cu_seqlens is not None:
        cu = torch.tensor(cu_seqlens, dtype=torch.int32)
        batch["position_ids"] = torch.cat([torch.arange(n) for n in (cu[1:] - cu[:-1]).tolist()]).unsqueeze(0)
        batch["cu_seqlens"] = cu
        batch["max_seqlen"] = (cu[1:] - cu[:-1]).max()
    return batch


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_context_parallel_split_matches_a_direct_computation(cp_size: int, packed: bool) -> None:
    align = 2 * cp_size
    if packed:
        cu_seqlens = [0, 3 * align, 4 * align, 7 * align, 8 * align]  # unequal sequences + a padding segment
        batch = _batch(1, 8 * align, cu_seqlens)
    else:
        cu_seqlens = None
        batch = _batch(3, 4 * align)
    seq_length = batch["input_ids"].shape[1]
    boundaries = cu_seqlens or [0, seq_length]

    pieces = [split_for_context_parallel(batch, rank, cp_size) for rank in range(cp_size)]
    for key in ("input_ids", "labels", "loss_mask", "position_ids"):
        for row in range(batch[key].shape[0]):
            expected = _expected_pieces(batch[key][row].tolist(), boundaries, cp_size)
            for rank in range(cp_size):
                assert pieces[rank][key][row].tolist() == expected[rank], (key, row, rank)
        assert torch.equal(_reassemble(pieces, key, cp_size), batch[key])
    for piece in pieces:
        assert piece["input_ids"].shape == (batch["input_ids"].shape[0], seq_length // cp_size)
        if packed:
            # the whole row's boundaries, on every rank: Megatron's PackedSeqParams convention
            assert piece["cu_seqlens"].tolist() == cu_seqlens
            assert int(piece["max_seqlen"]) == int(batch["max_seqlen"])


def test_context_parallel_split_rejects_sequences_it_cannot_cut() -> None:
    with pytest.raises(ValueError, match="cannot be cut into 2 x context_parallel_size = 4"):
        split_for_context_parallel(_batch(1, 16, [0, 6, 16]), 0, 2)
    with pytest.raises(ValueError, match="cannot be cut"):
        split_for_context_parallel(_batch(2, 10), 1, 2)
    with pytest.raises(ValueError, match="cp_rank"):
        split_for_context_parallel(_batch(2, 8), 2, 2)
    batch = _batch(2, 8)
    assert split_for_context_parallel(batch, 0, 1) == batch


_MEGATRON_SPLIT = """
import sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from megatron.core.utils import get_batch_on_this_cp_rank
batch, out = torch.load(sys.argv[1]), {}
for cp_size in (2, 4):
    for rank in range(cp_size):
        # A fake process group gives the helper the CP rank and size it asks for; it sends nothing.
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp_size)
        view = {key: value.clone() for key, value in batch.items()}
        view["tokens"] = view.pop("input_ids")
        view["cu_seqlens"] = None
        out[cp_size, rank] = get_batch_on_this_cp_rank(view, is_hybrid_cp=False, cp_group=dist.group.WORLD)
        dist.destroy_process_group()
torch.save(out, sys.argv[2])
"""


def test_padded_split_equals_megatron_core_get_batch_on_this_cp_rank(tmp_path: Path) -> None:
    """Megatron-Core 0.19.2's own split (``megatron/core/utils.py``), run in a fresh process on a fake group."""
    batch = _batch(2, 24)
    torch.save(batch, tmp_path / "batch.pt")
    subprocess.run(
        [sys.executable, "-c", _MEGATRON_SPLIT, str(tmp_path / "batch.pt"), str(tmp_path / "out.pt")],
        check=True, capture_output=True, timeout=300,
    )
    upstream = torch.load(tmp_path / "out.pt")
    for (cp_size, rank), theirs in upstream.items():
        ours = split_for_context_parallel(batch, rank, cp_size)
        assert torch.equal(ours["input_ids"], theirs["tokens"])
        for key in ("labels", "loss_mask", "position_ids"):
            assert torch.equal(ours[key], theirs[key]), (cp_size, rank, key)


def test_packed_microbatch_carries_max_seqlen_on_the_host_and_packed_seq_params_reads_nothing() -> None:
    """`collate_packed` reads `max_seqlen` on the CPU, so that `packed_seq_params` never reads the GPU back (a drained
    queue per microbatch); its value is the one computed from the slots. Meta tensors cannot be read at all: the
    params build from them only if nothing is read."""
    examples = [TokenizedExample("t", torch.arange(n) + 1, torch.ones(n, dtype=torch.bool)) for n in (5, 9, 3)]
    batch = collate_packed([pack_examples(examples, 24, pad_id=0)])
    assert isinstance(batch["max_seqlen"], int)
    computed = packed_seq_params({**batch, "max_seqlen": batch["cu_seqlens"].max()})  # a tensor: computed
    assert batch["max_seqlen"] == computed.max_seqlen_q == computed.max_seqlen_kv == 9
    on_meta = {key: value.to("meta") if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
    params = packed_seq_params(on_meta)
    assert params.max_seqlen_q == params.max_seqlen_kv == 9 and params.cu_seqlens_q.device.type == "meta"
    with pytest.raises(RuntimeError, match="meta"):  # without the host value it reads the device
        packed_seq_params({**on_meta, "max_seqlen": on_meta["cu_seqlens"].max()})
