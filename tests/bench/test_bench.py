"""Every benchmark script still runs, in its tiny CPU mode, and writes the JSON it promises (the FLOPs count they
share is in test_flops.py, the report of their JSON in test_report.py)."""

import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from bench import report
from bench.common import SCRATCH_PREFIX
from tests._background import Command, background_runs
from tests.bench._checks import check_sizes_config, check_throughput

ROOT = Path(__file__).resolve().parents[2]
VERSIONED = {"torch", "megatron-core", "megatron-bridge", "mbridge", "transformers", "lightning"}


def _env() -> dict[str, str]:
    # not the test process's own rendezvous port, which an earlier test's process group is listening on
    return {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}


def _run(tmp_path: Path, module: str, *args: str) -> subprocess.CompletedProcess:
    # output to files, not pipes: a child process left behind could hold a pipe open
    with open(tmp_path / "stdout.txt", "w") as stdout, open(tmp_path / "stderr.txt", "w") as stderr:
        completed = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, stdout=stdout, stderr=stderr,
                                   timeout=300, env=_env())
    assert completed.returncode == 0, (tmp_path / "stderr.txt").read_text()[-3000:]
    return completed


def _run_bench(tmp_path: Path, module: str, *args: str) -> dict:
    out = tmp_path / "result.json"
    _run(tmp_path, module, *args, "--out", str(out))
    return _checked_result(out, module, *args)


def _checked_result(out: Path, module: str, *args: str) -> dict:
    result = json.loads(out.read_text())
    assert result["command"] == shlex.join([Path(sys.executable).name, "-m", module, *args, "--out", str(out)])
    assert set(result["versions"]) == VERSIONED and result["versions"]["megatron-core"]
    assert result["device"] and re.match(r"\d{4}-\d\d-\d\dT", result["date"])
    return result


def _tiny(test: str, module: str, *args: str, out: bool = True, workdir: bool = False) -> Command:
    """`python -m module args` (then `--workdir FOLDER/work` and `--out FOLDER/result.json`) for `test`, forked from
    the module's preloaded process (`tests/_preloaded.py`)."""
    return Command(test, lambda folder: [module, *args, *(["--workdir", str(folder / "work")] if workdir else []),
                                         *(["--out", str(folder / "result.json")] if out else [])], _env, ROOT,
                   preloaded=True)


# the `--tiny` runs the tests below read, in the order they do
TINY_RUNS = {
    "lightning_overhead": _tiny("test_lightning_overhead_benchmark_runs_tiny", "bench.lightning_overhead", "--tiny"),
    "host_overhead": _tiny("test_host_overhead_benchmark_runs_tiny", "bench.host_overhead", "--steps", "2",
                           "--warmup", "1", "--rounds", "1", "--profile"),
    "hf_io": _tiny("test_hf_io_benchmark_runs_tiny", "bench.hf_io", "--tiny", "--repeats", "1"),
    "attention": _tiny("test_attention_benchmark_runs_tiny", "bench.attention", "--tiny"),
    "moe": _tiny("test_moe_benchmark_runs_tiny", "bench.moe", "--tiny"),
    "megatron_loop": _tiny("test_plain_megatron_loop_runs_tiny", "bench.megatron_loop", "--steps", "2", out=False),
    "async_save": _tiny("test_async_save_benchmark_runs_tiny", "bench.async_save", "--tiny"),
    "staging_probe": _tiny("test_staging_probe_runs_tiny", "bench.staging_probe", "--tiny", "--skip-gc"),
    "packing": _tiny("test_packing_benchmark_runs_tiny", "bench.packing", "--tiny"),
    "vl": _tiny("test_vl_benchmark_runs_tiny", "bench.vl", "--tiny"),
    "tree": _tiny("test_tree_benchmark_runs_tiny", "bench.tree", "--tiny"),
    "weight_sync": _tiny("test_weight_sync_benchmark_runs_tiny", "bench.weight_sync", "--tiny", "--repeats", "1",
                         "--steps", "1", "--warmup", "1"),
    "mtp_memory": _tiny("test_mtp_memory_benchmark_runs_tiny", "bench.mtp_memory", "--tiny"),
    "data": _tiny("test_data_benchmark_runs_tiny", "bench.data", "--tiny", workdir=True),
    "trunk_cache": _tiny("test_trunk_cache_benchmark_runs_tiny", "bench.trunk_cache", "--tiny"),
    "sizes": _tiny("test_sizes_benchmark_runs_tiny", "bench.sizes", "--tiny", "--configs", "qwen3_8b_lora",
                   "qwen3_0.6b_mtp_default", "qwen3_0.6b_mtp_graphed", "qwen3_30b_a3b_lora"),
    "norms": _tiny("test_norms_benchmark_runs_tiny", "bench.norms", "--tiny"),
    # 2 MiB to plan GLM's cuts against: its tiny model's MTP-only training fits (1.1 MiB), joint training not (3 MiB)
    "families": _tiny("test_families_benchmark_runs_tiny", "bench.families", "--tiny", "--free-gib", "0.002",
                      "--reserve-gib", "0"),
}


