"""The speculative-decoding report of an HF checkpoint with an MTP head:

    lightning-megatron-speculative HF_CHECKPOINT PROMPTS_JSONL --out DIR
    python -m lightning_megatron.cli.speculative HF_CHECKPOINT PROMPTS_JSONL --out DIR

A Megatron distributed checkpoint from training is first exported to an HF folder (the strategy's export_hf).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from lightning_megatron import _compat
from lightning_megatron.cli.user_errors import input_errors_reported
from lightning_megatron.families import MTP_MODEL_TYPES
from lightning_megatron.speculative.report import (
    BATCH_SIZE,
    DRAFT_TOKENS,
    measure_checkpoint,
    read_prompts,
    write_report,
)
from lightning_megatron.speculative.sampling import Sampling

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: Sequence[str] | None = None) -> int:
    _compat.quiet_handled_warnings()
    parser = argparse.ArgumentParser(
        prog="lightning-megatron-speculative",
        description="Self-speculative decoding with the checkpoint's MTP head as drafter, against plain decoding on "
        "the same prompts: acceptance rate, mean accepted length and tokens/s, greedy and sampled, for K draft "
        "tokens per step; per-prompt detail.",
    )
    parser.add_argument("checkpoint", type=Path,
                        help=f"HF checkpoint folder with an MTP head (model_type: {', '.join(MTP_MODEL_TYPES)})")
    parser.add_argument("prompts", type=Path, help='JSONL, one {"prompt": str} or {"messages": [...]} per line')
    parser.add_argument("--out", type=Path, required=True, help="folder for report.json and speculative.png")
    parser.add_argument("--max-new-tokens", type=_at_least_one, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32",
                        help="float32 keeps both decoders' argmax identical; lower precision may break ties apart")
    parser.add_argument("--draft-tokens", type=_at_least_one, nargs="+", default=list(DRAFT_TOKENS), metavar="K",
                        help="draft tokens per step to report (the MTP head reapplied to its own output)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="sampling temperature of the sampled runs; 0: greedy verification (a draft stands iff "
                        "it is the target's greedy token, so the sampled runs equal the greedy ones)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus of the sampled runs (1.0: all tokens)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled runs (prompt i: seed + i)")
    parser.add_argument("--batch-size", type=_at_least_one, default=BATCH_SIZE,
                        help="prompts decoded at once (each row accepts on its own: no figure depends on it); "
                        "larger is faster until the device is full")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    if args.temperature < 0:
        parser.error(f"--temperature {args.temperature} must be >= 0 (0: greedy verification)")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p {args.top_p} must be in (0, 1] (1.0: all tokens)")

    # a prompts file or checkpoint the report cannot read: one `error: ...` block (raised when called with `argv`)
    with input_errors_reported(on_the_command_line=argv is None):
        report = measure_checkpoint(args.checkpoint, read_prompts(args.prompts), max_new_tokens=args.max_new_tokens,
                                    device=args.device, dtype=_DTYPES[args.dtype], draft_tokens=args.draft_tokens,
                                    sampling=Sampling(args.temperature, args.top_p), seed=args.seed,
                                    batch_size=args.batch_size, progress=None if args.quiet else sys.stderr)
    json_path, png_path = write_report(report, args.out)
    summary = report["summary"]
    rate = summary["acceptance_rate"]
    print(
        f"{summary['prompts']} prompts: acceptance {_rate(rate)}{_interval(summary['acceptance_rate_interval'])} "
        f"({summary['accepted']}/{summary['drafts']} drafts), mean accepted length "
        f"{summary['mean_accepted_length'] or float('nan'):.3f}, {summary['speculative_tokens_per_s']:.1f} vs "
        f"{summary['greedy_tokens_per_s']:.1f} tokens/s ({summary['speedup']:.2f}x); wrote {json_path} and {png_path}"
    )
    for mode, by_k in summary["by_draft_tokens"].items():
        print(f"{mode}: " + "; ".join(f"K={k} acceptance {_rate(row['acceptance_rate'])}"
                                      f"{_interval(row['acceptance_rate_interval'])}, length "
                                      f"{row['mean_accepted_length'] or float('nan'):.2f}, {row['tokens_per_s']:.1f} "
                                      f"tokens/s" for k, row in by_k.items()))
    if not summary["all_identical"]:
        different = [row["index"] for row in report["prompts"] if not row["identical"]]
        draft_counts = [k for k, row in summary["by_draft_tokens"]["greedy"].items() if not row["identical"]]
        print(f"warning: speculative greedy output differs from plain greedy with K = {', '.join(draft_counts)} "
              f"drafts (K = 1: prompts {different})", file=sys.stderr)
        return 1
    return 0


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number (at least 1)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _rate(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate:.3f}"


def _interval(bounds: list[float | None]) -> str:
    """`` [low, high]``: the 95% interval over prompts, nothing when there is none."""
    return "" if bounds[0] is None else f" [{bounds[0]:.3f}, {bounds[1]:.3f}]"


if __name__ == "__main__":
    sys.exit(main())
