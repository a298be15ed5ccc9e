"""The MTP quality benchmark: a jointly trained head, lost, and retrained MTP-only three ways.

    python -m lightning_megatron.recipes.mtp_quality OUT --size gpu    # one H200, about 8 minutes
    python -m lightning_megatron.recipes.mtp_quality OUT --size cpu    # the test suite's version, 2 CPU cores

1. corpus, tokenizer and a random-init Qwen3+MTP checkpoint from the Python standard library (`stdlib_corpus`);
2. joint SFT + MTP (`configs/recipes/stdlib_joint.yaml`, MTP head detached: `mtp_detach_heads: true`) -> joint;
3. the head is lost the way it happens to users: an HF export with MTP disabled, then
   `lightning-megatron-restore-mtp --init random` (the README's recipe) -> reset;
4. from that same reset head, three MTP-only fits (`stdlib_mtp_only.yaml`, MTPOnlyCallback audit, same steps):
   (a) `self_distill`: self-distillation (`mtp_loss_type: self_distill`) on the raw training corpus, no generation;
   (b) `labels_corpus`: hard labels on the raw training corpus;
   (c) `labels_continuations`: the frozen model's own greedy continuations (`stdlib_generate.yaml`), hard labels;
   with `--trunk-cache`, (a) once more with `MTPOnlyCallback(trunk_cache_dir=...)` (later epochs read the frozen
   trunk's output from disk): `trunk_cache` in the JSON says whether its acceptance equals (a)'s, and both times;
   `--variants` picks the fits to run (default (a), (b), (c)); `self_distill_long` is (a+): (a) for the seconds
   (c)'s generation step costs, `--distill-steps` steps (gpu 400, cpu 120: about (c)'s wall time) with the trunk
   cache; `--distill-weighting greedy|sampled` weighs (a)'s and (a+)'s positions as a server feeds the MTP layer
   (`model.mtp_distill_weighting`);
5. for every head, on held-out prompts: greedy acceptance (1 draft), sampled acceptance at temperature 1 (speculative
   sampling, 1 draft), mean accepted length with 3 drafts (greedy and sampled), tokens/s; and each fit's wall time
   including its generation step. `mtp_quality.json` (with `targets`: (a) >= (c) greedy, (a) > (c) sampled, (a) >=
   joint greedy) and `mtp_quality.png`.

Every training and generation step is a `lightning-megatron` run of a config from `configs/recipes/`. The GPU
defaults (300 joint steps, 200 MTP-only steps each, 12 prompts x 48 new tokens) fit one H200 in about 8 minutes;
`--joint-steps` and `--mtp-only-steps` change them. `--variants self_distill_long` alone takes about 8 minutes too
(the joint fit and the measurements are most of it).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

from lightning_megatron.mtp.self_distill import DISTILL_WEIGHTINGS
from lightning_megatron.recipes import stdlib_corpus
from lightning_megatron.recipes.steps import acceptance, derived_config, read_jsonl, run_cli, write_jsonl

# what the CPU version changes in the GPU recipe so that the whole benchmark runs in the test suite
CPU_OVERRIDES: dict[str, dict[str, Any]] = {
    "stdlib_joint.yaml": {"trainer.accelerator": "cpu", "trainer.max_steps": 60, "trainer.val_check_interval": 30,
                          "trainer.log_every_n_steps": 5, "trainer.strategy.init_args.precision": "fp32",
                          "trainer.strategy.init_args.micro_batch_size": 8,
                          "trainer.strategy.init_args.global_batch_size": 8, "model.lr": 3.0e-3,
                          "model.warmup_steps": 10, "data.seq_length": 128},
    "stdlib_generate.yaml": {"trainer.accelerator": "cpu", "trainer.strategy.init_args.precision": "fp32",
                             "trainer.strategy.init_args.micro_batch_size": 32, "model.max_new_tokens": 32,
                             "data.seq_length": 128},
    "stdlib_mtp_only.yaml": {"trainer.accelerator": "cpu", "trainer.max_steps": 30, "trainer.val_check_interval": 10,
                             "trainer.strategy.init_args.precision": "fp32",
                             "trainer.strategy.init_args.micro_batch_size": 8,
                             "trainer.strategy.init_args.global_batch_size": 8, "model.lr": 1.0e-2,
                             "model.warmup_steps": 5, "data.seq_length": 96},
}
MEASURE = {"gpu": {"prompts": 12, "max_new_tokens": 48, "device": "cuda", "corpus_seq_length": 1024},
           "cpu": {"prompts": 8, "max_new_tokens": 24, "device": "cpu", "corpus_seq_length": 128}}
CORPUS_OVERRIDES = {"gpu": [], "cpu": ["--train-prompts", "64", "--heldout-prompts", "8"]}
DRAFT_TOKENS = (1, 3)  # 1: the greedy and sampled acceptance; 3: the accepted length with three drafts
VARIANTS = ("self_distill", "labels_corpus", "labels_continuations")
# (a+): self-distillation for as many steps as (c)'s wall time pays for, later epochs from the frozen trunk's cache
LONG_VARIANT = "self_distill_long"
CACHED_VARIANT = "self_distill_trunk_cache"  # --trunk-cache: (a) again, later epochs from the frozen trunk's cache
DISTILL_VARIANTS = ("self_distill", LONG_VARIANT, CACHED_VARIANT)
# (a+)'s steps: (c) pays for its generation step (86 s of 150 on the H200, 16 s of 34 on the CPU); with the trunk
# cache (a)'s later epochs cost a fraction of the first, so (a+) takes about (c)'s wall time
LONG_STEPS = {"gpu": 400, "cpu": 120}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_megatron.recipes.mtp_quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", choices=("cpu", "gpu"), default="gpu")
    parser.add_argument("--joint-steps", type=int, default=None, help="joint SFT + MTP steps (gpu default 300)")
    parser.add_argument("--mtp-only-steps", type=int, default=None,
                        help="steps of each MTP-only fit (gpu default 200)")
    parser.add_argument("--trunk-cache", action="store_true",
                        help="also run (a) again with MTPOnlyCallback(trunk_cache_dir=...): later epochs read the "
                        "frozen trunk's output from disk; reported beside (a): the same acceptance, the time each took")
    parser.add_argument("--distill-temperature", type=float, default=1.0,
                        help="(a)'s and (a+)'s teacher temperature (model.mtp_distill_temperature): below 1 sharpens the main "
                        "head's distribution toward its argmax, which greedy acceptance rewards")
    parser.add_argument("--variants", nargs="+", choices=(*VARIANTS, LONG_VARIANT), default=list(VARIANTS),
                        help="the MTP-only fits to run, in this order (default: (a), (b), (c)); "
                        f"{LONG_VARIANT} is (a+): (a) for --distill-steps steps with the trunk cache")
    parser.add_argument("--distill-steps", type=int, default=None,
                        help=f"(a+)'s steps (gpu default {LONG_STEPS['gpu']}, cpu {LONG_STEPS['cpu']}: about (c)'s "
                        "wall time including its generation step)")
    parser.add_argument("--distill-weighting", choices=DISTILL_WEIGHTINGS, default="uniform",
                        help="the self-distillation variants' model.mtp_distill_weighting: weigh each position by "
                        "how a server feeds the MTP layer its input token (greedy: only the main head's argmax; "
                        "sampled: by its probability)")
    args = parser.parse_args(argv)
    if args.distill_steps is not None and args.distill_steps < 1:
        parser.error(f"--distill-steps: {args.distill_steps} must be at least 1")
    if args.trunk_cache and "self_distill" not in args.variants:
        parser.error("--trunk-cache compares with (a): add self_distill to --variants")
    out, size = args.out.resolve(), args.size
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    timings: dict[str, float] = {}
    steps = {"joint": args.joint_steps or (300 if size == "gpu" else None),
             "mtp_only": args.mtp_only_steps or (200 if size == "gpu" else None)}

    def step(name: str, since: float) -> float:
        now = time.perf_counter()
        timings[name] = round(now - since, 1)
        return now

    clock = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # its summary: the files are what the steps below read
        stdlib_corpus.main([str(out), "--size", size, *CORPUS_OVERRIDES[size]])
    corpus, model = out / "corpus", out / "model"
    clock = step("corpus_s", clock)
    measure = MEASURE[size]
    held_out = [row["prompt"] for row in read_jsonl(corpus / "heldout_prompts.jsonl")][: measure["prompts"]]

    def config(source: str, name: str, overrides: dict[str, Any]) -> Path:
        merged = {**(CPU_OVERRIDES[source] if size == "cpu" else {}), **overrides}
        return derived_config(f"recipes/{source}", out / f"{name}.yaml", merged)

    def measured(name: str, checkpoint: Path, draft_tokens: tuple[int, ...] = DRAFT_TOKENS) -> dict[str, Any]:
        return acceptance(checkpoint, held_out, measure["max_new_tokens"], out / f"acceptance_{name}",
                          measure["device"], draft_tokens)

    joint = out / "joint"
    run_cli("fit", config("stdlib_joint.yaml", "joint", {
        "trainer.strategy.init_args.hf_checkpoint": str(model), "trainer.default_root_dir": str(joint),
        "trainer.logger.0.init_args.save_dir": str(joint), "trainer.callbacks.2.init_args.dirpath": str(joint / "hf"),
        "data.train_path": str(corpus / "train.jsonl"), "data.val_path": str(corpus / "val.jsonl"),
        **({"trainer.max_steps": steps["joint"]} if steps["joint"] else {}),
    }), "[1/5] joint SFT + MTP")
    clock = step("joint_fit_s", clock)
    results: dict[str, Any] = {"joint": measured("joint", joint / "hf")}
    clock = step("measure_joint_s", clock)

    from lightning_megatron.mtp.restore import restore_mtp_head

    export_without_mtp(joint / "hf", out / "no_mtp")
    restored = out / "restored"
    restore_mtp_head(out / "no_mtp", restored, init="random", seed=1)  # lightning-megatron-restore-mtp's work
    print(f"[2/5] exported without MTP, head restored at random: {restored}", flush=True)
    results["reset"] = measured("reset", restored, draft_tokens=(1,))
    clock = step("reset_and_measure_s", clock)

    train_seconds: dict[str, float] = {}
    variants = (*dict.fromkeys(args.variants), *((CACHED_VARIANT,) if args.trunk_cache else ()))
    for variant in variants:
        since = time.perf_counter()
        train, val, loss_type, seq_length = corpus / "train.jsonl", corpus / "val.jsonl", "labels", None
        cache, variant_steps = {}, steps["mtp_only"]
        if variant in DISTILL_VARIANTS:
            loss_type, seq_length = "self_distill", measure["corpus_seq_length"]
            if variant in (CACHED_VARIANT, LONG_VARIANT):
                cache = {"trainer.callbacks.0": {"class_path": "lightning_megatron.callbacks.MTPOnlyCallback",
                                                 "init_args": {"trunk_cache_dir": str(out / f"cache_{variant}")}}}
            if variant == LONG_VARIANT:
                variant_steps = args.distill_steps or LONG_STEPS[size]
        elif variant == "labels_corpus":
            seq_length = measure["corpus_seq_length"]
        else:
            train, val = own_continuations(out, corpus, restored, config)
            timings["generate_s"] = round(time.perf_counter() - since, 1)
        run = out / variant
        run_cli("fit", config("stdlib_mtp_only.yaml", variant, {
            "trainer.strategy.init_args.hf_checkpoint": str(restored), "trainer.default_root_dir": str(run),
            "trainer.logger.0.init_args.save_dir": str(run), "trainer.callbacks.3.init_args.dirpath": str(run / "hf"),
            "data.train_path": str(train), "data.val_path": str(val), "model.mtp_loss_type": loss_type,
            **({"model.mtp_distill_temperature": args.distill_temperature,
                "model.mtp_distill_weighting": args.distill_weighting} if loss_type == "self_distill" else {}),
            "trainer.limit_val_batches": 4,
            **({"data.seq_length": seq_length} if seq_length else {}), **cache,
            **({"trainer.max_steps": variant_steps} if variant_steps else {}),
        }), f"[{4 if variant == 'labels_continuations' else 3}/5] MTP-only fit ({variant})")
        train_seconds[variant] = round(time.perf_counter() - since, 1)
        clock = step(f"{variant}_train_s", since)
        results[variant] = measured(variant, run / "hf")
        clock = step(f"measure_{variant}_s", clock)

    summary = _summary(results, size, train_seconds, {variant: _curves(out / variant) for variant in variants},
                       _curves(joint), [json.loads((out / v / "mtp_only_audit.json").read_text()) for v in variants])
    summary["seconds"] = {**timings, "total_s": round(time.perf_counter() - started, 1)}
    summary["command"] = " ".join(["python3 -m lightning_megatron.recipes.mtp_quality", *(argv or sys.argv[1:])])
    summary["distill_temperature"] = args.distill_temperature
    summary["distill_weighting"] = args.distill_weighting
    (out / "mtp_quality.json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot(summary).savefig(out / "mtp_quality.png", dpi=100)
    print(json.dumps({key: summary[key] for key in ("heads", "targets", "seconds")}, indent=2))
    print(f"wrote {out / 'mtp_quality.json'} and {out / 'mtp_quality.png'}")
    return 0 if summary["greedy_identical_throughout"] and summary["frozen_bit_identical"] else 1


def own_continuations(out: Path, corpus: Path, restored: Path, config: Any) -> tuple[Path, Path]:
    """(c)'s generation step: the frozen model's greedy continuations of train and held-out prompts as SFT rows."""
    train_prompts = read_jsonl(corpus / "train_prompts.jsonl")
    held_out_rows = read_jsonl(corpus / "heldout_prompts.jsonl")
    prompts = write_jsonl(out / "prompts.jsonl", train_prompts + held_out_rows)
    continuations = out / "continuations.jsonl"
    run_cli("predict", config("stdlib_generate.yaml", "generate", {
        "trainer.strategy.init_args.hf_checkpoint": str(restored), "trainer.default_root_dir": str(out / "generate"),
        "trainer.callbacks.0.init_args.output_path": str(continuations), "data.predict_path": str(prompts),
    }), "[4/5] the frozen model's own continuations, for (c)")
    held_out_texts = {row["prompt"] for row in held_out_rows}
    rows = read_jsonl(continuations)
    return (write_jsonl(out / "continuations_train.jsonl", [r for r in rows if r["prompt"] not in held_out_texts]),
            write_jsonl(out / "continuations_heldout.jsonl", [r for r in rows if r["prompt"] in held_out_texts]))


def _curves(run: Path) -> dict[str, Any]:
    return json.loads(next(run.glob("csv/version_*/curves.json")).read_text())


def export_without_mtp(source: Path, target: Path) -> Path:
    """The user's mistake to recover from: an HF export of the trained model with the MTP head disabled."""
    from lightning_megatron.bridges import create_bridge
    from lightning_megatron.distributed import init_single_process
    from lightning_megatron.options import ModelOptions

    init_single_process()
    bridge = create_bridge("megatron-bridge", source)
    return bridge.save_hf(bridge.build(ModelOptions(mtp=False)), target)


