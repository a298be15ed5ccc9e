"""Everything a CUDA-graph mechanism does not serve, in one table.

One row per refusal: the mechanism, what it is checked on, the condition, the reason (naming the option) and the
fix. A row with a fix stops the run with `ValueError("<reason>; <fix>")` (`refuse`, `check_setting`); a row without
one lets the mechanism step aside (`reason`: the frozen trunk runs that chunk or that call eagerly, logged once).
The whole-iteration graph's rows serve both of its modes: `cuda_graph: full_iteration` raises on a row with a fix
(`cuda_graph: <reason>; <fix>`); `cuda_graph: auto` steps aside on every row (`auto_reason`: the training steps run
eagerly, and the strategy says why in one line), also on the `auto_only` rows, which an explicit `full_iteration`
graphs anyway: what would make a graphed run differ from an eager one, or a failed capture unable to fall back.
What a row is checked on, and when:
- `Setting`: the options with what is known of the run so far: the parallel sizes when the strategy is made, the
  device, the process count and the LightningModule in `setup_environment`, MTP-only training when
  `MTPOnlyCallback` validates the setup;
- a model chunk (unwrapped): when the whole-iteration graph is made, or the frozen trunk is set up;
- `TrunkCall`: each call of a graphed decoder;
- a microbatch: each training batch through the whole-iteration graph.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from lightning_megatron.cuda_graphs.options import CudaGraphOptions, IterationGraph, TrunkGraphs
from lightning_megatron.distributed import ParallelSizes
from lightning_megatron.microbatch import SUBTREE_END

if TYPE_CHECKING:
    from lightning_megatron.contract import MegatronLightningModule

Subject = TypeVar("Subject")


class Mechanism(Enum):
    """Whose refusal a row is."""

    FULL_ITERATION = "full_iteration"  # the strategy's `cuda_graph: auto` and `full_iteration` (`full_iteration.py`)
    FROZEN_TRUNK = "frozen_trunk"  # MTPOnlyCallback's `cuda_graph_trunk` (`frozen_trunk.py`)


@dataclass(frozen=True)
class Setting:
    """The options, with what is known of the run when they are checked (None, False: not known, not the case)."""

    options: CudaGraphOptions
    parallel: ParallelSizes | None = None
    device: torch.device | None = None
    processes: int = 1  # the run's process count
    module: MegatronLightningModule | None = None  # what trains
    mtp_only: bool = False  # MTPOnlyCallback trains the run


@dataclass(frozen=True)
class TrunkCall:
    """One call of a graphed decoder: the decoder and the forward's bound arguments by name."""

    decoder: torch.nn.Module
    arguments: Mapping[str, Any]


@dataclass(frozen=True)
class Refusal(Generic[Subject]):
    """One row: `mechanism` does not serve a `subject` (an instance of that type) for which `applies` holds."""

    mechanism: Mechanism
    subject: type[Subject]
    applies: Callable[[Subject], bool]
    reason: str | Callable[[Subject], str]  # naming the option (or, without a fix, what is left eager)
    fix: str | None = None  # None: the mechanism steps aside (eager), nothing for the user to change
    option: str = ""  # what the raised message begins with, before the reason
    auto_only: bool = False  # only `cuda_graph: auto` steps aside here; an explicit full_iteration graphs anyway

    def text(self, subject: Subject) -> str:
        return self.reason if isinstance(self.reason, str) else self.reason(subject)

    def message(self, subject: Subject) -> str:
        text = self.option + self.text(subject)
        return text if self.fix is None else f"{text}; {self.fix}"


def _parallel(setting: Setting) -> ParallelSizes:
    return setting.parallel or ParallelSizes()


def _off_cuda(device: torch.device | None) -> bool:
    return device is not None and device.type != "cuda"


def _has_sdpa_core(model: torch.nn.Module) -> bool:
    from lightning_megatron.attention import SDPAttention

    return any(isinstance(module, SDPAttention) for module in model.modules())


def _dropout(model: torch.nn.Module) -> str | None:
    """What draws dropout masks while the model trains (its config's rates, any `torch.nn.Dropout`), or None."""
    config = model.config
    found = [f"{name} {rate}" for name, rate in (("attention_dropout", config.attention_dropout),
                                                  ("hidden_dropout", config.hidden_dropout)) if rate]
    largest = max((module.p for module in model.modules() if isinstance(module, torch.nn.Dropout)), default=0.0)
    if largest:
        found.append(f"a torch.nn.Dropout of p {largest}")
    return ", ".join(found) or None