@pytest.fixture(scope="module", autouse=True)
def tiny_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    yield from background_runs(request, tmp_path_factory, TINY_RUNS)


def _tiny_result(tiny_runs, name: str) -> dict:
    """The run's JSON, checked as `_run_bench` checks it."""
    completed, folder = tiny_runs.result(name)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return _checked_result(folder / "result.json", *completed.args[2:-2])


@pytest.mark.slow
def test_lightning_overhead_benchmark_runs_tiny(tiny_runs):
    result = _tiny_result(tiny_runs, "lightning_overhead")
    assert result["benchmark"] == "lightning_overhead"
    assert result["order"] == ["plain", "lightning", "mtp_only", "mtp_only", "lightning", "plain"]
    runs = result["runs"]
    steps = result["settings"]["warmup"] + result["settings"]["steps"]
    for figures in runs.values():
        check_throughput(figures)
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
def test_host_overhead_benchmark_runs_tiny(tiny_runs):
    result = _tiny_result(tiny_runs, "host_overhead")
    assert result["order"] == ["plain", "lightning"] and result["max_abs_lm_loss_diff"] < 1e-5
    for figures in result["runs"].values():
        assert figures["step_ms"] >= figures["shared_ms"] > 0 and len(figures["round_host_ms"]) == 1
    lightning = result["profile"]["lightning"]["lightning_side_cumulative_ms"]
    assert any("log_step_metrics" in name for name in lightning)


@pytest.mark.slow
def test_hf_io_benchmark_runs_tiny(tiny_runs):
    result = _tiny_result(tiny_runs, "hf_io")
    assert set(result["bridges"]) == {"mbridge", "megatron-bridge"}
    mbridge, megatron_bridge = result["bridges"]["mbridge"], result["bridges"]["megatron-bridge"]
    assert (mbridge["mtp"], megatron_bridge["mtp"]) == (False, True)
    assert megatron_bridge["tensors"] - mbridge["tensors"] == 15  # the tiny Qwen3 MTP head
    for timings in result["bridges"].values():
        assert timings["build_and_load_s"] > 0 and timings["save_s"] > 0
        assert timings["raw_read_s"] > 0 and timings["raw_write_s"] > 0
        assert timings["load_vs_raw_read"] == pytest.approx(timings["build_and_load_s"] / timings["raw_read_s"])
        assert timings["load_s"] > 0 and timings["library_load_s"] > 0
        assert timings["load_report"]["converted"] == 0 and timings["load_report"]["sliced"] > 0  # all from slices


@pytest.mark.slow
def test_attention_benchmark_runs_tiny(tiny_runs):
    result = _tiny_result(tiny_runs, "attention")
    assert set(result["megatron"]) == {"local", "sdpa"}
    for timings in [*result["megatron"].values(), result["hf_transformers_sdpa"]]:
        assert timings.keys() == {"step_s", "tokens_per_s", "model_tflop_per_step", "model_tflop_per_s", "mfu",
                                  "peak_memory_gib", "last_loss"}
        check_throughput(timings)
    # the same weights and tokens: both core attentions compute the same training step
    megatron = result["megatron"]
    assert megatron["sdpa"]["last_loss"] == pytest.approx(megatron["local"]["last_loss"], abs=1e-4)
    assert result["sdpa_over_local_step_time"] > 0 and result["sdpa_over_hf_step_time"] > 0


