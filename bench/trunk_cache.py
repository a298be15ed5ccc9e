"""Issue 30 on one GPU: MTP-only epochs trained from the trunk cache (`MTPOnlyCallback(trunk_cache_dir=...)`).

Same shapes, batches and random-weight models as `bench/mtp_memory.py` (seq 2048, bf16, distributed optimizer,
megatron-bridge, one MTP layer, random tokens), all in one process:

- Qwen3-0.6B (tied), micro-batch 2 x 4: the Lightning joint step, then one MTP-only fit with the cache over
  `--epochs` epochs of `--batches` global batches: its first epoch runs the trunk (from CUDA graphs on a GPU,
  `MTPOnlyCallback`'s default; `--eager-trunk`: eagerly) and writes the cache, the later ones read it. Targets:
  first epoch <= 0.42x the joint step, cached epochs <= 0.2x.
- Qwen3-8B (untied), micro-batch 1 x 4: the plain Megatron-Core MTP-only loop (`bench/megatron_loop.py`), then the
  cached fit. Targets: first epoch <= 0.95x the plain loop, cached epochs <= 0.35x, peak <= the plain loop's.

Step times are medians over each epoch's steps after the first (`StepTimer`: synchronised ends of consecutive
optimizer steps); peak memory is the training steps' (`max_memory_allocated` from the first step on). Tokens/s and
MFU count the FLOPs each arm really runs (`bench.common.model_flops`): joint every pass; the first epoch
`MTP_ONLY_WITHOUT_MAIN_HEAD` (its timed steps log no `lm_loss`, so the main head does not run); cached epochs the
MTP layer (3 passes) and the MTP head's forward and input gradient (2) alone. `cache_bytes_per_token` is what the
cache's manifest says (the hidden states) and `cache_disk_bytes` what the shards took; `trunk_graphs` the graphed
trunk's warm-up, capture, replayed and eager calls (empty where it ran eagerly). `cached_profile`: the fit's last
step (a cached one, left out of the medians) under `torch.profiler` (`bench/packing_profile.py`'s
`profile_figures`: GPU-busy fraction, launches, syncs and where, top kernels and CPU operators, and CPU ranges
around the cache's planning, the cached forward and Megatron's forward and backward steps). Everything lives in
one `bench.common.scratch_dir` (free space checked first, removed at the end).

`--tiny`: the tiny Qwen3+MTP shape in fp32 on the CPU (what tests/bench/ runs).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    QWEN3_0_6B,
    QWEN3_8B,
    TINY_SCRATCH_BYTES,
    emit,
    environment,
    fresh_memory,
    make_config_only_checkpoint,
    parse_with_tiny,
    scratch_dir,
    start_single_process,
)
from bench.flops import (
    JOINT,
    MTP_ONLY,
    MTP_ONLY_WITHOUT_MAIN_HEAD,
    ModelShape,
    Passes,
    model_flops,
    peak_flops,
    throughput,
)
from bench.lightning_overhead import Settings, run_lightning, run_plain, summarize
from bench.mtp_memory import ProfileStep, ShapeRun
from bench.packing_profile import profile_figures, ranges

CACHED = Passes(backbone=0, mtp=3, main_head=0, mtp_head=2)
CACHE_SCRATCH_BYTES = 2 * 2**30  # the configs plus one epoch's cache: 5 x 4 x 2048 tokens x 8,192 bytes at 8B
TINY = dict(seq=32, batches=2, epochs=2, precision="fp32")
CACHE_RANGES = (  # CPU ranges of the profiled cached step, beside packing_profile's
    ("lightning_megatron.mtp.trunk_cache", "TrunkCache.plan_step", "## trunk cache plan"),
    ("lightning_megatron.mtp.trunk_cache", "TrunkCache._read_forward", "## cached forward"),
    ("lightning_megatron.mtp.trunk_cache", "_on_current_stream", "## wait for the cached rows"),
)


# the one variant is the reference: "joint" (Lightning joint step) or "plain_mtp_only" (the plain MTP-only loop)
SHAPES = (
    ShapeRun("qwen3_0.6b", QWEN3_0_6B, tied=True, micro_batch=2, microbatches=4, variants=("joint",),
             targets={"first_epoch_over_reference_step_time": 0.42, "cached_over_reference_step_time": 0.2}),
    ShapeRun("qwen3_8b", QWEN3_8B, tied=False, micro_batch=1, microbatches=4, variants=("plain_mtp_only",),
             targets={"first_epoch_over_reference_step_time": 0.95, "cached_over_reference_step_time": 0.35,
                      "cached_over_reference_peak_memory": 1.0}),
)


def run_cached(settings: Settings, vocab: int, epochs: int, cache_dir: Path) -> dict[str, Any]:
    """One MTP-only fit of `epochs` epochs over `settings.total_steps` global batches with the trunk cache."""
    import lightning.pytorch as pl

    from lightning_megatron import MTPOnlyCallback

    class EpochPeaks(pl.Callback):
        def __init__(self) -> None:
            self.peaks: list[float | None] = []

        def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()

        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.peaks.append(torch.cuda.max_memory_allocated() / 1024**3 if torch.cuda.is_available() else None)

    peaks = EpochPeaks()
    audit = cache_dir.with_name(f"{cache_dir.name}_audit.json")
    cache = MTPOnlyCallback(audit_path=str(audit), loss_chunk_tokens=settings.loss_chunk_tokens,
                            trunk_cache_dir=str(cache_dir), cuda_graph_trunk=settings.cuda_graph_trunk)
    recorder = ProfileStep(step_index=epochs * settings.total_steps - 1)  # the last step: a cached one
    with ranges(CACHE_RANGES):
        run = run_lightning(settings, vocab, mtp_only=False, callbacks=(recorder, peaks, cache), max_epochs=epochs)
    run["profile"] = recorder
    manifest = json.loads((cache_dir / "manifest.json").read_text())
    run["frozen_bit_identical"] = json.loads(audit.read_text())["frozen_bit_identical"]
    run.update(epoch_peak_memory_gib=peaks.peaks, cache_bytes_per_token=manifest["bytes_per_token"],
               cache_disk_bytes=sum(path.stat().st_size for path in cache_dir.rglob("*.safetensors")),
               cache_reads=cache.trunk_cache.reads, cache_writes=cache.trunk_cache.writes_done)
    return run


def _epoch(run: dict[str, Any], steps_per_epoch: int, epochs: range, flops: float, peak: float | None,
           tokens_per_step: int) -> dict[str, Any]:
    """Median step time over the given epochs' steps, each epoch's first step left out (the first epoch's is the
    warm-up, later ones pay the epoch turn), and the fit's last (profiled) step unless it is the only one left."""
    steps = run["step_times_s"]
    timed = [index for epoch in epochs for index in range(epoch * steps_per_epoch + 1, (epoch + 1) * steps_per_epoch)]
    times = [steps[index] for index in timed if index != len(steps) - 1] or [steps[index] for index in timed]
    memory = [run["epoch_peak_memory_gib"][epoch] for epoch in epochs]
    return {**throughput(statistics.median(times), tokens_per_step, flops, peak),
            "peak_memory_gib": None if None in memory else max(memory), "steps_timed": len(times)}


