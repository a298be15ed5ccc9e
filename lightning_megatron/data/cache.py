"""The tokenized-data cache: a file is tokenized once, memory-mapped by every rank, and found again by later runs.

Without it every rank of every run read, validated and tokenized the whole file and held every row as two torch
tensors (a million rows: about 20 minutes and 6 GB a rank). With it:

- Key: xxh3-128 of everything the cached rows depend on: the data's bytes (``sources.fingerprint``) and the format
  they are read as, the tokenizer
  (its full serialized state, chat template, class and special tokens: ``tokenizer_fingerprint``), ``seq_length``,
  the ``overlong`` policy, the packing mode, the CP alignment, the transformers version and ``FORMAT_VERSION``. A
  changed input gives a new key, hence a new folder; nothing is ever updated in place. The key is printed.
- One writer: a file lock per key (``filelock``) around build-then-publish. The first process to take it builds;
  every other rank or run waits on the lock (no collective, so data knows no parallel state) and then reads. The
  builder tokenizes with a pool of ``workers`` processes, so the node's cores work while the other ranks wait:
  the same throughput as splitting the rows over the local ranks, without their coordination, and the same for a
  single run. Chunks come back in order, so the rows are in file order whatever the pool size.
- Atomic: the folder is filled under a hidden staging name and renamed into place (``atomic.write_atomically``),
  its ``manifest.json`` written last with every file's size and xxh3-64. Opening checks the sizes and checksums
  (about a second per GB); a damaged folder (truncated, edited) is reported and rebuilt, never read.
- Format: Arrow IPC files (pyarrow, a well-kept library with a stable, self-describing format), memory-mapped and
  read without copying. ``rows.arrow`` holds ``input_ids`` (``large_list<int32>``), ``response_mask``
  (``large_list<uint8>``, the same offsets) and ``row`` (where the row is, for messages); a list column is exactly
  flat values + offsets, so a row is two slices. ``plan.arrow`` holds the packing plan (``bins``, one
  ``list<int32>`` per packed row), computed once by ``first_fit`` from the lengths alone. A rank's memory is the
  lengths array (8 bytes a row) plus the pages it touches.
- Where: ``cache_dir`` if given, else ``lightning_megatron/data`` in the user's cache directory (``$XDG_CACHE_HOME``,
  else ``~/.cache``), where HF ``datasets`` keeps its own: not beside the data, whose folder is often read-only,
  shared, or inside a package (the configs' tiny sets). Several nodes share one cache only on a file system whose
  locks work across them; else give each node its own.
"""

from __future__ import annotations

import json
import mmap
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_megatron.atomic import remove_folder, write_atomically, write_file_atomically
from lightning_megatron.data.jsonl import VALID_ROW_HELP, DataValidationError, raise_for_bad_rows
from lightning_megatron.data.packing import first_fit
from lightning_megatron.data.sources import (
    data_format,
    fingerprint,
    iter_raw_rows,
    parse_raw_row,
    size_of,
    source_name,
)
from lightning_megatron.data.tokenize import Overlong, TokenizedExample, fit_example, quiet_length_warning

# 2: messages keep their other keys (tool_calls, ...), a turn found by prefix renders ends at its last special token
# (not only eos), the manifest counts truncated rows
FORMAT_VERSION = 2
CHUNK_ROWS = 256  # rows a pool worker tokenizes at a time
# The map's pages are dropped from the reading process every this many rows: the kernel reads ahead ~64 KiB around
# every row it faults in, so without it a rank's resident memory grows with every row it has touched (clean, shared
# pages of the page cache, but counted in its RSS); the rows stay valid and fault back in when read again.
RELEASE_EVERY_ROWS = 512
_KEPT_PROBLEMS = 5  # problem messages kept in full (raise_for_bad_rows shows that many and counts the rest)


@dataclass(frozen=True)
class CacheSpec:
    """What the cached rows depend on besides the data and the tokenizer."""

    seq_length: int
    overlong: Overlong
    packing: bool | str  # False, True or "tree" (only True stores a packing plan)
    alignment: int  # every packed sequence is padded to a multiple of it (2 x CP)


