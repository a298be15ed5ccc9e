"""What every benchmark here shares: options, checkpoints, the environment record, memory, JSON output.

The benchmarked model is Qwen3-0.6B-shaped (hidden 1024, 28 layers, 16 heads, 8 KV groups, head_dim 128, FFN 3072,
vocab 151936, tied embeddings, one MTP layer) with random weights, written locally as a bf16 HF checkpoint; the
tiny CPU mode uses the same code on `make_tiny_checkpoint`'s default shape.

The model shape and its FLOPs (MFU) are `bench/flops.py`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from lightning_megatron.atomic import remove_folder, write_atomically, write_text_atomically

PACKAGES = ("torch", "megatron-core", "megatron-bridge", "mbridge", "transformers", "lightning")

QWEN3_0_6B: dict[str, Any] = dict(
    num_layers=28, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    intermediate_size=3072, vocab_size=151936, max_position_embeddings=40960,
)
"""`make_tiny_checkpoint` arguments of the Qwen3-0.6B shape (the real model's max_position_embeddings too)."""

QWEN3_8B: dict[str, Any] = dict(
    num_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    intermediate_size=12288, vocab_size=151936, max_position_embeddings=40960,
)
"""The Qwen3-8B shape (untied embeddings in the real model)."""

QWEN3_4B: dict[str, Any] = dict(
    num_layers=36, hidden_size=2560, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    intermediate_size=9728, vocab_size=151936, max_position_embeddings=40960,
)
"""The Qwen3-4B shape (tied embeddings in the real model)."""

QWEN3_30B_A3B: dict[str, Any] = dict(
    num_layers=48, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    intermediate_size=6144, vocab_size=151936, max_position_embeddings=40960,
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
)
"""The Qwen3-30B-A3B shape (`qwen3_moe`, untied): every layer's MLP is 128 experts of FFN 768, 8 per token."""

QWEN3_5_2B: dict[str, Any] = dict(
    num_layers=24, hidden_size=2048, intermediate_size=6144, num_attention_heads=8, num_key_value_heads=2,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248320, max_position_embeddings=262144,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(24)],
    rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25),
)
"""Qwen/Qwen3.5-2B's text model (`qwen3_5_text`; tied embeddings, one MTP layer): 24 layers of hidden 2048, 8 query
and 2 KV heads, 6 of them gated full attention (every 4th: the model card's 6 KV-bearing layers), the others gated
DeltaNet. Sources: layers, hidden, heads and the 6 attention layers from the model card (as fitmygpu.com/models/
qwen-3.5-2b lists them); head_dim 256, the DeltaNet's 16 key and 16 value heads of 128 and width 4, RoPE theta 1e7
on a quarter of each head, the 248320-token vocabulary and tied embeddings as Qwen3.5-0.8B's config has them
(THUDM/slime scripts/models/qwen3.5-0.8B.sh, cpehle/tyr Tyr/Model/Qwen35/Config.lean); FFN 6144 from the published
config.json as remembered, not re-read here: check it against the hub's config.json when one is reachable."""

GLM4_5_AIR: dict[str, Any] = dict(
    num_layers=46, hidden_size=4096, intermediate_size=10944, num_attention_heads=96, num_key_value_heads=8,
    head_dim=128, n_routed_experts=128, num_experts_per_tok=8, moe_intermediate_size=1408, n_shared_experts=1,
    first_k_dense_replace=1, routed_scaling_factor=1.0, vocab_size=151552, max_position_embeddings=131072,
    rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0, partial_rotary_factor=0.5),
)
"""zai-org/GLM-4.5-Air (`glm4_moe`; untied, one MTP layer stored as decoder layer 46): 46 layers of hidden 4096, 96
query and 8 KV heads of 128 with q/k/v biases, RoPE on half of each head; layer 0 dense (FFN 10944), the other 45
with 128 routed experts (top 8, FFN 1408, sigmoid routing with an expert bias) and one shared expert; vocabulary
151552. Source: THUDM/slime scripts/models/glm4.5-106B-A12B.sh, the same checkpoint's Megatron arguments (its
routed_scaling_factor 1.0 from the absent --moe-router-topk-scaling-factor that the 355B script sets to 2.5)."""

_HF_CONFIG_KEYS = {"num_layers": "num_hidden_layers"}


def add_step_options(parser: argparse.ArgumentParser) -> None:
    """The options every training-step benchmark shares: batch shape, timed and warm-up steps, MFU peak, output."""
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run (after warm-up)")
    parser.add_argument("--warmup", type=int, default=3)


