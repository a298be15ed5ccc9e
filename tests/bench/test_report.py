"""`bench.report` turns the benchmarks' JSON into tables, each figure against its target, and names no folder of
the machine that measured; the GPU driver that writes that JSON (`bench/run_h200.sh`) runs only scripts that exist."""

import json
import re
import subprocess
from pathlib import Path

from bench import report

ROOT = Path(__file__).resolve().parents[2]


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
    switched = report.render([("a.json", {**_lightning_overhead_result("NVIDIA H200"),
                                          "switches": {"LIGHTNING_MEGATRON_FAST_SWIGLU": "0"}})])
    assert "- [1] `a.json`: `LIGHTNING_MEGATRON_FAST_SWIGLU=0 python3 -m bench.lightning_overhead`;" in switched
    assert "(skipped, not a known benchmark: notes.json)" in text
    # our joint step is set beside plain HF only when both ran on the same device
    elsewhere = report.render([("a.json", _lightning_overhead_result("cpu")), ("b.json", h200_attention)])
    assert "ours (joint, with MTP)" not in elsewhere


def test_report_tables_the_mtp_memory_benchmark():
    def figures(step_s: float, memory: float) -> dict:
        return {"step_s": step_s, "tokens_per_s": 16384 / step_s, "mfu": None, "peak_memory_gib": memory}

    data = {"benchmark": "mtp_memory", "command": "python3 -m bench.mtp_memory", "device": "NVIDIA H200",
            "shapes": {
                "qwen3_0.6b": {"runs": {"joint": figures(0.5, 25.0), "mtp_only": figures(0.2, 5.0),
                                        "plain_mtp_only": figures(0.3, 9.0)},
                               "figures": {"mtp_only_over_joint_peak_memory": 0.2,
                                           "mtp_only_over_joint_step_time": 0.4,
                                           "mtp_only_over_plain_mtp_only_peak_memory": 5 / 9,
                                           "mtp_only_over_plain_mtp_only_step_time": 2 / 3},
                               "targets": {"mtp_only_over_joint_peak_memory": 0.25,
                                           "mtp_only_over_joint_step_time": 0.42}},
                "qwen3_8b": {"runs": {"mtp_only": figures(0.35, 20.0), "plain_mtp_only": figures(0.6, 23.6)},
                             "figures": {"mtp_only_peak_memory_gib": 20.0, "mtp_only_step_s": 0.35},
                             "targets": {"mtp_only_peak_memory_gib": 23.6, "mtp_only_step_s": 0.348}}}}
    lines = report.render([("m.json", data)]).splitlines()
    mtp_only = next(line for line in lines if line.startswith("| Qwen3-0.6B: lightning_megatron, MTP-only"))
    assert "| 0.200 s |" in mtp_only and "| 5.0 GiB |" in mtp_only
    assert ("0.400x joint step time, 0.200x joint peak memory, 0.667x plain loop's step time, 0.556x plain loop's "
            "peak memory") in mtp_only
    assert any(line.startswith("| Qwen3-8B: plain Megatron-Core MTP-only loop") for line in lines)
    assert "| P2 Qwen3-0.6B MTP-only / joint peak memory | 0.200x | <= 0.25x | yes | [1] |" in lines
    assert "| P2 Qwen3-8B MTP-only peak memory | 20.0 GiB | <= 23.6 GiB | yes | [1] |" in lines
    assert "| P2 Qwen3-8B MTP-only step time | 0.350 s | <= 0.348 s | no | [1] |" in lines


