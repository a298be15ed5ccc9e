"""The contracts between the strategy, the modules and the callbacks, declared and typed in one room.

`MegatronLightningModule` is what `MegatronStrategy` and the callbacks call on a module; `MegatronStrategyContract`
is what modules, callbacks and commands call on the strategy (`MegatronStrategy` implements it), reached through
one accessor, `megatron_strategy`. The strategy imports this room and never the file that defines `SFTModule`;
this room imports nothing of the strategy (it would be an import circle), hence the Protocol.
`MeasuresDraftAcceptance` is what the draft probe calls on a module (`SFTModule` implements it); it is declared
beside the probe in `mtp.probe`, a floor below, which checks modules against it, and is listed here with the rest.
`ModelBuild` is what the strategy records on a module about the model it attached, so that the module's later runs
keep that model.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Mapping, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch

from lightning_megatron.distributed import ParallelSizes
from lightning_megatron.microbatch import LossOutput, Microbatch
from lightning_megatron.mtp.probe import MeasuresDraftAcceptance
from lightning_megatron.optimizer import MegatronOptimizerAdapter
from lightning_megatron.options import BridgeType, ModelOptions

if TYPE_CHECKING:  # the bridges import Megatron-Core: a command's --help must not (tests/_compat/test_quiet.py)
    from lightning_megatron.bridges import Bridge
    from lightning_megatron.data.settings import DataSettings

__all__ = ["MeasuresDraftAcceptance", "MegatronLightningModule", "MegatronStrategyContract", "ModelBuild",
           "PreWrapHook", "ValidatesMegatronSetup", "megatron_strategy"]

PreWrapHook = Callable[[list[torch.nn.Module]], None]


@runtime_checkable
class MegatronStrategyContract(Protocol):
    """What modules, callbacks and commands call on `MegatronStrategy` (its docstrings say more)."""

    hf_checkpoint: str | None
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int
    sequence_parallel: bool
    model_chunks: list[torch.nn.Module]  # the wrapped chunks, from `setup` on

    def data_settings(self, module: MegatronLightningModule) -> DataSettings:
        """What the run decides for the data (tokenizer checkpoint, microbatch rows, parallel sizes, MTP head)."""
        ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def bridge(self) -> Bridge:
        """The bridge backend that builds and exports the model, from `setup_environment` on."""
        ...

    def register_pre_wrap_hook(self, hook: PreWrapHook) -> None:
        """Run `hook(chunks)` in `setup` before Megatron DDP wraps the model (freezing, adapters); in order."""
        ...

    def forward_backward(self, microbatches: list[Microbatch],
                         forward_step: Callable[[torch.nn.Module, Microbatch], torch.Tensor],
                         loss_func: Callable[[Microbatch, torch.Tensor], LossOutput], *,
                         forward_only: bool = False) -> dict[str, torch.Tensor]:
        """Megatron's schedule over one global batch; returns each metric of `loss_func` token-weighted."""
        ...

    def megatron_optimizer(self, config: Any) -> MegatronOptimizerAdapter:
        """Megatron's optimizer for the wrapped chunks from an `OptimizerConfig`; call it in `configure_optimizers`."""
        ...

    def export_hf(self, path: str | Path) -> Path:
        """Write an HF checkpoint of the current weights through the bridge (all ranks call it)."""
        ...

    def finish_saves(self) -> None:
        """Block until a background save is published (all ranks call it); raises its failure."""
        ...


def megatron_strategy(trainer: pl.Trainer, user: str) -> MegatronStrategyContract:
    """`trainer.strategy` as a `MegatronStrategyContract`; any other strategy is refused, naming `user` and the fix."""
    strategy = trainer.strategy
    if not isinstance(strategy, MegatronStrategyContract):
        raise TypeError(f"{user} needs Trainer(strategy=MegatronStrategy(...)), got {type(strategy).__name__}")
    return strategy


def logs_this_step(trainer: pl.Trainer, every_n_steps: int | None = None) -> bool:
    """Whether the metrics of the training step about to run (or running) reach the loggers, by Lightning's rule
    for `log_every_n_steps` (`every_n_steps` instead when given; a stop already asked for logs that step too). One
    Lightning batch is one optimizer step under `MegatronStrategy`, so `global_step + 1` is the step the logger
    connector checks; the same on every rank. What is read from the device only to be logged waits for these."""
    every = every_n_steps or trainer.log_every_n_steps
    return trainer.should_stop or (every > 0 and (trainer.global_step + 1) % every == 0)


