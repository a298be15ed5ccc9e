"""Every benchmark script still runs, in its tiny CPU mode, and prints the JSON it promises."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_hf_io_benchmark_runs_tiny():
    completed = subprocess.run([sys.executable, "bench/hf_io.py", "--repeats", "1"], cwd=ROOT, capture_output=True,
                               text=True, timeout=300, check=True)
    result = json.loads(completed.stdout[completed.stdout.index("{\n"):])
    assert set(result["bridges"]) == {"mbridge", "megatron-bridge"}
    for timings in result["bridges"].values():
        assert timings["build_and_load_s"] > 0 and timings["save_s"] > 0
