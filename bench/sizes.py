"""Issue 41: throughput at the sizes users train on one GPU, each configuration beside the plain Megatron-Core loop.

Every configuration builds its model with Megatron's random initialization straight on the GPU from a config-only
checkpoint (`ModelOptions(random_weights=True)`: no weights written or read), bf16, megatron-bridge, distributed
optimizer, and trains on packed rows of `--seq` (4096) tokens: SFT-like sequences of `--min-length`-`--max-length`
tokens (P5's, `bench.packing_profile.sft_sequences`) packed first-fit by the data pipeline's own packing, the
`rows` fullest rows of the pool as one global batch (micro-batch 1), the same rows every step. Two runs of it in
this process, one after the other, each released before the next (`common.release_model`):

- `lightning`: `Trainer` + `MegatronStrategy` + `SFTModule` (+ `LoRACallback`), with only the options the
  configuration names (`cuda_graph` is not passed where the configuration says None: the strategy's default, `auto`,
  which graphs the dense configurations on a GPU and runs the MoE one eagerly);
- `plain`: the plain Megatron-Core loop (`bench/megatron_loop.py`) on the same model, rows and options: the same
  LoRA transform, the same optimizer offload, and the whole-iteration CUDA graph exactly when the Lightning run
  replayed one (for the default configurations: whatever `auto` chose, read from the strategy's graph counts).

| configuration | model | training | targets (issue 41) |
|---|---|---|---|
| `qwen3_8b_lora` | Qwen3-8B, untied | LoRA (rank 8, alpha 16), every linear | >= 8,429 tokens/s, <= 1.0x the loop |
| `qwen3_8b_lora_qkv_proj` | the same | LoRA on `linear_qkv`, `linear_proj` only | (not default) |
| `qwen3_4b_full` | Qwen3-4B, tied | full SFT | >= 40% MFU |
| `qwen3_0.6b_mtp_default` | Qwen3-0.6B, tied, one MTP layer | joint SFT + MTP, `auto` | >= 30% MFU, <= 1.01x |
| `qwen3_0.6b_mtp_eager` | the same | `cuda_graph: none` | <= 1.01x |
| `qwen3_0.6b_mtp_graphed` | the same | `cuda_graph: full_iteration` | <= 1.01x |
| `qwen3_30b_a3b_lora` | Qwen3-30B-A3B (128 experts, top 8, 48 layers) | LoRA on attention | tokens/s |
| `qwen3_8b_full_offload` | Qwen3-8B | full SFT, 3/4 of the optimizer on the host | tokens/s (not default) |

Per run: the median step time over `--steps` steps after `--warmup` (from one synchronised step end to the next, as
`bench/lightning_overhead.py` times them), real (non-pad) tokens/s, model TFLOP/s and MFU (Megatron-LM's count,
`bench/flops.py`, summed over the packed sequences: each sequence's attention is its own length squared; every
GEMM counted with three passes also under LoRA, as Megatron-Bridge's card counts its 387 TFLOP/s; the MoE's active
FFN), peak memory of the training steps, the host CPU time of the median step (`process_cpu_s_median`: every
thread's, `main_thread_cpu_s_median`: the training thread's; a wait for the device that spins counts too) with the
run's other Python threads (`threads`): an eager step bound by the host that is slower under Lightning with the same
kernels shows there whether its thread worked more, shared the CPU or waited, and one more step profiled (`bench.packing_profile.profile_figures`: the
GPU-busy fraction of the median step, kernel and graph launches, top kernels), and which torch Adam each part of
Megatron's optimizer stepped with (`adam`: "fused" on a GPU without TE/Apex, `_compat.fused_adam`, in both runs;
`LIGHTNING_MEGATRON_FUSED_ADAM=0` for both upstream's foreach). A run that fails (out of memory
included) is that run's row with its error; the other runs still go. `--tiny`: the tiny shapes in fp32 on the CPU
(what tests/bench/ runs; configurations that need CUDA are skipped with the reason).

Why Qwen3-30B-A3B has LoRA on attention only: Megatron-Bridge's Qwen3-30B-A3B (and current Qwen3-8B) LoRA recipes
target `linear_qkv` and `linear_proj`; adapters on 128 x 48 experts would, through the grouped-GEMM experts
(`_compat.grouped_experts`, which read `LoRALinear.weight`, the merged weight), keep a merged copy of every
expert's weights per layer for backward (~1.2 GB a layer, 58 GB in all) beside the 61 GB of bf16 weights.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from bench.common import (
    QWEN3_0_6B,
    QWEN3_4B,
    QWEN3_8B,
    QWEN3_30B_A3B,
    TINY_SCRATCH_BYTES,
    allocated_gib,
    emit,
    environment,
    fresh_memory,
    make_config_only_checkpoint,
    own_gib,
    parse_with_tiny,
    peak_memory_gib,
    release_model,
    scratch_dir,
    start_single_process,
)
from bench.flops import ModelShape, model_flops, peak_flops, throughput
from bench.lightning_overhead import RandomWeightsSFTModule, StepTimer, timed_trainer
from bench.mtp_memory import ProfileStep
from bench.packing_profile import packed_rows, profile_figures, profiler, sft_sequences
from lightning_megatron.atomic import write_text_atomically
from lightning_megatron.data.packing import first_fit
from lightning_megatron.lora import DEFAULT_TARGET_MODULES, LoRAConfig

LORA_RANK, LORA_ALPHA = 8, 16  # Megatron-Bridge's Qwen3 LoRA recipes (dim 8, alpha 16)
ATTENTION = ("linear_qkv", "linear_proj")
LR = 1e-5
RUNS = ("lightning", "plain")
TINY = dict(seq=128, min_length=8, max_length=64, steps=1, warmup=1, precision="fp32", rows=2)


@dataclass(frozen=True)
class SizeConfig:
    """One configuration: the model, how it trains, and what issue 41 holds it to (`at_least` / `at_most`: figure
    of the Lightning run -> bound; `lightning_over_plain_step_time` is Lightning's step time over the plain loop's)."""

    name: str
    label: str  # the report's
    shape: dict[str, Any]
    tied: bool
    rows: int  # packed rows per optimizer step
    steps: int = 3  # timed steps per run (`--steps` overrides)
    mtp: bool = False
    lora_targets: tuple[str, ...] | None = None  # None: full fine-tuning
    cuda_graph: str | None = None  # MegatronStrategy's cuda_graph; None: not passed (the default, auto)
    optimizer_offload_fraction: float = 0.0
    at_least: dict[str, float] = field(default_factory=dict)
    at_most: dict[str, float] = field(default_factory=dict)
    default: bool = True  # in the default --configs

    def needs_cuda(self) -> bool:
        return self.cuda_graph == "full_iteration" or self.optimizer_offload_fraction > 0

    def lora(self) -> LoRAConfig | None:
        if self.lora_targets is None:
            return None
        return LoRAConfig(target_modules=list(self.lora_targets), rank=LORA_RANK, alpha=LORA_ALPHA)


# a cheap step: more of them, for a ratio held to 1%
MTP_0_6B = dict(shape=QWEN3_0_6B, tied=True, rows=8, steps=8, mtp=True,
                at_most={"lightning_over_plain_step_time": 1.01})
CONFIGS = {config.name: config for config in (
    SizeConfig("qwen3_8b_lora", "Qwen3-8B LoRA, every linear layer", QWEN3_8B, tied=False, rows=4,
               lora_targets=DEFAULT_TARGET_MODULES, at_least={"tokens_per_s": 8429.0},
               at_most={"lightning_over_plain_step_time": 1.0}),
    SizeConfig("qwen3_8b_lora_qkv_proj", "Qwen3-8B LoRA, linear_qkv and linear_proj", QWEN3_8B, tied=False, rows=4,
               lora_targets=ATTENTION, default=False),
    SizeConfig("qwen3_4b_full", "Qwen3-4B full SFT", QWEN3_4B, tied=True, rows=4, at_least={"mfu": 0.40}),
    SizeConfig("qwen3_0.6b_mtp_default", "Qwen3-0.6B SFT + MTP, default settings", **MTP_0_6B,
               at_least={"mfu": 0.30}),
    SizeConfig("qwen3_0.6b_mtp_eager", "Qwen3-0.6B SFT + MTP, cuda_graph: none", **MTP_0_6B, cuda_graph="none"),
    SizeConfig("qwen3_0.6b_mtp_graphed", "Qwen3-0.6B SFT + MTP, cuda_graph: full_iteration", **MTP_0_6B,
               cuda_graph="full_iteration"),
    SizeConfig("qwen3_30b_a3b_lora", "Qwen3-30B-A3B LoRA, linear_qkv and linear_proj", QWEN3_30B_A3B, tied=False,
               rows=2, lora_targets=ATTENTION),
    SizeConfig("qwen3_8b_full_offload", "Qwen3-8B full SFT, 3/4 of the optimizer in host memory", QWEN3_8B,
               tied=False, rows=2, optimizer_offload_fraction=0.75, default=False),
)}


def parameters(shape: dict[str, Any], tied: bool) -> int:
    """Parameters of a Qwen3 (or Qwen3-MoE, every layer routed) model of `make_tiny_checkpoint`-style `shape`,
    without an MTP layer: attention, MLP or experts and router, norms (QK norms included), embeddings."""
    h, head_dim = shape["hidden_size"], shape["head_dim"]
    q, k = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    mlp = 3 * h * shape["intermediate_size"]
    if "num_experts" in shape:
        mlp = shape["num_experts"] * (3 * h * shape["moe_intermediate_size"] + h)
    layer = h * (q + 2 * k) + q * h + mlp + 2 * h + 2 * head_dim
    return shape["num_layers"] * layer + (1 if tied else 2) * shape["vocab_size"] * h + h


def static_bytes_per_parameter(lora: bool, offload_fraction: float) -> tuple[float, float]:
    """(GPU, host) bytes per parameter before activations, bf16 with fp32 main grads and Adam: LoRA keeps only the
    frozen bf16 weights (the adapters are a rounding error); full fine-tuning adds 4 (fp32 main grad) + 4 (fp32
    master) + 8 (Adam's two moments) = 18, of which the offloaded fraction's master weights and moments (12) move
    to the host beside an fp32 copy of their grads (4) (`lightning_megatron/optimizer.py`)."""
    if lora:
        return 2.0, 0.0
    if not offload_fraction:
        return 18.0, 0.0
    return 2 + 4 + 12 * (1 - offload_fraction), 16 * offload_fraction


@dataclass(frozen=True)
class Step:
    """One configuration's global batch: the packed rows and the real sequence lengths in each."""

    rows: list[dict[str, Any]]
    lengths: list[list[int]]

    @property
    def real_tokens(self) -> int:
        return sum(map(sum, self.lengths))


def packed_step(rows: int, args: argparse.Namespace, vocab: int) -> Step:
    """`rows` packed rows of `args.seq` tokens: a pool of SFT-like sequences first-fit packed, the fullest rows."""
    mean = (args.min_length + args.max_length) / 2
    pool = sft_sequences(argparse.Namespace(min_length=args.min_length, max_length=args.max_length, vocab=vocab,
                                            sequences=int(3 * rows * args.seq / mean) + 4))
    bins = first_fit([len(sequence) for sequence in pool], args.seq)
    bins = sorted(bins, key=lambda members: -sum(len(pool[i]) for i in members))[:rows]
    if len(bins) < rows:
        raise ValueError(f"{rows} rows of {args.seq} tokens need more sequences than the pool holds")
    return Step(packed_rows(pool, args.seq, bins), [[len(pool[i]) for i in members] for members in bins])


def step_flops(shape: ModelShape, step: Step, mtp: bool) -> float:
    """Model FLOPs of one step: each packed sequence's own (its attention over its own length only)."""
    return sum(model_flops(shape, 1, length, with_mtp=mtp) for lengths in step.lengths for length in lengths)


def _one_row(items: list[dict[str, Any]]) -> dict[str, Any]:
    (row,) = items  # a packed microbatch is one row, already collated
    return row


def _dataset(step: Step, total_steps: int) -> list[dict[str, Any]]:
    return step.rows * total_steps  # in order: every global batch is the step's rows


def _timed_steps(args: argparse.Namespace, config: SizeConfig) -> tuple[int, int]:
    """(warm-up, timed) steps; a graphed run warms up eagerly, then captures: two steps at least."""
    graphed = config.cuda_graph != "none" and torch.cuda.is_available()  # full_iteration, or auto (the default)
    return (max(args.warmup, 2) if graphed else args.warmup), args.steps or config.steps


def run_lightning(config: SizeConfig, args: argparse.Namespace, checkpoint: Path, step: Step,
                  workdir: Path) -> dict[str, Any]:
    from lightning_megatron import MegatronStrategy
    from lightning_megatron._compat.fused_adam import implementations
    from lightning_megatron.callbacks import LoRACallback

    warmup, steps = _timed_steps(args, config)
    fresh_memory()
    at_start = allocated_gib()
    timer, profile = StepTimer(), ProfileStep(step_index=warmup + steps)  # one more step, profiled
    callbacks: list[Any] = [timer, profile]
    if config.lora_targets is not None:
        callbacks.append(LoRACallback(list(config.lora_targets), rank=LORA_RANK, alpha=LORA_ALPHA))
    options = {} if config.cuda_graph is None else {"cuda_graph": config.cuda_graph}
    strategy = MegatronStrategy(hf_checkpoint=str(checkpoint), bridge_type="megatron-bridge", micro_batch_size=1,
                                global_batch_size=len(step.rows), precision=args.precision,
                                optimizer_offload_fraction=config.optimizer_offload_fraction, **options)
    trainer = timed_trainer(strategy, callbacks, workdir, max_steps=warmup + steps + 1)
    loader = DataLoader(_dataset(step, warmup + steps + 1), batch_size=1, collate_fn=_one_row)
    try:
        trainer.fit(RandomWeightsSFTModule(enable_mtp=config.mtp, lr=LR), loader)
        graph = strategy.cuda_graphs.graph  # None: the training steps were never going to be graphed
        graph_counts = None if graph is None else graph.counts()
        adam = implementations(strategy.optimizers[0].megatron_optimizer)
    finally:
        release_model(strategy.model_chunks)
    return {"step_times_s": timer.step_times_s, "process_cpu_s": timer.process_cpu_s,
            "main_thread_cpu_s": timer.main_thread_cpu_s, "threads": timer.threads, "losses": timer.losses,
            "graph": graph_counts, "adam": adam,
            "peak_memory_gib": own_gib(peak_memory_gib(), at_start),
            "setup_peak_memory_gib": own_gib(timer.setup_peak_memory_gib, at_start),
            "profiled": (profile.profile, profile.profiled_s)}


def run_plain(config: SizeConfig, args: argparse.Namespace, checkpoint: Path, step: Step,
              graphed: bool) -> dict[str, Any]:
    from bench.megatron_loop import LoopConfig, run

    warmup, steps = _timed_steps(args, config)
    fresh_memory()
    at_start = allocated_gib()
    recorder = profiler()
    loop = LoopConfig(hf_checkpoint=str(checkpoint), bridge_type="megatron-bridge", micro_batch_size=1,
                      global_batch_size=len(step.rows), precision=args.precision, lr=LR, steps=warmup + steps + 1,
                      mtp=config.mtp, random_weights=True, lora=config.lora(), cuda_graph=graphed,
                      optimizer_offload_fraction=config.optimizer_offload_fraction, shuffle=False)
    result = run(loop, _dataset(step, loop.steps), collate_fn=_one_row,
                 step_context=lambda index: recorder if index == warmup + steps else contextlib.nullcontext())
    release_model(result.pop("model"))
    setup_peak = result["setup_peak_memory_bytes"]
    return {**{key: result[key] for key in ("step_times_s", "process_cpu_s", "main_thread_cpu_s", "threads", "adam")},
            "losses": result["losses"], "graph": graphed,
            "peak_memory_gib": own_gib(peak_memory_gib(), at_start),
            "setup_peak_memory_gib": None if setup_peak is None else own_gib(setup_peak / 1024**3, at_start),
            "profiled": (recorder, result["step_times_s"][-1])}


def summarize(run: dict[str, Any], warmup: int, steps: int, step: Step, flops: float,
              peak: float | None) -> dict[str, Any]:
    """The median timed step's figures and the profiled step's."""
    step_s = statistics.median(run["step_times_s"][warmup:warmup + steps])
    cpu = {f"{series}_median": statistics.median(run[series][warmup:warmup + steps])
           for series in ("process_cpu_s", "main_thread_cpu_s")}
    profile, profiled_s = run.pop("profiled")
    return {**throughput(step_s, step.real_tokens, flops, peak), **cpu, **run,
            "profile": profile_figures(profile, profiled_s, step_s)}


def replayed_a_graph(run: dict[str, Any]) -> bool:
    """Whether a Lightning run's steps replayed a whole-iteration graph (`FullIterationGraph.counts`): under
    `cuda_graph: auto` the strategy makes no graph where the run or the model is in the way, and a graph that stepped
    aside at the first batch or fell back after a failed capture replayed nothing."""
    return run["graph"] is not None and run["graph"]["replays"] > 0


def _failure(error: BaseException) -> dict[str, Any]:
    out_of_memory = isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error)
    return {"error": f"{type(error).__name__}: {str(error)[:2000]}", "failure": "out_of_memory" if out_of_memory
            else "failed", "traceback": traceback.format_exc()[-4000:]}


