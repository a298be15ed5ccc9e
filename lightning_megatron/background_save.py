"""Asynchronous checkpoint saves: the step resumes once the state is staged, the shards are written in the background.

`MegatronStrategy(async_save=True)` hands each save made while training to `BackgroundSaves`:
`checkpoint.save(..., background=True)` stages every rank's shards off the device and returns Megatron-Core's
`AsyncRequest`; `AsyncCallsQueue` forks the writer; the request's finalize steps (Megatron's metadata, then our
`publish`: manifest, `COMPLETE`, rename) run on every rank once every rank's writer finished, so the `*.ckpt`
folder appears only when the whole checkpoint is on disk. A run killed before that leaves the hidden staging folder,
which nothing loads.

Why the strategy and not Lightning's `AsyncCheckpointIO`: that plugin runs `CheckpointIO.save_checkpoint` of one
dict in a thread, while our save is collective (every rank writes its shards, then all agree before the rename);
collectives from a side thread would interleave with the training step's. Megatron's machinery forks a writer that
needs no collectives and leaves the agreement to the training thread, at the start of the next step.

At most one save is in flight: the next waits for it. Removing an older checkpoint (Lightning's `ModelCheckpoint`
top-k) while a save is in flight is deferred until that save is published, so a failed save never costs the
checkpoint it was to replace. A failure raises `CheckpointError` naming the checkpoint on every rank, at the next
step or at the end of training, and leaves nothing at its path.

Staging (`HostStaging`): every shard on the GPU is copied into host memory reserved at the start of training (for
this rank's model shards; a save that stages more, such as optimizer shards on the GPU, grows it once) and reused by
every save, page-locked, with asynchronous copies and one synchronisation at the end; the forked writer reads it and
calls nothing of CUDA. Shards already on the host (the distributed optimizer's fully reshardable state, gathered for
each save) go to the writer as they are, as with Megatron-Core's staging. Without CUDA (the tests) every shard is on
the host and is copied the same way, into memory that is not page-locked.

Megatron-Core's own staging (`FileSystemWriterAsync.preload_tensors`,
`megatron/core/dist_checkpointing/strategies/filesystem_async.py:227-250`) copies each shard with
`.to("cpu", non_blocking=True)`, for which torch allocates fresh page-locked memory per tensor through its
pinned-memory cache, each rounded up to a power of two: an 8B checkpoint's first save page-locks more than its own
size, shard by shard, while the step waits. Megatron-Core lets the caller choose the staging: it is the request's
`preload_fn` (`async_utils.py:120`, called by `TemporalAsyncCaller.schedule_async_call` before it forks,
`:266-277`), replaced here, so nothing of Megatron-Core is patched.

A writer forked per save, not Megatron-Core's persistent worker (`AsyncCallsQueue(persistent=True)`): that worker is
spawned, gets each request through a queue (the GPU tensors as CUDA IPC handles) and stages them itself, in the child
(`async_utils.py:565,582`: `torch.cuda.set_device`, then `preload_fn()`), so the child needs CUDA (without CUDA it
fails at `set_device`), and staged host memory would reach it only by a copy into shared memory. The fork costs
little here: the staging memory is a shared mapping, so the kernel copies no page of it, neither at fork nor after.
"""

from __future__ import annotations

import mmap
import shutil
import time
import warnings
import weakref
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_megatron import checkpoint as megatron_checkpoint
from lightning_megatron.checkpoint import CheckpointError


