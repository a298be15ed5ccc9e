"""The RL drift benchmark's CPU version, one policy round: every way of handling the draft head is measured by
speculative decoding on the held-out prompts, with its extra training time and the disk syncs it needs, with and
without deltas (a refresh's sync after the policy's is the MTP head alone); the statement names the cheapest way
within 0.02 of the converged head."""

import json
import os
from pathlib import Path

import pytest

from tests._background import Command

ROOT = Path(__file__).resolve().parents[2]
MTP_TENSORS = 15  # the tiny Qwen3 + MTP head: eh_proj, 3 norms, one decoder layer's 11 tensors


def _env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}


# started when the session starts (tests/_background.py), after the quality recipe: about three minutes on one core
EARLY_RUNS = {"mtp_drift": Command(
    "test_the_drift_benchmark_measures_every_way_each_round_with_its_cost",
    lambda folder: ["lightning_megatron.recipes.mtp_drift", str(folder / "out"), "--size", "cpu", "--rounds", "1"],
    _env, ROOT, timeout=900)}


@pytest.mark.slow
def test_the_drift_benchmark_measures_every_way_each_round_with_its_cost(early_runs) -> None:
    from lightning_megatron.recipes.mtp_drift import CONVERGED, WAYS

    completed, folder = early_runs.result("mtp_drift")
    out = folder / "out"
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    summary = json.loads((out / "mtp_drift.json").read_text())
    assert summary["rounds_done"] == summary["rounds"] == 1
    first, round_one = summary["per_round"]
    assert (first["round"], round_one["round"]) == (0, 1)
    for way in (*WAYS, CONVERGED):
        for mode in ("greedy", "sampled"):
            value = round_one["acceptance"][way][f"{mode}_acceptance"]
            low, high = round_one["acceptance"][way][f"{mode}_acceptance_interval"]
            assert 0 <= low <= value <= high <= 1, (way, mode)
    assert round_one["extra_train_s"]["frozen"] == round_one["extra_train_s"]["best_loss_frozen"] == 0
    assert round_one["extra_train_s"]["refresh"] > 0
    syncs = round_one["syncs"]
    policy_sync, head_sync = syncs["refresh"]  # the policy's new trunk, then the refreshed head alone
    assert head_sync["changed_tensors"] == MTP_TENSORS and head_sync["delta_bytes"] < policy_sync["delta_bytes"]
    assert policy_sync["changed_tensors"] == syncs["frozen"][0]["changed_tensors"]  # the trunk, not the head
    assert syncs["joint"][0]["delta_bytes"] == syncs["joint"][0]["full_bytes"]  # trunk and head both moved
    statement = summary["statement"]
    assert set(statement["ways"]) == set(WAYS)
    assert statement["cheapest_within_tolerance"] in (None, *statement["within_tolerance"])
    assert statement["within_tolerance"] == [way for way in WAYS
                                             if statement["ways"][way]["largest_shortfall"] <= 0.02]
    assert (out / "mtp_drift.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("flags", [["--rounds", "0"], ["--refresh-steps", "0"], ["--converged-steps", "-2"]])
def test_a_count_below_one_is_refused_naming_its_flag_before_anything_runs(tmp_path, capsys, flags) -> None:
    """0 is not "the size's default" (which leaving the flag out gives)."""
    from lightning_megatron.recipes.mtp_drift import main

    with pytest.raises(SystemExit) as exited:
        main([str(tmp_path / "out"), "--size", "cpu", *flags])
    assert exited.value.code == 2
    assert f"{flags[0]}: {flags[1]} must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