@pytest.mark.slow
def test_moe_benchmark_runs_tiny(tiny_runs):
    result = _tiny_result(tiny_runs, "moe")
    for figures in (result["moe"], result["moe_expert_loop"], result["dense_equivalent"]):
        check_throughput(figures)
    assert result["moe"]["mlp_backend"] == "SequentialMLP" and result["dense_equivalent"]["mlp_backend"] == "MLP"
    assert result["experts_grouped_gemm"] is False  # the CPU keeps upstream's loop: both MoE arms run it
    assert result["grouped_over_expert_loop_step_time"] == pytest.approx(result["moe"]["step_s"]
                                                                         / result["moe_expert_loop"]["step_s"])
    # the same active FLOPs (the router's h x experts projection is left out)
    assert result["moe"]["model_tflop_per_step"] == result["dense_equivalent"]["model_tflop_per_step"]
    assert result["moe"]["parameters"] > result["dense_equivalent"]["parameters"]
    assert result["moe_over_dense_step_time"] == pytest.approx(result["moe"]["step_s"]
                                                               / result["dense_equivalent"]["step_s"])


@pytest.mark.slow
def test_plain_megatron_loop_runs_tiny(tiny_runs):
    completed, _ = tiny_runs.result("megatron_loop")
    assert completed.returncode == 0, completed.stderr[-3000:]
    stdout = completed.stdout
    result = json.loads(stdout[stdout.index("{\n"):])
    assert len(result["losses"]) == len(result["step_times_s"]) == 2
    assert all(loss > 0 for loss in result["losses"]) and all(t > 0 for t in result["step_times_s"])
    assert result["adam"] == ["for-loop"]  # the CPU's: `_compat.fused_adam` switches CUDA parameters only


def test_async_save_benchmark_runs_tiny(tiny_runs):
    result = _tiny_result(tiny_runs, "async_save")
    sync, background = result["runs"]["sync"], result["runs"]["async"]
    assert sync["blocked_s"] > 0 and background["blocked_s"] > 0
    assert sync["published_after_s"] >= sync["blocked_s"] and background["published_after_s"] > 0
    assert len(background["step_times_s"]) == len(sync["step_times_s"]) == 1 + 4 + 2  # warm-up, steps, save's
    assert result["figures"]["async_over_sync_blocked"] == background["blocked_s"] / sync["blocked_s"]
    assert set(result["met"]) == set(result["targets"]) == set(result["figures"])
    # async staged into memory reserved at the start of training (and grown by the optimizer's shards at most once)
    staging = background["staging"]
    assert staging["reserved_bytes"] > 0 and staging["bytes"] > 0 and staging["segments_made"] <= 2
    assert staging["copy_s"] > 0 and staging["allocation_s"] >= staging["reserve_s"]
    assert sync["staging"] == {"reserved_bytes": 0, "reserve_s": 0.0, "allocation_s": 0.0, "segments_made": 0}
    assert result["settings"]["gc_every"] == 2
    noise = result["noise_reference"]
    assert noise["sync_max_step_over_median"] == sync["max_step_over_median"]
    assert noise["sync_steps_with_no_save_in_flight_s"] == sync["step_times_s"][1:2] + sync["step_times_s"][3:]
    table = "\n".join(report.targets_table([("async_save.json", result)], {"async_save.json": 1}))
    assert "async save: time a step is blocked" in table and "slowest step outside staging" in table
    assert "(noise) sync run, no save in flight" in table


def test_staging_probe_runs_tiny(tiny_runs):
    result = _tiny_result(tiny_runs, "staging_probe")
    assert result["bytes"] > 0 and result["device"] == "cpu"
    for variant in ("megatron", "host_staging"):  # a forked child read every staged tensor and wrote it right
        assert result[variant]["exitcode"] == 0 and result[variant]["child_wrote_the_gpu_bytes"] is True
    staging = result["host_staging"]
    assert staging["pinned"] is False and staging["first"]["capacity"] >= result["bytes"]
    assert staging["parent_heap_write_after_fork_s"] > 0 and "gc" not in result