def measure(config: SizeConfig, args: argparse.Namespace, root: Path, peak: float | None) -> dict[str, Any]:
    """Every round's Lightning and plain runs of one configuration (mirrored order), their figures and targets."""
    if config.needs_cuda() and not torch.cuda.is_available():
        return {"skipped": "needs a CUDA device (CUDA graphs or the optimizer's offload)"}
    checkpoint = make_config_only_checkpoint(root / config.name, config.shape, tied=config.tied, tiny=args.tiny)
    shape = ModelShape.from_hf_checkpoint(checkpoint)
    step = packed_step(args.rows or config.rows, args, shape.vocab)
    flops = step_flops(shape, step, config.mtp)
    warmup, steps = _timed_steps(args, config)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in RUNS}
    lightning_graphed = config.cuda_graph == "full_iteration"
    for round_index in range(args.rounds):
        for name in RUNS if round_index % 2 == 0 else RUNS[::-1]:
            try:
                if name == "lightning":
                    run = summarize(run_lightning(config, args, checkpoint, step, root / f"{config.name}_fit"),
                                    warmup, steps, step, flops, peak)
                    lightning_graphed = replayed_a_graph(run)
                else:
                    run = summarize(run_plain(config, args, checkpoint, step, lightning_graphed), warmup, steps,
                                    step, flops, peak)
                runs[name].append(run)
            except Exception as error:  # a run's failure (out of memory too) is its row: the others still run
                runs[name].append(_failure(error))
            print(f"{config.name} {name}: " + (runs[name][-1].get("error") or
                  f"{runs[name][-1]['tokens_per_s']:.0f} tokens/s"), flush=True)
    gpu, host = static_bytes_per_parameter(config.lora_targets is not None, config.optimizer_offload_fraction)
    count = parameters(config.shape, config.tied)
    return {"settings": {**asdict(config), "parameters": count, "static_gpu_gib": gpu * count / 2**30,
                         "static_host_gib": host * count / 2**30, "real_tokens_per_step": step.real_tokens,
                         "sequences_per_step": sum(map(len, step.lengths)), "warmup": warmup, "steps": steps,
                         "rounds": args.rounds, "lightning_graphed": lightning_graphed},
            "shape": asdict(shape), "runs": runs, **figures(config, runs)}


