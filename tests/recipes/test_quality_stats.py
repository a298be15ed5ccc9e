"""The quality benchmark's figures from real speculative-decoding reports of a tiny model: every figure with an
interval that holds it, paired comparisons between heads on the same prompts (zero for a head against itself),
issue 42's TV targets, and the figure."""

from __future__ import annotations

import io

import pytest
from transformers import AutoTokenizer

from lightning_megatron.recipes.mtp_quality import _depth_targets, _table, _tv_targets
from lightning_megatron.recipes.quality_report import comparisons, head_row, plot
from lightning_megatron.speculative import load_mtp_head, load_target, measure
from lightning_megatron.speculative.report import encode_prompt, eos_token_ids
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from tests.speculative.test_batched import _repeat_drafter
from tests.speculative.test_speculative import one_thread

__all__ = ["one_thread"]  # the fixture (autouse), shared with test_speculative

PROMPTS = ["def add(a, b):", "import os\n", "class Tree:", "for i in range(10):", "while True:", "x = [1, 2, 3]"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Two heads' report summaries on the same prompts: the stored random head and one that repeats the target's
    next token (accepted in the tiny model's loops)."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("quality") / "qwen3", "qwen3", mtp=True)
    target = load_target(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [encode_prompt(tokenizer, prompt) for prompt in PROMPTS]
    eos = eos_token_ids(path, tokenizer)
    return {name: measure(target, head, prompts, 12, eos, draft_tokens=(1, 2), batch_size=4)["summary"]
            for name, head in (("self_distill", load_mtp_head(path, target)), ("tv", _repeat_drafter(path, target)))}


def test_every_figure_has_an_interval_that_holds_it(results):
    row = head_row(results["tv"])
    figures = ["greedy_acceptance", "sampled_acceptance", "greedy_accepted_length_k1", "greedy_accepted_length_k2",
               "sampled_accepted_length_k1", "sampled_accepted_length_k2"]
    for figure in figures:
        low, high = row[f"{figure}_interval"]
        assert low <= row[figure] <= high
    assert row["greedy_acceptance"] == results["tv"]["acceptance_rate"]
    assert row["sampled_accepted_length_k2"] == results["tv"]["by_draft_tokens"]["sampled"]["2"]["mean_accepted_length"]
    assert 1 <= row["greedy_accepted_length_k1"] <= 2 and 1 <= row["sampled_accepted_length_k2"] <= 3


def test_paired_comparisons_between_heads_on_the_same_prompts(results):
    compared = comparisons({"joint": results["self_distill"], **results})
    assert set(compared) == {"tv - self_distill", "self_distill - joint", "tv - joint"}
    for figure, difference in compared["tv - self_distill"].items():
        mine, theirs = head_row(results["tv"])[figure], head_row(results["self_distill"])[figure]
        assert difference["value"] == pytest.approx(mine - theirs)
        assert difference["low"] <= difference["value"] <= difference["high"]
    assert all(difference == {"value": 0.0, "low": 0.0, "high": 0.0}
               for difference in compared["self_distill - joint"].values())  # the same head twice


def test_the_tv_targets_take_the_better_tv_head():
    def head(greedy: float, sampled: float, greedy_interval: list[float]) -> dict:
        return {"greedy_acceptance": greedy, "sampled_acceptance": sampled,
                "greedy_acceptance_interval": greedy_interval}

    heads = {"tv": head(0.80, 0.84, [0.75, 0.85]), "tv_kl": head(0.82, 0.80, [0.78, 0.86]),
             "labels_continuations": head(0.85, 0.48, [0.81, 0.89])}
    compared = {"tv - self_distill": {"sampled_acceptance": {"value": 0.05, "low": 0.01, "high": 0.09}}}
    assert _tv_targets(heads, compared) == {
        "tv_best": "tv", "tv_best_sampled_at_least_target": True, "tv_best_sampled_above_self_distill_paired": True,
        "tv_best_greedy_within_or_above_continuations": False}
    assert _tv_targets({"labels_continuations": heads["labels_continuations"]}, {}) == {}


def test_each_k_depth_head_meets_its_own_loss_at_depth_one(results):
    """tv_kl_k3 is judged against tv_kl, not against tv; a K-depth head whose depth-1 run is absent gets only the
    length target."""
    heads = {"tv_kl_k3": {"sampled_accepted_length_k3": 2.75}, "tv_kl": {"sampled_accepted_length_k3": 2.60},
             "self_distill_k3": {"sampled_accepted_length_k3": 2.65}}
    compared = {"tv_kl_k3 - tv_kl": {"sampled_accepted_length_k3": {"value": 0.15, "low": 0.04, "high": 0.26}},
                "tv_kl_k3 - tv": {"sampled_accepted_length_k3": {"value": -0.1, "low": -0.2, "high": -0.01}}}
    assert _depth_targets(heads, compared) == {
        "tv_kl_k3_sampled_length_k3_at_least_target": True, "tv_kl_k3_sampled_length_k3_above_tv_kl_paired": True,
        "self_distill_k3_sampled_length_k3_at_least_target": False}
    assert "tv_kl_k3 - tv_kl" in comparisons({"tv_kl": results["tv"], "tv_kl_k3": results["self_distill"]})


def test_the_figure_and_the_table(results):
    heads = {name: head_row(result) for name, result in results.items()}
    summary = {"heads": heads, "measure": {"prompts": len(PROMPTS), "draft_tokens": [1, 2]},
               "val_mtp_acceptance_by_step": {"tv": [(10, 0.2), (20, 0.3)]},
               "val_mtp_sampled_acceptance_by_step": {"tv": [(10, 0.5), (20, 0.6)]}}
    buffer = io.BytesIO()
    plot(summary).savefig(buffer, format="png")
    assert buffer.getvalue()[:4] == b"\x89PNG"
    table = _table(summary)
    assert table.count("\n") == 1 + len(heads) and f"{heads['tv']['greedy_acceptance']:.3f} [" in table