@pytest.mark.slow
def test_packing_benchmark_runs_tiny(tiny_runs):
    result = _tiny_result(tiny_runs, "packing")
    layouts = result["layouts"]
    graphed = {"full_graph", "packed_graph"}
    assert set(layouts) == {"packed", "padded", "full", "packed_before", "packed_upstream_rope"} | graphed
    if not torch.cuda.is_available():  # the graphed layouts are skipped with their reason, the others ran
        assert {name: layouts.pop(name) for name in graphed} == {
            name: {"error": "skipped: CUDA graphs need a GPU"} for name in graphed}
        assert result["core_attention"] == {"error": "skipped: needs a GPU"}  # varlen_attn is CUDA only
    assert result["vectorized_thd_rope"]
    # the code before issue 29 (create_block_mask, RoPE index per layer, max_seqlen read back) trains the same
    assert layouts["packed_before"]["last_loss"] == pytest.approx(layouts["packed"]["last_loss"], abs=1e-5)
    assert all(set(layout["ranges_cpu_ms"]) >= {"## forward_step", "## backward_step"} for layout in layouts.values())
    assert layouts["packed"]["real_tokens_per_step"] == layouts["padded"]["real_tokens_per_step"]
    # the vectorized THD RoPE gives upstream's training steps
    assert layouts["packed"]["last_loss"] == layouts["packed_upstream_rope"]["last_loss"]
    assert layouts["packed"]["rows"] < layouts["padded"]["rows"] == result["sequences"]
    # the same sequences, labels and masks, packed or padded: the same training steps
    assert layouts["packed"]["last_loss"] == pytest.approx(layouts["padded"]["last_loss"], abs=1e-4)
    assert all(layout["step_s"] > 0 and layout["peak_memory_gib"] is None for layout in layouts.values())
    summary = result["summary"]
    assert 0 < summary["packed_padding_fraction"] < summary["padded_padding_fraction"] < 1
    gloo = result["context_parallel"]["gloo_cp2"]
    assert gloo["matches_formula"] and gloo["layers"] == 2  # one all-gather per decoder layer
    scaling = result["context_parallel"]["per_row_of_seq_tokens_at_benchmark_shape"]
    assert [scaling[size]["forward_all_gather_bytes_per_layer_per_rank"] for size in ("2", "4")] == [
        2 * (cp - 1) / cp * 128 * 2 * 16 * 4 for cp in (2, 4)]


def test_vl_benchmark_runs_tiny(tiny_runs):
    result = _tiny_result(tiny_runs, "vl")
    padded, packed = result["padded"], result["packed"]
    assert packed["rows"] < padded["rows"] == result["sequences_per_step"]
    assert packed["processed_tokens_per_step"] < padded["processed_tokens_per_step"]
    assert 0 < result["padding_fraction_padded"] < 1 and result["real_tokens_per_step"] > 0
    for figures in (padded, packed):
        assert figures["step_s"] > 0 and figures["real_tokens_per_s"] > 0 and figures["peak_memory_gib"] is None
        assert all(math.isfinite(loss) for loss in figures["losses"])


@pytest.mark.slow
def test_tree_benchmark_runs_tiny(tiny_runs):
    result = _tiny_result(tiny_runs, "tree")
    assert result["benchmark"] == "tree" and result["settings"]["order"] == ["flat", "tree", "tree", "flat"]
    batch = result["batch"]
    assert batch["tree_tokens"] < batch["original_tokens"] and batch["tree_rows"] <= batch["flat_rows"]
    for figures in result["runs"].values():
        assert figures["step_s"] > 0 and figures["original_tokens_per_s"] > 0 and figures["peak_memory_gib"] is None
    assert result["tree_over_flat"]["original_tokens_per_s"] > 0
    # fp32 on the CPU: every flat layout (file order, permutations, padded) and the tree compute the same batch and
    # per-sequence losses; each layout's per-sequence losses, weighted by trained tokens, give its batch loss
    loss = result["loss"]
    assert loss["flat_layouts"] == result["settings"]["permutations"] + 2
    assert loss["tree_layouts"] == result["settings"]["permutations"] + 1 and loss["tree_band"] < 1e-5
    assert loss["per_sequence"]["sequences"] == batch["sequences"]
    for check in (loss, loss["fp32"]):
        per_sequence = check["per_sequence"]
        assert abs(check["tree_minus_flat_mean"]) < 1e-5 and check["flat_band"] < 1e-5
        assert per_sequence["tree_minus_flat_mean_max_abs"] < 1e-5 and per_sequence["flat_band_max"] < 1e-5
        weights = per_sequence["trained_tokens"]
        for name, losses in per_sequence["losses"].items():
            weighted = math.fsum(loss * weight for loss, weight in zip(losses, weights)) / sum(weights)
            assert abs(weighted - check["batch"][name]) < 1e-5, name
    assert result["recompiles_after_warmup"] == 0
    table = report.render([("tree.json", result)])
    assert "**Tree packing vs flat packing (P6)**" in table and "(>= 3x)" in table


