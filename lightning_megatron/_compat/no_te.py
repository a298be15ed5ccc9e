"""megatron-core 0.19 and megatron-bridge 0.6 without Transformer Engine (and Apex).

megatron-core falls back to torch optimizers and norms, whose checkpoint state and sequence-parallel support differ
from Apex's and TE's; megatron-bridge imports TE unconditionally and defaults to TE layer specs. Without TE, the
local (plain PyTorch) specs are used instead. These adjustments are needed on the GPU machine too, which has no TE.
mbridge's are in `mbridge.py`.
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import functools
import importlib
import importlib.util
import inspect
import logging
import types
from collections.abc import Iterator
from typing import Any

import torch

from lightning_megatron._compat._adjustment import Adjustment, Patches
from lightning_megatron.families import mtp_names


def no_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is None


# megatron-core ----------------------------------------------------------------------------------------------------


def _no_apex_or_transformer_engine_optimizer() -> bool:
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def _install_state_dict_before_first_step(patches: Patches) -> None:
    """Without Apex/TE the torch optimizer has no per-parameter state (hence no `step`) before its first step, and
    upstream asserts it finds exactly one `step`; loading a checkpoint needs this state dict first. Step 0 it is."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    upstream_state_dict = DistributedOptimizer.state_dict

    def state_dict(self: Any) -> dict[str, Any]:
        if self.optimizer.state:
            return upstream_state_dict(self)
        inner_state_dict = self.optimizer.state_dict()
        optimizer_state = {key: value for key, value in inner_state_dict.items() if key != "state"}
        for param_group in optimizer_state["param_groups"]:
            del param_group["params"]
            param_group["step"] = 0
        state = {"optimizer": optimizer_state}
        if self.grad_scaler:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    patches.setattr(DistributedOptimizer, "state_dict", state_dict)


def _install_set_states_without_step(patches: Patches) -> None:
    """Without Apex/TE each torch optimizer state holds a `step` tensor, which checkpoints do not carry (upstream
    saves `step` in the param groups); loading then looks `step` up among the loaded tensors and fails."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    upstream_set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        step = self.optimizer.state[main_param].get("step")
        if step is not None and "step" not in tensors:
            tensors = {**tensors, "step": step}  # already restored from the param groups: copied onto itself
        upstream_set_states(self, model_param, tensors)

    patches.setattr(DistributedOptimizer, "_set_main_param_and_optimizer_states", set_states)


def _install_distinct_step_tensors(patches: Patches) -> None:
    """Without Apex/TE upstream gives every parameter's state the *same* `step` tensor on load; torch's Adam then
    increments it once per parameter per step, and Adam's bias correction is wrong from the first resumed step."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    upstream_load_state_dict = DistributedOptimizer.load_state_dict

    def load_state_dict(self: Any, state_dict: dict[str, Any]) -> None:
        upstream_load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()

    patches.setattr(DistributedOptimizer, "load_state_dict", load_state_dict)


def _torch_norm_refuses_sequence_parallel() -> bool:
    from megatron.core.transformer import torch_norm

    return "not config.sequence_parallel" in inspect.getsource(torch_norm.WrappedTorchNorm.__new__)


