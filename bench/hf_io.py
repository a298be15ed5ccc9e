"""P3: HF checkpoint load and save through each bridge, side by side with raw safetensors I/O of the same bytes.

For each bridge: `build` (model creation without random init, HF weights loaded) and `save_hf` (a complete HF
checkpoint written atomically), against reading the same tensors raw with safetensors onto the device the bridge
puts the model on, and writing them raw from there. The raw write is the fastest plain write of the same tensors
(`bench.common.raw_write`: HF's shards written in parallel, GPU tensors through pinned staging, no export), so
`save_vs_raw_write` is what the export costs; `export_s` times the export alone (tensors left on the device, nothing
written) and `save_gb_per_s` is the save's bytes over its time (target >= 4 GB/s at 8B, to a RAM-backed folder:
`TMPDIR=/dev/shm`); `save_extra_device_gib` is the device memory a save holds at its peak beyond the model (the
writer holds the tensors the export made until its file threads have copied them). The load alone into the built
model is timed twice: the package's sliced load (`load_s`, what `build` uses: each rank reads its slices on several
threads) and the library's own loader (`library_load_s`, one run); `load_report` says how the sliced load filled the
parameters (all from slices, `converted` 0, for the stock Qwen3 mappings). megatron-bridge loads and saves the MTP
head when the checkpoint has one; mbridge cannot build MTP heads, so its model, and its raw baseline, leave the MTP
tensors out. Times are medians over `--repeats` runs in one process after one warm-up (imports and first-call set-up
excluded); ratios are against raw (targets: load within 1.5x, save within 1.2x). `--tiny` (also the default without
`--checkpoint`): a tiny checkpoint made locally; `--checkpoint` for a real one (the 0.6B benchmark checkpoint:
`python -m bench.make_checkpoint`); `--qwen3-8b PATH`: the Qwen3-8B-shaped one (made on the GPU in seconds, reused
after).
`--load-only` leaves the saves out (the 8B loads then fit in a few minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import shutil
import statistics
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from bench.common import (
    QWEN3_8B,
    TINY_SCRATCH_BYTES,
    allocated_gib,
    emit,
    environment,
    fresh_memory,
    make_checkpoint,
    make_large_checkpoint,
    median_seconds,
    own_gib,
    peak_memory_gib,
    raw_write,
    require_free_space,
    scratch_dir,
    weights_bytes,
)
from bench.flops import ModelShape
from lightning_megatron.distributed import init_single_process
from lightning_megatron.families import is_hf_mtp_tensor


def _raw_read(files: list[Path], names: set[str], device: torch.device) -> dict[str, torch.Tensor]:
    """The named tensors, read with safetensors straight onto `device` into memory the caller owns (on the CPU
    safetensors hands out views of its memory map, which read nothing until touched: they are copied out)."""
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as handle:
            for name in handle.keys():
                if name in names:
                    tensor = handle.get_tensor(name)
                    tensors[name] = tensor.clone() if device.type == "cpu" else tensor
    return tensors


def _model_device(chunks: list[torch.nn.Module]) -> torch.device:
    return next(chunks[0].parameters()).device


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def _median_build_seconds(bridge: Any, options: Any, repeats: int) -> float:
    """Median time of `build`, each after the previous model was collected (Megatron modules hold reference
    cycles: without a collection every build would also pay for the memory of those before it)."""
    times = []
    for _ in range(repeats):
        gc.collect()
        times.append(median_seconds(lambda: bridge.build(options), 1))
    return statistics.median(times)


def _export_only(bridge: Any, chunks: list[torch.nn.Module]) -> None:
    """The export a save runs, its tensors left where the model is and dropped: what the save adds to the write."""
    for _ in bridge.export_hf_tensors(chunks, on_host=next(chunks[0].parameters()).device.type == "cpu"):
        pass


def measure_bridge(bridge_type: str, checkpoint: Path, workdir: Path, repeats: int, save: bool = True
                   ) -> dict[str, Any]:
    from lightning_megatron.bridges import create_bridge
    from lightning_megatron.options import ModelOptions

    files = sorted(checkpoint.glob("*.safetensors"))
    dtypes = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            dtypes.update({name: handle.get_slice(name).get_dtype() for name in handle.keys()})
    bridge = create_bridge(bridge_type, checkpoint)
    mtp = bridge_type == "megatron-bridge" and ModelShape.from_hf_checkpoint(checkpoint).mtp_layers > 0
    # the package's one rule for which HF tensors are the MTP head (the ones an mtp=False export leaves out)
    names = {name for name in dtypes if mtp or not is_hf_mtp_tensor(name)}
    options = ModelOptions(params_dtype=_DTYPES[dtypes[min(names)]], mtp=mtp)
    chunks = bridge.build(options)  # warm-up: the first build pays one-time set-up
    device = _model_device(chunks)
    tensors = _raw_read(files, names, device)
    size = sum(tensor.nbytes for tensor in tensors.values())
    raw_read_s = median_seconds(lambda: _raw_read(files, names, device), repeats)
    if save:  # the raw copy goes before the export's: at 8B each is 17 GB; a replacing save holds two exports
        require_free_space(workdir, int(2.05 * size), f"hf_io {bridge_type}")
        try:
            raw_write_s = median_seconds(partial(raw_write, tensors, workdir / f"raw-{bridge_type}"), repeats)
        finally:
            shutil.rmtree(workdir / f"raw-{bridge_type}", ignore_errors=True)
    del tensors
    build_s = _median_build_seconds(bridge, options, repeats)
    sliced_load_s = median_seconds(lambda: bridge.load_hf_weights(chunks), repeats)
    library_load_s = median_seconds(lambda: bridge.load_hf_weights(chunks, sliced=False), 1)  # the slow reference
    result = {
        "mtp": mtp,
        "tensors": len(names),
        "bytes": size,
        "device": str(device),
        "raw_read_s": raw_read_s,
        "build_and_load_s": build_s,
        "load_vs_raw_read": build_s / raw_read_s,
        "load_s": sliced_load_s,
        "library_load_s": library_load_s,
        "sliced_load_vs_raw_read": sliced_load_s / raw_read_s,
        "library_load_vs_raw_read": library_load_s / raw_read_s,
        "load_report": dataclasses.asdict(bridge.load_hf_weights(chunks)),
    }
    result.update(raw_write_s=None, save_s=None, save_vs_raw_write=None, export_s=None, save_gb_per_s=None,
                  raw_write_gb_per_s=None, save_extra_device_gib=None)  # `--load-only`: the report says n/a
    if save:
        export_s = median_seconds(lambda: _export_only(bridge, chunks), repeats)
        fresh_memory()
        at_start_gib = allocated_gib()
        try:
            save_s = median_seconds(lambda: bridge.save_hf(chunks, workdir / f"export-{bridge_type}"), repeats)
        finally:
            shutil.rmtree(workdir / f"export-{bridge_type}", ignore_errors=True)
        result.update(raw_write_s=raw_write_s, save_s=save_s, save_vs_raw_write=save_s / raw_write_s,
                      export_s=export_s, save_gb_per_s=size / save_s / 1e9, raw_write_gb_per_s=size / raw_write_s / 1e9,
                      save_extra_device_gib=own_gib(peak_memory_gib(), at_start_gib))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny checkpoint made locally (the default)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="an HF checkpoint folder (default: a tiny one)")
    parser.add_argument("--qwen3-8b", type=Path, default=None, metavar="PATH",
                        help="the Qwen3-8B-shaped checkpoint (untied, one MTP layer) at PATH, made there once")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bridges", nargs="+", default=["mbridge", "megatron-bridge"])
    parser.add_argument("--load-only", action="store_true", help="time the loads only, not the saves")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    if sum(map(bool, (args.tiny, args.checkpoint, args.qwen3_8b))) > 1:
        parser.error("--tiny, --checkpoint and --qwen3-8b exclude each other")

    if args.qwen3_8b:
        args.checkpoint = make_large_checkpoint(args.qwen3_8b, mtp=True, tied=False, **QWEN3_8B)
    needed = TINY_SCRATCH_BYTES  # the tiny checkpoint and its copies
    if args.checkpoint and not args.load_only:  # a raw copy, then two exports (a save replacing the one before)
        needed = int(2.05 * weights_bytes(args.checkpoint))
    with scratch_dir("hf_io_", needed) as workdir:
        checkpoint = args.checkpoint or make_checkpoint(workdir / "tiny-qwen3-mtp", tiny=True)
        init_single_process()
        result: dict[str, Any] = {
            "benchmark": "hf_io",
            **environment(),
            "checkpoint": str(checkpoint) if args.checkpoint else "tiny qwen3 + MTP (bench.common.make_checkpoint)",
            "output_folder": str(workdir),
            "repeats": args.repeats,
            "target_vs_raw": 1.5,
            "target_save_vs_raw": 1.2,
            "bridges": {bridge_type: measure_bridge(bridge_type, checkpoint, workdir, args.repeats, not args.load_only)
                        for bridge_type in args.bridges},
        }
    emit(result, args.out)


if __name__ == "__main__":
    main()
