"""Tensors written into files laid out up front, each at its place, every file at once.

Why this shape: an export hands tensors over one at a time, in the model's order, which feeds HF's shard files
(the names' order) in long runs of one file: layers 13 to 21 of an 8B model all go to the second of four. The
place of every tensor in its file is known from the names, shapes and dtypes before the first tensor arrives, so
each one can be written at its offset in any order (`os.pwrite`, which releases the GIL). Writes into one file are
serialised by the kernel (the inode lock, on tmpfs and local file systems alike), so the speed comes from writing
the files at the same time, which the export's order does not give by itself.

So the export's thread only hands each tensor to its file's writing thread, with an event marking where the
producing stream stands, and goes on: the export runs ahead of the writes, and every file's thread has its own
tensors to write from the start. There is one thread per file, up to `threads` (a thread with several files takes
their tensors in arrival order). Each copies its GPU tensors in chunks into its own two pinned buffers, on its own
CUDA stream (waiting on the event), and writes one buffer while the next chunk is copied into the other: the only
host copy is that staging. Small tensors that lie one after the other in their file share a chunk while the export
runs ahead of the thread (a LoRA adapter's 500 tensors of ~100 KB each become a few writes and waits, not 500). A
tensor already on the host is written straight from its memory.

The price is device memory: a GPU tensor stays referenced until its thread has copied it. A view of the
parameters (most of an export at TP=1) costs nothing; tensors the export made (gathers, casts, splits) do, so the
export waits while the device memory allocated since the first tensor exceeds `device_budget_bytes` (4 GiB by
default; a gathering export at TP>1 then runs at most that far ahead of the writes). A tensor handed to `write`
must stay unchanged until `close`: true of an export's tensors, and of the parameters while the training waits for
the save.

Pinned buffers: two of `chunk_bytes` (32 MiB) per thread that has GPU tensors (at most 512 MiB), taken at its
first GPU tensor and freed at `close` into torch's pinned-memory cache, where the next writer finds them (a
`WeightSync` in disk mode saves many times and allocates pinned memory once).

Nothing here raises before `close`: every rank of an export must keep iterating it in lockstep (its collectives),
so a failed write is remembered, later writes are skipped, and `close` raises the first failure.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CHUNK_BYTES = 32 * 1024**2
PINNED_BUFFERS_PER_THREAD = 2
DEVICE_BUDGET_BYTES = 4 * 1024**3
WRITER_THREADS = 8


@dataclass(frozen=True)
class FileLayout:
    """One file's bytes before the first tensor (a safetensors header) and each tensor's (offset, byte count)."""

    prefix: bytes
    regions: Mapping[str, tuple[int, int]]

    def tiled_size(self) -> int | None:
        """The file's size when the prefix and the regions cover it back to back (every byte written), else None."""
        end = len(self.prefix)
        for offset, size in sorted(self.regions.values()):
            if offset != end:
                return None
            end += size
        return end


def create_file(path: Path, layout: FileLayout) -> int:
    """Create `path` holding the layout's prefix; returns the descriptor the tensors are written through.

    A file already at `path` of exactly the size of a layout that covers it (`FileLayout.tiled_size`: every byte is
    written again) is kept, not truncated: a preallocated file (`lora_folder`'s spare) keeps its allocated pages
    (90 MB into tmpfs: 21.9 ms instead of 28.7 ms on the H100 machine)."""
    flags = os.O_WRONLY | os.O_CREAT
    size = layout.tiled_size()
    try:
        keep = size is not None and os.stat(path).st_size == size
    except FileNotFoundError:
        keep = False
    descriptor = os.open(path, flags if keep else flags | os.O_TRUNC, 0o666)
    try:
        _write_all(descriptor, memoryview(layout.prefix), 0)
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def _write_all(descriptor: int, data: memoryview, offset: int) -> None:
    while data:  # pwrite may write less than asked (at most ~2 GiB per call on Linux)
        written = os.pwrite(descriptor, data, offset)
        data, offset = data[written:], offset + written


