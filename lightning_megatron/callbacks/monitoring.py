"""Callbacks that report on training: tokens per second, and the loss and MTP-acceptance curves as JSON and PNG.

`TrainingCurves` is also the example of a custom callback reading the per-step metrics the module and the strategy
log (`lm_loss`, `mtp_loss`, `mtp_accuracy`, `grad_norm`, `tokens_per_s`, and per validation `val_lm_loss`,
`val_mtp_acceptance`): they are in `trainer.callback_metrics` after each step.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

STEP_METRICS = ("lm_loss", "mtp_loss", "mtp_accuracy", "grad_norm", "tokens_per_s")
VALIDATION_METRICS = ("val_lm_loss", "val_mtp_acceptance", "val_mtp_sampled_acceptance")


class TokensPerSecond(pl.Callback):
    """Log `tokens_per_s`: the tokens of one global batch (all data-parallel ranks, padding included) over the wall
    time of its optimizer step, forward and backward included."""

    def __init__(self) -> None:
        self._started = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        _synchronize(trainer)
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        _synchronize(trainer)
        seconds = time.perf_counter() - self._started
        replicas = trainer.strategy.distributed_sampler_kwargs.get("num_replicas", 1)
        tokens = sum(microbatch["input_ids"].numel() for microbatch in batch) * replicas
        pl_module.log("tokens_per_s", tokens / seconds, on_step=True, on_epoch=False, prog_bar=True)


class TrainingCurves(pl.Callback):
    """Record the per-step and per-validation metrics and write `curves.json` and `curves.png` at the end of fit.

    Only global rank 0 writes; the metrics are the same on every rank.

    Args:
        dirpath: where `curves.json` and `curves.png` go (default: the first logger's log_dir, else the trainer's
            default_root_dir).
    """

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath
        self.steps: dict[str, list[tuple[int, float]]] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.steps = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._record(trainer, STEP_METRICS)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:  # here the epoch's metrics are computed; at on_validation_epoch_end not yet
            self._record(trainer, VALIDATION_METRICS)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # every rank asks: `Trainer.log_dir` broadcasts from rank 0, a collective the other ranks must join
        directory = Path(self.dirpath or (trainer.log_dir if trainer.loggers else None) or trainer.default_root_dir)
        if not trainer.is_global_zero:
            return
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "curves.json").write_text(json.dumps(self.steps, indent=1) + "\n")
        plot_curves(self.steps).savefig(directory / "curves.png", dpi=100)

    def _record(self, trainer: pl.Trainer, names: tuple[str, ...]) -> None:
        from lightning_megatron.callbacks.mtp_only import MTPOnlyCallback

        # an MTP-only step that skipped the main head logged no lm_loss; callback_metrics still holds the last one
        skipped = any(isinstance(callback, MTPOnlyCallback) and not callback.main_head_runs
                      for callback in trainer.callbacks)
        for name in names:
            if skipped and name == "lm_loss":
                continue
            value = trainer.callback_metrics.get(name)
            if value is not None and math.isfinite(float(value)):
                self.steps.setdefault(name, []).append((trainer.global_step, float(value)))


def plot_curves(steps: dict[str, list[tuple[int, float]]]):
    """Losses on the left, MTP acceptance on the right, against the optimizer step (matplotlib's Agg canvas)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4), layout="constrained")
    losses, acceptance = figure.subplots(1, 2)
    for name in ("lm_loss", "mtp_loss", "val_lm_loss"):
        if steps.get(name):
            x, y = zip(*steps[name])
            losses.plot(x, y, marker="o" if name.startswith("val_") else None, label=name)
    losses.set(xlabel="optimizer step", ylabel="loss", title="losses")
    for name, label in (("mtp_accuracy", "mtp_accuracy (train, vs labels)"),
                        ("val_mtp_acceptance", "val_mtp_acceptance (vs the model's greedy)"),
                        ("val_mtp_sampled_acceptance", "val_mtp_sampled_acceptance (speculative sampling)")):
        if steps.get(name):
            x, y = zip(*steps[name])
            acceptance.plot(x, y, marker="o" if name.startswith("val_") else None, label=label)
    acceptance.set(xlabel="optimizer step", ylabel="fraction", ylim=(0, 1), title="MTP draft acceptance")
    for axes in (losses, acceptance):
        if axes.lines:
            axes.legend()
    return figure


def _synchronize(trainer: pl.Trainer) -> None:
    if trainer.strategy.root_device.type == "cuda":
        torch.cuda.synchronize(trainer.strategy.root_device)
