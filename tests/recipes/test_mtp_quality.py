"""The MTP quality benchmark's CPU version: a head lost by an export without MTP and restored at random is
recovered by MTP-only training, by self-distillation and by the TV loss on the corpus and by hard labels on the
model's own continuations, all through `lightning-megatron`; every figure with its interval over prompts, and
paired comparisons between the heads."""

import json
import os
from pathlib import Path

import pytest

from tests._background import Command

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}


# started when the session starts (tests/_background.py): it runs about two minutes, mostly on one core
EARLY_RUNS = {"mtp_quality": Command(
    "test_mtp_only_training_recovers_the_acceptance_a_reset_head_lost",
    lambda folder: ["lightning_megatron.recipes.mtp_quality", str(folder / "out"), "--size", "cpu"], _env, ROOT,
    timeout=600)}


@pytest.mark.slow
def test_mtp_only_training_recovers_the_acceptance_a_reset_head_lost(early_runs) -> None:
    completed, folder = early_runs.result("mtp_quality")
    out = folder / "out"
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    summary = json.loads((out / "mtp_quality.json").read_text())
    heads = summary["heads"]
    for variant in ("self_distill", "labels_continuations", "tv"):
        assert heads["reset"]["greedy_acceptance"] < heads[variant]["greedy_acceptance"]
        if variant != "labels_continuations":  # (c)'s hard labels sample no better than the random head: on these
            # 8 prompts each lies within the other's interval (0.35 and 0.40 in one run)
            assert heads["reset"]["sampled_acceptance"] < heads[variant]["sampled_acceptance"]
        for k in (1, 2, 3, 4):
            low, high = heads[variant][f"sampled_accepted_length_k{k}_interval"]
            assert 1 <= low <= heads[variant][f"sampled_accepted_length_k{k}"] <= high <= k + 1
        assert heads[variant]["train_s_including_generation"] > 0
        for which in ("every_position", "drafted"):  # alpha on the head's own decoded texts, beside the rate
            assert 0 < heads[variant][f"sampled_teacher_forced_{which}"] < 1
        difference = summary["comparisons"][f"{variant} - joint"]["sampled_acceptance"]
        assert difference["low"] <= difference["value"] <= difference["high"]
    assert heads["reset"]["greedy_acceptance"] < 0.05 < heads["joint"]["greedy_acceptance"]
    assert set(summary["targets"]) == {"self_distill_greedy_at_least_continuations",
                                       "self_distill_sampled_beats_continuations", "self_distill_greedy_over_joint",
                                       "tv_best", "tv_best_sampled_at_least_target",
                                       "tv_best_sampled_above_self_distill_paired",
                                       "tv_best_greedy_within_or_above_continuations"}
    for variant in ("self_distill", "labels_continuations", "tv"):  # validated every 10 of 30 steps
        assert len(summary["val_mtp_acceptance_by_step"][variant]) == 3
        assert len(summary["val_mtp_sampled_acceptance_by_step"][variant]) == 3
    assert summary["greedy_identical_throughout"] and summary["frozen_bit_identical"]
    assert (out / "mtp_quality.png").read_bytes()[:4] == b"\x89PNG"


def test_the_targets_compare_each_self_distilled_head_that_ran_with_the_heads_that_ran() -> None:
    """`--variants` runs a subset: (a+) is held to (c)'s targets when (c) ran, and to the joint head's always."""
    from lightning_megatron.recipes.mtp_quality import LONG_VARIANT, _targets

    def head(greedy: float, sampled: float) -> dict[str, float]:
        return {"greedy_acceptance": greedy, "sampled_acceptance": sampled}

    joint, c = head(0.7, 0.6), head(0.85, 0.48)
    assert _targets({"joint": joint, LONG_VARIANT: head(0.86, 0.7), "labels_continuations": c}) == {
        f"{LONG_VARIANT}_greedy_at_least_continuations": True, f"{LONG_VARIANT}_sampled_beats_continuations": True,
        f"{LONG_VARIANT}_greedy_over_joint": pytest.approx(0.86 / 0.7)}
    assert _targets({"joint": joint, LONG_VARIANT: head(0.8, 0.4)}) == {
        f"{LONG_VARIANT}_greedy_over_joint": pytest.approx(0.8 / 0.7)}
    assert _targets({"joint": joint, "self_distill": head(0.8, 0.4), "labels_continuations": c}) == {
        "self_distill_greedy_at_least_continuations": False, "self_distill_sampled_beats_continuations": False,
        "self_distill_greedy_over_joint": pytest.approx(0.8 / 0.7)}


@pytest.mark.parametrize(("argv", "message"), [
    (["--mtp-only-steps", "-1"], "--mtp-only-steps: -1 must be at least 1"),
    (["--joint-steps", "0"], "--joint-steps: 0 must be at least 1"),
    (["--distill-temperature", "0"], "--distill-temperature: 0.0 must be finite and > 0"),
    (["--distill-temperature", "0.5", "--variants", "tv", "labels_continuations"],
     "--distill-temperature 0.5 is (a)'s and (a+)'s teacher temperature, and neither runs"),
    (["--distill-weighting", "greedy", "--variants", "labels_corpus"], "--distill-weighting greedy weighs"),
    (["--sample-prompts", "0", "--variants", "self_distill_sampled"], "--sample-prompts: 0 must be at least 1"),
    (["--sample-prompts", "4096", "--variants", "self_distill", "tv"],
     "--sample-prompts 4096 sizes the generated data, and no variant trained on it runs"),
])
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, capsys, argv, message) -> None:
    from lightning_megatron.recipes.mtp_quality import main

    with pytest.raises(SystemExit):
        main([str(tmp_path / "out"), "--size", "cpu", *argv])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_recipe_quiets_what_the_package_handles_before_it_runs(tmp_path, capsys) -> None:
    from lightning_megatron._compat import quiet
    from lightning_megatron.recipes.mtp_quality import main

    active = [adjustment for adjustment in quiet.ADJUSTMENTS if adjustment.active]
    for adjustment in active:
        adjustment.revert()
    try:
        with pytest.raises(SystemExit):
            main([str(tmp_path / "out"), "--size", "cpu", "--joint-steps", "0"])
        assert [one.name for one in quiet.ADJUSTMENTS if one.needed() and not one.active] == []
    finally:
        for adjustment in active:
            adjustment.apply()