def parse_with_tiny(parser: argparse.ArgumentParser, tiny_defaults: dict[str, Any]) -> argparse.Namespace:
    """Parse the command line; with `--tiny`, `tiny_defaults` replace the defaults (explicit flags still win)."""
    parser.add_argument("--peak-tflops", type=float, default=None, help="peak for MFU (default: H200 dense bf16)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    if args.tiny:
        parser.set_defaults(**tiny_defaults)
        args = parser.parse_args()
    return args


def checkpoint_scratch_bytes(tiny: bool) -> int:
    """The free space a temporary folder holding `make_checkpoint(..., tiny=tiny)` needs."""
    return TINY_SCRATCH_BYTES if tiny else hf_checkpoint_bytes(QWEN3_0_6B, tied=True)


def make_checkpoint(path: str | Path, *, tiny: bool) -> Path:
    """The benchmark checkpoint: Qwen3 with one MTP layer, tied embeddings; bf16 0.6B shape, or tiny fp32."""
    from lightning_megatron.testing.checkpoints import make_tiny_checkpoint

    if tiny:
        return make_tiny_checkpoint(path, "qwen3", mtp=True, tied=True)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    require_free_space(Path(path).parent, hf_checkpoint_bytes(QWEN3_0_6B, tied=True), f"checkpoint {path}")
    return make_tiny_checkpoint(path, "qwen3", mtp=True, tied=True, dtype=torch.bfloat16, **QWEN3_0_6B)


def reshape_config(folder: Path, shape: dict[str, Any]) -> None:
    """Give a tiny checkpoint's config.json the `make_tiny_checkpoint`-style `shape` (its per-layer `layer_types`
    dropped unless `shape` gives them: transformers >= 5.17 refuses a count that differs from the layers)."""
    from lightning_megatron.moe import EXPERT_COUNT_KEYS

    config = json.loads((folder / "config.json").read_text())
    config.pop("layer_types", None)
    updates = {_HF_CONFIG_KEYS.get(key, key): value for key, value in shape.items()}
    if "num_experts" in updates:  # under the key this transformers version writes (5.x: num_local_experts)
        updates[next((key for key in EXPERT_COUNT_KEYS if key in config), "num_experts")] = updates.pop("num_experts")
    config.update(updates)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def make_large_checkpoint(path: str | Path, *, mtp: bool = True, tied: bool = False,
                          dtype: torch.dtype = torch.bfloat16, **shape: Any) -> Path:
    """A random-weight Qwen3 HF checkpoint of any size, made in seconds and reused when already there.

    `make_tiny_checkpoint` draws every tensor on one CPU core (minutes at 8B); here the config and tokenizer come
    from a one-layer checkpoint of the same shape family, and the weights are drawn on the GPU (when there is one)
    shard by shard and written with the package's threaded safetensors writer.
    """
    from lightning_megatron.hf_io import plan_shards, shard_file_names, write_index, write_shard_files
    from lightning_megatron.testing.checkpoints import CheckpointShape, make_tiny_checkpoint, tensor_shapes

    path = Path(path)
    if (path / "config.json").is_file():
        return path
    shape = {**QWEN3_0_6B, **shape}
    shapes = tensor_shapes("qwen3", mtp, tied, CheckpointShape(**shape))
    sizes = {name: math.prod(dims) * torch.empty((), dtype=dtype).element_size() for name, dims in shapes.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    for leftover in path.parent.glob(f".{path.name}.partial-*"):  # write_atomically's folder of a killed run (17 GB)
        remove_folder(leftover, ignore_errors=True)
    require_free_space(path.parent, int(1.02 * sum(sizes.values())), f"checkpoint {path}")

    def write(staging: Path) -> None:
        small = make_tiny_checkpoint(staging, "qwen3", mtp=mtp, tied=tied, dtype=dtype)  # config layout, tokenizer
        reshape_config(small, shape)
        (small / "model.safetensors").unlink()
        shards = plan_shards(sizes)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        generator = torch.Generator(device).manual_seed(0)
        for file, shard in zip(shard_file_names(len(shards)), shards):
            tensors = {}
            for name in shard:
                values = torch.randn(shapes[name], generator=generator, device=device, dtype=torch.float32)
                values = 1.0 + 0.1 * values if name.endswith("norm.weight") else values / shapes[name][-1] ** 0.5
                tensors[name] = values.to(dtype).cpu()
            write_shard_files(small, {file: tensors})
        write_index(small, shards, sizes)

    write_atomically(path, write)  # a failed write leaves no partial copy behind
    return path


def make_config_only_checkpoint(path: str | Path, shape: dict[str, Any], *, tied: bool, tiny: bool = False,
                                family: str | None = None) -> Path:
    """A `family` checkpoint folder with one MTP layer, of `shape` (config.json fields, `num_layers` for the layer
    count), without weights (config, tokenizer, generation config): what a model built with
    `ModelOptions(random_weights=True)` needs, so an 8B shape costs no 16 GB write and read. `tiny`: the tiny shape
    itself (CPU runs). `family` None: Qwen3, or Qwen3-MoE (`qwen3_moe`; tiny: 4 experts, top 2) for a `shape` with
    `num_experts`."""
    from lightning_megatron.testing.checkpoints import make_tiny_checkpoint

    if family is None:
        family = "qwen3_moe" if "num_experts" in shape else "qwen3"
    path = make_tiny_checkpoint(path, family, mtp=True, tied=tied)
    for weights in [*path.glob("*.safetensors"), *path.glob("*.safetensors.index.json")]:
        weights.unlink()
    if not tiny:
        reshape_config(path, shape)
    return path


def import_megatron_bridge_first() -> None:
    """Import megatron-bridge before the first run, so that the first run does not pay for it. (Its first import
    once kept every frame then on the stack, and so a run's model; `import_megatron_bridge` now forgets those
    tracebacks: `_compat/kept_tracebacks.py`.)"""
    from lightning_megatron._compat import import_megatron_bridge

    import_megatron_bridge()


def start_single_process(*, tiny: bool) -> None:
    """What a one-process training benchmark does first: one CPU thread when tiny (tests run several at once), the
    process group and Megatron parallel state, megatron-bridge imported first."""
    if tiny:
        torch.set_num_threads(1)
    from lightning_megatron.distributed import init_single_process

    init_single_process()
    import_megatron_bridge_first()


def release_model(chunks: list[torch.nn.Module]) -> None:
    """Let a finished run's model, grad buffers and optimizer be freed (`schedule.release_training_hooks`, what
    `MegatronStrategy.teardown` does): else the next run's peak memory counts them."""
    from lightning_megatron.schedule import release_training_hooks

    release_training_hooks(chunks)


class CpuClock:
    """Host CPU time per step beside its wall time: the whole process's (every thread) and the training thread's.

    Why: a step bound by the host can be slower with the same work because the training thread does more, because
    other threads of the process burn CPU beside it (process time above the thread's), or because it waits off the
    CPU (wall time above the thread's); the three tell these apart. `lap()` returns both since the last lap."""

    def __init__(self) -> None:
        self._last = (time.process_time(), time.thread_time())

    def lap(self) -> tuple[float, float]:
        now = (time.process_time(), time.thread_time())
        (process_then, thread_then), self._last = self._last, now
        return now[0] - process_then, now[1] - thread_then


def live_threads() -> list[str]:
    """The names of the process's Python threads (besides the main one), for a run's record."""
    import threading

    return sorted(thread.name for thread in threading.enumerate() if thread is not threading.main_thread())


def median_seconds(action: Callable[[], Any], repeats: int) -> float:
    """Median wall time of `repeats` calls of `action`, each between two device synchronisations."""
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        action()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


SCRATCH_PREFIX = "lightning_megatron_bench."
"""The start of every benchmark's temporary folder name: `bench/run_h200.sh` removes, by this name, what a step
killed before its `finally` (a call's time limit, SIGKILL) left in the temporary folder."""

TINY_SCRATCH_BYTES = 256 * 2**20
"""Room for a tiny checkpoint and its copies (a few MB each) or a config-only one."""


def require_free_space(folder: Path, nbytes: int, step: str) -> None:
    """Stop a step before it writes when `folder`'s file system cannot hold `nbytes` (8B copies are 17 GB each)."""
    free = shutil.disk_usage(folder).free
    if free < nbytes:
        tmpdir = f"TMPDIR={os.environ['TMPDIR']}" if "TMPDIR" in os.environ else "TMPDIR is not set"
        raise SystemExit(f"{step}: {folder} has {free / 1e9:.1f} GB free but needs {nbytes} bytes "
                         f"({nbytes / 1e9:.1f} GB; {tmpdir}); free space there or set TMPDIR to a folder with more "
                         f"room (a RAM-backed one such as /dev/shm)")


@contextlib.contextmanager
def scratch_dir(prefix: str, bytes_needed: int, parent: Path | None = None) -> Iterator[Path]:
    """A new folder for one step's temporary files, removed when the step ends, also when it fails.

    It is made under `parent` (default: the system temporary folder, `TMPDIR`) after checking that the file system
    there has `bytes_needed` free, so that a step that cannot fit stops at once, before it writes, naming the folder,
    the bytes and TMPDIR (a half-written 8B copy would otherwise fill the disk for every step after it)."""
    root = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    require_free_space(root, bytes_needed, prefix.rstrip("_"))
    folder = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX + prefix, dir=root))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def hf_checkpoint_bytes(shape: dict[str, Any], *, tied: bool, mtp_layers: int = 1, bytes_per_weight: int = 2) -> int:
    """The bytes of a Qwen3 HF checkpoint of `shape` (`make_tiny_checkpoint` arguments), with 5% slack: the
    free space a step checks before it writes one or a copy of one (the 8B shape, untied, bf16: about 17 GB)."""
    h, f, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    q, k = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    layer = h * (q + 2 * k) + q * h + 3 * h * f + 2 * h
    mtp = mtp_layers * (layer + 2 * h * h + 3 * h)
    return int(1.05 * bytes_per_weight * (shape["num_layers"] * layer + (1 if tied else 2) * vocab * h + mtp))


