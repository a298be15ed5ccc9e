"""The draft head's quality at one weight version: its teacher-forced acceptance on a fixed probe set.

In an RL loop the policy changes every few steps and its MTP draft head with it (trained jointly, refreshed, or
frozen); rollouts run with version N's weights and head. `DraftProbe.measure` measures the head's acceptance at
version N, greedy and sampled at the rollout temperature, per MTP depth (`DraftAcceptance`), on the first
`batches` global batches of the validation data (or of a data module the user names), so that a weight sync can
log it and write it beside the weights for the rollout workers (`as_metrics`, `as_json`, `from_json`).

The module measures (`MeasuresDraftAcceptance`, which `SFTModule` implements on `mtp.draft_capture`); the probe
chooses the batches and leaves training as it found it: no gradients, every submodule back in its train/eval mode,
and every RNG (Python, NumPy, torch, CUDA, Megatron-Core's model-parallel streams) back in its state, so a run is
bit-exact whether the probe ran or not. Iterating a DataLoader draws from torch's RNG (its workers' base seed),
which is why the states are restored and not merely left alone.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import islice
from typing import Any, Protocol, cast, runtime_checkable

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_megatron.distributed import megatron_rng_states, set_megatron_rng_states
from lightning_megatron.microbatch import Microbatch

METRIC_PREFIX = "draft_acceptance"


@dataclass(frozen=True)
class DraftAcceptance:
    """The draft head's teacher-forced acceptance: `greedy[k - 1]` and `sampled[k - 1]` at MTP depth k (NaN where
    no position counted), sampled at `temperature`; `positions`: the positions counted at depth 1 (over all
    data-parallel and context-parallel ranks); `batches`: the global batches read; `seconds`: the probe's wall
    time (its cost per sync)."""

    greedy: tuple[float, ...]
    sampled: tuple[float, ...]
    temperature: float
    positions: int
    batches: int
    seconds: float

    @classmethod
    def from_totals(cls, totals: torch.Tensor, temperature: float, batches: int, seconds: float) -> DraftAcceptance:
        """From `[depths, 3]` pooled totals: greedy accepted, sampled overlap, counted (`mtp.draft_capture`)."""
        rows = [[float(value) for value in row] for row in totals.tolist()]
        greedy = tuple(accepted / counted if counted else math.nan for accepted, _, counted in rows)
        sampled = tuple(overlap / counted if counted else math.nan for _, overlap, counted in rows)
        return cls(greedy, sampled, temperature, int(rows[0][2]) if rows else 0, batches, seconds)

    def as_metrics(self) -> dict[str, float]:
        """Flat names for a logger: `draft_acceptance/greedy_depth<k>`, `.../sampled_depth<k>`, `.../probe_seconds`."""
        metrics = {}
        for depth, (greedy, sampled) in enumerate(zip(self.greedy, self.sampled, strict=True), start=1):
            metrics[f"{METRIC_PREFIX}/greedy_depth{depth}"] = greedy
            metrics[f"{METRIC_PREFIX}/sampled_depth{depth}"] = sampled
        metrics[f"{METRIC_PREFIX}/probe_seconds"] = self.seconds
        return metrics

    def as_json(self) -> dict[str, Any]:
        """JSON-safe (NaN: None), for the version's metadata; `from_json` reads it back."""
        return {"greedy": [_finite_or_none(value) for value in self.greedy],
                "sampled": [_finite_or_none(value) for value in self.sampled],
                "temperature": self.temperature, "positions": self.positions, "batches": self.batches,
                "seconds": self.seconds}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DraftAcceptance:
        """What `as_json` wrote (a rollout worker reading the served version's draft quality)."""
        missing = sorted({"greedy", "sampled", "temperature", "positions", "batches", "seconds"} - set(data))
        if missing:
            raise ValueError(f"draft acceptance record without {missing}: expected what DraftAcceptance.as_json "
                             "writes")
        greedy, sampled = (tuple(math.nan if value is None else float(value) for value in data[key])
                           for key in ("greedy", "sampled"))
        if len(greedy) != len(sampled):
            raise ValueError(f"draft acceptance record: {len(greedy)} greedy and {len(sampled)} sampled depths")
        return cls(greedy, sampled, float(data["temperature"]), int(data["positions"]), int(data["batches"]),
                   float(data["seconds"]))


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


@runtime_checkable
class MeasuresDraftAcceptance(Protocol):
    """A module whose draft (MTP) head's acceptance can be measured (`SFTModule`); the draft probe calls it. Declared
    here, beside the probe, a floor below `contract.py`, which lists it with the other contracts."""

    def draft_acceptance(self, batches: Iterable[list[Microbatch]], temperature: float) -> DraftAcceptance:
        """The teacher-forced acceptance of every MTP depth on `batches` (global batches as this rank holds them;
        every rank calls it), pooled over tokens and data-parallel ranks, sampled at `temperature`."""
        ...


