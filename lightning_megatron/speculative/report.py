"""Measure speculative decoding against plain greedy on a set of prompts, and write the JSON report and a PNG.

Definitions used in the report:

* ``acceptance_rate``: accepted drafts / drafts.
* ``mean_accepted_length``: tokens decided per verification forward of the target, ``(steps + accepted) /
  steps`` (1.0 when no draft is ever accepted, 2.0 when all are; the prefill forward is not a step).
* ``tokens_per_s``: new tokens / wall time of the whole decode (prefill included), measured for each decoder on
  the same prompts after one untimed warm-up of both.

The top-level fields are greedy decoding with one draft token. ``by_draft_tokens`` repeats the measurement for
``K`` drafts per step (the MTP head reapplied to its own output), greedy and sampled (speculative sampling at
``sampling``, seeded): ``acceptance_rate`` (accepted / drafted), ``mean_accepted_length`` (tokens per verification
forward, up to ``K + 1``) and ``tokens_per_s``, beside plain sampling's ``tokens_per_s``.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from lightning_megatron.atomic import write_file_atomically, write_text_atomically
from lightning_megatron.generate import eos_token_ids
from lightning_megatron.speculative.decode import Decoded, greedy_decode, sample_decode, speculative_decode
from lightning_megatron.speculative.mtp_head import MTPDraftHead, load_mtp_head, load_target
from lightning_megatron.speculative.sampling import GREEDY, Sampling

DRAFT_TOKENS = (1, 2, 3)

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
) -> dict[str, Any]:
    """Decode every prompt with both decoders; the per-prompt detail and the summary of the report."""
    if not prompts:
        raise ValueError("prompts is empty")
    greedy_decode(target, prompts[0], min(max_new_tokens, 4), eos_token_ids)  # warm-up, untimed
    speculative_decode(target, head, prompts[0], min(max_new_tokens, 4), eos_token_ids)
    rows, greedy_runs, speculative_runs = [], [], []
    for index, prompt_ids in enumerate(prompts):
        greedy = greedy_decode(target, prompt_ids, max_new_tokens, eos_token_ids)
        speculative = speculative_decode(target, head, prompt_ids, max_new_tokens, eos_token_ids)
        greedy_runs.append(greedy)
        speculative_runs.append(speculative)
        row = {"index": index, "prompt_tokens": len(prompt_ids), "identical": speculative.tokens == greedy.tokens}
        row.update(_speculative_statistics([speculative]))
        row.update(
            greedy_seconds=greedy.seconds,
            greedy_tokens_per_s=len(greedy.tokens) / greedy.seconds,
            accepted_flags="".join("1" if flag else "0" for flag in speculative.accepted),
        )
        if tokenizer is not None:
            row["completion"] = tokenizer.decode(speculative.tokens)
        rows.append(row)
    summary = {"prompts": len(prompts), "all_identical": all(row["identical"] for row in rows)}
    summary.update(_speculative_statistics(speculative_runs))
    greedy_tokens, greedy_seconds = sum(len(r.tokens) for r in greedy_runs), sum(r.seconds for r in greedy_runs)
    summary.update(greedy_seconds=greedy_seconds, greedy_tokens_per_s=greedy_tokens / greedy_seconds)
    summary["speedup"] = summary["speculative_tokens_per_s"] / summary["greedy_tokens_per_s"]
    if not draft_tokens:  # greedy with one draft only
        return {"summary": summary, "prompts": rows}
    summary["sampling"] = {"temperature": sampling.temperature, "top_p": sampling.top_p, "seed": seed}
    summary["by_draft_tokens"] = {
        "greedy": {str(k): _by_draft_tokens(target, head, prompts, max_new_tokens, eos_token_ids, k, GREEDY, seed)
                   if k != 1 else _draft_summary(_speculative_statistics(speculative_runs)) for k in draft_tokens},
        "sampled": {str(k): _by_draft_tokens(target, head, prompts, max_new_tokens, eos_token_ids, k, sampling, seed)
                    for k in draft_tokens},
    }
    generator = torch.Generator().manual_seed(seed)
    plain = [sample_decode(target, prompt, max_new_tokens, eos_token_ids, sampling, generator) for prompt in prompts]
    summary["sampled_tokens_per_s"] = sum(len(r.tokens) for r in plain) / sum(r.seconds for r in plain)
    return {"summary": summary, "prompts": rows}


def _by_draft_tokens(target: PreTrainedModel, head: MTPDraftHead, prompts: Sequence[Sequence[int]],
                     max_new_tokens: int, eos_token_ids: Collection[int], draft_tokens: int, sampling: Sampling,
                     seed: int) -> dict[str, Any]:
    """Acceptance, mean accepted length and tokens/s of speculative decoding with `draft_tokens` per step."""
    generator = torch.Generator().manual_seed(seed)
    runs = [speculative_decode(target, head, prompt, max_new_tokens, eos_token_ids, num_draft_tokens=draft_tokens,
                               sampling=sampling, generator=generator) for prompt in prompts]
    return _draft_summary(_speculative_statistics(runs))


def _draft_summary(statistics: dict[str, Any]) -> dict[str, Any]:
    return {"acceptance_rate": statistics["acceptance_rate"],
            "mean_accepted_length": statistics["mean_accepted_length"],
            "tokens_per_s": statistics["speculative_tokens_per_s"]}


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
) -> dict[str, Any]:
    """The full report for an HF checkpoint with an MTP head (e.g. a training run's HF export).

    Loads the target and its MTP head, encodes ``prompts`` as :func:`encode_prompt` does and runs :func:`measure`.
    """
    hf_path = Path(hf_path)
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
                          sampling=sampling, seed=seed))
    return report


def write_report(report: dict[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``report.json`` and ``speculative.png`` into ``out_dir``, each atomically; return both paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out_dir / "report.json", out_dir / "speculative.png"
    write_text_atomically(json_path, json.dumps(report, indent=2) + "\n")
    write_file_atomically(png_path, lambda file: _plot(report).savefig(file, format="png", dpi=100))
    return json_path, png_path


def _speculative_statistics(runs: Sequence[Decoded]) -> dict[str, Any]:
    drafts = sum(len(run.accepted) for run in runs)
    accepted = sum(sum(run.accepted) for run in runs)
    steps = sum(run.target_forwards - 1 for run in runs)
    tokens, seconds = sum(len(run.tokens) for run in runs), sum(run.seconds for run in runs)
    return {
        "new_tokens": tokens,
        "drafts": drafts,
        "accepted": accepted,
        "acceptance_rate": accepted / drafts if drafts else None,
        "verification_steps": steps,
        "mean_accepted_length": (steps + accepted) / steps if steps else None,
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