def default_cache_root() -> Path:
    """``lightning_megatron/data`` in the user's cache directory (``$XDG_CACHE_HOME``, else ``~/.cache``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lightning_megatron" / "data"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """xxh3-128 of what decides how a tokenizer turns rows into ids: its serialized state (vocabulary, merges,
    normalizer, pre- and post-processor, added tokens), chat template, class and special tokens."""
    import xxhash

    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = json.dumps({
        "class": type(tokenizer).__name__, "chat_template": getattr(tokenizer, "chat_template", None),
        "special_ids": list(tokenizer.all_special_ids), "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id, "bos": tokenizer.bos_token_id, "size": len(tokenizer),
    }, sort_keys=True, default=str)
    return xxhash.xxh3_128(state.encode() + b"\0" + extra.encode()).hexdigest()


def cache_key(data_path: str | Path, tokenizer: Any, spec: CacheSpec) -> str:
    import transformers
    import xxhash

    # the data's format too: the same bytes under a .parquet name are not JSONL rows (and are refused, cache or not)
    parts = {"format": FORMAT_VERSION, "data": fingerprint(data_path), "read_as": data_format(data_path),
             "tokenizer": tokenizer_fingerprint(tokenizer),
             "transformers": transformers.__version__, **asdict(spec)}
    return xxhash.xxh3_128(json.dumps(parts, sort_keys=True).encode()).hexdigest()


class TokenizedRows(Sequence[TokenizedExample]):
    """The cached rows of one data file, memory-mapped: ``rows[i]`` is a :class:`TokenizedExample` (its tensors
    copied out of the map), ``lengths`` every row's token count, ``plan`` the packing plan (with ``packing=True``).
    Picklable (a DataLoader worker reopens the files), so it never travels as data."""

    def __init__(self, folder: Path, data_path: str | Path, manifest: dict[str, Any]) -> None:
        self.folder, self.data_path, self.manifest = Path(folder), str(data_path), manifest
        self.key: str = manifest["key"]
        self.dropped: int = manifest["dropped"]
        self.truncated: int = manifest["truncated"]
        self._open()

    def _open(self) -> None:
        table, self._map = _map_arrow(self.folder / "rows.arrow")
        self._reads = 0
        self._ids = [chunk.values.to_numpy() for chunk in table.column("input_ids").chunks]
        self._masks = [chunk.values.to_numpy() for chunk in table.column("response_mask").chunks]
        self._offsets = [chunk.offsets.to_numpy() for chunk in table.column("input_ids").chunks]
        self._where = [chunk.to_numpy() for chunk in table.column("row").chunks]
        self._starts = np.cumsum([0] + [len(offsets) - 1 for offsets in self._offsets])
        self.lengths = np.concatenate([np.diff(offsets) for offsets in self._offsets] or [np.zeros(0, np.int64)])
        self.plan = _Plan(self.folder / "plan.arrow") if (self.folder / "plan.arrow").is_file() else None

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> TokenizedExample:  # type: ignore[override]
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        chunk = int(np.searchsorted(self._starts, index, side="right")) - 1
        local = index - int(self._starts[chunk])
        start, end = int(self._offsets[chunk][local]), int(self._offsets[chunk][local + 1])
        source = source_name(self.data_path, int(self._where[chunk][local]), self.manifest["lines"])
        row = TokenizedExample(source, torch.from_numpy(self._ids[chunk][start:end].astype(np.int64)),
                               torch.from_numpy(self._masks[chunk][start:end].astype(np.bool_)))
        self._reads += 1
        if self._reads % RELEASE_EVERY_ROWS == 0:
            self._map.madvise(mmap.MADV_DONTNEED)
        return row

    def __getstate__(self) -> dict[str, Any]:
        return {"folder": self.folder, "data_path": self.data_path, "manifest": self.manifest}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["folder"], state["data_path"], state["manifest"])


class _Plan(Sequence[np.ndarray]):
    """The stored packing plan: ``plan[i]`` is the row indices packed into packed row ``i``."""

    def __init__(self, path: Path) -> None:
        bins = _read_arrow(path).column("bins").combine_chunks()
        self._members, self._offsets = bins.values.to_numpy(), bins.offsets.to_numpy()

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index: int) -> np.ndarray:  # type: ignore[override]
        return self._members[self._offsets[index] : self._offsets[index + 1]]


def open_or_build(data_path: str | Path, tokenizer: Any, spec: CacheSpec, *, cache_root: str | Path | None = None,
                  workers: int = 1, progress_every_s: float = 10.0) -> tuple[TokenizedRows, bool]:
    """The cached rows of ``data_path`` for ``tokenizer`` and ``spec``, built first if no valid cache exists;
    returns ``(rows, built)`` (``built``: this call tokenized the data and wrote the cache). A cache found is only
    read, so a read-only ``cache_root`` that holds it serves; one that must be built needs a writable one."""
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    key = cache_key(data_path, tokenizer, spec)
    folder = root / key
    manifest, problem = _verified(folder)
    if manifest is not None:
        return TokenizedRows(folder, data_path, manifest), False
    lock = _locked(root, key, data_path)
    try:
        manifest, problem = _verified(folder)  # another rank or run may have built it while this one waited
        if manifest is not None:
            return TokenizedRows(folder, data_path, manifest), False
        if problem is not None:
            _say(f"{folder}: damaged tokenized-data cache ({problem}); rebuilding it")
        _remove_abandoned_writes(root, key)
        write_atomically(folder, lambda staging: _build(staging, data_path, tokenizer, spec, key, workers,
                                                        progress_every_s))
        manifest, problem = _verified(folder)
        if manifest is None:
            raise RuntimeError(f"{folder}: the tokenized-data cache just written does not verify: {problem}")
    finally:
        lock.release()
    return TokenizedRows(folder, data_path, manifest), True


def _remove_abandoned_writes(root: Path, key: str) -> None:
    """What a build of this key killed mid-way left (its hidden staging folder, a retired damaged one): with the
    key's lock held no other process is writing them, and nothing else would ever remove them (a killed build of a
    large file leaves gigabytes)."""
    for abandoned in [*root.glob(f".{key}.partial-*"), *root.glob(f".{key}.old-*")]:
        _say(f"{abandoned}: removing what an interrupted build of this cache left")
        remove_folder(abandoned, ignore_errors=True)


def _locked(root: Path, key: str, data_path: str | Path) -> Any:
    """The key's file lock in ``root``, taken; a ``root`` that cannot be made or written (read-only, a file, no
    permission) is refused naming the option, before anything is tokenized."""
    from filelock import FileLock

    lock = FileLock(str(root / f".{key}.lock"))
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except OSError as error:
        raise ValueError(
            f"{data_path} has no tokenized-data cache in {root} yet, and one cannot be written there ({error}); "
            "set data.cache_dir (SFTDataModule(cache_dir=...)) to a writable folder, or build the cache once "
            "where it can be written and copy its folder here"
        ) from None
    return lock


def _build(staging: Path, data_path: str | Path, tokenizer: Any, spec: CacheSpec, key: str, workers: int,
           progress_every_s: float) -> None:
    import pyarrow as pa
    from pyarrow import ipc

    schema = pa.schema([("input_ids", pa.large_list(pa.int32())), ("response_mask", pa.large_list(pa.uint8())),
                        ("row", pa.int64())])
    lines = data_format(data_path) == "jsonl"
    total_bytes = max(1, size_of(data_path))
    started = last_report = time.monotonic()
    rows = kept = dropped = truncated = problem_count = 0
    problems: list[str] = []
    lengths: list[np.ndarray] = []
    with pa.OSFile(str(staging / "rows.arrow"), "wb") as sink, ipc.new_file(sink, schema) as writer:
        for chunk in _tokenized_chunks(data_path, tokenizer, spec, workers):
            rows += chunk["rows"]
            dropped += chunk["dropped"]
            truncated += chunk["truncated"]
            problem_count += chunk["problem_count"]
            problems.extend(chunk["problems"][: _KEPT_PROBLEMS - len(problems)])
            if problem_count == 0 and len(chunk["lengths"]):
                offsets = pa.array(np.concatenate([[0], np.cumsum(chunk["lengths"])]), pa.int64())
                writer.write_batch(pa.record_batch([
                    pa.LargeListArray.from_arrays(offsets, pa.array(chunk["ids"], pa.int32())),
                    pa.LargeListArray.from_arrays(offsets, pa.array(chunk["mask"], pa.uint8())),
                    pa.array(chunk["where"], pa.int64())], schema=schema))
                lengths.append(chunk["lengths"])
                kept += len(chunk["lengths"])
            now = time.monotonic()
            if now - last_report >= progress_every_s:
                last_report = now
                share = f", {100 * chunk['bytes_done'] / total_bytes:.0f}% of the file" if lines else ""
                _say(f"{data_path}: tokenized {rows} rows ({rows / (now - started):.0f} rows/s{share})")
    if rows == 0:
        raise DataValidationError(f"{data_path} has no rows. {VALID_ROW_HELP}")
    raise_for_bad_rows(problems, rows, count=problem_count)
    if spec.packing is True:
        all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        spans = -(-all_lengths // spec.alignment) * spec.alignment
        bins = first_fit(spans.tolist(), spec.seq_length)
        members = pa.array(np.fromiter((i for members in bins for i in members), np.int32, len(all_lengths)))
        offsets = pa.array(np.cumsum([0] + [len(members) for members in bins]), pa.int32())
        plan = pa.table({"bins": pa.ListArray.from_arrays(offsets, members)})
        with pa.OSFile(str(staging / "plan.arrow"), "wb") as sink, ipc.new_file(sink, plan.schema) as writer:
            writer.write_table(plan)
    elapsed = time.monotonic() - started
    _say(f"{data_path}: tokenized {rows} rows in {elapsed:.1f} s ({rows / max(elapsed, 1e-9):.0f} rows/s), "
         f"{kept} kept ({truncated} truncated), {dropped} dropped; cache {staging.name.split('.partial')[0].lstrip('.')}")
    manifest = {"key": key, "format": FORMAT_VERSION, "data": str(data_path), "spec": asdict(spec), "rows": rows,
                "kept": kept, "dropped": dropped, "truncated": truncated, "lines": lines,
                "files": {file.name: {"size": file.stat().st_size, "xxh3_64": _checksum(file)}
                          for file in sorted(staging.glob("*.arrow"))}}
    write_file_atomically(staging / "manifest.json", lambda path: path.write_text(json.dumps(manifest, indent=1)))


def _tokenized_chunks(data_path: str | Path, tokenizer: Any, spec: CacheSpec, workers: int) -> Iterator[dict]:
    """The data's rows tokenized, ``CHUNK_ROWS`` at a time, in order: in this process, or in a pool of ``workers``."""
    chunks = _raw_chunks(data_path)
    lines = data_format(data_path) == "jsonl"
    if workers <= 1:
        _init_worker(tokenizer, spec, str(data_path), lines)
        yield from map(_tokenize_chunk, chunks)
        return
    # fork: the workers inherit the loaded tokenizer and modules instead of importing torch again
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # each worker tokenizes one row at a time
    unreadable: list[Exception] = []
    with context.Pool(workers, initializer=_init_worker,
                      initargs=(tokenizer, spec, str(data_path), lines)) as pool:
        yield from pool.imap(_tokenize_chunk, _until_failure(chunks, unreadable), chunksize=1)
    if unreadable:  # raised here as it was raised (the pool would re-raise it from a worker, its origin lost)
        raise unreadable[0]