def test_tree_benchmark_permuted_trees_hold_every_sequence_elsewhere():
    from bench.tree import equivalent_layouts, grpo_batch
    from lightning_megatron.data.tree import build_tree_rows

    examples = grpo_batch(prompts=3, responses=4, prompt_tokens=12, response_tokens=5, vocab_size=50)
    layouts = equivalent_layouts(examples, build_tree_rows(examples, 64, 0), 64, 0, permutations=2)
    trees = {name: layout for name, layout in layouts.items() if name.startswith("tree")}
    assert sorted(trees) == ["tree", "tree_permutation0", "tree_permutation1"]
    for layout in trees.values():  # each sequence's tokens, read where the layout put them, are the sequence
        for (row, positions), example in zip(layout.paths, examples):
            assert torch.equal(layout.rows[row]["input_ids"][positions], example.input_ids)
    placements = {name: [(row, int(positions[-1])) for row, positions in layout.paths]
                  for name, layout in trees.items()}
    assert len({tuple(placement) for placement in placements.values()}) == 3  # three different layouts


@pytest.mark.slow
def test_weight_sync_benchmark_runs_tiny(tiny_runs):
    result = _tiny_result(tiny_runs, "weight_sync")
    sync = result["sync"]
    for figure in ("raw_write_s", "disk_sync_s", "engine_read_s", "colocated_sync_s", "collective_sync_s"):
        assert sync[figure] > 0, figure
    assert sync["disk_round_trip_s"] == sync["disk_sync_s"] + sync["engine_read_s"]
    assert sync["colocated_extra_sender_memory_bytes"] is None  # GPU memory only
    steps = result["steps_between_syncs"]
    arms = ["without", "attached", "after_disk_sync", "receiver_idle", "after_colocated_sync"]
    assert steps["order"] == [*arms, *reversed(arms)] and set(steps["ratios"]) == set(arms[1:])
    assert steps["step_time_ratio"] == steps["ratios"]["attached"] > 0 and steps["noise"] >= 0
    assert result["output_folder"] and not Path(result["output_folder"]).exists()  # removed at the end
    table = "\n".join(report.targets_table([("weight_sync.json", result)], {"weight_sync.json": 1}))
    assert "P7 disk sync / raw write" in table and "P7 step time with WeightSync / without" in table
    delta = result["delta"]
    assert 0 < delta["mtp_head_bytes"] < delta["model_bytes"] / 2 and delta["lora_adapter_bytes"] > 0
    assert delta["lora_adapter_spare_file"] == {"mapped": True, "registered": False, "refusal": "not asked"}  # CPU
    assert all(delta[figure] > 0 for figure in ("delta_vs_full_disk", "delta_vs_full_colocated", "lora_adapted_tensors",
                                                "lora_adapter_vs_merged_disk", "lora_adapter_vs_full_disk",
                                                "lora_adapter_between_steps_vs_merged_disk"))
    assert "P7 MTP-only delta / full sync, colocated" in table and "the LoRA run's full (merged) sync" in table