def test_report_tables_the_families_benchmark():
    def figures(step_s: float, memory: float) -> dict:
        return {"step_s": step_s, "tokens_per_s": 8192 / step_s, "mfu": 0.2, "peak_memory_gib": memory}

    targets = {"mtp_only_over_plain_mtp_only_step_time": 0.95, "mtp_only_over_plain_mtp_only_peak_memory": 1.0}
    data = {"benchmark": "families", "command": "python3 -m bench.families", "device": "NVIDIA H200", "shapes": {
        "glm4_5_air": {"label": "GLM-4.5-Air, first 17 of 46 layers (MTP-only fits)", "targets": targets,
                       "runs": {"mtp_only": figures(0.9, 110.0), "plain_mtp_only": figures(1.0, 112.0)},
                       "figures": {"mtp_only_over_plain_mtp_only_step_time": 0.9,
                                   "mtp_only_over_plain_mtp_only_peak_memory": 110 / 112,
                                   "mtp_only_over_plain_mtp_only_peak_reserved": 0.93}},
        "glm4_5_air_joint": {"label": "GLM-4.5-Air (joint)", "skipped": "no cut fits joint training"}},
        "gdn": {"layer": {"hidden": 2048, "key_heads": 16, "value_heads": 16, "value_head_dim": 128},
                "micro_batch": 2, "seq": 2048, "dtype": "bfloat16", "pytorch": {"forward_backward_s": 0.05},
                "fla": {"forward_backward_s": 0.005}, "pytorch_over_fla": 10.0,
                "difference": {"output": {"max_abs": 0.01, "pytorch_max_abs": 4.0},
                               "input_grad": {"max_abs": 0.02, "pytorch_max_abs": 8.0},
                               "in_proj_weight_grad": {"max_abs": 0.5, "pytorch_max_abs": 100.0}}}}
    lines = report.render([("f.json", data)]).splitlines()
    mtp_only = next(line for line in lines if line.startswith("| GLM-4.5-Air, first 17 of 46 layers (MTP-only fits): "
                                                              "lightning_megatron, MTP-only"))
    assert ("| 0.900 s | 9.1k | 20.0% | 110.0 GiB | 0.900x plain loop's step time, 0.982x plain loop's peak memory, "
            "0.930x plain loop's peak reserved") in mtp_only
    assert "| GLM-4.5-Air (joint) | no cut fits joint training |  |  |  |  | [1] |" in lines
    assert ("| issue 40 GLM-4.5-Air, first 17 of 46 layers (MTP-only fits) MTP-only / plain MTP-only loop step time "
            "| 0.900x | <= 0.95x | yes | [1] |") in lines
    assert ("| hidden 2048, 16/16 key/value heads of 128; 2 x 2048 tokens, bfloat16 | 0.050 s | 0.005 s | 10.000x | "
            "1.00e-02 of 4.00e+00 | 2.00e-02 of 8.00e+00 | 5.00e-01 of 1.00e+02 | [1] |") in lines



def test_report_tables_a_forward_only_gated_delta_net_comparison():  # fla refuses its backward (bench/gdn.py)
    gdn = {"layer": {"hidden": 2048, "key_heads": 16, "value_heads": 16, "value_head_dim": 128},
           "micro_batch": 2, "seq": 2048, "dtype": "bfloat16",
           "pytorch": {"forward_backward_s": 0.05, "forward_s": 0.02},
           "fla": {"forward_s": 0.004, "backward_skipped": "fla refuses the backward"},
           "pytorch_over_fla_forward": 5.0, "difference": {"output": {"max_abs": 0.01, "pytorch_max_abs": 4.0}}}
    lines = report.render([("g.json", {"benchmark": "gdn", "command": "python3 -m bench.gdn",
                                       "device": "NVIDIA H200", **gdn})]).splitlines()
    assert ("| hidden 2048, 16/16 key/value heads of 128; 2 x 2048 tokens, bfloat16 | 0.050 s | forward only: 0.004 s "
            "against PyTorch's 0.020 s (backward: fla refuses the backward) | 5.000x (forward) | 1.00e-02 of 4.00e+00 "
            "| n/a | n/a | [1] |") in lines

