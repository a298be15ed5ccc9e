"""Every benchmark script still runs, in its tiny CPU mode, and writes the JSON it promises; the FLOPs count they
share is Megatron-LM's, and the report turns their JSON into tables."""

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from bench import report
from bench.common import JOINT, MTP_ONLY, ModelShape, Passes, model_flops

ROOT = Path(__file__).resolve().parents[1]
VERSIONED = {"torch", "megatron-core", "megatron-bridge", "mbridge", "transformers", "lightning"}
QWEN3_0_6B = ModelShape(layers=28, hidden=1024, heads=16, kv_groups=8, head_dim=128, ffn=3072, vocab=151936,
                        mtp_layers=1)


def _run(tmp_path: Path, module: str, *args: str) -> subprocess.CompletedProcess:
    # not the test process's own rendezvous port, which an earlier test's process group is listening on
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}
    # output to files, not pipes: a child process left behind could hold a pipe open
    with open(tmp_path / "stdout.txt", "w") as stdout, open(tmp_path / "stderr.txt", "w") as stderr:
        completed = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, stdout=stdout, stderr=stderr,
                                   timeout=300, env=env)
    assert completed.returncode == 0, (tmp_path / "stderr.txt").read_text()[-3000:]
    return completed


def _run_bench(tmp_path: Path, module: str, *args: str) -> dict:
    out = tmp_path / "result.json"
    _run(tmp_path, module, *args, "--out", str(out))
    result = json.loads(out.read_text())
    assert result["command"] == shlex.join([Path(sys.executable).name, "-m", module, *args, "--out", str(out)])
    assert set(result["versions"]) == VERSIONED and result["versions"]["megatron-core"]
    assert result["device"] and re.match(r"\d{4}-\d\d-\d\dT", result["date"])
    return result


def _check_throughput(figures: dict) -> None:
    assert figures["step_s"] > 0 and figures["tokens_per_s"] > 0 and figures["model_tflop_per_step"] > 0
    assert figures["mfu"] is None and figures["peak_memory_gib"] is None  # on the CPU: no peak to divide by


@pytest.mark.slow
def test_lightning_overhead_benchmark_runs_tiny(tmp_path):
    result = _run_bench(tmp_path, "bench.lightning_overhead", "--tiny")
    assert result["benchmark"] == "lightning_overhead"
    assert result["order"] == ["plain", "lightning", "mtp_only", "mtp_only", "lightning", "plain"]
    runs = result["runs"]
    steps = result["settings"]["warmup"] + result["settings"]["steps"]
    for figures in runs.values():
        _check_throughput(figures)
        assert len(figures["losses"]) == len(figures["mtp_losses"]) == 2  # one list per round
        assert all(len(losses) == steps and all(math.isfinite(x) and x > 0 for x in losses)
                   for losses in figures["losses"] + figures["mtp_losses"])
        assert figures["losses"][0] == figures["losses"][1]  # CPU fp32 is deterministic: the rounds agree
    # the same computation through Lightning and through the plain loop
    assert result["overhead"]["max_abs_lm_loss_diff"] < 1e-5
    assert result["overhead"]["max_abs_mtp_loss_diff"] < 1e-5
    assert result["overhead"]["lightning_over_plain_step_time"] > 0 and len(result["overhead"]["per_round"]) == 2
    # MTP-only starts from the same weights and data, then leaves the backbone (and so lm_loss's model) alone
    joint, mtp_only = runs["lightning"]["losses"][0], runs["mtp_only"]["losses"][0]
    assert mtp_only[0] == joint[0] and mtp_only[1:] != joint[1:]
    assert runs["mtp_only"]["model_tflop_per_step"] < runs["lightning"]["model_tflop_per_step"]
    assert result["mtp_only"]["step_time_ratio"] > 0 and result["mtp_only"]["peak_memory_ratio"] is None
    assert result["mtp_only"]["frozen_bit_identical"] is True


@pytest.mark.slow
def test_hf_io_benchmark_runs_tiny(tmp_path):
    result = _run_bench(tmp_path, "bench.hf_io", "--tiny", "--repeats", "1")
    assert set(result["bridges"]) == {"mbridge", "megatron-bridge"}
    mbridge, megatron_bridge = result["bridges"]["mbridge"], result["bridges"]["megatron-bridge"]
    assert (mbridge["mtp"], megatron_bridge["mtp"]) == (False, True)
    assert megatron_bridge["tensors"] - mbridge["tensors"] == 15  # the tiny Qwen3 MTP head
    for timings in result["bridges"].values():
        assert timings["build_and_load_s"] > 0 and timings["save_s"] > 0
        assert timings["raw_read_s"] > 0 and timings["raw_write_s"] > 0
        assert timings["load_vs_raw_read"] == pytest.approx(timings["build_and_load_s"] / timings["raw_read_s"])


@pytest.mark.slow
def test_attention_benchmark_runs_tiny(tmp_path):
    result = _run_bench(tmp_path, "bench.attention", "--tiny")
    assert set(result["megatron"]) == {"local", "sdpa"}
    for timings in [*result["megatron"].values(), result["hf_transformers_sdpa"]]:
        assert timings.keys() == {"step_s", "tokens_per_s", "model_tflop_per_step", "model_tflop_per_s", "mfu",
                                  "peak_memory_gib", "last_loss"}
        _check_throughput(timings)
    # the same weights and tokens: both core attentions compute the same training step
    megatron = result["megatron"]
    assert megatron["sdpa"]["last_loss"] == pytest.approx(megatron["local"]["last_loss"], abs=1e-4)
    assert result["sdpa_over_local_step_time"] > 0 and result["sdpa_over_hf_step_time"] > 0


