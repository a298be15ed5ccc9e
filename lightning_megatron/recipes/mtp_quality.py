"""The MTP quality benchmark: acceptance of a jointly trained head, lost, and recovered by MTP-only training.

    python -m lightning_megatron.recipes.mtp_quality OUT --size gpu    # one H200, about 6 minutes
    python -m lightning_megatron.recipes.mtp_quality OUT --size cpu    # the test suite's version, 2 CPU cores

1. corpus, tokenizer and a random-init Qwen3+MTP checkpoint from the Python standard library (`stdlib_corpus`);
2. joint SFT + MTP (`configs/recipes/stdlib_joint.yaml`, MTP head detached: `mtp_detach_heads: true`) -> A_joint
   on held-out prompts;
3. the head is lost the way it happens to users: an HF export with MTP disabled, then
   `lightning-megatron-restore-mtp --init random` (the README's recipe) -> A_reset;
4. the frozen model's own greedy continuations (`stdlib_generate.yaml`), MTP-only fit on them
   (`stdlib_mtp_only.yaml`, MTPOnlyCallback audit) -> A_recovered;
5. speculative vs plain greedy tokens/s for each head; `mtp_quality.json` and `mtp_quality.png`.

Every training and generation step is a `lightning-megatron` run of a config from `configs/recipes/`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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
MEASURE = {"gpu": {"prompts": 24, "max_new_tokens": 64, "device": "cuda"},
           "cpu": {"prompts": 8, "max_new_tokens": 24, "device": "cpu"}}
CORPUS_OVERRIDES = {"gpu": [], "cpu": ["--train-prompts", "64", "--heldout-prompts", "8"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_megatron.recipes.mtp_quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", choices=("cpu", "gpu"), default="gpu")
    args = parser.parse_args(argv)
    out, size = args.out.resolve(), args.size
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    timings: dict[str, float] = {}

    def step(name: str, since: float) -> float:
        now = time.perf_counter()
        timings[name] = round(now - since, 1)
        return now

    clock = time.perf_counter()
    subprocess.run([sys.executable, "-m", "lightning_megatron.recipes.stdlib_corpus", str(out), "--size", size,
                    *CORPUS_OVERRIDES[size]],
                   check=True, stdout=subprocess.DEVNULL)
    corpus, model = out / "corpus", out / "model"
    clock = step("corpus_s", clock)
    measure = MEASURE[size]
    held_out = [row["prompt"] for row in read_jsonl(corpus / "heldout_prompts.jsonl")][: measure["prompts"]]

    def config(source: str, overrides: dict[str, Any]) -> Path:
        merged = {**(CPU_OVERRIDES[source] if size == "cpu" else {}), **overrides}
        return derived_config(f"recipes/{source}", out / source, merged)

    joint = out / "joint"
    run_cli("fit", config("stdlib_joint.yaml", {
        "trainer.strategy.init_args.hf_checkpoint": str(model), "trainer.default_root_dir": str(joint),
        "trainer.logger.0.init_args.save_dir": str(joint), "trainer.callbacks.2.init_args.dirpath": str(joint / "hf"),
        "data.train_path": str(corpus / "train.jsonl"), "data.val_path": str(corpus / "val.jsonl"),
    }), "[1/4] joint SFT + MTP")
    clock = step("joint_fit_s", clock)
    results: dict[str, Any] = {"joint": acceptance(joint / "hf", held_out, measure["max_new_tokens"],
                                                   out / "acceptance_joint", measure["device"])}
    clock = step("measure_joint_s", clock)

    export_without_mtp(joint / "hf", out / "no_mtp")
    restored = out / "restored"
    subprocess.run([sys.executable, "-m", "lightning_megatron.cli.restore_mtp", str(out / "no_mtp"), str(restored),
                    "--init", "random", "--seed", "1"], check=True, stdout=subprocess.DEVNULL)
    print(f"[2/4] exported without MTP, head restored at random: {restored}", flush=True)
    results["reset"] = acceptance(restored, held_out, measure["max_new_tokens"], out / "acceptance_reset",
                                  measure["device"])
    clock = step("reset_and_measure_s", clock)

    train_prompts = read_jsonl(corpus / "train_prompts.jsonl")
    held_out_rows = read_jsonl(corpus / "heldout_prompts.jsonl")
    prompts = write_jsonl(out / "prompts.jsonl", train_prompts + held_out_rows)
    continuations = out / "continuations.jsonl"
    run_cli("predict", config("stdlib_generate.yaml", {
        "trainer.strategy.init_args.hf_checkpoint": str(restored), "trainer.default_root_dir": str(out / "generate"),
        "trainer.callbacks.0.init_args.output_path": str(continuations), "data.predict_path": str(prompts),
    }), "[3/4] the frozen model's own continuations")
    held_out_texts = {row["prompt"] for row in held_out_rows}
    rows = read_jsonl(continuations)
    train_file = write_jsonl(out / "continuations_train.jsonl", [r for r in rows if r["prompt"] not in held_out_texts])
    val_file = write_jsonl(out / "continuations_heldout.jsonl", [r for r in rows if r["prompt"] in held_out_texts])
    clock = step("generate_s", clock)

    mtp_only = out / "mtp_only"
    run_cli("fit", config("stdlib_mtp_only.yaml", {
        "trainer.strategy.init_args.hf_checkpoint": str(restored), "trainer.default_root_dir": str(mtp_only),
        "trainer.logger.0.init_args.save_dir": str(mtp_only),
        "trainer.callbacks.3.init_args.dirpath": str(mtp_only / "hf"),
        "data.train_path": str(train_file), "data.val_path": str(val_file),
    }), "[4/4] MTP-only fit on them")
    clock = step("mtp_only_fit_s", clock)
    results["recovered"] = acceptance(mtp_only / "hf", held_out, measure["max_new_tokens"],
                                      out / "acceptance_recovered", measure["device"])
    step("measure_recovered_s", clock)

    curves = json.loads(next(mtp_only.glob("csv/version_*/curves.json")).read_text())
    joint_curves = json.loads(next(joint.glob("csv/version_*/curves.json")).read_text())
    summary = _summary(results, size, curves, joint_curves, json.loads((mtp_only / "mtp_only_audit.json").read_text()))
    summary["seconds"] = {**timings, "total_s": round(time.perf_counter() - started, 1)}
    (out / "mtp_quality.json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot(summary, curves).savefig(out / "mtp_quality.png", dpi=100)
    print(json.dumps(summary["acceptance"], indent=2))
    print(f"wrote {out / 'mtp_quality.json'} and {out / 'mtp_quality.png'}")
    return 0 if summary["greedy_identical_throughout"] and summary["frozen_bit_identical"] else 1


def export_without_mtp(source: Path, target: Path) -> Path:
    """The user's mistake to recover from: an HF export of the trained model with the MTP head disabled."""
    from lightning_megatron.bridges import create_bridge
    from lightning_megatron.distributed import init_single_process
    from lightning_megatron.options import ModelOptions

    init_single_process()
    bridge = create_bridge("megatron-bridge", source)
    return bridge.save_hf(bridge.build(ModelOptions(mtp=False)), target)