@pytest.mark.slow
def test_mtp_memory_benchmark_runs_tiny(tiny_runs):
    result = _tiny_result(tiny_runs, "mtp_memory")
    assert result["benchmark"] == "mtp_memory" and result["breakdown"] == {}  # no allocator trace on the CPU
    small, large = result["shapes"]["qwen3_0.6b"], result["shapes"]["qwen3_8b"]
    assert small["order"] == ["joint", "mtp_only", "mtp_only_eager", "mtp_only_lm_loss_every_step",
                              "mtp_only_self_distill", "mtp_only_tv", "mtp_only_tv_kl", "mtp_only_whole_logits",
                              "plain_mtp_only"]
    # the TV losses' MTP-only step beside self-distillation's (issue 42's <= 1.1x), on the same steps
    assert all(small["figures"][f"{loss}_over_self_distill_step_time"] > 0 for loss in ("tv", "tv_kl"))
    assert large["order"] == ["mtp_only", "mtp_only_eager", "mtp_only_whole_logits", "plain_mtp_only"]
    assert (small["tied"], large["tied"]) == (True, False)
    for shape in (small, large):
        for figures in shape["runs"].values():
            check_throughput(figures)
            assert figures["memory_at_start_gib"] == [None]
            assert all(math.isfinite(x) and x > 0 for losses in figures["losses"] for x in losses if x is not None)
        # randomly initialised the same way, the same tokens: Lightning MTP-only and the plain MTP-only loop
        # compute the same steps, and leave the backbone (so lm_loss's model) alone; MTP-only runs the main head
        # (and has an lm_loss) only in the step Lightning logs (log_every_n_steps 2 of --tiny), the others in all
        ours, plain = shape["runs"]["mtp_only"], shape["runs"]["plain_mtp_only"]
        eager = shape["runs"]["mtp_only_eager"]  # on the CPU both arms run the trunk eagerly: the same steps
        assert ours["trunk_graphs"] == eager["trunk_graphs"] == [[]] and eager["mtp_losses"] == ours["mtp_losses"]
        assert shape["figures"]["mtp_only_over_eager_trunk_step_time"] > 0 and "mtp_only_eager_profile" not in shape
        assert ours["main_head_steps"] == [False, True, False] and ours["losses"][0][::2] == [None, None]
        assert ours["losses"][0][1] == pytest.approx(plain["losses"][0][1], abs=1e-5)
        assert ours["mtp_losses"][0] == pytest.approx(plain["mtp_losses"][0], abs=1e-5)
        assert ours["frozen_bit_identical"] is True
        whole = shape["runs"]["mtp_only_whole_logits"]  # token chunks change the time, not the losses
        assert whole["main_head_steps"] == [True] * 3
        assert whole["losses"][0] == pytest.approx(plain["losses"][0], abs=1e-5)
        assert whole["mtp_losses"][0] == pytest.approx(ours["mtp_losses"][0], abs=1e-5)
        # MFU counts what ran: the main head's projection in one timed step of two
        assert ours["model_tflop_per_step"] < whole["model_tflop_per_step"]
        profile = shape["mtp_only_profile"]  # one profiled step; on the CPU no device figures
        assert profile["main_head_ran"] is False and profile["profiled_step_s"] > 0 and profile["top_cpu_ops"]
        assert profile["gpu_busy_fraction"] is None and profile["kernel_launch_calls"] == 0
        assert shape["figures"]["mtp_only_over_whole_logits_step_time"] > 0
        assert shape["figures"]["mtp_only_peak_memory_gib"] is None  # no peak memory on the CPU
        assert all(met is None for figure, met in shape["met"].items() if "memory" in figure)
    joint, every_step = small["runs"]["joint"], small["runs"]["mtp_only_lm_loss_every_step"]
    assert joint["losses"][0][0] == every_step["losses"][0][0] and every_step["main_head_steps"] == [True] * 3
    assert every_step["mtp_losses"][0] == pytest.approx(small["runs"]["mtp_only"]["mtp_losses"][0], abs=1e-6)
    assert small["figures"]["mtp_only_over_lm_loss_every_step_step_time"] > 0
    assert small["figures"]["mtp_only_over_joint_step_time"] > 0
    assert small["targets"] == {"mtp_only_over_joint_peak_memory": 0.25, "mtp_only_over_joint_step_time": 0.42,
                                "self_distill_over_joint_peak_memory": 0.25, "tv_over_self_distill_step_time": 1.1,
                                "tv_kl_over_self_distill_step_time": 1.1}
    distilled = small["runs"]["mtp_only_self_distill"]  # same trunk, same lm_loss; a different MTP target
    assert distilled["losses"][0][1] == small["runs"]["mtp_only"]["losses"][0][1]
    assert small["figures"]["self_distill_over_joint_step_time"] > 0
    assert large["targets"] == {"mtp_only_peak_memory_gib": 23.6, "mtp_only_step_s": 0.348}


