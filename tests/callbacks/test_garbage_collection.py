"""`ManualGarbageCollection`: while training, Python's automatic collector is off and full collections run after the
chosen optimizer steps only; afterwards the collector is on again and nothing is frozen. The collections are
observed through `gc.callbacks` (the interpreter's own report of each one) on a real Lightning fit whose steps make
cyclic garbage."""

import gc

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_megatron.callbacks import ManualGarbageCollection


class CyclicGarbage(pl.LightningModule):
    """A linear model whose every step leaves ~3000 reference cycles behind: enough to start the automatic
    collector's youngest generation (threshold 700) several times a step."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        for _ in range(3000):
            cycle: list = []
            cycle.append(cycle)
        return self.layer(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TrainingWindow(pl.Callback):
    """Open from the start of training to its end (listed first: its hooks run before the other callbacks'); notes
    the collector's state at each batch."""

    def __init__(self) -> None:
        self.open = False
        self.states: list[tuple[bool, bool]] = []  # (automatic collector on, objects frozen) at each batch

    def on_train_start(self, *args) -> None:
        self.open = True

    def on_train_batch_start(self, *args) -> None:
        self.states.append((gc.isenabled(), gc.get_freeze_count() > 0))

    def on_train_end(self, *args) -> None:
        self.open = False


def _collections_while_fitting(callbacks: list[pl.Callback], steps: int) -> tuple[list[tuple[int, int]],
                                                                                    TrainingWindow]:
    """(trainer.global_step, generation) of every collection from the start of training to its end."""
    seen: list[tuple[int, int]] = []
    window = TrainingWindow()
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[window, *callbacks])

    def observe(phase: str, info: dict) -> None:
        if phase == "start" and window.open:
            seen.append((trainer.global_step, info["generation"]))

    gc.callbacks.append(observe)
    try:
        trainer.fit(CyclicGarbage(), DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4))
    finally:
        gc.callbacks.remove(observe)
    return seen, window


def test_collections_run_only_after_the_chosen_steps_and_the_collector_is_restored():
    assert gc.isenabled()
    # without the callback the automatic collector runs during every step (what makes steps spike)
    automatic, _ = _collections_while_fitting([], steps=4)
    assert {0, 1, 2, 3} <= {step for step, _ in automatic}

    manual, window = _collections_while_fitting([ManualGarbageCollection(every_n_steps=3)], steps=7)
    # one full collection before freezing at the start (step 0), then after steps 3 and 6, nothing else
    assert manual == [(0, 2), (3, 2), (6, 2)]
    assert window.states == [(False, True)] * 7  # off and frozen while training
    assert gc.isenabled() and gc.get_freeze_count() == 0  # restored, and the model can be freed again


def test_the_collector_is_restored_when_training_fails():
    class Fails(CyclicGarbage):
        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            if batch_idx == 2:
                assert not gc.isenabled()
                raise RuntimeError("step 2 failed")
            return super().training_step(batch, batch_idx)

    trainer = pl.Trainer(max_steps=5, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[ManualGarbageCollection(every_n_steps=2)])
    with pytest.raises(RuntimeError, match="step 2 failed"):
        trainer.fit(Fails(), DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4))
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_every_n_steps_must_be_positive():
    with pytest.raises(ValueError, match="every_n_steps must be a positive integer"):
        ManualGarbageCollection(every_n_steps=0)
