"""LoRA through megatron-bridge's PEFT: adapters added before Megatron wraps the model, exported for HF.

`callbacks.LoRACallback` registers `add_lora_adapters` as a pre-wrap hook with `MegatronStrategy`. The hook runs in
`setup`, after the bridge has loaded the HF weights and before Float16Module, Megatron DDP and the optimizer exist,
so it freezes every base weight and adds `megatron.bridge.peft.lora.LoRA` adapters: DDP's buffers and the optimizer
hold only adapters.
The trained adapters leave in two forms, both through the bridge's name mappings (TP shards gathered, fused
QKV / gate-up split into HF's projections): an HF PEFT adapter folder (`export_lora_adapter`, loadable with
`peft.PeftModel.from_pretrained`) and a merged HF checkpoint (`export_lora_merged`, loadable without `peft`).
"""

from __future__ import annotations

import json
import warnings
import weakref
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from lightning_megatron.atomic import write_atomically
from lightning_megatron.bridges import Bridge, BridgeError, capable_backends
from lightning_megatron.contract import MegatronStrategyContract
from lightning_megatron.distributed import cpu_group
from lightning_megatron.families import is_hf_mtp_tensor
from lightning_megatron.hf_io import TensorSpec, checkpoint_tensor_specs, safetensors_layout
from lightning_megatron.lora_folder import (
    ADAPTER_FILE,
    AdapterPlan,
    CopyPlan,
    MappedSpare,
    find_copy_plan,
    with_stand_ins,
    write_config_and_extras,
)
from lightning_megatron.staged_write import FileLayout, StagedWriter

# The linears of every transformer layer (MTP layer included), as megatron-bridge's LoRA names them.
DEFAULT_TARGET_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# PEFT's spelling of "every linear layer": here, every linear of the built model's transformer layers
ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class LoRAConfig:
    """Which linears get adapters, and their shape: `W x + (alpha / rank) * B A x`, with `B` starting at zero.

    `target_modules`: module names (`linear_qkv`) or wildcard patterns over full names
    (`*.layers.0.*.linear_qkv`; layer numbers are local to the pipeline stage), or "all-linear" (PEFT's word):
    every linear LoRA can wrap inside the model's transformer layers, MTP layer included, by the names the built
    model gives them (`all_linear_names`): whatever the family (multi-latent attention's down and up projections,
    the gated DeltaNet's `in_proj` / `out_proj`, the experts' `linear_fc1` / `linear_fc2`) and the MTP layer's
    `eh_proj` too (both exports carry it exactly: the merged one folds it into `eh_proj.weight` / `mtp.fc.weight`,
    the PEFT one writes its adapter under that HF name; transformers' models hold no MTP layer, so `peft` on them
    applies the MTP layer's adapters to nothing). The LM head, embeddings, norms and routers get none.
    """

    target_modules: list[str] | Literal["all-linear"] = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    rank: int = 8
    alpha: int = 16
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.target_modules != ALL_LINEAR and (isinstance(self.target_modules, str) or not self.target_modules
                                                  or not all(isinstance(name, str) and name
                                                             for name in self.target_modules)):
            raise ValueError(f"target_modules: {self.target_modules!r} must be a non-empty list of module names, "
                             f"e.g. {list(DEFAULT_TARGET_MODULES)}, or '{ALL_LINEAR}'")
        if self.target_modules != ALL_LINEAR and ALL_LINEAR in self.target_modules:
            raise ValueError(f"target_modules: {self.target_modules!r}: '{ALL_LINEAR}' stands alone "
                             f"(target_modules: {ALL_LINEAR}), it is not a module name to list with others")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"rank: {self.rank!r} must be a positive integer (8 or 16 are common)")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or self.alpha <= 0:
            raise ValueError(f"alpha: {self.alpha!r} must be > 0 (the adapter is scaled by alpha / rank)")
        if not isinstance(self.dropout, int | float) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: {self.dropout!r} must be in [0, 1)")

    def megatron_bridge_lora(self, target_modules: list[str]) -> Any:
        """megatron-bridge's `LoRA` transform of these settings on `target_modules` (resolved: `target_names`)."""
        from megatron.bridge.peft.lora import LoRA

        return LoRA(target_modules=target_modules, dim=self.rank, alpha=self.alpha, dropout=self.dropout)

    def target_names(self, chunks: list[torch.nn.Module]) -> list[str]:
        """The names and patterns megatron-bridge matches: "all-linear" resolved on this pipeline stage's chunks."""
        return all_linear_names(chunks) if self.target_modules == ALL_LINEAR else list(self.target_modules)