def _allocated_bytes(device: torch.device) -> int:
    """`torch.cuda.memory_allocated` without flattening all the allocator's statistics (asked once per tensor)."""
    return torch.cuda.memory_stats_as_nested_dict(device)["allocated_bytes"]["all"]["current"]


@dataclass(eq=False)
class _Tensor:
    data: torch.Tensor  # flat uint8 view of a contiguous tensor, on the host or a GPU
    file: int
    offset: int
    produced: torch.cuda.Event | None  # a GPU tensor's producing stream has made it once this has happened
    held: bool = False  # a GPU tensor the export waits on (counted in the writer's device budget)


@dataclass
class _Chunk:
    staged: torch.Tensor  # its bytes in a pinned buffer, once `copied` has happened
    file: int
    offset: int
    copied: torch.cuda.Event
    last_of: list[_Tensor]  # the tensors whose last bytes it holds: done with once copied


@dataclass
class _OpenChunk:
    """A pinned buffer being filled with successive pieces of one file, not yet waited on."""

    buffer: torch.Tensor
    file: int
    offset: int
    filled: int = 0
    last_of: list[_Tensor] = field(default_factory=list)

    def takes(self, file: int, offset: int, nbytes: int) -> bool:
        return file == self.file and offset == self.offset + self.filled and self.filled + nbytes <= self.buffer.numel()


class _Staging:
    """One writing thread's way off the GPU: its own stream and pinned buffers, used in turn; the copy of a chunk
    into one buffer overlaps the write of the chunk before from another. Pieces that continue the open chunk's
    bytes in the same file join it; a chunk is closed (its copies waited on, then written) when the next piece does
    not continue it or when the thread has nothing else to do."""

    def __init__(self, device: torch.device, chunk_bytes: int) -> None:
        torch.cuda.set_device(device)  # a new thread's current device is cuda:0, whatever this rank's is
        self.stream = torch.cuda.Stream(device)
        self.buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True)
                        for _ in range(PINNED_BUFFERS_PER_THREAD)]
        self.turn = 0
        self.open: _OpenChunk | None = None
        self.pending: collections.deque[_Chunk] = collections.deque()  # closed, oldest first

    def full(self) -> bool:
        return len(self.pending) + (self.open is not None) == len(self.buffers)

    def continues_open_chunk(self, tensor: _Tensor, start: int, stop: int) -> bool:
        return self.open is not None and self.open.takes(tensor.file, tensor.offset + start, stop - start)

    def close_open_chunk(self) -> None:
        """Mark the open chunk's copies done once the stream reaches here; it becomes the newest pending chunk."""
        if self.open is None:
            return
        copied = torch.cuda.Event()
        copied.record(self.stream)
        chunk, self.open = self.open, None
        self.pending.append(_Chunk(chunk.buffer[:chunk.filled], chunk.file, chunk.offset, copied, chunk.last_of))

    def copy(self, tensor: _Tensor, start: int, stop: int) -> None:
        """Start copying `tensor.data[start:stop]` into the open chunk, or into a new chunk in the next buffer where
        none is open (the caller closes an open chunk this piece does not continue and makes sure the staging is not
        `full`)."""
        if self.open is None:
            assert not self.full()
            self.open = _OpenChunk(self.buffers[self.turn], tensor.file, tensor.offset + start)
            self.turn = (self.turn + 1) % len(self.buffers)
        chunk = self.open
        if start == 0:
            self.stream.wait_event(tensor.produced)
        with torch.cuda.stream(self.stream):
            chunk.buffer[chunk.filled:chunk.filled + stop - start].copy_(tensor.data[start:stop], non_blocking=True)
        chunk.filled += stop - start
        if stop == tensor.data.numel():
            chunk.last_of.append(tensor)


