"""The Qwen3.5 layouts (HF `qwen3_5_text`, dense; `qwen3_5_moe_text`; the multimodal `qwen3_5` and `qwen3_5_moe`) for
the tiny-checkpoint maker (`testing.checkpoints`).

Qwen3.5 interleaves gated DeltaNet linear-attention layers (`linear_attn.*`) with gated full-attention layers
(`self_attn.*`, whose `q_proj` also produces the output gate, so it is twice the query size), by `layer_types`
(here a full-attention layer every `FULL_ATTENTION_INTERVAL` layers; Qwen3.5's own checkpoints have one every 4th).
Its MTP layer (`mtp.*`, the names of the family table) is one full-attention layer with a dense MLP, as in
Qwen3.5-0.8B's index; every RMSNorm but the DeltaNet output norm is zero-centred (`1 + weight`). The linear-attention
sizes follow the checkpoint's shape: as many key heads as KV heads, as many value heads as query heads, both of
`head_dim`, a causal convolution of width 4 (Qwen3.5's); `make_tiny_checkpoint(config=...)` sets the published
checkpoints' own (`linear_num_key_heads`, ..., `layer_types`), and the tensors follow the config's fields.

Qwen3.5-MoE's layers (and its MTP layer) replace the dense MLP by routed experts beside a sigmoid-gated shared
expert (`mlp.gate`, `mlp.experts.*`, `mlp.shared_expert.*`, `mlp.shared_expert_gate`). Qwen/Qwen3.5-35B-A3B's index
stores the decoder layers' experts packed (`mlp.experts.gate_up_proj` [experts, 2 x ffn, hidden], gate rows first,
and `mlp.experts.down_proj` [experts, hidden, ffn], without a `.weight`) and the MTP layer's one by one
(`mtp.layers.0.mlp.experts.{e}.gate_proj.weight`, ...); Qwen3.6 packs the MTP layer's too
(`MoEShape.packed_mtp_experts`).

The checkpoints Qwen publishes are the multimodal form (`qwen3_5`, `Qwen3_5ForConditionalGeneration`; `qwen3_5_moe`,
`Qwen3_5MoeForConditionalGeneration`): the same text model under `model.language_model.` (the family table's
`LanguageModel`), `lm_head` and `mtp.*` at the top, a vision tower under `model.visual.`, and config.json holding the
text model's config as `text_config` (with MRoPE sections: an image's tokens get 3-D positions) beside a
`vision_config`. `multimodal_config` and `vision_tower_shapes` give the tiny checkpoint of that form its config and
its vision tower (named and shaped by transformers' `Qwen3_5VisionModel` / `Qwen3_5MoeVisionModel`, which
megatron-bridge's `qwen_vl/qwen35_vl_bridge.py` maps too).
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from lightning_megatron.families import MODEL_FAMILIES


class CheckpointShape(Protocol):
    """The sizes of `testing.checkpoints.CheckpointShape` a Qwen3.5 layer is made of."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int

MODEL_TYPE = "qwen3_5_text"
MOE_MODEL_TYPE = "qwen3_5_moe_text"
MODEL_TYPES = (MODEL_TYPE, MOE_MODEL_TYPE)
FULL_ATTENTION_INTERVAL = 2
CONV_KERNEL = 4
PARTIAL_ROTARY_FACTOR = 0.25  # Qwen3.5's: RoPE on the first quarter of each head


def config_fields(shape: CheckpointShape) -> dict[str, Any]:
    """The config fields of Qwen3.5 beyond a dense decoder's (`Qwen3_5TextConfig` derives `layer_types`)."""
    return dict(
        head_dim=shape.head_dim,
        full_attention_interval=FULL_ATTENTION_INTERVAL,
        linear_conv_kernel_dim=CONV_KERNEL,
        linear_key_head_dim=shape.head_dim,
        linear_value_head_dim=shape.head_dim,
        linear_num_key_heads=shape.num_key_value_heads,
        linear_num_value_heads=shape.num_attention_heads,
    )


def rope_parameters(theta: float) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": PARTIAL_ROTARY_FACTOR}


def zero_centred(family: str, name: str) -> bool:
    """Whether tensor `name` of a `family` checkpoint is a zero-centred RMSNorm weight (scale `1 + weight`): every
    Qwen3.5 norm but the DeltaNet's gated output norm (the family table's `zero_centered_norms`)."""
    return (MODEL_FAMILIES[family].zero_centered_norms and name.endswith("norm.weight")
            and ".linear_attn.norm." not in name)


def packs_experts(family: str, mlp_prefix: str, packed_mtp_experts: bool) -> bool:
    """Whether the routed experts under `mlp_prefix` are stored packed: Qwen3.5-MoE's decoder layers', and its MTP
    layer's with `packed_mtp_experts` (Qwen3.6's layout)."""
    return family == MOE_MODEL_TYPE and (packed_mtp_experts or mlp_prefix.startswith("model.layers."))


def packed_expert_shapes(mlp_prefix: str, num_experts: int, hidden_size: int, expert_size: int
                         ) -> dict[str, tuple[int, ...]]:
    """The packed routed experts of one Qwen3.5-MoE decoder layer, as transformers' `Qwen3_5MoeExperts` holds them."""
    return {f"{mlp_prefix}experts.gate_up_proj": (num_experts, 2 * expert_size, hidden_size),
            f"{mlp_prefix}experts.down_proj": (num_experts, hidden_size, expert_size)}