def _full(subject: type, applies: Callable[[Any], bool], reason: str | Callable[[Any], str],
          fix: str) -> Refusal[Any]:
    """A row of the whole-iteration graph: `full_iteration` raises `cuda_graph: <reason>; <fix>`, auto steps
    aside with `<reason>`."""
    return Refusal(Mechanism.FULL_ITERATION, subject, applies, reason, fix, option="cuda_graph: ")


def _auto_only(subject: type, applies: Callable[[Any], bool], reason: str | Callable[[Any], str]) -> Refusal[Any]:
    """A row where only `cuda_graph: auto` steps aside (the reason says that `full_iteration` graphs anyway)."""
    return Refusal(Mechanism.FULL_ITERATION, subject, applies, reason, auto_only=True)


FULL, TRUNK, MODEL = Mechanism.FULL_ITERATION, Mechanism.FROZEN_TRUNK, torch.nn.Module
NO_FULL_ITERATION = "set cuda_graph: none"
UNGRAPHED_TRUNK_ARGUMENTS = ("context", "context_mask", "attention_bias", "inference_context", "inference_params")

REFUSALS: tuple[Refusal[Any], ...] = (
    # the whole-iteration graph: the options and the run (the device first: on a CPU it is the reason auto gives)
    _full(Setting, lambda s: _off_cuda(s.device),
          lambda s: f"full_iteration needs the model on a CUDA device, got {s.device.type}",
          f"{NO_FULL_ITERATION} (or train on a GPU)"),
    _full(Setting, lambda s: _parallel(s).pipeline != 1,
          lambda s: f"full_iteration needs pipeline_model_parallel_size: 1, got {_parallel(s).pipeline} (the "
                    "pipeline schedule is not captured)", NO_FULL_ITERATION),
    _full(Setting, lambda s: _parallel(s).context != 1,
          lambda s: f"full_iteration needs context_parallel_size: 1, got {_parallel(s).context} (the CP cut reads "
                    "cu_seqlens on the host in the step)", NO_FULL_ITERATION),
    _full(Setting, lambda s: _parallel(s).expert != 1,
          lambda s: f"full_iteration needs expert_model_parallel_size: 1, got {_parallel(s).expert} (MoE routing "
                    "has data-dependent shapes)", NO_FULL_ITERATION),
    _full(Setting, lambda s: s.mtp_only,
          "full_iteration does not serve MTPOnlyCallback (it decides in Python, step by step, whether the main head "
          "runs; replays would repeat one choice)",
          "set the strategy's cuda_graph: none (MTPOnlyCallback's cuda_graph_trunk graphs the frozen trunk)"),
    _auto_only(Setting, lambda s: s.module is not None and not s.module.replayable_training_step,
               lambda s: f"{type(s.module).__name__} does not set replayable_training_step (a replay repeats the "
                         "captured step's Python choices; cuda_graph: full_iteration graphs it anyway)"),
    _auto_only(Setting, lambda s: s.processes > 1,
               lambda s: f"{s.processes} processes: a capture that fails on one could not fall back to eager without "
                         "the others (cuda_graph: full_iteration graphs them anyway)"),
    # the whole-iteration graph: each model chunk when the graph is made, then each training batch
    _full(MODEL, lambda model: bool(model.config.num_moe_experts),
          "full_iteration does not serve Mixture of Experts models (token routing has data-dependent shapes)",
          NO_FULL_ITERATION),
    _full(MODEL, lambda model: not _has_sdpa_core(model),
          "full_iteration needs the SDPAttention core (attention_backend: sdpa, or auto without Transformer Engine)",
          f"{NO_FULL_ITERATION} or attention_backend: sdpa"),
    _auto_only(MODEL, lambda model: _dropout(model) is not None,
               lambda model: f"dropout while training ({_dropout(model)}): a graphed step's masks are not shown to "
                             "equal an eager step's (cuda_graph: full_iteration graphs it anyway)"),
    _full(dict, lambda microbatch: SUBTREE_END in microbatch,
          "full_iteration does not serve tree rows (subtree_end)", NO_FULL_ITERATION),
    # the frozen trunk: the options and the run
    Refusal(TRUNK, Setting, lambda s: s.options.frozen_trunk is TrunkGraphs.REQUIRED and _off_cuda(s.device),
            lambda s: f"cuda_graph_trunk: true needs the model on a CUDA device (this run's is {s.device})",
            "set cuda_graph_trunk: null (on where it applies) or false"),
    # the frozen trunk: a model chunk whose decoder stays eager (in this order: later rows read the decoder)
    Refusal(TRUNK, MODEL, lambda model: getattr(model, "decoder", None) is None, "no decoder on this chunk"),
    Refusal(TRUNK, MODEL,
            lambda model: not torch.cuda.is_available() or any(p.device.type != "cuda" for p in model.parameters()),
            "the model is not on a CUDA device"),
    Refusal(TRUNK, MODEL, lambda model: not model.decoder.pre_process,
            "a later pipeline stage (its decoder reads the received input_tensor)"),
    Refusal(TRUNK, MODEL, lambda model: model.config.tensor_model_parallel_size > 1, "tensor parallelism"),
    Refusal(TRUNK, MODEL, lambda model: model.config.context_parallel_size > 1, "context parallelism"),
    Refusal(TRUNK, MODEL, lambda model: bool(model.config.sequence_parallel), "sequence parallelism"),
    Refusal(TRUNK, MODEL, lambda model: model.config.recompute_granularity is not None,
            lambda model: f"recompute_granularity: {model.config.recompute_granularity}"),
    Refusal(TRUNK, MODEL, lambda model: bool(model.config.fp8 or getattr(model.config, "fp4", None)), "FP8/FP4"),
    Refusal(TRUNK, MODEL, lambda model: model.config.expert_model_parallel_size > 1,
            "expert parallelism (the MoE layers' all-to-all)"),
    Refusal(TRUNK, MODEL, lambda model: bool(model.config.num_moe_experts) and (
        model.config.moe_expert_capacity_factor is not None or model.config.moe_pad_expert_input_to_capacity),
            "MoE token dropping or padding (moe_expert_capacity_factor)"),
    Refusal(TRUNK, MODEL, lambda model: bool(getattr(model.config, "cpu_offloading", False)
                                             or getattr(model.config, "fine_grained_activation_offloading", False)),
            "activation offloading"),
    Refusal(TRUNK, MODEL, lambda model: getattr(model.config, "cuda_graph_impl", "none") != "none",
            "Megatron-Core's own CUDA graphs (cuda_graph_impl)"),
    Refusal(TRUNK, MODEL, lambda model: any(p.requires_grad for p in model.decoder.parameters()),
            "trainable decoder parameters"),
    # the frozen trunk: a decoder call that runs eagerly (inputs the first version does not graph)
    Refusal(TRUNK, TrunkCall, lambda call: call.arguments.get("packed_seq_params") is not None,
            "packed rows (packed_seq_params)"),
    Refusal(TRUNK, TrunkCall, lambda call: call.arguments.get("attention_mask") is not None,
            "an attention mask (tree rows or an explicit mask)"),
    *(Refusal(TRUNK, TrunkCall, lambda call, name=name: call.arguments.get(name) is not None, f"{name} given")
      for name in UNGRAPHED_TRUNK_ARGUMENTS),
    Refusal(TRUNK, TrunkCall, lambda call: bool(call.arguments.get("extract_layer_indices")),
            "extract_layer_indices given"),
    Refusal(TRUNK, TrunkCall, lambda call: call.decoder.training and bool(
        call.decoder.config.hidden_dropout or call.decoder.config.attention_dropout), "dropout while training"),
)


