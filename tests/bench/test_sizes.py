"""`bench/sizes.py`'s pure parts (issue 41): the FLOPs of a packed step against a hand computation and against
Megatron-Bridge's Qwen3-8B card, the configurations' table, the packed rows, the memory arithmetic, the figures and
targets of a run, and the report's rows. The tiny run on the CPU is in test_bench.py."""

import argparse
import dataclasses

import pytest
import torch

from bench import report
from bench.common import QWEN3_8B, QWEN3_30B_A3B, make_config_only_checkpoint
from bench.flops import Experts, ModelShape, model_flops
from bench.sizes import CONFIGS, Step, figures, packed_step, parameters, static_bytes_per_parameter, step_flops
from lightning_megatron.lora import DEFAULT_TARGET_MODULES, LoRAConfig
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint

SHAPE_8B = ModelShape(layers=36, hidden=4096, heads=32, kv_groups=8, head_dim=128, ffn=12288, vocab=151936,
                      mtp_layers=0)


def test_a_packed_step_counts_each_sequence_with_its_own_attention():
    # by hand, Megatron-LM's count with three passes: per token 6 x (36 layers x (3 h f + h (q + 2k) + q h) + h V)
    # = 6 x (36 x 192,937,984 + 622,329,856); per sequence of n tokens 2 x 3 x 36 x n^2 x q = 884,736 n^2
    per_token, per_square = 6 * (36 * 192_937_984 + 622_329_856), 884_736
    assert per_token == 45_408_583_680
    step = Step(rows=[], lengths=[[1024, 3072], [4000]])
    expected = per_token * 8096 + per_square * (1024**2 + 3072**2 + 4000**2)
    assert step_flops(SHAPE_8B, step, mtp=False) == pytest.approx(expected, rel=1e-12)
    assert step.real_tokens == 8096
    # one row of 4096 tokens as one sequence would count the cross-sequence attention packing does not compute
    assert step_flops(SHAPE_8B, Step([], [[2048, 2048]]), mtp=False) < step_flops(SHAPE_8B, Step([], [[4096]]),
                                                                               mtp=False)


def test_the_count_agrees_with_megatron_bridges_qwen3_8b_card():
    """The card's 387 TFLOP/s at 8,429 tokens/s (LoRA, packed rows of 2048) is 45.9 GFLOP a token: ours for
    sequences of 128-2048 tokens (mean 1088) is within 3% of it, so its tokens/s target and our MFU agree."""
    card = 387e12 / 8429
    ours = step_flops(SHAPE_8B, Step([], [[1088]]), mtp=False) / 1088
    assert ours == pytest.approx(card, rel=0.03)


def test_the_configurations_are_the_issues():
    assert [name for name, config in CONFIGS.items() if config.default] == [
        "qwen3_8b_lora", "qwen3_4b_full", "qwen3_0.6b_mtp_default", "qwen3_0.6b_mtp_eager",
        "qwen3_0.6b_mtp_graphed", "qwen3_30b_a3b_lora"]
    assert CONFIGS["qwen3_8b_lora"].lora_targets == DEFAULT_TARGET_MODULES  # every linear layer
    assert CONFIGS["qwen3_8b_lora"].at_least == {"tokens_per_s": 8429.0}
    assert CONFIGS["qwen3_8b_lora"].at_most == {"lightning_over_plain_step_time": 1.0}
    assert CONFIGS["qwen3_4b_full"].at_least == {"mfu": 0.40} and CONFIGS["qwen3_4b_full"].lora() is None
    assert [CONFIGS[f"qwen3_0.6b_mtp_{kind}"].cuda_graph for kind in ("default", "eager", "graphed")] == [
        None, "none", "full_iteration"]  # the default passes no cuda_graph at all
    assert all(CONFIGS[f"qwen3_0.6b_mtp_{kind}"].at_most == {"lightning_over_plain_step_time": 1.01}
               for kind in ("default", "eager", "graphed"))
    assert CONFIGS["qwen3_30b_a3b_lora"].shape["num_experts"] == 128
    assert CONFIGS["qwen3_30b_a3b_lora"].shape["num_layers"] == 48  # every layer: it fits (below)
    assert CONFIGS["qwen3_8b_full_offload"].needs_cuda() and not CONFIGS["qwen3_8b_lora"].needs_cuda()
    for config in CONFIGS.values():
        assert set(config.at_least) | set(config.at_most) <= set(report._SIZES_FIGURES)
        if config.lora_targets is not None:
            assert isinstance(config.lora(), LoRAConfig) and config.lora().rank == 8 and config.lora().alpha == 16