def _head(result: dict[str, Any]) -> dict[str, Any]:
    """One head's row: greedy and sampled acceptance with one draft, accepted length with three, tokens/s."""
    by_k = result["by_draft_tokens"]
    row = {"greedy_acceptance": result["acceptance_rate"],
           "sampled_acceptance": by_k["sampled"]["1"]["acceptance_rate"],
           "greedy_tokens_per_s": result["greedy_tokens_per_s"],
           "speculative_tokens_per_s": result["speculative_tokens_per_s"],
           "sampled_tokens_per_s": result["sampled_tokens_per_s"]}
    if "3" in by_k["greedy"]:
        row.update(greedy_accepted_length_k3=by_k["greedy"]["3"]["mean_accepted_length"],
                   sampled_accepted_length_k3=by_k["sampled"]["3"]["mean_accepted_length"],
                   greedy_k3_tokens_per_s=by_k["greedy"]["3"]["tokens_per_s"],
                   sampled_k3_tokens_per_s=by_k["sampled"]["3"]["tokens_per_s"])
    return row


def _summary(results: dict[str, Any], size: str, train_seconds: dict[str, float], curves: dict[str, dict],
             joint_curves: dict, audits: list[dict]) -> dict[str, Any]:
    heads = {name: _head(result) for name, result in results.items()}
    for variant, seconds in train_seconds.items():
        heads[variant]["train_s_including_generation"] = seconds
    return {
        "size": size,
        "heads": heads,
        "targets": _targets(heads),
        "greedy_identical_throughout": all(result["all_identical"] for result in results.values()),
        "frozen_bit_identical": all(audit["frozen_bit_identical"] for audit in audits),
        "joint_val_lm_loss": joint_curves.get("val_lm_loss", []),
        "val_mtp_acceptance_by_step": {name: curve.get("val_mtp_acceptance", []) for name, curve in curves.items()},
        "val_mtp_sampled_acceptance_by_step": {name: curve.get("val_mtp_sampled_acceptance", [])
                                               for name, curve in curves.items()},
        "prompts": results["joint"]["prompts"],
        **({"trunk_cache": _trunk_cache_comparison(heads)} if CACHED_VARIANT in heads else {}),
    }


