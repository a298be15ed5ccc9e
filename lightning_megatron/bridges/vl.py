"""Qwen vision-language checkpoints: which ones the project trains, what each cannot do, and how megatron-bridge
builds them here.

Both are built by megatron-bridge: Qwen2.5-VL (HF vision tower + Megatron MRoPE language model; its forward fuses
the image embeddings but never cuts the sequence for context parallelism, so CP must be 1) and Qwen3-VL (Megatron
vision tower with deepstack; packed THD rows and context parallelism, cut after the image embeddings are fused).
"""

from __future__ import annotations

from typing import Any

from lightning_megatron.attention import SDPAttention, with_core_attention
from lightning_megatron.families import VL_MODEL_TYPES, family
from lightning_megatron.options import AttentionBackend

CONTEXT_PARALLEL_VL_MODELS = ("qwen3_vl",)


class VLOptionError(ValueError):
    """A VL checkpoint asked for something its model cannot do; the message names the model and the option."""


def vl_model_type(hf_config: dict[str, Any]) -> str | None:
    """The VL family of an HF ``config.json`` (``"qwen2_5_vl"``, ``"qwen3_vl"``), or None for a text model."""
    model_type = hf_config.get("model_type")
    return model_type if model_type in VL_MODEL_TYPES else None


def check_vl_options(hf_config: dict[str, Any], *, context_parallel_size: int,
                     attention_backend: AttentionBackend = "auto") -> None:
    """Refuse, before any model is built, what a VL checkpoint cannot do with these options (which bridge can
    build it is the bridge's own `supports_vl`)."""
    model_type = vl_model_type(hf_config)
    if model_type is None:
        return
    name = family(model_type).vl_name
    if model_type == "qwen3_vl" and attention_backend == "local":
        raise VLOptionError("attention_backend: local is not supported for Qwen3-VL: its vision tower runs one packed "
                            "sequence per image, which Megatron-Core's local attention cannot; set attention_backend: "
                            "auto or sdpa")
    if context_parallel_size > 1 and model_type not in CONTEXT_PARALLEL_VL_MODELS:
        raise VLOptionError(
            f"context_parallel_size: {context_parallel_size} is not supported for {name}: its megatron-bridge "
            "forward fuses the image embeddings but never cuts the sequence for context parallelism; set "
            "context_parallel_size: 1 (or use a Qwen3-VL checkpoint, whose forward does)"
        )


class WholeImageSDPAttention(SDPAttention):
    """`SDPAttention` for a vision tower inside a context-parallel model: it shares the model's process groups but
    sees whole images (one packed sequence each), so it never gathers keys and values over the CP group."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cp_group = None


def prepare_vl_provider(provider: Any, hf_config: dict[str, Any], attention_backend: AttentionBackend) -> None:
    """Give Qwen3-VL's vision tower the chosen core attention too (it runs one packed sequence per image)."""
    if vl_model_type(hf_config) != "qwen3_vl":
        return
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec

    spec = with_core_attention(get_vit_layer_with_local_spec(), attention_backend)
    attention = spec.submodules.self_attention.submodules
    if attention.core_attention is SDPAttention:
        attention.core_attention = WholeImageSDPAttention
    provider.vision_transformer_layer_spec = spec
