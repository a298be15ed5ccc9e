"""The MTP quality benchmark's figures: each head's row with 95% intervals over prompts, the paired comparisons
between heads (the same held-out prompts, and for sampled runs the same seed per prompt, for every head), and the
figure `mtp_quality.png`.

Every figure comes from the per-prompt counts of the speculative-decoding report (`by_draft_tokens.<mode>.<K>.
per_prompt`); intervals and paired differences are `lightning_megatron.speculative.stats`' bootstrap over prompts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from lightning_megatron.speculative.stats import (
    Counts,
    acceptance_counts,
    accepted_length_counts,
    paired_difference,
    ratio_interval,
)

# the heads every trained head is compared with, where they ran: the blend and TV at depth 1 (what their K-depth
# training is measured against), (a) (likewise), (c) and the jointly trained head
REFERENCES = ("tv_kl", "tv", "self_distill", "labels_continuations", "joint")
NOT_COMPARED = ("reset",)  # a random head: every trained head beats it, and the report says by how much anyway


def _acceptance(per_prompt: dict[str, list[int]]) -> Counts:
    return acceptance_counts(per_prompt["accepted"], per_prompt["drafts"])


def _length(per_prompt: dict[str, list[int]]) -> Counts:
    return accepted_length_counts(per_prompt["accepted"], per_prompt["verification_steps"])


def figures(result: dict[str, Any]) -> dict[str, tuple[str, str, Callable[[dict[str, list[int]]], Counts]]]:
    """The figures of one head's report: name -> (mode, K, counts of a per-prompt record). Acceptance with one
    draft (greedy and sampled) and the mean accepted length for every K measured."""
    by_k = result["by_draft_tokens"]
    table = {"greedy_acceptance": ("greedy", "1", _acceptance), "sampled_acceptance": ("sampled", "1", _acceptance)}
    for mode in ("greedy", "sampled"):
        for k in by_k[mode]:
            table[f"{mode}_accepted_length_k{k}"] = (mode, k, _length)
    return table


def head_row(result: dict[str, Any]) -> dict[str, Any]:
    """One head: each figure with its interval (``<figure>_interval``: [low, high]), the tokens/s, and where the
    report has them the teacher-forced acceptance of its decoded texts (``speculative.teacher_forced``)."""
    by_k = result["by_draft_tokens"]
    row: dict[str, Any] = {}
    for name, (mode, k, counts) in figures(result).items():
        estimate = ratio_interval(counts(by_k[mode][k]["per_prompt"]))
        row[name], row[f"{name}_interval"] = estimate.value, [estimate.low, estimate.high]
    row.update(greedy_tokens_per_s=result["greedy_tokens_per_s"],
               speculative_tokens_per_s=result["speculative_tokens_per_s"],
               sampled_tokens_per_s=result["sampled_tokens_per_s"])
    for mode in ("greedy", "sampled"):
        if "3" in by_k[mode]:
            row[f"{mode}_k3_tokens_per_s"] = by_k[mode]["3"]["tokens_per_s"]
        teacher_forced = by_k[mode].get("1", {}).get("teacher_forced")
        if teacher_forced is not None:  # alpha on the decoded texts: every position, and the drafted ones
            row[f"{mode}_teacher_forced_every_position"] = teacher_forced["every_position"]
            row[f"{mode}_teacher_forced_drafted"] = teacher_forced["drafted_positions"]
    return row


def comparisons(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """``"<head> - <reference>"`` -> figure -> the paired difference and its interval, on the figures both
    measured: every trained head against each of :data:`REFERENCES` that ran (a reference against the ones after
    it: tv - (a), (a) - (c), (a) - joint, ...)."""
    compared: dict[str, dict[str, dict[str, float | None]]] = {}
    for name, result in results.items():
        if name in NOT_COMPARED:
            continue
        later = REFERENCES[REFERENCES.index(name) + 1:] if name in REFERENCES else REFERENCES
        for reference in (reference for reference in later if reference in results):
            shared = figures(result).keys() & figures(results[reference]).keys()
            compared[f"{name} - {reference}"] = {
                figure: paired_difference(_counts(result, figure), _counts(results[reference], figure)).as_dict()
                for figure in sorted(shared)}
    return compared


def _counts(result: dict[str, Any], figure: str) -> Counts:
    mode, k, counts = figures(result)[figure]
    return counts(result["by_draft_tokens"][mode][k]["per_prompt"])


def plot(summary: dict[str, Any]):
    """Acceptance per head with its interval, the K = 1.. accepted-length curves, and validation acceptance by
    step. Uses the Agg canvas, no global backend."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(16, 4.5), layout="constrained")
    bars, curves, by_step = figure.subplots(1, 3)
    heads = summary["heads"]
    names = list(heads)
    width = 0.4
    for offset, mode, label in ((-width / 2, "greedy", "greedy"), (width / 2, "sampled", "sampled, T = 1")):
        values = [_number(heads[name][f"{mode}_acceptance"]) for name in names]
        bars.bar([i + offset for i in range(len(names))], values, width, label=label,
                 yerr=_error_bars(values, [heads[name][f"{mode}_acceptance_interval"] for name in names]), capsize=3)
    bars.set(xticks=list(range(len(names))), ylim=(0, 1), ylabel="accepted drafts / drafts (95% interval)",
             title=f"speculative decoding, {summary['measure']['prompts']} held-out prompts")
    bars.set_xticklabels(names, rotation=20, fontsize=7)
    bars.legend(fontsize=7)
    for index, name in enumerate(names):
        for mode, style in (("sampled", "-"), ("greedy", ":")):
            ks = sorted(int(key.rsplit("_k", 1)[1]) for key in heads[name]
                        if key.startswith(f"{mode}_accepted_length_k") and not key.endswith("_interval"))
            if len(ks) < 2:
                continue
            values = [_number(heads[name][f"{mode}_accepted_length_k{k}"]) for k in ks]
            curves.errorbar(ks, values, yerr=_error_bars(values, [heads[name][f"{mode}_accepted_length_k{k}_interval"]
                                                                   for k in ks]),
                            linestyle=style, marker="o", capsize=2, color=f"C{index}", label=f"{name} ({mode})")
    curves.set(xlabel="draft tokens per step K", xticks=summary["measure"]["draft_tokens"],
               ylabel="tokens per verification step (95% interval)",
               title="accepted length, solid: sampled T = 1, dotted: greedy")
    curves.legend(fontsize=6)
    for key, mode, style, marker in (("val_mtp_sampled_acceptance_by_step", "sampled", "-", "o"),
                                     ("val_mtp_acceptance_by_step", "greedy", ":", ".")):
        for name, curve in summary[key].items():
            if curve:  # each head in the colour the other panels give it
                x, y = zip(*curve)
                by_step.plot(x, y, marker=marker, linestyle=style, label=f"{name}: {mode} (teacher-forced)",
                             color=f"C{names.index(name)}" if name in names else None)
    by_step.set(xlabel="MTP-only optimizer step", ylabel="validation acceptance", ylim=(0, 1),
                title="MTP-only training from the reset head")
    by_step.legend(fontsize=6)
    return figure


def _number(value: float | None) -> float:
    """A figure to plot: NaN (no point) where nothing was counted (a head that drafted nothing)."""
    return math.nan if value is None else value


def _error_bars(values: Sequence[float], intervals: Sequence[list[float | None]]) -> list[list[float]]:
    """Matplotlib's ``[below, above]`` distances from the intervals (none where a figure has no interval)."""
    below = [value - low if low is not None else 0.0 for value, (low, _) in zip(values, intervals)]
    above = [high - value if high is not None else 0.0 for value, (_, high) in zip(values, intervals)]
    return [below, above]
