"""Messages about conditions the package handles, or libraries' notices to each other, dropped so that commands and
fits print only what a user can act on.

At a command's start (`ADJUSTMENTS`, installed by `quiet_handled_warnings()` before megatron-core is imported): the
reports of a missing piece that the other adjustments already work around (torch's "No CUDA runtime is found",
megatron-core's "Transformer Engine and Apex are not installed" and "Apex is not installed. Falling back to Torch
Norm", megatron-bridge's disabled gradient-accumulation fusion), and the notices one library gives another about
its calls (megatron-core's own default cuda_graph_modules, "GPTModel IS DEPRECATED", the advice to pre-compute
DDP layouts, torch's renamed collectives and checkpoint-loading notices read by megatron-core, Lightning's
`LeafSpec`, transformers' `torch_dtype` read by megatron-bridge). At megatron-bridge's import
(`BRIDGE_IMPORT_ADJUSTMENTS`): modelopt's `@torch.jit.script` at import, and its warning that the installed
transformers is not one it tested (megatron-bridge uses none of modelopt's HF features). At the first checkpoint save
(`SAVE_ADJUSTMENTS`, installed by `prepare_megatron_core`), megatron-core's "MCore's async save is deprecated ...
set `async_strategy` to `nvrx`": its own synchronous save writes through that writer
(`TorchDistSaveShardedStrategy.save` calls `async_save(..., async_strategy="mcore")`), so every save logs it, and the
package's background saves use that writer too (nvidia-resiliency-ext is no dependency), so the advice is nothing a
user can follow. Only those exact messages from those exact modules are dropped (each filter names its message,
category and module; never a blanket filter); every other warning and log record still shows, those about the
user's own config among them.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import re
import sys
import warnings
from collections.abc import Callable

from lightning_megatron._compat._adjustment import Adjustment, Patches
from lightning_megatron._compat.cpu import no_cuda

# torch ------------------------------------------------------------------------------------------------------------

_CPP_EXTENSION = "torch.utils.cpp_extension"
_NO_CUDA_RUNTIME = "No CUDA runtime is found"


def _cpp_extension_would_report_no_cuda_runtime() -> bool:
    return _CPP_EXTENSION not in sys.modules and no_cuda()


def _drop_warning_records(patches: Patches, logger_name: str, message_start: str) -> None:
    """Drop `logger_name`'s WARNING records whose message starts with `message_start`."""
    logger = logging.getLogger(logger_name)

    def keep(record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING and str(record.msg).startswith(message_start))

    logger.addFilter(keep)
    patches.on_revert(lambda: logger.removeFilter(keep))


def _drop_no_cuda_runtime_record(patches: Patches) -> None:
    _drop_warning_records(patches, _CPP_EXTENSION, _NO_CUDA_RUNTIME)


_TORCH_ADJUSTMENT = Adjustment(
    "torch.quiet_no_cuda_runtime",
    "torch/utils/cpp_extension.py:183 _find_cuda_home logs 'No CUDA runtime is found' at import (:364), which "
    "megatron/core/tensor_parallel/random.py:17 `from torch.utils.cpp_extension import load_inline` triggers",
    _cpp_extension_would_report_no_cuda_runtime,
    _drop_no_cuda_runtime_record,
)


# megatron-core ----------------------------------------------------------------------------------------------------

_NO_TE_OR_APEX = "Transformer Engine and Apex are not installed"
# the modules that warn: megatron.core.optimizer, .optimizer.optimizer, .optimizer.clip_grads, megatron_fsdp's
# mixed_precision (importable as megatron.core.distributed.fsdp.src.megatron_fsdp or as megatron_fsdp) and
# megatron.training.utils.common_utils (megatron-bridge imports it)
_WARNING_MODULES = r"(megatron\.core\.|megatron_fsdp\.|megatron\.training\.)"


def _missing(*modules: str) -> Callable[[], bool]:
    return lambda: all(importlib.util.find_spec(name) is None for name in modules)


def _always() -> bool:
    return True


