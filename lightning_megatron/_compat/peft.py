"""peft 0.21 on transformers 5's MoE models: the adapters of plain MLP linears that share the experts' names.

transformers 5 fuses the routed experts of Qwen3-MoE, GLM-4.5, DeepSeek-V3 and the other "qwen2_moe"-pattern models
into 3-D parameters (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`). peft converts an adapter written against
the per-expert names (what checkpoints, vLLM and SGLang use: `mlp.experts.3.gate_proj`) by moving every target named
`gate_proj` / `up_proj` / `down_proj` from `target_modules` to the fused parameters. The shared experts
(`mlp.shared_experts.gate_proj`) and the dense layers' MLPs (`mlp.gate_proj`), still `nn.Linear` modules under those
names, lose their targets with it: their adapters are then loaded into nothing, without an error, and the logits
differ from the trained model's (huggingface/peft#3711). The adjustment puts back, after upstream's conversion, every
moved target that names such a linear of the model, by the linear's full name; routed experts stay converted.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
from collections.abc import Callable
from types import ModuleType
from typing import Any

from lightning_megatron._compat._adjustment import Adjustment, Patches

_CONVERSION = "peft.utils.transformers_weight_conversion"


def _conversion_module() -> ModuleType | None:
    """peft's transformers-5 conversion module, where it exists (peft >= 0.19 with transformers >= 5)."""
    if importlib.util.find_spec("peft") is None or importlib.util.find_spec("transformers") is None:
        return None
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        return None
    module = importlib.import_module(_CONVERSION)
    return module if hasattr(module, "_convert_peft_config_moe") else None


def _peft_converts_moe_targets() -> bool:
    return _conversion_module() is not None


def _keeping_linear_targets(convert: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    """`convert`, then the plain linears it took off `target_modules` targeted again by their full names."""
    import torch
    from peft.tuners.tuners_utils import check_target_module_exists

    def convert_keeping_linear_targets(peft_config: Any, model: torch.nn.Module) -> None:
        before = copy.copy(peft_config)  # upstream assigns new target collections: this keeps the old ones
        convert(peft_config, model)
        if peft_config.target_modules == before.target_modules:
            return
        kept = set(peft_config.target_modules or ())
        lost = {name for name, module in model.named_modules()
                if isinstance(module, torch.nn.Linear) and name not in kept
                and check_target_module_exists(before, name) and not check_target_module_exists(peft_config, name)}
        if lost:
            peft_config.target_modules = kept | lost

    return convert_keeping_linear_targets


def _install_linear_targets(patches: Patches) -> None:
    module = _conversion_module()
    assert module is not None
    patches.setattr(module, "_convert_peft_config_moe", _keeping_linear_targets(module._convert_peft_config_moe))


ADJUSTMENTS = (
    Adjustment(
        "peft.moe_linear_targets",
        "peft/utils/transformers_weight_conversion.py:402-482 `_convert_peft_config_moe` moves every `gate_proj` / "
        "`up_proj` / `down_proj` target to the fused experts (:454, :482), the shared experts' and dense MLPs' "
        "linears of those names included (huggingface/peft#3711)",
        _peft_converts_moe_targets,
        _install_linear_targets,
    ),
)
