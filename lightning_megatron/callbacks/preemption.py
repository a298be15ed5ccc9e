"""A clean stop on preemption: finish the step, save a checkpoint every rank agrees on, exit with status 143.

Lightning 2.x's own SIGTERM handling does not fit a sharded, collective save: its signal handler broadcasts from
inside the handler (a collective at an arbitrary point; when only one rank got the signal, the ranks' collectives
no longer pair up), and under SLURM with `auto_requeue` its SIGUSR1 handler saves a checkpoint from inside the
signal handler, in the middle of a step. `PreemptionCheckpoint` instead replaces those handlers for the training
loop with one that only notes the signal; after every optimizer step the ranks agree with one all-reduce of one
integer (on the host, gloo) whether any of them got one, so all stop after the same step even when the signal
reached one rank only. Then every rank saves `last.ckpt` through the strategy, waits until it is published (a
background save included), and the process exits with status 143 (128 + SIGTERM, what a shell reports for a process
ended by SIGTERM): schedulers treat it as "terminated, not finished", so SLURM with `--requeue` or a preemption
policy requeues it, and a Kubernetes/torchrun restart policy restarts it. Under Lightning's `SLURMEnvironment` with
`auto_requeue` (its default), its requeue signal (SIGUSR1) is handled the same way and global rank 0 asks SLURM to
requeue the job (`scontrol requeue`) before exiting, as Lightning does. Resume with `fit --ckpt_path last`.

The process ends once Python's exit handlers ran, before the interpreter finalizes (`exit_before_finalization`): a
rank that finalized right after the save's last collectives was now and then aborted (SIGABRT, not 143) by a gloo
worker thread of torch, which releases each collective's tensors after the caller has moved on. Only a job of several
ranks: a one-process fit (a notebook, a script that catches the `SystemExit`) may go on after it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_megatron.contract import megatron_strategy
from lightning_megatron.distributed import cpu_group, exit_before_finalization

PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM  # 143


class PreemptionCheckpoint(pl.Callback):
    """On SIGTERM (and SLURM's requeue signal), every rank finishes the current optimizer step, saves
    `dirpath/last.ckpt` synchronously and exits with `PREEMPTED_EXIT_CODE` (143).

    Args:
        dirpath: where `last.ckpt` goes; when not given, the folder of the first `ModelCheckpoint` (so that
            `fit --ckpt_path last` finds it), else `default_root_dir/checkpoints`.
    """

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath
        self._received = 0
        self._previous: dict[int, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        megatron_strategy(trainer, "PreemptionCheckpoint")  # refused now rather than when a signal comes
        self._received = 0
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionCheckpoint: fit runs outside the main thread, where Python cannot install "
                               "signal handlers; run fit in the main thread or remove the callback")
        for signum in self._signals(trainer):
            self._previous[signum] = signal.signal(signum, self._note)  # replaces Lightning's for the training loop

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        received = torch.tensor([self._received], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(received, op=dist.ReduceOp.MAX, group=cpu_group())
        if not received.item():
            return
        path = self.checkpoint_path(trainer)
        rank_zero_info(f"PreemptionCheckpoint: signal {received.item()} received; saving {path} at step "
                       f"{trainer.global_step}, then exiting with status {PREEMPTED_EXIT_CODE}")
        trainer.save_checkpoint(path)
        megatron_strategy(trainer, "PreemptionCheckpoint").finish_saves()  # a background save is published first
        if trainer.is_global_zero and self._requeue_job(trainer):
            job_id = os.environ["SLURM_JOB_ID"]
            rank_zero_info(f"PreemptionCheckpoint: requeueing SLURM job {job_id}")
            subprocess.run(["scontrol", "requeue", job_id], check=False)
        if dist.is_initialized() and dist.get_world_size() > 1:  # one rank of a job: it ends here
            exit_before_finalization(PREEMPTED_EXIT_CODE)  # every rank has its checkpoint: nothing left to agree on
        raise SystemExit(PREEMPTED_EXIT_CODE)  # Lightning tears down (on_exception, teardown), then Python exits

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    def checkpoint_path(self, trainer: pl.Trainer) -> Path:
        if self.dirpath is not None:
            return Path(self.dirpath) / "last.ckpt"
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath:
                return Path(callback.dirpath) / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}.ckpt"
        return Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self._received = int(signum)  # no collective, no I/O in a signal handler: the next step end acts on it

    def _signals(self, trainer: pl.Trainer) -> list[int]:
        environment = trainer.strategy.cluster_environment
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and environment.requeue_signal:
            return [signal.SIGTERM, int(environment.requeue_signal)]
        return [signal.SIGTERM]

    @staticmethod
    def _requeue_job(trainer: pl.Trainer) -> bool:
        environment = trainer.strategy.cluster_environment
        return isinstance(environment, SLURMEnvironment) and environment.auto_requeue and "SLURM_JOB_ID" in os.environ

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