def _ignore_warnings(message: str | tuple[str, ...], category: type[Warning], module: str
                     ) -> Callable[[Patches], None]:
    """An install that ignores the `category` warnings starting with `message` (or one of several) that `module` (a
    regex matched from the start of the module name) warns."""
    messages = (message,) if isinstance(message, str) else message

    def install(patches: Patches) -> None:
        warnings.filterwarnings("ignore", message="|".join(map(re.escape, messages)), category=category,
                                module=module)
        entry = warnings.filters[0]

        def remove() -> None:
            if entry in warnings.filters:
                warnings.filters.remove(entry)
                warnings._filters_mutated()  # what filterwarnings itself calls: modules' cached decisions are stale

        patches.on_revert(remove)

    return install


def _each(*installs: Callable[[Patches], None]) -> Callable[[Patches], None]:
    def install(patches: Patches) -> None:
        for one in installs:
            one(patches)

    return install


def _drop_records(logger_name: str, message_start: str) -> Callable[[Patches], None]:
    return lambda patches: _drop_warning_records(patches, logger_name, message_start)


_MEGATRON_CORE_ADJUSTMENT = Adjustment(
    "megatron_core.quiet_no_te_or_apex",
    "megatron/core/optimizer/__init__.py:25, optimizer/optimizer.py:29, optimizer/clip_grads.py:32, "
    "distributed/fsdp/src/megatron_fsdp/mixed_precision.py:115 and megatron/training/utils/common_utils.py:27 warn "
    "'Transformer Engine and Apex are not installed' at import (the torch fallbacks they announce are what runs)",
    _missing("transformer_engine", "apex"),
    _ignore_warnings(_NO_TE_OR_APEX, UserWarning, _WARNING_MODULES),
)