def _targets(heads: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets for each self-distilled head that ran ((a), (a+)): against (c) where (c) ran, and
    against the joint head."""
    targets: dict[str, Any] = {}
    c, joint = heads.get("labels_continuations"), heads["joint"]
    for name in ("self_distill", LONG_VARIANT):
        if name not in heads:
            continue
        a = heads[name]
        if c is not None:
            targets[f"{name}_greedy_at_least_continuations"] = a["greedy_acceptance"] >= c["greedy_acceptance"]
            targets[f"{name}_sampled_beats_continuations"] = a["sampled_acceptance"] > c["sampled_acceptance"]
        targets[f"{name}_greedy_over_joint"] = (a["greedy_acceptance"] / joint["greedy_acceptance"]
                                                if joint["greedy_acceptance"] else None)
    return targets


def _trunk_cache_comparison(heads: dict[str, Any]) -> dict[str, Any]:
    """(a) trained again from the trunk cache: the same head (acceptance) in less time."""
    plain, cached = heads["self_distill"], heads[CACHED_VARIANT]
    measured = ("greedy_acceptance", "sampled_acceptance", "greedy_accepted_length_k3", "sampled_accepted_length_k3")
    return {"same_acceptance": all(plain[key] == cached[key] for key in measured),
            "train_s": plain["train_s_including_generation"],
            "train_s_with_trunk_cache": cached["train_s_including_generation"]}


def _plot(summary: dict[str, Any]):
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4), layout="constrained")
    by_step, bars = figure.subplots(1, 2)
    for name, curve in summary["val_mtp_sampled_acceptance_by_step"].items():
        if curve:
            x, y = zip(*curve)
            by_step.plot(x, y, marker="o", label=f"{name}: sampled (teacher-forced)")
    for name, curve in summary["val_mtp_acceptance_by_step"].items():
        if curve:
            x, y = zip(*curve)
            by_step.plot(x, y, marker=".", linestyle=":", label=f"{name}: greedy (teacher-forced)")
    by_step.set(xlabel="MTP-only optimizer step", ylabel="validation acceptance", ylim=(0, 1),
                title="MTP-only training from the reset head")
    by_step.legend(fontsize=6)
    names = list(summary["heads"])
    width = 0.4
    positions = range(len(names))
    bars.bar([i - width / 2 for i in positions], [summary["heads"][n]["greedy_acceptance"] for n in names], width,
             label="greedy")
    bars.bar([i + width / 2 for i in positions], [summary["heads"][n]["sampled_acceptance"] for n in names], width,
             label="sampled, T = 1")
    bars.set(xticks=list(positions), ylim=(0, 1), ylabel="accepted drafts / drafts",
             title="speculative decoding, held-out prompts")
    bars.set_xticklabels(names, rotation=20, fontsize=7)
    bars.legend()
    return figure


if __name__ == "__main__":
    sys.exit(main())
