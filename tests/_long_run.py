"""One rank of a 2-process fit that the long-run tests interrupt: `python -m tests._long_run MODE WORKDIR HF RANK PORT`.

MODE "sigterm": async saves every 2 steps and `PreemptionCheckpoint`; each step end writes `WORKDIR/rank{R}.step`
and then sleeps, so that the test can send SIGTERM (to one rank) mid-epoch.
MODE "sigterm_one_process": a one-process fit whose `PreemptionCheckpoint` gets SIGTERM after step 2; the script
catches the `SystemExit(143)`, writes `WORKDIR/went_on` and ends normally (status 0). RANK is ignored.
MODE "kill": async saves every 2 steps plus `last.ckpt`; rank 1 kills itself (SIGKILL) at the start of step 5,
while `last.ckpt` of step 4 is still being written in the background.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

STEPS = 6


class Pace(pl.Callback):
    def __init__(self, workdir: Path, rank: int) -> None:
        self.marker = workdir / f"rank{rank}.step"

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.marker.write_text(str(trainer.global_step))
        if trainer.global_step >= 2:
            time.sleep(1.0)


class KillWhileSaving(pl.Callback):
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 4 and trainer.global_rank == 1:
            assert trainer.strategy._saves.in_flight is not None, "no save in flight to die during"
            os.kill(os.getpid(), signal.SIGKILL)


class SigtermAfterStep2(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)


def main(mode: str, workdir: Path, hf_checkpoint: str, rank: int, port: str) -> None:
    from lightning_megatron.callbacks import PreemptionCheckpoint
    from tests.test_long_runs import fit

    if mode == "sigterm_one_process":
        from tests.test_strategy import _fit

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")

        try:
            _fit(workdir, Path(hf_checkpoint), STEPS, callbacks=(SigtermAfterStep2(), PreemptionCheckpoint()),
                 trainer_kwargs=dict(enable_checkpointing=True))
        except SystemExit as stopped:
            (workdir / "went_on").write_text(str(stopped.code))
        return

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_RANK=str(rank), RANK=str(rank),
                      WORLD_SIZE="2")
    saver = pl.callbacks.ModelCheckpoint(dirpath=workdir / "ckpts", every_n_train_steps=2, save_top_k=-1,
                                         save_last=mode == "kill")
    extra = (Pace(workdir, rank), PreemptionCheckpoint()) if mode == "sigterm" else (KillWhileSaving(),)
    fit(workdir / f"rank{rank}", hf_checkpoint, STEPS, callbacks=(*extra, saver), async_save=True)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5])
