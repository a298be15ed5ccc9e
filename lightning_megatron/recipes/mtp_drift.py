"""The RL drift benchmark: does a draft head go stale while the policy moves, and what does keeping it good cost?

    python -m lightning_megatron.recipes.mtp_drift OUT --size gpu    # one H100 or H200, about 20 minutes
    python -m lightning_megatron.recipes.mtp_drift OUT --size cpu    # the test suite's version, 2 CPU cores

A stand-in for an RL loop that moves the policy as RL does, round by round on data that shift: the stdlib corpus
(`stdlib_corpus`) cut into `rounds` domains (contiguous runs of files), each round one SFT fit of the policy on
the next domain. Before the rounds: a joint SFT + MTP fit (the released model with its head), then two MTP-only fits
of its head: self-distillation (`self_distill`) and the acceptance loss (`--best-loss`, default `tv_kl`). The head is
then handled four ways, every round:
- `frozen`: the self-distilled head, never trained again;
- `joint`: the policy's rounds run with the MTP loss on (detached heads: the policy is the same), from that head;
- `refresh`: after each round's policy fit, a short MTP-only fit (`--refresh-steps`) of the last round's head on
  the round's data, trunk cache off (the trunk changes every round);
- `best_loss_frozen`: the `--best-loss` head, never trained again;
and `converged`, the yardstick: after each round a long MTP-only fit (`--converged-steps`) of the last round's
converged head: a head refreshed to convergence. Every way's checkpoint of a round is the same policy (the round's
trunk, exported without MTP, with that way's head restored by `restore_mtp_head`), except `joint`'s, which trains
its own copy. Per round and way: greedy and sampled (T = 1) acceptance by speculative decoding on the held-out
prompts (the evaluator, with intervals over prompts), the training time the head cost beyond the policy's own fit,
and the disk syncs the way needs, each with and without a delta (the bytes that differ from the version before,
found by comparing the tensors; the time of writing them, the rest hard-linked, against writing every tensor).
Writes `mtp_drift.json` after every round, atomically (`rounds_done`; `statement`: the cheapest way within
`TOLERANCE` of the converged head's sampled acceptance in every round so far, and how far the frozen head fell), and
`mtp_drift.png` at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from lightning_megatron import _compat
from lightning_megatron.atomic import write_text_atomically
from lightning_megatron.mtp.restore import restore_mtp_head
from lightning_megatron.recipes import stdlib_corpus
from lightning_megatron.recipes.mtp_quality import CORPUS_OVERRIDES, CPU_OVERRIDES, MEASURE, export_without_mtp
from lightning_megatron.recipes.quality_report import head_row
from lightning_megatron.recipes.steps import acceptance, derived_config, read_jsonl, run_cli, write_jsonl

WAYS = ("frozen", "joint", "refresh", "best_loss_frozen")
CONVERGED = "converged"
TOLERANCE = 0.02  # issue 43: "within 0.02 of a head refreshed to convergence"
STEPS = {"gpu": {"base": 300, "initial_head": 120, "round": 60, "refresh": 20, "converged": 120},
         "cpu": {"base": 40, "initial_head": 20, "round": 12, "refresh": 6, "converged": 20}}
ROUNDS = {"gpu": 3, "cpu": 2}  # gpu: about 20 minutes on one H100 (fits of 25-130 s, 25 s a measurement)


def main(argv: list[str] | None = None) -> int:
    _compat.quiet_handled_warnings()
    parser = argparse.ArgumentParser(prog="python -m lightning_megatron.recipes.mtp_drift", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", choices=("cpu", "gpu"), default="gpu")
    parser.add_argument("--rounds", type=int, default=None, help="policy rounds (gpu 3, cpu 2)")
    for name in STEPS["gpu"]:
        parser.add_argument(f"--{name.replace('_', '-')}-steps", type=int, default=None,
                            help=f"steps of each {name.replace('_', ' ')} fit (gpu {STEPS['gpu'][name]}, "
                            f"cpu {STEPS['cpu'][name]})")
    parser.add_argument("--best-loss", choices=("tv", "tv_kl", "self_distill"), default="tv_kl",
                        help="the loss of the best_loss_frozen head (default tv_kl: the acceptance loss that kept up "
                        "with self-distillation in the quality recipe, docs/mtp_quality.md)")
    args = parser.parse_args(argv)
    size, out = args.size, args.out.resolve()
    given = {"--rounds": args.rounds, **{f"--{name.replace('_', '-')}-steps": getattr(args, f"{name}_steps")
                                         for name in STEPS[size]}}
    for flag, value in given.items():
        if value is not None and value < 1:
            parser.error(f"{flag}: {value} must be at least 1 (leave it out for the size's default)")
    rounds = ROUNDS[size] if args.rounds is None else args.rounds
    steps = {name: STEPS[size][name] if getattr(args, f"{name}_steps") is None else getattr(args, f"{name}_steps")
             for name in STEPS[size]}
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        stdlib_corpus.main([str(out), "--size", size, *CORPUS_OVERRIDES[size]])
    corpus, measure = out / "corpus", MEASURE[size]
    domains = _domains(corpus / "train.jsonl", rounds + 1, out / "domains")  # 0: the initial heads' data
    held_out = [row["prompt"] for row in read_jsonl(corpus / "heldout_prompts.jsonl")][: measure["prompts"]]
    fits = _Fits(out, size, corpus)

    def measured(name: str, checkpoint: Path) -> dict[str, Any]:
        report = acceptance(checkpoint, held_out, measure["max_new_tokens"], out / f"acceptance_{name}",
                            measure["device"], (1,), batch_size=measure["batch_size"], progress=sys.stderr)
        row = head_row(report)
        return {key: row[key] for key in ("greedy_acceptance", "greedy_acceptance_interval", "sampled_acceptance",
                                          "sampled_acceptance_interval")}

    base = fits.joint("base", out / "model", corpus / "train.jsonl", steps["base"], "[base] joint SFT + MTP")
    heads = {"frozen": fits.mtp_only("head_self_distill", base, domains[0], steps["initial_head"], "self_distill"),
             "best_loss_frozen": fits.mtp_only("head_best_loss", base, domains[0], steps["initial_head"],
                                               args.best_loss)}
    heads["joint"] = heads["refresh"] = heads[CONVERGED] = heads["frozen"]
    trunk = export_without_mtp(base, out / "trunk_0")
    rows: list[dict[str, Any]] = [{"round": 0, "acceptance": {way: measured(f"r0_{way}", heads[way])
                                                              for way in ("frozen", "best_loss_frozen")}}]
    rows[0]["acceptance"].update({way: rows[0]["acceptance"]["frozen"] for way in ("joint", "refresh", CONVERGED)})
    for index in range(1, rounds + 1):
        data, row = domains[index], {"round": index}
        policy_s = time.perf_counter()
        trunk = export_without_mtp(fits.policy(f"policy_{index}", trunk, data, steps["round"]), out / f"trunk_{index}")
        policy_s = time.perf_counter() - policy_s
        served = {way: restore_mtp_head(trunk, out / f"r{index}_{way}_start", source=heads[way])
                  for way in ("frozen", "best_loss_frozen", "refresh", CONVERGED)}
        seconds: dict[str, float] = {"frozen": 0.0, "best_loss_frozen": 0.0}
        clock = time.perf_counter()
        refreshed = fits.mtp_only(f"r{index}_refresh", served["refresh"], data, steps["refresh"], "self_distill")
        seconds["refresh"] = time.perf_counter() - clock
        clock = time.perf_counter()
        converged = fits.mtp_only(f"r{index}_converged", served[CONVERGED], data, steps["converged"], "self_distill")
        seconds[CONVERGED] = time.perf_counter() - clock
        clock = time.perf_counter()
        joint = fits.joint(f"r{index}_joint", heads["joint"], data, steps["round"], f"[round {index}] joint")
        seconds["joint"] = max(0.0, time.perf_counter() - clock - policy_s)  # beyond the policy's own fit
        syncs = {way: [_sync_cost(heads[way], served[way], out / "sync_scratch")]
                 for way in ("frozen", "best_loss_frozen")}
        syncs["refresh"] = [_sync_cost(heads["refresh"], served["refresh"], out / "sync_scratch"),
                            _sync_cost(served["refresh"], refreshed, out / "sync_scratch")]
        syncs["joint"] = [_sync_cost(heads["joint"], joint, out / "sync_scratch")]
        heads.update(refresh=refreshed, joint=joint, **{CONVERGED: converged},
                     frozen=served["frozen"], best_loss_frozen=served["best_loss_frozen"])
        row.update(policy_fit_s=round(policy_s, 1), extra_train_s={k: round(v, 1) for k, v in seconds.items()},
                   syncs=syncs, acceptance={way: measured(f"r{index}_{way}", heads[way])
                                            for way in (*WAYS, CONVERGED)})
        rows.append(row)
        summary = {"size": size, "rounds": rounds, "rounds_done": index, "steps": steps, "best_loss": args.best_loss,
                   "per_round": rows, "statement": statement(rows),
                   "measure": {key: measure[key] for key in ("prompts", "max_new_tokens")},
                   "seconds": round(time.perf_counter() - started, 1),
                   "command": " ".join(["python3 -m lightning_megatron.recipes.mtp_drift", *(argv or sys.argv[1:])])}
        write_text_atomically(out / "mtp_drift.json", json.dumps(summary, indent=2) + "\n")  # each round's kept
    plot(summary).savefig(out / "mtp_drift.png", dpi=100)
    print(json.dumps(summary["statement"], indent=2))
    print(f"wrote {out / 'mtp_drift.json'} and {out / 'mtp_drift.png'}")
    return 0


class _Fits:
    """The recipe's `lightning-megatron fit` runs, each from a config of `configs/recipes/` (CPU-sized on the CPU),
    exporting its HF checkpoint to `<name>/hf`."""

    def __init__(self, out: Path, size: str, corpus: Path) -> None:
        self.out, self.size, self.val = out, size, corpus / "val.jsonl"

    def _run(self, source: str, name: str, checkpoint: Path, data: Path, steps: int, overrides: dict[str, Any],
             export_callback: int, title: str) -> Path:
        run = self.out / name
        merged = {**(CPU_OVERRIDES[source] if self.size == "cpu" else {}),
                  "trainer.strategy.init_args.hf_checkpoint": str(checkpoint), "trainer.default_root_dir": str(run),
                  "trainer.logger.0.init_args.save_dir": str(run),
                  f"trainer.callbacks.{export_callback}.init_args.dirpath": str(run / "hf"),
                  "data.train_path": str(data), "data.val_path": str(self.val), "trainer.max_steps": steps,
                  "trainer.limit_val_batches": 2, **overrides}
        run_cli("fit", derived_config(f"recipes/{source}", self.out / f"{name}.yaml", merged), title)
        return run / "hf"

    def joint(self, name: str, checkpoint: Path, data: Path, steps: int, title: str) -> Path:
        return self._run("stdlib_joint.yaml", name, checkpoint, data, steps, {}, 2, title)

    def policy(self, name: str, trunk: Path, data: Path, steps: int) -> Path:
        """The round's policy update: SFT of the trunk alone (built without the MTP head)."""
        return self._run("stdlib_joint.yaml", name, trunk, data, steps, {"model.enable_mtp": False}, 2,
                         f"[{name}] policy SFT on a new domain")

    def mtp_only(self, name: str, checkpoint: Path, data: Path, steps: int, loss_type: str) -> Path:
        return self._run("stdlib_mtp_only.yaml", name, checkpoint, data, steps,
                         {"model.mtp_loss_type": loss_type, "model.warmup_steps": max(1, steps // 10)}, 3,
                         f"[{name}] MTP-only fit ({loss_type})")


def _domains(train: Path, count: int, folder: Path) -> list[Path]:
    """The train rows cut into `count` contiguous runs (the corpus lists them file by file, in path order, so
    each run is other modules' code: a shift of domain from round to round)."""
    rows = read_jsonl(train)
    folder.mkdir(parents=True, exist_ok=True)
    per_domain = max(1, len(rows) // count)
    return [write_jsonl(folder / f"domain_{index}.jsonl", rows[index * per_domain:(index + 1) * per_domain])
            for index in range(count)]


def _sync_cost(previous: Path, current: Path, scratch: Path) -> dict[str, Any]:
    """One disk sync from the version `previous` to `current`: every tensor written (full), against only the
    tensors whose bits differ written and the rest hard-linked (a delta)."""
    import torch
    from safetensors.torch import load_file

    from lightning_megatron.hf_io import write_shard_files

    def tensors(folder: Path) -> dict[str, torch.Tensor]:
        return {name: tensor for file in sorted(folder.glob("*.safetensors")) for name, tensor in
                load_file(file).items()}

    before, after = tensors(previous), tensors(current)
    changed = {name: tensor for name, tensor in after.items()
               if name not in before or not torch.equal(before[name], tensor)}
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    (scratch / "full").mkdir()
    (scratch / "delta").mkdir()
    clock = time.perf_counter()
    write_shard_files(scratch / "full", {"model.safetensors": after})
    full_s = time.perf_counter() - clock
    clock = time.perf_counter()
    write_shard_files(scratch / "delta", {"changed.safetensors": changed})
    for file in previous.glob("*.safetensors"):
        os.link(file, scratch / "delta" / file.name)
    delta_s = time.perf_counter() - clock
    shutil.rmtree(scratch, ignore_errors=True)
    return {"changed_tensors": len(changed), "full_bytes": sum(t.nbytes for t in after.values()),
            "delta_bytes": sum(t.nbytes for t in changed.values()), "full_s": round(full_s, 4),
            "delta_s": round(delta_s, 4)}


def statement(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The benchmark's answer: per way its largest shortfall against the converged head's sampled acceptance over
    the rounds and its total extra training time; the cheapest way within `TOLERANCE` in every round; how far the
    frozen head fell (first round's against the last's, and against the converged head at the end)."""
    rounds = [row for row in rows if row["round"] > 0]

    def sampled(row: dict[str, Any], way: str) -> float:
        return row["acceptance"][way]["sampled_acceptance"] or 0.0

    ways = {way: {"largest_shortfall": round(max(sampled(row, CONVERGED) - sampled(row, way) for row in rounds), 4),
                  "extra_train_s": round(sum(row["extra_train_s"][way] for row in rounds), 1)}
            for way in WAYS}
    within = [way for way, figures in ways.items() if figures["largest_shortfall"] <= TOLERANCE]
    cheapest = min(within, key=lambda way: ways[way]["extra_train_s"]) if within else None
    return {"ways": ways, "within_tolerance": within, "cheapest_within_tolerance": cheapest,
            "tolerance": TOLERANCE,
            "frozen_fall": round(sampled(rows[0], "frozen") - sampled(rows[-1], "frozen"), 4),
            "frozen_below_converged_at_end": round(sampled(rows[-1], CONVERGED) - sampled(rows[-1], "frozen"), 4)}


def plot(summary: dict[str, Any]) -> Any:
    """Sampled (solid) and greedy (dashed) acceptance per round for each way, its extra training time in the
    legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    rows, ways = summary["per_round"], summary["statement"]["ways"]
    rounds = [row["round"] for row in rows]
    for way in (*WAYS, CONVERGED):
        extra = ways[way]["extra_train_s"] if way in ways else sum(row.get("extra_train_s", {}).get(way, 0.0)
                                                                   for row in rows)
        line, = axis.plot(rounds, [row["acceptance"][way]["sampled_acceptance"] for row in rows], marker="o",
                          label=f"{way} (+{extra:.0f} s training)")
        axis.plot(rounds, [row["acceptance"][way]["greedy_acceptance"] for row in rows], linestyle="--",
                  color=line.get_color(), alpha=0.6)
    axis.set(xlabel="policy round", ylabel="acceptance (solid: sampled T = 1, dashed: greedy)",
             title="Draft head acceptance as the policy drifts")
    axis.set_xticks(rounds)
    axis.legend(fontsize=8)
    figure.tight_layout()
    return figure


if __name__ == "__main__":
    sys.exit(main())
