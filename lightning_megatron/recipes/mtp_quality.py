"""The MTP quality benchmark: a jointly trained head, lost, and retrained MTP-only several ways, ranked on held-out
prompts with 95% intervals and paired comparisons.

    python -m lightning_megatron.recipes.mtp_quality OUT --size gpu    # one H200, about 12 minutes
    python -m lightning_megatron.recipes.mtp_quality OUT --size cpu    # the test suite's version, 2 CPU cores

1. corpus, tokenizer and a random-init Qwen3+MTP checkpoint from the Python standard library (`stdlib_corpus`);
2. joint SFT + MTP (`configs/recipes/stdlib_joint.yaml`, MTP head detached: `mtp_detach_heads: true`) -> joint;
3. the head is lost the way it happens to users: an HF export with MTP disabled, then
   `lightning-megatron-restore-mtp --init random` (the README's recipe) -> reset;
4. from that same reset head, MTP-only fits (`stdlib_mtp_only.yaml`, MTPOnlyCallback audit, the same steps each),
   one per variant of `VARIANTS`:
   (a) `self_distill`: self-distillation (`mtp_loss_type: self_distill`, KL to the main head) on the raw corpus;
   (b) `labels_corpus`: hard labels on the raw corpus;
   (c) `labels_continuations`: the frozen model's own greedy continuations (`stdlib_generate.yaml`), hard labels;
   `tv`: the acceptance rate itself (`mtp_loss_type: tv`, 1 - sum_x min(p, q) at T = 1) on the raw corpus;
   `tv_kl`: the KL/TV blend (`mtp_loss_type: tv_kl`) on the raw corpus;
   `tv_kl_sampled`: the KL/TV blend on the frozen model's own samples at T = 1 (`model.generation_temperature`):
   the contexts sampled rollouts put the head in, where the corpus is text the model would not write;
   `self_distill_sampled`: (a) on those samples; `--sample-prompts` sets how many training prompts are continued
   (gpu 1024, about 131k sampled tokens);
   `--variants` picks the fits (default: gpu (a), (c), tv, tv_kl; cpu (a), (c), tv); `self_distill_long` is (a+):
   (a) for `--distill-steps` steps (gpu 400, cpu 120: about (c)'s wall time) with the trunk cache; with
   `--trunk-cache`, (a) once more from the trunk cache (`trunk_cache` in the JSON: the same acceptance, both
   times); `--distill-weighting greedy|sampled` weighs the distillation and TV variants' positions as a server
   feeds the MTP layer (`model.mtp_distill_weighting`);
5. every head on the same held-out prompts (gpu 64 x 128 new tokens, all decoded at once): greedy and sampled
   (T = 1, speculative sampling, prompt i seeded with i for every head) acceptance with one draft, the mean accepted
   length for K = 1..4 drafts, each with its 95% bootstrap interval over prompts (`speculative.stats`), tokens/s;
   paired differences between heads with their intervals (`comparisons`: every trained head against tv, (a), (c)
   and the joint head); each fit's wall time including its generation step. `mtp_quality.json` (`targets`: the
   issues' targets for the heads that ran) and `mtp_quality.png` (acceptance per head with its interval, the
   K = 1..4 accepted-length curves, validation acceptance by step).

Every training and generation step is a `lightning-megatron` run of a config from `configs/recipes/`. The GPU
defaults (300 joint steps, 120 MTP-only steps per variant, five variants) keep the run on one H200 near 12
minutes; every head sees the same model, data budget and steps, and its training time (generation included) is
reported beside it:
`--joint-steps` and `--mtp-only-steps` change them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lightning_megatron import _compat
from lightning_megatron.mtp.self_distill import DISTILL_WEIGHTINGS
from lightning_megatron.recipes import stdlib_corpus
from lightning_megatron.recipes.quality_report import comparisons, head_row, plot
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
MEASURE = {"gpu": {"prompts": 64, "max_new_tokens": 128, "device": "cuda", "corpus_seq_length": 1024,
                   "batch_size": 64},
           "cpu": {"prompts": 8, "max_new_tokens": 24, "device": "cpu", "corpus_seq_length": 128, "batch_size": 8}}
CORPUS_OVERRIDES = {"gpu": [], "cpu": ["--train-prompts", "64", "--heldout-prompts", "8"]}
DRAFT_TOKENS = (1, 2, 3, 4)  # 1: the greedy and sampled acceptance; 1..4: the accepted-length curve
STEPS = {"gpu": {"joint": 300, "mtp_only": 120}, "cpu": {}}  # cpu: the configs' own (CPU_OVERRIDES)


@dataclass(frozen=True)
class Variant:
    """One MTP-only fit of the reset head: its loss (`model.mtp_loss_type`), its data, and any further `model.*`
    setting. A new way to train the head is one more row of `VARIANTS`."""

    loss_type: Literal["labels", "self_distill", "tv", "tv_kl"]
    data: Literal["corpus", "continuations", "sampled_continuations"]
    summary: str
    model: Mapping[str, Any] = field(default_factory=dict)
    trunk_cache: bool = False  # later epochs read the frozen trunk's output from disk
    depth_one: str | None = None  # K-depth training: the variant of the same loss at depth 1 it is compared with

    @property
    def distills(self) -> bool:
        """Learns the main head's distribution (takes `model.mtp_distill_weighting`)."""
        return self.loss_type != "labels"


