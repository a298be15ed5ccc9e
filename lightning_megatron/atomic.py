"""The one "stage, then rename" write: a folder or a file is filled under a hidden name and renamed into place
when complete.

A reader never sees a half-written folder or file: a run killed mid-write leaves only the hidden staging name
(`.NAME.partial-PID` for a folder, `.NAME.XXXX.partial` for a file), which no reader picks. Used by HF exports,
training checkpoints, weight-sync versions, reports and the tiny-checkpoint makers. A spare file
(`preallocate_spare`, `.spare-NAME`) is a file allocated ahead of the write that will fill it, moved into the
staging folder by `take_spare`.
A leaf: it imports nothing of `lightning_megatron` but the distributed helpers.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_megatron.distributed import agree_on_failure, cpu_group

REMOVER_THREADS = 8


def write_atomically(path: Path, write: Any, *, every_rank: bool = False) -> None:
    """Fill a temporary sibling folder, then rename it into place; an earlier folder at `path` is replaced.

    `every_rank`: all ranks call it and `write` on the same folder (global rank 0 makes and renames it); when one
    rank fails, every rank raises and nothing is left behind; every rank returns only once the folder is in place.
    """
    collective = every_rank and dist.is_initialized() and dist.get_world_size() > 1
    leader = not collective or dist.get_rank() == 0
    staging = path.parent / f".{path.name}.partial-{os.getpid()}"
    if leader:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    if collective:
        container = [staging]
        dist.broadcast_object_list(container, src=0, group=cpu_group())
        staging = container[0]
    error: BaseException | None = None
    try:
        write(staging)
    except BaseException as caught:
        error = caught
    try:
        agree_on_failure(error, collective=collective)
        if leader:
            try:
                move_into_place(staging, path)
            except BaseException as caught:
                error = caught
        agree_on_failure(error, collective=collective)
    except BaseException:
        if leader:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def move_into_place(staging: Path, path: Path) -> None:
    """Rename the finished staging folder to `path`, replacing an earlier checkpoint of the same name."""
    if path.exists():
        retired = path.parent / f".{path.name}.old-{os.getpid()}"
        os.replace(path, retired)
        os.replace(staging, path)
        remove_folder(retired)
    else:
        os.replace(staging, path)


def remove_folder(folder: Path, *, ignore_errors: bool = False) -> None:
    """`shutil.rmtree`, the files directly in `folder` unlinked on several threads first: the kernel frees a
    file's pages in the unlink itself (on tmpfs about 0.1 s per GB), so the shards of a replaced or pruned
    checkpoint go in parallel rather than one after another."""
    try:
        files = [entry.path for entry in os.scandir(folder) if entry.is_file(follow_symlinks=False)]
    except OSError:
        files = []  # rmtree says why, or ignores it
    if len(files) > 1:
        with ThreadPoolExecutor(min(REMOVER_THREADS, len(files)), thread_name_prefix="remove") as pool:
            list(pool.map(_unlink_if_possible, files))
    shutil.rmtree(folder, ignore_errors=ignore_errors)


_RETIRED_NAMES = itertools.count()
_REMOVALS: list[threading.Thread] = []
_REMOVALS_LOCK = threading.Lock()


def remove_folder_soon(folder: Path) -> None:
    """Take `folder` out of sight now and delete it on a thread of its own: a caller that only needs it gone from
    its name (a pruned weight-sync version) does not wait while the kernel frees its pages (on tmpfs about 0.1 s
    per GB, as long as writing them). It is renamed `.NAME.old-PID-N` beside itself at once, the hidden name of a
    retired folder that cleanups of leftovers remove should the process die first; the thread is no daemon, so the
    process deletes it before it exits (`wait_for_removals` waits sooner). A folder that cannot be renamed is
    deleted here and now."""
    retired = folder.parent / f".{folder.name}.old-{os.getpid()}-{next(_RETIRED_NAMES)}"
    try:
        os.replace(folder, retired)
    except OSError:
        remove_folder(folder, ignore_errors=True)
        return
    thread = threading.Thread(target=remove_folder, args=(retired,), kwargs={"ignore_errors": True},
                              name=f"remove-{folder.name}")
    thread.start()
    with _REMOVALS_LOCK:
        _REMOVALS[:] = [*(running for running in _REMOVALS if running.is_alive()), thread]


def wait_for_removals() -> None:
    """Return once every folder `remove_folder_soon` was given is deleted."""
    with _REMOVALS_LOCK:
        running = list(_REMOVALS)
    for thread in running:
        thread.join()


def _unlink_if_possible(path: str) -> None:
    with contextlib.suppress(OSError):  # what is left, rmtree removes or reports
        os.unlink(path)


def write_file_atomically(path: Path, write: Callable[[Path], None], *, mode: int | None = None,
                          fsync: bool = False) -> None:
    """Call `write` on a hidden temporary sibling file, then rename it to `path` (an earlier file is replaced).

    `mode`: the file's permission bits (a temporary file is private to its owner). `fsync`: flush the bytes to the
    disk before the rename (for files another process polls).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    os.close(handle)
    temporary = Path(name)
    try:
        write(temporary)
        if fsync:
            with open(temporary, "rb") as file:
                os.fsync(file.fileno())
        if mode is not None:
            os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_text_atomically(path: Path, text: str, *, mode: int | None = None, fsync: bool = False) -> None:
    """`text` (UTF-8) to `path` through `write_file_atomically`."""
    write_file_atomically(path, lambda temporary: temporary.write_text(text, encoding="utf-8"), mode=mode,
                          fsync=fsync)


SPARE_FILE_PREFIX = ".spare-"  # hidden; what a killed run left, `serving.disk.remove_partials` clears


def preallocate_spare(directory: Path, name: str, size: int) -> Path | None:
    """A hidden file of `size` bytes in `directory` whose pages are allocated now (`os.posix_fallocate`), for a
    later write to fill instead of a new file (`take_spare`); None, and nothing left, where the file system cannot.
    On tmpfs a good part of a fresh file's write time is the kernel allocating and zeroing its pages."""
    path = Path(directory) / f"{SPARE_FILE_PREFIX}{name}"
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            os.posix_fallocate(descriptor, 0, size)
        finally:
            os.close(descriptor)
    except OSError:
        path.unlink(missing_ok=True)
        return None
    return path


def take_spare(spare: Path, target: Path, size: int) -> bool:
    """Rename `spare` to `target` (inside a staging folder, on the spare's file system) when it still has `size`
    bytes, else remove it; whether it was taken. The writer then writes over it (`staged_write.create_file` keeps a
    file of its layout's exact size)."""
    try:
        if spare.stat().st_size == size:
            os.rename(spare, target)
            return True
    except OSError:
        pass
    spare.unlink(missing_ok=True)
    return False