def reason(mechanism: Mechanism, subject: object) -> str | None:
    """The first of `mechanism`'s refusals that applies to `subject` (rows in table order, `auto_only` ones left
    out), as raised or logged; or None."""
    row = _first_row(mechanism, subject, auto=False)
    return None if row is None else row.message(subject)


def auto_reason(subject: object) -> str | None:
    """Why `cuda_graph: auto` runs the training steps eagerly: the first whole-iteration row that applies to
    `subject` (`auto_only` ones included), without the option or the fix; None: nothing in the way."""
    row = _first_row(FULL, subject, auto=True)
    return None if row is None else row.text(subject)


def _first_row(mechanism: Mechanism, subject: object, *, auto: bool) -> Refusal[Any] | None:
    return next((row for row in REFUSALS if row.mechanism is mechanism and (auto or not row.auto_only)
                 and isinstance(subject, row.subject) and row.applies(subject)), None)


def refuse(mechanism: Mechanism, subject: object) -> None:
    """Raise, naming the option and the fix, when `mechanism` does not serve `subject`."""
    message = reason(mechanism, subject)
    if message is not None:
        raise ValueError(message)


def check_setting(setting: Setting) -> None:
    """Raise on what the mechanisms the options require cannot serve in this setting (`cuda_graph: auto` steps
    aside instead: `auto_reason`)."""
    if setting.options.full_iteration is IterationGraph.REQUIRED:
        refuse(FULL, setting)
    if setting.options.frozen_trunk is not TrunkGraphs.OFF:
        refuse(TRUNK, setting)
