"""How long a checkpoint save blocks training, asynchronous (`MegatronStrategy(async_save=True)`) vs synchronous.

One H200: the Qwen3-8B shape (hidden 4096, 36 layers, 32/8 heads, FFN 12288, untied, one MTP layer) built with
Megatron's random initialization from a config-only checkpoint, bf16, distributed optimizer, seq 2048, micro-batch
1 x 4, trained MTP-only (`MTPOnlyCallback`): the largest Qwen3 shape that trains on one GPU (a full fine-tune of 8B
with Adam needs ~144 GB). Its checkpoint is the whole model (~16.4 GB of bf16 weights) plus the MTP head's
optimizer state, so the save moves what an 8B checkpoint's weights are; a full fine-tune's optimizer state (~100 GB
more) would not fit the 64 GiB disk nor `/dev/shm` twice.

Each run trains `--warmup` steps, saves once (`trainer.save_checkpoint` from a callback after step `warmup + 1`),
then trains `--steps` more while an asynchronous save writes in the background. Reported per variant:
`blocked_s`, the wall time `save_checkpoint` kept the training loop (GPU synchronised before and after: for
`async`, staging the shards off the device into the strategy's reused host memory, and forking the writer);
`staging`, what that memory did (async: reserved for the model's shards at the start of training, `reserve_s`; the
save's `bytes` copied, `host_bytes_passed` (the optimizer state Megatron gathered on the host, handed over as it
is), the seconds it spent growing the memory for what the reservation did not cover, `grow_s`, and copying,
`copy_s`); `published_after_s`, from the save call until its folder appeared (async: the writer finished
and every rank agreed, seen at a step end, or at the end of fit when `published_during_training` is false; sync:
= blocked); the step times (wall time between synchronised step ends, `bench/lightning_overhead.py`'s
`StepTimer`), their median outside the staging step, and the largest step outside it over that median. Targets:
async `blocked_s` <= 10% of sync `blocked_s`, and no async step outside the staging step over 1.1x the median.
`noise_reference`: the same ratio for the synchronous run, whose steps outside the staging step have no save in
flight: what the machine alone does to the step times.

Both variants train with `ManualGarbageCollection(every_n_steps=--gc-every)` (the automatic collector off, what
setup made frozen, a collection every 10 steps): with Python's automatic collector, full collections of the ~0.8
million objects Lightning, Megatron-Core and the bridges hold land on steps no one chose (~0.4 s each on a CPU of
the test machine; the likely cause of the few steps ~0.3 s longer in both variants of the first H200 run), so the
step-time figure would measure the collector, not the writer (`bench.staging_probe` times such a collection).

Checkpoints go to `--dir` (default `/dev/shm/async_save_bench`: RAM-backed, so the disk is not what is timed and
the 64 GiB disk is not filled); free space is checked first, and every folder is removed in a `finally`.

`--tiny`: the tiny Qwen3+MTP shape, fp32 on the CPU, a few steps, under TMPDIR (what tests/bench/ runs).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from bench.common import (
    QWEN3_8B,
    TINY_SCRATCH_BYTES,
    emit,
    environment,
    fresh_memory,
    import_megatron_bridge_first,
    make_config_only_checkpoint,
    release_model,
    scratch_dir,
)
from bench.flops import ModelShape
from bench.lightning_overhead import RandomWeightsSFTModule, Settings, StepTimer
from lightning_megatron.callbacks import ManualGarbageCollection

VARIANTS = ("sync", "async")
TARGETS = {"async_over_sync_blocked": 0.10, "async_max_step_over_median": 1.1}
TINY = dict(seq=32, steps=4, warmup=1, precision="fp32", dir=None, gc_every=2)


class SaveOnce(pl.Callback):
    """Save `path` once, after step `step`; time how long the loop was held, what the staging memory did, and when
    the folder appeared."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step
        self.blocked_s: float | None = None
        self.published_after_s: float | None = None
        self.published_during_training = False
        self.staging: dict[str, Any] = {}
        self._started = 0.0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            staging = trainer.strategy._saves.staging
            reserved = {"reserved_bytes": staging.capacity, "reserve_s": staging.allocation_s}
            self._started = _synchronized_now()
            trainer.save_checkpoint(self.path)
            self.blocked_s = _synchronized_now() - self._started
            self.staging = {**reserved, **staging.last_stage, "allocation_s": staging.allocation_s,
                            "segments_made": staging.segments_made}
        if self.published_after_s is None and self.path.is_dir():
            self.published_after_s = time.perf_counter() - self._started
            self.published_during_training = True

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.published_after_s is None and self.path.is_dir():  # the strategy's on_train_end waited for it
            self.published_after_s = time.perf_counter() - self._started