def check_lora_supported(bridge: Bridge | type[Bridge], mtp_only: bool) -> None:
    """Raise, before any model is built, for the combinations LoRA cannot serve (`bridge`: the strategy's bridge,
    or a backend's registered class)."""
    if not bridge.supports_lora:
        raise BridgeError(f"bridge_type: {bridge.name} has no LoRA/PEFT support (LoRACallback); set bridge_type: "
                          f"{capable_backends(lambda backend: backend.supports_lora)}")
    if mtp_only:
        raise ValueError("LoRACallback and MTPOnlyCallback cannot be used together: LoRA freezes every base weight, "
                         "the MTP head's included, and trains only adapters, while MTPOnlyCallback trains the whole "
                         "MTP head; remove one of the two callbacks")


def add_lora_adapters(chunks: list[torch.nn.Module], config: LoRAConfig, *, training: bool = True) -> None:
    """Freeze every parameter of `chunks` and wrap the target linears with adapters, in place.

    A model that has adapters (a module's later run keeps its model, `contract.ModelBuild`) keeps them, `config`'s
    settings or refused: megatron-bridge wraps no linear twice but freezes them with the rest, so they are made
    trainable again for training."""
    kept = _lora_adapters(chunks)
    wanted = [(config.rank, config.alpha, float(config.dropout))]
    if kept and _adapter_settings(kept) != wanted:
        raise ValueError(f"rank: {config.rank}, alpha: {config.alpha}, dropout: {config.dropout}: the module's model "
                         "keeps the adapters an earlier run added, and its adapters' (rank, alpha, dropout): "
                         f"{_adapter_settings(kept)}; give LoRACallback those, or a new module for other adapters")
    target_modules = config.target_names(chunks)
    config.megatron_bridge_lora(target_modules)(chunks, training=training)
    for adapter in kept if training else []:
        adapter.requires_grad_(True)
    if config.target_modules != ALL_LINEAR:  # its names are this stage's own (stages differ: no all-reduce)
        _check_every_target_matched(chunks, target_modules)


