"""Tensors written into files laid out up front, each at its place, as fast as the copies and the files allow.

Why this shape: an export hands tensors over one at a time, in the model's order, not the files'. The place of
every tensor in its file is known from the names, shapes and dtypes before the first tensor arrives, so each one
is written at its offset the moment it comes (`os.pwrite`, which releases the GIL), while the export produces the
next. A tensor on a GPU is copied in chunks into pinned host buffers on the stream that produced it (so a freed
tensor's memory is reused only after the copy) and written from there: the only host copy is that staging. The
buffers form a window of `staging_bytes`: the copy of the next chunks overlaps the writing of the earlier ones.

Each file has its own writing thread: writes into one file are serialised by the kernel (the inode lock, on tmpfs
and local file systems alike), so parallelism comes from several files at once. The staging window lets the files
progress together although the export feeds them one after another. A tensor already on the host is written
straight from its memory, with no staging.

Nothing here raises before `close`: every rank of an export must keep iterating it in lockstep (its collectives),
so a failed write is remembered, later writes are skipped, and `close` raises the first failure.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CHUNK_BYTES = 32 * 1024**2
STAGING_BYTES = 1024**3
WRITER_THREADS = 8


@dataclass(frozen=True)
class FileLayout:
    """One file's bytes before the first tensor (a safetensors header) and each tensor's (offset, byte count)."""

    prefix: bytes
    regions: Mapping[str, tuple[int, int]]


def create_file(path: Path, layout: FileLayout) -> int:
    """Create `path` holding the layout's prefix; returns the descriptor the tensors are written through."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
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


@dataclass
class _Chunk:
    data: torch.Tensor  # uint8, on the host: a pinned staging slot or the tensor's own memory
    offset: int
    ready: torch.cuda.Event | None  # the copy into the staging slot is done once this has happened
    slot: int | None


class StagedWriter:
    """Writes named tensors into the files of `layouts` (path -> layout); use as a context manager, or `close`.

    `threads`: how many files are written at the same time; `staging_bytes`: the pinned window for GPU tensors
    (allocated at the first GPU tensor, and kept by torch's pinned-memory cache for the next writer).
    """

    def __init__(self, layouts: Mapping[Path, FileLayout], *, threads: int = WRITER_THREADS,
                 staging_bytes: int = STAGING_BYTES, chunk_bytes: int = CHUNK_BYTES) -> None:
        self._chunk_bytes = chunk_bytes
        self._slot_count = max(2, staging_bytes // chunk_bytes)
        self._staging: torch.Tensor | None = None
        self._free_slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._active = threading.Semaphore(max(1, threads))
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        self._targets: dict[str, tuple[int, int, int]] = {}  # name -> (file index, offset, byte count)
        self._descriptors: list[int | None] = []
        self._queues: list[queue.SimpleQueue[_Chunk | None]] = []
        self._threads: list[threading.Thread] = []
        for index, (path, layout) in enumerate(layouts.items()):
            try:
                self._descriptors.append(create_file(path, layout))
            except BaseException as error:  # raised by `close`, after the export went on in lockstep
                self._descriptors.append(None)
                self._fail(error)
            for name, (offset, nbytes) in layout.regions.items():
                self._targets[name] = (index, offset, nbytes)
            self._queues.append(queue.SimpleQueue())
            thread = threading.Thread(target=self._drain, args=(index,), name=f"hf-write-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def __enter__(self) -> StagedWriter:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close(raise_error=exc_info[0] is None)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Queue `tensor` (laid out under `name`) for writing; returns once it is staged (a GPU tensor) or queued."""
        if self._error is not None:
            return
        if name not in self._targets:
            self._fail(KeyError(f"{name} is in no file's layout, or was written already"))
            return
        index, offset, nbytes = self._targets.pop(name)
        if tensor.nbytes != nbytes:
            self._fail(ValueError(f"{name} has {tensor.nbytes} bytes, its place in the file {nbytes}"))
            return
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        for start in range(0, nbytes, self._chunk_bytes):
            piece = data[start:start + self._chunk_bytes]
            if piece.is_cuda:
                self._queues[index].put(self._stage(piece, offset + start))
            else:
                self._queues[index].put(_Chunk(piece, offset + start, None, None))

    def close(self, *, raise_error: bool = True) -> None:
        """Wait for every write, close the files; raise the first failure, or name the tensors never written."""
        for chunks in self._queues:
            chunks.put(None)
        for thread in self._threads:
            thread.join()
        for descriptor in self._descriptors:
            if descriptor is not None:
                os.close(descriptor)
        self._queues, self._threads, self._descriptors, self._staging = [], [], [], None
        if not raise_error:
            return
        if self._error is not None:
            raise self._error
        if self._targets:
            missing = sorted(self._targets)
            raise ValueError(f"{len(missing)} tensor(s) laid out in the files were never written, e.g. {missing[:5]}")

    def _stage(self, piece: torch.Tensor, offset: int) -> _Chunk:
        """Copy a GPU chunk into a free pinned slot on the current stream of its device (waits for a free slot)."""
        if self._staging is None:
            self._staging = torch.empty(self._slot_count * self._chunk_bytes, dtype=torch.uint8, pin_memory=True)
            for slot in range(self._slot_count):
                self._free_slots.put(slot)
        slot = self._free_slots.get()
        start = slot * self._chunk_bytes
        staged = self._staging[start:start + piece.numel()]
        stream = torch.cuda.current_stream(piece.device)
        with torch.cuda.stream(stream):
            staged.copy_(piece, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(stream)
        return _Chunk(staged, offset, ready, slot)

    def _drain(self, index: int) -> None:
        """One file's thread: write its chunks in arrival order; a slot goes back to the window once written."""
        while (chunk := self._queues[index].get()) is not None:
            try:
                if self._error is None:
                    if chunk.ready is not None:
                        chunk.ready.synchronize()
                    descriptor = self._descriptors[index]
                    assert descriptor is not None  # a file that could not be created failed the writer
                    with self._active:
                        _write_all(descriptor, memoryview(chunk.data.numpy()), chunk.offset)
            except BaseException as error:
                self._fail(error)
            finally:
                if chunk.slot is not None:
                    self._free_slots.put(chunk.slot)

    def _fail(self, error: BaseException) -> None:
        with self._error_lock:
            if self._error is None:
                self._error = error


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