def _synchronized_now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def checkpoint_bytes(shape: ModelShape, bytes_per_weight: int) -> int:
    """What one checkpoint of this MTP-only run holds, with 10% slack: every weight, plus fp32 main weights and
    two Adam moments (12 bytes) for the MTP layer's weights."""
    q, k = shape.heads * shape.head_dim, shape.kv_groups * shape.head_dim
    layer = shape.hidden * (q + 2 * k) + q * shape.hidden + 3 * shape.hidden * shape.ffn + 2 * shape.hidden
    mtp = shape.mtp_layers * (layer + 2 * shape.hidden * shape.hidden + 3 * shape.hidden)
    weights = shape.layers * layer + 2 * shape.vocab * shape.hidden + mtp
    return int(1.1 * (weights * bytes_per_weight + 12 * mtp))


def run(variant: str, settings: Settings, vocab: int, folder: Path, gc_every: int) -> dict[str, Any]:
    from lightning_megatron import MegatronStrategy, MTPOnlyCallback

    fresh_memory()
    if torch.cuda.is_available():  # the synchronous save's page-locked copies (~21 GiB), cached by torch: freed
        torch._C._host_emptyCache()
    timer, saver = StepTimer(), SaveOnce(folder / f"{variant}.ckpt", step=settings.warmup + 1)
    strategy = MegatronStrategy(
        hf_checkpoint=settings.checkpoint, bridge_type=settings.bridge_type, micro_batch_size=settings.micro_batch,
        global_batch_size=settings.global_batch, precision=settings.precision, async_save=variant == "async",
        cuda_graph="none",  # eager, as the measurements in bench/results were taken
    )
    trainer = pl.Trainer(
        strategy=strategy, accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=1,
        max_steps=settings.total_steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=folder,
        callbacks=[timer, saver, MTPOnlyCallback(audit_path=str(folder / f"{variant}_audit.json")),
                   ManualGarbageCollection(every_n_steps=gc_every)],
    )
    loader = DataLoader(settings.dataset(vocab), batch_size=settings.micro_batch, drop_last=True)
    try:
        trainer.fit(RandomWeightsSFTModule(enable_mtp=True, lr=settings.lr), loader)
    finally:
        release_model(strategy.model_chunks)
        shutil.rmtree(folder / f"{variant}.ckpt", ignore_errors=True)
    staging = settings.warmup + 1  # step_times_s[i] ends step i + 1; the save ran at the end of step warmup + 1
    outside = [seconds for index, seconds in enumerate(timer.step_times_s) if index >= settings.warmup
               and index != staging]
    median = statistics.median(outside)
    return {"blocked_s": saver.blocked_s, "published_after_s": saver.published_after_s,
            "published_during_training": saver.published_during_training, "staging": saver.staging,
            "step_times_s": timer.step_times_s, "staging_step_s": timer.step_times_s[staging],
            "steps_outside_staging_s": outside, "median_step_s": median, "max_step_over_median": max(outside) / median}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shape, fp32, CPU, a few steps")
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm/async_save_bench"),
                        help="where the checkpoints are written (default RAM-backed; tiny: under TMPDIR)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=40, help="steps after the save (the background write overlaps)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--gc-every", type=int, default=10, help="ManualGarbageCollection's every_n_steps")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    if args.tiny:
        parser.set_defaults(**TINY)
        args = parser.parse_args()
    import_megatron_bridge_first()
    with scratch_dir("async_save_", TINY_SCRATCH_BYTES) as root:  # the config-only checkpoint
        checkpoint = make_config_only_checkpoint(root / "model", QWEN3_8B, tied=False, tiny=args.tiny)
        shape = ModelShape.from_hf_checkpoint(checkpoint)
        needed = checkpoint_bytes(shape, 4 if args.precision == "fp32" else 2)  # one at a time: each is removed
        with scratch_dir("async_save_checkpoints_", needed, parent=args.dir or root) as folder:
            settings = Settings(checkpoint=str(checkpoint), seq=args.seq, micro_batch=1, microbatches=4,
                                steps=args.steps + 2, warmup=args.warmup, precision=args.precision,
                                random_weights=True)
            runs = {variant: run(variant, settings, shape.vocab, folder, args.gc_every) for variant in VARIANTS}
    figures = {"async_over_sync_blocked": runs["async"]["blocked_s"] / runs["sync"]["blocked_s"],
               "async_max_step_over_median": runs["async"]["max_step_over_median"]}
    noise = {"sync_steps_with_no_save_in_flight_s": runs["sync"]["steps_outside_staging_s"],
             "sync_max_step_over_median": runs["sync"]["max_step_over_median"],
             "sync_median_step_s": runs["sync"]["median_step_s"]}
    emit({"benchmark": "async_save", **environment(), "shape": vars(shape),
          "settings": {**vars(settings), "save_after_step": args.warmup + 1, "gc_every": args.gc_every},
          "runs": runs, "figures": figures, "noise_reference": noise, "targets": TARGETS,
          "met": {key: figures[key] <= target for key, target in TARGETS.items()}}, args.out)


if __name__ == "__main__":
    main()
