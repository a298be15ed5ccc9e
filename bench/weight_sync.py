"""P7: pushing the trained weights to an inference engine, against raw safetensors I/O of the same bytes.

One GPU, one process for the trainer side (the model built by megatron-bridge from a Qwen3-8B-shaped checkpoint,
untied, one MTP layer, random bf16 weights) and the package's receiver (a `transformers` model of the same
checkpoint) in a second process on the same GPU. Medians over `--repeats` after one warm-up:
- `disk`: `serving.disk.sync_to_disk` with the bridge's `save_hf` (what `WeightSync(mode="disk")` runs), against a
  raw write of the same tensors from the GPU (target <= 1.2x); the engine-side read is the receiver's
  `/update_weights_from_disk` of that folder; the disk round trip is write + engine-side read.
- `colocated`: `ColocatedSender` of the whole model over CUDA IPC (target <= 2 s and <= 0.25x the disk round
  trip); the sender's extra GPU memory is the peak during the sync over what was allocated before it (target
  <= 2 buckets + the largest tensor).
- step time between syncs: a smaller model trained through Lightning without a `WeightSync`, with one attached
  whose next sync lies beyond the timed steps (target <= 1.01x), after a disk or a colocated sync in the warm-up,
  and with the engine's process alive on the device; mirrored rounds (`measure_step_overhead`).
The raw write is the fastest plain write of the same tensors (`bench.common.raw_write`); `disk_sync_gb_per_s` is
the sync's bytes over its time (target >= 4 GB/s to a RAM-backed folder, `TMPDIR=/dev/shm`). Every temporary
folder is removed at the end, and each write first checks that the folder's file system can hold it.
- delta syncs (`--parts delta`): after MTP-only training only the MTP head changes (every other parameter frozen,
  as `MTPOnlyCallback` leaves them): a delta disk version (the head's shard written, every other file a hard link
  to the previous version) and a colocated delta (the head's tensors), each against the full sync of the same kind
  (target <= 0.05x); then LoRA adapters on every linear layer: the adapter-only disk version (a PEFT folder, what
  `WeightSync(lora_form="adapter")` writes) against the LoRA run's own full disk sync, the merged form
  (`WeightSync(lora_form="merged")`: the adapted linears merged, apart from the rest; target <= 0.01x), and, as
  before, against the plain model's full disk sync (`lora_adapter_vs_full_disk`). The adapter syncs are timed back
  to back and, as a training loop runs them, each after 0.5 s standing in for the steps between syncs
  (`lora_adapter_between_steps_vs_merged_disk`): a sync leaves the next spare file's preparation (preallocated,
  mapped, its pages registered with CUDA: `lightning_megatron/lora_folder.py`) to a thread that the steps overlap;
  back to back, a sync that finds it still running writes staged instead (`lora_adapter_spare_file`: whether the
  spare was mapped and registered, or CUDA's refusal).
`collective` needs two GPUs (NCCL refuses two ranks on one); `--tiny` runs it over gloo on the CPU too.
`--tiny`: a tiny checkpoint, everything on the CPU (the colocated hand-over through shared memory).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    QWEN3_8B,
    TINY_SCRATCH_BYTES,
    emit,
    environment,
    make_large_checkpoint,
    median_seconds,
    raw_write,
    require_free_space,
    scratch_dir,
    weights_bytes,
)
from lightning_megatron.distributed import init_single_process


def _median(action: Callable[[], Any], repeats: int, warmups: int = 1) -> float:
    for _ in range(warmups):
        action()
    return median_seconds(action, repeats)


STEPS_BETWEEN_SYNCS_S = 0.5  # stands in for the training steps between two syncs (one Qwen3-8B LoRA step or more)


def _median_between_steps(action: Callable[[], Any], repeats: int, pause_s: float) -> float:
    """Median wall time of `action` when each call follows `pause_s` of idle host (training steps, in a loop): what a
    sync costs the loop once the work a sync leaves for a thread (the next spare file) is done between syncs."""
    times = []
    for _ in range(repeats):
        time.sleep(pause_s)
        times.append(median_seconds(action, 1))
    return statistics.median(times)


def _profile(action: Callable[[], Any], lines: int = 30) -> list[str]:
    """One more call of `action` under cProfile: its costliest calls by cumulative time (what a delta's fixed cost
    is made of, where the medians alone cannot tell)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(action)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(lines)
    return [line for line in text.getvalue().splitlines() if line.strip()]


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
    # the raw copy goes before the syncs; a sync with keep_last=1 holds two versions while it writes
    require_free_space(workdir, int(2.05 * model_bytes), "weight_sync disk")
    try:
        raw_write_s = _median(partial(raw_write, exported, workdir / "raw"), repeats)
    finally:
        shutil.rmtree(workdir / "raw", ignore_errors=True)
    del exported  # the raw write's copy of the model; the syncs below hold at most a bucket
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
        "disk_sync_gb_per_s": model_bytes / disk_sync_s / 1e9,
        "engine_read_s": engine_read_s,
        "disk_round_trip_s": round_trip_s,
        "colocated_sync_s": colocated_s,
        "colocated_vs_disk_round_trip": colocated_s / round_trip_s,
        "colocated_extra_sender_memory_bytes": extra_memory,
        "colocated_extra_memory_limit_bytes": memory_limit,
        "colocated_extra_memory_within_limit": None if extra_memory is None else extra_memory <= memory_limit,
    }