def test_the_memory_each_configuration_needs_before_activations():
    """Qwen3-8B 8.19B, 4B 4.02B, 30B-A3B 30.5B parameters; full fine-tuning at 18 bytes a parameter leaves 8B no
    room on a 139 GiB H200 (137 GiB before activations), a quarter of the optimizer on the GPU 9 bytes (69 GiB)
    and 12 bytes in host memory (92 GiB of the machine's 128 GiB); the 30B-A3B LoRA holds 61 GB of bf16 weights."""
    assert parameters(QWEN3_8B, tied=False) == 8_190_735_360
    assert parameters(CONFIGS["qwen3_4b_full"].shape, tied=True) == 4_022_468_096
    assert parameters(QWEN3_30B_A3B, tied=False) == 30_532_122_624
    assert static_bytes_per_parameter(lora=False, offload_fraction=0.0) == (18.0, 0.0)
    assert static_bytes_per_parameter(lora=False, offload_fraction=0.75) == (9.0, 12.0)
    assert static_bytes_per_parameter(lora=True, offload_fraction=0.0) == (2.0, 0.0)
    assert 18 * 8_190_735_360 / 2**30 == pytest.approx(137.3, abs=0.05)
    assert 9 * 8_190_735_360 / 2**30 == pytest.approx(68.7, abs=0.05)
    assert 12 * 8_190_735_360 / 2**30 == pytest.approx(91.5, abs=0.05)
    assert 2 * 30_532_122_624 / 1e9 == pytest.approx(61.1, abs=0.05)


def test_a_packed_step_is_the_fullest_rows_of_first_fit_packing(tmp_path):
    args = argparse.Namespace(seq=128, min_length=8, max_length=64)
    step = packed_step(3, args, vocab=384)
    assert len(step.rows) == len(step.lengths) == 3
    for row, lengths in zip(step.rows, step.lengths, strict=True):
        assert row["input_ids"].shape == (1, 128) and isinstance(row["max_seqlen"], int)
        boundaries = row["cu_seqlens"].tolist()
        assert [end - start for start, end in zip(boundaries, boundaries[1:])][:len(lengths)] == lengths
        assert sum(lengths) <= 128 and boundaries[-1] == 128  # the rest of the row is one padding segment
        assert int(row["loss_mask"].sum()) == sum(length - 1 for length in lengths)  # each sequence's last token
    assert step.real_tokens == sum(map(sum, step.lengths)) > 0.9 * 3 * 128  # the fullest rows of the pool
    again = packed_step(3, args, vocab=384)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(step.rows, again.rows))


def _run(step_s: float, mfu: float | None = None, busy: float | None = None) -> dict:
    return {"step_s": step_s, "tokens_per_s": 1000 / step_s, "model_tflop_per_s": 1 / step_s, "mfu": mfu,
            "peak_memory_gib": 10.0, "losses": [2.5, 2.4], "profile": {"gpu_busy_fraction": busy}}


