"""P7: pushing the trained weights to an inference engine, against raw safetensors I/O of the same bytes.

One GPU, one process for the trainer side (the model built by megatron-bridge from a Qwen3-8B-shaped checkpoint,
untied, one MTP layer, random bf16 weights) and the package's receiver (a `transformers` model of the same
checkpoint) in a second process on the same GPU. Medians over `--repeats` after one warm-up:
- `disk`: `serving.disk.sync_to_disk` with the bridge's `save_hf` (what `WeightSync(mode="disk")` runs), against a
  raw `save_file` of the same tensors from the GPU (target <= 1.5x); the engine-side read is the receiver's
  `/update_weights_from_disk` of that folder; the disk round trip is write + engine-side read.
- `colocated`: `ColocatedSender` of the whole model over CUDA IPC (target <= 2 s and <= 0.25x the disk round
  trip); the sender's extra GPU memory is the peak during the sync over what was allocated before it (target
  <= 2 buckets + the largest tensor).
- step time between syncs: a smaller model trained through Lightning with and without a `WeightSync` callback
  whose next sync lies beyond the timed steps, alternating runs (target <= 1.01x).
`collective` needs two GPUs (NCCL refuses two ranks on one); `--tiny` runs it over gloo on the CPU too.
`--tiny`: a tiny checkpoint, everything on the CPU (the colocated hand-over through shared memory).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from bench.common import QWEN3_8B, emit, environment, make_large_checkpoint, median_seconds
from lightning_megatron.distributed import init_single_process


def _median(action: Callable[[], Any], repeats: int) -> float:
    action()  # warm-up
    return median_seconds(action, repeats)


def measure_syncs(checkpoint: Path, workdir: Path, repeats: int, bucket_mb: float, collective: bool) -> dict:
    from lightning_megatron.bridges import create_bridge
    from lightning_megatron.options import ModelOptions
    from lightning_megatron.serving import CollectiveSender, ColocatedSender, disk
    from lightning_megatron.serving.protocol import post_json
    from lightning_megatron.serving.receiver import spawn_receiver

    bridge = create_bridge("megatron-bridge", checkpoint)
    specs_dtype = next(iter(bridge.hf_tensor_specs().values())).dtype
    chunks = bridge.build(ModelOptions(params_dtype=specs_dtype, mtp=True))
    device = next(chunks[0].parameters()).device
    specs = bridge.hf_tensor_specs()
    model_bytes = sum(spec.nbytes for spec in specs.values())
    largest = max(spec.nbytes for spec in specs.values())
    bucket_bytes = int(bucket_mb * 1024**2)

    # the engine loads its model in its own process while the disk figures are measured here
    engine_start = ThreadPoolExecutor(1).submit(spawn_receiver, checkpoint, device=str(device), timeout_s=600,
                                                log=workdir / "receiver.log")
    exported = dict(bridge.export_hf_tensors(chunks, on_host=False))
    raw_file = workdir / "raw.safetensors"
    raw_write_s = _median(partial(save_file, exported, str(raw_file)), repeats)
    del exported  # the raw write's copy of the model; the syncs below hold at most a bucket
    raw_file.unlink()  # the disk holds the checkpoint and at most two versions (keep_last=1) at 8B: 3 x 17 GB
    root = workdir / "versions"
    versions = iter(range(1, 1000))
    disk_sync_s = _median(lambda: disk.sync_to_disk(lambda path: bridge.save_hf(chunks, path), root, next(versions),
                                                    keep_last=1, is_leader=True), repeats)

    process, url = engine_start.result()
    try:
        latest = disk.read_latest(root)
        engine_read_s = _median(lambda: post_json(f"{url}/update_weights_from_disk", {"model_path": str(latest)}, 600),
                                repeats)
        sender = ColocatedSender(url, bucket_bytes=bucket_bytes, timeout_s=600, device=device)

        def colocated() -> None:
            sender.sync(bridge.export_hf_tensors(chunks, on_host=False), specs, next(versions), is_sender=True)

        colocated()  # warm-up: the staging buffer is allocated here
        extra_memory = None
        if device.type == "cuda":
            sender.close()  # measure the staging buffer too
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            colocated()
            extra_memory = torch.cuda.max_memory_allocated() - before
        colocated_s = median_seconds(colocated, repeats)
        sender.close()
        result: dict[str, Any] = {}
        if collective:
            collective_sender = CollectiveSender(url, bucket_bytes=bucket_bytes, timeout_s=600, device=device)
            result["collective_sync_s"] = _median(
                lambda: collective_sender.sync(bridge.export_hf_tensors(chunks, on_host=False), specs,
                                               next(versions), is_sender=True), repeats)
            collective_sender.close()
    finally:
        process.kill()
        process.wait()
    round_trip_s = disk_sync_s + engine_read_s
    memory_limit = 2 * bucket_bytes + largest
    return {
        **result,
        "tensors": len(specs),
        "bytes": model_bytes,
        "largest_tensor_bytes": largest,
        "bucket_bytes": bucket_bytes,
        "device": str(device),
        "raw_write_s": raw_write_s,
        "disk_sync_s": disk_sync_s,
        "disk_sync_vs_raw_write": disk_sync_s / raw_write_s,
        "engine_read_s": engine_read_s,
        "disk_round_trip_s": round_trip_s,
        "colocated_sync_s": colocated_s,
        "colocated_vs_disk_round_trip": colocated_s / round_trip_s,
        "colocated_extra_sender_memory_bytes": extra_memory,
        "colocated_extra_memory_limit_bytes": memory_limit,
        "colocated_extra_memory_within_limit": None if extra_memory is None else extra_memory <= memory_limit,
    }


def measure_step_overhead(checkpoint: Path, workdir: Path, steps: int, warmup: int) -> dict:
    """Median step time with and without a WeightSync callback (no sync inside the timed steps), mirrored runs."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_megatron import MegatronStrategy, SFTModule, WeightSync
    from lightning_megatron.testing.datasets import RandomTokenDataset

    class StepTimes(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._last = 0.0

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            now = time.perf_counter()
            if self._last:
                self.times.append(now - self._last)
            self._last = now

    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]

    def run(with_sync: bool) -> float:
        timer = StepTimes()
        callbacks: list[pl.Callback] = [timer]
        if with_sync:
            callbacks.insert(0, WeightSync("disk", every_n_steps=10 * (steps + warmup), root=str(workdir / "never"),
                                           sync_on_train_end=False))
        precision = "bf16" if torch.cuda.is_available() else "fp32"
        trainer = pl.Trainer(strategy=MegatronStrategy(hf_checkpoint=str(checkpoint), micro_batch_size=2,
                                                       global_batch_size=8, precision=precision),
                             accelerator="auto", devices=1, max_steps=steps + warmup + 1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=callbacks, default_root_dir=workdir)
        loader = DataLoader(RandomTokenDataset(8 * (steps + warmup + 1), 256, vocab), batch_size=2, drop_last=True)
        trainer.fit(SFTModule(lr=1e-5), loader)
        return statistics.median(timer.times[warmup:])

    order = [False, True, True, False]
    times: dict[bool, list[float]] = {False: [], True: []}
    for with_sync in order:
        times[with_sync].append(run(with_sync))
    without, with_callback = statistics.median(times[False]), statistics.median(times[True])
    return {"steps": steps, "warmup": warmup, "order": ["without" if not w else "with" for w in order],
            "step_s_without": times[False], "step_s_with": times[True],
            "step_time_ratio": with_callback / without}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny checkpoint, everything on the CPU")
    parser.add_argument("--checkpoint", type=Path, default=Path(tempfile.gettempdir()) / "qwen3-8b-mtp",
                        help="the Qwen3-8B-shaped checkpoint (made there once when missing, then reused)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs after one warm-up")
    parser.add_argument("--bucket-mb", type=float, default=1024.0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="weight_sync_"))
    init_single_process()
    if args.tiny:
        from lightning_megatron.testing.checkpoints import make_tiny_checkpoint

        checkpoint = make_tiny_checkpoint(workdir / "tiny-qwen3-mtp", "qwen3", mtp=True)
        step_checkpoint = checkpoint
    else:
        started = time.perf_counter()
        checkpoint = make_large_checkpoint(args.checkpoint, mtp=True, tied=False, **QWEN3_8B)
        print(f"checkpoint ready in {time.perf_counter() - started:.1f} s", flush=True)
        step_checkpoint = make_large_checkpoint(workdir / "step-model", mtp=False, tied=False, num_layers=4,
                                                hidden_size=1024, vocab_size=32000, intermediate_size=3072)
    result = {
        "benchmark": "weight_sync",
        **environment(),
        "checkpoint": "tiny qwen3 + MTP" if args.tiny else f"{args.checkpoint} (Qwen3-8B shape, untied, one MTP layer)",
        "repeats": args.repeats,
        "targets": {"disk_sync_vs_raw_write": 1.5, "colocated_sync_s": 2.0, "colocated_vs_disk_round_trip": 0.25,
                    "extra_sender_memory": "2 x bucket + largest tensor", "step_time_ratio": 1.01},
        "sync": measure_syncs(checkpoint, workdir, args.repeats, args.bucket_mb, collective=args.tiny),
        "steps_between_syncs": measure_step_overhead(step_checkpoint, workdir, args.steps, args.warmup),
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
