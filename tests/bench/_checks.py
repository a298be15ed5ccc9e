"""Checks the tiny benchmark runs of `test_bench.py` share: what every throughput figure holds, and one `sizes`
configuration's Lightning and plain runs."""

import pytest


def check_throughput(figures: dict) -> None:
    assert figures["step_s"] > 0 and figures["tokens_per_s"] > 0 and figures["model_tflop_per_step"] > 0
    assert figures["mfu"] is None and figures["peak_memory_gib"] is None  # on the CPU: no peak to divide by


def check_sizes_config(config: dict, name: str) -> None:
    """One configuration of a tiny `bench.sizes` run: each run's figures, CPU times and profile; both runs the same
    losses (the same random initialization, LoRA adapters too, rows and optimizer)."""
    assert config["settings"]["lightning_graphed"] is False and config["settings"]["real_tokens_per_step"] > 0
    (lightning,), (plain,) = config["runs"]["lightning"], config["runs"]["plain"]
    for run in (lightning, plain):
        check_throughput(run)
        steps = (run["losses"], run["step_times_s"], run["process_cpu_s"], run["main_thread_cpu_s"])
        assert [len(series) for series in steps] == [1 + 1 + 1] * 4  # warm-up, timed, profiled
        assert run["profile"]["gpu_busy_fraction"] is None and run["profile"]["top_cpu_ops"]
        assert 0 < run["main_thread_cpu_s_median"] <= run["process_cpu_s_median"]  # the process's holds the thread's
    assert lightning["losses"] == pytest.approx(plain["losses"], abs=1e-6), name
    assert lightning["adam"] == plain["adam"] == ["for-loop"], name  # the same Adam; on the CPU upstream's
    assert lightning["model_tflop_per_step"] == plain["model_tflop_per_step"]
    figures = config["figures"]["lightning"]
    assert figures["lightning_over_plain_step_time"] == pytest.approx(lightning["step_s"] / plain["step_s"])
    assert figures["first_loss_difference"] < 1e-6
