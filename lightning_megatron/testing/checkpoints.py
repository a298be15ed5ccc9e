"""Deterministic Hugging Face checkpoints with random weights, written locally, for tests, the demo and benchmarks.

Tiny by default; any real dense shape on request (the benchmarks write a Qwen3-0.6B-shaped one). Nothing here
downloads anything: every checkpoint (weights, config, tokenizer, remote code) is built from the arguments alone
(a tokenizer passed in included), so the same call gives byte-identical files (for the same transformers and
tokenizers versions; config.json records the transformers version). The MTP families carry exactly the tensor
names of the family table (`lightning_megatron.families`), which megatron-bridge 0.6.2 maps
(``qwen/qwen3_bridge.py``, ``mimo/mimo_bridge.py``). The tokenizer is `testing.tokenizer`'s, MiMo's remote code
`testing.mimo`'s; `testing.references.hf_mtp_reference_logits` says what the MTP head should predict.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from lightning_megatron.atomic import write_atomically
from lightning_megatron.families import (
    MODEL_FAMILIES,
    MTP_CONFIG_KEYS,
    checkpoint_mtp_layers,
    mtp_names,
)
from lightning_megatron.testing import qwen3_5
from lightning_megatron.testing.deepseek import MLA_CONFIG_KEYS, deepseek_v3_config_fields, mla_attention_shapes
from lightning_megatron.testing.experts import MoEShape, check_moe_shape, moe_config_fields, with_experts
from lightning_megatron.testing.mimo import write_mimo_remote_code
from lightning_megatron.testing.published import published_config
from lightning_megatron.testing.tokenizer import (
    VISION_SPECIAL_TOKENS,
    VISION_TOKEN_ROLES,
    build_tokenizer,
    special_token_roles,
    tokenizer_config,
)

Family = Literal["qwen3", "qwen2", "llama", "mimo", "qwen3_moe", "qwen2_moe", "glm4_moe", "deepseek_v3",
                 "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe"]

FAMILIES: tuple[tuple[Family, bool], ...] = (
    ("qwen3", False),
    ("qwen3", True),
    ("qwen2", False),
    ("llama", False),
    ("mimo", True),
    ("qwen3_moe", False),
    ("qwen3_moe", True),
    ("qwen2_moe", False),
    ("glm4_moe", False),
    ("glm4_moe", True),
    ("deepseek_v3", False),
    ("deepseek_v3", True),
    ("qwen3_5_text", False),
    ("qwen3_5_text", True),
    ("qwen3_5", False),
    ("qwen3_5", True),
    ("qwen3_5_moe_text", False),
    ("qwen3_5_moe_text", True),
    ("qwen3_5_moe", False),
    ("qwen3_5_moe", True),
)
"""Supported ``(family, mtp)`` combinations: MTP exists for Qwen3 (Qwen3-Next-style ``mtp.*`` keys) and MiMo
(always, ``model.mtp_layers.0.*``); Qwen2 and Llama are plain decoders. Qwen3-MoE and Qwen2-MoE (with its gated
shared expert) replace every MLP with routed experts (:class:`MoEShape`); a Qwen3-MoE MTP layer is a Qwen3-MoE
decoder layer under the same ``mtp.*`` keys, as Qwen3-Next lays it out. GLM-4.5 (``glm4_moe``) keeps its first
``MoEShape.first_dense_layers`` layers dense, routes with a sigmoid and an expert bias, adds an ungated shared expert
and q/k/v biases, rotates half of each head (partial RoPE), and stores its MTP layer as decoder layer
``num_layers`` (routed experts, ``eh_proj``, ``enorm``, ``hnorm``, ``shared_head.norm``, and copies of the
embedding and LM head), as GLM-4.5-Air's checkpoint does. DeepSeek-V3 (``deepseek_v3``) has GLM-4.5's MoE and MTP
layout with multi-head latent attention and YaRN RoPE in place of GLM's attention (`testing.deepseek`), and
group-limited routing (``MoEShape.n_group``, ``topk_group``). Qwen3.5 (``qwen3_5_text``) interleaves gated DeltaNet
and gated full-attention layers, its MTP layer a full-attention one under Qwen3's ``mtp.*`` keys
(:mod:`lightning_megatron.testing.qwen3_5`); ``qwen3_5`` is the multimodal form Qwen publishes: the same text model
(the same tensors, for the same seed) under ``model.language_model.``, ``lm_head`` and ``mtp.*`` at the top, a
two-block vision tower under ``model.visual.``, and the vision tokens in its tokenizer. Qwen3.5-MoE
(``qwen3_5_moe_text``) has Qwen3.5's layers and MTP layer with routed experts (packed in the decoder layers, one by
one in the MTP layer) and a sigmoid-gated shared expert; ``qwen3_5_moe`` is its multimodal form, as ``qwen3_5`` is
Qwen3.5's."""

