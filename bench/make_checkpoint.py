"""Write the benchmark checkpoint (Qwen3-0.6B shape, one MTP layer, tied embeddings, random bf16 weights).

`python -m bench.make_checkpoint checkpoints/qwen3-0.6b-mtp` (about 30 s on one CPU core; `--tiny` for the tiny fp32 one).
The same command always writes the same bytes (`lightning_megatron.testing.checkpoints.make_tiny_checkpoint`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.common import make_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path)
    parser.add_argument("--tiny", action="store_true", help="the tiny fp32 shape instead of Qwen3-0.6B")
    args = parser.parse_args()
    started = time.perf_counter()
    path = make_checkpoint(args.path, tiny=args.tiny)
    size = sum(file.stat().st_size for file in path.glob("*.safetensors"))
    print(f"wrote {path} ({size / 1e9:.2f} GB of safetensors) in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
