"""The bootstrap over prompts on synthetic counts: an interval holds the mean the counts were drawn around, a paired
difference of a shifted head excludes zero and of an identical one is zero, and the same seed gives the same
interval."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_megatron.speculative.stats import (
    Counts,
    Estimate,
    acceptance_counts,
    accepted_length_counts,
    paired_difference,
    ratio_interval,
)

PROMPTS = 64


def _head(rate: float, seed: int) -> tuple[list[int], list[int]]:
    """Per-prompt accepted drafts and drafts: each prompt's own difficulty around ``rate``, as real prompts vary."""
    rng = np.random.default_rng(seed)
    drafts = rng.integers(40, 80, size=PROMPTS)
    difficulty = np.clip(rate + rng.normal(0, 0.1, size=PROMPTS), 0, 1)
    return rng.binomial(drafts, difficulty).tolist(), drafts.tolist()


def test_the_interval_holds_the_pooled_ratio_and_the_rate_the_counts_were_drawn_around():
    accepted, drafts = _head(0.7, seed=1)
    estimate = ratio_interval(acceptance_counts(accepted, drafts))
    assert estimate.value == pytest.approx(sum(accepted) / sum(drafts))
    assert estimate.low < 0.7 < estimate.high and estimate.low < estimate.value < estimate.high
    assert 0.01 < estimate.high - estimate.low < 0.1  # 64 prompts pin the rate to a few hundredths
    assert ratio_interval(acceptance_counts(accepted, drafts)) == estimate  # a fixed seed: the same interval
    few = ratio_interval(acceptance_counts(accepted[:8], drafts[:8]))
    assert few.high - few.low > estimate.high - estimate.low  # fewer prompts, a wider interval


def test_the_mean_accepted_length_is_steps_plus_accepted_over_steps():
    estimate = ratio_interval(accepted_length_counts([3, 0, 5], [4, 2, 5]))
    assert estimate.value == pytest.approx((8 + 11) / 11)
    assert 1.0 <= estimate.low <= estimate.value <= estimate.high <= 2.0


def test_a_shifted_head_differs_and_an_identical_one_does_not():
    accepted, drafts = _head(0.7, seed=2)
    better = [min(a + max(1, d // 20), d) for a, d in zip(accepted, drafts)]  # about 0.05 more on every prompt
    shifted = paired_difference(acceptance_counts(better, drafts), acceptance_counts(accepted, drafts))
    assert shifted.value > 0 and shifted.excludes_zero()
    # unpaired, the two heads' own intervals overlap: the pairing is what shows the difference
    assert ratio_interval(acceptance_counts(better, drafts)).low < ratio_interval(
        acceptance_counts(accepted, drafts)).high
    same = paired_difference(acceptance_counts(accepted, drafts), acceptance_counts(list(accepted), drafts))
    assert same == Estimate(0.0, 0.0, 0.0) and not same.excludes_zero()
    other_accepted, other_drafts = _head(0.7, seed=3)  # another head of the same quality on the same prompts
    noise = paired_difference(acceptance_counts(other_accepted, other_drafts), acceptance_counts(accepted, drafts))
    assert noise.low < 0 < noise.high


def test_nothing_to_count_and_mismatched_prompts_are_named():
    assert ratio_interval(acceptance_counts([0, 0], [0, 0])) == Estimate(None, None, None)
    with pytest.raises(ValueError, match="one count per prompt"):
        Counts([1, 2], [3])
    with pytest.raises(ValueError, match="the same prompts for both heads: 2 against 3"):
        paired_difference(acceptance_counts([1, 2], [3, 3]), acceptance_counts([1, 2, 3], [3, 3, 3]))
    with pytest.raises(ValueError, match="no prompts"):
        ratio_interval(acceptance_counts([], []))