def test_report_tables_the_norms_benchmark():
    def arm(gpu_us: float) -> dict:
        return {"forward_backward_wall_us": 2 * gpu_us, "forward_backward_gpu_us": gpu_us,
                "max_abs_diff": {"output": 0.01, "input_grad": 0.02, "weight_grad": 0.5},
                "reference_max_abs": {"output": 4.0, "input_grad": 8.0, "weight_grad": 100.0}}

    arms = {"torch": arm(72.0), "compiled": arm(18.0), "aten_compiled_weight_grad": arm(30.0),
            "eager": arm(150.0)}
    norm = {"rows": 65536, "width": 128, "arms": arms}
    data = {"benchmark": "norms", "command": "python3 -m bench.norms", "device": "NVIDIA H200", "shapes": {
        "qwen3_0.6b": {"layers": 28, "norms": {"query": norm},
                       "per_microbatch": {"gpu_ms": {"torch": 9.0, "compiled": 3.0}, "compiled_over_torch": 1 / 3}}}}
    lines = report.render([("n.json", data)]).splitlines()
    assert ("| qwen3_0.6b query | 65536 x 128 | 72.0 us | 18.0 us | 30.0 us | 150.0 us | 0.250x | 1.0e-02 of 4.0e+00 "
            "/ 2.0e-02 of 8.0e+00 / 5.0e-01 of 1.0e+02 | [1] |") in lines
    assert "| qwen3_0.6b: a microbatch's norms | 28 layers | 9.00 ms | 3.00 ms | n/a | n/a | 0.333x |  | [1] |" in lines


def test_report_names_no_folder_of_the_machine_that_measured():
    command = "python3 -m bench.hf_io --checkpoint ckpt/qwen3-0.6b-mtp --repeats 3 --out runs/b/hf_io.json"
    assert report.portable(command) == (
        "python3 -m bench.hf_io --checkpoint $CHECKPOINT --repeats 3 --out $OUT/hf_io.json")
    driver = 'OUT=runs/b STEPS="tree" bash bench/run_h200.sh'
    assert report.portable(driver) == 'OUT=$OUT STEPS="tree" bash bench/run_h200.sh'


def test_report_tables_the_packing_layouts_and_their_targets():
    def layout(step_s: float, tokens: int, busy: float, graph_launches: int) -> dict:
        return {"step_s": step_s, "real_tokens_per_s": tokens / step_s, "gpu_busy_fraction": busy,
                "kernel_launch_calls": 100, "graph_launch_calls": graph_launches, "peak_memory_gib": 20.0}

    data = {"benchmark": "P5 packing", "command": "python3 -m bench.packing", "device": "NVIDIA H200",
            "layouts": {"full": layout(2.0, 80_000, 0.8, 0), "full_graph": layout(1.6, 80_000, 0.99, 1),
                        "packed_graph": layout(1.5, 76_000, 0.98, 1), "padded": {"error": "RuntimeError: oom\nmore"}},
            "summary": {"target_packed_over_full": 0.95, "target_packed_over_padded": 1.72,
                        "target_full_tokens_per_s": 45_000, "target_full_gpu_busy_fraction": 0.9,
                        "packed_graph_over_fastest_full_tokens_per_s": 1.013, "packed_over_full_tokens_per_s": 0.7,
                        "gpu_busy_fraction": {"full_graph": 0.99}}}
    lines = report.render([("packing.json", data)]).splitlines()
    assert "| `packed_graph` | 1.500 s | 50.7k | 1.267x | 98.0% | 100 | 1 | 20.0 GiB | [1] |" in lines
    assert "| `padded` | RuntimeError: oom |  |  |  |  |  |  | [1] |" in lines
    assert "| P5 packed (graphed) / the faster full rows, real tokens/s | 1.013x | >= 0.950x | yes | [1] |" in lines
    assert "| P5 packed / full rows, real tokens/s (eager) | 0.700x | >= 0.950x | no | [1] |" in lines
    assert "| P5 full rows (graphed), tokens/s | 50.0k | >= 45.0k | yes | [1] |" in lines
    assert "| P5 full rows (graphed), GPU busy | 99.0% | >= 90.0% | yes | [1] |" in lines