_ROPE_THETA = 10000.0
_RMS_EPS = 1e-6

_QWEN3_5_VARIATIONS = ("layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                       "linear_value_head_dim", "linear_conv_kernel_dim", "partial_rotary_factor",
                       "mtp_num_hidden_layers")
_ROUTER_VARIATIONS = ("n_shared_experts", "norm_topk_prob")
CONFIG_VARIATIONS: dict[str, tuple[str, ...]] = {
    "qwen3": ("rope_parameters",),
    "qwen3_5_text": _QWEN3_5_VARIATIONS,
    "qwen3_5_moe_text": _QWEN3_5_VARIATIONS,
    "glm4_moe": ("use_qk_norm", "attention_bias", "partial_rotary_factor", "num_nextn_predict_layers",
                 *_ROUTER_VARIATIONS),
    "deepseek_v3": (*MLA_CONFIG_KEYS, "rope_parameters", "num_nextn_predict_layers", *_ROUTER_VARIATIONS),
}
"""The config.json fields `make_tiny_checkpoint(config=...)` takes per (text) family: the ones its published
checkpoints differ in (the YaRN Qwen3's model cards add for long contexts; Qwen3.5-0.8B's 16 DeltaNet key heads of
128; GLM-4.6's q/k norms; Moonlight's query without a low-rank projection, `q_lora_rank: None`, and no rope scaling;
a second MTP layer), with the tensors they imply."""


