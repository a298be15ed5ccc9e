"""Every benchmark script still runs, in its tiny CPU mode, and prints the JSON it promises."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run_bench(script: str, *args: str) -> dict:
    # not the test process's own rendezvous port, which an earlier test's process group is listening on
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}
    completed = subprocess.run([sys.executable, script, *args], cwd=ROOT, capture_output=True, text=True,
                               timeout=300, env=env)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout[completed.stdout.index("{\n"):])


@pytest.mark.slow
def test_hf_io_benchmark_runs_tiny():
    result = _run_bench("bench/hf_io.py", "--repeats", "1")
    assert set(result["bridges"]) == {"mbridge", "megatron-bridge"}
    for timings in result["bridges"].values():
        assert timings["build_and_load_s"] > 0 and timings["save_s"] > 0


@pytest.mark.slow
def test_attention_benchmark_runs_tiny():
    result = _run_bench("bench/attention.py", "--tiny")
    assert set(result["megatron"]) == {"local", "sdpa"}
    for timings in [*result["megatron"].values(), result["hf_transformers_sdpa"]]:
        assert timings.keys() == {"step_s", "tokens_per_s", "peak_memory_gib", "last_loss"}
        assert timings["step_s"] > 0 and timings["tokens_per_s"] > 0
    # the same weights and tokens: both core attentions compute the same training step
    assert result["megatron"]["sdpa"]["last_loss"] == pytest.approx(result["megatron"]["local"]["last_loss"], abs=1e-4)
    assert result["sdpa_over_local_step_time"] > 0 and result["sdpa_over_hf_step_time"] > 0


@pytest.mark.slow
def test_plain_megatron_loop_runs_tiny():
    result = _run_bench("bench/megatron_loop.py", "--steps", "2")
    assert len(result["losses"]) == len(result["step_times_s"]) == 2
    assert all(loss > 0 for loss in result["losses"])