@pytest.mark.slow
def test_sizes_benchmark_runs_tiny(tiny_runs):
    """Dense LoRA, joint SFT + MTP at the default settings and MoE LoRA, each through Lightning and the plain loop
    (the graphed configuration needs CUDA: skipped, said so); fp32 on the CPU: both compute the same steps."""
    result = _tiny_result(tiny_runs, "sizes")
    configs = result["configs"]
    assert result["benchmark"] == "sizes" and list(configs) == ["qwen3_8b_lora", "qwen3_0.6b_mtp_default",
                                                                 "qwen3_0.6b_mtp_graphed", "qwen3_30b_a3b_lora"]
    assert configs["qwen3_0.6b_mtp_graphed"] == {"skipped": "needs a CUDA device (CUDA graphs or the optimizer's "
                                                             "offload)"}
    for name in ("qwen3_8b_lora", "qwen3_0.6b_mtp_default", "qwen3_30b_a3b_lora"):
        check_sizes_config(configs[name], name)
    assert configs["qwen3_8b_lora"]["met"] == {"tokens_per_s": False, "lightning_over_plain_step_time": (
        configs["qwen3_8b_lora"]["figures"]["lightning"]["lightning_over_plain_step_time"] <= 1.0)}
    assert configs["qwen3_0.6b_mtp_default"]["met"]["mfu"] is None  # no peak to divide by on the CPU
    table = report.render([("sizes.json", result)])
    assert "**Sizes users train on one GPU" in table and "| Qwen3-30B-A3B LoRA, linear_qkv and linear_proj | plain |" \
        in table


@pytest.mark.slow
def test_norms_benchmark_runs_tiny(tiny_runs):  # its figures: tests/bench/test_norms.py, in-process
    assert set(_tiny_result(tiny_runs, "norms")["shapes"]["tiny"]["norms"]) == {"hidden", "query", "key"}


def test_families_benchmark_runs_tiny(tiny_runs):
    result = _tiny_result(tiny_runs, "families")
    shapes = result["shapes"]
    assert result["benchmark"] == "families" and set(shapes) == {"qwen3_5_2b", "glm4_5_air", "glm4_5_air_joint"}
    qwen, glm, joint = shapes["qwen3_5_2b"], shapes["glm4_5_air"], shapes["glm4_5_air_joint"]
    assert qwen["order"] == ["joint", "mtp_only", "plain_mtp_only"]
    # GLM cut to what 2 MiB hold: MTP-only training of both tiny layers (a dense one, an MoE one), no joint training
    assert glm["fit"]["mtp_only_layers"] == 2 and glm["fit"]["joint_layers"] is None and "skipped" in joint
    assert glm["order"] == ["mtp_only", "plain_mtp_only"]
    assert glm["label"] == "GLM-4.5-Air, first 2 of 2 layers (MTP-only fits)"
    assert glm["shape"]["experts"]["moe_layers"] == [False, True]
    for shape in (qwen, glm):
        for figures in shape["runs"].values():
            check_throughput(figures)
        # Megatron's random initialization and the same tokens: Lightning MTP-only and the plain MTP-only loop
        # train the same MTP layer and leave the backbone alone (lm_loss only in the step Lightning logs)
        ours, plain = shape["runs"]["mtp_only"], shape["runs"]["plain_mtp_only"]
        assert ours["mtp_losses"][0] == pytest.approx(plain["mtp_losses"][0], abs=1e-5)
        assert ours["losses"][0][1] == pytest.approx(plain["losses"][0][1], abs=1e-5)
        assert ours["frozen_bit_identical"] is True
        assert shape["figures"]["mtp_only_over_plain_mtp_only_step_time"] > 0
        assert shape["targets"] == {"mtp_only_over_plain_mtp_only_step_time": 0.95,
                                    "mtp_only_over_plain_mtp_only_peak_memory": 1.0}
        assert shape["met"]["mtp_only_over_plain_mtp_only_peak_memory"] is None  # no peak memory on the CPU
    assert qwen["runs"]["mtp_only"]["model_tflop_per_step"] < qwen["runs"]["joint"]["model_tflop_per_step"]
    gdn = result["gdn"]  # the PyTorch path alone: fla's Triton kernels need fla and a GPU
    assert gdn["pytorch"]["forward_backward_s"] > 0 and gdn["model_tflop_per_call"] > 0 and gdn["fla"]["skipped"]
    assert result["gdn_kernels"].startswith("pytorch")
    table = report.render([("families.json", result)])
    assert ("| issue 40 GLM-4.5-Air, first 2 of 2 layers (MTP-only fits) MTP-only / plain MTP-only loop step time |"
            in table)
    assert "| Qwen3.5-2B: plain Megatron-Core MTP-only loop (non-MTP frozen) |" in table
    assert "| GLM-4.5-Air (joint) | no cut with an MoE layer fits joint training in the budget |" in table


