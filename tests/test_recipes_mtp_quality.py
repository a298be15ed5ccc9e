"""The MTP quality benchmark's CPU version: a head lost by an export without MTP and restored at random is
recovered by MTP-only training on the model's own continuations, all through `lightning-megatron`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_mtp_only_training_recovers_the_acceptance_a_reset_head_lost(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}
    completed = subprocess.run([sys.executable, "-m", "lightning_megatron.recipes.mtp_quality", str(tmp_path),
                                "--size", "cpu"], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    summary = json.loads((tmp_path / "mtp_quality.json").read_text())
    acceptance = summary["acceptance"]
    assert acceptance["A_reset"] < acceptance["A_recovered"]
    assert acceptance["A_reset"] < 0.05 < acceptance["A_joint"]
    assert summary["greedy_identical_throughout"] and summary["frozen_bit_identical"]
    assert (tmp_path / "mtp_quality.png").read_bytes()[:4] == b"\x89PNG"