def measure_delta_syncs(checkpoint: Path, workdir: Path, repeats: int, bucket_mb: float, profile: bool = False
                        ) -> dict:
    from lightning_megatron.bridges import create_bridge
    from lightning_megatron.lora import LoRAConfig, add_lora_adapters, next_adapter_file, write_lora_adapter
    from lightning_megatron.mtp.parameters import is_mtp_parameter
    from lightning_megatron.options import ModelOptions
    from lightning_megatron.serving import ColocatedSender, disk
    from lightning_megatron.serving.receiver import spawn_receiver

    shutil.rmtree(workdir / "versions", ignore_errors=True)  # the full syncs' last version: its room is needed here
    bridge = create_bridge("megatron-bridge", checkpoint)
    chunks = bridge.build(ModelOptions(params_dtype=next(iter(bridge.hf_tensor_specs().values())).dtype, mtp=True))
    specs = bridge.hf_tensor_specs()  # with the MTP head, now that the model has one
    device = next(chunks[0].parameters()).device
    engine_start = ThreadPoolExecutor(1).submit(spawn_receiver, checkpoint, device=str(device), timeout_s=600,
                                                log=workdir / "delta_receiver.log")
    head = {id(parameter) for chunk in chunks for name, parameter in chunk.named_parameters()
            if is_mtp_parameter(name)}
    changing = bridge.changed_hf_names(chunks, head)
    model_bytes = sum(spec.nbytes for spec in specs.values())
    require_free_space(workdir, int(2.2 * model_bytes), "weight_sync delta")
    root, versions = workdir / "delta_versions", iter(range(1, 10_000))
    state = {"version": 0}

    def full_disk() -> None:
        state["version"] = next(versions)
        disk.sync_to_disk(lambda path: bridge.save_hf(chunks, path, separate=changing), root, state["version"],
                          keep_last=2, is_leader=True)

    head_specs = {name: specs[name] for name in changing}

    def delta_disk() -> None:  # what `WeightSync`'s delta runs: the export's GPU tensors streamed into the files
        base = disk.version_folder(root, state["version"])
        state["version"] = next(versions)
        disk.sync_to_disk(lambda path: disk.write_delta_version(
            base, path, head_specs, bridge.export_hf_tensors(chunks, only=changing, on_host=False), {}),
            root, state["version"], keep_last=2, is_leader=True)

    full_disk_s = _median(full_disk, repeats)
    delta_disk_s = _median(delta_disk, repeats)
    profiles: dict[str, list[str]] = {}
    process, url = engine_start.result()
    try:
        if profile:  # now that the engine's start (polling on a thread) is over
            profiles["delta_disk"] = _profile(delta_disk)
        sender = ColocatedSender(url, bucket_bytes=int(bucket_mb * 1024**2), timeout_s=600, device=device)

        def full_colocated() -> None:
            state["version"] = next(versions)
            sender.sync(bridge.export_hf_tensors(chunks, on_host=False), specs, state["version"], is_sender=True)

        def delta_colocated() -> None:
            base, state["version"] = state["version"], next(versions)
            sender.sync(bridge.export_hf_tensors(chunks, on_host=False, only=changing), head_specs, state["version"],
                        is_sender=True, base_version=base)

        full_colocated_s = _median(full_colocated, repeats)
        delta_colocated_s = _median(delta_colocated, repeats)
        if profile:
            profiles["delta_colocated"] = _profile(delta_colocated)
        sender.close()
    finally:
        process.kill()
        process.wait()
    shutil.rmtree(root, ignore_errors=True)  # the delta versions: the merged LoRA syncs need their room
    add_lora_adapters(chunks, LoRAConfig(rank=16, alpha=32))  # every linear layer, as the reference card does
    # the LoRA run's own full sync: the adapted linears merged (`WeightSync(lora_form="merged")`), apart from the
    # rest as the callback writes them for the deltas that follow
    adapted = bridge.changed_hf_names(chunks, {id(parameter) for chunk in chunks for parameter in chunk.parameters()
                                               if parameter.requires_grad})
    merged = workdir / "lora_merged_versions"
    require_free_space(workdir, int(2.05 * model_bytes), "weight_sync merged LoRA")
    merged_disk_s = _median(lambda: disk.sync_to_disk(lambda path: bridge.save_hf(chunks, path, separate=adapted),
                                                      merged, next(versions), keep_last=1, is_leader=True), repeats)
    shutil.rmtree(merged, ignore_errors=True)
    adapters = workdir / "adapters"

    def adapter_disk() -> None:
        disk.sync_to_disk(partial(write_lora_adapter, bridge, chunks), adapters, next(versions), keep_last=1,
                          is_leader=True)

    # the steady state of a sync loop: the first write exports and probes, the second is the copy plan's first
    # (it prepares the spare file each later write goes into)
    adapter_disk_s = _median(adapter_disk, repeats, warmups=2)
    # and as a training loop syncs: after steps, which the next spare file's preparation overlaps (its thread)
    adapter_between_steps_s = _median_between_steps(adapter_disk, 2 * repeats + 1, STEPS_BETWEEN_SYNCS_S)
    spare = next_adapter_file(bridge)  # what the timed writes went into: by DMA, or why not
    spare_file = {"mapped": spare is not None, "registered": spare is not None and spare.registered,
                  "refusal": None if spare is None else spare.refusal}
    if profile:
        profiles["lora_adapter_disk"] = _profile(adapter_disk)
    return {
        "model_bytes": model_bytes,
        "mtp_head_tensors": len(changing),
        "mtp_head_bytes": sum(specs[name].nbytes for name in changing),
        "full_disk_sync_s": full_disk_s,
        "delta_disk_sync_s": delta_disk_s,
        "delta_vs_full_disk": delta_disk_s / full_disk_s,
        "full_colocated_sync_s": full_colocated_s,
        "delta_colocated_sync_s": delta_colocated_s,
        "delta_vs_full_colocated": delta_colocated_s / full_colocated_s,
        "lora_adapter_bytes": sum(file.stat().st_size for file in adapters.glob("v*/*.safetensors")),
        "lora_adapted_tensors": len(adapted),
        "lora_merged_disk_sync_s": merged_disk_s,
        "lora_adapter_disk_sync_s": adapter_disk_s,
        # the LoRA run's own full sync (merged) is the adapter's baseline; the plain model's is kept beside it
        "lora_adapter_vs_merged_disk": adapter_disk_s / merged_disk_s,
        "lora_adapter_disk_between_steps_sync_s": adapter_between_steps_s,
        "steps_between_syncs_stand_in_s": STEPS_BETWEEN_SYNCS_S,
        "lora_adapter_spare_file": spare_file,
        "lora_adapter_between_steps_vs_merged_disk": adapter_between_steps_s / merged_disk_s,
        "lora_adapter_vs_full_disk": adapter_disk_s / full_disk_s,
        **({"profiles": profiles} if profile else {}),
    }


