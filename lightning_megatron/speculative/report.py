"""Measure speculative decoding against plain decoding on a set of prompts, and write the JSON report and a PNG.

Definitions used in the report:

* ``acceptance_rate``: accepted drafts / drafts.
* ``mean_accepted_length``: tokens decided per verification forward of the target, ``(steps + accepted) /
  steps`` (1.0 when no draft is ever accepted, ``K + 1`` when all are; the prefill forward is not a step).
* ``*_interval``: the figure's 95% bootstrap interval over prompts (``speculative.stats``).
* ``tokens_per_s``: new tokens / wall time of the whole pass over the prompts (prefill included), each decoder
  on the same prompts, ``batch_size`` prompts decoded at once, after one untimed warm-up.

The top-level fields are greedy decoding with one draft token. ``by_draft_tokens`` repeats the measurement for
``K`` drafts per step (the MTP head reapplied to its own output), greedy and sampled (speculative sampling at
``sampling``, prompt ``i`` seeded with ``seed + i``, so that its tokens do not depend on the batch it is decoded
in): ``acceptance_rate`` (accepted / drafted), ``mean_accepted_length`` (up to ``K + 1``), their intervals,
``tokens_per_s``, ``identical`` (greedy: every output equals plain greedy decoding's) and ``per_prompt`` (each
prompt's accepted drafts, drafts, verification steps and new tokens: what paired comparisons between heads read),
beside plain sampling's ``sampled_tokens_per_s``. With one draft per step, ``teacher_forced`` gives the expected
acceptance ``alpha = sum_x min(p, q)`` of the decoded texts themselves, the target and the head teacher-forced on
them: its mean over every position and over the drafted ones, which the measured rate estimates
(``speculative.teacher_forced``: how a rate below the validation metric splits into text and drafted positions).
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any, TextIO

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from lightning_megatron.atomic import write_file_atomically, write_text_atomically
from lightning_megatron.generate import eos_token_ids
from lightning_megatron.speculative.decode import Decoded, decode_batch
from lightning_megatron.speculative.mtp_head import MTPDraftHead, load_mtp_head, load_target, quiet_loading
from lightning_megatron.speculative.progress import Progress
from lightning_megatron.speculative.sampling import GREEDY, Sampling
from lightning_megatron.speculative.stats import acceptance_counts, accepted_length_counts, ratio_interval
from lightning_megatron.speculative.teacher_forced import teacher_forced_acceptance

DRAFT_TOKENS = (1, 2, 3)
BATCH_SIZE = 16  # prompts decoded at once

Prompt = str | list[dict[str, str]]
"""A plain text prompt, or chat messages ``[{"role": ..., "content": ...}, ...]``."""


def read_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a JSONL file whose rows are ``{"prompt": str}`` or ``{"messages": [{"role", "content"}, ...]}``."""
    prompts: list[Prompt] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            prompts.append(row["prompt"])
        elif isinstance(row, dict) and isinstance(row.get("messages"), list):
            prompts.append(row["messages"])
        else:
            raise ValueError(
                f"{path}:{number}: each row needs a 'prompt' string or a 'messages' list, got {line[:80]!r}"
            )
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> list[int]:
    """Token ids of a prompt: through the chat template, ending in the assistant's turn, when the tokenizer has one.

    A plain prompt is sent as one user message then; without a template it is tokenized as it is.
    """
    if tokenizer.chat_template is None:
        if not isinstance(prompt, str):
            raise ValueError("a 'messages' prompt needs a tokenizer with a chat template; this one has none")
        return tokenizer(prompt)["input_ids"]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def measure(
    target: PreTrainedModel,
    head: MTPDraftHead,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: Collection[int],
    tokenizer: PreTrainedTokenizerBase | None = None,
    *,
    draft_tokens: Sequence[int] = DRAFT_TOKENS,
    sampling: Sampling = Sampling(temperature=1.0),
    seed: int = 0,
    batch_size: int = BATCH_SIZE,
    progress: TextIO | None = None,
) -> dict[str, Any]:
    """Decode every prompt with each decoder, ``batch_size`` prompts at once; the per-prompt detail and the summary
    of the report. ``progress`` (e.g. ``sys.stderr``) gets a line per pass and every few seconds within one."""
    if not prompts:
        raise ValueError("prompts is empty")
    if batch_size < 1:
        raise ValueError(f"batch_size: {batch_size} must be at least 1")
    passes = _Passes(target, head, prompts, max_new_tokens, eos_token_ids, batch_size, seed,
                     Progress(progress, 2 + 2 * len(draft_tokens) - (1 in draft_tokens) + bool(draft_tokens),
                              len(prompts)))
    passes.warm_up(max(draft_tokens, default=1))
    greedy, greedy_seconds = passes.run("plain greedy", 0, GREEDY)
    speculative, speculative_seconds = passes.run("speculative greedy, K=1", 1, GREEDY)
    rows = []
    for index, (prompt_ids, plain, drafted) in enumerate(zip(prompts, greedy, speculative, strict=True)):
        row = {"index": index, "prompt_tokens": len(prompt_ids), "identical": drafted.tokens == plain.tokens}
        row.update((key, value) for key, value in _speculative_statistics([drafted], drafted.seconds).items()
                   if not key.endswith("_interval"))  # an interval over one prompt says nothing
        row.update(greedy_seconds=plain.seconds, greedy_tokens_per_s=len(plain.tokens) / plain.seconds,
                   accepted_flags="".join("1" if flag else "0" for flag in drafted.accepted))
        if tokenizer is not None:
            row["completion"] = tokenizer.decode(drafted.tokens)
        rows.append(row)
    summary = {"prompts": len(prompts), "batch_size": batch_size}
    summary.update(_speculative_statistics(speculative, speculative_seconds))
    summary.update(greedy_seconds=greedy_seconds,
                   greedy_tokens_per_s=sum(len(run.tokens) for run in greedy) / greedy_seconds)
    summary["speedup"] = summary["speculative_tokens_per_s"] / summary["greedy_tokens_per_s"]
    summary["all_identical"] = all(row["identical"] for row in rows)
    if not draft_tokens:  # greedy with one draft only
        return {"summary": summary, "prompts": rows}
    summary["sampling"] = {"temperature": sampling.temperature, "top_p": sampling.top_p, "seed": seed}
    by_k: dict[str, dict[str, Any]] = {"greedy": {}, "sampled": {}}
    for k in draft_tokens:
        runs, seconds = ((speculative, speculative_seconds) if k == 1 else
                         passes.run(f"speculative greedy, K={k}", k, GREEDY))
        by_k["greedy"][str(k)] = {**_draft_summary(runs, seconds),
                                  "identical": all(run.tokens == plain.tokens for run, plain in zip(runs, greedy))}
        if k == 1:
            by_k["greedy"]["1"]["teacher_forced"] = teacher_forced_acceptance(target, head, prompts, runs, GREEDY)
    for k in draft_tokens:
        runs, seconds = passes.run(f"speculative sampled, K={k}", k, sampling)
        by_k["sampled"][str(k)] = _draft_summary(runs, seconds)
        if k == 1:
            by_k["sampled"]["1"]["teacher_forced"] = teacher_forced_acceptance(target, head, prompts, runs, sampling)
    summary["by_draft_tokens"] = by_k
    summary["all_identical"] = all(row["identical"] for row in by_k["greedy"].values())
    plain, seconds = passes.run("plain sampled", 0, sampling)
    summary["sampled_tokens_per_s"] = sum(len(run.tokens) for run in plain) / seconds
    return {"summary": summary, "prompts": rows}


