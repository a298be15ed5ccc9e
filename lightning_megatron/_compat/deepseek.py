"""DeepSeek-V3 (`deepseek_v3`: multi-head latent attention, MoE, MTP) through megatron-bridge without Transformer
Engine or Apex.

Found by building a tiny DeepSeek-V3 (q-LoRA, the first layer dense, group-limited sigmoid routing, YaRN RoPE, one
MTP layer) on the local spec; the core attention of its MLA is the package's SDPA one (`attention.SDPAttention`
takes MLA's distinct key and value head sizes; megatron-core's local `DotProductAttention` does not).
"""

from __future__ import annotations

from types import SimpleNamespace

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


MEGATRON_BRIDGE_ADJUSTMENTS = (
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