def test_figures_pool_the_runs_that_finished_and_hold_lightning_to_its_targets():
    config = CONFIGS["qwen3_0.6b_mtp_default"]
    runs = {"lightning": [_run(1.02, 0.31, 0.99), _run(1.0, 0.32, 0.98)], "plain": [_run(1.0), _run(1.0)]}
    result = figures(config, runs)
    lightning = result["figures"]["lightning"]
    assert lightning["step_s"] == pytest.approx(1.01) and lightning["mfu"] == pytest.approx(0.315)
    assert lightning["lightning_over_plain_step_time"] == pytest.approx(1.01)
    assert lightning["first_loss_difference"] == 0.0 and result["figures"]["plain"]["mfu"] is None
    assert result["met"] == {"mfu": True, "lightning_over_plain_step_time": True}
    out_of_memory = {"error": "OutOfMemoryError: CUDA out of memory", "failure": "out_of_memory"}
    result = figures(config, {"lightning": [out_of_memory], "plain": [_run(1.0)]})
    assert "lightning" not in result["figures"] and result["met"] == {"mfu": None,
                                                                       "lightning_over_plain_step_time": None}


def test_the_report_tables_each_run_and_each_target():
    config = CONFIGS["qwen3_8b_lora"]
    runs = {"lightning": [_run(1.9, 0.35, 0.97)], "plain": [{"error": "OutOfMemoryError: CUDA out of memory. Tried",
                                                              "failure": "out_of_memory"}]}
    data = {"benchmark": "sizes", "device": "NVIDIA H200", "configs": {
        "qwen3_8b_lora": {"settings": {"label": config.label}, "runs": runs, **figures(config, runs)},
        "qwen3_0.6b_mtp_graphed": {"skipped": "needs a CUDA device"}}}
    lines = report.render([("sizes.json", data)]).splitlines()
    assert ("| Qwen3-8B LoRA, every linear layer | lightning | 1.900 s | 0.5k | 1 | 35.0% | 97.0% | 10.0 GiB | n/a "
            "| [1] |") in lines
    assert ("| Qwen3-8B LoRA, every linear layer | plain | out_of_memory: OutOfMemoryError: CUDA out of memory. Tried "
            "|  |  |  |  |  |  |  | [1] |") in lines
    assert "| `qwen3_0.6b_mtp_graphed` |  | skipped: needs a CUDA device |  |  |  |  |  |  |  | [1] |" in lines
    assert "| Qwen3-8B LoRA, every linear layer: tokens/s | 0.5k | >= 8.4k | no | [1] |" in lines
    assert "| Qwen3-8B LoRA, every linear layer: Lightning / plain step time | n/a | <= 1.000x | n/a | [1] |" in lines


def test_a_moe_shape_counts_the_ffn_a_token_sees(tmp_path):
    """`bench.flops.Experts`: an MoE layer (the MTP layer's too) counts its top-k experts' FFN, the router left out:
    the FLOPs of the dense model whose FFN is top-k x the experts' FFN."""
    from lightning_megatron.testing.checkpoints import MoEShape

    checkpoint = make_tiny_checkpoint(tmp_path / "moe", "qwen3_moe", mtp=True, moe=MoEShape(
        num_experts=4, top_k=2, intermediate_size=24))
    shape = ModelShape.from_hf_checkpoint(checkpoint)
    assert shape.experts == Experts(experts=4, top_k=2, ffn=24, shared_ffn=0, moe_layers=(True, True))
    dense = dataclasses.replace(shape, ffn=2 * 24, experts=None)
    assert model_flops(shape, 2, 16) == model_flops(dense, 2, 16) > model_flops(dense, 2, 16, with_mtp=False)


def test_the_30b_a3b_configuration_is_a_qwen3_moe_checkpoint_of_its_shape(tmp_path):
    """The config-only checkpoint of the MoE configuration: Qwen3-MoE, its expert count under the key this
    transformers version writes, every layer routed (top 8 of 128, FFN 768)."""
    checkpoint = make_config_only_checkpoint(tmp_path / "30b", QWEN3_30B_A3B, tied=False)
    shape = ModelShape.from_hf_checkpoint(checkpoint)
    assert shape.experts == Experts(experts=128, top_k=8, ffn=768, shared_ffn=0, moe_layers=(True,) * 48)
    assert (shape.layers, shape.hidden, shape.mtp_layers, shape.tied) == (48, 2048, 1, False)