APEX_NORM = "Apex is not installed. Falling back to Torch Norm"
GPT_MODEL_DEPRECATED = "GPTModel IS DEPRECATED"
_HANDLED = (
    Adjustment(
        "megatron_core.quiet_no_apex_norm",
        "megatron/core/models/backends.py:34, models/gpt/gpt_layer_specs.py:74, "
        "models/gpt/heterogeneous/heterogeneous_layer_specs.py:68, models/vision/vit_layer_specs.py:31 and "
        "mbridge/models/internvl3/transformer_layer.py:38 warn 'Apex is not installed. Falling back to Torch Norm' "
        "at import: the torch norms are what the package builds without Apex (`no_te.py`)",
        _missing("apex"),
        _ignore_warnings(APEX_NORM, UserWarning, r"(megatron\.core\.|mbridge\.)"),
    ),
    Adjustment(
        "megatron_core.quiet_no_te_moe_experts",
        "megatron/core/extensions/transformer_engine_spec_provider.py:88 warns 'Only transformer-engine>=1.7.0 "
        "supports MoE experts, but your version is 0.0.0' when megatron-bridge builds its default specs without "
        "Transformer Engine (0.0.0: none installed); the local experts it falls back to are what runs",
        _missing("transformer_engine"),
        _ignore_warnings("Only transformer-engine>=1.7.0 supports MoE experts, but your version is 0.0.0",
                         UserWarning, r"megatron\.core\.extensions\.transformer_engine_spec_provider"),
    ),
    Adjustment(
        "megatron_core.quiet_mimo_experimental",
        "megatron/core/models/mimo/config/base_configs.py:36 warns 'MimoModelConfig is experimental' when the "
        "class is defined (megatron-bridge imports it); the package builds no MIMO model",
        _always,
        _ignore_warnings("MimoModelConfig is experimental", UserWarning,
                         r"megatron\.core\.models\.mimo\.config\.base_configs"),
    ),
    Adjustment(
        "megatron_core.quiet_full_cuda_graph_scope",
        "megatron/core/transformer/transformer_config.py:2415 warns 'full scope is deprecated' for its own default "
        "(`cuda_graph_modules: ... = \"full\"`, :1047): every TransformerConfig built warns it; the package sets no "
        "cuda_graph_modules",
        _always,
        _ignore_warnings("full scope is deprecated", UserWarning, r"megatron\.core\.transformer\.transformer_config"),
    ),
    Adjustment(
        "megatron_core.quiet_gpt_model_deprecated",
        "megatron/core/models/gpt/gpt_model.py:118 logs 'GPTModel IS DEPRECATED ... HybridModel' for every model "
        "built: GPTModel is what megatron-bridge and mbridge build for the families the package trains",
        _always,
        _drop_records("megatron.core.models.gpt.gpt_model", GPT_MODEL_DEPRECATED),
    ),
    Adjustment(
        "megatron_core.quiet_ddp_layout_advice",
        "megatron/core/distributed/distributed_data_parallel.py:133 logs 'full_param_layout not provided ... "
        "Callers should pre-compute layouts' to the code that wraps the model (`schedule.wrap_chunks`), which "
        "leaves that layout to DDP on purpose: DDP computes it from its own bucket size and groups",
        _always,
        _drop_records("megatron.core.distributed.distributed_data_parallel",
                      "DistributedDataParallel: full_param_layout not provided"),
    ),
    Adjustment(
        "megatron_bridge.quiet_no_gradient_accumulation_fusion",
        "megatron/bridge/utils/fusions.py:63 logs 'gradient_accumulation_fusion requires either TransformerEngine "
        "or the fused_weight_gradient_mlp_cuda APEX extension' for each model it configures; the unfused path it "
        "falls back to is what runs",
        _missing("transformer_engine", "fused_weight_gradient_mlp_cuda"),
        _drop_records("megatron.bridge.utils.fusions", "gradient_accumulation_fusion requires either"),
    ),
    Adjustment(
        "megatron_core.quiet_non_leaf_grad_read",
        "megatron/core/optimizer/optimizer.py:68 `_zero_grad_group_helper` reads `.grad` of the distributed "
        "optimizer's fp32 shards, views of the parameters (distrib_optimizer.py:467; its zero_grad, :2581, says "
        "'throws grad-access warning'), and torch warns about reading a non-leaf `.grad` at every step; on CPU the "
        "warning names the frame of `cpu.py`'s torch-function mode that forwards the read",
        _always,
        _ignore_warnings("The .grad attribute of a Tensor that is not a leaf Tensor is being accessed", UserWarning,
                         r"(megatron\.core\.optimizer\.optimizer|lightning_megatron\._compat\.cpu)$"),
    ),
    Adjustment(
        "torch.quiet_collective_renames",
        "torch/distributed/c10d_logger.py:83 warns that `reduce_scatter_tensor` and `all_gather_into_tensor` are "
        "deprecated when megatron/core/distributed/param_and_grad_buffer.py:712 and :515 call them at every step",
        _always,
        _ignore_warnings(("`torch.distributed.reduce_scatter_tensor` is deprecated",
                          "`torch.distributed.all_gather_into_tensor` is deprecated"), FutureWarning,
                         r"torch\.distributed\.c10d_logger$"),
    ),
    Adjustment(
        "torch.quiet_dcp_load_notices",
        "megatron/core/dist_checkpointing/serialization.py:229 and strategies/torch.py:979 call "
        "`torch.distributed.checkpoint.load` the way torch/distributed/checkpoint/utils.py:467 ('The argument order "
        "of load has been changed') and state_dict_loader.py:160 ('torch.distributed is disabled ... single "
        "process') announce, at every checkpoint load (`export`, a resumed fit); torch/distributed/checkpoint/"
        "planner_helpers.py:523 reads a ShardedTensor's device, which warns 'we are deprecating ShardedTensor' "
        "(on CPU naming the frame of `cpu.py`'s torch-function mode)",
        _always,
        _each(
            _ignore_warnings(("The argument order of load has been changed",
                              "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
                              "load in a single process"), UserWarning, r"torch\.distributed\.checkpoint\."),
            _ignore_warnings("Please use DTensor instead and we are deprecating ShardedTensor", FutureWarning,
                             r"(torch\.distributed\.checkpoint\.planner_helpers|lightning_megatron\._compat\.cpu)$"),
        ),
    ),
    Adjustment(
        "lightning.quiet_leaf_spec",
        "lightning/pytorch/utilities/_pytree.py:21 builds `LeafSpec()`, which torch/utils/_pytree.py:1364 deprecates, "
        "whenever Lightning combines the dataloaders",
        _always,
        _ignore_warnings("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning,
                         r"lightning\.pytorch\.utilities\._pytree$"),
    ),
    Adjustment(
        "transformers.quiet_torch_dtype_property",
        "transformers/configuration_utils.py:415 logs '`torch_dtype` is deprecated! Use `dtype` instead!' when "
        "megatron/bridge/models/conversion/model_bridge.py:1475 reads `config.torch_dtype`",
        _always,
        _drop_records("transformers.configuration_utils", "`torch_dtype` is deprecated!"),
    ),
)

