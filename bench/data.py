"""SFT data set-up at the scale of real runs: tokenizing a generated chat set into the cache, and finding it again.

Generates (once, deterministically) a JSONL chat set of `--rows` rows of about `--tokens` tokens each (a user turn
and an assistant turn of random words, lengths calibrated on the tokenizer), then runs, each in a fresh process as
one rank of a run would:
- `first`: `SFTDataModule(packing=True, seq_length=2048).setup("fit")` with no cache: read, validate, tokenize
  (`--workers` processes), write the cache, plan the packing. Setup time and rows/s.
- `second`: the same, the cache in place: setup time (hash the data, verify the cache, map it), then `--steps`
  micro-batches through the train dataloader as training draws them (shuffled). Peak RSS of the process beyond its
  RSS after imports, sampled every 20 ms through setup and the steps; the file-backed part (pages of the mapped
  cache) and the anonymous part are also reported.
Plus the cache's size on disk. The tokenizer is the tiny Qwen3 one `make_tiny_checkpoint` writes (the issue's
measurement used it too). `python -m bench.data --out bench/results/data/data_cpu_1m.json` (the 1M-row run takes
tens of minutes on 2 cores); `--tiny` is 400 rows.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import emit, environment

WORDS = ("the model reads a long answer about data and tokens while every rank waits for its cache to be ready "
         "packing rows of text into sequences keeps the accelerator busy with useful work instead of padding").split()


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="400 rows, 40 steps (a CPU check)")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--tokens", type=int, default=600, help="about this many tokens a row")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)),
                        help="tokenize_workers (default: every CPU this process may use)")
    parser.add_argument("--steps", type=int, default=2000, help="micro-batches drawn in the second run")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "lightning_megatron_bench_data")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--phase", choices=["first", "second"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        args.rows, args.steps = 400, 40
    return args


def _make_data(args: argparse.Namespace) -> tuple[Path, Path]:
    from transformers import AutoTokenizer

    from lightning_megatron.atomic import write_file_atomically
    from lightning_megatron.data.tokenize import quiet_length_warning
    from lightning_megatron.testing.checkpoints import make_tiny_checkpoint

    args.workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = args.workdir / "qwen3"
    if not (checkpoint / "config.json").is_file():
        make_tiny_checkpoint(checkpoint)
    data = args.workdir / f"chat_{args.rows}x{args.tokens}.jsonl"
    if data.is_file():
        return checkpoint, data
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    rng = random.Random(0)
    sample = " ".join(rng.choice(WORDS) for _ in range(400))
    with quiet_length_warning():
        tokens_per_word = len(tokenizer(sample)["input_ids"]) / 400
    words = max(8, int(args.tokens / tokens_per_word))

    def write(path: Path) -> None:
        with path.open("w") as handle:
            for index in range(args.rows):
                n = rng.randint(words // 2, 3 * words // 2)  # lengths spread around the mean, as real sets are
                question = " ".join(rng.choices(WORDS, k=max(4, n // 5)))
                answer = " ".join(rng.choices(WORDS, k=n - n // 5))
                row = {"messages": [{"role": "user", "content": f"{index}: {question}?"},
                                    {"role": "assistant", "content": answer}]}
                handle.write(json.dumps(row) + "\n")

    write_file_atomically(data, write)
    return checkpoint, data


class RSSSampler:
    """The process's resident memory (total, file-backed, anonymous) every 20 ms; the peaks above a baseline."""

    def __init__(self) -> None:
        self.baseline = self._read()
        self.peak = dict(self.baseline)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _read() -> dict[str, int]:
        fields = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssFile", "RssAnon"):
                fields[name] = int(value.split()[0]) * 1024
        return fields

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for name, value in self._read().items():
                self.peak[name] = max(self.peak[name], value)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        gib = 1024**3
        return {"baseline_rss_gib": self.baseline["VmRSS"] / gib,
                "peak_rss_beyond_start_gib": (self.peak["VmRSS"] - self.baseline["VmRSS"]) / gib,
                "peak_anon_beyond_start_gib": (self.peak["RssAnon"] - self.baseline["RssAnon"]) / gib,
                "peak_file_backed_beyond_start_gib": (self.peak["RssFile"] - self.baseline["RssFile"]) / gib}


def _phase(args: argparse.Namespace, checkpoint: Path, data: Path) -> dict[str, Any]:
    """One rank's setup (and, in the second run, its training draws), in this fresh process."""
    import torch  # imported before the baseline, as in a training process

    from lightning_megatron.data import SFTDataModule

    torch.set_num_threads(1)
    sampler = RSSSampler()
    datamodule = SFTDataModule(str(data), hf_checkpoint=str(checkpoint), seq_length=args.seq_length, packing=True,
                               micro_batch_size=1, cache_dir=str(args.workdir / "cache"),
                               tokenize_workers=args.workers)
    started = time.perf_counter()
    datamodule.setup("fit")
    setup_s = time.perf_counter() - started
    rows = len(datamodule.datasets["train"].examples)
    result: dict[str, Any] = {"setup_s": setup_s, "built": datamodule.cache_built["train"], "rows": rows,
                              "packed_rows": len(datamodule.datasets["train"])}
    if args.phase == "first":
        result["rows_per_s"] = rows / setup_s
    else:
        started = time.perf_counter()
        tokens = 0
        for step, batch in enumerate(datamodule.train_dataloader()):
            tokens += int((batch["loss_mask"] > 0).sum())
            if step + 1 == args.steps:
                break
        result.update(steps=step + 1, steps_s=time.perf_counter() - started, trained_tokens=tokens)
    result.update(sampler.stop())
    return result


def main() -> None:
    args = _parse_args()
    checkpoint, data = _make_data(args)
    if args.phase is not None:
        print(json.dumps(_phase(args, checkpoint, data)))
        return
    shutil.rmtree(args.workdir / "cache", ignore_errors=True)
    phases = {}
    for phase in ("first", "second"):
        command = [sys.executable, "-m", "bench.data", "--phase", phase, "--rows", str(args.rows), "--tokens",
                   str(args.tokens), "--seq-length", str(args.seq_length), "--steps", str(args.steps),
                   "--workdir", str(args.workdir), "--workers", str(args.workers)]
        completed = subprocess.run(command, check=True, capture_output=True, text=True)
        sys.stderr.write(completed.stderr)
        phases[phase] = json.loads(completed.stdout.strip().splitlines()[-1])
    cache_bytes = sum(file.stat().st_size for file in (args.workdir / "cache").rglob("*") if file.is_file())
    result = {
        **environment(), "rows": args.rows, "tokens_per_row_target": args.tokens, "seq_length": args.seq_length,
        "workers": args.workers, "cpus": os.cpu_count(), "data_bytes": data.stat().st_size,
        "first_run": phases["first"], "second_run": phases["second"], "cache_bytes": cache_bytes,
        "targets": {"second_run_setup_s": 10.0, "peak_rss_beyond_start_gib": 0.5},
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
