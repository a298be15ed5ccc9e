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
"""

from __future__ import annotations

import shutil
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
        if self._queue is None:
            self._queue = AsyncCallsQueue(persistent=False)  # a forked writer per save: a copy-on-write snapshot
        self._queue.schedule_async_request(request)
        self._in_flight = path

    def begin_training(self) -> None:
        self._training = True

    def end_training(self) -> None:
        """The end of training: wait for the save in flight; later saves (after fit) are synchronous."""
        self.wait()
        self._training = False

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
