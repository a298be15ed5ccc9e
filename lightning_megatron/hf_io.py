"""Fast safetensors I/O shared by the bridges: sharded writes by several threads (and ranks), sliced reads.

Writing: the safetensors library serialises a whole shard in one call that holds the GIL, from host tensors. Here
every file is laid out from the tensors' names, shapes and dtypes first (`safetensors_layout`), so each tensor is
written at its place as soon as it exists (`staged_write`: from a GPU through pinned buffers, the copy of the
next chunk overlapping the writes, one thread per file). The files are ordinary safetensors files (safetensors'
own tensor order and alignment).

Reading: `CheckpointReader` opens every file of a checkpoint once and hands out the tensors, or only the rows or
columns a rank owns, through safetensors' slice API (views of the memory-mapped file: nothing is read until the
bytes are copied); `Copier` copies such slices into parameters on several threads (`copy_` releases the GIL), so
reading the page cache or disk overlaps with the copies into the parameters (host or device).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
import threading
from collections.abc import Collection, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from lightning_megatron.staged_write import WRITER_THREADS, FileLayout, StagedWriter

SHARD_BYTES = 4 * 1024**3
READER_THREADS = 8
STAGING_BYTES = 16 * 1024**2
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "U8": torch.uint8,
                      "I8": torch.int8, "BOOL": torch.bool}
_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def safetensors_files(hf_path: Path) -> list[Path]:
    return sorted(Path(hf_path).glob("*.safetensors"))


def rotary_position_ids(rotary: torch.nn.Module, position_ids: torch.Tensor) -> torch.Tensor:
    """The ids an HF rotary embedding takes for text positions `[batch, positions]`: a multi-axis one (Qwen3.5's,
    with `mrope_section`) one row per axis, as its model expands them (transformers >= 5.17 no longer expands 2-D
    ids inside the rotary)."""
    sections = getattr(rotary, "mrope_section", None)
    if sections is None or position_ids.ndim != 2:
        return position_ids
    return position_ids.expand(len(sections), *position_ids.shape)


def hf_module_state(state: Mapping[str, torch.Tensor], read: Any, prefix: str, stored: Collection[str]
                    ) -> dict[str, torch.Tensor]:
    """A transformers module's state dict (`state`: its own, for the names and shapes) read from a checkpoint's
    tensors under `prefix` (`read(name)` returns one; `stored`: the checkpoint's tensor names). Most checkpoints store
    routed experts one by one (`experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`); transformers 5 fuses them into
    `experts.gate_up_proj` [experts, 2 x ffn, hidden] (gate rows first) and `experts.down_proj`, which some
    checkpoints store as they are (Qwen3.5-MoE's decoder layers). A tensor without elements that the checkpoint does
    not store keeps the module's own: GLM-4.5's and DeepSeek-V3's shared MLP with `n_shared_experts: 0`, whose
    checkpoints have no shared-expert tensors."""
    loaded = {}
    for name, value in state.items():
        experts = prefix + name.rsplit(".", 1)[0] + "."
        if prefix + name in stored:
            loaded[name] = read(prefix + name)
        elif value.numel() == 0:
            loaded[name] = value
        elif name.endswith("experts.gate_up_proj"):
            loaded[name] = torch.stack([torch.cat([read(f"{experts}{e}.gate_proj.weight"),
                                                   read(f"{experts}{e}.up_proj.weight")]) for e in range(len(value))])
        elif name.endswith("experts.down_proj"):
            loaded[name] = torch.stack([read(f"{experts}{e}.down_proj.weight") for e in range(len(value))])
        else:
            loaded[name] = read(prefix + name)
    return loaded


@dataclass(frozen=True)
class TensorSpec:
    """One HF tensor as a checkpoint (or an export, or a wire) carries it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def checkpoint_tensor_specs(hf_path: Path) -> dict[str, TensorSpec]:
    """Name -> shape and dtype of every tensor in an HF checkpoint, read from the safetensors headers only."""
    specs = {}
    for file in safetensors_files(hf_path):
        with safe_open(file, framework="pt") as reader:
            for name in reader.keys():
                tensor_slice = reader.get_slice(name)
                specs[name] = TensorSpec(name, tuple(tensor_slice.get_shape()),
                                         SAFETENSORS_DTYPES[tensor_slice.get_dtype()])
    return specs


def checkpoint_tensor_dtypes(hf_path: Path) -> dict[str, torch.dtype]:
    """Name -> dtype of every tensor in an HF checkpoint, read from the safetensors headers only."""
    return {name: spec.dtype for name, spec in checkpoint_tensor_specs(hf_path).items()}



def plan_shards(sizes: Mapping[str, int], shard_bytes: int = SHARD_BYTES) -> list[list[str]]:
    """Tensor names grouped into shards of at most `shard_bytes` (a bigger tensor gets its own), in name order."""
    shards: list[list[str]] = [[]]
    used = 0
    for name in sorted(sizes):
        if shards[-1] and used + sizes[name] > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    return shards


def plan_parallel_shards(sizes: Mapping[str, int], files: int = WRITER_THREADS,
                         shard_bytes: int = SHARD_BYTES) -> list[list[str]]:
    """Tensor names spread over shards of about equal bytes, each in name order: `files` of them (more where a
    shard would pass `shard_bytes`, fewer where there are fewer tensors), so that as many threads write them at
    once (`staged_write` writes one file per thread). For the few tensors a weight sync rewrites (an MTP head, LoRA
    adapters' linears), which `plan_shards` would put into one file written by one thread."""
    count = max(1, min(len(sizes), max(files, math.ceil(sum(sizes.values()) / shard_bytes))))
    shards: list[list[str]] = [[] for _ in range(count)]
    loads = [0] * count
    for name in sorted(sizes, key=lambda name: (-sizes[name], name)):  # the largest first, onto the lightest
        lightest = min(range(count), key=lambda index: (loads[index], index))
        shards[lightest].append(name)
        loads[lightest] += sizes[name]
    return [sorted(shard) for shard in shards]


def shard_file_names(count: int, prefix: str = "model") -> list[str]:
    """HF's file names: one `model.safetensors`, or `model-0000i-of-0000n.safetensors` (`prefix` for `model`)."""
    if count == 1:
        return [f"{prefix}.safetensors"]
    return [f"{prefix}-{index:05d}-of-{count:05d}.safetensors" for index in range(1, count + 1)]


def safetensors_layout(specs: Iterable[TensorSpec]) -> FileLayout:
    """The safetensors file of these tensors: its header and each tensor's place, known before any tensor is."""
    # safetensors' own order (widest dtype first, then name) keeps every tensor aligned to its element size
    ordered = sorted(specs, key=lambda spec: (-spec.dtype.itemsize, spec.name))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in ordered:
        header[spec.name] = {"dtype": _DTYPE_NAMES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    prefix = struct.pack("<Q", len(encoded)) + encoded
    regions = {}
    for spec in ordered:
        start, stop = header[spec.name]["data_offsets"]  # type: ignore[index]
        regions[spec.name] = (len(prefix) + start, stop - start)
    return FileLayout(prefix, regions)


def shard_writer(folder: Path, files: Mapping[str, Iterable[TensorSpec]], threads: int = WRITER_THREADS
                 ) -> StagedWriter:
    """A writer of the safetensors files `{file name: the specs of its tensors}` in `folder`; tensors go in by name,
    in any order (`staged_write`: pinned staging from a GPU, one thread per file)."""
    return StagedWriter({Path(folder) / name: safetensors_layout(specs) for name, specs in files.items()},
                        threads=threads)


def write_shard_files(folder: Path, files: Mapping[str, Mapping[str, torch.Tensor]],
                      threads: int = WRITER_THREADS) -> None:
    """Write `{file name: tensors}` (on the host or a GPU) into `folder`, several files at a time.

    The tensors go in turn from each file (one of the first file, one of the second, ...), so that every file's
    thread has work from the start even where the writer's device budget binds (GPU tensors made for the write):
    the fastest order for the writer, which is why the benchmarks' raw reference write is this function.
    """
    specs = {file: [TensorSpec(name, tuple(tensor.shape), tensor.dtype) for name, tensor in tensors.items()]
             for file, tensors in files.items()}
    with shard_writer(folder, specs, threads) as writer:
        for row in itertools.zip_longest(*(tensors.items() for tensors in files.values())):
            for name, tensor in filter(None, row):
                writer.write(name, tensor)


def write_index(folder: Path, shards: list[list[str]], sizes: Mapping[str, int]) -> None:
    """HF's `model.safetensors.index.json` for a sharded checkpoint (nothing for a single file)."""
    if len(shards) == 1:
        return
    weight_map = {name: file for file, shard in zip(shard_file_names(len(shards)), shards) for name in shard}
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_safetensors(folder: Path, tensors: Mapping[str, torch.Tensor], shard_bytes: int = SHARD_BYTES) -> None:
    """One `model.safetensors`, or shards of at most `shard_bytes` with an index, as HF writes them."""
    sizes = {name: tensor.nbytes for name, tensor in tensors.items()}
    shards = plan_shards(sizes, shard_bytes)
    names = shard_file_names(len(shards))
    files = {file: {name: tensors[name] for name in shard} for file, shard in zip(names, shards)}
    write_shard_files(folder, files)
    write_index(folder, shards, sizes)


@dataclass
class LoadReport:
    """What an HF load did on this rank: bytes read from the checkpoint's files, parameters filled straight from
    (slices of) checkpoint tensors, parameters filled through the library's own conversion of whole tensors, or
    `library`: the library's own loader did it all."""

    bytes_read: int = 0
    sliced: int = 0
    converted: int = 0
    library: bool = False


@dataclass(frozen=True)
class Source:
    """Part of one checkpoint tensor: the whole tensor (`dim` None), or indices [start, stop) along `dim`; viewed
    as `shape` when given (a contiguous run of rows regrouped, e.g. into attention heads); cast to `via` before
    the parameter's own dtype when given (a library that rounds through the model's dtype first)."""

    name: str
    dim: int | None = None
    start: int = 0
    stop: int = 0
    shape: tuple[int, ...] | None = None
    via: torch.dtype | None = None

    def result_shape(self, tensor_shape: Sequence[int]) -> tuple[int, ...] | None:
        """The shape `CheckpointReader.read` gives for this source of a tensor of `tensor_shape`; None when the
        source does not fit the tensor (indices past its end, or a view that regroups a non-contiguous slice)."""
        shape = list(tensor_shape)
        if self.dim is not None:
            if not (0 <= self.dim < len(shape) and 0 <= self.start < self.stop <= shape[self.dim]):
                return None
            shape[self.dim] = self.stop - self.start
        if self.shape is None:
            return tuple(shape)
        if self.dim not in (None, 0) or math.prod(shape) != math.prod(self.shape):
            return None
        return self.shape


@dataclass(frozen=True)
class Piece:
    """A view into a parameter and what fills it: a checkpoint `Source`, or zeros (`source` None: the padding rows
    of a vocabulary that Megatron rounds up)."""

    target: torch.Tensor
    source: Source | None


class CheckpointReader:
    """Every tensor of an HF checkpoint folder by name, each safetensors file opened once.

    `read` gives a whole tensor or one slice of it; `bytes_read` counts the bytes of all that was read, which is
    what a rank pulls from the files (the slices are views of the memory map until copied).
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"] if index.is_file() else {}
        files = sorted(set(weight_map.values()) if weight_map else {p.name for p in self.folder.glob("*.safetensors")})
        self._handles: dict[str, Any] = {}
        for file in files:
            handle = safe_open(str(self.folder / file), framework="pt", device="cpu")
            for name in handle.keys():
                if weight_map and weight_map.get(name) != file:
                    continue
                if name in self._handles:
                    raise ValueError(f"{self.folder}: {name} is in more than one safetensors file and there is no "
                                     "model.safetensors.index.json to say which one counts; remove the duplicate")
                self._handles[name] = handle
        missing = sorted(set(weight_map) - set(self._handles))
        if missing:
            raise ValueError(f"{index} names {len(missing)} tensor(s) its files lack, e.g. {missing[:3]}")
        self._specs: dict[str, tuple[tuple[int, ...], torch.dtype | None]] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0

    def __contains__(self, name: str) -> bool:
        return name in self._handles

    def names(self) -> list[str]:
        return sorted(self._handles)

    def _handle(self, name: str) -> Any:
        if name not in self._handles:
            raise KeyError(f"{name} is in no safetensors file of {self.folder}")
        return self._handles[name]

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype | None]:
        """Shape and dtype (None for one torch has no name for here) from the file header; reads no tensor data."""
        if name not in self._specs:
            tensor_slice = self._handle(name).get_slice(name)
            self._specs[name] = (tuple(tensor_slice.get_shape()), SAFETENSORS_DTYPES.get(tensor_slice.get_dtype()))
        return self._specs[name]

    def read(self, source: Source, *, count: bool = True) -> torch.Tensor:
        """The tensor or slice `source` names (a view of the file where safetensors gives one); `count=False` for a
        look that may not be used (`count` it if it is)."""
        handle = self._handle(source.name)
        if source.dim is None:
            tensor = handle.get_tensor(source.name)
        else:
            index = (slice(None),) * source.dim + (slice(source.start, source.stop),)
            tensor = handle.get_slice(source.name)[index]
        if source.shape is not None:
            tensor = tensor.view(source.shape)
        if count:
            self.count([tensor])
        return tensor

    def count(self, tensors: Iterable[torch.Tensor]) -> None:
        """Add tensors read from the files to `bytes_read`."""
        with self._lock:
            self.bytes_read += sum(tensor.nbytes for tensor in tensors)


def reader_threads() -> int:
    """Reader threads per process: up to `READER_THREADS`, sharing the cores with the other local ranks."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(READER_THREADS, cores // max(1, local_ranks)))


class _DeviceStaging:
    """One reader thread's way onto the GPU: its own CUDA stream and two pinned host buffers, so that the host copy
    of one chunk (from the memory-mapped file) overlaps the transfer of the chunk before (a pageable copy would do
    both in turn, in the driver)."""

    def __init__(self, nbytes: int, after: torch.cuda.Event) -> None:
        self.stream = torch.cuda.Stream()
        self.stream.wait_event(after)  # what the caller queued on the parameters before the load comes first
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """`target.copy_(source)` chunk by chunk along dim 0; done once `stream` is synchronised."""
        row_bytes = source.nbytes // source.shape[0]
        rows = self.buffers[0].nbytes // row_bytes
        with torch.cuda.stream(self.stream):
            for start in range(0, source.shape[0], rows):
                count = min(rows, source.shape[0] - start)
                index, self.turn = self.turn, 1 - self.turn
                if self.events[index] is not None:
                    self.events[index].synchronize()  # its previous chunk has reached the GPU
                staged = self.buffers[index][:count * row_bytes].view(source.dtype).view(count, *source.shape[1:])
                staged.copy_(source.narrow(0, start, count))
                target.narrow(0, start, count).copy_(staged, non_blocking=True)
                self.events[index] = torch.cuda.Event()
                self.events[index].record(self.stream)


class Copier:
    """Fills parameters from checkpoint slices on several threads while the caller goes on planning the next ones.

    Parameters on a GPU are filled through pinned buffers (`_DeviceStaging`, `staging_bytes` each, two per thread).
    Use as a context manager: leaving it waits for every copy and raises the first failure.
    """

    def __init__(self, reader: CheckpointReader, threads: int | None = None, staging_bytes: int | None = None) -> None:
        self.reader = reader
        self.staging_bytes = staging_bytes or STAGING_BYTES
        self._pool = ThreadPoolExecutor(max_workers=threads or reader_threads(), thread_name_prefix="hf-load")
        self._futures: list[Future] = []
        self._thread = threading.local()
        self._stagings: list[_DeviceStaging] = []
        self._submitted: torch.cuda.Event | None = None

    def __enter__(self) -> Copier:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            for future in self._futures:
                if exc_info[0] is None:
                    future.result()
                else:
                    future.cancel()
        finally:
            self._pool.shutdown(wait=True)
            for staging in self._stagings:
                staging.stream.synchronize()

    def submit(self, pieces: Sequence[Piece]) -> None:
        for piece in pieces:
            if piece.target.is_cuda and self._submitted is None:
                self._submitted = torch.cuda.Event()
                self._submitted.record(torch.cuda.current_stream(piece.target.device))
            self._futures.append(self._pool.submit(self._copy, piece))

    def _copy(self, piece: Piece) -> None:
        target = piece.target
        if target.is_cuda:  # a new thread's current device is cuda:0, whatever this rank's is
            torch.cuda.set_device(target.device)
        if piece.source is None:
            target.zero_()
            return
        source = self.reader.read(piece.source)
        if piece.source.via is not None:
            source = source.to(piece.source.via)
        if target.is_cuda and source.ndim and source.numel() and source.nbytes // source.shape[0] <= self.staging_bytes:
            self._staging(target.device).copy(target, source)
        else:
            target.copy_(source)

    def _staging(self, device: torch.device) -> _DeviceStaging:
        staging = getattr(self._thread, "staging", None)
        if staging is None:
            with torch.cuda.device(device):
                staging = self._thread.staging = _DeviceStaging(self.staging_bytes, self._submitted)
            self._stagings.append(staging)
        return staging


def checked_pieces(pieces: Sequence[Piece] | None, parameter: torch.Tensor,
                   reader: CheckpointReader) -> Sequence[Piece] | None:
    """`pieces` when they fill all of `parameter` with sources of exactly their shapes, else None (the caller then
    falls back to the library's own conversion: a plan that does not add up never loads)."""
    if pieces is None or sum(piece.target.numel() for piece in pieces) != parameter.numel():
        return None
    for piece in pieces:
        if piece.source is None:
            continue
        shape, dtype = reader.spec(piece.source.name)
        if dtype is None or piece.source.result_shape(shape) != tuple(piece.target.shape):
            return None
    return pieces
