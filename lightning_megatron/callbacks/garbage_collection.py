"""Python's garbage collector run by the step count instead of by allocation thresholds.

Why: with the automatic collector on, a full (generation 2) collection starts whenever enough objects survived the
younger ones, at some step no one chose; in a process that imported Lightning, Megatron-Core and the bridges it
scans ~0.8 million objects, and a step of a large model stalls by a few hundred milliseconds, at different steps on
different ranks, so every rank waits for the slowest at the next collective. Megatron-LM turns the automatic
collector off and collects every N iterations (`--manual-gc`, `--manual-gc-interval`), NeMo has a
`GarbageCollection` callback; this is the Lightning callback of the same idea.

While training: the automatic collector is off, everything alive once training starts (modules, imports, the
model's Python objects) is collected once and then frozen (`gc.freeze`: later collections skip it, so they scan
only what training made), and a full collection runs after every `every_n_steps`-th optimizer step, the same steps
on every rank (`trainer.global_step`). At the end of training, or when it fails, the collector is on again (if it
was) and nothing is frozen.
"""

from __future__ import annotations

import gc
from typing import Any

import lightning.pytorch as pl


class ManualGarbageCollection(pl.Callback):
    """Collect garbage after every `every_n_steps`-th optimizer step, with the automatic collector off meanwhile.

    Args:
        every_n_steps: optimizer steps between two collections (a positive integer).
        freeze: collect once at the start of training and freeze what survives; unfrozen at the end, so that the
            model and its cycles can be freed after training (`gc.unfreeze` thaws everything: also the few hundred
            objects CPython itself freezes at startup, which full collections then scan again).
    """

    def __init__(self, every_n_steps: int = 100, freeze: bool = True) -> None:
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"ManualGarbageCollection: every_n_steps must be a positive integer, got "
                             f"{every_n_steps!r}; pass e.g. every_n_steps=100")
        self.every_n_steps = every_n_steps
        self.freeze = freeze
        self._was_enabled: bool | None = None  # None: not training (nothing to restore)
        self._froze = False
        self._collected_at: int | None = None  # a step Lightning accumulates over ends several batches

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._was_enabled = gc.isenabled()
        gc.disable()
        if self.freeze:
            gc.collect()
            gc.freeze()
            self._froze = True

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step % self.every_n_steps == 0 and step != self._collected_at:
            gc.collect()
            self._collected_at = step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        if self._froze:
            gc.unfreeze()
            self._froze = False
        if self._was_enabled:
            gc.enable()
        self._was_enabled, self._collected_at = None, None
