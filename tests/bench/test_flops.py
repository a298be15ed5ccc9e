"""The FLOPs count the benchmarks share (`bench.flops.model_flops`): Megatron-LM's count, gated DeltaNet and MoE
layers included, and MTP-only's count of only the passes it runs."""

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench.common import GLM4_5_AIR, QWEN3_5_2B, make_config_only_checkpoint
from bench.flops import JOINT, MTP_ONLY, ModelShape, Passes, dense_bf16_tflops, model_flops

QWEN3_0_6B = ModelShape(layers=28, hidden=1024, heads=16, kv_groups=8, head_dim=128, ffn=3072, vocab=151936,
                        mtp_layers=1)


def megatron_lm(shape: ModelShape, sequences: int, seq: int, **family: Any) -> float:
    """Megatron-LM's `num_floating_point_operations` for a dense GQA `shape`, with `family`'s arguments on top."""
    from megatron.training.training import num_floating_point_operations

    args = SimpleNamespace(**{
        **dict(seq_length=seq, num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
               group_query_attention=True, num_query_groups=shape.kv_groups, kv_channels=shape.head_dim,
               ffn_hidden_size=shape.ffn, swiglu=True, padded_vocab_size=shape.vocab,
               mtp_num_layers=shape.mtp_layers or None, num_experts=None, moe_ffn_hidden_size=None,
               moe_latent_size=None, moe_shared_expert_intermediate_size=None, multi_latent_attention=False,
               attention_output_gate=False, experimental_attention_variant=None, is_hybrid_model=False,
               hybrid_layer_pattern=None),
        **family,
    })
    return num_floating_point_operations(args, sequences)


@pytest.mark.slow
def test_model_flops_are_megatron_lms_count():
    tiny = ModelShape(layers=2, hidden=64, heads=4, kv_groups=2, head_dim=16, ffn=128, vocab=384, mtp_layers=1)
    for shape, sequences, seq in [(QWEN3_0_6B, 8, 2048), (tiny, 4, 32)]:
        assert model_flops(shape, sequences, seq) == pytest.approx(megatron_lm(shape, sequences, seq), rel=1e-12)
        no_mtp = ModelShape(**{**shape.__dict__, "mtp_layers": 0})
        assert model_flops(shape, sequences, seq, with_mtp=False) == pytest.approx(
            megatron_lm(no_mtp, sequences, seq), rel=1e-12)


@pytest.mark.slow
def test_the_families_flops_are_megatron_lms_count(tmp_path: Path):
    """Qwen3.5-2B (gated DeltaNet and gated attention; its MTP layer is a full-attention one, as Megatron-LM counts it
    when the layer pattern says so) and GLM-4.5-Air (a dense first layer, routed and shared experts, an MoE MTP
    layer), read from their config.json as the benchmark reads them."""
    qwen = ModelShape.from_hf_checkpoint(make_config_only_checkpoint(tmp_path / "qwen", QWEN3_5_2B, tied=True,
                                                                     family="qwen3_5_text"))
    linear = qwen.linear_attention
    pattern = [0 if full else 1 for full in linear.full_attention]
    gdn = dict(experimental_attention_variant="gated_delta_net", attention_output_gate=True,
               linear_key_head_dim=linear.key_head_dim, linear_value_head_dim=linear.value_head_dim,
               linear_num_key_heads=linear.key_heads, linear_num_value_heads=linear.value_heads,
               linear_conv_kernel_dim=linear.conv_kernel)
    assert (sum(pattern), len(pattern)) == (18, 24)
    assert model_flops(qwen, 8, 2048) == pytest.approx(
        megatron_lm(qwen, 8, 2048, linear_attention_freq=[*pattern, 0], **gdn), rel=1e-12)
    no_mtp = ModelShape(**{**qwen.__dict__, "mtp_layers": 0})
    assert model_flops(qwen, 8, 2048, with_mtp=False) == pytest.approx(
        megatron_lm(no_mtp, 8, 2048, linear_attention_freq=pattern, **gdn), rel=1e-12)

    glm = ModelShape.from_hf_checkpoint(make_config_only_checkpoint(tmp_path / "glm", GLM4_5_AIR, tied=False,
                                                                    family="glm4_moe"))
    experts = glm.experts
    assert (experts.experts, experts.top_k, experts.ffn, experts.shared_ffn) == (128, 8, 1408, 1408)
    moe = dict(num_experts=128, moe_router_topk=8, moe_ffn_hidden_size=1408, moe_shared_expert_intermediate_size=1408)
    for layers in (46, 17):  # the whole model and a cut
        cut = glm.cut(layers)
        assert model_flops(cut, 4, 2048) == pytest.approx(
            megatron_lm(cut, 4, 2048, moe_layer_freq=[0] + [1] * (layers - 1), **moe), rel=1e-12)


def test_mtp_only_flops_count_only_the_passes_it_needs():
    joint, mtp_only = model_flops(QWEN3_0_6B, 8, 2048), model_flops(QWEN3_0_6B, 8, 2048, MTP_ONLY)
    assert joint == pytest.approx(87.59e12, rel=1e-3)
    # every GEMM counts once per pass: one pass of everything is a third of the joint count
    assert model_flops(QWEN3_0_6B, 8, 2048, Passes(1, 1, 1, 1)) == pytest.approx(joint / 3)
    assert joint / 3 < mtp_only < joint / 2  # the forward of everything plus the MTP layer's backward
    assert model_flops(QWEN3_0_6B, 8, 2048, JOINT) == joint


def test_the_peak_is_the_named_cards_dense_bf16_figure():
    assert dense_bf16_tflops("NVIDIA H200") == 989.4
    assert dense_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.4  # the SXM card
    assert dense_bf16_tflops("NVIDIA H100 PCIe") == 756.5
    assert dense_bf16_tflops("NVIDIA H100 NVL") == 835.5
    assert dense_bf16_tflops("NVIDIA A100-SXM4-80GB") is None