def figures(config: SizeConfig, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The pooled figures of the runs that succeeded (median over rounds) and the targets they meet."""
    done = {name: [run for run in rounds if "error" not in run] for name, rounds in runs.items()}
    result: dict[str, Any] = {
        name: {**{key: _median(run[key] for run in rounds) for key in
                  ("step_s", "tokens_per_s", "model_tflop_per_s", "mfu", "peak_memory_gib")},
               "gpu_busy_fraction": _median(run["profile"]["gpu_busy_fraction"] for run in rounds)}
        for name, rounds in done.items() if rounds}
    lightning, plain = result.get("lightning"), result.get("plain")
    if lightning and plain:
        lightning["lightning_over_plain_step_time"] = lightning["step_s"] / plain["step_s"]
        lightning["first_loss_difference"] = abs(done["lightning"][0]["losses"][0] - done["plain"][0]["losses"][0])
    met = {}
    for bounds, holds in ((config.at_least, lambda value, bound: value >= bound),
                          (config.at_most, lambda value, bound: value <= bound)):
        for figure, bound in bounds.items():
            value = (lightning or {}).get(figure)
            met[figure] = None if value is None else holds(value, bound)
    return {"figures": result, "targets": {"at_least": config.at_least, "at_most": config.at_most}, "met": met}


def _median(values: Any) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, fp32, CPU-sized (explicit flags win)")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS),
                        default=[name for name, config in CONFIGS.items() if config.default])
    parser.add_argument("--seq", type=int, default=4096, help="packed row length")
    parser.add_argument("--min-length", type=int, default=128)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=None, help="rows per step for every configuration (default: "
                        "each configuration's own)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run, after warm-up (default: "
                        "each configuration's own, 3 or 8)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps (a graphed run takes 2 at least)")
    parser.add_argument("--rounds", type=int, default=1, help="Lightning and plain runs per configuration, each "
                        "(mirrored order)")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    return parse_with_tiny(parser, TINY)


def _write(args: argparse.Namespace, results: dict[str, Any], spent: dict[str, float]) -> dict[str, Any]:
    result = {"benchmark": "sizes", **environment(), "peak_tflops": (peak_flops(args.peak_tflops) or 0) / 1e12 or None,
              "settings": {key: getattr(args, key) for key in ("seq", "min_length", "max_length", "rows", "steps",
                                                                "warmup", "rounds", "precision", "tiny")},
              "seconds": spent, "configs": results}
    if args.out is not None:
        write_text_atomically(args.out, json.dumps(result, indent=2) + "\n")
    return result


def main() -> None:
    args = _parse_args()
    start_single_process(tiny=args.tiny)
    peak = peak_flops(args.peak_tflops)
    results: dict[str, Any] = {}
    spent: dict[str, float] = {}
    with scratch_dir("sizes_", TINY_SCRATCH_BYTES) as root:  # config-only checkpoints
        for name in args.configs:
            started = time.perf_counter()
            results[name] = measure(CONFIGS[name], args, root, peak)
            spent[name] = time.perf_counter() - started
            _write(args, results, spent)  # so far: a run stopped from outside keeps what it measured
    result = _write(args, results, spent)
    failed = [f"{name} {run_name}" for name, config in results.items() for run_name, rounds in
              config.get("runs", {}).items() for run in rounds if run.get("failure") == "failed"]
    emit(result, None)
    if failed:  # out of memory is a result; any other failure is a bug to look at
        raise SystemExit(f"failed (not out of memory): {', '.join(failed)}")


if __name__ == "__main__":
    main()