def _lora_adapters(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    from megatron.bridge.peft.lora_layers import LoRALinear

    return [module.adapter for chunk in chunks for module in chunk.modules() if isinstance(module, LoRALinear)]


def _adapter_settings(adapters: list[torch.nn.Module]) -> list[tuple[int, float, float]]:
    """The (rank, alpha, dropout) the adapters were built with, each once."""
    return sorted({(adapter.dim, adapter.alpha, getattr(adapter.dropout, "p", 0.0)) for adapter in adapters})


def all_linear_names(chunks: list[torch.nn.Module]) -> list[str]:
    """What "all-linear" stands for: the names of the linears LoRA can wrap inside this pipeline stage's transformer
    layers, the MTP layer's included (the LM head, outside them, is left out, as PEFT's "all-linear" leaves it)."""
    names = _layer_linear_names(chunks)
    if not names:
        raise ValueError(f"target_modules: {ALL_LINEAR} found no linear layer in this pipeline stage's transformer "
                         "layers; name the modules to adapt instead")
    return names


def _check_every_target_matched(chunks: list[torch.nn.Module], target_modules: list[str]) -> None:
    """megatron-bridge only warns about a target that matches nothing; a typo here would train nothing it names."""
    from megatron.bridge.peft.lora_layers import LoRALinear
    from megatron.bridge.peft.utils import wildcard_match
    from megatron.core import parallel_state

    wrapped = [name for chunk in chunks for name, module in chunk.named_modules() if isinstance(module, LoRALinear)]
    matches = torch.tensor([
        sum(1 for name in wrapped if name.rsplit(".", 1)[-1] == target or wildcard_match(target, name))
        for target in target_modules
    ], dtype=torch.int64, device=next(chunks[0].parameters()).device)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # another stage may hold the match
        dist.all_reduce(matches, group=parallel_state.get_pipeline_model_parallel_group())
    unmatched = [target for target, count in zip(target_modules, matches.tolist(), strict=True) if count == 0]
    if unmatched:
        raise ValueError(f"target_modules: {unmatched} matched no linear layer of the model; its layers' linears are "
                         f"{_layer_linear_names(chunks)} (multi-latent attention and gated DeltaNet layers name theirs "
                         "otherwise than linear_qkv), or use patterns such as '*.layers.0.*.linear_qkv'")


def _layer_linear_names(chunks: list[torch.nn.Module]) -> list[str]:
    """The names of the tensor-parallel linears inside this pipeline stage's transformer layers (MTP included), as
    target_modules names them (a wrapped one by its own name, not its adapter's)."""
    linears = _wrappable_linear_classes()
    return sorted({name.removesuffix(".to_wrap").rsplit(".", 1)[-1] for chunk in chunks
                   for name, module in chunk.named_modules()
                   if ".layers." in name and ".adapter." not in name and isinstance(module, linears)})


def _wrappable_linear_classes() -> tuple[type, ...]:
    """The parallel linears megatron-bridge's LoRA wraps (peft/utils.py `get_adapter_attributes_from_linear`):
    Megatron-Core's own, and with Transformer Engine its linears, grouped experts' included."""
    from megatron.bridge.peft import utils
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    transformer_engine = (*utils.TECL, *utils.TERL, utils.TELinear) if utils.HAVE_TE else ()
    return (ColumnParallelLinear, RowParallelLinear, *transformer_engine)


# ---------------------------------------------------------------------------------------------------- export


def export_lora_adapter(strategy: MegatronStrategyContract, path: str | Path, *,
                        extra_files: Mapping[str, str] | None = None) -> Path:
    """Write the adapters as an HF PEFT folder (`adapter_config.json`, `adapter_model.safetensors`), atomically.

    Names and layouts are megatron-bridge's PEFT export (TP shards gathered, fused QKV and gate/up split per HF
    projection); rank, alpha and dropout are read from the adapters themselves. All ranks call it; rank 0 writes.
    `extra_files`: `{name: text}` written into the folder before it is renamed into place (a version's metadata).

    Each adapter is named after the HF checkpoint's tensor it adapts: routed experts per expert
    (`mlp.experts.3.gate_proj`) where the checkpoint stores them so (Qwen3-MoE, GLM-4.5, DeepSeek-V3: what vLLM's
    and SGLang's MoE LoRA loaders read; `peft` on transformers 5 folds them into the fused experts exactly, with
    `lightning_megatron._compat.import_peft()` for the shared experts' and dense MLPs' adapters, huggingface/peft#3711).
    A checkpoint that stores its experts fused (Qwen3.5-MoE) has no tensor per expert to name: adapters on its
    experts are refused (exclude the experts' linears from target_modules, or export merged). The MTP layer's
    adapters are written under its HF names, but engines apply LoRA adapters to the main model only and
    transformers' models have no MTP layer: the draft head is served without them (a warning says so; a merged
    export serves the trained head).
    """
    return write_lora_adapter(*_megatron_bridge_and_chunks(strategy), path, extra_files=extra_files)


def write_lora_adapter(bridge: Bridge, chunks: list[torch.nn.Module], path: str | Path, *,
                       extra_files: Mapping[str, str] | None = None) -> Path:
    """`export_lora_adapter` of unwrapped chunks built by `bridge` (outside a Trainer: scripts, benchmarks).

    The adapters stay on the model's device: rank 0 writes `adapter_model.safetensors` from there through pinned
    staging (`staged_write`), on a thread of its own while the export goes on, into the layout of the adapters the
    last write of this bridge exported (`AdapterPlan`: the file's header, the names PEFT gives them, the adapter
    config), checked against what the export yields: other adapters (a new model, another rank) are written again in
    their own layout. So a weight sync's work is the adapters' bytes, not a host copy and a safetensors
    serialisation per tensor. Where the model is whole on every rank (no tensor, pipeline or expert parallelism),
    the export itself runs only for the first write of a set of adapters: later writes copy the file's bytes
    straight from the adapters' parameters (`lora_folder.CopyPlan`)."""
    path = Path(path)
    adapters = _lora_adapters(chunks)
    trained = _trained_lora(adapters, "export_lora_adapter")
    parameters = _adapter_parameters(adapters)
    copy_plan = _COPY_PLANS.get(bridge)
    if copy_plan is not None and copy_plan.serves(_lora_settings(bridge, trained), parameters):
        if not dist.is_initialized() or dist.get_rank() == 0:
            write_atomically(path, partial(copy_plan.write_folder, extra_files or {}))
    else:
        _export_adapter_folder(bridge, chunks, trained, path, extra_files or {})
        _COPY_PLANS.pop(bridge, None)
        copy_plan = _probe_copy_plan(bridge, chunks, trained, parameters) if _whole_model_on_every_rank() else None
        if copy_plan is not None:
            _COPY_PLANS[bridge] = copy_plan
    if dist.is_initialized():
        dist.barrier()
    return path


def _export_adapter_folder(bridge: Bridge, chunks: list[torch.nn.Module], trained: Any, path: Path,
                           extra_files: Mapping[str, str]) -> None:
    """The adapters through megatron-bridge's export, rank 0 writing them as they come."""
    adapters = bridge.export_adapter_weights(chunks, on_host=_exports_to_host(chunks))
    try:
        if not dist.is_initialized() or dist.get_rank() == 0:
            write_atomically(path, partial(_write_adapter_folder, bridge, trained, adapters, extra_files))
        else:  # every rank refuses adapters no engine could apply, together
            _check_adapter_names(bridge, [name for name, _ in adapters])
    finally:
        for _ in adapters:  # every rank iterates the export to its end (its collectives)
            pass


def _exports_to_host(chunks: list[torch.nn.Module]) -> bool:
    """A model on the host exports host tensors; one on a GPU keeps its adapters there for the staged write."""
    return not next(chunks[0].parameters()).is_cuda


# the last plan of each bridge: a weight sync writes the same adapters every time
_PLANS: weakref.WeakKeyDictionary[Bridge, AdapterPlan] = weakref.WeakKeyDictionary()
# the adapter names each bridge already checked against its checkpoint (`_check_adapter_names`)
_CHECKED_NAMES: weakref.WeakKeyDictionary[Bridge, frozenset[str]] = weakref.WeakKeyDictionary()


def _write_adapter_folder(bridge: Bridge, trained: Any, adapters: Iterable[tuple[str, torch.Tensor]],
                          extra_files: Mapping[str, str], folder: Path) -> None:
    """Rank 0's part of `write_lora_adapter`: the adapters streamed into the last plan's layout while the export
    runs, or written in a new plan's layout once it has run (the first write, or other adapters)."""
    from megatron.bridge.models.conversion.model_bridge import HFWeightTuple

    settings = _lora_settings(bridge, trained)
    plan = _PLANS.get(bridge)
    file_names = plan.file_names if plan is not None and plan.settings == settings else None
    writer = None if plan is None or file_names is None else StagedWriter({folder / ADAPTER_FILE: plan.layout},
                                                                          threads=1)
    exported: list[Any] = []
    try:
        for name, tensor in adapters:
            exported.append(HFWeightTuple(name, tensor))
            if writer is not None and file_names is not None:
                # a name the plan lacks, or other bytes: the writer fails, and the file is written again below
                writer.write(file_names.get(name, name), tensor)
        specs = tuple(TensorSpec(weight.param_name, tuple(weight.weight.shape), weight.weight.dtype)
                      for weight in exported)
        if writer is not None and plan is not None and plan.exported == specs:
            writer.close()  # raises a failed write
        else:
            if writer is not None:
                writer.close(raise_error=False)
            plan, state = _plan_adapter_folder(bridge, trained, exported, specs, settings)
            _PLANS[bridge] = plan
            with StagedWriter({folder / ADAPTER_FILE: plan.layout}, threads=1) as fresh:
                for name, tensor in state.items():
                    fresh.write(name, tensor)
    except BaseException:
        if writer is not None:
            writer.close(raise_error=False)
        raise
    write_config_and_extras(folder, plan.config_text, extra_files)


def _plan_adapter_folder(bridge: Bridge, trained: Any, exported: list[Any], specs: tuple[TensorSpec, ...],
                         settings: tuple[Any, ...]) -> tuple[AdapterPlan, dict[str, torch.Tensor]]:
    """The plan of these exported adapters, and the PEFT state dict to write (megatron-bridge's PEFT layout)."""
    from megatron.bridge.models.conversion.peft_bridge import (
        build_adapter_config_dict,
        convert_adapter_weights_to_peft_state,
        infer_rank_pattern_from_adapter_weights,
        infer_target_modules_from_adapter_weights,
    )

    _check_adapter_names(bridge, [spec.name for spec in specs])
    state, module_weight_names, target_parameters = convert_adapter_weights_to_peft_state(exported)
    config = build_adapter_config_dict(
        trained,
        target_modules=infer_target_modules_from_adapter_weights(module_weight_names),
        target_parameters=target_parameters,
        base_model_name_or_path=str(bridge.hf_path),
        rank_pattern=infer_rank_pattern_from_adapter_weights(exported, default_rank=trained.dim),
    )
    layout = safetensors_layout(TensorSpec(name, tuple(tensor.shape), tensor.dtype) for name, tensor in state.items())
    # PEFT's state holds the exported tensors themselves, in the export's order, unless it packs some (experts)
    pairs = list(zip(exported, state.items()))
    as_they_are = len(state) == len(exported) and all(tensor is weight.weight for weight, (_, tensor) in pairs)
    file_names = {weight.param_name: name for weight, (name, _) in pairs} if as_they_are else None
    return AdapterPlan(specs, settings, json.dumps(config, indent=2) + "\n", layout, file_names), state


def _lora_settings(bridge: Bridge, trained: Any) -> tuple[Any, ...]:
    """What `adapter_config.json` says besides the adapters' names: a plan holds for these settings only."""
    return type(trained).__name__, trained.dim, trained.alpha, trained.dropout, str(bridge.hf_path)


_COPY_PLANS: weakref.WeakKeyDictionary[Bridge, CopyPlan] = weakref.WeakKeyDictionary()


def next_adapter_file(bridge: Bridge) -> MappedSpare | None:
    """Where `bridge`'s next adapter write goes, when it copies into a mapped spare file (`lora_folder`): whether that
    copy is a DMA (`registered`) or why not (`refusal`). None: no copy plan yet, no spare, or not mapped."""
    plan = _COPY_PLANS.get(bridge)
    return None if plan is None else plan.spare.mapping()


def _adapter_parameters(adapters: list[torch.nn.Module]) -> list[torch.nn.Parameter]:
    return [parameter for adapter in adapters for parameter in adapter.parameters()]


def _whole_model_on_every_rank() -> bool:
    """No tensor, pipeline or expert parallelism: each rank's export reads only its own parameters."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return True
    return (parallel_state.get_tensor_model_parallel_world_size() == 1
            and parallel_state.get_pipeline_model_parallel_world_size() == 1
            and parallel_state.get_expert_model_parallel_world_size() == 1
            and parallel_state.get_expert_tensor_parallel_world_size() == 1)


def _probe_copy_plan(bridge: Bridge, chunks: list[torch.nn.Module], trained: Any,
                     parameters: list[torch.nn.Parameter]) -> CopyPlan | None:
    """The copy plan (`lora_folder.find_copy_plan`) of the adapters rank 0 has just written (`_PLANS`), or None.

    Rank 0 probes and tells the others, so every rank takes the same path at the next write (the others write
    nothing: their plan only says so)."""
    settings = _lora_settings(bridge, trained)
    plan = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        folder_plan = _PLANS.get(bridge)
        if folder_plan is not None and folder_plan.settings == settings:
            export = partial(bridge.export_adapter_weights, chunks, on_host=_exports_to_host(chunks))
            plan = find_copy_plan(partial(with_stand_ins, export, parameters), folder_plan, parameters)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return plan
    found = [plan is not None]
    dist.broadcast_object_list(found, src=0, group=cpu_group())
    if dist.get_rank() == 0 or not found[0]:
        return plan
    stand_in = AdapterPlan((), settings, "", FileLayout(b"", {}), {})
    return CopyPlan(stand_in, tuple(parameters), tuple(parameter.data_ptr() for parameter in parameters), ())


def _check_adapter_names(bridge: Bridge, names: list[str]) -> None:
    """`_check_adapters_name_checkpoint_tensors`, once per set of names (it reads the checkpoint's headers)."""
    if _CHECKED_NAMES.get(bridge) != frozenset(names):
        _check_adapters_name_checkpoint_tensors(bridge, names)
        _CHECKED_NAMES[bridge] = frozenset(names)


_EXCLUDE_THE_LINEARS = ("exclude those linears from LoRACallback's target_modules (name the others, e.g. "
                        "['linear_qkv', 'linear_proj', '*.shared_experts.linear_fc1', '*.shared_experts.linear_fc2'])")


def check_adapter_form(bridge: Bridge, chunks: list[torch.nn.Module]) -> None:
    """Refuse, before the first training step, adapters the PEFT adapter form cannot write (those of experts a
    checkpoint stores fused: `WeightSync(lora_form="adapter")` calls it at fit start; `export_lora_adapter` refuses
    the same adapters when it writes). Names only: no adapter tensor is gathered. Every rank calls it."""
    _refuse_adapters_naming_no_tensor(bridge, bridge.adapted_hf_modules(chunks), "WeightSync(lora_form='adapter')",
                                      "set lora_form: merged (the engine gets the adapted weights with the adapters "
                                      f"merged in), or {_EXCLUDE_THE_LINEARS}")


def _check_adapters_name_checkpoint_tensors(bridge: Bridge, adapter_names: list[str]) -> None:
    """Refuse adapters of tensors the HF checkpoint does not hold (an engine or `peft` would apply them to nothing,
    silently); warn that the MTP layer's adapters reach no engine's draft head."""
    adapted = {name.rsplit(".lora_", 1)[0] for name in adapter_names}
    _refuse_adapters_naming_no_tensor(bridge, adapted, "export_lora_adapter",
                                      f"{_EXCLUDE_THE_LINEARS}, or use export_lora_merged / "
                                      "WeightSync(lora_form='merged')")
    if any(is_hf_mtp_tensor(name, bridge.hf_config) for name in adapted):
        warnings.warn("export_lora_adapter: the MTP layer's adapters are written, but engines apply LoRA adapters to "
                      "the main model only (transformers' models have no MTP layer): the draft head is served "
                      "without them, as the base model's head; use WeightSync(lora_form='merged') to serve the "
                      "trained head", stacklevel=2)


def _refuse_adapters_naming_no_tensor(bridge: Bridge, adapted: Collection[str], caller: str, fix: str) -> None:
    """`adapted`: HF module names; the MTP head's are left out (`export_lora_adapter` warns that engines serve no
    adapter of it)."""
    hf_path = Path(bridge.hf_path)
    stored = checkpoint_tensor_specs(hf_path).keys()
    missing = sorted(name for name in adapted if f"{name}.weight" not in stored and name not in stored
                     and not is_hf_mtp_tensor(name, bridge.hf_config))
    if missing:
        raise ValueError(f"{caller}: the adapters of {missing[:3]}{' ...' if len(missing) > 3 else ''} "
                         f"({len(missing)} in all) name no tensor of {hf_path} (a checkpoint that stores its experts "
                         f"fused has no tensor per expert), so no engine or peft could apply them; {fix}")


def export_lora_merged(strategy: MegatronStrategyContract, path: str | Path) -> Path:
    """Write an HF checkpoint with `W + (alpha / rank) * B A` in every adapted linear, atomically.

    The bridge's HF export merges the adapters into copies of the base weights (the model keeps its adapters), so
    the result loads with plain transformers. All ranks call it; rank 0 writes.
    """
    _, chunks = _megatron_bridge_and_chunks(strategy)
    _trained_lora(_lora_adapters(chunks), "export_lora_merged")
    return strategy.export_hf(path)


def _megatron_bridge_and_chunks(strategy: MegatronStrategyContract) -> tuple[Bridge, list[torch.nn.Module]]:
    from megatron.core.utils import unwrap_model

    if not strategy.model_chunks:
        raise RuntimeError("export: the strategy has no model yet; call it after trainer.fit(...)")
    check_lora_supported(strategy.bridge, mtp_only=False)
    return strategy.bridge, [unwrap_model(chunk) for chunk in strategy.model_chunks]


def _trained_lora(adapters: list[torch.nn.Module], caller: str) -> Any:
    """The `LoRA` settings the model's adapters (`_lora_adapters`) were built with (one rank, alpha and dropout for
    all of them)."""
    from megatron.bridge.peft.lora import LoRA

    if not adapters:
        raise ValueError(f"{caller}: the model has no LoRA adapters; train with "
                         "Trainer(callbacks=[LoRACallback(...)]) first, or use strategy.export_hf for a full model")
    settings = _adapter_settings(adapters)
    if len(settings) > 1:
        raise ValueError(f"{caller}: the adapters differ in (rank, alpha, dropout): {settings}; "
                         "one adapter_config.json cannot describe them")
    ((dim, alpha, dropout),) = settings
    return LoRA(dim=dim, alpha=alpha, dropout=dropout)
