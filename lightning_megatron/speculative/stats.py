"""Intervals over prompts for the speculative-decoding figures, and paired differences between two heads.

Every figure is a ratio of sums over prompts: acceptance is accepted drafts / drafts, the mean accepted length
(verification steps + accepted drafts) / verification steps. The independent units are the prompts, not the
drafts (a prompt's drafts go together: a loop is accepted throughout, a hard passage rejected throughout), so the
interval is a bootstrap over prompts: resample the prompts with replacement (a fixed seed: the same figures give
the same interval), recompute the ratio, keep the middle 95% of the resampled ratios (percentile interval).

Two heads measured on the same prompts are compared paired: each resample takes the same prompts for both and
keeps the difference of their ratios. The pairing removes what the prompts share (an easy prompt is easy for both
heads), so a difference whose interval excludes zero is one these prompts support, and the paired interval is
narrower than the two heads' own intervals suggest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

RESAMPLES = 2000
SEED = 0
LEVEL = 0.95


@dataclass(frozen=True)
class Estimate:
    """A figure and its bootstrap interval; all None when no prompt had anything to count (no draft at all)."""

    value: float | None
    low: float | None
    high: float | None

    def excludes_zero(self) -> bool:
        return self.low is not None and self.high is not None and (self.low > 0 or self.high < 0)

    def as_dict(self) -> dict[str, float | None]:
        return {"value": self.value, "low": self.low, "high": self.high}


@dataclass(frozen=True)
class Counts:
    """One figure's numerator and denominator for each prompt, in the same prompt order for every head."""

    numerators: Sequence[float]
    denominators: Sequence[float]

    def __post_init__(self) -> None:
        if len(self.numerators) != len(self.denominators):
            raise ValueError(f"numerators ({len(self.numerators)}) and denominators ({len(self.denominators)}) "
                             "must give one count per prompt each")


def acceptance_counts(accepted: Sequence[int], drafts: Sequence[int]) -> Counts:
    """Acceptance (accepted drafts / drafts) from each prompt's counts."""
    return Counts(accepted, drafts)


def accepted_length_counts(accepted: Sequence[int], steps: Sequence[int]) -> Counts:
    """Mean accepted length (tokens decided per verification step) from each prompt's counts."""
    return Counts([a + s for a, s in zip(accepted, steps, strict=True)], steps)


def ratio_interval(counts: Counts, *, resamples: int = RESAMPLES, seed: int = SEED, level: float = LEVEL) -> Estimate:
    """The pooled ratio ``sum(numerators) / sum(denominators)`` and its bootstrap interval over prompts."""
    numerators, denominators = _arrays(counts)
    if denominators.sum() == 0:
        return Estimate(None, None, None)
    chosen = _resampled_prompts(len(denominators), resamples, seed)
    return _estimate(float(numerators.sum() / denominators.sum()), _ratios(numerators, denominators, chosen), level)


def paired_difference(first: Counts, second: Counts, *, resamples: int = RESAMPLES, seed: int = SEED,
                      level: float = LEVEL) -> Estimate:
    """``ratio(first) - ratio(second)`` for two heads on the same prompts, and its paired bootstrap interval."""
    first_num, first_den = _arrays(first)
    second_num, second_den = _arrays(second)
    if len(first_den) != len(second_den):
        raise ValueError(f"a paired comparison needs the same prompts for both heads: {len(first_den)} against "
                         f"{len(second_den)} prompts")
    if first_den.sum() == 0 or second_den.sum() == 0:
        return Estimate(None, None, None)
    chosen = _resampled_prompts(len(first_den), resamples, seed)
    value = float(first_num.sum() / first_den.sum() - second_num.sum() / second_den.sum())
    differences = _ratios(first_num, first_den, chosen) - _ratios(second_num, second_den, chosen)
    return _estimate(value, differences, level)


def _arrays(counts: Counts) -> tuple[np.ndarray, np.ndarray]:
    if len(counts.denominators) == 0:
        raise ValueError("no prompts: an interval over prompts needs at least one")
    return np.asarray(counts.numerators, dtype=np.float64), np.asarray(counts.denominators, dtype=np.float64)


def _resampled_prompts(prompts: int, resamples: int, seed: int) -> np.ndarray:
    """``[resamples, prompts]`` prompt indices, drawn with replacement."""
    return np.random.default_rng(seed).integers(0, prompts, size=(resamples, prompts))


def _ratios(numerators: np.ndarray, denominators: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """The ratio of each resample; NaN where its prompts have nothing to count."""
    totals = denominators[chosen].sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(totals > 0, numerators[chosen].sum(axis=1) / totals, np.nan)


def _estimate(value: float, resampled: np.ndarray, level: float) -> Estimate:
    tail = (1 - level) / 2 * 100
    low, high = np.nanpercentile(resampled, [tail, 100 - tail])
    return Estimate(value, float(low), float(high))