def make_tiny_checkpoint(
    path: str | Path,
    family: Family = "qwen3",
    *,
    mtp: bool = False,
    tied: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    vocab_size: int = 384,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int | None = None,
    head_dim: int | None = None,
    max_position_embeddings: int = 512,
    tokenizer: Tokenizer | None = None,
    moe: MoEShape | None = None,
    config: dict[str, Any] | None = None,
    published: bool = False,
) -> Path:
    """Write a tiny, deterministic HF checkpoint of ``family`` into ``path`` and return ``path``.

    Tests and the demo need real checkpoints (config, safetensors, tokenizer, generation config) without a
    download. The same arguments always give byte-identical files. Each tensor is drawn from its own generator,
    seeded by ``seed`` and the tensor's name, so e.g. a Qwen3 checkpoint with ``mtp=True`` shares every non-MTP
    tensor with the one without. Shapes: ``num_attention_heads`` query heads and ``num_key_value_heads`` KV heads
    of ``head_dim`` (default ``hidden_size // num_attention_heads``; Qwen2 and MiMo configs have no such field, so
    there it must be the default), FFN ``intermediate_size`` (default ``2 * hidden_size``). The defaults are the
    original tiny shape; a real one (e.g. Qwen3-0.6B: 1024 hidden, 28 layers, 16/8 heads, head_dim 128,
    FFN 3072, vocab 151936) costs a few seconds per 100M parameters.

    ``(family, mtp)`` must be one of :data:`FAMILIES` (MiMo always has its MTP layer: pass ``mtp=True``).
    ``tied=True`` ties the LM head to the input embedding and leaves ``lm_head.weight`` out of the file.

    The tokenizer is a byte-level BPE trained on a fixed corpus with exactly ``vocab_size`` tokens (ChatML specials,
    bytes, merges, then ``<|reserved_N|>`` fillers) and a ChatML chat template. ``tokenizer`` writes a ready one
    instead; ``vocab_size`` must be at least its size (extra embedding rows are padding, as in real Qwen
    checkpoints). If it holds all of ``<|endoftext|>``, ``<|im_start|>`` and ``<|im_end|>`` they play their usual
    roles (eos ``<|im_end|>``; bos and pad ``<|endoftext|>``) and the chat template is written; otherwise its
    lowest-id special token is bos, eos and pad, and no chat template is written.

    The checkpoint is built in a hidden folder next to ``path`` (one per process) and renamed into place,
    replacing what was there (`lightning_megatron.atomic.write_atomically`), so a reader never sees a half-written
    checkpoint and processes writing the same one do not write into each other's files.

    ``moe``: the experts of the MoE families (default :class:`MoEShape()`); refused for the dense ones.

    ``config``: config.json fields the family's real checkpoints vary in and the tiny one's defaults lack
    (:data:`CONFIG_VARIATIONS`, e.g. Qwen3.5-0.8B's ``linear_num_key_heads``, Moonlight's ``q_lora_rank: None``,
    GLM-4.6's ``use_qk_norm: True``, two MTP layers); the tensors follow them. A multimodal family takes its text
    model's fields.

    ``published``: config.json in the layout the family's checkpoints were published in (transformers 4's
    `rope_theta`, `rope_scaling`, `torch_dtype`, ...: :func:`testing.published.published_config`), the same values
    and the same tensors as without it.
    """
    if (family, mtp) not in FAMILIES:
        raise ValueError(f"unsupported (family, mtp)=({family!r}, {mtp}); supported: {FAMILIES}")
    shape = CheckpointShape(
        num_layers=num_layers,
        hidden_size=hidden_size,
        vocab_size=vocab_size,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=2 * hidden_size if intermediate_size is None else intermediate_size,
        head_dim=hidden_size // num_attention_heads if head_dim is None else head_dim,
        max_position_embeddings=max_position_embeddings,
    )
    _check_shape(family, shape, explicit_head_dim=head_dim is not None)
    multimodal = MODEL_FAMILIES[family].language_model
    text_family: Family = family if multimodal is None else multimodal.model_type  # type: ignore[assignment]
    moe = check_moe_shape(text_family, moe)
    config_variation = _check_config_variation(text_family, mtp, config or {})
    if tokenizer is None:
        tokenizer = build_tokenizer(vocab_size, VISION_SPECIAL_TOKENS if multimodal else ())
    elif tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} is smaller than the given tokenizer's {tokenizer.get_vocab_size()} tokens; "
            f"pass vocab_size >= {tokenizer.get_vocab_size()}"
        )
    roles = special_token_roles(tokenizer)
    ids = {role: tokenizer.token_to_id(token) for role, token in roles.items()}

    def write(folder: Path) -> None:
        config = _model_config(text_family, mtp, tied, dtype, shape, ids, moe, config_variation)
        shapes = with_experts(text_family, tensor_shapes(text_family, mtp, tied, shape, config), moe, shape, config)
        tensors = {name: random_tensor(name, tensor_shape, seed, zero_centred=qwen3_5.zero_centred(text_family, name))
                   .to(dtype) for name, tensor_shape in shapes.items()}
        for layer in range(checkpoint_mtp_layers(config) if mtp else 0):  # the MTP layers' copies of the embedding
            for main, copy in mtp_names(family).copy_names(layer, config).items():  # and LM head (GLM-4.5)
                tensors[copy] = tensors[main if main in tensors else "model.embed_tokens.weight"].clone()
        if multimodal is not None:  # the text model's tensors under the multimodal names, and a vision tower
            vision_ids = {role: tokenizer.token_to_id(token) for role, token in VISION_TOKEN_ROLES.items()}
            config = qwen3_5.multimodal_config(family, config, vision_ids)
            tensors = {multimodal.checkpoint_name(name): tensor for name, tensor in tensors.items()}
            tensors.update({name: random_tensor(name, tensor_shape, seed).to(dtype)
                            for name, tensor_shape in qwen3_5.vision_tower_shapes(config).items()})
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        write_json(folder / "config.json", published_config(config) if published else config)
        write_json(
            folder / "generation_config.json",
            {
                "bos_token_id": ids["bos"],
                "eos_token_id": [ids["eos"], ids["bos"]] if ids["eos"] != ids["bos"] else ids["eos"],
                "pad_token_id": ids["pad"],
                "do_sample": False,
            },
        )
        tokenizer.save(str(folder / "tokenizer.json"))
        write_json(folder / "tokenizer_config.json", tokenizer_config(roles, shape.max_position_embeddings))
        if family == "mimo":
            write_mimo_remote_code(folder)

    path = Path(path)
    write_atomically(path, write)
    return path



