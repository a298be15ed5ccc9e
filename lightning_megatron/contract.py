"""The contracts between the strategy, the modules and the callbacks, declared and typed in one room.

`MegatronLightningModule` is what `MegatronStrategy` and the callbacks call on a module; `MegatronStrategyContract`
is what modules, callbacks and commands call on the strategy (`MegatronStrategy` implements it), reached through
one accessor, `megatron_strategy`. The strategy imports this room and never the file that defines `SFTModule`;
this room imports nothing of the strategy (it would be an import circle), hence the Protocol.
`MeasuresDraftAcceptance` is what the draft probe calls on a module (`SFTModule` implements it); it is declared
beside the probe in `mtp.probe`, a floor below, which checks modules against it, and is listed here with the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Set
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch

from lightning_megatron.microbatch import LossOutput, Microbatch
from lightning_megatron.mtp.probe import MeasuresDraftAcceptance
from lightning_megatron.optimizer import MegatronOptimizerAdapter
from lightning_megatron.options import ModelOptions

if TYPE_CHECKING:  # the bridges import Megatron-Core: a command's --help must not (tests/_compat/test_quiet.py)
    from lightning_megatron.bridges import Bridge
    from lightning_megatron.data.settings import DataSettings

__all__ = ["MeasuresDraftAcceptance", "MegatronLightningModule", "MegatronStrategyContract", "PreWrapHook",
           "ValidatesMegatronSetup", "megatron_strategy"]

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


class MegatronLightningModule(pl.LightningModule):
    """The contract `MegatronStrategy` needs; subclasses implement `forward_step` and `loss_func`.

    `self.model` is a `ModuleList` of Megatron model chunks (one per virtual pipeline stage) that the strategy
    attaches in `setup_environment`, so callbacks' `setup` already sees real parameters. `forward_step` and
    `loss_func` receive the microbatch as this rank holds it (cut for context parallelism by the strategy).
    """

    model: torch.nn.ModuleList
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


@runtime_checkable
class ValidatesMegatronSetup(Protocol):
    """A callback that checks the strategy's options and the module before any weights are loaded: called in
    `setup_environment` once `strategy.bridge` exists, before the model is built; raise, naming the option and the
    fix, to refuse a combination the callback cannot serve."""

    def validate_megatron_setup(self, strategy: MegatronStrategyContract, module: MegatronLightningModule) -> None: ...