def decoder_layer_shapes(prefix: str, shape: CheckpointShape, config: dict[str, Any], *, full_attention: bool
                         ) -> dict[str, tuple[int, ...]]:
    """One Qwen3.5 decoder layer's tensors: gated full attention or gated DeltaNet (its sizes the config's
    `linear_*` fields), then a dense SwiGLU MLP."""
    hidden_size, ffn, head_dim = shape.hidden_size, shape.intermediate_size, shape.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        f"{prefix}input_layernorm.weight": (hidden_size,),
        f"{prefix}post_attention_layernorm.weight": (hidden_size,),
        f"{prefix}mlp.gate_proj.weight": (ffn, hidden_size),
        f"{prefix}mlp.up_proj.weight": (ffn, hidden_size),
        f"{prefix}mlp.down_proj.weight": (hidden_size, ffn),
    }
    if full_attention:
        q_size, kv_size = shape.num_attention_heads * head_dim, shape.num_key_value_heads * head_dim
        shapes.update({
            f"{prefix}self_attn.q_proj.weight": (2 * q_size, hidden_size),  # queries and their output gates
            f"{prefix}self_attn.k_proj.weight": (kv_size, hidden_size),
            f"{prefix}self_attn.v_proj.weight": (kv_size, hidden_size),
            f"{prefix}self_attn.o_proj.weight": (hidden_size, q_size),
            f"{prefix}self_attn.q_norm.weight": (head_dim,),
            f"{prefix}self_attn.k_norm.weight": (head_dim,),
        })
        return shapes
    key_size = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value_heads = config["linear_num_value_heads"]
    value_size = value_heads * config["linear_value_head_dim"]
    conv_size = 2 * key_size + value_size
    shapes.update({
        f"{prefix}linear_attn.in_proj_qkv.weight": (conv_size, hidden_size),
        f"{prefix}linear_attn.in_proj_z.weight": (value_size, hidden_size),
        f"{prefix}linear_attn.in_proj_b.weight": (value_heads, hidden_size),
        f"{prefix}linear_attn.in_proj_a.weight": (value_heads, hidden_size),
        f"{prefix}linear_attn.conv1d.weight": (conv_size, 1, config["linear_conv_kernel_dim"]),
        f"{prefix}linear_attn.dt_bias": (value_heads,),
        f"{prefix}linear_attn.A_log": (value_heads,),
        f"{prefix}linear_attn.norm.weight": (config["linear_value_head_dim"],),
        f"{prefix}linear_attn.out_proj.weight": (hidden_size, value_size),
    })
    return shapes


def _multimodal_classes(family: str) -> tuple[type, type]:
    """transformers' config class and vision tower class of a multimodal Qwen3.5 family."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

    classes = {"qwen3_5": (Qwen3_5Config, Qwen3_5VisionModel), "qwen3_5_moe": (Qwen3_5MoeConfig, Qwen3_5MoeVisionModel)}
    if family not in classes:
        raise ValueError(f"family: {family!r} is not a multimodal Qwen3.5 family; use one of {', '.join(classes)}")
    return classes[family]


def multimodal_config(family: str, text_config: dict[str, Any], token_ids: dict[str, int]) -> dict[str, Any]:
    """The config.json of the multimodal `family` checkpoint holding a text model of `text_config` (the tiny one's),
    with a two-block vision tower a quarter of the text width and `token_ids` for its image, video and vision-span
    tokens.

    The text model's rotary half-dims are split over MRoPE's temporal, height and width sections in the proportions of
    Qwen3.5's [11, 11, 10] (interleaved); on text, whose three positions are equal, that is the text model's RoPE.
    """
    config_class, _ = _multimodal_classes(family)
    text = {key: value for key, value in text_config.items() if key not in ("architectures", "transformers_version")}
    rope = text["rope_parameters"]
    half = int(text["head_dim"] * rope["partial_rotary_factor"]) // 2
    temporal = -(-half * 11 // 32)  # Qwen3.5's 11 of 32, rounded up
    text["rope_parameters"] = {**rope, "mrope_section": [temporal, temporal, half - 2 * temporal],
                               "mrope_interleaved": True}
    hidden = int(text["hidden_size"])
    vision = dict(depth=2, hidden_size=hidden // 2, num_heads=2, intermediate_size=hidden, out_hidden_size=hidden,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64)
    config = config_class(text_config=text, vision_config=vision, tie_word_embeddings=text["tie_word_embeddings"],
                          dtype=text["dtype"], **token_ids)
    fields = json.loads(config.to_json_string(use_diff=True))
    fields["architectures"] = [MODEL_FAMILIES[family].architecture]
    return fields


def vision_tower_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The vision tower's tensors (checkpoint names, shapes) of a multimodal config, as transformers builds it."""
    import torch

    family = config["model_type"]
    config_class, vision_model_class = _multimodal_classes(family)
    with torch.device("meta"):
        tower = vision_model_class(config_class(**config).vision_config)
    (prefix,) = MODEL_FAMILIES[family].language_model.other_prefixes
    return {prefix + name: tuple(tensor.shape) for name, tensor in tower.state_dict().items()}