class StagedWriter:
    """Writes named tensors into the files of `layouts` (path -> layout); use as a context manager, or `close`.

    `threads`: how many files are written at the same time; `device_budget_bytes`: how much device memory the
    tensors waiting for their threads may hold (views of existing tensors cost nothing).
    """

    def __init__(self, layouts: Mapping[Path, FileLayout], *, threads: int = WRITER_THREADS,
                 chunk_bytes: int = CHUNK_BYTES, device_budget_bytes: int = DEVICE_BUDGET_BYTES) -> None:
        self._chunk_bytes = chunk_bytes
        self._device_budget_bytes = device_budget_bytes
        self._allocated_at_start: int | None = None
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._released = threading.Condition()
        self._held_bytes = 0  # of the GPU tensors handed over and not yet copied (views of other tensors too)
        self._targets: dict[str, tuple[int, int, int]] = {}  # name -> (file index, offset, byte count)
        files = [(Path(path), layout) for path, layout in layouts.items()]
        self._descriptors: list[int | None] = [None] * len(files)
        thread_count = max(1, min(threads, len(files)))
        self._queues: list[queue.SimpleQueue[_Tensor | None]] = [queue.SimpleQueue() for _ in range(thread_count)]
        for index, (_, layout) in enumerate(files):
            for name, (offset, nbytes) in layout.regions.items():
                self._targets[name] = (index, offset, nbytes)
        self._threads = [threading.Thread(target=self._write_files, args=(worker, files), name=f"hf-write-{worker}",
                                          daemon=True) for worker in range(thread_count)]
        for thread in self._threads:
            thread.start()

    def __enter__(self) -> StagedWriter:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close(raise_error=exc_info[0] is None)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Hand `tensor` (laid out under `name`) to its file's thread; returns at once unless the device budget
        is spent. `tensor` must stay unchanged until `close`."""
        if self._error is not None:
            return
        if name not in self._targets:
            self._fail(KeyError(f"{name} is in no file's layout, or was written already"))
            return
        file, offset, nbytes = self._targets.pop(name)
        if tensor.nbytes != nbytes:
            self._fail(ValueError(f"{name} has {tensor.nbytes} bytes, its place in the file {nbytes}"))
            return
        tensors = self._queues[file % len(self._queues)]
        try:
            data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            if not data.is_cuda:
                tensors.put(_Tensor(data, file, offset, None))
                return
            if self._allocated_at_start is None:
                self._allocated_at_start = _allocated_bytes(data.device)
            produced = torch.cuda.Event()
            produced.record(torch.cuda.current_stream(data.device))
            with self._released:
                self._held_bytes += nbytes
            tensors.put(_Tensor(data, file, offset, produced, held=True))
            self._wait_for_device_budget(data.device)
        except BaseException as error:  # e.g. out of device memory for a contiguous copy: raised by `close`
            self._fail(error)

    def close(self, *, raise_error: bool = True) -> None:
        """Wait for every write, close the files; raise the first failure, or name the tensors never written.

        `raise_error=False` (the export failed): the queued writes are skipped; the caller removes the files."""
        if not raise_error:
            self._fail(RuntimeError("the writer was closed without finishing"))
        for tensors in self._queues:
            tensors.put(None)
        for thread in self._threads:
            thread.join()
        self._queues, self._threads = [], []
        if not raise_error:
            return
        if self._error is not None:
            raise self._error
        if self._targets:
            missing = sorted(self._targets)
            raise ValueError(f"{len(missing)} tensor(s) laid out in the files were never written, e.g. {missing[:5]}")

    def _wait_for_device_budget(self, device: torch.device) -> None:
        """Wait while the held tensors' bytes exceed the budget and so does the device memory allocated since the
        first one (what they really cost: views of existing tensors add nothing)."""
        assert self._allocated_at_start is not None
        with self._released:
            while (self._error is None and self._held_bytes > self._device_budget_bytes
                   and _allocated_bytes(device) - self._allocated_at_start > self._device_budget_bytes):
                self._released.wait()

    def _release(self, tensor: _Tensor) -> None:
        """Drop a GPU tensor once copied (or skipped): its memory may be reused, the export may run on."""
        if tensor.held:
            tensor.held = False
            with self._released:
                self._held_bytes -= tensor.data.numel()
                tensor.data = torch.empty(0, dtype=torch.uint8)
                self._released.notify_all()

    def _write_files(self, worker: int, files: list[tuple[Path, FileLayout]]) -> None:
        """One writing thread: create its files (truncating old ones runs in parallel too), then write their
        tensors in arrival order, the next GPU chunk copied while the one before is written."""
        mine = range(worker, len(files), len(self._queues))
        staging: _Staging | None = None
        try:
            for file in mine:
                try:
                    self._descriptors[file] = create_file(*files[file])
                except BaseException as error:  # raised by `close`, after the export went on in lockstep
                    self._fail(error)
            tensors = self._queues[worker]
            while True:
                if staging is not None and (staging.pending or staging.open is not None):
                    try:
                        tensor = tensors.get_nowait()
                    except queue.Empty:  # nothing new yet: write what is copied meanwhile
                        staging.close_open_chunk()
                        self._write_staged(staging)
                        continue
                else:
                    tensor = tensors.get()
                if tensor is None:
                    break
                try:
                    descriptor = self._descriptors[tensor.file]
                    if self._error is None and descriptor is not None:
                        if tensor.produced is None:
                            _write_all(descriptor, memoryview(tensor.data.numpy()), tensor.offset)
                        else:
                            staging = staging or _Staging(tensor.data.device, self._chunk_bytes)
                            self._stage(tensor, staging)
                except BaseException as error:
                    self._fail(error)
                finally:
                    if tensor.data.numel() == 0 or self._error is not None:  # nothing (more) to copy
                        self._release(tensor)
            if staging is not None:
                staging.close_open_chunk()
            while staging is not None and staging.pending:
                self._write_staged(staging)
        except BaseException as error:  # not expected; an export waiting for device memory must not wait on
            self._fail(error)
        finally:
            for file in mine:
                descriptor = self._descriptors[file]
                if descriptor is not None:
                    os.close(descriptor)

    def _stage(self, tensor: _Tensor, staging: _Staging) -> None:
        """Queue the copies of a GPU tensor's chunks, writing the oldest copied chunk whenever no buffer is free."""
        size = tensor.data.numel()
        for start in range(0, size, self._chunk_bytes):
            stop = min(size, start + self._chunk_bytes)
            if not staging.continues_open_chunk(tensor, start, stop):
                staging.close_open_chunk()
                while staging.full():
                    self._write_staged(staging)
            staging.copy(tensor, start, stop)

    def _write_staged(self, staging: _Staging) -> None:
        """Write the oldest copied chunk (skipped after a failure); its tensor is released after its last chunk."""
        chunk = staging.pending.popleft()
        try:
            chunk.copied.synchronize()
        except BaseException as error:  # the copy failed: nothing pending is written
            self._fail(error)
            for pending in (chunk, *staging.pending):
                for tensor in pending.last_of:
                    self._release(tensor)
            staging.pending.clear()
            return
        for tensor in chunk.last_of:
            self._release(tensor)
        descriptor = self._descriptors[chunk.file]
        if self._error is None and descriptor is not None:
            try:
                _write_all(descriptor, memoryview(chunk.staged.numpy()), chunk.offset)
            except BaseException as error:
                self._fail(error)

    def _fail(self, error: BaseException) -> None:
        with self._error_lock:
            if self._error is None:
                self._error = error
        with self._released:  # an export waiting for device memory goes on (skipping) at once
            self._released.notify_all()


def write_host_tensors(path: Path, layout: FileLayout, tensors: Mapping[str, torch.Tensor]) -> None:
    """One file of host tensors, now, each written straight from its memory at its place in `layout`: `os.pwrite`
    releases the GIL, so a thread that launches a training step's kernels beside this one is not held up
    (safetensors' `save_file` holds the GIL while it copies the bytes)."""
    descriptor = create_file(path, layout)
    try:
        for name, tensor in tensors.items():
            offset, size = layout.regions[name]
            data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            if data.device.type != "cpu" or data.numel() != size:
                raise ValueError(f"{name}: {tuple(tensor.shape)} {tensor.dtype} on {tensor.device} is not the "
                                 f"{size} host bytes the layout has for it")
            _write_all(descriptor, memoryview(data.numpy()), offset)
    finally:
        os.close(descriptor)