@pytest.mark.gpu
def test_mtp_memory_breakdown_on_the_gpu(tmp_path):
    """The allocator trace of a real (tiny) MTP-only run: its peak is the trained steps' and the markdown exists."""
    result = _run_bench(tmp_path, "bench.mtp_memory", "--tiny", "--shapes", "qwen3_8b", "--breakdown-steps", "1")
    breakdown = result["breakdown"]["qwen3_8b"]
    assert breakdown["rows"] and 0 < breakdown["peak_gib"] <= breakdown["max_memory_allocated_gib"] + 1e-6
    assert breakdown["allocated_before_recording_gib"] < 0.01  # every earlier run was released
    assert sum(row["gib"] for row in breakdown["rows"]) == pytest.approx(breakdown["peak_gib"])
    assert "| GiB | blocks | allocated at |" in (tmp_path / "mtp_memory_breakdown.md").read_text()
    runs = result["shapes"]["qwen3_8b"]["runs"]
    assert runs["mtp_only"]["peak_memory_gib"] > 0
    # the trunk from CUDA graphs by default (3 steps x 4 microbatches: a warm-up, a capture, 10 replays), not eager
    assert runs["mtp_only"]["trunk_graphs"] == [[{"warmups": 1, "captures": 1, "replays": 10, "eager": {}}]]
    assert runs["mtp_only_eager"]["trunk_graphs"] == [[]]
    assert runs["mtp_only"]["mtp_losses"][0] == pytest.approx(runs["mtp_only_eager"]["mtp_losses"][0], abs=1e-5)
    profile = result["shapes"]["qwen3_8b"]["mtp_only_profile"]
    assert profile["graph_launch_calls"] >= 4 and profile["kernel_launch_calls"] < result["shapes"]["qwen3_8b"][
        "mtp_only_eager_profile"]["kernel_launch_calls"]
    assert runs["plain_mtp_only"]["memory_at_start_gib"][0] < 0.01  # the Lightning run before it was released


def test_data_benchmark_runs_tiny(tiny_runs):
    result = _tiny_result(tiny_runs, "data")
    first, second = result["first_run"], result["second_run"]
    assert first["built"] and not second["built"] and first["rows"] == second["rows"] == 400
    assert second["steps"] == 40 and second["trained_tokens"] > 0 and result["cache_bytes"] > 0
    assert first["setup_s"] > 0 and first["rows_per_s"] > 0 and second["peak_rss_beyond_start_gib"] is not None


@pytest.mark.slow
def test_trunk_cache_benchmark_runs_tiny(tiny_runs):
    result = _tiny_result(tiny_runs, "trunk_cache")
    assert result["benchmark"] == "trunk_cache"
    for name, reference in (("qwen3_0.6b", "joint"), ("qwen3_8b", "plain_mtp_only")):
        shape = result["shapes"][name]
        assert set(shape["runs"]) == {reference, "first_epoch", "cached_epochs"}
        for figures in shape["runs"].values():
            check_throughput(figures)
        # the cached epochs count only the MTP layer and head: fewer FLOPs per step than the first epoch
        assert shape["runs"]["cached_epochs"]["model_tflop_per_step"] < shape["runs"]["first_epoch"][
            "model_tflop_per_step"]
        # the first epoch writes every sample once (the tiny shape: 64 fp32 hidden values a token)
        assert shape["cache"]["writes"] == shape["cache"]["reads"] > 0 and shape["cache"]["frozen_bit_identical"]
        assert shape["trunk_graphs"] == ([{"warmups": 1, "captures": 1, "replays": 6, "eager": {}}]
                                         if torch.cuda.is_available() else [])  # 2 steps x 4 microbatches
        assert shape["figures"]["cache_bytes_per_token"] == 64 * 4
        assert shape["figures"]["cache_disk_bytes_per_token"] >= 256
        # the cached fit's first step is the reference run's first step (same weights, same tokens): the same MTP
        # loss (its lm_loss is computed only on the steps that log it)
        assert shape["losses"]["cached_fit_mtp"][0] == pytest.approx(shape["losses"]["reference_mtp"][0], abs=1e-5)
        # the fit's last step (a cached one) profiled: the cache's planning and the cached forward, no trunk
        assert {"## trunk cache plan", "## cached forward"} <= set(shape["cached_profile"]["ranges_cpu_ms"])
    assert not list(Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}trunk_cache_*"))  # the cache removed