class BackgroundSaves:
    """The strategy's save queue: synchronous outside training or when `enabled` is False, else in the background."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._training = False  # background saves only from on_train_start to on_train_end, which finishes them
        self._queue: Any = None
        self._in_flight: Path | None = None
        self._deferred_removals: list[Path] = []
        self.staging = HostStaging()

    @property
    def in_flight(self) -> Path | None:
        """The checkpoint being written in the background, not yet published."""
        return self._in_flight

    def save(self, path: Path, model_chunks: list[torch.nn.Module], optimizer: Any | None,
             checkpoint: dict[str, Any], *, optimizer_sharding: str) -> None:
        """Save `path` (every rank calls it): in the background when enabled and training, else before returning."""
        self.wait()
        if not (self.enabled and self._training):
            megatron_checkpoint.save(path, model_chunks, optimizer, checkpoint, optimizer_sharding=optimizer_sharding)
            return
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        request = megatron_checkpoint.save(path, model_chunks, optimizer, checkpoint,
                                           optimizer_sharding=optimizer_sharding, background=True)
        request = staged_by(self.staging, request)  # the wait above: no writer reads the staging memory now
        if self._queue is None:
            self._queue = AsyncCallsQueue(persistent=False)  # a forked writer per save, see the module docstring
        self._queue.schedule_async_request(request)
        self._in_flight = path

    def begin_training(self, model_chunks: list[torch.nn.Module]) -> None:
        """Background saves from now on; the staging memory for the model's shards is reserved now, not in the
        first save's step."""
        self._training = True
        if self.enabled:
            self.staging.reserve(megatron_checkpoint.model_shard_bytes(model_chunks))

    def end_training(self) -> None:
        """The end of training: wait for the save in flight and give the staging memory back; later saves (after
        fit) are synchronous."""
        try:
            self.wait()
        finally:
            self._training = False
            self.staging.release()

    def poll(self) -> None:
        """Publish the save in flight if every rank's writer finished (one small all-reduce while one is in flight)."""
        self._finalize(blocking=False)

    def wait(self) -> None:
        """Block until the save in flight is published; raise its failure."""
        self._finalize(blocking=True)

    def remove(self, path: Path) -> None:
        """Remove a checkpoint (global rank 0 calls it); deferred until the save in flight is published."""
        if self._in_flight is not None:
            self._deferred_removals.append(path)
        else:
            megatron_checkpoint.remove(path)

    def abort(self) -> None:
        """After an exception: stop the writer without collectives (another rank may be gone). The staging folder
        stays hidden and is replaced by the next save of that name; the deferred removals are dropped."""
        if self._queue is not None:
            self._queue.close(abort=True)
        self._queue, self._in_flight, self._deferred_removals, self._training = None, None, [], False
        self.staging.release()

    def _finalize(self, *, blocking: bool) -> None:
        if self._in_flight is None:
            return
        path = self._in_flight
        try:
            finished = self._queue.maybe_finalize_async_calls(blocking=blocking)
        except BaseException as error:  # torch's CheckpointException is a BaseException
            self._in_flight, self._deferred_removals = None, []
            if dist.get_rank() == 0:
                shutil.rmtree(megatron_checkpoint.staging_folder(path), ignore_errors=True)
            if isinstance(error, CheckpointError):
                raise
            raise CheckpointError(
                f"saving {path} in the background failed ({type(error).__name__}: {error}); nothing was written at "
                f"{path} and the earlier checkpoints are kept. Look for a rank that died (its log) or a disk that "
                f"is full or not writable ({path.parent}), then resume from the last complete checkpoint"
            ) from error
        if finished:
            self._in_flight = None
            removals, self._deferred_removals = self._deferred_removals, []
            for removed in removals:
                megatron_checkpoint.remove(removed)


_ALIGNMENT = 4096  # each staged tensor starts on a page of its own
_CUDA_HOST_REGISTER_PORTABLE = 1  # page-locked for every CUDA context, as torch's own stager registers its memory


