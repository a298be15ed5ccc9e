"""Deterministic Hugging Face checkpoints with random weights, written locally, for tests, the demo and benchmarks.

Tiny by default; any real dense shape on request (the benchmarks write a Qwen3-0.6B-shaped one). Nothing here
downloads anything: every checkpoint (weights, config, tokenizer, remote code) is built from the arguments alone
(a tokenizer passed in included), so the same call gives byte-identical files (for the same transformers and
tokenizers versions; config.json records the transformers version). The MTP families carry exactly the tensor
names megatron-bridge 0.6.2 maps (``qwen/qwen3_bridge.py``, ``mimo/mimo_bridge.py``), and
:func:`hf_mtp_reference_logits` computes what the MTP head should predict using Hugging Face modules only, as an
independent check on whatever Megatron computes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

Family = Literal["qwen3", "qwen2", "llama", "mimo", "qwen3_moe", "qwen2_moe"]

FAMILIES: tuple[tuple[Family, bool], ...] = (
    ("qwen3", False),
    ("qwen3", True),
    ("qwen2", False),
    ("llama", False),
    ("mimo", True),
    ("qwen3_moe", False),
    ("qwen3_moe", True),
    ("qwen2_moe", False),
)
"""Supported ``(family, mtp)`` combinations: MTP exists for Qwen3 (Qwen3-Next-style ``mtp.*`` keys) and MiMo
(always, ``model.mtp_layers.0.*``); Qwen2 and Llama are plain decoders. Qwen3-MoE and Qwen2-MoE (with its gated
shared expert) replace every MLP with routed experts (:class:`MoEShape`); a Qwen3-MoE MTP layer is a Qwen3-MoE
decoder layer under the same ``mtp.*`` keys, as Qwen3-Next lays it out."""

_ARCHITECTURES: dict[Family, str] = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mimo": "MiMoForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}
_MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")

_ROPE_THETA = 10000.0
_RMS_EPS = 1e-6

_ENDOFTEXT = "<|endoftext|>"
_IM_START = "<|im_start|>"
_IM_END = "<|im_end|>"
_SPECIAL_TOKENS = (_ENDOFTEXT, _IM_START, _IM_END)

# Qwen-style ChatML. The {% generation %} block lets apply_chat_template(return_assistant_tokens_mask=True) mark
# the assistant reply (content and its <|im_end|>) as the part to train on.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Fixed training text for the byte-level BPE: English prose, chat-like lines and Python, so the merges are
# plausible for the prompts tests and the demo use. Changing it changes every tokenizer (and so every checkpoint).
_TOKENIZER_CORPUS = '''\
The quick brown fox jumps over the lazy dog. A language model reads a sequence of tokens and predicts the next
one. During training, the model sees many examples and slowly learns which words tend to follow which. The loss
goes down, the learning rate warms up and then decays, and the checkpoint is saved to disk at the end of every
epoch. Multi-token prediction adds a small extra head that guesses the token after the next one, which makes
speculative decoding faster: the draft head proposes tokens and the main model verifies them in one pass.

User: What is the capital of France?
Assistant: The capital of France is Paris.
User: Can you write a function that adds two numbers?
Assistant: Sure. Here is a short Python function that returns the sum of its two arguments.
User: Thank you! How do I run the tests?
Assistant: Install the package, then run pytest from the repository root. Every test should pass in a few seconds.
System: You are a helpful assistant. Answer briefly and correctly, and say when you do not know.

Tensor parallelism splits each weight matrix across devices, pipeline parallelism splits the layers, and data
parallelism splits the batch. The optimizer keeps a copy of the parameters in full precision, while the forward
and backward passes may run in bfloat16 to save memory and time. Gradients are reduced across the data parallel
group before the optimizer step. A learning rate that is too high makes the loss diverge; one that is too low
makes training slow. Always check that the validation loss follows the training loss.

import math
from pathlib import Path


def add(a: int, b: int) -> int:
    """Return the sum of a and b."""
    return a + b


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def step(self, amount: int = 1) -> int:
        self.value += amount
        return self.value


def read_lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as handle:
        return [line.rstrip("\\n") for line in handle if line.strip()]


for index in range(10):
    if index % 2 == 0:
        print(f"even: {index}")
    else:
        print(f"odd: {index}, square root {math.sqrt(index):.3f}")

config = {"hidden_size": 64, "num_layers": 2, "vocab_size": 384, "learning_rate": 1e-3}
result = [add(x, y) for x, y in zip(range(5), range(5, 10))]
assert result == [5, 7, 9, 11, 13], result
'''

_CONFIGURATION_MIMO_PY = '''\
"""MiMo configuration: Qwen2 plus a number of MTP (next-n prediction) layers."""

from transformers import Qwen2Config


class MiMoConfig(Qwen2Config):
    model_type = "mimo"

    num_nextn_predict_layers: int = 1
'''

_MODELING_MIMO_PY = '''\
"""MiMo = Qwen2 with MTP layers under model.mtp_layers.N, laid out as in XiaomiMiMo/MiMo-7B.