def _until_failure(chunks: Iterator[tuple[list, int]], failures: list[Exception]) -> Iterator[tuple[list, int]]:
    """``chunks`` until reading the data fails; the error is kept in ``failures`` instead of raised into the pool's
    feeding thread."""
    try:
        yield from chunks
    except Exception as error:
        failures.append(error)


def _raw_chunks(data_path: str | Path) -> Iterator[tuple[list, int]]:
    chunk: list = []
    done = 0
    for number, raw in iter_raw_rows(data_path):
        chunk.append((number, raw))
        done += len(raw) if isinstance(raw, bytes) else 0
        if len(chunk) == CHUNK_ROWS:
            yield chunk, done
            chunk = []
    if chunk:
        yield chunk, done


_worker_state: dict[str, Any] = {}


def _init_worker(tokenizer: Any, spec: CacheSpec, data_path: str, lines: bool) -> None:
    _worker_state.update(tokenizer=tokenizer, spec=spec, data_path=data_path, lines=lines)


def _tokenize_chunk(item: tuple[list, int]) -> dict[str, Any]:
    """Parse, check, tokenize and fit one chunk of rows; flat arrays of the kept ones, the problems (first few)."""
    chunk, bytes_done = item
    tokenizer, spec, path, lines = (_worker_state[name] for name in ("tokenizer", "spec", "data_path", "lines"))
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    lengths, where, problems = [], [], []
    problem_count = dropped = truncated = 0
    with quiet_length_warning():
        for number, raw in chunk:
            source = source_name(path, number, lines)
            try:
                example = parse_raw_row(raw, source)
            except ValueError as error:
                tokenized, problem = None, f"{source}: {error}"
            else:
                tokenized, problem, cut = fit_example(example, tokenizer, max_tokens=spec.seq_length,
                                                      overlong=spec.overlong)
            if problem is not None:
                problem_count += 1
                if len(problems) < _KEPT_PROBLEMS:
                    problems.append(problem)
            elif tokenized is None:
                dropped += 1
            elif not problem_count:
                truncated += cut
                ids.append(tokenized.input_ids.numpy().astype(np.int32))
                masks.append(tokenized.response_mask.numpy().astype(np.uint8))
                lengths.append(len(tokenized))
                where.append(number)
    return {"rows": len(chunk), "dropped": dropped, "truncated": truncated, "problems": problems, "problem_count": problem_count,
            "ids": np.concatenate(ids) if ids else np.zeros(0, np.int32),
            "mask": np.concatenate(masks) if masks else np.zeros(0, np.uint8),
            "lengths": np.array(lengths, np.int64), "where": np.array(where, np.int64), "bytes_done": bytes_done}