def run_shape(shape_run: ShapeRun, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    checkpoint = make_config_only_checkpoint(root / shape_run.name, shape_run.shape, tied=shape_run.tied,
                                             tiny=args.tiny)
    shape = ModelShape.from_hf_checkpoint(checkpoint)
    settings = Settings(checkpoint=str(checkpoint), seq=args.seq, micro_batch=shape_run.micro_batch,
                        microbatches=shape_run.microbatches, steps=args.batches - 1, warmup=1,
                        precision=args.precision, random_weights=True,
                        cuda_graph_trunk=False if args.eager_trunk else None)
    (reference_name,) = shape_run.variants
    peak = peak_flops(args.peak_tflops)
    tokens = settings.global_batch * settings.seq
    if reference_name == "joint":
        reference_run = run_lightning(settings, shape.vocab, mtp_only=False)
    else:
        reference_run = run_plain(settings, shape.vocab, mtp_only=True)
    reference = summarize([reference_run], settings, model_flops(
        shape, settings.global_batch, settings.seq, JOINT if reference_name == "joint" else MTP_ONLY), peak)
    cache_dir = root / f"{shape_run.name}_cache"
    try:
        fresh_memory()
        cached_run = run_cached(settings, shape.vocab, args.epochs, cache_dir)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    first = _epoch(cached_run, args.batches, range(1), model_flops(shape, settings.global_batch, settings.seq,
                                                                    MTP_ONLY_WITHOUT_MAIN_HEAD), peak, tokens)
    cached = _epoch(cached_run, args.batches, range(1, args.epochs),
                    model_flops(shape, settings.global_batch, settings.seq, CACHED), peak, tokens)
    figures = {
        "first_epoch_over_reference_step_time": first["step_s"] / reference["step_s"],
        "cached_over_reference_step_time": cached["step_s"] / reference["step_s"],
        "cached_over_reference_peak_memory": (None if None in (cached["peak_memory_gib"], reference["peak_memory_gib"])
                                              else cached["peak_memory_gib"] / reference["peak_memory_gib"]),
        "cache_bytes_per_token": cached_run["cache_bytes_per_token"],
        "cache_disk_bytes_per_token": cached_run["cache_disk_bytes"] / (args.batches * tokens),
    }
    met = {key: None if figures[key] is None else figures[key] <= target
           for key, target in shape_run.targets.items()}
    return {"shape": asdict(shape), "tied": shape_run.tied, "reference": reference_name,
            "settings": {**asdict(settings), "global_batch": settings.global_batch, "epochs": args.epochs,
                         "batches_per_epoch": args.batches},
            "runs": {reference_name: reference, "first_epoch": first, "cached_epochs": cached},
            "losses": {"reference": reference_run["losses"], "cached_fit": cached_run["losses"],
                       "reference_mtp": reference_run["mtp_losses"], "cached_fit_mtp": cached_run["mtp_losses"]},
            "cache": {"reads": cached_run["cache_reads"], "writes": cached_run["cache_writes"],
                      "frozen_bit_identical": cached_run.get("frozen_bit_identical")},
            "trunk_graphs": cached_run["trunk_graphs"],
            "cached_profile": profile_figures(cached_run["profile"].profile, cached_run["profile"].profiled_s,
                                              cached["step_s"]),
            "figures": figures, "targets": shape_run.targets, "met": met}


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shape, fp32, CPU-sized (explicit flags win)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batches", type=int, default=5, help="global batches per epoch")
    parser.add_argument("--epochs", type=int, default=3, help="epochs of the cached fit (the first writes)")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--shapes", nargs="+", choices=[s.name for s in SHAPES], default=[s.name for s in SHAPES])
    parser.add_argument("--eager-trunk", action="store_true",
                        help="the first epoch's trunk eagerly (MTPOnlyCallback(cuda_graph_trunk=False))")
    args = parse_with_tiny(parser, TINY)
    if args.batches < 2 or args.epochs < 2:
        parser.error("--batches and --epochs must be at least 2 (a timed step per epoch, a cached epoch)")
    return args


def main() -> None:
    args = _parse_args()
    start_single_process(tiny=args.tiny)
    with scratch_dir("trunk_cache_", TINY_SCRATCH_BYTES if args.tiny else CACHE_SCRATCH_BYTES) as root:
        shapes = {shape_run.name: run_shape(shape_run, args, root) for shape_run in SHAPES
                  if shape_run.name in args.shapes}
    emit({"benchmark": "trunk_cache", **environment(),
          "peak_tflops": (peak_flops(args.peak_tflops) or 0) / 1e12 or None, "shapes": shapes}, args.out)


if __name__ == "__main__":
    main()