The MTP layers are only declared here, so the checkpoint loads without missing or unexpected keys; the forward
pass is plain Qwen2. Each MTP layer is a Qwen2 decoder layer (input_layernorm, self_attn, post_attention_layernorm,
mlp) plus token_layernorm, hidden_layernorm, input_proj (applied to cat([hidden, embedding])) and final_layernorm.
"""

from torch import nn
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2ForCausalLM, Qwen2Model, Qwen2RMSNorm

from .configuration_mimo import MiMoConfig


class MiMoMTPLayer(Qwen2DecoderLayer):
    def __init__(self, config: MiMoConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.token_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.hidden_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.input_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.final_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class MiMoModel(Qwen2Model):
    config_class = MiMoConfig

    def __init__(self, config: MiMoConfig) -> None:
        super().__init__(config)
        # MiMo builds every MTP attention with layer_idx 0.
        self.mtp_layers = nn.ModuleList([MiMoMTPLayer(config, 0) for _ in range(config.num_nextn_predict_layers)])
        self.post_init()


class MiMoForCausalLM(Qwen2ForCausalLM):
    config_class = MiMoConfig

    def __init__(self, config: MiMoConfig) -> None:
        super().__init__(config)
        self.model = MiMoModel(config)
        self.post_init()
'''


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

    The checkpoint is built in a temporary directory next to ``path`` and renamed into place, replacing what
    was there, so a reader never sees a half-written checkpoint.

    ``moe``: the experts of the MoE families (default :class:`MoEShape()`); refused for the dense ones.
    """
    if (family, mtp) not in FAMILIES:
        raise ValueError(f"unsupported (family, mtp)=({family!r}, {mtp}); supported: {FAMILIES}")
    shape = _Shape(
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
    moe = _check_moe_shape(family, moe)
    if tokenizer is None:
        tokenizer = _build_tokenizer(vocab_size)
    elif tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} is smaller than the given tokenizer's {tokenizer.get_vocab_size()} tokens; "
            f"pass vocab_size >= {tokenizer.get_vocab_size()}"
        )
    roles = _special_token_roles(tokenizer)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    tmp.mkdir()
    try:
        ids = {role: tokenizer.token_to_id(token) for role, token in roles.items()}
        config = _model_config(family, mtp, tied, dtype, shape, ids, moe)
        tensors = {
            name: _random_tensor(name, tensor_shape, seed).to(dtype)
            for name, tensor_shape in _with_experts(family, _tensor_shapes(family, mtp, tied, shape), moe, shape).items()
        }
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_json(tmp / "config.json", config)
        _write_json(
            tmp / "generation_config.json",
            {
                "bos_token_id": ids["bos"],
                "eos_token_id": [ids["eos"], ids["bos"]] if ids["eos"] != ids["bos"] else ids["eos"],
                "pad_token_id": ids["pad"],
                "do_sample": False,
            },
        )
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", _tokenizer_config(roles, shape.max_position_embeddings))
        if family == "mimo":
            (tmp / "configuration_mimo.py").write_text(_CONFIGURATION_MIMO_PY)
            (tmp / "modeling_mimo.py").write_text(_MODELING_MIMO_PY)
        _move_into_place(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def hf_mtp_reference_logits(path: str | Path, input_ids: torch.Tensor) -> torch.Tensor:
    """MTP-head logits of the checkpoint at ``path``, computed with Hugging Face modules only (no Megatron).

    This is the independent reference a Megatron MTP implementation is checked against. It is computed in float32
    from the safetensors with stock transformers modules (MiMo's remote code is not executed):

    1. ``h = final_norm(decoder(ids))``: the main model's last hidden states, after its final norm.
    2. ``e = embed_tokens(ids[:, 1:])``: the input ids rolled left by one (position ``t`` sees token ``t+1``).
    3. Combine, per family:

       * Qwen3-MTP: ``x = fc(cat(pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)))``;
       * MiMo: ``x = input_proj(cat(hidden_layernorm(h), token_layernorm(e)))``. MiMo puts the hidden state
         first, which is why megatron-bridge swaps the two column halves of ``input_proj`` into ``eh_proj``
         (Megatron concatenates ``[embedding, hidden]``).

    4. One decoder layer (``Qwen3DecoderLayer`` / ``Qwen2DecoderLayer`` holding the ``mtp.layers.0`` /
       ``model.mtp_layers.0`` weights) with a causal mask and the same rotary positions ``0..S-2``.
    5. The MTP final norm (``mtp.norm`` / ``final_layernorm``), then the LM head (``embed_tokens`` if tied).

    Returns logits ``[batch, seq - 1, vocab]`` for positions ``0..seq-2``: position ``t`` predicts token ``t+2``.
    Megatron's MTP also computes a last position (from a rolled-in pad token); causal attention keeps it from
    affecting the others, so it is left out here.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
    from transformers.masking_utils import create_causal_mask
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm

    path = Path(path)
    if input_ids.ndim != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [batch, seq] with seq >= 2, got shape {tuple(input_ids.shape)}")
    raw_config = json.loads((path / "config.json").read_text())
    weights = {name: t.float() for name, t in load_file(str(path / "model.safetensors")).items()}
    config_fields = {k: v for k, v in raw_config.items() if k not in ("architectures", "auto_map", "model_type")}
    config_fields.update(dtype="float32", attn_implementation="eager")

    if raw_config["model_type"] == "mimo":
        config = Qwen2Config(**config_fields)
        model_cls, layer_cls, norm_cls = Qwen2ForCausalLM, Qwen2DecoderLayer, Qwen2RMSNorm
        prefix = "model.mtp_layers.0."
        layer_names = {"enorm": "token_layernorm", "hnorm": "hidden_layernorm", "final": "final_layernorm"}
        proj_name, hidden_first = "input_proj", True
    elif raw_config["model_type"] == "qwen3" and "mtp.fc.weight" in weights:
        config = Qwen3Config(**config_fields)
        model_cls, layer_cls, norm_cls = Qwen3ForCausalLM, Qwen3DecoderLayer, Qwen3RMSNorm
        prefix = "mtp."
        layer_names = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "final": "norm"}
        proj_name, hidden_first = "fc", False
    else:
        raise ValueError(f"{path} has no MTP weights this reference knows (Qwen3-MTP or MiMo)")

    mtp_weights = {name[len(prefix) :]: t for name, t in weights.items() if name.startswith(prefix)}
    main_weights = {name: t for name, t in weights.items() if not name.startswith(prefix)}

    model = model_cls(config).eval()
    missing, unexpected = model.load_state_dict(main_weights, strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if config.tie_word_embeddings else set()):
        raise ValueError(f"{path}: main model weights do not match: missing={missing}, unexpected={unexpected}")

    def norm(name: str) -> torch.nn.Module:
        module = norm_cls(config.hidden_size, eps=config.rms_norm_eps)
        module.load_state_dict({"weight": mtp_weights[f"{name}.weight"]})
        return module

    layer_prefix = "layers.0." if prefix == "mtp." else ""
    layer = layer_cls(config, layer_idx=0).eval()
    layer.load_state_dict({name: mtp_weights[layer_prefix + name] for name in layer.state_dict()})

    with torch.no_grad():
        hidden = model.model(input_ids=input_ids).last_hidden_state[:, :-1]
        embedded = model.model.embed_tokens(input_ids[:, 1:])
        parts = [norm(layer_names["enorm"])(embedded), norm(layer_names["hnorm"])(hidden)]
        if hidden_first:
            parts.reverse()
        x = torch.nn.functional.linear(torch.cat(parts, dim=-1), mtp_weights[f"{proj_name}.weight"])
        position_ids = torch.arange(x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)
        mask = create_causal_mask(
            config=config, inputs_embeds=x, attention_mask=None, past_key_values=None, position_ids=position_ids
        )
        x = layer(
            x,
            attention_mask=mask,
            position_ids=position_ids,
            position_embeddings=model.model.rotary_emb(x, position_ids),
        )
        x = norm(layer_names["final"])(x)
        return model.lm_head(x)


@dataclass(frozen=True)
class _Shape:
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int
    max_position_embeddings: int


def _check_shape(family: Family, shape: _Shape, *, explicit_head_dim: bool) -> None:
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


def _special_token_roles(tokenizer: Tokenizer) -> dict[str, str]:
    """bos/eos/pad token strings: the ChatML ones if the tokenizer has all of them, else its first special token."""
    if all(tokenizer.token_to_id(token) is not None for token in _SPECIAL_TOKENS):
        return {"bos": _ENDOFTEXT, "eos": _IM_END, "pad": _ENDOFTEXT}
    specials = sorted((i, t.content) for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
    if not specials:
        raise ValueError(
            "the given tokenizer has neither the ChatML tokens (<|endoftext|>, <|im_start|>, <|im_end|>) nor any "
            "special token to use as bos/eos/pad; add one with tokenizer.add_special_tokens([...])"
        )
    first = specials[0][1]
    return {"bos": first, "eos": first, "pad": first}


def _model_config(
    family: Family,
    mtp: bool,
    tied: bool,
    dtype: torch.dtype,
    shape: _Shape,
    special_ids: dict[str, int],
    moe: MoEShape | None = None,
) -> dict[str, Any]:
    """config.json contents, produced by the transformers config class so it reads like a real checkpoint's."""
    from transformers import LlamaConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

    fields: dict[str, Any] = dict(
        architectures=[_ARCHITECTURES[family]],
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
    if family in ("qwen3", "llama", "qwen3_moe"):
        fields["head_dim"] = shape.head_dim
    if mtp:
        # The key megatron-bridge maps to mtp_num_layers (model_bridge.py CONFIG_MAPPING; mimo_bridge.py).
        fields["num_nextn_predict_layers"] = 1
    config_cls = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig, "mimo": Qwen2Config,
                  "qwen3_moe": Qwen3MoeConfig, "qwen2_moe": Qwen2MoeConfig}[family]
    if moe is not None:
        fields.update(_moe_config_fields(family, moe, shape))
    config = json.loads(config_cls(**fields).to_json_string(use_diff=True))
    if family == "mimo":
        config["model_type"] = "mimo"
        config["auto_map"] = {
            "AutoConfig": "configuration_mimo.MiMoConfig",
            "AutoModel": "modeling_mimo.MiMoModel",
            "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM",
        }
    return config


def _tensor_shapes(family: Family, mtp: bool, tied: bool, shape: _Shape) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the checkpoint with its shape, in HF naming."""
    hidden_size, vocab_size = shape.hidden_size, shape.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab_size, hidden_size),
        "model.norm.weight": (hidden_size,),
    }
    if not tied:
        shapes["lm_head.weight"] = (vocab_size, hidden_size)
    for i in range(shape.num_layers):
        shapes.update(_decoder_layer_shapes(f"model.layers.{i}.", family, shape))
    if family in ("qwen3", "qwen3_moe") and mtp:
        shapes.update(
            {
                "mtp.fc.weight": (hidden_size, 2 * hidden_size),
                "mtp.pre_fc_norm_embedding.weight": (hidden_size,),
                "mtp.pre_fc_norm_hidden.weight": (hidden_size,),
                "mtp.norm.weight": (hidden_size,),
            }
        )
        shapes.update(_decoder_layer_shapes("mtp.layers.0.", family, shape))
    if family == "mimo":
        prefix = "model.mtp_layers.0."
        shapes.update(
            {
                f"{prefix}token_layernorm.weight": (hidden_size,),
                f"{prefix}hidden_layernorm.weight": (hidden_size,),
                f"{prefix}input_proj.weight": (hidden_size, 2 * hidden_size),
                f"{prefix}final_layernorm.weight": (hidden_size,),
            }
        )
        shapes.update(_decoder_layer_shapes(prefix, family, shape))
    return shapes


def _decoder_layer_shapes(prefix: str, family: Family, shape: _Shape) -> dict[str, tuple[int, ...]]:
    """One decoder layer's tensors: Qwen3 adds q/k norms, Qwen2 and MiMo add q/k/v biases."""
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
    if family in ("qwen3", "qwen3_moe"):
        shapes[f"{prefix}self_attn.q_norm.weight"] = (head_dim,)
        shapes[f"{prefix}self_attn.k_norm.weight"] = (head_dim,)
    if family in ("qwen2", "mimo", "qwen2_moe"):
        shapes[f"{prefix}self_attn.q_proj.bias"] = (q_size,)
        shapes[f"{prefix}self_attn.k_proj.bias"] = (kv_size,)
        shapes[f"{prefix}self_attn.v_proj.bias"] = (kv_size,)
    return shapes


def _random_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A float32 tensor that depends only on (seed, name, shape).

    Norm weights are ``1 + N(0, 0.1)`` rather than ones, so that mixing up two norms (e.g. the MTP embedding and
    hidden norms) changes the output; matrices are ``N(0, 1/fan_in)``, which keeps activations and logits O(1).
    """
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    values = torch.randn(shape, generator=generator)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * values
    if name.endswith(".bias"):
        return 0.1 * values
    return values / shape[-1] ** 0.5


def _build_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE trained on the fixed corpus, so any text round-trips.

    The vocab is exactly ``vocab_size``: ChatML specials first (ids 0, 1, 2), the 256 bytes, the merges, and, when
    the corpus runs out of merges (past about 900), ``<|reserved_N|>`` special tokens to fill up.
    """
    minimum = 256 + len(_SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} (256 bytes + special tokens), got {vocab_size}")
    return train_byte_level_bpe([_TOKENIZER_CORPUS], vocab_size, list(_SPECIAL_TOKENS))


def train_byte_level_bpe(texts: list[str], vocab_size: int, special_tokens: list[str]) -> Tokenizer:
    """Byte-level BPE (any text round-trips) trained on ``texts``, ``special_tokens`` first, with exactly
    ``vocab_size`` ids: when the texts run out of merges, ``<|reserved_N|>`` special tokens fill up."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer, length=len(texts))
    tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab_size - tokenizer.get_vocab_size())])
    return tokenizer


def _tokenizer_config(roles: dict[str, str], max_length: int) -> dict[str, Any]:
    """tokenizer_config.json: tokenizer.json used as-is, its specials, the ChatML chat template if it has ChatML."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": roles["eos"],
        "pad_token": roles["pad"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    if roles["eos"] == _IM_END:
        config["chat_template"] = CHAT_TEMPLATE
    return config


def _write_json(file: Path, content: dict[str, Any]) -> None:
    file.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")


def _move_into_place(tmp: Path, path: Path) -> None:
    """Rename the finished ``tmp`` directory to ``path``; an existing ``path`` is moved aside, then deleted."""
    old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex}") if path.exists() else None
    if old is not None:
        os.rename(path, old)
    os.rename(tmp, path)
    if old is not None:
        shutil.rmtree(old)


@dataclass(frozen=True)
class MoEShape:
    """The routed experts of an MoE checkpoint: ``num_experts`` experts of FFN size ``intermediate_size`` (default
    ``hidden_size // 2``), each token going to ``top_k``; ``norm_topk_prob`` renormalises the chosen experts'
    probabilities; Qwen2-MoE adds a sigmoid-gated shared expert of size ``shared_expert_intermediate_size``
    (default ``hidden_size``)."""

    num_experts: int = 4
    top_k: int = 2
    intermediate_size: int | None = None
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 1e-3
    shared_expert_intermediate_size: int | None = None


def _check_moe_shape(family: Family, moe: MoEShape | None) -> MoEShape | None:
    if family not in _MOE_FAMILIES:
        if moe is not None:
            raise ValueError(f"moe= applies to the MoE families {_MOE_FAMILIES}, not {family!r}")
        return None
    moe = moe or MoEShape()
    if moe.num_experts < 1 or not 1 <= moe.top_k <= moe.num_experts:
        raise ValueError(f"MoEShape: top_k={moe.top_k} must be between 1 and num_experts={moe.num_experts}")
    return moe


def _moe_config_fields(family: Family, moe: MoEShape, shape: _Shape) -> dict[str, Any]:
    expert_size, shared_size = _moe_intermediate_sizes(moe, shape)
    fields: dict[str, Any] = dict(
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        norm_topk_prob=moe.norm_topk_prob,
        router_aux_loss_coef=moe.router_aux_loss_coef,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    fields["moe_intermediate_size"] = expert_size
    if family == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = shared_size
    return fields


def _moe_intermediate_sizes(moe: MoEShape, shape: _Shape) -> tuple[int, int]:
    expert = shape.hidden_size // 2 if moe.intermediate_size is None else moe.intermediate_size
    shared = shape.hidden_size if moe.shared_expert_intermediate_size is None else moe.shared_expert_intermediate_size
    return expert, shared


def _with_experts(family: Family, shapes: dict[str, tuple[int, ...]], moe: MoEShape | None, shape: _Shape
                  ) -> dict[str, tuple[int, ...]]:
    """Every dense MLP (``<layer>.mlp.{gate,up,down}_proj``) replaced by a router and routed experts, in HF naming."""
    if moe is None:
        return shapes
    hidden_size = shape.hidden_size
    expert_size, shared_size = _moe_intermediate_sizes(moe, shape)
    result: dict[str, tuple[int, ...]] = {}
    for name, tensor_shape in shapes.items():
        if not name.endswith(".mlp.gate_proj.weight"):
            if not name.endswith((".mlp.up_proj.weight", ".mlp.down_proj.weight")):
                result[name] = tensor_shape
            continue
        mlp = name.removesuffix("gate_proj.weight")
        result[f"{mlp}gate.weight"] = (moe.num_experts, hidden_size)
        for expert in range(moe.num_experts):
            result[f"{mlp}experts.{expert}.gate_proj.weight"] = (expert_size, hidden_size)
            result[f"{mlp}experts.{expert}.up_proj.weight"] = (expert_size, hidden_size)
            result[f"{mlp}experts.{expert}.down_proj.weight"] = (hidden_size, expert_size)
        if family == "qwen2_moe":
            result[f"{mlp}shared_expert.gate_proj.weight"] = (shared_size, hidden_size)
            result[f"{mlp}shared_expert.up_proj.weight"] = (shared_size, hidden_size)
            result[f"{mlp}shared_expert.down_proj.weight"] = (hidden_size, shared_size)
            result[f"{mlp}shared_expert_gate.weight"] = (1, hidden_size)
    return result


class RandomTokenDataset(torch.utils.data.Dataset):
    """Fixed random token sequences as SFT microbatch rows (the first quarter of each is a prompt the loss skips)."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab_size, (num_samples, seq_length + 1), generator=generator)
        self.seq_length = seq_length

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = self.tokens[index]
        loss_mask = torch.ones(self.seq_length)
        loss_mask[: self.seq_length // 4] = 0
        return {"input_ids": tokens[:-1], "labels": tokens[1:], "loss_mask": loss_mask,
                "position_ids": torch.arange(self.seq_length)}

