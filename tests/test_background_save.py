"""`HostStaging`, the memory background saves stage their shards into: the copies equal what Megatron-Core's own
staging (`.to("cpu")`) gives, down to the bytes `torch.save` writes; the memory is reused by later saves and grown
only when one needs more; a forked child (how Megatron-Core's writer runs) reads the staged bytes. On the CPU the
memory is not page-locked; the placement, reuse and copies are the same code as on the GPU."""

import io
import os

import torch

from lightning_megatron.background_save import HostStaging


def _saved(tensor: torch.Tensor) -> bytes:
    stream = io.BytesIO()
    torch.save(tensor, stream)
    return stream.getvalue()


def _shards() -> list[torch.Tensor]:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    return [base, base.t(), base[2:4], torch.randn(3, 5).to(torch.bfloat16), torch.arange(7), torch.tensor(3.5),
            torch.empty(0, 4), torch.ones(5000, dtype=torch.float16)]


def test_staged_copies_are_what_megatron_core_stages_and_torch_save_writes_the_same_bytes():
    staging = HostStaging()
    assert staging.pin is False  # no CUDA here
    shards = _shards()
    staged = staging.stage(shards)
    for shard, copy in zip(shards, staged):
        reference = shard.to("cpu", copy=True)  # Megatron-Core's preload_tensors, without a GPU
        assert copy.dtype == shard.dtype and copy.shape == shard.shape and copy.stride() == reference.stride()
        assert torch.equal(copy, shard)
        assert copy.untyped_storage().nbytes() == reference.untyped_storage().nbytes()  # not the whole buffer
        assert _saved(copy) == _saved(reference)
    assert staging.last_stage["bytes"] == sum(shard.nbytes for shard in shards) <= staging.capacity


def test_later_saves_reuse_the_memory_and_grow_it_only_by_what_they_add():
    staging = HostStaging()
    staging.reserve([100, 4096])  # each placed on its own pages
    assert (staging.capacity, staging.segments_made) == (8192, 1)
    staging.reserve([4096, 4000])  # fits already
    assert (staging.capacity, staging.segments_made) == (8192, 1)
    shards = _shards()
    first = staging.stage(shards)
    assert staging.segments_made == 2  # the reserved segment filled, the rest in one more
    pointers = [copy.data_ptr() for copy in first if copy.numel()]
    shards[0].add_(1)
    again = staging.stage(shards)
    assert staging.segments_made == 2 and [copy.data_ptr() for copy in again if copy.numel()] == pointers
    assert torch.equal(again[0], shards[0]) and torch.equal(first[0], shards[0])  # the same memory, new values
    capacity = staging.capacity
    bigger = staging.stage([*shards, torch.ones(100_000)])
    assert staging.segments_made == 3 and staging.capacity > capacity
    assert [copy.data_ptr() for copy in bigger[:len(shards)] if copy.numel()] == pointers  # the rest stays put
    staging.release()
    assert staging.capacity == 0 and torch.equal(bigger[-1], torch.ones(100_000))  # a staged tensor keeps its memory


def test_a_forked_child_reads_the_staged_bytes():
    staging = HostStaging()
    shards = _shards()
    staged = staging.stage(shards)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # what Megatron-Core's forked writer does with each staged tensor: torch.save it
        os.close(read)
        with os.fdopen(write, "wb") as stream:
            for copy in staged:
                data = _saved(copy)
                stream.write(len(data).to_bytes(8, "little") + data)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as stream:
        received = stream.read()
    assert os.waitpid(child, 0)[1] == 0
    written = []
    while received:
        length = int.from_bytes(received[:8], "little")
        written.append(received[8:8 + length])
        received = received[8 + length:]
    assert written == [_saved(shard.to("cpu", copy=True)) for shard in shards]


def test_with_cuda_tensors_already_on_the_host_go_to_the_writer_as_they_are():
    staging = HostStaging(copy_host_tensors=False)  # the default with CUDA, as Megatron-Core's own staging
    shards = _shards()
    staged = staging.stage(shards)
    assert all(copy is shard for copy, shard in zip(staged, shards))
    assert staging.segments_made == 0 and staging.last_stage["bytes"] == 0
    assert staging.last_stage["host_bytes_passed"] == sum(shard.nbytes for shard in shards)