class _Passes:
    """One decoder over every prompt, ``batch_size`` at a time (prompts of similar length together), timed."""

    def __init__(self, target: PreTrainedModel, head: MTPDraftHead, prompts: Sequence[Sequence[int]],
                 max_new_tokens: int, eos_token_ids: Collection[int], batch_size: int, seed: int,
                 progress: Progress) -> None:
        self.target, self.head, self.prompts = target, head, prompts
        self.max_new_tokens, self.eos_token_ids, self.batch_size = max_new_tokens, eos_token_ids, batch_size
        self.seed, self.progress = seed, progress
        self.order = sorted(range(len(prompts)), key=lambda index: len(prompts[index]))

    def warm_up(self, draft_tokens: int) -> None:
        """Both decoders on one batch, a few tokens each, untimed (kernel choices, allocator)."""
        batch = [self.prompts[index] for index in self.order[-self.batch_size:]]
        decode_batch(self.target, batch, min(self.max_new_tokens, 4), self.eos_token_ids)
        decode_batch(self.target, batch, min(self.max_new_tokens, 4), self.eos_token_ids, head=self.head,
                     num_draft_tokens=draft_tokens)

    def run(self, name: str, draft_tokens: int, sampling: Sampling) -> tuple[list[Decoded], float]:
        """Every prompt's decoding (in the prompts' order) with ``draft_tokens`` drafts per step (0: plain) and the
        wall seconds of the whole pass."""
        self.progress.begin(name)
        results: dict[int, Decoded] = {}
        start = time.perf_counter()
        for first in range(0, len(self.order), self.batch_size):
            indices = self.order[first:first + self.batch_size]
            decoded = decode_batch(
                self.target, [self.prompts[index] for index in indices], self.max_new_tokens, self.eos_token_ids,
                head=self.head if draft_tokens else None, num_draft_tokens=max(draft_tokens, 1), sampling=sampling,
                generators=[torch.Generator().manual_seed(self.seed + index) for index in indices],
                on_finished=self.progress.finished)
            results.update(zip(indices, decoded))
        seconds = time.perf_counter() - start
        self.progress.end()
        return [results[index] for index in range(len(self.prompts))], seconds


