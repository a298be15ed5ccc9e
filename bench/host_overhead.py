"""Issue 41: what one training step costs the host under Lightning beyond the plain Megatron-Core loop, and where.

A host-bound step (the eager 0.6B joint SFT + MTP step on an H100 keeps the GPU 31-46% busy) is slower by every
millisecond of Python the training loop adds around Megatron-Core's work, and on a GPU each such millisecond also
delays the kernel launches behind it. The same work shows on a CPU: both loops run a tiny model (the tiny Qwen3 with
one MTP layer, fp32, one thread, joint SFT + MTP) on the same random tokens, `bench/megatron_loop.py` (the plain
loop) and `Trainer` + `MegatronStrategy` + `SFTModule(enable_mtp=True)`.

The work both loops share is timed apart: Megatron-Core's forward-backward schedule (the model's forward and
backward, the loss functions, the gradients' finalisation), the Megatron optimizer's step and the DataLoader's
next batch (wrapped where they are looked up, for the run only). What is left of a step, `host_s = step_s -
shared_s`, is what the loop costs around them: Lightning's loops, hooks, logging and our strategy's and module's
own work for one, the plain loop's few lines for the other. A step is measured from one step's end to the next
(`on_train_batch_end`, the plain loop's step context), so it holds everything one iteration costs. The runs
alternate in mirrored rounds; the median over the timed steps of all rounds is reported.

`--profile`: then one more run of each under cProfile, the shared work left out (the profiler is paused inside it),
giving per step: the functions the loop calls directly (its "entries", which add up to what was profiled), the
time spent in each package, and the Lightning-side functions with the most time (cumulative, nested ones
included). cProfile slows Python down, several times for small functions: its figures rank, the unprofiled
`host_s` is the cost. It counts Python functions only (`builtins=False`; a C function's time is its caller's): with
C functions counted, Python 3.12.1's profiler lost its call stack in these runs (functions called once a step
reported dozens of recursive calls, others none).

`--logger csv` and `--progress-bar` time what a user's Trainer runs as well; the default is `bench/sizes.py`'s
timed Trainer (no logger, progress bar or checkpointing; `log_every_n_steps` 50).
`python -m bench.host_overhead --profile --out host_overhead.json` (about 2 minutes on one CPU core).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import pstats
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from bench.common import (
    TINY_SCRATCH_BYTES,
    emit,
    environment,
    make_checkpoint,
    release_model,
    scratch_dir,
    start_single_process,
)
from bench.flops import ModelShape
from lightning_megatron.testing.datasets import RandomTokenDataset

VARIANTS = ("plain", "lightning")
SHARED_KINDS = ("schedule", "optimizer", "data")
TOP = 25  # rows of each profile table


@dataclass(frozen=True)
class Settings:
    seq: int = 64
    micro_batch: int = 1
    microbatches: int = 4
    steps: int = 40
    warmup: int = 5
    lr: float = 1e-4
    logger: str = "none"
    progress_bar: bool = False
    log_every_n_steps: int = 50

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    def dataset(self, vocab: int) -> RandomTokenDataset:
        """Exactly one epoch of `total_steps` global batches, the same tokens for every run."""
        return RandomTokenDataset(self.total_steps * self.micro_batch * self.microbatches, self.seq, vocab, seed=0)


class SharedWork:
    """Times the work both loops share, per step.

    Megatron-Core's schedule and optimizer step and the DataLoader's `__next__` are wrapped where they are looked up
    for as long as the context is open; only the outermost of nested shared calls counts. `straddlers`: the functions
    that were on the stack at a shared call (the loops' own frames around it), which cProfile cannot time whole."""

    def __init__(self) -> None:
        self.profiler: cProfile.Profile | None = None
        self.profiling = False
        self.straddlers: set[tuple[str, int, str]] = set()
        self._seconds: dict[str, float] = defaultdict(float)  # this step's, by kind (and "gc", "gc_in_shared")
        self._depth = 0
        self._gc_started = 0.0
        self._patches: list[tuple[Any, str, Any]] = []

    def profile(self, on: bool) -> None:
        """Start or stop the profiler, if there is one."""
        if self.profiler is not None and on != self.profiling:
            self.profiling = on
            if on:
                self.profiler.enable()
            else:
                self.profiler.disable()

    def lap(self) -> dict[str, float]:
        """The seconds spent in each kind of shared work, and in garbage collection, since the last lap."""
        seconds, self._seconds = dict(self._seconds), defaultdict(float)
        return seconds

    def __enter__(self) -> SharedWork:
        from megatron.core.optimizer import optimizer as megatron_optimizers
        from megatron.core.pipeline_parallel import schedules
        from torch.utils.data import dataloader

        for kind, owner, name in (
                ("schedule", schedules, "forward_backward_no_pipelining"),
                ("schedule", schedules, "forward_backward_pipelining_without_interleaving"),
                ("schedule", schedules, "forward_backward_pipelining_with_interleaving"),
                ("optimizer", megatron_optimizers.MixedPrecisionOptimizer, "step"),
                ("optimizer", megatron_optimizers.FP32Optimizer, "step"),
                ("optimizer", megatron_optimizers.ChainedOptimizer, "step"),
                ("data", dataloader._BaseDataLoaderIter, "__next__")):
            original = owner.__dict__[name]
            self._patches.append((owner, name, original))
            setattr(owner, name, self._timed(kind, original))
        gc.callbacks.append(self._garbage_collection)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._garbage_collection)
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)
        self._patches.clear()

    def _timed(self, kind: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def shared(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return function(*args, **kwargs)
            profiling = self.profiling
            if profiling:  # the shared work stays out of the profile
                self.profile(False)
                self._note_straddlers(sys._getframe(1))
            self._depth += 1
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self._seconds[kind] += time.perf_counter() - start
                self._depth -= 1
                if profiling:
                    self.profile(True)

        return shared

    def _garbage_collection(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
            return
        seconds = time.perf_counter() - self._gc_started
        self._seconds["gc"] += seconds
        self._seconds[f"gc_collections_gen{info['generation']}"] += 1
        if self._depth:
            self._seconds["gc_in_shared"] += seconds

    def _note_straddlers(self, frame: Any) -> None:
        while frame is not None:
            code = frame.f_code
            self.straddlers.add((code.co_filename, code.co_firstlineno, code.co_name))
            frame = frame.f_back


class StepWindows:
    """Per step, from one step's end to the next: wall time, shared work by kind, garbage collection, the training
    thread's CPU time; the profiler (if any) runs from the end of the warm-up to the end of the last step."""

    def __init__(self, shared: SharedWork, warmup: int, total_steps: int) -> None:
        self.shared = shared
        self.warmup, self.total_steps = warmup, total_steps
        self.steps: list[dict[str, float]] = []
        self._wall = self._cpu = 0.0

    def start(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.thread_time()
        self.shared.lap()

    def step_ended(self, step: int) -> None:
        """`step` (0-based) just ended."""
        wall, cpu = time.perf_counter(), time.thread_time()
        shared = self.shared.lap()
        self.steps.append({"step_s": wall - self._wall, "thread_cpu_s": cpu - self._cpu,
                           "shared_s": sum(shared.get(kind, 0.0) for kind in SHARED_KINDS), **shared})
        if step == self.warmup - 1:
            self.shared.profile(True)
        elif step == self.total_steps - 1:
            self.shared.profile(False)
        self._wall, self._cpu = time.perf_counter(), time.thread_time()

    def result(self) -> list[dict[str, float]]:
        """The timed steps'."""
        return self.steps[self.warmup:]


def run_plain(checkpoint: Path, settings: Settings, vocab: int, shared: SharedWork) -> dict[str, Any]:
    from bench.megatron_loop import LoopConfig, run

    windows = StepWindows(shared, settings.warmup, settings.total_steps)

    @contextlib.contextmanager
    def step_context(step: int) -> Iterator[None]:
        if step == 0:
            windows.start()
        yield
        windows.step_ended(step)

    config = LoopConfig(hf_checkpoint=str(checkpoint), bridge_type="megatron-bridge",
                        micro_batch_size=settings.micro_batch,
                        global_batch_size=settings.micro_batch * settings.microbatches, precision="fp32",
                        lr=settings.lr, steps=settings.total_steps, mtp=True)
    result = run(config, settings.dataset(vocab), step_context=step_context)
    release_model(result.pop("model"))
    return {"steps": windows.result(), "losses": result["losses"]}


class _LightningWindows(pl.Callback):
    def __init__(self, windows: StepWindows) -> None:
        self.windows = windows
        self.losses: list[torch.Tensor] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.windows.start()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(outputs["loss"].detach())  # read after the fit: the plain loop's float() is its own
        self.windows.step_ended(batch_idx)


def run_lightning(checkpoint: Path, settings: Settings, vocab: int, shared: SharedWork,
                  workdir: Path) -> dict[str, Any]:
    from lightning_megatron import MegatronStrategy, SFTModule

    windows = _LightningWindows(StepWindows(shared, settings.warmup, settings.total_steps))
    strategy = MegatronStrategy(hf_checkpoint=str(checkpoint), bridge_type="megatron-bridge",
                                micro_batch_size=settings.micro_batch,
                                global_batch_size=settings.micro_batch * settings.microbatches, precision="fp32",
                                cuda_graph="none")
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=settings.total_steps,
        logger=CSVLogger(workdir) if settings.logger == "csv" else False, enable_checkpointing=False,
        enable_progress_bar=settings.progress_bar, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=workdir, callbacks=[windows], log_every_n_steps=settings.log_every_n_steps)
    loader = DataLoader(settings.dataset(vocab), batch_size=settings.micro_batch, drop_last=True)
    trainer.fit(SFTModule(enable_mtp=True, lr=settings.lr), loader)
    release_model(strategy.model_chunks)
    return {"steps": windows.windows.result(), "losses": [float(loss) for loss in windows.losses]}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians per step over every round's timed steps, in milliseconds (collections and `host_mean_ms`: means)."""
    steps = [step for run in runs for step in run["steps"]]
    for step in steps:
        step["host_s"] = step["step_s"] - step["shared_s"]
    keys = ("step_s", "host_s", "shared_s", *SHARED_KINDS, "gc", "gc_in_shared", "thread_cpu_s")
    summary = {key.removesuffix("_s") + "_ms": 1e3 * statistics.median(step.get(key, 0.0) for step in steps)
               for key in keys}
    summary["host_mean_ms"] = 1e3 * statistics.mean(step["host_s"] for step in steps)  # logging steps weigh in
    summary["gc_mean_ms"] = 1e3 * statistics.mean(step.get("gc", 0.0) for step in steps)
    summary["collections_per_step"] = {
        generation: statistics.mean(step.get(f"gc_collections_gen{generation}", 0.0) for step in steps)
        for generation in range(3)}
    summary["round_host_ms"] = [1e3 * statistics.median(step["host_s"] for step in run["steps"]) for run in runs]
    return summary


def profile_breakdown(profiler: cProfile.Profile, straddlers: set[tuple[str, int, str]],
                      steps: int) -> dict[str, Any]:
    """Per step, in ms: what cProfile saw (the profiler is paused inside the shared work), by the loop's entries,
    by package, and the Lightning-side functions with the most cumulative time.

    `straddlers` are the frames that were on the stack at a shared call (the loops' own frames): the profiler,
    paused and resumed under them, times only their calls. An entry is a function that is not one of them, with
    the time of its calls from them (or from frames older than the profile); the entries add up to what was
    profiled, less the straddlers' own time (listed until their first shared call)."""
    stats = pstats.Stats(profiler).stats  # key -> (calls, primitive calls, own time, cumulative time, callers)
    per_step = 1e3 / steps
    entries: dict[str, float] = defaultdict(float)
    for key, (_, _, own, cumulative, callers) in stats.items():
        if key in straddlers:
            entries[_name(key) + " (own time)"] += own
        else:
            entries[_name(key)] += cumulative - sum(edge[3] for caller, edge in callers.items()
                                                    if caller not in straddlers and caller in stats)
    packages: dict[str, float] = defaultdict(float)
    for key, (_, _, own, _, _) in stats.items():
        packages[_package(key[0])] += own
    lightning_side = {_name(key): cumulative for key, (_, _, _, cumulative, _) in stats.items()
                      if key not in straddlers and _package(key[0]) in ("lightning", "lightning_megatron",
                                                                          "torchmetrics")}
    return {
        "profiled_ms": sum(own for _, _, own, _, _ in stats.values()) * per_step,
        "entries_ms": _top(entries, per_step),
        "packages_ms": _top(packages, per_step),
        "lightning_side_cumulative_ms": _top(lightning_side, per_step),
        "calls": sum(calls for calls, _, _, _, _ in stats.values()) / steps,
    }


def _top(times: dict[str, float], scale: float) -> dict[str, float]:
    ranked = sorted(times.items(), key=lambda item: -item[1])[:TOP]
    return {name: round(seconds * scale, 4) for name, seconds in ranked if seconds * scale >= 1e-3}


def _package(filename: str) -> str:
    """The top-level package of a profiled function's file (`lightning`, `torch`, ...), or what cProfile calls it."""
    if filename == "~":
        return "builtins"
    parts = Path(filename).parts
    if "site-packages" in parts:
        return parts[parts.index("site-packages") + 1].removesuffix(".py")
    for package in ("lightning_megatron", "bench"):
        if package in parts:
            return package
    return "python"


def _name(key: tuple[str, int, str]) -> str:
    filename, line, function = key
    if filename == "~":
        return function
    parts = Path(filename).parts
    for anchor in ("site-packages", "lightning_megatron", "bench"):
        if anchor in parts:
            parts = parts[parts.index(anchor) + (anchor == "site-packages"):]
            break
    else:
        parts = parts[-2:]
    return f"{'/'.join(parts)}:{line}({function})"


def measure(args: argparse.Namespace, checkpoint: Path, workdir: Path) -> dict[str, Any]:
    settings = Settings(seq=args.seq, micro_batch=args.micro_batch, microbatches=args.microbatches,
                        steps=args.steps, warmup=args.warmup, logger=args.logger, progress_bar=args.progress_bar,
                        log_every_n_steps=args.log_every_n_steps)
    vocab = ModelShape.from_hf_checkpoint(checkpoint).vocab
    start_single_process(tiny=True)
    order = [variant for index in range(args.rounds) for variant in (VARIANTS if index % 2 == 0 else VARIANTS[::-1])]
    runs: dict[str, list[dict[str, Any]]] = {variant: [] for variant in VARIANTS}
    for index, variant in enumerate(order):
        with SharedWork() as shared:
            runs[variant].append(_run(variant, checkpoint, settings, vocab, shared, workdir / f"run{index}"))
    summaries = {variant: summarize(variant_runs) for variant, variant_runs in runs.items()}
    lightning, plain = summaries["lightning"], summaries["plain"]
    result: dict[str, Any] = {
        "benchmark": "host_overhead",
        **environment(),
        "threads": torch.get_num_threads(),
        "settings": {**asdict(settings), "rounds": args.rounds, "precision": "fp32", "mtp": "joint",
                     "bridge_type": "megatron-bridge"},
        "order": order,
        "runs": summaries,
        "lightning_extra_host_ms": lightning["host_ms"] - plain["host_ms"],
        "lightning_extra_host_mean_ms": lightning["host_mean_ms"] - plain["host_mean_ms"],
        "lightning_over_plain_step_time": lightning["step_ms"] / plain["step_ms"],
        "max_abs_lm_loss_diff": max(abs(ours - theirs) for ours_run, theirs_run in
                                    zip(runs["lightning"], runs["plain"], strict=True)
                                    for ours, theirs in zip(ours_run["losses"], theirs_run["losses"], strict=True)),
    }
    if args.profile:
        result["profile"] = {}
        for index, variant in enumerate(VARIANTS):
            with SharedWork() as shared:
                shared.profiler = cProfile.Profile(builtins=False)
                _run(variant, checkpoint, settings, vocab, shared, workdir / f"profile{index}")
            result["profile"][variant] = profile_breakdown(shared.profiler, shared.straddlers, settings.steps)
    return result


def _run(variant: str, checkpoint: Path, settings: Settings, vocab: int, shared: SharedWork,
         workdir: Path) -> dict[str, Any]:
    if variant == "plain":
        return run_plain(checkpoint, settings, vocab, shared)
    return run_lightning(checkpoint, settings, vocab, shared, workdir)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=Settings.seq)
    parser.add_argument("--micro-batch", type=int, default=Settings.micro_batch)
    parser.add_argument("--microbatches", type=int, default=Settings.microbatches)
    parser.add_argument("--steps", type=int, default=Settings.steps, help="timed steps per run (after warm-up)")
    parser.add_argument("--warmup", type=int, default=Settings.warmup)
    parser.add_argument("--rounds", type=int, default=2, help="mirrored rounds (plain, lightning, lightning, plain)")
    parser.add_argument("--logger", choices=["none", "csv"], default="none")
    parser.add_argument("--progress-bar", action="store_true")
    parser.add_argument("--log-every-n-steps", type=int, default=Settings.log_every_n_steps)
    parser.add_argument("--profile", action="store_true", help="one more cProfile'd run of each: where the time goes")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    return parser.parse_args()


def main() -> None:
    args = _parse_args()
    if torch.cuda.is_available():  # the plain loop would train on the GPU, the Trainer here on the CPU
        raise SystemExit("bench.host_overhead measures on the CPU; hide the GPUs: CUDA_VISIBLE_DEVICES= python -m "
                         "bench.host_overhead ...")
    with scratch_dir("host_overhead_", 2 * TINY_SCRATCH_BYTES) as folder:
        emit(measure(args, make_checkpoint(folder / "qwen3-mtp", tiny=True), folder), args.out)


if __name__ == "__main__":
    main()