TV_HEADS = ("tv", "tv_kl", "tv_kl_sampled")  # the depth-1 heads trained on TV, the candidates for issue 42's target
# the data kinds made by a generation step: its temperature (0: greedy) and the timing it is reported under
GENERATED_DATA = {"continuations": (0.0, "generate_s"), "sampled_continuations": (1.0, "generate_sampled_s")}
LONG_VARIANT = "self_distill_long"
CACHED_VARIANT = "self_distill_trunk_cache"  # --trunk-cache: (a) again, later epochs from the frozen trunk's cache
VARIANTS: dict[str, Variant] = {
    "self_distill": Variant("self_distill", "corpus", "(a) self-distillation (KL to the main head), raw corpus"),
    "labels_corpus": Variant("labels", "corpus", "(b) hard labels, raw corpus"),
    "labels_continuations": Variant("labels", "continuations", "(c) hard labels, the model's greedy continuations"),
    "tv": Variant("tv", "corpus", "TV (1 - acceptance at T = 1), raw corpus"),
    "tv_kl": Variant("tv_kl", "corpus", "the KL/TV blend, raw corpus"),
    "tv_kl_sampled": Variant("tv_kl", "sampled_continuations",
                             "the KL/TV blend, the model's own samples at T = 1 (on-policy contexts)"),
    "self_distill_sampled": Variant("self_distill", "sampled_continuations",
                                    "(a), the model's own samples at T = 1 (on-policy contexts)"),
    # (a+): self-distillation for as many steps as (c)'s wall time pays for (--distill-steps)
    LONG_VARIANT: Variant("self_distill", "corpus", "(a+) (a) for (c)'s wall time", trunk_cache=True),
    CACHED_VARIANT: Variant("self_distill", "corpus", "(a) from the trunk cache", trunk_cache=True),
    # the one MTP layer trained at drafting depths 1..3 (`SFTModule(mtp_depths=3)`), each compared with its loss
    # at depth 1
    "tv_k3": Variant("tv", "corpus", "TV at drafting depths 1..3, one layer", model={"mtp_depths": 3},
                     depth_one="tv"),
    "tv_kl_k3": Variant("tv_kl", "corpus", "the KL/TV blend at drafting depths 1..3, one layer",
                        model={"mtp_depths": 3}, depth_one="tv_kl"),
    # equal depth weights gave depth 1 a third of the gradient and cost its acceptance (bench/results/
    # h100_2026-12-06c): halving each deeper depth's share keeps 4/7 on depth 1
    "tv_kl_k3_decay": Variant("tv_kl", "corpus", "the KL/TV blend at depths 1..3 weighted 4:2:1, one layer",
                              model={"mtp_depths": 3, "mtp_depth_weights": [4.0, 2.0, 1.0]}, depth_one="tv_kl"),
    "self_distill_k3": Variant("self_distill", "corpus", "(a) at drafting depths 1..3, one layer",
                               model={"mtp_depths": 3}, depth_one="self_distill"),
    "self_distill_k3_decay": Variant("self_distill", "corpus", "(a) at depths 1..3 weighted 4:2:1, one layer",
                                     model={"mtp_depths": 3, "mtp_depth_weights": [4.0, 2.0, 1.0]},
                                     depth_one="self_distill"),
}
CHOOSABLE = tuple(name for name in VARIANTS if name != CACHED_VARIANT)
DEFAULT_VARIANTS = {"gpu": ("self_distill", "labels_continuations", "tv", "tv_kl", "tv_k3"),
                    "cpu": ("self_distill", "labels_continuations", "tv")}
