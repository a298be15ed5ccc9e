"""HF checkpoint load and save through each bridge, side by side with raw safetensors I/O of the same bytes.

Prints one JSON object. `--tiny` (the default) uses a tiny checkpoint made locally; pass `--checkpoint` for a real
one. Times are medians over `--repeats` runs in one process (imports excluded); ratios are against raw I/O.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from importlib import metadata
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lightning_megatron.demo import init_single_process


def _median_seconds(action, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", type=Path, default=None, help="an HF checkpoint folder (default: a tiny one)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bridges", nargs="+", default=["mbridge", "megatron-bridge"])
    args = parser.parse_args()

    from lightning_megatron.bridges import ModelOptions, create_bridge
    from lightning_megatron.testing import make_tiny_checkpoint

    workdir = Path(tempfile.mkdtemp(prefix="hf_io_"))
    checkpoint = args.checkpoint or make_tiny_checkpoint(workdir / "tiny-qwen3", "qwen3")
    init_single_process()
    files = sorted(checkpoint.glob("*.safetensors"))

    def raw_read() -> dict[str, torch.Tensor]:
        return {name: tensor for file in files for name, tensor in load_file(file).items()}

    tensors = raw_read()
    result = {
        "checkpoint": str(checkpoint) if args.checkpoint else "tiny qwen3 (make_tiny_checkpoint)",
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "raw_read_s": _median_seconds(raw_read, args.repeats),
        "raw_write_s": _median_seconds(lambda: save_file(tensors, workdir / "raw.safetensors"), args.repeats),
        "bridges": {},
        "versions": {p: metadata.version(p) for p in ("torch", "megatron-core", "megatron-bridge", "mbridge")},
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "date": time.strftime("%Y-%m-%d"),
    }
    dtype = next(iter(tensors.values())).dtype
    for bridge_type in args.bridges:
        bridge = create_bridge(bridge_type, checkpoint)
        chunks = bridge.build(ModelOptions(params_dtype=dtype))  # warm-up: first build pays one-time set-up
        load_s = _median_seconds(lambda: bridge.build(ModelOptions(params_dtype=dtype)), args.repeats)
        save_s = _median_seconds(lambda: bridge.save_hf(chunks, workdir / f"export-{bridge_type}"), args.repeats)
        result["bridges"][bridge_type] = {
            "build_and_load_s": load_s,
            "save_s": save_s,
            "load_vs_raw_read": load_s / result["raw_read_s"],
            "save_vs_raw_write": save_s / result["raw_write_s"],
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
