"""Where a training step's time goes for full, packed and padded rows, and what takes the host's share away.

P5's model and rows (Qwen3-0.6B shape, rows of 4096, 48 SFT-like sequences of 128-2048 tokens, bf16, one
Megatron-Core training step over all rows; the rows are made here, `sft_sequences` and `layouts`, and `bench.packing`
runs these candidates), one candidate after another in one process:

| candidate | rows | what it changes |
|---|---|---|
| `full` | full | nothing: eager, causal SDPA |
| `packed` | packed | the default path: flex_attention on CUDA, BlockMask from the layout's bounds, RoPE gather once per microbatch, host `max_seqlen` |
| `packed_varlen` | packed | the same through varlen_attn (`attention_varlen`, opt-in: switched on) |
| `padded` | padded | nothing: eager, one sequence per row |
| `packed_before` | packed | flex with `create_block_mask`, the THD RoPE index per layer, `max_seqlen` read back |
| `full_graph` | full | `cuda_graph="full_iteration"`: the forward-backward captured once, replayed; flex attention |
| `packed_graph` | packed | the same for packed rows: `cu_seqlens` padded to one count, one `max_seqlen` for all |
| `packed_graph_varlen` | packed | the same through varlen_attn (switched on) |
| `padded_graph` | padded | the same for padded rows (flex attention) |
| `full_layer_graphs` | full | Megatron-Core's per-layer graphs (`cuda_graph_impl="local"`; it switches the current stream) |

Per candidate: median step time, real tokens/s, peak memory, and one profiled step (`torch.profiler`, CPU + CUDA):
the GPU busy time (union of all device activity) over the un-profiled step time, device kernels, kernel-launch and
graph-launch calls, synchronising runtime calls (with the operators that made them, and the Python lines from
`torch.cuda.set_sync_debug_mode("warn")` in one more step), Python's garbage collections in one step, the CPU time
inside the ranges of `RANGES` (microbatch inputs, layout, block mask, varlen, RoPE gather, core attention, Megatron's
forward_step / backward_step), the top CUDA kernels and CPU operators by time. A failing candidate records its error and the others still run; `--deadline-s` skips the
candidates that no longer fit.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from bench.attention import add_shape_options, device, gpt_model, trainable
from bench.common import emit, environment, fresh_memory, parse_with_tiny, peak_memory_gib, release_model
from lightning_megatron import attention_layout
from lightning_megatron._compat import packed_rope
from lightning_megatron.atomic import write_text_atomically
from lightning_megatron.attention_varlen import OPT_IN as VARLEN_SWITCH
from lightning_megatron.cuda_graphs.full_iteration import FullIterationGraph
from lightning_megatron.cuda_graphs.options import SEQUENCES_PER_ROW
from lightning_megatron.distributed import init_single_process
from lightning_megatron.schedule import run_schedule

P5_TINY = dict(hidden=64, layers=2, heads=4, kv_groups=2, head_dim=16, ffn=128, vocab=512, seq=128,
               min_length=8, max_length=64, sequences=12, steps=2, warmup=1, dtype="fp32")
"""`bench.packing`'s tiny CPU mode (`--tiny`)."""
TINY = {**P5_TINY, "steps": 1, "warmup": 1}
CANDIDATES = {  # name: (rows, mode), in the order they run
    "full": ("full", "eager"),
    "packed": ("packed", "eager"),
    "packed_varlen": ("packed", "eager"),
    "padded": ("padded", "eager"),
    "packed_before": ("packed", "before"),
    "full_graph": ("full", "graph"),
    "packed_graph": ("packed", "graph"),
    "packed_graph_varlen": ("packed", "graph"),
    "padded_graph": ("padded", "graph"),
    "full_layer_graphs": ("full", "layer_graphs"),
}
GRAPH_MODES = ("graph", "layer_graphs")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC",
                "cudaLaunchCooperativeKernel")


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    add_shape_options(parser)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--min-length", type=int, default=128)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--sequences", type=int, default=48)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per candidate (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    parser.add_argument("--deadline-s", type=float, default=None, help="skip candidates that would end past this")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the tables here")
    return parse_with_tiny(parser, TINY)


def sft_sequences(args: argparse.Namespace) -> list[torch.Tensor]:
    """Random token sequences with SFT-like lengths, the same on every run."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_length, args.max_length + 1, (args.sequences,), generator=generator)
    return [torch.randint(0, args.vocab, (int(n),), generator=generator) for n in lengths]


def _examples(sequences: list[torch.Tensor]) -> list[Any]:
    from lightning_megatron.data.tokenize import TokenizedExample

    return [TokenizedExample("bench", ids, torch.ones_like(ids, dtype=torch.bool)) for ids in sequences]


def packed_rows(sequences: list[torch.Tensor], seq: int, bins: list[list[int]] | None = None
                ) -> list[dict[str, Any]]:
    """The sequences packed into microbatches of one row of `seq` tokens each by the data pipeline's own packing
    (`max_seqlen` a host int, every token trained): first-fit in order, or the given `bins` of sequence indices."""
    from lightning_megatron.data.packing import collate_packed, first_fit, pack_examples

    examples = _examples(sequences)
    bins = first_fit([len(e) for e in examples], seq) if bins is None else bins
    return [collate_packed([pack_examples([examples[i] for i in members], seq, pad_id=0)]) for members in bins]


def layouts(args: argparse.Namespace, sequences: list[torch.Tensor]) -> dict[str, list[dict[str, torch.Tensor]]]:
    """The microbatches (one row each) of every layout, built by the data pipeline's own packing and padding."""
    from lightning_megatron.data.packing import pad_example

    examples = _examples(sequences)
    packed = packed_rows(sequences, args.seq)
    padded = [{key: value[None] for key, value in pad_example(example, args.seq, pad_id=0).items()}
              for example in examples]
    real_tokens = sum(len(e) for e in examples)
    stream = torch.cat(sequences)
    full_rows = max(1, round(real_tokens / args.seq))
    stream = stream.repeat(-(-full_rows * args.seq // stream.numel()))[: full_rows * args.seq + 1]
    full = []
    for row in range(full_rows):
        tokens = stream[row * args.seq: (row + 1) * args.seq + 1]
        full.append({"input_ids": tokens[None, :-1], "labels": tokens[None, 1:],
                     "loss_mask": torch.ones(1, args.seq), "position_ids": torch.arange(args.seq)[None]})
    return {"packed": packed, "padded": padded, "full": full}


def _forward_step_func(rows: str, mode: str) -> Any:
    from lightning_megatron.microbatch import model_inputs
    from lightning_megatron.module import masked_token_loss

    def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple:
        with torch.profiler.record_function("## microbatch inputs"):
            microbatch = next(data_iterator)
            inputs = model_inputs(microbatch)
        return model(**inputs), lambda output: masked_token_loss(microbatch, output)

    return forward_step


@contextlib.contextmanager
def _before() -> Any:
    """The code before: `create_block_mask`, and the THD RoPE index computed for every call (and `max_seqlen` on the
    device, `run_candidate`)."""
    builder, gathered = attention_layout.BLOCK_MASK_BUILDER, packed_rope._gathered_freqs

    def every_call(*args: Any) -> torch.Tensor:
        packed_rope._last_gather = None
        return gathered(*args)

    attention_layout.BLOCK_MASK_BUILDER, packed_rope._gathered_freqs = "create_block_mask", every_call
    try:
        yield
    finally:
        attention_layout.BLOCK_MASK_BUILDER, packed_rope._gathered_freqs = builder, gathered


def varlen_switched(on: bool) -> Any:
    """Packed rows through varlen_attn where it applies (`LIGHTNING_MEGATRON_FAST_VARLEN=1`, opt-in) while it is
    entered if `on`, else through flex_attention (`=0`)."""
    return mock.patch.dict(os.environ, {VARLEN_SWITCH: "1" if on else "0"})


@contextlib.contextmanager
def _cudagraphable_rng() -> Any:
    """Megatron's CUDA graphs (whole-iteration and per-layer) need the graph-safe RNG tracker: the capture registers
    each tracked generator state (`FullCudaGraphWrapper` fails with "expected a Generator, but got Tensor" on the
    default tracker's plain state tensors); `gpt_model` seeds without it."""
    from megatron.core import tensor_parallel

    seed = tensor_parallel.model_parallel_cuda_manual_seed
    tensor_parallel.model_parallel_cuda_manual_seed = lambda *a, **k: seed(*a, **k, use_cudagraphable_rng=True)
    try:
        yield
    finally:
        tensor_parallel.model_parallel_cuda_manual_seed = seed


def run_candidate(args: argparse.Namespace, name: str, microbatches: list[dict]) -> dict[str, Any]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    rows, mode = CANDIDATES[name]
    if mode == "before":  # max_seqlen on the device: packed_seq_params reads it back once per microbatch
        microbatches = [{**m, "max_seqlen": torch.tensor(m["max_seqlen"])} for m in microbatches]
    fresh_memory()
    overrides: dict[str, Any] = dict(calculate_per_token_loss=True, cross_entropy_loss_fusion=False)
    if mode == "layer_graphs":
        overrides.update(cuda_graph_impl="local", cuda_graph_modules=[], cuda_graph_warmup_steps=1)
    target = device()
    with _cudagraphable_rng() if mode in GRAPH_MODES else contextlib.nullcontext():
        config, model = gpt_model(args, "sdpa", **overrides)
    # made before DDP wraps the model, as the strategy does: the fit's stream changes with it (cuda_graphs/)
    graph = FullIterationGraph([model], SEQUENCES_PER_ROW) if mode == "graph" else None
    model, optimizer = trainable(config, model, bf16=args.dtype == "bf16")
    on_device = [{k: v.to(target) if isinstance(v, torch.Tensor) else v for k, v in m.items()} for m in microbatches]
    forward_backward = get_forward_backward_func()
    forward_step = _forward_step_func(rows, mode)

    def step() -> float:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        if graph is not None:  # what MegatronStrategy(cuda_graph="full_iteration") runs
            metrics = run_schedule([model], on_device, _model_forward, _token_loss, forward_only=False,
                                   cut_for_context_parallel=True, device=target, graph=graph)
            optimizer.step()
            return metrics["lm_loss"]
        losses = forward_backward(forward_step_func=forward_step, data_iterator=iter(on_device), model=[model],
                                  num_microbatches=len(on_device), seq_length=args.seq, micro_batch_size=1,
                                  forward_only=False)
        optimizer.step()
        return sum(m["lm_loss"][0] for m in losses) / sum(m["lm_loss"][1] for m in losses)

    varlen = name.endswith("_varlen")  # the rest runs the default path (the code before issue 29 had no varlen)
    try:
        with _before() if mode == "before" else contextlib.nullcontext(), varlen_switched(varlen):
            times, losses = [], []
            warmup = max(args.warmup, 2) if graph is not None else args.warmup  # the graph: warm-up, then capture
            for index in range(warmup + args.steps):
                _synchronize()
                started = time.perf_counter()
                result = step()
                _synchronize()
                if index >= warmup:
                    times.append(time.perf_counter() - started)
                losses.append(float(result))
            step_s = statistics.median(times)
            with _gc_time() as collections:
                step()
                _synchronize()
            profile = profile_step(step, step_s)
            sites = sync_sites(step) if mode not in GRAPH_MODES else {}
        return {"step_s": step_s, "steps_s": times, "losses": losses, "peak_memory_gib": peak_memory_gib(),
                "rows": len(microbatches), "gc_per_step": collections, "sync_sites": sites,
                "graph": None if graph is None else graph.counts(), **profile}
    finally:
        if graph is not None:
            graph.release()
        release_model([model])  # the next candidate's fresh_memory() then frees it


def _model_forward(model: torch.nn.Module, microbatch: dict) -> torch.Tensor:
    from lightning_megatron.microbatch import model_inputs

    return model(**model_inputs(microbatch))


def _token_loss(microbatch: dict, output: torch.Tensor) -> Any:
    from lightning_megatron.module import masked_token_loss

    return masked_token_loss(microbatch, output)


@contextlib.contextmanager
def _gc_time() -> Any:
    """Python's garbage collections during the block: count and seconds per generation."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    started: list[float] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            total = totals[f"gen{info['generation']}"]
            total[0] += 1
            total[1] += time.perf_counter() - started.pop()

    gc.callbacks.append(callback)
    result: dict[str, Any] = {}
    try:
        yield result
    finally:
        gc.callbacks.remove(callback)
        result.update({gen: {"count": int(c), "s": round(t, 4)} for gen, (c, t) in sorted(totals.items())})


def sync_sites(step: Any) -> dict[str, int]:
    """The Python lines whose operators synchronised with the device during one step (sync debug mode "warn")."""
    if not torch.cuda.is_available():
        return {}
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return dict(Counter(f"{w.filename.split('site-packages/')[-1]}:{w.lineno}" for w in caught
                        if "synchroniz" in str(w.message)).most_common(12))


RANGES = (  # (module, attribute path, label): CPU ranges around a microbatch's host work, in the profiled step only
    ("lightning_megatron.attention", "SDPAttention.forward", "## core attention"),
    ("lightning_megatron.attention", "build_layout", "## layout"),
    ("lightning_megatron.attention", "varlen_attention", "## varlen"),
    ("lightning_megatron.attention_layout", "Layout.block_mask", "## block mask"),
    ("lightning_megatron._compat.packed_rope", "_gathered_freqs", "## rope gather"),
    ("megatron.core.pipeline_parallel.schedules", "forward_step", "## forward_step"),
    ("megatron.core.pipeline_parallel.schedules", "backward_step", "## backward_step"),
)


@contextlib.contextmanager
def ranges(extra: tuple[tuple[str, str, str], ...] = ()) -> Any:
    """`RANGES` (and `extra`, the same triples) wrapped in `record_function`, put back after."""
    import functools
    import importlib

    undo = []
    for module_name, path, label in RANGES + extra:
        owner = importlib.import_module(module_name)
        *parents, attribute = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        original = getattr(owner, attribute)

        def wrapped(*args: Any, _original: Any = original, _label: str = label, **kwargs: Any) -> Any:
            with torch.profiler.record_function(_label):
                return _original(*args, **kwargs)

        setattr(owner, attribute, functools.wraps(original)(wrapped))
        undo.append((owner, attribute, original))
    try:
        yield
    finally:
        for owner, attribute, original in reversed(undo):
            setattr(owner, attribute, original)


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _interval_union_ns(intervals: list[tuple[int, int]]) -> int:
    busy, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy


def _top_level(event: Any) -> str:
    """The operators above a runtime call, outermost first (three at most)."""
    chain = []
    parent = event.cpu_parent
    while parent is not None:
        chain.append(parent.name)
        parent = parent.cpu_parent
    return " > ".join(chain[::-1][:3]) or "(no operator)"


def profiler() -> Any:
    """A `torch.profiler.profile` of the CPU, and of CUDA where there is one, with the operators' input shapes
    (`top_device_ops` names the operator and shapes behind each costly kernel)."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else []),
                   record_shapes=True)


def profile_step(step: Any, step_s: float, extra_ranges: tuple[tuple[str, str, str], ...] = ()) -> dict[str, Any]:
    """One step under torch.profiler: what the GPU did and what the host asked of it (`extra_ranges`: more CPU
    ranges, as `ranges` takes them)."""
    _synchronize()
    with ranges(extra_ranges), profiler() as prof:
        started = time.perf_counter()
        step()
        _synchronize()
        profiled_s = time.perf_counter() - started
    return profile_figures(prof, profiled_s, step_s)


def profile_figures(prof: Any, profiled_s: float, step_s: float) -> dict[str, Any]:
    """What a finished profile of one step (`profiled_s` long under the profiler, `step_s` without) says: GPU busy
    time (the union of device activity) and its fraction of the step, kernels, launch and sync calls, top kernels,
    the operators (with their input shapes) whose own kernels took the most device time (kernels a CUDA graph
    replays have no operator), and CPU operators."""
    from torch.autograd import DeviceType

    events = prof.events()
    # the `record_function` ranges are also projected onto the GPU timeline (user annotations): not device work
    device_events = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    kernels = [e for e in device_events if not e.name.startswith(("Memcpy", "Memset"))]
    busy_s = _interval_union_ns([(int(e.time_range.start * 1000), int(e.time_range.end * 1000))
                                 for e in device_events]) / 1e9
    host = [e for e in events if e.device_type == DeviceType.CPU]
    syncs = [e for e in host if e.name in SYNC_CALLS]
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for kernel in kernels:
        by_kernel[kernel.name][0] += kernel.time_range.elapsed_us() / 1e3
        by_kernel[kernel.name][1] += 1
    averages = [a for a in prof.key_averages() if a.device_type == DeviceType.CPU]
    by_shapes = [a for a in prof.key_averages(group_by_input_shape=True)
                 if a.device_type == DeviceType.CPU and a.self_device_time_total > 0]
    return {
        "profiled_step_s": profiled_s,
        "gpu_busy_s": busy_s,
        "gpu_busy_fraction": min(1.0, busy_s / step_s) if device_events else None,
        "gpu_busy_fraction_of_profiled_step": busy_s / profiled_s if device_events else None,
        "device_kernels": len(kernels),
        "memcpy_and_memset": len(device_events) - len(kernels),
        "kernel_launch_calls": sum(e.name in LAUNCH_CALLS for e in host),
        "graph_launch_calls": sum(e.name == "cudaGraphLaunch" for e in host),
        "sync_calls": dict(Counter(e.name for e in syncs)),
        "sync_sources": dict(Counter(f"{e.name} in {_top_level(e)}" for e in syncs).most_common(12)),
        "top_cuda_kernels": [{"name": name[:240], "ms": round(ms, 3), "count": count} for name, (ms, count) in
                             sorted(by_kernel.items(), key=lambda item: -item[1][0])[:12]],
        "top_device_ops": [{"name": a.key[:120], "input_shapes": str(a.input_shapes)[:240],
                            "device_ms": round(a.self_device_time_total / 1e3, 3), "count": a.count}
                           for a in sorted(by_shapes, key=lambda a: -a.self_device_time_total)[:15]],
        "ranges_cpu_ms": {a.key: {"total_ms": round(a.cpu_time_total / 1e3, 3), "count": a.count}
                          for a in averages if a.key.startswith(("## ", "Torch-Compiled Region", "CompiledFunction"))},
        "top_cpu_ops": [{"name": a.key[:120], "self_cpu_ms": round(a.self_cpu_time_total / 1e3, 3), "count": a.count}
                        for a in sorted(averages, key=lambda a: -a.self_cpu_time_total)[:15]],
    }


def markdown(results: dict[str, Any]) -> str:
    lines = ["| candidate | step | real tokens/s | over full | GPU busy | busy / step | kernels | launch calls | "
             "graph launches | sync calls | peak GiB |", "|---" * 11 + "|"]
    full = results.get("full", {}).get("real_tokens_per_s")
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][:150]} |" + " |" * 9)
            continue
        ratio = f"{r['real_tokens_per_s'] / full:.3f}x" if full else "-"
        busy = r["gpu_busy_fraction"]
        lines.append(f"| {name} | {r['step_s']:.3f} s | {r['real_tokens_per_s']:.0f} | {ratio} | "
                     f"{r['gpu_busy_s']:.3f} s | {'-' if busy is None else f'{busy:.1%}'} | {r['device_kernels']} | "
                     f"{r['kernel_launch_calls']} | {r['graph_launch_calls']} | {sum(r['sync_calls'].values())} | "
                     f"{r['peak_memory_gib'] or 0:.1f} |")
    for name, r in results.items():
        if "error" in r:
            continue
        lines += ["", f"### {name}", "", "| top CUDA kernels | ms | count |", "|---|---|---|"]
        lines += [f"| `{k['name']}` | {k['ms']} | {k['count']} |" for k in r["top_cuda_kernels"]]
        lines += ["", "| top CPU ops (self) | ms | count |", "|---|---|---|"]
        lines += [f"| `{k['name']}` | {k['self_cpu_ms']} | {k['count']} |" for k in r["top_cpu_ops"]]
        lines += ["", "sync calls: " + (", ".join(f"{k}: {v}" for k, v in r["sync_sources"].items()) or "none")]
        lines += ["", "sync lines: " + (", ".join(f"`{k}`: {v}" for k, v in r["sync_sites"].items()) or "none")]
        lines += ["", "CPU ranges (inclusive ms / calls): " + ", ".join(
            f"{k} {v['total_ms']:.0f} / {v['count']}" for k, v in r["ranges_cpu_ms"].items())]
        lines += ["", "garbage collections in one step: " + (", ".join(
            f"{gen} {v['count']} ({v['s']:.3f} s)" for gen, v in r["gc_per_step"].items()) or "none")]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = _parse_args()
    started = time.perf_counter()
    sequences = sft_sequences(args)
    real_tokens = sum(int(s.numel()) for s in sequences)
    rows = layouts(args, sequences)
    init_single_process()
    results: dict[str, Any] = {}
    spent: dict[str, float] = {}
    for name in args.candidates:
        layout, mode = CANDIDATES[name]
        if mode in GRAPH_MODES and not torch.cuda.is_available():
            continue
        expected = max(spent.values(), default=0.0) * (3 if layout == "padded" else 1)
        if args.deadline_s is not None and time.perf_counter() - started + expected > args.deadline_s:
            results[name] = {"error": f"skipped: would end past --deadline-s {args.deadline_s}"}
            continue
        begun = time.perf_counter()
        try:
            run = run_candidate(args, name, rows[layout])
            tokens = real_tokens if layout != "full" else len(rows["full"]) * args.seq
            results[name] = {**run, "real_tokens_per_step": tokens, "real_tokens_per_s": tokens / run["step_s"]}
        except Exception as error:  # one candidate's failure is a result, the others still run
            results[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}
        spent[name] = time.perf_counter() - begun
        print(f"{name}: {spent[name]:.0f} s, " + (results[name].get("error") or
              f"{results[name]['real_tokens_per_s']:.0f} real tokens/s"), flush=True)
        _write(args, results, real_tokens, spent)  # so far: a run stopped from outside keeps what it measured
    emit(_write(args, results, real_tokens, spent), None)
    print(markdown(results).split("\n\n")[0])


def _write(args: argparse.Namespace, results: dict[str, Any], real_tokens: int, spent: dict[str, float]
           ) -> dict[str, Any]:
    result = {**environment(), "benchmark": "P5 packing profile", "real_tokens": real_tokens, "seconds": spent,
              "candidates": results}
    for path, text in ((args.markdown, markdown(results)), (args.out, json.dumps(result, indent=2) + "\n")):
        if path is not None:
            write_text_atomically(path, text)
    return result


if __name__ == "__main__":
    main()