@dataclass(frozen=True)
class CheckpointShape:
    """A dense checkpoint's sizes, `make_tiny_checkpoint`'s shape arguments with their defaults filled in."""

    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int
    max_position_embeddings: int


def _check_shape(family: Family, shape: CheckpointShape, *, explicit_head_dim: bool) -> None:
    """Refuse shapes the HF classes or Megatron would reject later with a less clear message."""
    if shape.num_key_value_heads <= 0 or shape.num_attention_heads % shape.num_key_value_heads != 0:
        raise ValueError(
            f"num_attention_heads={shape.num_attention_heads} must be a positive multiple of "
            f"num_key_value_heads={shape.num_key_value_heads}"
        )
    if not explicit_head_dim and shape.hidden_size % shape.num_attention_heads != 0:
        raise ValueError(
            f"hidden_size={shape.hidden_size} is not divisible by num_attention_heads={shape.num_attention_heads}; "
            "pass head_dim explicitly"
        )
    if shape.head_dim <= 0 or shape.head_dim % 2 != 0:
        raise ValueError(f"head_dim must be positive and even (rotary embeddings), got {shape.head_dim}")
    if family in ("qwen2", "mimo", "qwen2_moe") and shape.head_dim * shape.num_attention_heads != shape.hidden_size:
        raise ValueError(
            f"{family} configs have no head_dim field: head_dim={shape.head_dim} must equal "
            f"hidden_size // num_attention_heads = {shape.hidden_size // shape.num_attention_heads}"
        )



