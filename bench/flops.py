"""The benchmarked model's shape and its FLOPs: what MFU divides by.

Model FLOPs are counted the Megatron-LM way (`num_floating_point_operations` in `megatron/training/training.py`,
megatron-core 0.19.2, unpacked sequences). For one step of B sequences of length s (T = B * s tokens), L decoder
layers and m MTP layers:

    F = 2 * T * [ p_b * sum_i (A_i + M_i) + p_m * m * (A_full + M_mtp + 3 h + 2 h^2) + (p_o + m * p_mo) * h V ]
      + 2 * B * s^2 * q * (p_b * L_full + p_m * m)

with h hidden, V the vocabulary, q = heads * head_dim, k = KV groups * head_dim, and per token of layer i:
- A_i, attention: full attention h (q + 2 k + g) + q h (g = q where the output is gated, Qwen3.5, else 0); a gated
  DeltaNet layer (Qwen3.5's linear attention, `LinearAttention`) h (2 d_k + 2 d_v + 2 n_v) + w (2 d_k + d_v)
  + 4 n_v e_v^2 + d_v h, Megatron-LM's approximation: the input and output projections, the width-w convolution,
  and the chunked delta rule as four products of e_v x e_v per value head and token (K K^T, V K^T, the state update,
  S Q), with d_k, d_v the key and value widths, n_v the value heads, e_v their size;
- M_i, MLP: 3 h f dense; an MoE layer (`Experts`) 3 h (k_e f_e + f_s), the top-k routed experts a token visits and
  the shared ones (the router's h x experts product left out, as Megatron-LM does); the MTP layer's is an MoE one
  where the last decoder layer is (GLM-4.5 stores it so).
L_full counts the full-attention layers (the s^2 term is Q K^T and softmax(.) V, halved by the causal mask; a gated
DeltaNet layer has none), p the number of GEMM passes each part needs: 3 (forward, input gradient, weight gradient)
or fewer. Joint training is Megatron-LM's count: every p = 3. MTP-only training counts what it needs: the frozen
backbone forward only (p_b = 1), the MTP layer with its projection and norms fully (p_m = 3), the main LM head forward
only (p_o = 1, `MTP_ONLY`) on the steps that log `lm_loss` and not at all on the others (p_o = 0,
`MTP_ONLY_WITHOUT_MAIN_HEAD`: `MTPOnlyCallback` skips it there), and the MTP LM head forward plus its input gradient
(p_mo = 2: the shared output weight is frozen). A dense Qwen3 layer's A_i + M_i is h (q + 2 k) + q h + 3 h f.
MFU = F / step time / peak; the peak is the card's dense bf16 figure from NVIDIA's data sheets
(`DENSE_BF16_TFLOPS`: H200 and H100 SXM 989.4, H100 NVL 835.5, H100 PCIe 756.5 TFLOP/s; no MFU on another card unless
`--peak-tflops` says what the peak is).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

# (marker in torch.cuda.get_device_name(), dense bf16 TFLOP/s), the first marker found wins: the H100's SXM card
# names itself "NVIDIA H100 80GB HBM3", the others say PCIe or NVL.
DENSE_BF16_TFLOPS = (("H200", 989.4), ("H100 PCIe", 756.5), ("H100 NVL", 835.5), ("H100", 989.4))


@dataclass(frozen=True)
class LinearAttention:
    """Gated DeltaNet layers (Qwen3.5's linear attention) between full-attention ones."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    full_attention: tuple[bool, ...]  # per decoder layer: full attention (True) or gated DeltaNet

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> LinearAttention | None:
        """From a Qwen3.5-style config: `layer_types`, or every `full_attention_interval`-th layer (transformers'
        rule, default 4) where it has none; None for a model without linear attention."""
        if not config.get("linear_num_value_heads"):
            return None
        layers = config["num_hidden_layers"]
        types = config.get("layer_types") or [
            "full_attention" if (i + 1) % config.get("full_attention_interval", 4) == 0 else "linear_attention"
            for i in range(layers)]
        return cls(key_heads=config["linear_num_key_heads"], value_heads=config["linear_num_value_heads"],
                   key_head_dim=config["linear_key_head_dim"], value_head_dim=config["linear_value_head_dim"],
                   conv_kernel=config["linear_conv_kernel_dim"],
                   full_attention=tuple(kind == "full_attention" for kind in types[:layers]))


@dataclass(frozen=True)
class Experts:
    """Routed experts (as megatron-bridge configures them, `lightning_megatron.moe.router_settings`)."""

    experts: int
    top_k: int
    ffn: int
    shared_ffn: int  # all shared experts together (0: none)
    moe_layers: tuple[bool, ...]  # per decoder layer: MoE (True) or dense (GLM-4.5's first layers)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Experts | None:
        from lightning_megatron.moe import router_settings

        settings = router_settings(config)
        if not settings:
            return None
        pattern = settings.get("moe_layer_freq") or [1] * config["num_hidden_layers"]
        return cls(experts=settings["num_moe_experts"], top_k=settings["moe_router_topk"],
                   ffn=settings["moe_ffn_hidden_size"], shared_ffn=settings["moe_shared_expert_intermediate_size"] or 0,
                   moe_layers=tuple(bool(moe) for moe in pattern))


_GATED_ATTENTION_MODEL_TYPES = ("qwen3_5_text",)  # megatron-bridge qwen35_bridge.py: attention_output_gate = True
_QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_5_text")  # GLM-4.5 says so in `use_qk_norm`


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_groups: int
    head_dim: int
    ffn: int
    vocab: int
    mtp_layers: int
    output_gate: bool = False  # full attention's output gate (Qwen3.5: its query projection also makes the gates)
    linear_attention: LinearAttention | None = None
    experts: Experts | None = None
    qkv_bias: bool = False
    qk_norm: bool = True
    tied: bool = False

    @classmethod
    def from_hf_checkpoint(cls, path: str | Path) -> ModelShape:
        from lightning_megatron.families import checkpoint_mtp_layers

        config = json.loads((Path(path) / "config.json").read_text())
        heads, model_type = config["num_attention_heads"], config.get("model_type")
        return cls(
            layers=config["num_hidden_layers"], hidden=config["hidden_size"], heads=heads,
            kv_groups=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads, ffn=config["intermediate_size"],
            vocab=config["vocab_size"], mtp_layers=checkpoint_mtp_layers(config),
            output_gate=model_type in _GATED_ATTENTION_MODEL_TYPES,
            linear_attention=LinearAttention.from_hf_config(config), experts=Experts.from_hf_config(config),
            qkv_bias=bool(config.get("attention_bias")),
            qk_norm=bool(config.get("use_qk_norm", model_type in _QK_NORM_MODEL_TYPES)),
            tied=bool(config.get("tie_word_embeddings")),
        )

    def full_attention(self, layer: int) -> bool:
        return self.linear_attention is None or self.linear_attention.full_attention[layer]

    def moe(self, layer: int) -> bool:
        return self.experts is not None and self.experts.moe_layers[layer]

    def cut(self, layers: int) -> ModelShape:
        """The same model with only its first `layers` decoder layers (the MTP layer kept)."""
        linear, experts = self.linear_attention, self.experts
        return replace(
            self, layers=layers,
            linear_attention=None if linear is None else replace(linear, full_attention=linear.full_attention[:layers]),
            experts=None if experts is None else replace(experts, moe_layers=experts.moe_layers[:layers]))

    @property
    def mtp_moe(self) -> bool:
        """Whether the MTP layer's MLP has experts: where the last decoder layer's has (Megatron-LM's count)."""
        return self.moe(self.layers - 1)


def attention_macs(shape: ModelShape, full: bool) -> int:
    """Multiply-adds per token of one pass through a layer's attention projections (`full`) or gated DeltaNet
    (formula in the module docstring; the s^2 part of full attention apart)."""
    h = shape.hidden
    if not full:
        linear = shape.linear_attention
        assert linear is not None, "a gated DeltaNet layer needs the shape's linear_attention"
        keys, values = linear.key_heads * linear.key_head_dim, linear.value_heads * linear.value_head_dim
        return (h * (2 * keys + 2 * values + 2 * linear.value_heads) + linear.conv_kernel * (2 * keys + values)
                + 4 * linear.value_heads * linear.value_head_dim**2 + values * h)
    q, k = shape.heads * shape.head_dim, shape.kv_groups * shape.head_dim
    return h * (q + 2 * k + (q if shape.output_gate else 0)) + q * h


def mlp_macs(shape: ModelShape, moe: bool) -> int:
    """Multiply-adds per token of one pass through a dense SwiGLU MLP, or the experts a token visits."""
    if moe:
        assert shape.experts is not None, "an MoE layer needs the shape's experts"
        return 3 * shape.hidden * (shape.experts.top_k * shape.experts.ffn + shape.experts.shared_ffn)
    return 3 * shape.hidden * shape.ffn


@dataclass(frozen=True)
class Passes:
    """GEMM passes per part of the model: 3 = forward + input gradient + weight gradient."""

    backbone: int = 3
    mtp: int = 3
    main_head: int = 3
    mtp_head: int = 3


JOINT = Passes()
MTP_ONLY = Passes(backbone=1, mtp=3, main_head=1, mtp_head=2)
MTP_ONLY_WITHOUT_MAIN_HEAD = Passes(backbone=1, mtp=3, main_head=0, mtp_head=2)


def model_flops(shape: ModelShape, sequences: int, seq_length: int, passes: Passes = JOINT, *,
                with_mtp: bool = True) -> float:
    """Model FLOPs of one step over `sequences` sequences of `seq_length` tokens (formula in the module docstring)."""
    h = shape.hidden
    m = shape.mtp_layers if with_mtp else 0
    tokens = sequences * seq_length
    backbone = sum(attention_macs(shape, shape.full_attention(i)) + mlp_macs(shape, shape.moe(i))
                   for i in range(shape.layers))
    mtp_layer = attention_macs(shape, True) + mlp_macs(shape, shape.mtp_moe) + 3 * h + 2 * h * h
    linear = (passes.backbone * backbone + passes.mtp * m * mtp_layer
              + (passes.main_head + m * passes.mtp_head) * h * shape.vocab)
    full_layers = sum(shape.full_attention(i) for i in range(shape.layers))
    attention = sequences * seq_length**2 * shape.heads * shape.head_dim * (passes.backbone * full_layers
                                                                            + passes.mtp * m)
    return 2.0 * (tokens * linear + attention)


def dense_bf16_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of the card `device_name` names (`DENSE_BF16_TFLOPS`), None for a card not listed."""
    return next((tflops for marker, tflops in DENSE_BF16_TFLOPS if marker in device_name), None)


def peak_flops(override_tflops: float | None) -> float | None:
    """The accelerator's dense bf16 peak in FLOP/s: `override_tflops` if given, else the listed card's, else None."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if not torch.cuda.is_available():
        return None
    tflops = dense_bf16_tflops(torch.cuda.get_device_name())
    return None if tflops is None else tflops * 1e12


def throughput(step_s: float, tokens_per_step: int, flops_per_step: float, peak: float | None) -> dict[str, Any]:
    """Tokens/s, model TFLOP/s and MFU of a median step time."""
    return {
        "step_s": step_s,
        "tokens_per_s": tokens_per_step / step_s,
        "model_tflop_per_step": flops_per_step / 1e12,
        "model_tflop_per_s": flops_per_step / step_s / 1e12,
        "mfu": flops_per_step / step_s / peak if peak else None,
    }
