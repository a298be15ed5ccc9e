"""The FLOPs count the benchmarks share (`bench.common.model_flops`): Megatron-LM's count, and MTP-only's
count of only the passes it runs."""

import pytest

from bench.common import JOINT, MTP_ONLY, ModelShape, Passes, model_flops

QWEN3_0_6B = ModelShape(layers=28, hidden=1024, heads=16, kv_groups=8, head_dim=128, ffn=3072, vocab=151936,
                        mtp_layers=1)


@pytest.mark.slow
def test_model_flops_are_megatron_lms_count():
    from types import SimpleNamespace

    from megatron.training.training import num_floating_point_operations

    def megatron_lm(shape: ModelShape, sequences: int, seq: int) -> float:
        args = SimpleNamespace(
            seq_length=seq, num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
            group_query_attention=True, num_query_groups=shape.kv_groups, kv_channels=shape.head_dim,
            ffn_hidden_size=shape.ffn, swiglu=True, padded_vocab_size=shape.vocab,
            mtp_num_layers=shape.mtp_layers or None, num_experts=None, moe_ffn_hidden_size=None,
            moe_latent_size=None, moe_shared_expert_intermediate_size=None, multi_latent_attention=False,
            attention_output_gate=False, experimental_attention_variant=None, is_hybrid_model=False,
            hybrid_layer_pattern=None,
        )
        return num_floating_point_operations(args, sequences)

    tiny = ModelShape(layers=2, hidden=64, heads=4, kv_groups=2, head_dim=16, ffn=128, vocab=384, mtp_layers=1)
    for shape, sequences, seq in [(QWEN3_0_6B, 8, 2048), (tiny, 4, 32)]:
        assert model_flops(shape, sequences, seq) == pytest.approx(megatron_lm(shape, sequences, seq), rel=1e-12)
        no_mtp = ModelShape(**{**shape.__dict__, "mtp_layers": 0})
        assert model_flops(shape, sequences, seq, with_mtp=False) == pytest.approx(
            megatron_lm(no_mtp, sequences, seq), rel=1e-12)


def test_mtp_only_flops_count_only_the_passes_it_needs():
    joint, mtp_only = model_flops(QWEN3_0_6B, 8, 2048), model_flops(QWEN3_0_6B, 8, 2048, MTP_ONLY)
    assert joint == pytest.approx(87.59e12, rel=1e-3)
    # every GEMM counts once per pass: one pass of everything is a third of the joint count
    assert model_flops(QWEN3_0_6B, 8, 2048, Passes(1, 1, 1, 1)) == pytest.approx(joint / 3)
    assert joint / 3 < mtp_only < joint / 2  # the forward of everything plus the MTP layer's backward
    assert model_flops(QWEN3_0_6B, 8, 2048, JOINT) == joint