def _model_config(
    family: Family,
    mtp: bool,
    tied: bool,
    dtype: torch.dtype,
    shape: CheckpointShape,
    special_ids: dict[str, int],
    moe: MoEShape | None = None,
    variation: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """config.json contents, produced by the transformers config class so it reads like a real checkpoint's."""
    from transformers import (
        DeepseekV3Config,
        Glm4MoeConfig,
        LlamaConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    fields: dict[str, Any] = dict(
        architectures=[MODEL_FAMILIES[family].architecture],
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": _ROPE_THETA},
        rms_norm_eps=_RMS_EPS,
        tie_word_embeddings=tied,
        bos_token_id=special_ids["bos"],
        eos_token_id=special_ids["eos"],
        dtype=str(dtype).removeprefix("torch."),
    )
    if family in ("qwen3", "llama", "qwen3_moe", "glm4_moe"):
        fields["head_dim"] = shape.head_dim
    if family == "deepseek_v3":
        fields.update(deepseek_v3_config_fields(shape.hidden_size, shape.head_dim, shape.num_attention_heads,
                                                shape.max_position_embeddings, _ROPE_THETA))
    if family == "glm4_moe":  # GLM-4.5's attention: q/k/v biases, no q/k norms, RoPE on half of each head
        fields.update(attention_bias=True, use_qk_norm=False)
        fields["rope_parameters"] = {**fields["rope_parameters"], "partial_rotary_factor": 0.5}
    if family in qwen3_5.MODEL_TYPES:
        fields.update(qwen3_5.config_fields(shape), rope_parameters=qwen3_5.rope_parameters(_ROPE_THETA))
    if family == qwen3_5.MOE_MODEL_TYPE:  # every MLP is routed experts: no dense FFN size
        del fields["intermediate_size"]
    if mtp:
        # The key megatron-bridge maps to mtp_num_layers (model_bridge.py CONFIG_MAPPING; mimo_bridge.py).
        fields[mtp_names(family).layers_key] = 1
    config_cls = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig, "mimo": Qwen2Config,
                  "qwen3_moe": Qwen3MoeConfig, "qwen2_moe": Qwen2MoeConfig, "glm4_moe": Glm4MoeConfig,
                  "deepseek_v3": DeepseekV3Config, qwen3_5.MODEL_TYPE: Qwen3_5TextConfig,
                  qwen3_5.MOE_MODEL_TYPE: Qwen3_5MoeTextConfig}[family]
    if moe is not None:
        fields.update(moe_config_fields(family, moe, shape))
    for key, value in (variation or {}).items():
        if key == "partial_rotary_factor":
            fields["rope_parameters"] = {**fields["rope_parameters"], key: value}
        else:
            fields[key] = value
    config = json.loads(config_cls(**fields).to_json_string(use_diff=True))
    if not mtp:  # transformers >= 5.17 defaults GLM-4.5's and DeepSeek-V3's `num_mtp_layers` to 1 (their configs)
        config.update({key: 0 for key in MTP_CONFIG_KEYS if config.get(key)})
    if family == "mimo":
        config["model_type"] = "mimo"
        config["auto_map"] = {
            "AutoConfig": "configuration_mimo.MiMoConfig",
            "AutoModel": "modeling_mimo.MiMoModel",
            "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM",
        }
    return config


def tensor_shapes(family: Family, mtp: bool, tied: bool, shape: CheckpointShape, config: dict[str, Any] | None = None
                  ) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the checkpoint with its shape, in HF naming (without the experts of the MoE families):
    what a writer of another checkpoint of the same layout draws (`bench.common.make_large_checkpoint`). `config`:
    the checkpoint's config.json (its variations of the family's layout, its MTP layer count); None: the tiny
    checkpoint's defaults for `shape`."""
    if config is None:
        config = _model_config(family, mtp, tied, torch.float32, shape, {"bos": 0, "eos": 0})
    hidden_size, vocab_size = shape.hidden_size, shape.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab_size, hidden_size),
        "model.norm.weight": (hidden_size,),
    }
    if not tied:
        shapes["lm_head.weight"] = (vocab_size, hidden_size)
    for i in range(shape.num_layers):
        shapes.update(_decoder_layer_shapes(f"model.layers.{i}.", family, shape, config, layer=i))
    names = mtp_names(family) if mtp else None
    for i in range(checkpoint_mtp_layers(config) if mtp else 0):  # the MTP layers, named as the family table says
        for role, name in names.head(i, config).items():
            shapes[name] = (hidden_size, 2 * hidden_size) if role == "projection" else (hidden_size,)
        shapes.update({copy: (vocab_size, hidden_size) for copy in names.copy_names(i, config).values()})
        shapes.update(_decoder_layer_shapes(names.layer_prefix(i, config), family, shape, config))
    return shapes