# Qwen3-8B's layers, tensors and MTP head at hidden 1024 (1.07 GB): on a CPU, the fixed costs per tensor and per sync
# of the 8B figures (exports, requests, files, pruning) at a fraction of their bytes (`--shape stand_in`)
STAND_IN: dict[str, Any] = dict(QWEN3_8B, hidden_size=1024, num_attention_heads=8, num_key_value_heads=4,
                                intermediate_size=3072, vocab_size=32000, max_position_embeddings=4096)
SHAPES = {"qwen3_8b": (QWEN3_8B, "Qwen3-8B shape"), "stand_in": (STAND_IN, "Qwen3-8B's layers at hidden 1024")}

ARMS = ("without", "attached", "after_disk_sync", "receiver_idle", "after_colocated_sync")


def measure_step_overhead(checkpoint: Path, workdir: Path, steps: int, warmup: int, rounds: int) -> dict:
    """Median step time of a small model per arm, in mirrored rounds (every arm, then every arm backwards), so that
    one H200 run tells which part of a sync's set-up costs step time between syncs:
    - `without`: no callback, no engine; `attached`: a `WeightSync` whose next sync lies beyond the run (the
      target: its `on_train_batch_end` compares a step count, nothing else);
    - `after_disk_sync`: one disk sync during the warm-up steps (the allocator's state after an export);
    - `receiver_idle`: no callback, the package's receiver holding the model on the same device, idle;
    - `after_colocated_sync`: that receiver and one colocated sync during the warm-up (the sender keeps its staging
      buffer, the engine its copy).
    `noise` is the spread of the `without` runs (max / min - 1): a ratio within it is not a cost."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_megatron import MegatronStrategy, SFTModule, WeightSync
    from lightning_megatron.serving.receiver import spawn_receiver
    from lightning_megatron.testing.datasets import RandomTokenDataset

    class StepTimes(pl.Callback):
        def __init__(self, sync: WeightSync | None) -> None:
            self.times: list[float] = []
            self._last = 0.0
            self._sync = sync

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if self._sync is not None and trainer.global_step == 1:  # a warm-up step: not timed
                self._sync.sync(trainer)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            now = time.perf_counter()
            if self._last:
                self.times.append(now - self._last)
            self._last = now

    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine, url = spawn_receiver(checkpoint, device=device, timeout_s=600, log=workdir / "step-receiver.log")
    engine.send_signal(signal.SIGSTOP)  # alive (its memory held) but absent, except in the arms that use it

    def run(arm: str) -> float:
        never = 10 * (steps + warmup)
        sync = {"attached": lambda: WeightSync("disk", every_n_steps=never, root=str(workdir / "never"),
                                               sync_on_train_end=False),
                "after_disk_sync": lambda: WeightSync("disk", every_n_steps=never, root=str(workdir / "step-syncs"),
                                                      keep_last=1, sync_on_train_end=False),
                "after_colocated_sync": lambda: WeightSync("colocated", every_n_steps=never, engine_url=url,
                                                           sync_on_train_end=False)}.get(arm, lambda: None)()
        timer = StepTimes(sync if arm.startswith("after_") else None)
        precision = "bf16" if torch.cuda.is_available() else "fp32"
        trainer = pl.Trainer(strategy=MegatronStrategy(hf_checkpoint=str(checkpoint), micro_batch_size=2,
                                                       global_batch_size=8, precision=precision,
                                                       cuda_graph="none"),  # eager step times, as measured before
                             accelerator="auto", devices=1, max_steps=steps + warmup + 1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[callback for callback in (sync, timer) if callback is not None],
                             default_root_dir=workdir)
        loader = DataLoader(RandomTokenDataset(8 * (steps + warmup + 1), 256, vocab), batch_size=2, drop_last=True)
        engine_used = arm in ("receiver_idle", "after_colocated_sync")
        if engine_used:
            engine.send_signal(signal.SIGCONT)
        try:
            trainer.fit(SFTModule(lr=1e-5), loader)
        finally:
            if engine_used:
                engine.send_signal(signal.SIGSTOP)
            shutil.rmtree(workdir / "step-syncs", ignore_errors=True)
        return statistics.median(timer.times[warmup:])

    order = [arm for _ in range(rounds) for arm in (*ARMS, *reversed(ARMS))]
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    try:
        for arm in order:
            times[arm].append(run(arm))
    finally:
        engine.send_signal(signal.SIGCONT)
        engine.kill()
        engine.wait()
    medians = {arm: statistics.median(values) for arm, values in times.items()}
    return {"steps": steps, "warmup": warmup, "order": order, "step_s": times,
            "ratios": {arm: medians[arm] / medians["without"] for arm in ARMS[1:]},
            "noise": max(times["without"]) / min(times["without"]) - 1,
            "step_time_ratio": medians["attached"] / medians["without"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny checkpoint, everything on the CPU")
    parser.add_argument("--checkpoint", type=Path, default=Path(tempfile.gettempdir()) / "qwen3-8b-mtp",
                        help="the Qwen3-8B-shaped checkpoint (made there once when missing, then reused)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3_8b",
                        help="the checkpoint's shape; stand_in: the 8B model's layers and tensors at hidden 1024 (a "
                             "CPU stand-in for the fixed costs; give it its own --checkpoint folder)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs after one warm-up")
    parser.add_argument("--bucket-mb", type=float, default=1024.0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="mirrored rounds of the step-time arms")
    parser.add_argument("--parts", nargs="+", choices=["sync", "delta", "steps"], default=["sync", "delta", "steps"],
                        help="the full syncs, the delta syncs, the step times between syncs (any of them)")
    parser.add_argument("--profile-deltas", action="store_true",
                        help="one more delta disk, delta colocated and LoRA adapter sync, each under cProfile: their "
                             "costliest calls go into the JSON (delta.profiles)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()

    init_single_process()
    if not args.tiny:
        started = time.perf_counter()
        checkpoint = make_large_checkpoint(args.checkpoint, mtp=True, tied=False, **SHAPES[args.shape][0])
        print(f"checkpoint ready in {time.perf_counter() - started:.1f} s", flush=True)
    # a raw copy, then a disk sync holding two versions while it writes; the small step-time model and its syncs
    needed = TINY_SCRATCH_BYTES if args.tiny else int(2.05 * weights_bytes(checkpoint)) + 2 * 2**30
    with scratch_dir("weight_sync_", needed) as workdir:
        if args.tiny:
            from lightning_megatron.testing.checkpoints import make_tiny_checkpoint

            checkpoint = make_tiny_checkpoint(workdir / "tiny-qwen3-mtp", "qwen3", mtp=True)
            step_checkpoint = checkpoint
        else:
            step_checkpoint = make_large_checkpoint(workdir / "step-model", mtp=False, tied=False, num_layers=4,
                                                    hidden_size=1024, vocab_size=32000, intermediate_size=3072)
        result: dict[str, Any] = {
            "benchmark": "weight_sync",
            **environment(),
            "checkpoint": "tiny qwen3 + MTP" if args.tiny
            else f"{args.checkpoint} ({SHAPES[args.shape][1]}, untied, one MTP layer)",
            "output_folder": str(workdir),
            "repeats": args.repeats,
            "targets": {"disk_sync_vs_raw_write": 1.2, "disk_sync_gb_per_s": 4.0, "colocated_sync_s": 2.0,
                        "colocated_vs_disk_round_trip": 0.25, "extra_sender_memory": "2 x bucket + largest tensor",
                        "step_time_ratio": 1.01, "delta_vs_full_disk": 0.05, "delta_vs_full_colocated": 0.05,
                        "lora_adapter_vs_merged_disk": 0.01, "lora_adapter_vs_full_disk": 0.01,
                        "lora_adapter_between_steps_vs_merged_disk": 0.01},
        }
        if "sync" in args.parts:
            result["sync"] = measure_syncs(checkpoint, workdir, args.repeats, args.bucket_mb, collective=args.tiny)
        if "delta" in args.parts:
            result["delta"] = measure_delta_syncs(checkpoint, workdir, args.repeats, args.bucket_mb,
                                                  profile=args.profile_deltas)
        if "steps" in args.parts:
            result["steps_between_syncs"] = measure_step_overhead(step_checkpoint, workdir, args.steps, args.warmup,
                                                                  args.rounds)
    emit(result, args.out)


if __name__ == "__main__":
    main()
