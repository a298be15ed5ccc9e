"""DeepSeek-V3's (`deepseek_v3`) layout for the tiny checkpoints: multi-head latent attention (MLA) and YaRN RoPE.

The sizes follow the checkpoint's `head_dim` (`hidden_size // num_attention_heads` by default): the query and the
key-value latents are low-rank (`q_lora_rank`, `kv_lora_rank`), each head's key is `qk_nope_head_dim` (= head_dim)
plus `qk_rope_head_dim` rotated channels, and its value is `v_head_dim` (3/4 of head_dim), so key and value heads
differ in size as in DeepSeek-V3 (192 and 128). The rope scaling is YaRN with DeepSeek-V3's beta and mscale
values, a factor of 4 over a quarter of `max_position_embeddings` (DeepSeek-V3: 40 over 4096).
"""

from __future__ import annotations

from typing import Any

MLA_CONFIG_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def mla_sizes(hidden_size: int, head_dim: int) -> dict[str, int]:
    """The MLA fields of config.json for a checkpoint of these sizes."""
    return {"q_lora_rank": hidden_size // 2, "kv_lora_rank": hidden_size // 4, "qk_nope_head_dim": head_dim,
            "qk_rope_head_dim": head_dim // 2, "v_head_dim": 3 * head_dim // 4}


def deepseek_v3_config_fields(hidden_size: int, head_dim: int, num_attention_heads: int,
                              max_position_embeddings: int, rope_theta: float) -> dict[str, Any]:
    """config.json fields DeepSeek-V3 adds to (or changes from) a dense decoder's: MLA, YaRN, one KV head per head."""
    return {
        **mla_sizes(hidden_size, head_dim),
        "num_key_value_heads": num_attention_heads,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": rope_theta, "factor": 4.0,
                            "original_max_position_embeddings": max_position_embeddings // 4,
                            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    }


def mla_attention_shapes(prefix: str, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """One decoder layer's MLA tensors for a checkpoint of this config.json, named as DeepSeek-V3's checkpoints name
    them: without `q_lora_rank` (Moonlight, DeepSeek-V2-Lite), one query projection `q_proj`."""
    sizes = {key: config[key] for key in MLA_CONFIG_KEYS}
    hidden_size, num_attention_heads = config["hidden_size"], config["num_attention_heads"]
    q_head = sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"]
    attention = f"{prefix}self_attn."
    query: dict[str, tuple[int, ...]] = {f"{attention}q_proj.weight": (num_attention_heads * q_head, hidden_size)}
    if sizes["q_lora_rank"] is not None:
        query = {f"{attention}q_a_proj.weight": (sizes["q_lora_rank"], hidden_size),
                 f"{attention}q_a_layernorm.weight": (sizes["q_lora_rank"],),
                 f"{attention}q_b_proj.weight": (num_attention_heads * q_head, sizes["q_lora_rank"])}
    return {
        **query,
        f"{attention}kv_a_proj_with_mqa.weight": (sizes["kv_lora_rank"] + sizes["qk_rope_head_dim"], hidden_size),
        f"{attention}kv_a_layernorm.weight": (sizes["kv_lora_rank"],),
        f"{attention}kv_b_proj.weight": (num_attention_heads * (sizes["qk_nope_head_dim"] + sizes["v_head_dim"]),
                                         sizes["kv_lora_rank"]),
        f"{attention}o_proj.weight": (hidden_size, num_attention_heads * sizes["v_head_dim"]),
    }