def _decoder_layer_shapes(prefix: str, family: Family, shape: CheckpointShape, config: dict[str, Any],
                          layer: int | None = None) -> dict[str, tuple[int, ...]]:
    """One decoder layer's tensors (`layer` None: an MTP layer): Qwen3 adds q/k norms, Qwen2 and MiMo add q/k/v
    biases (GLM-4.5 as its config's `use_qk_norm` and `attention_bias` say); Qwen3.5's layers are gated DeltaNet or
    gated full attention (`layer_types`), its MTP layer full attention."""
    if family in qwen3_5.MODEL_TYPES:
        full_attention = layer is None or config["layer_types"][layer] == "full_attention"
        return qwen3_5.decoder_layer_shapes(prefix, shape, config, full_attention=full_attention)
    hidden_size, ffn, head_dim = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q_size, kv_size = shape.num_attention_heads * head_dim, shape.num_key_value_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        f"{prefix}input_layernorm.weight": (hidden_size,),
        f"{prefix}post_attention_layernorm.weight": (hidden_size,),
        f"{prefix}self_attn.q_proj.weight": (q_size, hidden_size),
        f"{prefix}self_attn.k_proj.weight": (kv_size, hidden_size),
        f"{prefix}self_attn.v_proj.weight": (kv_size, hidden_size),
        f"{prefix}self_attn.o_proj.weight": (hidden_size, q_size),
        f"{prefix}mlp.gate_proj.weight": (ffn, hidden_size),
        f"{prefix}mlp.up_proj.weight": (ffn, hidden_size),
        f"{prefix}mlp.down_proj.weight": (hidden_size, ffn),
    }
    if family == "deepseek_v3":  # multi-head latent attention in place of q/k/v projections
        shapes = {name: size for name, size in shapes.items() if ".self_attn." not in name}
        shapes.update(mla_attention_shapes(prefix, config))
    if family in ("qwen3", "qwen3_moe") or (family == "glm4_moe" and config["use_qk_norm"]):
        shapes[f"{prefix}self_attn.q_norm.weight"] = (head_dim,)
        shapes[f"{prefix}self_attn.k_norm.weight"] = (head_dim,)
    if family in ("qwen2", "mimo", "qwen2_moe") or (family == "glm4_moe" and config["attention_bias"]):
        shapes[f"{prefix}self_attn.q_proj.bias"] = (q_size,)
        shapes[f"{prefix}self_attn.k_proj.bias"] = (kv_size,)
        shapes[f"{prefix}self_attn.v_proj.bias"] = (kv_size,)
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], seed: int, *, zero_centred: bool = False) -> torch.Tensor:
    """A float32 tensor that depends only on (seed, name, shape).

    Norm weights are ``1 + N(0, 0.1)`` rather than ones, so that mixing up two norms (e.g. the MTP embedding and
    hidden norms) changes the output (``N(0, 0.1)`` for a ``zero_centred`` norm, which scales by ``1 + weight``);
    matrices are ``N(0, 1/fan_in)``, which keeps activations and logits O(1).
    """
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    values = torch.randn(shape, generator=generator)
    if name.endswith("norm.weight"):
        return 0.1 * values if zero_centred else 1.0 + 0.1 * values
    if name.endswith(".bias"):
        return 0.1 * values
    return values / shape[-1] ** 0.5


def write_json(file: Path, content: dict[str, Any]) -> None:
    """JSON as the checkpoint files have it: indented, keys sorted, a final newline (byte-identical reruns)."""
    file.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")


def _check_config_variation(family: Family, mtp: bool, config: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(config) - set(CONFIG_VARIATIONS.get(family, ())))
    if unknown:
        raise ValueError(f"config: {unknown} are not fields make_tiny_checkpoint varies for {family!r}; it varies "
                         f"{CONFIG_VARIATIONS.get(family, ())}")
    if not mtp and any(config.get(key) for key in MTP_CONFIG_KEYS):
        raise ValueError(f"config: an MTP layer count needs mtp=True, got {config} with mtp=False")
    return config
