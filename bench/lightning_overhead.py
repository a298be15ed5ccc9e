"""P1: what the Lightning layer costs. P2: what MTP-only training saves. One process, side by side.

Three runs on the same HF checkpoint (Qwen3-0.6B shape with one MTP layer, `bench/common.py`), the same random
tokens, the same model options (megatron-bridge, MTP head trained jointly with loss scale 0.1, `attention_backend`
auto = SDPA without Transformer Engine), bf16 with fp32 main grads, distributed optimizer, micro-batch 2 x 4
microbatches of 2048 tokens per step:

- `plain`: the plain Megatron-Core loop (`bench/megatron_loop.py`);
- `lightning`: `Trainer` + `MegatronStrategy` + `SFTModule(enable_mtp=True)`, joint training;
- `mtp_only`: the same with `MTPOnlyCallback` (every non-MTP parameter frozen before Megatron DDP exists).

The runs alternate in mirrored rounds (plain, lightning, mtp_only, mtp_only, lightning, plain, ...) so slow drift of
the GPU clock cancels; GPU memory is freed and the peak counter reset before each. A step's time is the wall time
from one synchronised step end to the next (for Lightning, a callback calls `torch.cuda.synchronize` in
`on_train_batch_end`), so it holds everything one iteration costs; the first `--warmup` steps of each run are left
out and the median of the rest, pooled over rounds, is reported with tokens/s, model FLOPs and MFU (formula in
`bench/common.py`) and peak memory. Peak memory is that of the training steps; what building the model and the
callbacks' setup (e.g. `MTPOnlyCallback`'s checksums of the frozen weights) peaked at before is kept apart as
`setup_peak_memory_gib`. A run's peaks are its own: each run's model is released when it ends
(`common.release_model`), and what an earlier run still left allocated when it started (`memory_at_start_gib`)
is subtracted. `peak_reserved_gib` is the allocator's reserved peak over the same steps, taken the same way: it
holds cached blocks and CUDA graph pools too (`MTPOnlyCallback`'s trunk graphs keep their working set there).
Ratios: P1 `lightning / plain` step time (target <= 1.01); P2 `mtp_only / lightning` step time (target <= 0.40)
and peak memory (target <= 0.20; also given with the setup peaks included). The losses of
`plain` and `lightning` are compared step by step (the same computation: equal to ~1e-6 in fp32).

`--tiny`: the tiny checkpoint, fp32 on the CPU, a few steps (what tests/bench/ runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from bench.common import (
    TINY_SCRATCH_BYTES,
    CpuClock,
    add_step_options,
    allocated_gib,
    checkpoint_scratch_bytes,
    emit,
    environment,
    fresh_memory,
    import_megatron_bridge_first,
    live_threads,
    make_checkpoint,
    own_gib,
    parse_with_tiny,
    peak_memory_gib,
    peak_reserved_gib,
    release_model,
    reserved_gib,
    scratch_dir,
)
from bench.flops import JOINT, MTP_ONLY, ModelShape, model_flops, peak_flops, throughput
from lightning_megatron import MTPOnlyCallback, SFTModule
from lightning_megatron.mtp.chunked_cross_entropy import DEFAULT_CHUNK_TOKENS
from lightning_megatron.options import ModelOptions
from lightning_megatron.testing.datasets import RandomTokenDataset

VARIANTS = ("plain", "lightning", "mtp_only")
TINY = dict(seq=32, micro_batch=2, microbatches=2, steps=2, warmup=1, rounds=2, precision="fp32")


@dataclass(frozen=True)
class Settings:
    checkpoint: str
    seq: int
    micro_batch: int
    microbatches: int
    steps: int
    warmup: int
    precision: str
    lr: float = 1e-5
    bridge_type: str = "megatron-bridge"
    attention_backend: str = "auto"
    random_weights: bool = False
    loss_chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS
    mtp_loss_type: str = "labels"
    log_lm_loss_every_n_steps: int | None = 1  # MTPOnlyCallback's; None: on demand (its default)
    log_every_n_steps: int = 50  # the Trainer's (Lightning's default)
    cuda_graph_trunk: bool | None = None  # MTPOnlyCallback's; None: auto (the frozen trunk from CUDA graphs on a GPU)
    # the strategy's; "none" (eager), not its default "auto": the comparison with the plain (eager) loop stays eager
    cuda_graph: str = "none"

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.microbatches

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    def dataset(self, vocab: int) -> RandomTokenDataset:
        """Exactly one epoch of `total_steps` global batches, the same tokens for every run."""
        return RandomTokenDataset(self.total_steps * self.global_batch, self.seq, vocab, seed=0)


def run_plain(settings: Settings, vocab: int, *, mtp_only: bool = False) -> dict[str, Any]:
    """The plain Megatron-Core loop, joint or MTP-only (every non-MTP parameter frozen, nothing else)."""
    from bench.megatron_loop import LoopConfig, run

    fresh_memory()
    at_start, reserved_at_start = allocated_gib(), reserved_gib()
    config = LoopConfig(hf_checkpoint=settings.checkpoint, bridge_type=settings.bridge_type,
                        micro_batch_size=settings.micro_batch, global_batch_size=settings.global_batch,
                        precision=settings.precision, lr=settings.lr, steps=settings.total_steps,
                        attention_backend=settings.attention_backend, mtp=True, mtp_only=mtp_only,
                        random_weights=settings.random_weights)
    result = run(config, settings.dataset(vocab))
    release_model(result.pop("model"))
    setup_peak = result["setup_peak_memory_bytes"]
    return {"step_times_s": result["step_times_s"], "losses": result["losses"], "mtp_losses": result["mtp_losses"],
            "memory_at_start_gib": at_start, "peak_memory_gib": own_gib(peak_memory_gib(), at_start),
            "peak_reserved_gib": own_gib(peak_reserved_gib(), reserved_at_start),
            "setup_peak_memory_gib": None if setup_peak is None else own_gib(setup_peak / 1024**3, at_start)}


class StepTimer(pl.Callback):
    """Wall time between synchronised ends of consecutive optimizer steps, and each step's losses; the peak memory
    of everything before training (building, wrapping, callbacks' setup) is kept apart from training's."""

    def __init__(self) -> None:
        self.step_times_s: list[float] = []
        self.process_cpu_s: list[float] = []  # per step: every thread's CPU time, the training thread's
        self.main_thread_cpu_s: list[float] = []
        self.threads: list[str] = []  # the other Python threads at the last step
        self.losses: list[float | None] = []
        self.mtp_losses: list[float] = []
        self.main_head_steps: list[bool] = []
        self.setup_peak_memory_gib: float | None = None
        self._previous_end = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.setup_peak_memory_gib = peak_memory_gib()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._previous_end = _synchronized_now()
        self._cpu = CpuClock()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        end = _synchronized_now()
        self.step_times_s.append(end - self._previous_end)
        self._previous_end = end
        process_cpu, main_thread_cpu = self._cpu.lap()
        self.process_cpu_s.append(process_cpu)
        self.main_thread_cpu_s.append(main_thread_cpu)
        self.threads = live_threads()
        mtp_only = [callback for callback in trainer.callbacks if isinstance(callback, MTPOnlyCallback)]
        main_head = not mtp_only or mtp_only[0].main_head_runs
        self.main_head_steps.append(main_head)
        self.losses.append(float(outputs["loss"]) if main_head else None)  # else the step returned mtp_loss
        if "mtp_loss" in trainer.callback_metrics:  # a model with an MTP head
            self.mtp_losses.append(float(trainer.callback_metrics["mtp_loss"]))


def _synchronized_now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


class RandomWeightsSFTModule(SFTModule):
    """`SFTModule` built with Megatron's random initialization (`ModelOptions.random_weights`): config only."""

    def model_options(self) -> ModelOptions:
        return dataclasses.replace(super().model_options(), random_weights=True)


def run_lightning(settings: Settings, vocab: int, *, mtp_only: bool, callbacks: tuple[pl.Callback, ...] = (),
                  max_epochs: int | None = None) -> dict[str, Any]:
    """`max_epochs`: that many epochs of the dataset (one epoch of `settings.total_steps` steps by default)."""
    with scratch_dir("lightning_overhead_", TINY_SCRATCH_BYTES) as workdir:  # the MTP-only audit
        return _run_lightning(settings, vocab, workdir, mtp_only=mtp_only, callbacks=callbacks, max_epochs=max_epochs)


def _run_lightning(settings: Settings, vocab: int, workdir: Path, *, mtp_only: bool,
                   callbacks: tuple[pl.Callback, ...], max_epochs: int | None) -> dict[str, Any]:
    from lightning_megatron import MegatronStrategy

    fresh_memory()
    at_start, reserved_at_start = allocated_gib(), reserved_gib()
    timer = StepTimer()
    callbacks = (timer, *callbacks)
    if mtp_only:
        callbacks += (MTPOnlyCallback(audit_path=str(workdir / "mtp_only_audit.json"),
                                      loss_chunk_tokens=settings.loss_chunk_tokens,
                                      log_lm_loss_every_n_steps=settings.log_lm_loss_every_n_steps,
                                      cuda_graph_trunk=settings.cuda_graph_trunk),)
    strategy = MegatronStrategy(
        hf_checkpoint=settings.checkpoint, bridge_type=settings.bridge_type, micro_batch_size=settings.micro_batch,
        global_batch_size=settings.global_batch, precision=settings.precision,
        attention_backend=settings.attention_backend, cuda_graph=settings.cuda_graph,
    )
    trainer = timed_trainer(strategy, callbacks, workdir, max_steps=-1 if max_epochs else settings.total_steps,
                            max_epochs=max_epochs, log_every_n_steps=settings.log_every_n_steps)
    loader = DataLoader(settings.dataset(vocab), batch_size=settings.micro_batch, drop_last=True)
    module_class = RandomWeightsSFTModule if settings.random_weights else SFTModule
    trainer.fit(module_class(enable_mtp=True, lr=settings.lr, mtp_loss_type=settings.mtp_loss_type), loader)
    release_model(strategy.model_chunks)
    result = {"step_times_s": timer.step_times_s, "losses": timer.losses, "mtp_losses": timer.mtp_losses,
              "main_head_steps": timer.main_head_steps,
              "memory_at_start_gib": at_start, "setup_peak_memory_gib": own_gib(timer.setup_peak_memory_gib, at_start),
              "peak_memory_gib": own_gib(peak_memory_gib(), at_start),
              "peak_reserved_gib": own_gib(peak_reserved_gib(), reserved_at_start),
              "trunk_graphs": trunk_graph_counts(callbacks)}
    if mtp_only:
        audit = json.loads((workdir / "mtp_only_audit.json").read_text())
        result["frozen_bit_identical"] = audit["frozen_bit_identical"]
        result["trainable_parameters"] = audit["trainable_parameters"]
    return result


def timed_trainer(strategy: pl.strategies.Strategy, callbacks: Iterable[pl.Callback], workdir: Path, *,
                  max_steps: int, max_epochs: int | None = None, log_every_n_steps: int = 50) -> pl.Trainer:
    """A Trainer for a timed fit on one device: no logger, checkpoints, progress bar, summary or sanity steps."""
    return pl.Trainer(
        strategy=strategy, accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=1,
        max_steps=max_steps, max_epochs=max_epochs, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=workdir,
        callbacks=list(callbacks), log_every_n_steps=log_every_n_steps,
    )


def trunk_graph_counts(callbacks: Iterable[pl.Callback]) -> list[dict[str, Any]] | None:
    """Per graphed decoder of an `MTPOnlyCallback` among `callbacks`: warm-up, capture, replayed and eager calls
    (`GraphedForward.counts`); [] where the trunk ran eagerly, None without the callback."""
    for callback in callbacks:
        if isinstance(callback, MTPOnlyCallback):
            return [graph.counts() for graph in callback.trunk_graphs]
    return None


def summarize(runs: list[dict[str, Any]], settings: Settings, flops: float, peak: float | None) -> dict[str, Any]:
    """Pooled median over the timed steps of every round, plus what each round saw."""
    timed = [run["step_times_s"][settings.warmup:] for run in runs]
    summary = throughput(statistics.median(t for times in timed for t in times), settings.global_batch * settings.seq,
                         flops, peak)
    summary.update(
        peak_memory_gib=_max_or_none(run["peak_memory_gib"] for run in runs),
        peak_reserved_gib=_max_or_none(run.get("peak_reserved_gib") for run in runs),
        setup_peak_memory_gib=_max_or_none(run["setup_peak_memory_gib"] for run in runs),
        round_median_step_s=[statistics.median(times) for times in timed],
        memory_at_start_gib=[run["memory_at_start_gib"] for run in runs],
        losses=[run["losses"] for run in runs],
        mtp_losses=[run["mtp_losses"] for run in runs],
        trunk_graphs=[run.get("trunk_graphs") for run in runs],
    )
    if "frozen_bit_identical" in runs[0]:
        summary["frozen_bit_identical"] = all(run["frozen_bit_identical"] for run in runs)
        summary["trainable_parameters"] = runs[0]["trainable_parameters"]
    return summary


def _max_or_none(values: Iterable[float | None]) -> float | None:
    return max((value for value in values if value is not None), default=None)


def _max_abs_diff(first: list[list[float]], second: list[list[float]]) -> float:
    return max(abs(a - b) for xs, ys in zip(first, second, strict=True) for a, b in zip(xs, ys, strict=True))


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny checkpoint, fp32, CPU-sized (explicit flags win)")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="the HF checkpoint (default: made in a temp dir by bench/common.make_checkpoint)")
    parser.add_argument("--seq", type=int, default=2048)
    add_step_options(parser)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    return parse_with_tiny(parser, TINY)


def main() -> None:
    args = _parse_args()
    if args.tiny:
        torch.set_num_threads(1)
    needed = 0 if args.checkpoint else checkpoint_scratch_bytes(args.tiny)
    with scratch_dir("lightning_overhead_checkpoint_", needed) as folder:
        emit(measure(args, args.checkpoint or make_checkpoint(folder / "qwen3-mtp", tiny=args.tiny)), args.out)


def measure(args: argparse.Namespace, checkpoint: Path) -> dict[str, Any]:
    """The mirrored rounds of every variant on `checkpoint`: the benchmark's JSON."""
    from lightning_megatron.distributed import init_single_process

    settings = Settings(checkpoint=str(checkpoint), seq=args.seq, micro_batch=args.micro_batch,
                        microbatches=args.microbatches, steps=args.steps, warmup=args.warmup,
                        precision=args.precision)
    shape = ModelShape.from_hf_checkpoint(checkpoint)
    if shape.mtp_layers < 1:
        raise SystemExit(f"--checkpoint {checkpoint} has no MTP layer (num_nextn_predict_layers); P1/P2 need one")
    init_single_process()
    import_megatron_bridge_first()
    order = [variant for round_index in range(args.rounds)
             for variant in (args.variants if round_index % 2 == 0 else args.variants[::-1])]
    runs: dict[str, list[dict[str, Any]]] = {variant: [] for variant in args.variants}
    for variant in order:
        runs[variant].append(run_plain(settings, shape.vocab) if variant == "plain"
                             else run_lightning(settings, shape.vocab, mtp_only=variant == "mtp_only"))
    fresh_memory()

    peak = peak_flops(args.peak_tflops)
    summaries = {}
    for variant, variant_runs in runs.items():
        flops = model_flops(shape, settings.global_batch, settings.seq, MTP_ONLY if variant == "mtp_only" else JOINT)
        summaries[variant] = summarize(variant_runs, settings, flops, peak)
    result: dict[str, Any] = {
        "benchmark": "lightning_overhead",
        **environment(),
        "checkpoint": str(checkpoint),
        "shape": asdict(shape),
        "settings": {**asdict(settings), "global_batch": settings.global_batch,
                     "tokens_per_step": settings.global_batch * settings.seq, "rounds": args.rounds,
                     "distributed_optimizer": True, "mtp_loss_scaling_factor": 0.1},
        "peak_tflops": peak / 1e12 if peak else None,
        "order": order,
        "runs": summaries,
    }
    if {"plain", "lightning"} <= runs.keys():
        plain, lightning = summaries["plain"], summaries["lightning"]
        result["overhead"] = {
            "lightning_over_plain_step_time": lightning["step_s"] / plain["step_s"],
            "per_round": [ours / theirs for ours, theirs in zip(lightning["round_median_step_s"],
                                                                plain["round_median_step_s"], strict=True)],
            "target": 1.01,
            "max_abs_lm_loss_diff": _max_abs_diff(lightning["losses"], plain["losses"]),
            "max_abs_mtp_loss_diff": _max_abs_diff(lightning["mtp_losses"], plain["mtp_losses"]),
        }
    if {"lightning", "mtp_only"} <= runs.keys():
        joint, mtp_only = summaries["lightning"], summaries["mtp_only"]
        result["mtp_only"] = {
            "step_time_ratio": mtp_only["step_s"] / joint["step_s"],
            "peak_memory_ratio": _ratio(mtp_only["peak_memory_gib"], joint["peak_memory_gib"]),
            "peak_memory_ratio_including_setup": _ratio(
                _max_or_none([mtp_only["peak_memory_gib"], mtp_only["setup_peak_memory_gib"]]),
                _max_or_none([joint["peak_memory_gib"], joint["setup_peak_memory_gib"]])),
            "targets": {"step_time_ratio": 0.40, "peak_memory_ratio": 0.20},
            "frozen_bit_identical": mtp_only["frozen_bit_identical"],
        }
    return result


if __name__ == "__main__":
    main()
