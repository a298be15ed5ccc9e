"""`bench/families.py`'s memory arithmetic: the parameters it counts are those megatron-core builds, and the cut it
picks for GLM-4.5-Air is the hand computation's (its FLOPs are Megatron-LM's: test_flops.py; the whole benchmark in
its tiny mode: test_bench.py)."""

from collections import Counter
from pathlib import Path

import pytest

from bench.common import GLM4_5_AIR, QWEN3_5_2B, make_config_only_checkpoint
from bench.families import GIB, describe, fit_layers, parameter_counts, plan_cuts, static_bytes
from bench.flops import ModelShape


def _part(name: str) -> str:
    for prefix, part in (("embedding.", "embedding"), ("output_layer.", "output"), ("mtp.", "mtp"),
                         ("decoder.final_layernorm.", "final_norm")):
        if name.startswith(prefix):
            return part
    return f"layer {int(name.split('.')[2])}"


@pytest.mark.parametrize("family, tied", [("qwen3_5_text", True), ("glm4_moe", False)])
def test_the_parameters_counted_are_those_megatron_core_builds(model_parallel, tmp_path: Path, family: str,
                                                               tied: bool) -> None:
    """Per part, on the tiny checkpoints: Qwen3.5's gated DeltaNet and gated full-attention layers (q/k norms, tied
    output), GLM-4.5's dense and MoE layers (q/k/v biases, router, shared expert) and each one's MTP layer."""
    from lightning_megatron.bridges import create_bridge
    from lightning_megatron.options import ModelOptions
    from lightning_megatron.testing.checkpoints import make_tiny_checkpoint

    checkpoint = make_tiny_checkpoint(tmp_path / family, family, mtp=True, tied=tied)
    chunk = create_bridge("megatron-bridge", checkpoint).build(ModelOptions(mtp=True, random_weights=True))[0]
    built = Counter()
    for name, parameter in chunk.named_parameters():
        built[_part(name)] += parameter.numel()
    counts = parameter_counts(ModelShape.from_hf_checkpoint(checkpoint))
    assert dict(built) == {"embedding": counts.embedding, **({} if tied else {"output": counts.output}),
                           **{f"layer {i}": count for i, count in enumerate(counts.layers)},
                           "final_norm": counts.final_norm, "mtp": counts.mtp}


def test_glm_4_5_air_is_cut_to_the_layers_the_gpu_holds(tmp_path: Path) -> None:
    shape = ModelShape.from_hf_checkpoint(make_config_only_checkpoint(tmp_path / "glm", GLM4_5_AIR, tied=False,
                                                                      family="glm4_moe"))
    h, vocab, q, kv = 4096, 151552, 96 * 128, 8 * 128
    attention = h * (q + 2 * kv) + (q + 2 * kv) + q * h + h  # q/k/v with their biases, the output, the input norm
    dense = 3 * h * 10944 + h  # SwiGLU and its norm
    moe = 128 * h + 128 * 3 * h * 1408 + 3 * h * 1408 + h  # router, 128 experts, the shared one, the norm
    mtp = 3 * h + 2 * h * h + attention + moe  # enorm, hnorm, final norm, eh_proj, an MoE layer
    counts = parameter_counts(shape)
    assert counts.layers == (attention + dense, *[attention + moe] * 45) and counts.mtp == mtp
    assert counts.total - mtp == pytest.approx(106.85e9, rel=1e-3)  # the model card's 106B

    free, reserve = int(139.3 * GIB), 24 * GIB  # an H200's free memory after the CUDA context
    base = 2 * vocab * h + h + attention + dense  # embedding, output, final norm, the dense layer
    moe_layers = (free - reserve - 2 * base - 18 * mtp) // (2 * (attention + moe))  # frozen: 2 bytes, trained: 18
    joint_moe_layers = (free - reserve - 18 * (base + mtp)) // (18 * (attention + moe))
    plan = plan_cuts(shape, free, reserve)
    assert (plan["mtp_only_layers"], plan["joint_layers"]) == (1 + moe_layers, 1 + joint_moe_layers) == (17, 2)
    assert plan["mtp_only_static_gib"] == static_bytes(shape.cut(17), mtp_only=True) / GIB <= plan["budget_gib"]
    assert static_bytes(shape.cut(18), mtp_only=True) / GIB > plan["budget_gib"]
    assert "MTP-only training holds 17 (" in describe(plan) and "joint training 2 (" in describe(plan)
    # given cuts win; a budget for the dense layer alone holds no cut (its MTP layer would lose its experts)
    assert plan_cuts(shape, free, reserve, layers=10, joint_layers=1)["mtp_only_layers"] == 10
    only_dense = 2 * base + 18 * mtp + 2 * (attention + moe) - 1
    assert fit_layers(shape, only_dense, mtp_only=True) is None
    assert fit_layers(shape, only_dense + 1, mtp_only=True) == 2


def test_qwen3_5_2b_is_the_2b_model(tmp_path: Path) -> None:
    shape = ModelShape.from_hf_checkpoint(make_config_only_checkpoint(tmp_path / "qwen", QWEN3_5_2B, tied=True,
                                                                      family="qwen3_5_text"))
    counts = parameter_counts(shape)
    assert counts.output == 0 and counts.total - counts.mtp == pytest.approx(1.88e9, rel=0.01)
    assert sum(shape.linear_attention.full_attention) == 6  # the model card's 6 attention layers