# (a+)'s steps: (c) pays for its generation step (86 s of 150 on the H200, 16 s of 34 on the CPU); with the trunk
# cache (a)'s later epochs cost a fraction of the first, so (a+) takes about (c)'s wall time
LONG_STEPS = {"gpu": 400, "cpu": 120}
SAMPLED_ACCEPTANCE_TARGET = 0.82  # issue 42: the best TV head's sampled acceptance (T = 1)
DEPTHS_ACCEPTED_LENGTH_TARGET = 2.7  # issue 42: K-depth training's sampled accepted length at K = 3


def main(argv: list[str] | None = None) -> int:
    _compat.quiet_handled_warnings()
    parser = argparse.ArgumentParser(prog="python -m lightning_megatron.recipes.mtp_quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", choices=("cpu", "gpu"), default="gpu")
    parser.add_argument("--joint-steps", type=int, default=None,
                        help=f"joint SFT + MTP steps (gpu default {STEPS['gpu']['joint']})")
    parser.add_argument("--mtp-only-steps", type=int, default=None,
                        help=f"steps of each MTP-only fit (gpu default {STEPS['gpu']['mtp_only']})")
    parser.add_argument("--trunk-cache", action="store_true",
                        help="also run (a) again with MTPOnlyCallback(trunk_cache_dir=...): later epochs read the "
                        "frozen trunk's output from disk; reported beside (a): the same acceptance, the time each took")
    parser.add_argument("--distill-temperature", type=float, default=1.0,
                        help="(a)'s and (a+)'s teacher temperature (model.mtp_distill_temperature): below 1 sharpens "
                        "the main head's distribution toward its argmax, which greedy acceptance rewards")
    parser.add_argument("--variants", nargs="+", choices=CHOOSABLE, default=None,
                        help="the MTP-only fits to run, in this order (default: gpu "
                        f"{' '.join(DEFAULT_VARIANTS['gpu'])}; cpu {' '.join(DEFAULT_VARIANTS['cpu'])}); "
                        f"{LONG_VARIANT} is (a+): (a) for --distill-steps steps with the trunk cache")
    parser.add_argument("--distill-steps", type=int, default=None,
                        help=f"(a+)'s steps (gpu default {LONG_STEPS['gpu']}, cpu {LONG_STEPS['cpu']}: about (c)'s "
                        "wall time including its generation step)")
    parser.add_argument("--sample-prompts", type=int, default=None,
                        help="training prompts whose continuations the variants trained on generated data ((c), "
                        "tv_kl_sampled, self_distill_sampled) learn from, each continued by 128 tokens (gpu default "
                        "1024: the corpus's train_prompts); more prompts, more distinct contexts, a longer generation")
    parser.add_argument("--distill-weighting", choices=DISTILL_WEIGHTINGS, default="uniform",
                        help="the distillation and TV variants' model.mtp_distill_weighting: weigh each position by "
                        "how a server feeds the MTP layer its input token (greedy: only the main head's argmax; "
                        "sampled: by its probability)")
    args = parser.parse_args(argv)
    for flag, value in (("--joint-steps", args.joint_steps), ("--mtp-only-steps", args.mtp_only_steps),
                        ("--distill-steps", args.distill_steps), ("--sample-prompts", args.sample_prompts)):
        if value is not None and value < 1:
            parser.error(f"{flag}: {value} must be at least 1 (leave it out for the size's default)")
    if not (math.isfinite(args.distill_temperature) and args.distill_temperature > 0):
        parser.error(f"--distill-temperature: {args.distill_temperature} must be finite and > 0 (1.0: the main "
                     "head's own distribution)")
    out, size = args.out.resolve(), args.size
    chosen = list(dict.fromkeys(args.variants or DEFAULT_VARIANTS[size]))
    if args.trunk_cache and "self_distill" not in chosen:
        parser.error("--trunk-cache compares with (a): add self_distill to --variants")
    if args.distill_temperature != 1.0 and not any(VARIANTS[name].loss_type == "self_distill" for name in chosen):
        parser.error(f"--distill-temperature {args.distill_temperature} is (a)'s and (a+)'s teacher temperature, and "
                     f"neither runs: add self_distill or {LONG_VARIANT} to --variants, or leave it out")
    if args.sample_prompts is not None and not any(VARIANTS[name].data in GENERATED_DATA for name in chosen):
        parser.error(f"--sample-prompts {args.sample_prompts} sizes the generated data, and no variant trained on it "
                     "runs: add labels_continuations, tv_kl_sampled or self_distill_sampled to --variants, or leave "
                     "it out")
    if args.distill_weighting != "uniform" and not any(VARIANTS[name].distills for name in chosen):
        parser.error(f"--distill-weighting {args.distill_weighting} weighs the distillation and TV variants' "
                     "positions, and none runs: add one to --variants, or leave it out")
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    timings: dict[str, float] = {}
    steps = {"joint": args.joint_steps or STEPS[size].get("joint"),
             "mtp_only": args.mtp_only_steps or STEPS[size].get("mtp_only")}

    def step(name: str, since: float) -> float:
        now = time.perf_counter()
        timings[name] = round(now - since, 1)
        return now

    clock = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # its summary: the files are what the steps below read
        stdlib_corpus.main([str(out), "--size", size, *CORPUS_OVERRIDES[size],
                            *(["--train-prompts", str(args.sample_prompts)] if args.sample_prompts else [])])
    corpus, model = out / "corpus", out / "model"
    clock = step("corpus_s", clock)
    measure = MEASURE[size]
    held_out = [row["prompt"] for row in read_jsonl(corpus / "heldout_prompts.jsonl")][: measure["prompts"]]

    def config(source: str, name: str, overrides: dict[str, Any]) -> Path:
        merged = {**(CPU_OVERRIDES[source] if size == "cpu" else {}), **overrides}
        return derived_config(f"recipes/{source}", out / f"{name}.yaml", merged)

    def measured(name: str, checkpoint: Path, draft_tokens: tuple[int, ...] = DRAFT_TOKENS) -> dict[str, Any]:
        print(f"      measuring {name} on {len(held_out)} held-out prompts", flush=True)
        return acceptance(checkpoint, held_out, measure["max_new_tokens"], out / f"acceptance_{name}",
                          measure["device"], draft_tokens, batch_size=measure["batch_size"], progress=sys.stderr)

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
    names = (*chosen, *((CACHED_VARIANT,) if args.trunk_cache else ()))
    generated: dict[float, tuple[Path, Path]] = {}  # by temperature: each variant of that data pays for it once
    for name in names:
        variant, since = VARIANTS[name], time.perf_counter()
        if variant.data in GENERATED_DATA:
            temperature, timing = GENERATED_DATA[variant.data]
            if temperature not in generated:
                generated[temperature] = own_continuations(out, corpus, restored, config, temperature)
                timings[timing] = round(time.perf_counter() - since, 1)
            train, val = generated[temperature]
        else:
            train, val = corpus / "train.jsonl", corpus / "val.jsonl"
        variant_steps = (args.distill_steps or LONG_STEPS[size]) if name == LONG_VARIANT else steps["mtp_only"]
        run = out / name
        run_cli("fit", config("stdlib_mtp_only.yaml", name, {
            "trainer.strategy.init_args.hf_checkpoint": str(restored), "trainer.default_root_dir": str(run),
            "trainer.logger.0.init_args.save_dir": str(run), "trainer.callbacks.3.init_args.dirpath": str(run / "hf"),
            "data.train_path": str(train), "data.val_path": str(val), "model.mtp_loss_type": variant.loss_type,
            **({"model.mtp_distill_temperature": args.distill_temperature}
               if variant.loss_type == "self_distill" else {}),
            **({"model.mtp_distill_weighting": args.distill_weighting} if variant.distills else {}),
            **{f"model.{key}": value for key, value in variant.model.items()},
            "trainer.limit_val_batches": 4,
            **({"data.seq_length": measure["corpus_seq_length"]} if variant.data == "corpus" else {}),
            **({"trainer.callbacks.0": {"class_path": "lightning_megatron.callbacks.MTPOnlyCallback",
                                        "init_args": {"trunk_cache_dir": str(out / f"cache_{name}")}}}
               if variant.trunk_cache else {}),
            **({"trainer.max_steps": variant_steps} if variant_steps else {}),
        }), f"[{3 if variant.data == 'corpus' else 4}/5] MTP-only fit ({name}: {variant.summary})")
        train_seconds[name] = round(time.perf_counter() - since, 1)
        clock = step(f"{name}_train_s", since)
        results[name] = measured(name, run / "hf")
        clock = step(f"measure_{name}_s", clock)

    summary = _summary(results, size, train_seconds, {name: _curves(out / name) for name in names},
                       _curves(joint), [json.loads((out / name / "mtp_only_audit.json").read_text()) for name in names])
    summary["measure"] = {key: measure[key] for key in ("prompts", "max_new_tokens", "batch_size")}
    summary["measure"]["draft_tokens"] = list(DRAFT_TOKENS)
    summary["variants"] = {name: VARIANTS[name].summary for name in names}
    summary["seconds"] = {**timings, "total_s": round(time.perf_counter() - started, 1)}
    summary["command"] = " ".join(["python3 -m lightning_megatron.recipes.mtp_quality", *(argv or sys.argv[1:])])
    summary["distill_temperature"] = args.distill_temperature
    summary["distill_weighting"] = args.distill_weighting
    (out / "mtp_quality.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(summary).savefig(out / "mtp_quality.png", dpi=100)
    print(json.dumps({key: summary[key] for key in ("targets", "seconds")}, indent=2))
    print(_table(summary))
    print(f"wrote {out / 'mtp_quality.json'} and {out / 'mtp_quality.png'}")
    return 0 if summary["greedy_identical_throughout"] and summary["frozen_bit_identical"] else 1


def own_continuations(out: Path, corpus: Path, restored: Path, config: Any,
                      temperature: float = 0.0) -> tuple[Path, Path]:
    """The generation step of the variants trained on the frozen model's own continuations of train and held-out
    prompts, as SFT rows: greedy ones ((c)) at temperature 0, samples above it (`predict`'s default seed)."""
    train_prompts = read_jsonl(corpus / "train_prompts.jsonl")
    held_out_rows = read_jsonl(corpus / "heldout_prompts.jsonl")
    prompts = write_jsonl(out / "prompts.jsonl", train_prompts + held_out_rows)
    name = "continuations" if temperature == 0 else f"continuations_t{temperature:g}"
    continuations = out / f"{name}.jsonl"
    run_cli("predict", config("stdlib_generate.yaml", f"generate_{name}", {
        "trainer.strategy.init_args.hf_checkpoint": str(restored), "trainer.default_root_dir": str(out / "generate"),
        "trainer.callbacks.0.init_args.output_path": str(continuations), "data.predict_path": str(prompts),
        "model.generation_temperature": temperature,
    }), f"[4/5] the frozen model's own {'greedy continuations' if temperature == 0 else 'samples'}, for "
        f"{'(c)' if temperature == 0 else 'the variants trained on them'}")
    held_out_texts = {row["prompt"] for row in held_out_rows}
    rows = read_jsonl(continuations)
    return (write_jsonl(out / f"{name}_train.jsonl", [r for r in rows if r["prompt"] not in held_out_texts]),
            write_jsonl(out / f"{name}_heldout.jsonl", [r for r in rows if r["prompt"] in held_out_texts]))


def export_without_mtp(source: Path, target: Path) -> Path:
    """The user's mistake to recover from: an HF export of the trained model with the MTP head disabled."""
    from lightning_megatron.bridges import create_bridge
    from lightning_megatron.distributed import init_single_process
    from lightning_megatron.options import ModelOptions

    init_single_process()
    bridge = create_bridge("megatron-bridge", source)
    return bridge.save_hf(bridge.build(ModelOptions(mtp=False)), target)


def _curves(run: Path) -> dict[str, Any]:
    return json.loads(next(run.glob("csv/version_*/curves.json")).read_text())


def _summary(results: dict[str, Any], size: str, train_seconds: dict[str, float], curves: dict[str, dict],
             joint_curves: dict, audits: list[dict]) -> dict[str, Any]:
    heads = {name: head_row(result) for name, result in results.items()}
    for variant, seconds in train_seconds.items():
        heads[variant]["train_s_including_generation"] = seconds
    compared = comparisons(results)
    return {
        "size": size,
        "heads": heads,
        "comparisons": compared,
        "targets": {**_targets(heads), **_tv_targets(heads, compared), **_depth_targets(heads, compared)},
        "greedy_identical_throughout": all(result["all_identical"] for result in results.values()),
        "frozen_bit_identical": all(audit["frozen_bit_identical"] for audit in audits),
        "joint_val_lm_loss": joint_curves.get("val_lm_loss", []),
        "val_mtp_acceptance_by_step": {name: curve.get("val_mtp_acceptance", []) for name, curve in curves.items()},
        "val_mtp_sampled_acceptance_by_step": {name: curve.get("val_mtp_sampled_acceptance", [])
                                               for name, curve in curves.items()},
        "per_prompt": {name: result["by_draft_tokens"] for name, result in results.items()},
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


def _tv_targets(heads: dict[str, Any], compared: dict[str, Any]) -> dict[str, Any]:
    """Issue 42's targets for the better of the TV heads that ran (by sampled acceptance): at least
    `SAMPLED_ACCEPTANCE_TARGET`, above (a) with the paired interval excluding zero, and greedy acceptance within
    (c)'s interval or above it."""
    tv_heads = [name for name in TV_HEADS if name in heads]
    if not tv_heads:
        return {}
    best = max(tv_heads, key=lambda name: heads[name]["sampled_acceptance"] or 0.0)
    targets: dict[str, Any] = {"tv_best": best, "tv_best_sampled_at_least_target":
                               (heads[best]["sampled_acceptance"] or 0.0) >= SAMPLED_ACCEPTANCE_TARGET}
    if f"{best} - self_distill" in compared:
        low = compared[f"{best} - self_distill"]["sampled_acceptance"]["low"]
        targets["tv_best_sampled_above_self_distill_paired"] = low is not None and low > 0
    if "labels_continuations" in heads:
        low = heads["labels_continuations"]["greedy_acceptance_interval"][0]
        targets["tv_best_greedy_within_or_above_continuations"] = (
            low is not None and (heads[best]["greedy_acceptance"] or 0.0) >= low)
    return targets


def _depth_targets(heads: dict[str, Any], compared: dict[str, Any]) -> dict[str, Any]:
    """Issue 42's targets for each K-depth variant that ran (`Variant.depth_one`): a K = 3 sampled accepted length
    of at least `DEPTHS_ACCEPTED_LENGTH_TARGET`, above its loss at depth 1 with the paired interval excluding
    zero (where that ran too)."""
    targets: dict[str, Any] = {}
    for name, variant in VARIANTS.items():
        if variant.depth_one is None or name not in heads:
            continue
        targets[f"{name}_sampled_length_k3_at_least_target"] = (
            (heads[name].get("sampled_accepted_length_k3") or 0.0) >= DEPTHS_ACCEPTED_LENGTH_TARGET)
        paired = compared.get(f"{name} - {variant.depth_one}", {}).get("sampled_accepted_length_k3")
        if paired is not None:
            targets[f"{name}_sampled_length_k3_above_{variant.depth_one}_paired"] = (
                paired["low"] is not None and paired["low"] > 0)
    return targets


def _trunk_cache_comparison(heads: dict[str, Any]) -> dict[str, Any]:
    """(a) trained again from the trunk cache: the same head (acceptance) in less time."""
    plain, cached = heads["self_distill"], heads[CACHED_VARIANT]
    measured = ("greedy_acceptance", "sampled_acceptance", "greedy_accepted_length_k3", "sampled_accepted_length_k3")
    return {"same_acceptance": all(plain[key] == cached[key] for key in measured),
            "train_s": plain["train_s_including_generation"],
            "train_s_with_trunk_cache": cached["train_s_including_generation"]}


def _table(summary: dict[str, Any]) -> str:
    """Each head's figures with their intervals, and training time, as a Markdown table."""
    def cell(row: dict[str, Any], key: str, digits: int) -> str:
        value, (low, high) = row.get(key), row.get(f"{key}_interval", [None, None])
        if value is None:
            return "-"
        return f"{value:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]" if low is not None else f"{value:.{digits}f}"

    lines = ["| head | greedy | sampled (T = 1) | sampled alpha on its texts: every / drafted position | "
             "K = 3 greedy length | K = 3 sampled length | train s |",
             "|---|---|---|---|---|---|---|"]
    for name, row in summary["heads"].items():
        alphas = " / ".join(cell(row, f"sampled_teacher_forced_{which}", 3) for which in ("every_position", "drafted"))
        lines.append(f"| {name} | {cell(row, 'greedy_acceptance', 3)} | {cell(row, 'sampled_acceptance', 3)} | "
                     f"{alphas} | {cell(row, 'greedy_accepted_length_k3', 2)} | "
                     f"{cell(row, 'sampled_accepted_length_k3', 2)} | {row.get('train_s_including_generation', '-')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