ADJUSTMENTS = (_TORCH_ADJUSTMENT, _MEGATRON_CORE_ADJUSTMENT, *_HANDLED)


# megatron-core's checkpoint saves -------------------------------------------------------------------------------

_TORCH_DIST_STRATEGY = "megatron.core.dist_checkpointing.strategies.torch"
MCORE_ASYNC_SAVE_DEPRECATED = "MCore's async save is deprecated"


def _save_logs_the_mcore_async_notice() -> bool:
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return MCORE_ASYNC_SAVE_DEPRECATED in inspect.getsource(TorchDistSaveShardedStrategy.async_save)


def _drop_mcore_async_notice(patches: Patches) -> None:
    _drop_warning_records(patches, _TORCH_DIST_STRATEGY, MCORE_ASYNC_SAVE_DEPRECATED)


_SAVE_ADJUSTMENT = Adjustment(
    "megatron_core.quiet_mcore_async_save_notice",
    "megatron/core/dist_checkpointing/strategies/torch.py:749 logs 'MCore's async save is deprecated ... setting "
    "`async_strategy` to `nvrx`' at the first save of a process; the synchronous save itself writes through that "
    "writer (:727, in `save`, calls `async_save(..., async_strategy=\"mcore\")`), the package's background save "
    "uses it too, and nvidia-resiliency-ext is no dependency",
    _save_logs_the_mcore_async_notice,
    _drop_mcore_async_notice,
)

SAVE_ADJUSTMENTS = (_SAVE_ADJUSTMENT,)


# megatron-bridge's import -----------------------------------------------------------------------------------------

_MODELOPT_QUANTIZATION = "modelopt.torch.quantization"
TORCH_JIT_SCRIPT_DEPRECATED = "`torch.jit.script` is deprecated"
# modelopt/torch/__init__.py:51-58, for transformers outside [4.57, 5.15): megatron-bridge uses no modelopt feature
# that reads HF models, and its advice (`pip install -U nvidia-modelopt[hf]`) would replace the user's transformers
MODELOPT_UNTESTED_TRANSFORMERS = r"transformers \S+ is not tested with current version of modelopt"


def _modelopt_not_imported_yet() -> bool:
    return _MODELOPT_QUANTIZATION not in sys.modules and importlib.util.find_spec("modelopt") is not None


def import_modelopt_quantization_quietly(patches: Patches | None = None) -> None:
    """Import it (the adjustment's install: nothing to patch), ignoring its import's two notices during that import
    only: torch's names torch's own frame, so a filter left in place would hide every later `torch.jit.script`
    notice too (a user's own code among them)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape(TORCH_JIT_SCRIPT_DEPRECATED), category=FutureWarning)
        warnings.filterwarnings("ignore", message=MODELOPT_UNTESTED_TRANSFORMERS, category=UserWarning,
                                module=r"modelopt\.torch$")
        importlib.import_module(_MODELOPT_QUANTIZATION)


BRIDGE_IMPORT_ADJUSTMENTS = (
    Adjustment(
        "modelopt.quiet_import_notices",
        "modelopt/torch/quantization/tensor_quant.py:290 decorates with `@torch.jit.script` at import, which "
        "torch/jit/_script.py:1491 deprecates, and modelopt/torch/__init__.py:51-58 warns 'transformers X is not "
        "tested with current version of modelopt' for transformers outside [4.57, 5.15); megatron/bridge/training/"
        "checkpointing.py, gpt_step.py and train.py import modelopt when megatron-bridge is imported",
        _modelopt_not_imported_yet,
        import_modelopt_quantization_quietly,
    ),
)