def _draft_summary(runs: Sequence[Decoded], seconds: float) -> dict[str, Any]:
    statistics = _speculative_statistics(runs, seconds)
    return {"acceptance_rate": statistics["acceptance_rate"],
            "acceptance_rate_interval": statistics["acceptance_rate_interval"],
            "mean_accepted_length": statistics["mean_accepted_length"],
            "mean_accepted_length_interval": statistics["mean_accepted_length_interval"],
            "tokens_per_s": statistics["speculative_tokens_per_s"],
            "per_prompt": {"accepted": [sum(run.accepted) for run in runs],
                           "drafts": [len(run.accepted) for run in runs],
                           "verification_steps": [run.target_forwards - 1 for run in runs],
                           "new_tokens": [len(run.tokens) for run in runs]}}


def measure_checkpoint(
    hf_path: str | Path,
    prompts: Sequence[Prompt],
    *,
    max_new_tokens: int = 64,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    draft_tokens: Sequence[int] = DRAFT_TOKENS,
    sampling: Sampling = Sampling(temperature=1.0),
    seed: int = 0,
    batch_size: int = BATCH_SIZE,
    progress: TextIO | None = None,
) -> dict[str, Any]:
    """The full report for an HF checkpoint with an MTP head (e.g. a training run's HF export).

    Loads the target and its MTP head, encodes ``prompts`` as :func:`encode_prompt` does and runs :func:`measure`.
    """
    hf_path = Path(hf_path)
    with quiet_loading(progress_bar=progress is not None):
        target = load_target(hf_path, dtype=dtype, device=device)
        head = load_mtp_head(hf_path, target)
        tokenizer = AutoTokenizer.from_pretrained(hf_path, trust_remote_code=False)
    eos = eos_token_ids(hf_path, tokenizer)
    encoded = [encode_prompt(tokenizer, prompt) for prompt in prompts]
    report = {
        "checkpoint": str(hf_path),
        "mtp_layout": head.family,
        "max_new_tokens": max_new_tokens,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "eos_token_ids": sorted(eos),
    }
    report.update(measure(target, head, encoded, max_new_tokens, eos, tokenizer, draft_tokens=draft_tokens,
                          sampling=sampling, seed=seed, batch_size=batch_size, progress=progress))
    return report


def write_report(report: dict[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``report.json`` and ``speculative.png`` into ``out_dir``, each atomically; return both paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / "report.json", out_dir / "speculative.png"
    write_text_atomically(json_path, json.dumps(report, indent=2) + "\n")
    write_file_atomically(png_path, lambda file: _plot(report).savefig(file, format="png", dpi=100))
    return json_path, png_path


def _speculative_statistics(runs: Sequence[Decoded], seconds: float) -> dict[str, Any]:
    """Pooled figures of ``runs`` (one per prompt) with their intervals over prompts; ``seconds``: the pass's."""
    accepted, drafts = [sum(run.accepted) for run in runs], [len(run.accepted) for run in runs]
    steps = [run.target_forwards - 1 for run in runs]
    acceptance = ratio_interval(acceptance_counts(accepted, drafts))
    length = ratio_interval(accepted_length_counts(accepted, steps))
    tokens = sum(len(run.tokens) for run in runs)
    return {
        "new_tokens": tokens,
        "drafts": sum(drafts),
        "accepted": sum(accepted),
        "acceptance_rate": sum(accepted) / sum(drafts) if sum(drafts) else None,
        "acceptance_rate_interval": [acceptance.low, acceptance.high],
        "verification_steps": sum(steps),
        "mean_accepted_length": (sum(steps) + sum(accepted)) / sum(steps) if sum(steps) else None,
        "mean_accepted_length_interval": [length.low, length.high],
        "speculative_seconds": seconds,
        "speculative_tokens_per_s": tokens / seconds,
    }


def _plot(report: dict[str, Any]):
    """Acceptance per prompt, and tokens/s of both decoders per prompt. Uses the Agg canvas, no global backend."""
    from matplotlib.figure import Figure

    rows, summary = report["prompts"], report["summary"]
    indices = [row["index"] for row in rows]
    figure = Figure(figsize=(10, 4), layout="constrained")
    acceptance, speed = figure.subplots(1, 2)
    acceptance.bar(indices, [row["acceptance_rate"] or 0.0 for row in rows], color="tab:blue")
    if summary["acceptance_rate"] is not None:
        acceptance.axhline(summary["acceptance_rate"], color="black", linestyle="--", label="all prompts")
        acceptance.legend()
    rate = summary["acceptance_rate"]
    title = "MTP draft acceptance" + ("" if rate is None else f" {rate:.2f}")
    acceptance.set(ylim=(0, 1), xticks=indices, xlabel="prompt", ylabel="accepted drafts / drafts", title=title)
    width = 0.4
    speed.bar([i - width / 2 for i in indices], [row["greedy_tokens_per_s"] for row in rows], width, label="greedy")
    speed.bar(
        [i + width / 2 for i in indices], [row["speculative_tokens_per_s"] for row in rows], width, label="speculative"
    )
    speed.set(xticks=indices, xlabel="prompt", ylabel="new tokens / s", title=f"speed-up {summary['speedup']:.2f}x")
    speed.legend()
    return figure

