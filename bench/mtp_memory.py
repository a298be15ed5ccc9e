"""P2 on one GPU: what MTP-only training costs in memory and time, and what its peak is made of.

Two model shapes, each built with Megatron's random initialization straight on the GPU from a config-only
checkpoint (`ModelOptions(random_weights=True)`: no weights are written or read), bf16, distributed optimizer,
megatron-bridge, one MTP layer, seq 2048, random tokens, all in this one process:

- Qwen3-0.6B (tied), micro-batch 2 x 4: Lightning joint (`SFTModule(enable_mtp=True)`), Lightning MTP-only
  (`MTPOnlyCallback()`, its defaults: token-chunked cross-entropies, the main head only on the steps that log
  `lm_loss`, every `--log-every-n-steps`, the frozen trunk replayed from CUDA graphs on a GPU), the same with the
  trunk eager (`mtp_only_eager`: `cuda_graph_trunk=False`, what the graphs save), the same with the main head in
  every step
  (`log_lm_loss_every_n_steps=1`: what skipping it saves), the same with the self-distillation MTP loss
  (`mtp_loss_type="self_distill"`, issue 33's memory target: <= 0.25x joint), the same with whole-logits
  cross-entropy (`MTPOnlyCallback(loss_chunk_tokens=None)`, the previous implementation, the main head in every
  step), and the plain Megatron-Core MTP-only loop (`bench/megatron_loop.py`: every non-MTP parameter
  `requires_grad=False`, nothing else). Targets: MTP-only / joint peak memory <= 0.25, step time <= 0.42.
- Qwen3-8B (hidden 4096, 36 layers, 32/8 heads, FFN 12288, untied), micro-batch 1 x 4: the same but joint, the
  main head in every step and self-distillation. Targets: peak <= 23.6 GiB (the plain loop's figure in issue 21),
  step <= 0.348 s.

Each run reports tokens/s and MFU on the model FLOPs it really runs (`bench/common.py`): per timed step
`MTP_ONLY` where the main head ran and `MTP_ONLY_WITHOUT_MAIN_HEAD` where it was skipped (`main_head_steps`), plus
the teacher's vocabulary projection for self-distillation; joint `JOINT`.

Runs alternate in mirrored rounds (a, b, c, c, b, a) as in `bench/lightning_overhead.py`, whose run functions
these are: the median step time over the timed steps of all rounds, the training steps' peak memory
(`max_memory_allocated` reset when training starts; building the model and the audit's first checksums are kept
apart as `setup_peak_memory_gib`), each run's own: every run's model is released at its end and what was still
allocated when it started (`memory_at_start_gib`, ~0) is subtracted.

Breakdown: one more short MTP-only run per shape records PyTorch's allocator history
(`torch.cuda.memory._record_memory_history`) from before the model is built; its trace (`_snapshot()`) is replayed
to find the largest live total during the training steps, and the blocks live at that moment are grouped by the
innermost stack frame in megatron-core, lightning_megatron or bench. The JSON holds the table; the markdown
version goes to `--breakdown-md` (default: `mtp_memory_breakdown.md` beside `--out`).

Profile: one more short run per MTP-only arm (`mtp_only`, graphed, and `mtp_only_eager`) and shape profiles one
step with `torch.profiler` (`bench/packing_profile.py`'s `profile_figures`): the GPU-busy fraction of the step (the
union of device activity over the median un-profiled step time of that arm), kernels, kernel launches and graph
launches per step, synchronising calls, the top kernels and CPU operators (on the CPU, `--tiny`, only the host's
figures; the eager arm is profiled on a GPU only). Each MTP-only arm also reports `trunk_graphs`: per run, the
graphed decoder's warm-up, capture, replayed and eager calls (empty where the trunk ran eagerly, as on the CPU).

`--tiny`: the tiny Qwen3+MTP shape in fp32 on the CPU, a few steps (what tests/bench/ runs; no breakdown).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from bench.common import (
    QWEN3_0_6B,
    QWEN3_8B,
    TINY_SCRATCH_BYTES,
    emit,
    environment,
    fresh_memory,
    import_megatron_bridge_first,
    make_config_only_checkpoint,
    parse_with_tiny,
    scratch_dir,
)
from bench.flops import JOINT, MTP_ONLY, MTP_ONLY_WITHOUT_MAIN_HEAD, ModelShape, model_flops, peak_flops
from bench.lightning_overhead import Settings, run_lightning, run_plain, summarize
from bench.packing_profile import profile_figures, profiler
from lightning_megatron.atomic import write_text_atomically

GIB = 1024**3
MARKER_BYTES = 3 * 1024**2 + 7 * 512  # one allocation of this size marks where training starts in the trace
PROJECT_FRAMES = ("megatron/", "lightning_megatron/", "bench/")


@dataclass(frozen=True)
class ShapeRun:
    """One model shape: what to build, its batch, which variants run, and the targets they are held to."""

    name: str
    shape: dict[str, Any]
    tied: bool
    micro_batch: int
    microbatches: int
    variants: tuple[str, ...]
    targets: dict[str, float]


SHAPES = (
    ShapeRun("qwen3_0.6b", QWEN3_0_6B, tied=True, micro_batch=2, microbatches=4,
             variants=("joint", "mtp_only", "mtp_only_eager", "mtp_only_lm_loss_every_step",
                       "mtp_only_self_distill", "mtp_only_tv", "mtp_only_tv_kl", "mtp_only_whole_logits",
                       "plain_mtp_only"),
             targets={"mtp_only_over_joint_peak_memory": 0.25, "mtp_only_over_joint_step_time": 0.42,
                      "self_distill_over_joint_peak_memory": 0.25, "tv_over_self_distill_step_time": 1.1,
                      "tv_kl_over_self_distill_step_time": 1.1}),
    ShapeRun("qwen3_8b", QWEN3_8B, tied=False, micro_batch=1, microbatches=4,
             variants=("mtp_only", "mtp_only_eager", "mtp_only_whole_logits", "plain_mtp_only"),
             targets={"mtp_only_peak_memory_gib": 23.6, "mtp_only_step_s": 0.348}),
)
# MTP-only with a distillation loss (`SFTModule(mtp_loss_type=...)`): variant -> loss type
DISTILLATION = {"mtp_only_self_distill": "self_distill", "mtp_only_tv": "tv", "mtp_only_tv_kl": "tv_kl"}
TINY = dict(seq=32, steps=2, warmup=1, rounds=1, precision="fp32", breakdown_steps=0, log_every_n_steps=2)


def run_variant(variant: str, settings: Settings, vocab: int, callbacks: tuple[pl.Callback, ...] = ()
                ) -> dict[str, Any]:
    if variant == "plain_mtp_only":
        return run_plain(settings, vocab, mtp_only=True)
    if variant == "mtp_only_eager":
        return run_lightning(replace(settings, cuda_graph_trunk=False), vocab, mtp_only=True, callbacks=callbacks)
    if variant == "mtp_only_lm_loss_every_step":
        return run_lightning(replace(settings, log_lm_loss_every_n_steps=1), vocab, mtp_only=True,
                             callbacks=callbacks)
    if variant in DISTILLATION:
        return run_lightning(replace(settings, mtp_loss_type=DISTILLATION[variant]), vocab, mtp_only=True,
                             callbacks=callbacks)
    if variant == "mtp_only_whole_logits":
        return run_lightning(replace(settings, loss_chunk_tokens=None), vocab, mtp_only=True, callbacks=callbacks)
    return run_lightning(settings, vocab, mtp_only=variant == "mtp_only", callbacks=callbacks)


class RecordAllocations(pl.Callback):
    """Record the allocator's history from construction (before the model is built) to the end of training; mark
    where training starts with one allocation of `MARKER_BYTES`."""

    def __init__(self, max_entries: int = 2_000_000) -> None:
        self.baseline_bytes = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
        self.snapshot: dict[str, Any] | None = None
        self.max_memory_allocated: int | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.empty(MARKER_BYTES, dtype=torch.uint8, device="cuda")  # allocated and freed at once: the mark

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.cuda.synchronize()
        self.max_memory_allocated = torch.cuda.max_memory_allocated()
        self.snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)


class ProfileStep(pl.Callback):
    """`torch.profiler` over one training step (the one that starts at `trainer.global_step == step_index`), from
    its start to its synchronised end."""

    def __init__(self, step_index: int) -> None:
        self.step_index = step_index
        self.profile: Any = None
        self.profiled_s: float | None = None
        self._started: float | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_step == self.step_index:
            _synchronize()
            self.profile = profiler()
            self.profile.__enter__()
            self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._started is not None:
            _synchronize()
            self.profiled_s = time.perf_counter() - self._started
            self._started = None
            self.profile.__exit__(None, None, None)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_mtp_only(settings: Settings, vocab: int, step_s: float, variant: str = "mtp_only") -> dict[str, Any]:
    """One profiled step of an MTP-only arm, after two warm-up steps (both skipping the main head unless
    `log_every_n_steps` is 1 or 3; the trunk's graph is captured in the first), in a run of its own so the
    profiler's cost stays out of the timed runs."""
    fresh_memory()
    recorder = ProfileStep(step_index=2)
    result = run_variant(variant, replace(settings, steps=1, warmup=2), vocab, callbacks=(recorder,))
    figures = profile_figures(recorder.profile, recorder.profiled_s, step_s)
    return {**figures, "main_head_ran": result["main_head_steps"][2], "step_index": 2}


def step_flops(variant: str, run: dict[str, Any], shape: ModelShape, settings: Settings) -> float:
    """The mean model FLOPs of a run's timed steps: the main head counted only on the steps that ran it, the
    self-distillation teacher's vocabulary projection on every step."""
    if variant == "joint":
        return model_flops(shape, settings.global_batch, settings.seq, JOINT)
    main_head_steps = run.get("main_head_steps") or [True] * settings.total_steps  # the plain loop: every step
    teacher = int(variant in DISTILLATION)
    flops = []
    for main_head in main_head_steps[settings.warmup:]:
        passes = MTP_ONLY if main_head else MTP_ONLY_WITHOUT_MAIN_HEAD
        passes = replace(passes, main_head=passes.main_head + teacher)
        flops.append(model_flops(shape, settings.global_batch, settings.seq, passes))
    return sum(flops) / len(flops)


def _frame_label(frames: list[dict[str, Any]]) -> str:
    """The innermost frame in the project or megatron-core, as `path/from/package.py:line function`."""
    for frame in frames:
        filename = frame.get("filename", "")
        for marker in PROJECT_FRAMES:
            if marker in filename:
                return f"{filename[filename.index(marker):]}:{frame.get('line')} {frame.get('name')}"
    return "elsewhere (no megatron-core or project frame)"


def peak_breakdown(trace: list[dict[str, Any]], baseline_bytes: int = 0, marker_bytes: int = MARKER_BYTES,
                   top: int = 12) -> dict[str, Any]:
    """The largest live total after the marker allocation in an allocator trace (`_snapshot()["device_traces"]`
    of one device: `alloc` adds a block, `free_completed` removes it), and the blocks live then, grouped by
    allocating frame, largest first; `top` rows, the rest summed. `baseline_bytes`, allocated before recording
    started (by earlier runs, not this one), are reported apart and not counted in the peak."""

    def replay(stop: int | None = None) -> tuple[dict[int, dict[str, Any]], int, int]:
        live: dict[int, dict[str, Any]] = {}
        total, peak, peak_index, training = 0, -1, -1, False
        for index, event in enumerate(trace[:stop]):
            if event["action"] == "alloc":
                live[event["addr"]] = event
                total += event["size"]
                training |= event["size"] == marker_bytes
                if training and total > peak:
                    peak, peak_index = total, index
            elif event["action"] == "free_completed" and event["addr"] in live:
                total -= live.pop(event["addr"])["size"]
        return live, peak, peak_index

    _, peak, peak_index = replay()
    if peak_index < 0:
        return {"error": "the training-start marker is not in the trace (history too short?)"}
    live, _, _ = replay(peak_index + 1)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for event in live.values():
        group = groups[_frame_label(event.get("frames") or [])]
        group[0] += event["size"]
        group[1] += 1
    rows = sorted(groups.items(), key=lambda item: -item[1][0])
    table = [{"allocated_at": label, "gib": size / GIB, "blocks": blocks} for label, (size, blocks) in rows[:top]]
    rest = rows[top:]
    if rest:
        table.append({"allocated_at": f"{len(rest)} other frames", "gib": sum(r[1][0] for r in rest) / GIB,
                      "blocks": sum(r[1][1] for r in rest)})
    return {"peak_gib": peak / GIB, "rows": table, "allocated_before_recording_gib": baseline_bytes / GIB}


def breakdown_markdown(breakdowns: dict[str, dict[str, Any]], command: str) -> str:
    lines = ["# What the MTP-only training peak is made of", "",
             f"`{command}`: blocks live at the largest allocated total during the training steps of one MTP-only "
             "run, grouped by the innermost megatron-core / lightning_megatron / bench frame that allocated them.",
             ""]
    for name, breakdown in breakdowns.items():
        if "rows" not in breakdown:
            lines += [f"## {name}", "", breakdown.get("error", "no breakdown"), ""]
            continue
        lines += [f"## {name}: {breakdown['peak_gib']:.2f} GiB at the peak "
                  f"(max_memory_allocated {breakdown['max_memory_allocated_gib']:.2f} GiB, of which "
                  f"{breakdown['allocated_before_recording_gib']:.2f} GiB were left by earlier runs)", "",
                  "| GiB | blocks | allocated at |", "|---|---|---|"]
        lines += [f"| {row['gib']:.3f} | {row['blocks']} | `{row['allocated_at']}` |" for row in breakdown["rows"]]
        lines.append("")
    return "\n".join(lines)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def compare(runs: dict[str, dict[str, Any]], targets: dict[str, float]) -> dict[str, Any]:
    """The figures each target is about, and whether it is met (None where a figure is missing, e.g. CPU memory)."""
    mtp_only = runs["mtp_only"]
    figures: dict[str, float | None] = {"mtp_only_peak_memory_gib": mtp_only["peak_memory_gib"],
                                        "mtp_only_step_s": mtp_only["step_s"]}
    if "joint" in runs:
        figures["mtp_only_over_joint_peak_memory"] = _ratio(mtp_only["peak_memory_gib"],
                                                            runs["joint"]["peak_memory_gib"])
        figures["mtp_only_over_joint_step_time"] = _ratio(mtp_only["step_s"], runs["joint"]["step_s"])
    if "joint" in runs and "mtp_only_self_distill" in runs:
        figures["self_distill_over_joint_peak_memory"] = _ratio(runs["mtp_only_self_distill"]["peak_memory_gib"],
                                                                runs["joint"]["peak_memory_gib"])
        figures["self_distill_over_joint_step_time"] = _ratio(runs["mtp_only_self_distill"]["step_s"],
                                                              runs["joint"]["step_s"])
    for loss in ("tv", "tv_kl"):  # issue 42: the TV losses' MTP-only step against self-distillation's
        if f"mtp_only_{loss}" in runs and "mtp_only_self_distill" in runs:
            figures[f"{loss}_over_self_distill_step_time"] = _ratio(runs[f"mtp_only_{loss}"]["step_s"],
                                                                    runs["mtp_only_self_distill"]["step_s"])
            figures[f"{loss}_over_self_distill_peak_memory"] = _ratio(runs[f"mtp_only_{loss}"]["peak_memory_gib"],
                                                                      runs["mtp_only_self_distill"]["peak_memory_gib"])
    if "plain_mtp_only" in runs:
        plain = runs["plain_mtp_only"]
        figures["mtp_only_over_plain_mtp_only_peak_memory"] = _ratio(mtp_only["peak_memory_gib"],
                                                                     plain["peak_memory_gib"])
        figures["mtp_only_over_plain_mtp_only_step_time"] = _ratio(mtp_only["step_s"], plain["step_s"])
        figures["mtp_only_over_plain_mtp_only_peak_reserved"] = _ratio(mtp_only.get("peak_reserved_gib"),
                                                                       plain.get("peak_reserved_gib"))
    if "mtp_only_eager" in runs:
        figures["mtp_only_over_eager_trunk_step_time"] = _ratio(mtp_only["step_s"], runs["mtp_only_eager"]["step_s"])
        if "joint" in runs:
            figures["mtp_only_eager_over_joint_step_time"] = _ratio(runs["mtp_only_eager"]["step_s"],
                                                                    runs["joint"]["step_s"])
    if "mtp_only_lm_loss_every_step" in runs:
        every_step = runs["mtp_only_lm_loss_every_step"]
        figures["mtp_only_over_lm_loss_every_step_step_time"] = _ratio(mtp_only["step_s"], every_step["step_s"])
    if "mtp_only_whole_logits" in runs:
        whole = runs["mtp_only_whole_logits"]
        figures["mtp_only_over_whole_logits_step_time"] = _ratio(mtp_only["step_s"], whole["step_s"])
        figures["mtp_only_over_whole_logits_peak_memory"] = _ratio(mtp_only["peak_memory_gib"],
                                                                   whole["peak_memory_gib"])
    met = {key: None if figures.get(key) is None else figures[key] <= target for key, target in targets.items()}
    return {"figures": figures, "targets": targets, "met": met}


def measure_variants(variants: tuple[str, ...], settings: Settings, shape: ModelShape, rounds: int,
                     peak_tflops: float | None, targets: dict[str, float]) -> dict[str, Any]:
    """`variants` in mirrored rounds on the same settings, one after another in this process: each one's summary
    (median step, tokens/s, MFU on the FLOPs it ran, peak memory), the order they ran in, and the figures held to
    `targets` (`compare`; `mtp_only` must be among them)."""
    order = [variant for round_index in range(rounds)
             for variant in (variants if round_index % 2 == 0 else variants[::-1])]
    runs: dict[str, list[dict[str, Any]]] = {variant: [] for variant in variants}
    for variant in order:
        runs[variant].append(run_variant(variant, settings, shape.vocab))
    peak = peak_flops(peak_tflops)
    summaries = {variant: {**summarize(variant_runs, settings, step_flops(variant, variant_runs[0], shape, settings),
                                       peak),
                           "main_head_steps": variant_runs[0].get("main_head_steps")}
                 for variant, variant_runs in runs.items()}
    return {"shape": asdict(shape),
            "settings": {**asdict(settings), "global_batch": settings.global_batch, "rounds": rounds},
            "order": order, "runs": summaries, **compare(summaries, targets)}


def run_shape(shape_run: ShapeRun, args: argparse.Namespace, root: Path) -> tuple[dict[str, Any], dict | None]:
    checkpoint = make_config_only_checkpoint(root / shape_run.name, shape_run.shape, tied=shape_run.tied,
                                             tiny=args.tiny)
    shape = ModelShape.from_hf_checkpoint(checkpoint)
    settings = Settings(checkpoint=str(checkpoint), seq=args.seq, micro_batch=shape_run.micro_batch,
                        microbatches=shape_run.microbatches, steps=args.steps, warmup=args.warmup,
                        precision=args.precision, random_weights=True, loss_chunk_tokens=args.loss_chunk_tokens,
                        log_lm_loss_every_n_steps=None, log_every_n_steps=args.log_every_n_steps)
    variants = tuple(variant for variant in shape_run.variants if not args.variants or variant in args.variants)
    result = {"tied": shape_run.tied,
              **measure_variants(variants, settings, shape, args.rounds, args.peak_tflops, shape_run.targets)}
    summaries = result["runs"]
    for variant in ("mtp_only", "mtp_only_eager") if torch.cuda.is_available() else ("mtp_only",):  # same on a CPU
        if variant in summaries:
            result[f"{variant}_profile"] = profile_mtp_only(settings, shape.vocab, summaries[variant]["step_s"],
                                                            variant)
    breakdown = None
    if args.breakdown_steps and torch.cuda.is_available():
        fresh_memory()
        recorder = RecordAllocations()
        short = replace(settings, steps=args.breakdown_steps, warmup=1)
        run_variant("mtp_only", short, shape.vocab, callbacks=(recorder,))
        (trace,) = [t for t in recorder.snapshot["device_traces"] if t] or [[]]
        breakdown = {**peak_breakdown(trace, recorder.baseline_bytes),
                     "max_memory_allocated_gib": recorder.max_memory_allocated / GIB,
                     "variant": "mtp_only", "steps": args.breakdown_steps}
        recorder.snapshot = None
    return result, breakdown


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shape, fp32, CPU-sized (explicit flags win)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--shapes", nargs="+", choices=[s.name for s in SHAPES], default=[s.name for s in SHAPES])
    parser.add_argument("--loss-chunk-tokens", type=int, default=Settings.loss_chunk_tokens,
                        help="MTPOnlyCallback(loss_chunk_tokens); 0 = whole logits (the previous implementation)")
    parser.add_argument("--log-every-n-steps", type=int, default=50,
                        help="the Trainer's log_every_n_steps: MTP-only runs the main head on those steps only")
    parser.add_argument("--variants", nargs="+", default=None,
                        help="run only these of each shape's variants (mtp_only always runs: the figures compare "
                             "against it), e.g. mtp_only_self_distill mtp_only_tv mtp_only_tv_kl")
    parser.add_argument("--breakdown-steps", type=int, default=2, help="training steps of the recorded run (0: none)")
    parser.add_argument("--breakdown-md", type=Path, default=None,
                        help="markdown breakdown (default: mtp_memory_breakdown.md beside --out)")
    args = parse_with_tiny(parser, TINY)
    known = {variant for shape_run in SHAPES for variant in shape_run.variants}
    if args.variants and set(args.variants) - known:
        parser.error(f"--variants: unknown {sorted(set(args.variants) - known)}; choose from {sorted(known)}")
    args.variants = None if args.variants is None else {"mtp_only", *args.variants}
    args.loss_chunk_tokens = args.loss_chunk_tokens or None
    return args


def main() -> None:
    args = _parse_args()
    if args.tiny:
        torch.set_num_threads(1)
    from lightning_megatron.distributed import init_single_process

    init_single_process()
    import_megatron_bridge_first()
    shapes, breakdowns = {}, {}
    with scratch_dir("mtp_memory_", TINY_SCRATCH_BYTES) as root:  # config-only checkpoints
        for shape_run in SHAPES:
            if shape_run.name in args.shapes:
                shapes[shape_run.name], breakdown = run_shape(shape_run, args, root)
                if breakdown is not None:
                    breakdowns[shape_run.name] = breakdown
    result: dict[str, Any] = {"benchmark": "mtp_memory", **environment(),
                              "peak_tflops": (peak_flops(args.peak_tflops) or 0) / 1e12 or None,
                              "shapes": shapes, "breakdown": breakdowns}
    emit(result, args.out)
    markdown_path = args.breakdown_md or (args.out.with_name("mtp_memory_breakdown.md") if args.out else None)
    if markdown_path is not None and breakdowns:
        write_text_atomically(markdown_path, breakdown_markdown(breakdowns, result["command"]))


if __name__ == "__main__":
    main()