class DraftProbe:
    """What to probe and how much. `measure` is called by every rank; a shuffled validation loader would make
    another probe set each time, so give an unshuffled one.

    Args:
        batches: the first `batches` global batches of the validation data are probed (the bound on its cost; an
            integer > 0).
        temperature: sampled acceptance is measured at the rollout temperature (finite, > 0); greedy acceptance is
            measured as well.
        datamodule: whose `val_dataloader()` makes the probe set (e.g. `SFTDataModule(val_path=...)`); by default
            the trainer's own (a held-out slice of the validation data).
    """

    def __init__(self, batches: int = 8, temperature: float = 1.0,
                 datamodule: pl.LightningDataModule | None = None) -> None:
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
            raise ValueError(f"batches: {batches!r} must be an integer > 0 (the global batches each probe reads)")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
                math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature: {temperature!r} must be finite and > 0 (the rollouts' sampling "
                             "temperature; greedy acceptance is measured as well)")
        if datamodule is not None and not isinstance(datamodule, pl.LightningDataModule):
            raise ValueError(f"datamodule: {type(datamodule).__name__} is not a LightningDataModule; give one whose "
                             "val_dataloader() makes the probe set (e.g. SFTDataModule(val_path=...))")
        self.batches, self.temperature, self.datamodule = batches, float(temperature), datamodule
        self._datamodule_ready = False

    def measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> DraftAcceptance:
        """The draft head's acceptance now; the module's modes, the RNGs and the gradients as they were."""
        if not isinstance(pl_module, MeasuresDraftAcceptance):
            raise TypeError(f"DraftProbe measures a module with a draft head (MeasuresDraftAcceptance: SFTModule "
                            f"with enable_mtp: true), got {type(pl_module).__name__}")
        start = time.perf_counter()
        with _rng_untouched(), _modes_restored(pl_module), torch.no_grad():
            pl_module.eval()
            result = pl_module.draft_acceptance(self._probe_batches(trainer), self.temperature)
        if result.batches == 0:
            raise ValueError("DraftProbe: the probe set holds no global batch; give it at least "
                             "global_batch_size / data-parallel size rows per rank")
        return replace(result, seconds=time.perf_counter() - start)

    def check_data(self, trainer: pl.Trainer) -> None:
        """Raise now (a weight sync calls it when fit starts) if there is nothing to probe, not at the first
        measurement after training steps; every rank calls it."""
        self._probe_loader(trainer)

    def _probe_batches(self, trainer: pl.Trainer) -> Iterator[list[Microbatch]]:
        loader, global_batches = self._probe_loader(trainer)
        batches = iter(cast(Iterable[list[Microbatch]], loader)) if global_batches else _global_batches(trainer, loader)
        return islice(batches, self.batches)

    def _probe_loader(self, trainer: pl.Trainer) -> tuple[object, bool]:
        """The loader the probe reads, and whether it yields global batches already (Lightning's validation loader:
        the strategy's global batches, sharded over data-parallel ranks by Lightning)."""
        if self.datamodule is not None:
            return self._own_loader(trainer), False
        loader = _first(trainer.val_dataloaders)
        if loader is not None:
            return loader, True
        loader = _validation_data(trainer)
        if loader is None:
            raise ValueError("DraftProbe: the trainer has no validation data to probe (no val dataloader, and no "
                             "data module that makes one): give it validation data (e.g. SFTDataModule(val_path="
                             "...)) or name a probe set, DraftProbe(datamodule=...)")
        return loader, False

    def _own_loader(self, trainer: pl.Trainer) -> object:
        datamodule = self.datamodule
        assert datamodule is not None
        if not self._datamodule_ready:
            datamodule.trainer = trainer
            if trainer.local_rank == 0 if datamodule.prepare_data_per_node else trainer.is_global_zero:
                datamodule.prepare_data()
            trainer.strategy.barrier("DraftProbe.prepare_data")
            datamodule.setup("validate")
            self._datamodule_ready = True
        loader = _first(datamodule.val_dataloader()) if is_overridden("val_dataloader", datamodule) else None
        if loader is None:
            raise ValueError(f"DraftProbe(datamodule=...): {type(datamodule).__name__}.val_dataloader() makes no "
                             "loader; give the data module validation data (e.g. SFTDataModule(val_path=...))")
        return loader


def _first(loaders: Any) -> object | None:
    """The first of Lightning's evaluation loaders (one loader, a sequence or a mapping of them), None if none."""
    if isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    if isinstance(loaders, Sequence):
        return loaders[0] if loaders else None
    return loaders


def _validation_data(trainer: pl.Trainer) -> object | None:
    """The validation data the run was given (loaders passed to `fit` or `validate`, a data module's, the module's
    own `val_dataloader`) before Lightning has set it up: it does so only when validation first runs, and a weight
    sync may come earlier (`num_sanity_val_steps: 0`, `limit_val_batches: 0`, a sync every few steps)."""
    from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader

    for loop in (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop):
        source = loop._data_source
        if source.instance is not None and source.is_defined():
            loader = _first(_request_dataloader(source))
            if loader is not None:
                return loader
    return None


def _global_batches(trainer: pl.Trainer, loader: object) -> Iterator[list[Microbatch]]:
    """A data module's own loader as the strategy hands batches to the module: each data-parallel rank takes every
    n-th microbatch (whole rounds only, so that every rank runs as many), grouped by the strategy into global
    batches."""
    sharding = trainer.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
    ranks, rank = sharding["num_replicas"], sharding["rank"]

    def this_ranks_share() -> Iterator[Microbatch]:
        microbatches = iter(cast(Iterable[Microbatch], loader))
        while len(round_ := list(islice(microbatches, ranks))) == ranks:
            yield round_[rank]

    return iter(cast(Iterable[list[Microbatch]], trainer.strategy.process_dataloader(this_ranks_share())))


@contextmanager
def _rng_untouched() -> Iterator[None]:
    """Every RNG state back as it was on leaving: Python's, NumPy's, torch's (CPU and this CUDA device) and
    Megatron-Core's named model-parallel streams."""
    python_state, numpy_state, tracker_states = random.getstate(), np.random.get_state(), megatron_rng_states()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        set_megatron_rng_states(tracker_states)


@contextmanager
def _modes_restored(module: torch.nn.Module) -> Iterator[None]:
    """Every submodule back in the train/eval mode it had (a frozen part may be in eval while the rest trains)."""
    modes = [(submodule, submodule.training) for submodule in module.modules()]
    try:
        yield
    finally:
        for submodule, training in modes:
            submodule.training = training