def _verified(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(manifest, None)`` if the folder is a complete cache whose files match their sizes and checksums; else
    ``(None, what is wrong)`` (``(None, None)``: there is no folder)."""
    if not folder.is_dir():
        return None, None
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError) as error:
        return None, f"manifest.json unreadable: {error}"
    for name, expected in manifest["files"].items():
        file = folder / name
        if not file.is_file():
            return None, f"{name} is missing"
        if file.stat().st_size != expected["size"]:
            return None, f"{name} has {file.stat().st_size} bytes, the manifest says {expected['size']}"
        if _checksum(file) != expected["xxh3_64"]:
            return None, f"{name} does not match its checksum"
    return manifest, None


def _checksum(file: Path) -> str:
    import xxhash

    digest = xxhash.xxh3_64()
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)
    with file.open("rb", buffering=0) as handle:
        while read := handle.readinto(buffer):
            digest.update(view[:read])
    return digest.hexdigest()


def _read_arrow(path: Path) -> Any:
    return _map_arrow(path)[0]


def _map_arrow(path: Path) -> tuple[Any, mmap.mmap]:
    """The Arrow IPC file at ``path`` as a table whose buffers are views of a read-only map of the file (nothing is
    copied), and that map: dropping its pages from this process (``madvise(MADV_DONTNEED)``) keeps the table valid,
    the next read faults them back in from the page cache."""
    import pyarrow as pa

    with open(path, "rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    return pa.ipc.open_file(pa.BufferReader(pa.py_buffer(mapped))).read_all(), mapped


def _say(message: str) -> None:
    """Progress of whichever process builds (not necessarily rank 0), on stderr."""
    print(f"[lightning_megatron.data] {message}", file=sys.stderr, flush=True)