class HostStaging:
    """The host memory background saves stage their shards into: allocated by `reserve` or by the first save, reused
    by every later one, grown (by a segment, the earlier ones kept) when a save needs more; page-locked when CUDA is
    available.

    Each segment is a shared anonymous mapping (`mmap(-1, n)`), page-locked with `cudaHostRegister`. Shared, not the
    private memory torch allocates: the writer is forked while the buffer is in use, and the kernel copies the
    page-locked pages of a private mapping into the child at fork time (early copy-on-write of pinned pages, Linux
    >= 5.9; `bench.staging_probe` measures it), while a shared mapping is only mapped into the child; the parent's
    later writes fault nothing either.
    torch's asynchronous DCP staging does the same (`torch/distributed/checkpoint/_state_dict_stager.py:161-173`:
    shared memory, then `cudaHostRegister`), per storage. Without CUDA the segments are the same mappings, not
    page-locked: the copies and the reuse are the same code.

    A staged tensor has a storage of exactly its own bytes (`torch.frombuffer` at its offset) and the strides
    `.to("cpu")` gives it, so `torch.save` in the writer writes the bytes it writes for Megatron-Core's own copies.
    """

    def __init__(self, *, pin: bool | None = None, copy_host_tensors: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.copy_host_tensors = not self.pin if copy_host_tensors is None else copy_host_tensors
        self._segments: list[mmap.mmap] = []
        self.segments_made = 0  # how many times memory was allocated (stays put while saves reuse it)
        self.allocation_s = 0.0  # seconds spent allocating and page-locking, in all
        self.last_stage: dict[str, Any] = {}  # what the last `stage` did: bytes, segments grown, seconds

    @property
    def capacity(self) -> int:
        return sum(len(segment) for segment in self._segments)

    def stage(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of `tensors` (same values, shapes, dtypes and strides), in this object's memory; valid until
        the next `stage` or `release`. GPU copies are asynchronous, then one synchronisation.

        A tensor already in host memory is returned as it is unless `copy_host_tensors` (as Megatron-Core's staging
        does: the forked writer sees its contents as they were at the fork; the distributed optimizer's fully
        reshardable state is such a tensor, gathered for this save). `copy_host_tensors` defaults to True only
        without CUDA, where every tensor is on the host: the CPU path then runs the placement, reuse and copies
        that GPU tensors take."""
        started = time.perf_counter()
        copies = [self.copy_host_tensors or tensor.device.type != "cpu" for tensor in tensors]
        copied = [tensor for tensor, copy in zip(tensors, copies) if copy]
        placements = iter(self._placements(copied))
        grown = time.perf_counter()
        staged = []
        for tensor, copy in zip(tensors, copies):
            if copy:
                host = self._place(tensor, *next(placements))
                host.copy_(tensor.detach(), non_blocking=self.pin and tensor.is_cuda)
                tensor = host
            staged.append(tensor)
        if any(tensor.is_cuda for tensor in copied):
            torch.cuda.synchronize()
        copied_bytes = sum(tensor.nbytes for tensor in copied)
        self.last_stage = {"bytes": copied_bytes, "host_bytes_passed": sum(tensor.nbytes for tensor in tensors)
                           - copied_bytes, "capacity": self.capacity, "grow_s": grown - started,
                           "copy_s": time.perf_counter() - grown}
        return staged

    def stage_write_buckets(self, write_buckets: list[Any]) -> list[Any]:
        """`FileSystemWriterAsync.preload_tensors` for the background writer: the same buckets, each tensor staged
        here (Megatron-Core's `WriteBucket`: (file path, file name, (bytes items, [(item, tensor), ...])))."""
        tensors = [tensor for _, _, (_, tensor_items) in write_buckets for _, tensor in tensor_items]
        staged = iter(self.stage(tensors))
        return [(path, name, (byte_items, [(item, next(staged)) for item, _ in tensor_items]))
                for path, name, (byte_items, tensor_items) in write_buckets]

    def release(self) -> None:
        """Give the memory back: each segment is unlocked and unmapped once no staged tensor uses it any more."""
        self._segments = []

    def reserve(self, tensor_bytes: Sequence[int]) -> None:
        """Grow now to hold tensors of these byte counts, each placed as `stage` places it (page-locking takes
        seconds per 10 GB: better before training than in the first save's step)."""
        needed = sum(_aligned(nbytes) for nbytes in tensor_bytes)
        if needed > self.capacity:
            self._grow(needed - self.capacity)

    def _placements(self, tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
        """(segment index, offset) of each tensor: in the first segment with room left, else in one new segment."""
        placements, filled, extra = [], [0] * len(self._segments), 0
        for tensor in tensors:
            size = _aligned(tensor.nbytes)
            segment = next((index for index, used in enumerate(filled)
                            if used + size <= len(self._segments[index])), None)
            if segment is None:
                placements.append((len(self._segments), extra))
                extra += size
            else:
                placements.append((segment, filled[segment]))
                filled[segment] += size
        if extra:
            self._grow(extra)
        return placements

    def _grow(self, nbytes: int) -> None:
        started = time.perf_counter()
        segment = mmap.mmap(-1, nbytes)  # MAP_SHARED | MAP_ANONYMOUS: zero pages, mapped (not copied) by fork
        if self.pin:
            memory = torch.frombuffer(segment, dtype=torch.uint8)
            memory.zero_()  # fault the pages in with every intra-op thread: cudaHostRegister then only locks them
            pointer = memory.data_ptr()
            error = torch.cuda.cudart().cudaHostRegister(pointer, nbytes, _CUDA_HOST_REGISTER_PORTABLE)
            if int(error) == 0:  # unlocked when the mapping goes (its last staged tensor, after `release`)
                weakref.finalize(segment, torch.cuda.cudart().cudaHostUnregister, pointer).atexit = False
            else:
                warnings.warn(f"background saves stage into pageable memory: cudaHostRegister of {nbytes} bytes "
                              f"failed (CUDA error {int(error)}); staging is slower, the checkpoint the same",
                              stacklevel=2)
        self._segments.append(segment)
        self.segments_made += 1
        self.allocation_s += time.perf_counter() - started

    def _place(self, tensor: torch.Tensor, segment: int, offset: int) -> torch.Tensor:
        if tensor.numel() == 0:
            return torch.empty_like(tensor, device="cpu")
        flat = torch.frombuffer(self._segments[segment], dtype=tensor.dtype, count=tensor.numel(), offset=offset)
        return flat.as_strided(tensor.shape, torch.empty_like(tensor, device="meta").stride())


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGNMENT) * _ALIGNMENT


def staged_by(staging: HostStaging, request: Any) -> Any:
    """`request` (Megatron-Core's `AsyncRequest`) staging its shards into `staging` instead of fresh memory.

    The request's `preload_fn` is `partial(FileSystemWriterAsync.preload_tensors, write_buckets, True)`
    (`strategies/filesystem_async.py:222`); its result replaces the writer's second argument
    (`async_utils.py:268`). A request of another shape is left as it is."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    preload = request.preload_fn
    if not (isinstance(preload, partial) and preload.func is FileSystemWriterAsync.preload_tensors and preload.args):
        return request
    return request._replace(preload_fn=partial(staging.stage_write_buckets, preload.args[0]))
