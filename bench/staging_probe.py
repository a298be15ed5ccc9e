"""What staging a checkpoint off the GPU costs on this machine, and what a forked writer and the garbage collector
cost around it: the short probe that chooses how background saves stage (issue 31), one JSON line.

The tensors are the Qwen3-8B checkpoint's (`bench.common.QWEN3_8B`, bf16, untied, one MTP layer: 16.8 GB, in
Megatron's fused layout), random, on the GPU. Measured, each on its own and its memory freed before the next:

- `pageable`: `.to("cpu")` of every tensor, into fresh pageable memory.
- `megatron_first` / `megatron_again`: Megatron-Core's staging (`FileSystemWriterAsync.preload_tensors`:
  `.to("cpu", non_blocking=True)`, whose output torch allocates page-locked through its pinned-memory cache, each
  tensor rounded up to a power of two; `pinned_allocated_bytes` says how much, `cuda_host_alloc_s` how long it took),
  with the cache cold, then warm.
- `host_staging_first` / `host_staging_again`: `HostStaging.stage` (what `async_save` uses now): the first save
  grows its buffer (a shared mapping, pages faulted in, `cudaHostRegister`), the second reuses it.
- `fork_s`, `child_*`: with each staged copy alive, the seconds `fork` takes (`multiprocessing`'s fork context, as
  Megatron's writer), the forked child writing the staged bytes to a file under `--shm` (whole tensors up to
  `--child-write-gib`, then 4 MiB of each other one: it reads every tensor's memory) and GB/s, and whether what
  it wrote equals the GPU tensors (sampled). `private_registered` page-locks a private 4 GiB buffer instead, to
  show what fork does with one (the kernel copies page-locked private pages into the child at fork).
  `parent_heap_write_s`: the parent writing 2 GiB of its own heap (tiny: 16 MiB), once without a child and once
  right after a fork (copy-on-write faults).
- `gc`: after importing what a training process imports (Lightning, Megatron-Core, megatron-bridge), the objects
  the collector tracks and the seconds of a full `gc.collect()`, and of one after `gc.freeze()`.

`--tiny`: a few small tensors on the CPU (no page-locking, no CUDA), for tests/bench/.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import QWEN3_8B, environment, import_megatron_bridge_first
from lightning_megatron.atomic import write_text_atomically
from lightning_megatron.background_save import HostStaging

SAMPLE_BYTES = 4 * 2**20  # compared per sampled tensor after the child wrote it
HEAP_BYTES = 2 * 2**30
PRIVATE_REGISTERED_BYTES = 4 * 2**30


def checkpoint_shapes(shape: dict[str, Any], layers: int) -> list[tuple[int, ...]]:
    """The weights of a Qwen3 checkpoint in Megatron's layout: per layer the fused QKV, the projection, the fused
    gate/up and down matrices and two norms; the MTP layer (one more layer and its 2h -> h projection); untied
    input and output embeddings."""
    hidden, ffn, head_dim = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    qkv = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * head_dim
    layer = [(qkv, hidden), (hidden, shape["num_attention_heads"] * head_dim), (2 * ffn, hidden), (hidden, ffn),
             (hidden,), (hidden,)]
    vocab = (shape["vocab_size"], hidden)
    return [vocab, *[part for _ in range(layers + 1) for part in layer], (hidden, 2 * hidden), (hidden,), vocab]


def timed(action: Callable[[], Any]) -> tuple[Any, float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    result = action()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - started


def megatron_staging(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """What `FileSystemWriterAsync.preload_tensors` does with each tensor, then its one synchronisation."""
    staged = [tensor.to("cpu", non_blocking=True) for tensor in tensors]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return staged


def written_lengths(tensors: list[torch.Tensor], limit: int) -> list[int]:
    """How many bytes of each tensor the child writes: whole tensors up to `limit` bytes in all, then the first
    `SAMPLE_BYTES` of each (so that the child reads from every tensor's memory, in a bounded time)."""
    lengths, total = [], 0
    for tensor in tensors:
        length = tensor.nbytes if total + tensor.nbytes <= limit else min(tensor.nbytes, SAMPLE_BYTES)
        lengths.append(length)
        total += length
    return lengths


def _write_staged(staged: list[torch.Tensor], lengths: list[int], path: str) -> None:
    """The forked child: the first `lengths` bytes of each staged tensor, in order, to `path` (no CUDA call)."""
    with open(path, "wb") as stream:
        for tensor, length in zip(staged, lengths):
            if length:
                stream.write(memoryview(tensor.reshape(-1).view(torch.uint8)[:length].numpy()))
    os._exit(0)


def forked_write(staged: list[torch.Tensor], sources: list[torch.Tensor], folder: Path, limit: int) -> dict[str, Any]:
    """Fork a child that writes `staged` to a file (as Megatron's writer is forked); check what it wrote."""
    path = folder / "staged.bin"
    lengths = written_lengths(staged, limit)
    process = multiprocessing.get_context("fork").Process(target=_write_staged, args=(staged, lengths, str(path)))
    started = time.perf_counter()
    process.start()
    forked = time.perf_counter()
    process.join()
    finished = time.perf_counter()
    result = {"fork_s": forked - started, "child_write_s": finished - forked, "exitcode": process.exitcode,
              "child_wrote_bytes": sum(lengths), "child_write_gb_per_s": sum(lengths) / 1e9 / (finished - forked)}
    if process.exitcode == 0:
        result["child_wrote_the_gpu_bytes"] = _written_equals(path, sources, lengths)
    path.unlink(missing_ok=True)
    return result


def _written_equals(path: Path, sources: list[torch.Tensor], lengths: list[int]) -> bool:
    if path.stat().st_size != sum(lengths):
        return False
    offsets = [sum(lengths[:index]) for index in range(len(lengths))]
    picks = sorted({0, len(sources) - 1, *range(1, len(sources), max(1, len(sources) // 8))})
    with open(path, "rb") as stream:
        for index in picks:
            source = sources[index].reshape(-1).view(torch.uint8)[:min(lengths[index], SAMPLE_BYTES)].cpu()
            stream.seek(offsets[index])
            written = torch.frombuffer(bytearray(stream.read(source.numel())), dtype=torch.uint8)
            if not torch.equal(written, source):
                return False
    return True


def heap_write_after_fork(heap: torch.Tensor) -> dict[str, float]:
    """Seconds to write `heap` (already touched) with no child, then right after a fork (the child sleeps)."""
    _, alone = timed(lambda: heap.fill_(1))
    process = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,))
    process.start()
    try:
        _, after_fork = timed(lambda: heap.fill_(2))
    finally:
        process.kill()
        process.join()
    return {"parent_heap_write_s": alone, "parent_heap_write_after_fork_s": after_fork}


def private_registered(nbytes: int, folder: Path) -> dict[str, Any]:
    """A private (torch) buffer page-locked with cudaHostRegister: register seconds, then fork seconds."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    _, touch_s = timed(lambda: buffer.zero_())
    started = time.perf_counter()
    error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 1))  # portable, as HostStaging
    result: dict[str, Any] = {"bytes": nbytes, "register_s": time.perf_counter() - started, "touch_s": touch_s,
                              "cuda_error": error}
    if error == 0:
        try:
            result.update(forked_write([buffer[: 2**20]], [buffer[: 2**20]], folder, 2**20))
        finally:
            torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
    return result


def garbage_collection() -> dict[str, Any]:
    import lightning.pytorch  # noqa: F401  (what a training process holds)
    import megatron.core  # noqa: F401

    import_megatron_bridge_first()
    gc.collect()
    tracked = len(gc.get_objects())
    full = [timed(gc.collect)[1] for _ in range(3)]
    youngest = [timed(lambda: gc.collect(0))[1] for _ in range(3)]
    gc.freeze()
    try:
        frozen = [timed(gc.collect)[1] for _ in range(3)]
    finally:
        gc.unfreeze()
    return {"tracked_objects": tracked, "full_collect_s": statistics.median(full),
            "gen0_collect_s": statistics.median(youngest), "full_collect_after_freeze_s": statistics.median(frozen),
            "thresholds": gc.get_threshold()}


def _transparent_hugepages() -> dict[str, str]:
    """The kernel's huge-page settings for private and shared memory (page-locking and faulting cost follow them)."""
    folder = Path("/sys/kernel/mm/transparent_hugepage")
    return {name: (folder / file).read_text().strip() for name, file in (("private", "enabled"),
                                                                          ("shared", "shmem_enabled"))
            if (folder / file).is_file()}


def section(results: dict[str, Any], name: str, action: Callable[[], Any]) -> None:
    """Run one measurement; a failure is recorded, not fatal (the others still tell). Each section's result also
    goes to stderr as it ends, so that a run stopped by a time limit still tells what it measured."""
    started = time.perf_counter()
    try:
        results[name] = action()
    except Exception as error:  # a probe reports what broke and goes on
        results[name] = {"error": f"{type(error).__name__}: {error}"}
    gc.collect()
    print(f"{name} ({time.perf_counter() - started:.1f} s): {json.dumps(results[name])}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a few small tensors on the CPU")
    parser.add_argument("--layers", type=int, default=QWEN3_8B["num_layers"], help="decoder layers (36: 16.8 GB)")
    parser.add_argument("--shm", type=Path, default=Path("/dev/shm"), help="where the forked child writes")
    parser.add_argument("--child-write-gib", type=float, default=4.0,
                        help="whole tensors the forked child writes (then 4 MiB of each other tensor)")
    parser.add_argument("--skip-gc", action="store_true", help="leave out the imports and collections")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    args.child_write_bytes = int(args.child_write_gib * 2**30)
    started = time.perf_counter()
    shape = dict(QWEN3_8B, hidden_size=64, intermediate_size=128, head_dim=16, vocab_size=512) if args.tiny \
        else QWEN3_8B
    layers = 2 if args.tiny else args.layers
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    generator = torch.Generator(device).manual_seed(0)
    sources = [torch.randn(size, generator=generator, device=device).to(torch.bfloat16)
               for size in checkpoint_shapes(shape, layers)]
    nbytes = sum(tensor.nbytes for tensor in sources)
    results: dict[str, Any] = {"bytes": nbytes, "tensors": len(sources), "device": device,
                               "transparent_hugepages": _transparent_hugepages()}
    folder = Path(tempfile.mkdtemp(prefix="staging_probe_", dir=args.shm if args.shm.is_dir() else None))
    try:
        def pageable() -> dict[str, float]:
            _, seconds = timed(lambda: [tensor.to("cpu") for tensor in sources])
            return {"s": seconds, "gb_per_s": nbytes / 1e9 / seconds}

        section(results, "pageable", pageable)

        def megatron() -> dict[str, Any]:
            first, first_s = timed(lambda: megatron_staging(sources))
            stats = torch.cuda.host_memory_stats() if device == "cuda" else {}
            forked = forked_write(first, sources, folder, args.child_write_bytes)
            del first
            again, again_s = timed(lambda: megatron_staging(sources))
            del again
            if device == "cuda":
                torch._C._host_emptyCache()
            return {"first_s": first_s, "again_s": again_s, "first_gb_per_s": nbytes / 1e9 / first_s,
                    "again_gb_per_s": nbytes / 1e9 / again_s,
                    "pinned_allocated_bytes": stats.get("allocated_bytes.current"),
                    "cuda_host_alloc_s": stats.get("host_alloc_time.total", 0) / 1e6, **forked}

        section(results, "megatron", megatron)

        def host_staging() -> dict[str, Any]:
            staging = HostStaging()
            staged, first_s = timed(lambda: staging.stage(sources))
            first = dict(staging.last_stage)
            forked = forked_write(staged, sources, folder, args.child_write_bytes)
            heap = torch.ones(HEAP_BYTES if device == "cuda" else 2**24, dtype=torch.uint8)
            heap_times = heap_write_after_fork(heap)
            del heap, staged
            again, again_s = timed(lambda: staging.stage(sources))
            del again
            staging.release()
            return {"pinned": staging.pin, "first_s": first_s, "again_s": again_s, "first": first,
                    "again_gb_per_s": nbytes / 1e9 / again_s, **forked, **heap_times}

        section(results, "host_staging", host_staging)
        if device == "cuda":
            section(results, "private_registered", lambda: private_registered(PRIVATE_REGISTERED_BYTES, folder))
        if not args.skip_gc:
            section(results, "gc", garbage_collection)
    finally:
        for leftover in folder.glob("*"):
            leftover.unlink()
        folder.rmdir()
    results["elapsed_s"] = time.perf_counter() - started
    line = json.dumps({"benchmark": "staging_probe", **environment(), **results})
    print(line, flush=True)
    if args.out is not None:
        write_text_atomically(args.out, line + "\n")


if __name__ == "__main__":
    main()