@dataclass(frozen=True)
class ModelBuild:
    """What `MegatronStrategy` built a module's model as, and the bridge that built it (which exports it: mbridge's
    keeps what it built the model with; not compared). A later run on the module (`validate`, `test` or `predict`
    after `fit`, another `fit`, on the same Trainer or a new one) runs that model, its trained weights, as Lightning
    runs a module's current weights, where it would build the same model: with other shapes, dtype or process
    groups the model could not serve it. `process_groups`: Megatron's model-parallel group, the identity of the
    parallel state the model was built in (the same sizes set up again after a run at other sizes are new groups)."""

    hf_checkpoint: str
    bridge_type: BridgeType
    trust_remote_code: bool
    options: ModelOptions
    parallel_sizes: ParallelSizes
    device: torch.device
    process_groups: Any
    bridge: Bridge = field(compare=False, repr=False)

    @classmethod
    def for_run(cls, module: MegatronLightningModule, hf_checkpoint: str, bridge_type: BridgeType,
                trust_remote_code: bool, options: ModelOptions, device: torch.device) -> ModelBuild:
        """`module.megatron_build` where the module keeps a model this run would build (raises, naming what differs,
        where it keeps another); else a new build, its bridge made, its model not yet built."""
        from megatron.core import parallel_state

        from lightning_megatron.bridges import create_bridge

        kept = module.megatron_build
        wanted = (hf_checkpoint, bridge_type, trust_remote_code, options, ParallelSizes.current(), device,
                  parallel_state.get_model_parallel_group())
        if kept is None:
            return cls(*wanted, create_bridge(bridge_type, hf_checkpoint, trust_remote_code=trust_remote_code))
        kept.check_serves(cls(*wanted, kept.bridge), module)
        return kept

    def check_serves(self, wanted: ModelBuild, module: MegatronLightningModule) -> None:
        """Raise, naming each field that differs, unless `module`'s kept model (built as this) is the one `wanted`."""
        mine, theirs = self._fields(), wanted._fields()
        differences = [f"{name}: set up anew since the model was built" if name == "process_groups"
                       else f"{name}: {value!r} -> {theirs[name]!r}" for name, value in mine.items()
                       if value != theirs[name]]
        if differences:
            raise ValueError(
                f"{type(module).__name__} holds the model an earlier run built (and trained) for it, and this run "
                f"would build another: {'; '.join(differences)}. Lightning runs a module's own weights: run with the "
                "strategy options (and devices) it was built with, or pass a new module to start from hf_checkpoint "
                "(with ckpt_path for a saved run's weights)")

    def _fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for name, value in vars(self).items():
            if isinstance(value, ModelOptions | ParallelSizes):
                fields.update({f"{name}.{inner}": item for inner, item in vars(value).items()})
            elif name != "bridge":
                fields[name] = value
        return fields