def test_the_gpu_driver_runs_only_scripts_that_exist():
    script = (ROOT / "bench/run_h200.sh").read_text()
    modules = re.findall(r"python3 -m (bench\.\w+)", script)
    assert {"bench.make_checkpoint", "bench.lightning_overhead", "bench.hf_io", "bench.attention",
            "bench.report"} <= set(modules)
    assert all((ROOT / (module.replace(".", "/") + ".py")).is_file() for module in modules)
    assert subprocess.run(["bash", "-n", str(ROOT / "bench/run_h200.sh")]).returncode == 0


def _weight_sync_result(delta: dict) -> dict:
    sync = {"disk_sync_vs_raw_write": 1.1, "colocated_vs_disk_round_trip": 0.05, "colocated_sync_s": 0.18,
            "colocated_extra_sender_memory_bytes": None}
    targets = {"disk_sync_vs_raw_write": 1.2, "colocated_vs_disk_round_trip": 0.25, "colocated_sync_s": 2.0,
               "step_time_ratio": 1.01, "delta_vs_full_disk": 0.05, "delta_vs_full_colocated": 0.05,
               "lora_adapter_vs_merged_disk": 0.01, "lora_adapter_vs_full_disk": 0.01}
    return {"benchmark": "weight_sync", "device": "NVIDIA H100", "sync": sync, "targets": targets,
            "steps_between_syncs": {"step_time_ratio": 1.0}, "delta": delta}


def test_report_tables_the_adapter_sync_against_the_lora_runs_merged_sync_and_the_plain_one():
    """The LoRA run's own full sync (merged) is the adapter form's target; the plain model's stays beside it,
    labelled. Results from before the merged baseline table the plain one only."""
    delta = {"delta_vs_full_disk": 0.04, "delta_vs_full_colocated": 0.06, "lora_adapter_vs_merged_disk": 0.009,
             "lora_adapter_vs_full_disk": 0.011}
    lines = report.targets_table([("new.json", _weight_sync_result(delta))], {"new.json": 1})
    assert "| P7 MTP-only delta / full sync, disk | 0.040x | <= 0.05x | yes | [1] |" in lines
    assert "| P7 MTP-only delta / full sync, colocated | 0.060x | <= 0.05x | no | [1] |" in lines
    assert ("| P7 LoRA adapter-only / the LoRA run's full (merged) sync, disk, back to back | 0.009x | <= 0.01x | yes "
            "| [1] |" in lines)
    assert ("| P7 LoRA adapter-only / the plain model's full sync, disk (reference) | 0.011x | <= 0.01x | no | [1] |"
            in lines)
    del delta["lora_adapter_vs_merged_disk"]
    older = report.targets_table([("old.json", _weight_sync_result(delta))], {"old.json": 1})
    assert not any("merged" in line for line in older) and any("plain model's full sync" in line for line in older)


def test_report_tables_a_delta_only_weight_sync_run():
    """`bench.weight_sync --parts delta` has no full-sync or step-time part: only the delta rows, the adapter syncs
    spaced by steps among them."""
    result = _weight_sync_result({"delta_vs_full_disk": 0.014, "delta_vs_full_colocated": 0.039,
                                  "lora_adapter_vs_merged_disk": 0.043, "lora_adapter_vs_full_disk": 0.015,
                                  "lora_adapter_between_steps_vs_merged_disk": 0.0059})
    del result["sync"], result["steps_between_syncs"]
    result["targets"]["lora_adapter_between_steps_vs_merged_disk"] = 0.01
    lines = report.targets_table([("delta.json", result)], {"delta.json": 1})
    assert not any("raw write" in line or "step time" in line for line in lines)
    assert ("| P7 LoRA adapter-only / merged sync, disk, each sync after 0.5 s of steps | 0.006x | <= 0.01x | yes "
            "| [1] |" in lines)
