"""The independent Hugging Face statement of Megatron's MTP layer: what a checkpoint's MTP head should predict.

Cache-free and computed with stock transformers modules only (no Megatron, no remote code), so a Megatron MTP
implementation, a bridge's mapping or the speculative decoder's draft head can each be checked against it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from lightning_megatron.families import LINEAR_ATTENTION_MODEL_TYPES, MODEL_FAMILIES, language_model, text_model_config
from lightning_megatron.hf_io import hf_module_state, rotary_position_ids


def hf_mtp_reference_logits(path: str | Path, input_ids: torch.Tensor) -> torch.Tensor:
    """MTP-head logits of the checkpoint at ``path``, computed with Hugging Face modules only (no Megatron).

    This is the independent reference a Megatron MTP implementation is checked against. It is computed in float32
    from the safetensors with stock transformers modules (MiMo's remote code is not executed):

    1. ``h = final_norm(decoder(ids))``: the main model's last hidden states, after its final norm.
    2. ``e = embed_tokens(ids[:, 1:])``: the input ids rolled left by one (position ``t`` sees token ``t+1``).
    3. Combine, per family:

       ``x = projection(cat(embedding_norm(e), hidden_norm(h)))``, the names the family table gives
       (:class:`lightning_megatron.families.MTPNames`). MiMo puts the hidden state first (``hidden_first``), which
       is why megatron-bridge swaps the two column halves of its projection into ``eh_proj`` (Megatron
       concatenates ``[embedding, hidden]``).

    4. One decoder layer (``Qwen3DecoderLayer`` / ``Qwen2DecoderLayer`` / ``Glm4MoeDecoderLayer`` /
       ``DeepseekV3DecoderLayer`` holding the MTP layer's weights; GLM-4.5's and DeepSeek-V3's are built as the
       decoder layer they are stored as, so with their routed experts, DeepSeek-V3's with its multi-head latent
       attention and YaRN rotary embedding) with a causal mask and the same rotary positions ``0..S-2``. Qwen3.5's
       is a ``Qwen3_5DecoderLayer`` built as its first full-attention layer (gated attention; the MTP layer has no
       DeltaNet), its norms ``1 + weight``; Qwen3.5-MoE's a ``Qwen3_5MoeDecoderLayer``, so with its routed and
       shared experts.
    5. The MTP final norm, then the LM head (``embed_tokens`` if tied).

    A multimodal checkpoint (Qwen3.5's published ``qwen3_5``, ``qwen3_5_moe``) is read as the text model it holds: its
    ``text_config`` and its language model's, LM head's and MTP head's tensors.

    Returns logits ``[batch, seq - 1, vocab]`` for positions ``0..seq-2``: position ``t`` predicts token ``t+2``.
    Megatron's MTP also computes a last position (from a rolled-in pad token); causal attention keeps it from
    affecting the others, so it is left out here.
    """
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        Glm4MoeConfig,
        Glm4MoeForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
        Qwen3Config,
        Qwen3ForCausalLM,
    )
    from transformers.masking_utils import create_causal_mask
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer, Glm4MoeRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm

    path = Path(path)
    if input_ids.ndim != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [batch, seq] with seq >= 2, got shape {tuple(input_ids.shape)}")
    raw_config = json.loads((path / "config.json").read_text())
    weights = {name: t.float() for name, t in load_file(str(path / "model.safetensors")).items()}
    layout = language_model(raw_config)
    if layout is not None:  # a multimodal checkpoint: its text model's config and tensors, under the text names
        raw_config = text_model_config(raw_config)
        weights = {layout.text_name(name): t for name, t in weights.items() if layout.text_name(name) is not None}
    config_fields = {k: v for k, v in raw_config.items() if k not in ("architectures", "auto_map", "model_type")}
    config_fields.update(dtype="float32", attn_implementation="eager")

    classes = {
        "mimo": (Qwen2Config, Qwen2ForCausalLM, Qwen2DecoderLayer, Qwen2RMSNorm),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, Qwen3DecoderLayer, Qwen3RMSNorm),
        "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM, Glm4MoeDecoderLayer, Glm4MoeRMSNorm),
        "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV3DecoderLayer, DeepseekV3RMSNorm),
        "qwen3_5_text": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, Qwen3_5DecoderLayer, Qwen3_5RMSNorm),
        "qwen3_5_moe_text": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm),
    }
    model_type = raw_config["model_type"]
    names = MODEL_FAMILIES[model_type].mtp if model_type in classes else None
    if names is None or names.head(0, raw_config)["projection"] not in weights:
        raise ValueError(f"{path} has no MTP weights this reference knows (Qwen3-MTP, MiMo, GLM-4.5, DeepSeek-V3, "
                         "Qwen3.5 or Qwen3.5-MoE)")
    config_cls, model_cls, layer_cls, norm_cls = classes[model_type]
    config = config_cls(**config_fields)
    head, layer_prefix = names.head(0, raw_config), names.layer_prefix(0, raw_config)
    prefixes = names.layer_prefixes(raw_config)
    main_weights = {name: t for name, t in weights.items() if not name.startswith(prefixes)}

    model = model_cls(config).eval()
    read: set[str] = set()

    def read_main(name: str) -> torch.Tensor:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        if name not in main_weights:
            raise ValueError(f"{path}: the main model's weight {name} is missing")
        read.add(name)
        return main_weights[name]

    model.load_state_dict(hf_module_state(model.state_dict(), read_main, "", main_weights))
    if set(main_weights) - read:
        raise ValueError(f"{path}: main model weights do not match: unexpected={sorted(set(main_weights) - read)}")

    def norm(role: str) -> torch.nn.Module:
        module = norm_cls(config.hidden_size, eps=config.rms_norm_eps)
        module.load_state_dict({"weight": weights[head[role]]})
        return module

    # GLM-4.5's MTP layer is built as the decoder layer it is stored as; Qwen3.5's as its first full-attention layer
    index = (config.layer_types.index("full_attention") if model_type in LINEAR_ATTENTION_MODEL_TYPES
             else names.index(0, raw_config))
    layer = layer_cls(config, layer_idx=index).eval()
    layer.load_state_dict(hf_module_state(layer.state_dict(), weights.__getitem__, layer_prefix, weights))

    with torch.no_grad():
        hidden = model.model(input_ids=input_ids).last_hidden_state[:, :-1]
        embedded = model.model.embed_tokens(input_ids[:, 1:])
        parts = [norm("embedding_norm")(embedded), norm("hidden_norm")(hidden)]
        if names.hidden_first:
            parts.reverse()
        x = torch.nn.functional.linear(torch.cat(parts, dim=-1), weights[head["projection"]])
        position_ids = torch.arange(x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)
        mask = create_causal_mask(
            config=config, inputs_embeds=x, attention_mask=None, past_key_values=None, position_ids=position_ids
        )
        x = layer(
            x,
            attention_mask=mask,
            position_ids=position_ids,
            position_embeddings=model.model.rotary_emb(x, rotary_position_ids(model.model.rotary_emb, position_ids)),
        )
        x = norm("final_norm")(x)
        return model.lm_head(x)