@pytest.mark.slow
def test_moe_benchmark_runs_tiny(tmp_path):
    result = _run_bench(tmp_path, "bench.moe", "--tiny")
    for figures in (result["moe"], result["dense_equivalent"]):
        _check_throughput(figures)
    assert result["moe"]["mlp_backend"] == "SequentialMLP" and result["dense_equivalent"]["mlp_backend"] == "MLP"
    # the same active FLOPs (the router's h x experts projection is left out)
    assert result["moe"]["model_tflop_per_step"] == result["dense_equivalent"]["model_tflop_per_step"]
    assert result["moe"]["parameters"] > result["dense_equivalent"]["parameters"]
    assert result["moe_over_dense_step_time"] == pytest.approx(result["moe"]["step_s"]
                                                               / result["dense_equivalent"]["step_s"])


@pytest.mark.slow
def test_plain_megatron_loop_runs_tiny(tmp_path):
    _run(tmp_path, "bench.megatron_loop", "--steps", "2")
    stdout = (tmp_path / "stdout.txt").read_text()
    result = json.loads(stdout[stdout.index("{\n"):])
    assert len(result["losses"]) == len(result["step_times_s"]) == 2
    assert all(loss > 0 for loss in result["losses"]) and all(t > 0 for t in result["step_times_s"])


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


def _lightning_overhead_result(device: str) -> dict:
    def figures(step_s: float, memory: float) -> dict:
        return {"step_s": step_s, "tokens_per_s": 16384 / step_s, "mfu": 0.1, "peak_memory_gib": memory}

    return {
        "benchmark": "lightning_overhead", "command": "python3 -m bench.lightning_overhead", "device": device,
        "versions": {"torch": "2.11.0", "mbridge": None}, "date": "2026-12-03T00:00:00Z",
        "settings": {"precision": "bf16"},
        "runs": {"plain": figures(0.8, 40.0), "lightning": figures(0.808, 40.0), "mtp_only": figures(0.3, 7.0)},
        "overhead": {"lightning_over_plain_step_time": 1.01, "target": 1.01},
        "mtp_only": {"step_time_ratio": 0.3 / 0.808, "peak_memory_ratio": 7 / 40,
                     "peak_memory_ratio_including_setup": 0.2,
                     "targets": {"step_time_ratio": 0.40, "peak_memory_ratio": 0.20}},
    }


def test_report_tables_every_figure_against_its_target():
    h200_attention = json.loads((ROOT / "bench/results/attention_p1_h200.json").read_text())
    hf_io = {"benchmark": "hf_io", "device": "NVIDIA H200", "target_vs_raw": 1.5, "bridges": {"mbridge": {
        "mtp": False, "tensors": 310, "bytes": 1.19e9, "build_and_load_s": 1.0, "raw_read_s": 0.5,
        "load_vs_raw_read": 2.0, "save_s": 0.6, "raw_write_s": 0.5, "save_vs_raw_write": 1.2}}}
    text = report.render([("a.json", _lightning_overhead_result("NVIDIA H200")), ("b.json", h200_attention),
                          ("c.json", hf_io), ("notes.json", {"something": "else"})])
    lines = text.splitlines()
    joint = next(line for line in lines if line.startswith("| lightning_megatron, joint"))
    assert "| 0.808 s | 20.3k | 10.0% | 40.0 GiB | 1.010x plain step time | [1] |" in joint
    mtp_only = next(line for line in lines if line.startswith("| lightning_megatron, MTP-only"))
    assert "0.371x joint step time, 0.175x joint peak memory (0.200x with set-up)" in mtp_only
    hf = next(line for line in lines if line.startswith("| plain HF transformers"))
    assert "| 0.551 s | 29.7k | n/a | 27.0 GiB | ours (joint, with MTP): 1.465x its step time | [2] |" in hf
    assert "| P1 Lightning / plain Megatron-Core step time | 1.010x | <= 1.01x | yes | [1] |" in lines
    assert "| P2 MTP-only / joint peak memory | 0.175x | <= 0.2x | yes | [1] |" in lines
    assert "| P3 mbridge load / raw read | 2.000x | <= 1.5x | no | [3] |" in lines
    assert any(line.startswith("| mbridge | 310 (no MTP head) | 1.19 GB | 1.000 s | 0.500 s | 2.000x")
               for line in lines)
    source = "- [1] `a.json`: `python3 -m bench.lightning_overhead`; NVIDIA H200; torch 2.11.0; 2026-12-03T00:00:00Z"
    assert source in lines
    assert "(skipped, not a known benchmark: notes.json)" in text
    # our joint step is set beside plain HF only when both ran on the same device
    elsewhere = report.render([("a.json", _lightning_overhead_result("cpu")), ("b.json", h200_attention)])
    assert "ours (joint, with MTP)" not in elsewhere


def test_the_gpu_driver_runs_only_scripts_that_exist():
    script = (ROOT / "bench/run_h200.sh").read_text()
    modules = re.findall(r"python3 -m (bench\.\w+)", script)
    assert {"bench.make_checkpoint", "bench.lightning_overhead", "bench.hf_io", "bench.attention",
            "bench.report"} <= set(modules)
    assert all((ROOT / (module.replace(".", "/") + ".py")).is_file() for module in modules)
    assert subprocess.run(["bash", "-n", str(ROOT / "bench/run_h200.sh")]).returncode == 0
