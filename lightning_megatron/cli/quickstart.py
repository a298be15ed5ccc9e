"""The main job (`make demo`): recover an MTP head's speculative-decoding acceptance, end to end, on CPU or GPU.

1. the tiny Qwen3+MTP checkpoint is made locally (random weights, a random MTP head: nothing is downloaded), and
   the packaged training and held-out prompts are written to the work folder;
2. `lightning-megatron predict` writes the frozen model's own greedy continuations of training and held-out
   prompts as SFT JSONL (`--mtp-loss labels`, the default); with `--mtp-loss self_distill` (or `tv`, `tv_kl`)
   this step is skipped: the head learns the model's own distribution on the packaged SFT text (`mtp_loss_type`);
3. the acceptance of the stored MTP head is measured on the held-out prompts by speculative decoding;
4. `lightning-megatron fit` trains only the MTP head on the training continuations (backbone audited bit for
   bit), validating on the held-out ones, and exports an HF checkpoint;
5. the acceptance is measured again; both reports, the logs, the checkpoint and the plot are listed.

Each CLI step runs as its own `lightning-megatron` process from a config written into the work folder, so what
runs here is exactly what a user runs. It exits 1 if the acceptance did not rise or speculative decoding ever
differed from plain greedy decoding. `--stop-after N` runs steps 1 to N only (and exits 0).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from lightning_megatron import _compat
from lightning_megatron.recipes.steps import CONFIGS, acceptance, derived_config, read_jsonl, run_cli, write_jsonl

STEPS = 5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_megatron.cli.quickstart", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("artifacts/quickstart"))
    parser.add_argument("--max-steps", type=int, default=150, help="MTP-only optimizer steps")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--mtp-loss", choices=("labels", "self_distill", "tv", "tv_kl"), default="labels",
                        help="labels: hard labels on the model's own continuations (a generation step first); "
                        "self_distill (KL), tv (the sampled acceptance itself) or tv_kl (their blend): the main "
                        "head's distribution on the packaged SFT text, no generation step")
    parser.add_argument("--stop-after", type=int, choices=range(1, STEPS + 1), default=STEPS, metavar="N",
                        help=f"run steps 1 to N only (1-{STEPS}; default: all)")
    args = parser.parse_args(argv)
    _compat.quiet_handled_warnings()
    started = time.perf_counter()
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)

    from lightning_megatron.cli.megatron_cli import ensure_tiny_checkpoint

    checkpoint = ensure_tiny_checkpoint(work / "tiny-qwen3-mtp")
    train_prompts = read_jsonl(CONFIGS / "data" / "tiny_prompts_train.jsonl")
    held_out_prompts = read_jsonl(CONFIGS / "data" / "tiny_prompts_heldout.jsonl")
    prompts_file = write_jsonl(work / "prompts.jsonl", train_prompts + held_out_prompts)
    print(f"[1/5] tiny Qwen3 checkpoint with a random MTP head: {checkpoint}; prompts: {prompts_file}")
    if args.stop_after == 1:
        return _stopped(1)

    if args.mtp_loss != "labels":
        train_file, val_file = CONFIGS / "data" / "tiny_sft.jsonl", CONFIGS / "data" / "tiny_sft_val.jsonl"
        print(f"[2/5] no generation step: the {args.mtp_loss} loss trains on {train_file.name} and validates on "
              f"{val_file.name}")
    else:
        train_file, val_file = _own_continuations(work, checkpoint, prompts_file, held_out_prompts,
                                                  args.max_new_tokens)
    if args.stop_after == 2:
        return _stopped(2)

    held_out = [row["prompt"] for row in held_out_prompts]
    before = acceptance(checkpoint, held_out, args.max_new_tokens, work / "acceptance_before", draft_tokens=())
    print(f"[3/5] stored (random) MTP head on {len(held_out_prompts)} held-out prompts: "
          f"acceptance {before['acceptance_rate']:.3f}")
    if args.stop_after == 3:
        return _stopped(3)

    run = work / "mtp_only"
    export = run / "hf"
    fit = derived_config("tiny/mtp_only.yaml", work / "mtp_only.yaml", {
        "make_tiny_checkpoint": False,
        "trainer.strategy.init_args.hf_checkpoint": str(checkpoint),
        "trainer.default_root_dir": str(run),
        "trainer.max_steps": args.max_steps,
        "trainer.val_check_interval": max(1, args.max_steps // 6),
        "trainer.logger.0.init_args.save_dir": str(run),
        "trainer.logger.1.init_args.save_dir": str(run),
        "trainer.callbacks.4.init_args.dirpath": str(run / "checkpoints"),
        "trainer.callbacks.5.init_args.dirpath": str(export),
        "data.train_path": str(train_file),
        "data.val_path": str(val_file),
        "model.mtp_loss_type": args.mtp_loss,
    })
    run_cli("fit", fit, f"[4/5] MTP-only fit, {args.max_steps} steps")
    if args.stop_after == 4:
        return _stopped(4)

    after = acceptance(export, held_out, args.max_new_tokens, work / "acceptance_after", draft_tokens=())
    audit = json.loads((run / "mtp_only_audit.json").read_text())
    print(f"[5/5] trained MTP head on the same prompts: acceptance {after['acceptance_rate']:.3f}\n")
    print(f"MTP draft acceptance on held-out prompts: before {before['acceptance_rate']:.3f} -> after "
          f"{after['acceptance_rate']:.3f} (mean accepted length {before['mean_accepted_length']:.2f} -> "
          f"{after['mean_accepted_length']:.2f}; speculative vs greedy tokens/s {after['speedup']:.2f}x on this "
          f"tiny model)")
    print(f"speculative output identical to greedy for every prompt: "
          f"{before['all_identical'] and after['all_identical']}; frozen backbone bit-identical: "
          f"{audit['frozen_bit_identical']} ({run / 'mtp_only_audit.json'})")
    print(f"logs: TensorBoard {run / 'tensorboard'}, CSV {run / 'csv'}")
    print(f"plot: {next(run.glob('tensorboard/version_*/curves.png'), run / 'tensorboard')}; acceptance reports: "
          f"{work / 'acceptance_before'}, {work / 'acceptance_after'}")
    print(f"checkpoint: {run / 'checkpoints' / 'last.ckpt'}; HF export: {export}")
    print(f"done in {time.perf_counter() - started:.0f} s")
    improved = after["acceptance_rate"] > before["acceptance_rate"]
    return 0 if improved and before["all_identical"] and after["all_identical"] else 1


def _own_continuations(work: Path, checkpoint: Path, prompts_file: Path, held_out_prompts: list[dict],
                       max_new_tokens: int) -> tuple[Path, Path]:
    """Step 2 for hard labels: the frozen model's greedy continuations, split into training and held-out rows."""
    continuations = work / "continuations.jsonl"
    generate = derived_config("tiny/generate.yaml", work / "generate.yaml", {
        "trainer.strategy.init_args.hf_checkpoint": str(checkpoint),
        "trainer.default_root_dir": str(work / "generate"),
        "trainer.callbacks.0.init_args.output_path": str(continuations),
        "data.predict_path": str(prompts_file),
        "model.max_new_tokens": max_new_tokens,
    })
    run_cli("predict", generate, "[2/5] greedy continuations of the frozen model")
    held_out_texts = {row["prompt"] for row in held_out_prompts}
    rows = read_jsonl(continuations)
    train_file = write_jsonl(work / "train.jsonl", [row for row in rows if row["prompt"] not in held_out_texts])
    val_file = write_jsonl(work / "heldout.jsonl", [row for row in rows if row["prompt"] in held_out_texts])
    print(f"      {continuations}: {len(rows)} rows -> {train_file.name} and {val_file.name}")
    return train_file, val_file


def _stopped(step: int) -> int:
    print(f"stopped after step {step} of {STEPS} (--stop-after {step})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
