"""DeepSeek-V3 (`deepseek_v3`: multi-head latent attention, MoE, MTP) through megatron-bridge without Transformer
Engine or Apex.

Found by building a tiny DeepSeek-V3 (q-LoRA, the first layer dense, group-limited sigmoid routing, YaRN RoPE, one
MTP layer) on the local spec; the core attention of its MLA is the package's SDPA one (`attention.SDPAttention`
takes MLA's distinct key and value head sizes; megatron-core's local `DotProductAttention` does not).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

from lightning_megatron._compat._adjustment import Adjustment, Patches
from lightning_megatron._compat.moe import install_mtp_copies, set_provider_fields
from lightning_megatron._compat.no_te import no_transformer_engine
from lightning_megatron.families import mtp_names


def _install_local_fusions(patches: Patches) -> None:
    from megatron.bridge.models.deepseek.deepseek_v3_bridge import DeepSeekV3Bridge

    set_provider_fields(patches, DeepSeekV3Bridge, {
        "moe_permute_fusion": False,  # TE's fused permutation; the unfused one computes the same
        "persist_layer_norm": False,  # Apex's persistent layer norm, refused by the local spec's torch norm
        "gradient_accumulation_fusion": False,  # Apex's fused weight-gradient accumulation (a CUDA extension)
        "cross_entropy_loss_fusion": False,  # TE's fused cross entropy (cross_entropy_fusion_impl "te")
    })


def _exports_no_mtp_copies() -> bool:
    from megatron.bridge.models.deepseek.common import get_common_mapping_list

    config = {"num_hidden_layers": 1}
    copies = set(mtp_names("deepseek_v3").copy_names(0, config).values())
    mappings = get_common_mapping_list(hf_config=SimpleNamespace(num_nextn_predict_layers=1, **config))
    return not any(mapping.hf_param in copies for mapping in mappings if isinstance(mapping.hf_param, str))


def _install_mtp_copies(patches: Patches) -> None:
    """DeepSeek-V3's index stores copies of the embedding and the LM head in its MTP layer (`model.layers.61.
    embed_tokens`, `shared_head.head`); the export writes them from the shared tensors, after DeepSeek's own hook
    (which keeps a source checkpoint's rotary `inv_freq`)."""
    from megatron.bridge.models.deepseek.deepseek_v3_bridge import DeepSeekV3Bridge

    install_mtp_copies(patches, DeepSeekV3Bridge, "deepseek_v3")


def _query_projection_resolver() -> Any:
    from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver

    return QKNormConfigResolver


def _no_lora_query(config: Any) -> bool:
    """MLA whose query has no low-rank projection (`q_lora_rank: None`: Moonlight, DeepSeek-V2-Lite), with the q-LoRA
    and KV-LoRA norms on (`qk_layernorm`, as megatron-bridge's DeepSeek providers set it)."""
    return (config.q_lora_rank is None and config.qk_layernorm and not config.qk_l2_norm
            and config.experimental_attention_variant != "dsa")


def _normalises_an_unlowered_query() -> bool:
    """Whether Megatron-Core's MLA puts a norm before (or refuses the local spec's norm beside) the query projection
    of a query without q-LoRA, which has none."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = SimpleNamespace(q_lora_rank=None, qk_layernorm=True, qk_l2_norm=False, experimental_attention_variant=None,
                             transformer_impl="local", normalization="RMSNorm")
    submodules = SimpleNamespace(linear_q_proj=ColumnParallelLinear, linear_q_up_proj=ColumnParallelLinear,
                                 linear_kv_up_proj=ColumnParallelLinear, q_layernorm=WrappedTorchNorm,
                                 kv_layernorm=WrappedTorchNorm)
    try:
        resolved = _query_projection_resolver()(config, submodules).resolve()
    except (ValueError, RuntimeError):
        return True
    return resolved["linear_q_proj"] is not ColumnParallelLinear


def _install_plain_query_projection(patches: Patches) -> None:
    """HF's DeepseekV3Attention without q-LoRA projects the layer's normed input by `q_proj` alone
    (modeling_deepseek_v3.py:384-385); Megatron-Core's resolver refuses the local spec's query norm there, and with
    Transformer Engine fuses a second norm (a `layer_norm_weight` no HF tensor maps) into `linear_q_proj`."""
    from megatron.core.transformer.identity_op import IdentityOp

    resolver = _query_projection_resolver()
    resolve = resolver.resolve

    @functools.wraps(resolve)
    def resolve_with_a_plain_query_projection(self: Any) -> dict[str, Any]:
        if not _no_lora_query(self.config):
            return resolve(self)
        query_projection = self.submodules.linear_q_proj or self.linear_impl
        if self._is_fused_norm_linear(query_projection):
            query_projection = self.linear_impl
        self.has_q_lora = True  # the KV path resolved as it is with q-LoRA; the query's slots set below
        try:
            resolved = resolve(self)
        finally:
            self.has_q_lora = False
        return {**resolved, "linear_q_proj": query_projection, "linear_q_up_proj": IdentityOp, "q_layernorm": IdentityOp}

    patches.setattr(resolver, "resolve", resolve_with_a_plain_query_projection)


MEGATRON_BRIDGE_ADJUSTMENTS = (
    Adjustment(
        "megatron_core.mla_query_without_lora",
        "megatron/core/transformer/mla_qk_norm_config.py:150-152 (_resolve_mla_qk_layernorm) fuses a norm into "
        "linear_q_proj when q_lora_rank is None, :169-170 refuses the local spec's q_layernorm "
        "(megatron/core/models/gpt/gpt_layer_specs.py:428): Moonlight-style DeepSeek-V3 checkpoints (q_lora_rank: null) "
        "fail to build, or build with a query norm HF does not have",
        _normalises_an_unlowered_query,
        _install_plain_query_projection,
    ),
    Adjustment(
        "megatron_bridge.deepseek_v3_local_fusions",
        "megatron/bridge/models/deepseek/deepseek_v3_bridge.py:76 moe_permute_fusion=True: 'fused permutation is not "
        "available' (megatron/core/transformer/transformer_config.py:2667); :85 persist_layer_norm (Apex); :79 "
        "gradient_accumulation_fusion ('fused_weight_gradient_mlp_cuda module is not found'); :83 "
        "cross_entropy_loss_fusion ('Trying to use a TE block when it's not present')",
        no_transformer_engine,
        _install_local_fusions,
    ),
    Adjustment(
        "megatron_bridge.deepseek_v3_mtp_copies",
        "megatron/bridge/models/deepseek/common.py:100-130 maps no copy of the embedding or LM head in the MTP "
        "layers, so the export omits two tensors of every DeepSeek-V3 checkpoint with MTP (its index lists them)",
        _exports_no_mtp_copies,
        _install_mtp_copies,
    ),
)