def _install_sequence_parallel_torch_norm(patches: Patches) -> None:
    """Build the torch norm as without sequence parallelism and mark its parameters `sequence_parallel`, as Apex's
    and TE's norms do: a norm is per token, so on a sequence shard it needs no communication, and
    `finalize_model_grads` sums the marked parameters' gradients over the tensor-parallel group."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    upstream_new = WrappedTorchNorm.__new__

    def new(cls: type, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> Any:
        if not config.sequence_parallel:
            return upstream_new(cls, config, hidden_size, *args, **kwargs)
        without_sequence_parallel = copy.copy(config)
        without_sequence_parallel.sequence_parallel = False
        norm = upstream_new(cls, without_sequence_parallel, hidden_size, *args, **kwargs)
        for parameter in norm.parameters():
            parameter.sequence_parallel = True
        return norm

    patches.setattr(WrappedTorchNorm, "__new__", staticmethod(new))


def _grad_norm_syncs_per_tensor() -> bool:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    return (clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm
            and "torch.tensor(l2)" in inspect.getsource(utils.local_multi_tensor_l2_norm))


def _l2_norm_on_device(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
                       per_tensor: bool, *args: Any) -> tuple[torch.Tensor, None]:
    """Upstream's fallback's value (the 2-norm of the per-tensor 2-norms, fp32, shape [1]) computed where the
    tensors are: one multi-tensor norm kernel and one reduction instead of a host round trip per tensor."""
    tensors = tensor_lists[0]
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    return torch.linalg.vector_norm(norms).reshape(1), None


def _scale_in_place(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
                    scale: float) -> None:
    """Upstream's fallback (`dst.copy_(src * scale)` per tensor) as one multi-tensor multiply where `dst` is `src`
    (the gradient clipping's use); the same products, without a temporary and a copy per tensor."""
    sources, targets = tensor_lists
    if all(source is target for source, target in zip(sources, targets)):
        torch._foreach_mul_(targets, scale)
    else:
        torch._foreach_copy_(targets, torch._foreach_mul(sources, scale))


def _install_grad_norm_on_device(patches: Patches) -> None:
    """The gradient norm of every optimizer step, without Apex/TE, converted each parameter's norm to a Python float
    (`torch.tensor(list of device scalars)`): one host-device synchronisation per parameter tensor (226 per step of
    Qwen3-0.6B, measured on the H200), each waiting for the GPU. Computed on the device it needs none; the step's one
    remaining synchronisation is upstream's `total_norm.item()` (clip_grads.py:138)."""
    from megatron.core.optimizer import clip_grads

    patches.setattr(clip_grads, "l2_norm_impl", _l2_norm_on_device)
    patches.setattr(clip_grads, "multi_tensor_scale_impl", _scale_in_place)


MEGATRON_CORE_ADJUSTMENTS = (
    Adjustment(
        "megatron_core.distributed_optimizer_state_dict_before_first_step",
        "megatron/core/optimizer/distrib_optimizer.py:837-839 asserts one `step` among an empty optimizer state "
        "(no Apex/TE), so a checkpoint cannot be loaded into a fresh distributed optimizer",
        _no_apex_or_transformer_engine_optimizer,
        _install_state_dict_before_first_step,
    ),
    Adjustment(
        "megatron_core.distributed_optimizer_load_without_step_tensors",
        "megatron/core/optimizer/distrib_optimizer.py:1219-1223 copies every optimizer state tensor, `step` "
        "included (no Apex/TE), from loaded tensors that never contain it (KeyError: 'step')",
        _no_apex_or_transformer_engine_optimizer,
        _install_set_states_without_step,
    ),
    Adjustment(
        "megatron_core.distributed_optimizer_distinct_step_tensors",
        "megatron/core/optimizer/distrib_optimizer.py:1028-1032 assigns one shared `step` tensor to every "
        "parameter's Adam state on load (no Apex/TE), so each step adds the number of parameters to it",
        _no_apex_or_transformer_engine_optimizer,
        _install_distinct_step_tensors,
    ),
    Adjustment(
        "megatron_core.sequence_parallel_torch_norm",
        "megatron/core/transformer/torch_norm.py:50 asserts `not config.sequence_parallel` (the norm used without "
        "Apex/TE), so sequence_parallel: true cannot build a model",
        _torch_norm_refuses_sequence_parallel,
        _install_sequence_parallel_torch_norm,
    ),
    Adjustment(
        "megatron_core.grad_norm_on_device",
        "megatron/core/utils.py:1331-1332 (`local_multi_tensor_l2_norm`, the no-Apex/TE gradient norm of "
        "optimizer/clip_grads.py:116) synchronises with the device once per parameter tensor; utils.py:1336-1340 "
        "scales by a temporary and a copy per tensor",
        _grad_norm_syncs_per_tensor,
        _install_grad_norm_on_device,
    ),
)


# megatron-bridge --------------------------------------------------------------------------------------------------

_LORA_LAYERS = "megatron.bridge.peft.lora_layers"


class _AbsentTransformerEngine(types.ModuleType):
    """What `megatron.bridge.peft.lora_layers` sees as `transformer_engine`, and nothing else does.

    Every attribute is a class that can never be instantiated, so the module's `isinstance(m, te.Linear)` checks are
    False and its `-> te.ops.Sequential` annotations evaluate; `pytorch` and `ops` are nested namespaces.
    """

    _NAMESPACES = frozenset({"pytorch", "ops"})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        qualified_name = f"{self.__name__}.{name}"
        if name in self._NAMESPACES:
            value: Any = _AbsentTransformerEngine(qualified_name)
        else:
            value = type(name, (), {"__init__": _refuse_without_transformer_engine, "__module__": self.__name__})
        setattr(self, name, value)
        return value


def _refuse_without_transformer_engine(self: Any, *args: Any, **kwargs: Any) -> None:
    raise ModuleNotFoundError(f"{type(self).__module__}.{type(self).__name__} needs Transformer Engine")


@contextlib.contextmanager
def _transformer_engine_stubbed_for(importer: str) -> Iterator[None]:
    """While open, `import transformer_engine...` executed by module `importer` (only) gets the stub."""
    original_import = builtins.__import__
    stub = _AbsentTransformerEngine("transformer_engine")

    def import_(name: str, globals: dict | None = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        is_transformer_engine = name == "transformer_engine" or name.startswith("transformer_engine.")
        if level == 0 and is_transformer_engine and globals is not None and globals.get("__name__") == importer:
            return stub  # the top-level package, as `import transformer_engine.pytorch as te` expects
        return original_import(name, globals, locals, fromlist, level)

    builtins.__import__ = import_
    try:
        yield
    finally:
        builtins.__import__ = original_import


def _install_lora_layers_without_transformer_engine(patches: Patches) -> None:
    """Imports `lora_layers` (and with it `megatron.bridge`) once; an imported module cannot be un-imported, so there
    is nothing to revert, and the test shows the failure in a fresh interpreter."""
    with _transformer_engine_stubbed_for(_LORA_LAYERS):
        importlib.import_module(_LORA_LAYERS)


def _install_peft_without_transformer_engine(patches: Patches) -> None:
    """peft's TE flags only check that megatron-core defines the TE classes, which it does as MagicMocks."""
    from megatron.bridge.peft import module_matcher, utils

    patches.setattr(utils, "HAVE_TE", False)
    for flag in ("HAVE_TE", "HAVE_TE_COL_LINEAR", "HAVE_TE_LN_COL_LINEAR", "HAVE_TE_ROW_LINEAR"):
        patches.setattr(module_matcher, flag, False)


def _install_local_layer_spec(patches: Patches) -> None:
    from megatron.bridge.models import gpt_provider

    patches.setattr(gpt_provider, "transformer_engine_layer_spec", gpt_provider.local_layer_spec)


def _local_mtp_block_spec(config: Any, vp_stage: int | None = None) -> Any:
    """`gpt_provider.mtp_block_spec` building the MTP layers from local specs."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs, get_gpt_mtp_block_spec

    if not getattr(config, "mtp_num_layers", None):
        return None
    spec = config.transformer_layer_spec
    if callable(spec):
        spec = spec(config, vp_stage=vp_stage) if "vp_stage" in inspect.signature(spec).parameters else spec(config)
    if hasattr(spec, "layer_specs") and len(spec.layer_specs) == 0:
        # a pipeline stage without decoder layers (MoE block specs): the MTP layer copies the last decoder layer
        spec = get_gpt_decoder_layer_specs(
            config, use_transformer_engine=False, normalization=config.normalization, qk_l2_norm=config.qk_l2_norm
        )[-1]
    return get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage)


def _install_local_mtp_block_spec(patches: Patches) -> None:
    from megatron.bridge.models import gpt_provider

    patches.setattr(gpt_provider, "mtp_block_spec", _local_mtp_block_spec)


_MTP_FUSED_NORM = "mtp.layers.0.mtp_model_layer.self_attention.linear_qkv.layer_norm_weight"
_MTP_SEPARATE_NORM = "mtp.layers.0.mtp_model_layer.input_layernorm.weight"


def _mtp_layernorm_names_unaliased() -> bool:
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.param_mapping import AutoMapping

    hf_layer = mtp_names("qwen3").layer.format(i=0)
    registry = MegatronMappingRegistry(AutoMapping(_MTP_FUSED_NORM, f"{hf_layer}input_layernorm.weight"))
    return all(mapping.megatron_param != _MTP_SEPARATE_NORM for mapping in registry.mappings)


def _install_layernorm_aliases_for_any_prefix(patches: Patches) -> None:
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.param_mapping import AutoMapping

    add_upstream_aliases = MegatronMappingRegistry._add_separate_layernorm_mappings

    def add_aliases_for_any_prefix(registry: MegatronMappingRegistry) -> None:
        """Upstream's aliases, plus those for names under a fixed prefix such as `mtp.layers.0.mtp_model_layer.`."""
        add_upstream_aliases(registry)
        existing_names = {mapping.megatron_param for mapping in registry.mappings}
        for mapping in list(registry.mappings):
            if not isinstance(mapping, AutoMapping):
                continue
            for fused_name, separate_name in registry._SEPARATE_LAYERNORM_REWRITES:
                if mapping.megatron_param.endswith(f".{fused_name}"):
                    alias = mapping.megatron_param[: -len(fused_name)] + separate_name
                    if alias not in existing_names:
                        registry.mappings.append(AutoMapping(alias, mapping.hf_param, mapping.permute_dims))
                        existing_names.add(alias)
                    break

    patches.setattr(MegatronMappingRegistry, "_add_separate_layernorm_mappings", add_aliases_for_any_prefix)


def _install_llama_local_fusions(patches: Patches) -> None:
    """Turns off the two fusions the local spec cannot run; the unfused paths compute the same."""
    from megatron.bridge.models.llama.llama_bridge import LlamaBridge

    provider_bridge = LlamaBridge.provider_bridge

    @functools.wraps(provider_bridge)
    def provider_bridge_with_local_fusions(bridge: LlamaBridge, hf_pretrained: Any) -> Any:
        provider = provider_bridge(bridge, hf_pretrained)
        provider.apply_rope_fusion = False  # TE's fused RoPE kernel
        provider.persist_layer_norm = False  # Apex's persistent layer norm, which the local spec's torch norm refuses
        return provider

    patches.setattr(LlamaBridge, "provider_bridge", provider_bridge_with_local_fusions)


def _drop_missing_transformer_engine_reports(patches: Patches) -> None:
    """Without TE every TE symbol megatron-bridge tries is reported at INFO with a full traceback, twice (its own
    handler and the root logger megatron.training sets to INFO): expected failures that read like crashes. Only
    the records about transformer_engine are dropped."""
    logger = logging.getLogger("megatron.bridge.utils.import_utils")

    def keep(record: logging.LogRecord) -> bool:
        return "transformer_engine" not in record.getMessage()

    logger.addFilter(keep)
    patches.on_revert(lambda: logger.removeFilter(keep))


MEGATRON_BRIDGE_ADJUSTMENTS = (
    Adjustment(
        "megatron_bridge.quiet_missing_te_imports",
        "megatron/bridge/utils/import_utils.py:333 logs each failed TE import at INFO with its traceback",
        no_transformer_engine,
        _drop_missing_transformer_engine_reports,
    ),
    Adjustment(
        "megatron_bridge.lora_layers_import",
        "megatron/bridge/peft/lora_layers.py:20 imports transformer_engine.pytorch, so `import megatron.bridge` fails",
        no_transformer_engine,
        _install_lora_layers_without_transformer_engine,
    ),
    Adjustment(
        "megatron_bridge.peft_have_te",
        "megatron/bridge/peft/utils.py:86, module_matcher.py:40 HAVE_TE* True for MagicMock TE classes (utils.py:591)",
        no_transformer_engine,
        _install_peft_without_transformer_engine,
    ),
    Adjustment(
        "megatron_bridge.local_layer_spec",
        "megatron/bridge/models/gpt_provider.py:125 default_layer_spec builds the TE spec (gpt_layer_specs.py:233)",
        no_transformer_engine,
        _install_local_layer_spec,
    ),
    Adjustment(
        "megatron_bridge.local_mtp_block_spec",
        "megatron/bridge/models/gpt_provider.py:376 mtp_block_spec hard-codes use_transformer_engine=True",
        no_transformer_engine,
        _install_local_mtp_block_spec,
    ),
    Adjustment(
        "megatron_bridge.mtp_layernorm_aliases",
        "megatron/bridge/models/conversion/mapping_registry.py:101 aliases local-spec layernorms only for `*.` names",
        _mtp_layernorm_names_unaliased,
        _install_layernorm_aliases_for_any_prefix,
    ),
    Adjustment(
        "megatron_bridge.llama_local_fusions",
        "megatron/bridge/models/llama/llama_bridge.py:67,71 persist_layer_norm, apply_rope_fusion: Apex/TE fusions",
        no_transformer_engine,
        _install_llama_local_fusions,
    ),
)