class MegatronLightningModule(pl.LightningModule):
    """The contract `MegatronStrategy` needs; subclasses implement `forward_step` and `loss_func`.

    `self.model` is a `ModuleList` of Megatron model chunks (one per virtual pipeline stage) that the strategy
    attaches in `setup_environment`, so callbacks' `setup` already sees real parameters: built from the HF
    checkpoint in the module's first run, and the same model, trained weights and all, in its later runs
    (`megatron_build`). `forward_step` and `loss_func` receive the microbatch as this rank holds it (cut for
    context parallelism by the strategy).
    """

    model: torch.nn.ModuleList
    # What the strategy built `model` as (None: no run yet); a later run keeps that model (`ModelBuild`).
    megatron_build: ModelBuild | None = None
    # True for a model that fuses other inputs into the sequence first (Qwen3-VL's images) and so cuts it for
    # context parallelism itself: the strategy then hands `forward_step` whole rows.
    cuts_context_parallel_in_model: ClassVar[bool] = False
    # True when `forward_step` and `loss_func` make no per-step choice in Python (a step counter, a schedule, a
    # branch on values read from the device): `cuda_graph: auto` then replays training steps from one CUDA graph,
    # which runs their Python only when it is captured.
    replayable_training_step: ClassVar[bool] = False
    # Whether the MTP head trains (its loss joins the model's): `MTPOnlyCallback` trains nothing else.
    enable_mtp_training: bool = False
    # The token ids `predict` stops at; `ContinuationWriter` leaves a final one out of the answer it writes.
    generation_eos_token_ids: Set[int] = frozenset()

    def model_options(self) -> ModelOptions:
        """What the Megatron model should be beyond the HF config (MTP head, config overrides)."""
        return ModelOptions()

    def forward_step(self, model: torch.nn.Module, microbatch: Microbatch) -> torch.Tensor:
        """One microbatch through one model chunk: the per-token loss on the last stage, hidden states before it."""
        raise NotImplementedError

    def loss_func(self, microbatch: Microbatch, output: torch.Tensor) -> LossOutput:
        """`(loss_sum, num_tokens, metrics)` of one microbatch; each metric is a `[sum, count]` pair."""
        raise NotImplementedError

    @property
    def megatron_strategy(self) -> MegatronStrategyContract:
        """The trainer's `MegatronStrategy` (`megatron_strategy`)."""
        return megatron_strategy(self.trainer, type(self).__name__)

    def log_step_metrics(self, metrics: Mapping[str, torch.Tensor], prog_bar: Collection[str] = ()) -> None:
        """`self.log(name, value, prog_bar=name in prog_bar, on_step=True, on_epoch=False)` for each of a training
        step's metrics (0-dim tensors, already reduced over the ranks): the same values reach the loggers, the
        callbacks (`trainer.callback_metrics`) and the progress bar at the same steps, for a fraction of the host
        time.

        Why: each `self.log` runs Lightning's checks and moves the metric's whole state to the value's device
        (`_ResultCollection.log`: `self[key].to(value.device)`, lightning/pytorch/trainer/connectors/
        logger_connector/result.py:412 in 2.6.0, 413 in 2.5.0), about 0.3 ms of Python a call on a server CPU, and a
        host-bound step (issue 41) pays it for every metric of every step. The first time a metric is logged in a
        fit (and whenever Lightning would reset the hook's metrics: an epoch's first step after another hook
        logged) it goes through `self.log`; after that, while the metric Lightning keeps is the one that call
        registered and its state is on the value's device, the value goes straight to what `self.log` ends with
        (`_ResultCollection.update_metrics`, result.py:418), which stores it the same way. A module whose class
        overrides `log` always goes through it.
        """
        trainer = self.trainer
        fx = self._current_fx_name
        results = trainer._results
        fast = (_LIGHTNING_KEEPS_STEP_METRICS and type(self).log is pl.LightningModule.log and fx is not None
                and results is not None
                and results.dataloader_idx is None and not trainer._logger_connector.should_reset_tensors(fx))
        registered = self.__dict__.setdefault("_registered_step_metrics", weakref.WeakValueDictionary())
        for name, value in metrics.items():
            shown = name in prog_bar
            key = f"{fx}.{name}"
            metric = registered.get((key, shown)) if fast else None
            if (metric is not None and results.get(key) is metric and value.dim() == 0
                    and metric.value.device == value.device):
                results.update_metrics(key, value.detach(), 1)  # the batch size only weighs epoch-level means
                trainer._logger_connector._current_fx = fx
                continue
            self.log(name, value, prog_bar=shown, on_step=True, on_epoch=False)
            if results is not None and results.get(key) is not None:
                registered[(key, shown)] = results[key]


def _lightning_keeps_step_metrics() -> bool:
    """Whether this Lightning has the internals `log_step_metrics`' short path writes through (2.5.0 to 2.6.6 do);
    another one goes through `self.log` for every metric."""
    from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    return (hasattr(_ResultCollection, "update_metrics") and hasattr(_LoggerConnector, "should_reset_tensors")
            and hasattr(pl.Trainer, "_results"))


_LIGHTNING_KEEPS_STEP_METRICS = _lightning_keeps_step_metrics()


@runtime_checkable
class ValidatesMegatronSetup(Protocol):
    """A callback that checks the strategy's options and the module before any weights are loaded: called in
    `setup_environment` once `strategy.bridge` exists, before the model is built; raise, naming the option and the
    fix, to refuse a combination the callback cannot serve."""

    def validate_megatron_setup(self, strategy: MegatronStrategyContract, module: MegatronLightningModule) -> None: ...