def weights_bytes(checkpoint: Path) -> int:
    """The bytes of an HF checkpoint's safetensors files."""
    return sum(path.stat().st_size for path in Path(checkpoint).glob("*.safetensors"))


def raw_write(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """The fastest plain write of these tensors: HF's shard plan, the files written in parallel, GPU tensors
    through pinned staging, tensors taken from every file in turn (the package's writer with no export before it:
    a save's ratio to this is what the export and its order cost)."""
    from lightning_megatron.hf_io import plan_shards, shard_file_names, write_shard_files

    shards = plan_shards({name: tensor.nbytes for name, tensor in tensors.items()})
    folder.mkdir(parents=True, exist_ok=True)
    write_shard_files(folder, {file: {name: tensors[name] for name in shard}
                               for file, shard in zip(shard_file_names(len(shards)), shards)})


def fresh_memory() -> None:
    """Free what the last run left and restart the peak-memory count. cuBLAS's workspaces (32 MiB per handle and
    stream on Hopper) come from the caching allocator and outlive a run; they are freed too, so what a run reports
    as allocated at its start is only what an earlier run leaked."""
    gc.collect()
    if torch.cuda.is_available():
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def allocated_gib() -> float | None:
    return torch.cuda.memory_allocated() / 1024**3 if torch.cuda.is_available() else None


def own_gib(peak_gib: float | None, at_start_gib: float | None) -> float | None:
    """A run's own peak: the allocator's peak less what was already allocated when the run started (an earlier
    run's leftovers stay allocated through it: `release_model` frees what it can)."""
    return None if peak_gib is None else peak_gib - (at_start_gib or 0.0)


def peak_memory_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 1024**3 if torch.cuda.is_available() else None


def reserved_gib() -> float | None:
    return torch.cuda.memory_reserved() / 1024**3 if torch.cuda.is_available() else None


def peak_reserved_gib() -> float | None:
    """The most the caching allocator held from the device since the peak was reset: live tensors, cached blocks
    and CUDA graph pools. `peak_memory_gib` counts live tensors only, so a graph's working set, kept in its private
    pool between replays, shows here and not there."""
    return torch.cuda.max_memory_reserved() / 1024**3 if torch.cuda.is_available() else None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


SWITCH_PREFIX = "LIGHTNING_MEGATRON_"


def environment() -> dict[str, Any]:
    """The exact command (and the driver that ran it, from `BENCH_DRIVER`), the package's switches it ran with
    (`LIGHTNING_MEGATRON_*` variables, e.g. `LIGHTNING_MEGATRON_FAST_SWIGLU=0`: the command alone does not say),
    the device, the library versions and the date, for the JSON of every benchmark."""
    main_spec = getattr(sys.modules["__main__"], "__spec__", None)
    launch = ["-m", main_spec.name] if main_spec is not None else [sys.argv[0]]
    return {
        "command": shlex.join([Path(sys.executable).name, *launch, *sys.argv[1:]]),
        "driver": os.environ.get("BENCH_DRIVER"),
        "switches": {name: value for name, value in sorted(os.environ.items()) if name.startswith(SWITCH_PREFIX)},
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "versions": {package: _version(package) for package in PACKAGES},
        "python": platform.python_version(),
        "cpu": _cpu_model(),  # host-bound steps follow the host's CPU
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                platform.processor())


def json_text(result: dict[str, Any]) -> str:
    return json.dumps(result, indent=2) + "\n"


def emit(result: dict[str, Any], out: Path | None) -> None:
    """Print the result as JSON and, with `out`, write it there too."""
    text = json_text(result)
    print(text, end="")
    if out is not None:
        write_text_atomically(out, text)