def _summary(results: dict[str, Any], size: str, curves: dict, joint_curves: dict, audit: dict) -> dict[str, Any]:
    rates = {name: result["acceptance_rate"] for name, result in results.items()}
    return {
        "size": size,
        "acceptance": {f"A_{name}": rate for name, rate in rates.items()},
        "recovered_over_joint": rates["recovered"] / rates["joint"] if rates["joint"] else None,
        "target_recovered_over_joint": 0.9,
        "mean_accepted_length": {name: result["mean_accepted_length"] for name, result in results.items()},
        "tokens_per_s": {name: {"speculative": result["speculative_tokens_per_s"],
                                "greedy": result["greedy_tokens_per_s"], "speedup": result["speedup"]}
                         for name, result in results.items()},
        "greedy_identical_throughout": all(result["all_identical"] for result in results.values()),
        "frozen_bit_identical": audit["frozen_bit_identical"],
        "joint_val_lm_loss": joint_curves.get("val_lm_loss", []),
        "mtp_only_val_acceptance_by_step": curves.get("val_mtp_acceptance", []),
        "prompts": results["joint"]["prompts"],
    }


def _plot(summary: dict[str, Any], curves: dict):
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4), layout="constrained")
    by_step, bars = figure.subplots(1, 2)
    if curves.get("val_mtp_acceptance"):
        x, y = zip(*curves["val_mtp_acceptance"])
        by_step.plot(x, y, marker="o", label="val_mtp_acceptance (teacher-forced, own continuations)")
    for name, style in (("A_joint", "--"), ("A_reset", ":"), ("A_recovered", "-.")):
        by_step.axhline(summary["acceptance"][name], linestyle=style, color="gray", label=f"{name} (decoding)")
    by_step.set(xlabel="MTP-only optimizer step", ylabel="acceptance", ylim=(0, 1), title="acceptance recovery")
    by_step.legend(fontsize=7)
    names = list(summary["acceptance"])
    bars.bar(names, [summary["acceptance"][name] for name in names], color=["tab:blue", "tab:red", "tab:green"])
    bars.set(ylim=(0, 1), ylabel="accepted drafts / drafts", title="speculative decoding, held-out prompts")
    return figure


if __name__ == "__main__":
    sys.exit(main())
