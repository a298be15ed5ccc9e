"""config.json in the form the families' checkpoints were published in, for the tiny checkpoints.

`make_tiny_checkpoint` writes config.json through transformers 5's config classes (`rope_parameters`, `dtype`); the
checkpoints users download were mostly written by transformers 4 and keep that layout: `rope_theta` and
`rope_scaling` at the top (`rope_scaling: null` for plain RoPE, `"type": "yarn"` for DeepSeek-V3), GLM-4.5's
`partial_rotary_factor` at the top, `torch_dtype`, and keys transformers 5 no longer writes (`auto_map` naming
DeepSeek's remote code, `topk_method`, `use_mrope`, ...). `published_config` rewrites a tiny checkpoint's config into
that layout with the same values, so a test can check that both forms build the same model. The layouts follow
zai-org/GLM-4.5-Air, deepseek-ai/DeepSeek-V3 (and moonshotai/Moonlight-16B-A3B), XiaomiMiMo/MiMo-7B-RL, Qwen/Qwen3-8B,
Qwen/Qwen3-30B-A3B and Qwen/Qwen3.5-35B-A3B (a multimodal one: transformers-5 keys already, with the rotary share
repeated at the top of `text_config` and fields transformers 5 drops).
"""

from __future__ import annotations

import copy
from typing import Any

PUBLISHED_FAMILIES = ("qwen3", "qwen3_moe", "mimo", "glm4_moe", "deepseek_v3", "qwen3_5", "qwen3_5_moe")
"""The `model_type`s whose published config.json layout `published_config` writes."""

# The transformers version each family's published config.json records.
_TRANSFORMERS_VERSION = {"qwen3": "4.51.0", "qwen3_moe": "4.51.0", "mimo": "4.40.1", "glm4_moe": "4.54.0",
                         "deepseek_v3": "4.46.3", "qwen3_5": "4.57.1", "qwen3_5_moe": "4.57.1"}
# Keys the published configs hold that transformers 5's config classes no longer write (same meaning as its defaults).
_EXTRA_KEYS: dict[str, dict[str, Any]] = {
    "qwen3": {"attention_bias": False, "use_sliding_window": False, "sliding_window": None},
    "qwen3_moe": {"attention_bias": False, "use_sliding_window": False, "sliding_window": None},
    "mimo": {"use_mrope": False, "use_sliding_window": False},
    "glm4_moe": {},
    "deepseek_v3": {"auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
                    "ep_size": 1, "moe_layer_freq": 1, "scoring_func": "sigmoid", "topk_method": "noaux_tc"},
}
# Keys transformers 5 writes that the published configs lack (derived again on load).
_DERIVED_KEYS = {"deepseek_v3": ("head_dim", "qk_head_dim", "rope_interleave"), "mimo": ("layer_types",),
                 "qwen3": ("layer_types",), "qwen3_moe": ()}
# Qwen3.5's text_config fields transformers 5 drops (Qwen/Qwen3.5-35B-A3B's).
_QWEN3_5_TEXT_EXTRAS = {"attn_output_gate": True, "mamba_ssm_dtype": "float32", "mtp_use_dedicated_embeddings": False}


def published_config(config: dict[str, Any]) -> dict[str, Any]:
    """`config` (a tiny checkpoint's config.json, transformers 5's layout) in its family's published layout."""
    model_type = config.get("model_type")
    if model_type not in PUBLISHED_FAMILIES:
        raise ValueError(f"model_type: {model_type!r} has no published layout here; the families with one are "
                         f"{', '.join(PUBLISHED_FAMILIES)}")
    config = copy.deepcopy(config)
    config["transformers_version"] = _TRANSFORMERS_VERSION[model_type]
    if "text_config" in config:  # Qwen3.5: the rotary share also at the top of text_config, as published
        text = config["text_config"]
        text.update(_QWEN3_5_TEXT_EXTRAS, partial_rotary_factor=text["rope_parameters"]["partial_rotary_factor"])
        config["vision_config"]["deepstack_visual_indexes"] = []
        return config
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:
        config["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    rope_type = rope.pop("rope_type")
    config["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}
    config["torch_dtype"] = config.pop("dtype")
    for key in _DERIVED_KEYS.get(model_type, ()):
        config.pop(key, None)
    config.update(_EXTRA_KEYS[model_type])
    if model_type == "mimo":  # MiMo-7B's window is its context, unused (use_sliding_window: false)
        config["sliding_window"] = config["max_position_embeddings"]
    return config
