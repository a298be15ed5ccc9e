"""P5: packed THD rows against the same sequences padded, and against full unpadded rows; CP communication volume.

One Megatron-Core training step (local layer spec with `SDPAttention`, Float16Module + DDP + distributed optimizer,
forward-backward over the microbatches, optimizer step) of the Qwen3-0.6B shape, side by side in one process, for
three layouts of rows of `--seq` tokens (one row per microbatch):
- `packed`: SFT-like sequences (lengths uniform in [`--min-length`, `--max-length`]) first-fit packed (THD,
  `cu_seqlens`; on CUDA flex_attention's block mask, the default, `packed_varlen` and `packed_graph_varlen` the same
  rows through torch's varlen_attn where `attention_varlen` lets them through, which is opt-in);
- `padded`: the same sequences, one per row, padded to `--seq` (what `SFTDataModule(packing=False)` feeds);
- `full`: unpadded `--seq`-token rows (causal SDPA), as many as the real tokens fill.
Each layout runs as `bench.packing_profile`'s candidate of that name (`--layouts` picks some; `packed_before` is the
packed path before issue 29). `full_graph`, `packed_graph` and `padded_graph` (GPU only; skipped with the reason on
the CPU; `padded_graph` only when asked) run the same rows through `MegatronStrategy(cuda_graph="full_iteration")`'s
code path
(`lightning_megatron.cuda_graphs.full_iteration`): the step's forward-backward captured once and replayed, full rows
through flex_attention because cuDNN SDPA's backward cannot be captured. A layout that fails records its error and
the others still run. Reported per layout:
real (non-pad) tokens/s, step time, peak memory, the GPU-busy fraction of the step (device activity from one
`torch.profiler` step over the un-profiled step time), kernel launches, host syncs (and the Python lines that made
them), the CPU time of the microbatch's host work and the top kernels and CPU operators (`--markdown` writes those
tables); and the ratios packed / full and packed / padded next to the padding fraction (the targets: packed >= 0.95x
full, and packed beats padded by at least the padding fraction, packed / padded >= 1 + padding fraction; removing
all padding would give 1 / (1 - fraction)); with every layout graphed (`bench/run_h200.sh`'s `packing_graphed` step:
the default's path, `cuda_graph: auto`, on a GPU), issue 41's packed >= 0.95x full and >= 3x padded.
Full rows are host-bound too, so their speed follows the host's CPU: the
same code measured 1.20-1.31 s a step on one H200 machine and 1.41-1.71 s on earlier ones (`environment()` records
the CPU model).

Without Transformer Engine, Megatron-Core's THD rotary embedding is replaced by a vectorized one
(`lightning_megatron._compat.packed_rope`); the packed layout then runs a second time with upstream's, side by side
(`packed_upstream_rope`), and `vectorized_thd_rope` in the JSON says whether the replacement was active.

Context parallelism needs two GPUs; instead a two-process gloo run on the CPU (a small model, `--cp-*` options)
records the bytes each rank all-gathers (K and V of every layer, forward; the backward reduce-scatters as many),
checks them against the formula `2 * (cp - 1) / cp * tokens * kv_groups * head_dim * bytes` per layer and step,
and the formula gives the figures for the benchmarked shape at CP 2, 4 and 8.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.attention import add_shape_options, gpt_model
from bench.common import TINY_SCRATCH_BYTES, emit, environment, parse_with_tiny, scratch_dir
from bench.packing_profile import (
    CANDIDATES,
    P5_TINY,
    layouts,
    markdown,
    run_candidate,
    sft_sequences,
    varlen_switched,
)
from lightning_megatron._compat import packed_rope
from lightning_megatron.atomic import write_text_atomically
from lightning_megatron.distributed import init_single_process


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    add_shape_options(parser)
    parser.add_argument("--seq", type=int, default=4096, help="row length of every layout")
    parser.add_argument("--min-length", type=int, default=128)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--sequences", type=int, default=48, help="SFT sequences per step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layout (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--layouts", nargs="+",
                        default=["full", "packed", "padded", "packed_before", "full_graph", "packed_graph"],
                        choices=["full", "packed", "packed_varlen", "padded", "packed_before", "full_graph",
                                 "packed_graph", "packed_graph_varlen", "padded_graph"],
                        help="bench.packing_profile candidates: packed_before is the code before issue 29, the "
                        "*_graph ones MegatronStrategy(cuda_graph='full_iteration')'s path (GPU only), the *_varlen "
                        "ones packed rows through varlen_attn (opt-in) instead of flex_attention")
    parser.add_argument("--upstream-rope", action=argparse.BooleanOptionalAction, default=True,
                        help="also packed rows with Megatron-Core's own THD RoPE (packed_upstream_rope)")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the profile tables here")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="skip (and record as skipped) the layouts that would end past this many seconds")
    parser.add_argument("--core-attention", action=argparse.BooleanOptionalAction, default=True,
                        help="also the core attention alone on the packed rows, varlen_attn against flex_attention "
                        "(GPU only, ~30 s)")
    parser.add_argument("--core-repeats", type=int, default=10, help="timed passes over the rows per kernel")
    parser.add_argument("--context-parallel", action=argparse.BooleanOptionalAction, default=True,
                        help="also the two-process gloo CP communication check (CPU, ~20 s)")
    parser.add_argument("--cp-seq", type=int, default=256, help="row length of the gloo CP run")
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[2, 4, 8], help="CP sizes of the scaling table")
    return parse_with_tiny(parser, P5_TINY)


def cp_bytes_formula(tokens: int, cp: int, kv_groups: int, head_dim: int, element_bytes: int) -> float:
    """Bytes one rank receives in the forward all-gather of K and V, per layer, for `tokens` tokens in the row."""
    return 2 * (cp - 1) / cp * tokens * kv_groups * head_dim * element_bytes


def _cp_worker(rank: int, world_size: int, port: int, args: argparse.Namespace, out: str) -> None:
    """One rank of the gloo CP run: a packed row through a small GPT, forward and backward, recording what the
    attention all-gathers."""
    from megatron.core import parallel_state

    from lightning_megatron._compat import prepare_megatron_core
    from lightning_megatron.attention import SDPAttention
    from lightning_megatron.microbatch import model_inputs, split_for_context_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")  # gloo on the CPU
    torch.set_num_threads(1)
    prepare_megatron_core()
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(context_parallel_size=world_size)
    small = argparse.Namespace(**{**vars(args), **{key: value for key, value in P5_TINY.items() if key != "seq"},
                                  "seq": args.cp_seq, "dtype": "fp32"})
    small.min_length, small.max_length = 2 * world_size, args.cp_seq // 2
    _, model = gpt_model(small, "sdpa")
    gathered: list[int] = []
    for module in model.modules():
        if isinstance(module, SDPAttention):
            module.register_forward_pre_hook(lambda _module, inputs: gathered.append(
                (world_size - 1) * (inputs[1].numel() + inputs[2].numel()) * inputs[1].element_size()))
    generator = torch.Generator().manual_seed(0)
    unit = 2 * world_size  # each sequence a multiple of 2 x CP, three of them within 3/4 of the row
    lengths = [unit * int(n) for n in torch.randint(1, args.cp_seq // (4 * unit) + 1, (3,), generator=generator)]
    lengths.append(args.cp_seq - sum(lengths))
    tokens = torch.randint(0, small.vocab, (1, args.cp_seq + 1), generator=generator)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    microbatch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(1, args.cp_seq),
                  "position_ids": position_ids, "cu_seqlens": cu_seqlens}
    local = split_for_context_parallel(microbatch, parallel_state.get_context_parallel_rank(), world_size)
    model(**model_inputs(local)).sum().backward()
    if rank == 0:
        torch.save({"bytes_per_layer": gathered[0], "layers": len(gathered), "tokens": args.cp_seq,
                    "kv_groups": small.kv_groups, "head_dim": small.head_dim}, out)
    dist.destroy_process_group()


def cp_communication(args: argparse.Namespace) -> dict[str, Any]:
    """The gloo CP=2 run's all-gather volume against the formula, and the formula at the benchmarked shape."""
    from lightning_megatron.distributed import free_port as _free_port

    cp = 2
    with scratch_dir("packing_cp_", TINY_SCRATCH_BYTES) as folder:  # the ranks' measured volumes
        out = str(folder / "cp.pt")
        mp.start_processes(_cp_worker, args=(cp, _free_port(), args, out), nprocs=cp, start_method="spawn",
                           join=True)
        measured = torch.load(out)
    formula = cp_bytes_formula(measured["tokens"], cp, measured["kv_groups"], measured["head_dim"], 4)
    element_bytes = 2 if args.dtype == "bf16" else 4
    scaling = {
        str(size): {
            "forward_all_gather_bytes_per_layer_per_rank": cp_bytes_formula(args.seq, size, args.kv_groups,
                                                                            args.head_dim, element_bytes),
            "forward_and_backward_bytes_per_step_per_rank": 2 * args.layers * cp_bytes_formula(
                args.seq, size, args.kv_groups, args.head_dim, element_bytes),
        }
        for size in args.cp_sizes
    }
    return {"gloo_cp2": {**measured, "measured_bytes_per_layer_per_rank": measured["bytes_per_layer"],
                         "formula_bytes_per_layer_per_rank": formula,
                         "matches_formula": measured["bytes_per_layer"] == formula},
            "per_row_of_seq_tokens_at_benchmark_shape": scaling}


def main() -> None:
    args = _parse_args()
    sequences = sft_sequences(args)
    real_tokens = sum(int(s.numel()) for s in sequences)
    rows = layouts(args, sequences)
    init_single_process()

    (vectorized_rope,) = packed_rope.ADJUSTMENTS
    names = list(args.layouts) + (["packed_upstream_rope"] if vectorized_rope.active and args.upstream_rope else [])
    results: dict[str, Any] = {}
    started, spent = time.perf_counter(), [0.0]
    for name in names:
        candidate = "packed" if name == "packed_upstream_rope" else name
        microbatches = rows[CANDIDATES[candidate][0]]
        if name.endswith("_graph") and not torch.cuda.is_available():
            results[name] = {"error": "skipped: CUDA graphs need a GPU"}
            continue
        expected = max(spent) * (3 if CANDIDATES[candidate][0] == "padded" else 1)
        if args.deadline_s is not None and time.perf_counter() - started + expected > args.deadline_s:
            results[name] = {"error": f"skipped: would end past --deadline-s {args.deadline_s}"}
            continue
        begun = time.perf_counter()
        try:
            with vectorized_rope.suspended() if name == "packed_upstream_rope" else contextlib.nullcontext():
                run = run_candidate(args, candidate, microbatches)
        except Exception as error:  # one layout's failure is a result: the others still run
            results[name] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}
            print(f"{name}: failed: {results[name]['error']}", flush=True)
            continue
        finally:
            spent.append(time.perf_counter() - begun)
        tokens = real_tokens if CANDIDATES[candidate][0] != "full" else len(microbatches) * args.seq
        results[name] = {**run, "last_loss": run["losses"][-1], "real_tokens_per_step": tokens,
                         "real_tokens_per_s": tokens / run["step_s"]}
        print(f"{name}: {results[name]['real_tokens_per_s']:.0f} real tokens/s", flush=True)
    if args.markdown is not None:
        write_text_atomically(args.markdown, markdown(results))
    padding_fraction = 1 - real_tokens / (len(rows["padded"]) * args.seq)
    emit({**environment(), "benchmark": "P5 packing", "shape": {key: getattr(args, key) for key in (
        "hidden", "layers", "heads", "kv_groups", "head_dim", "ffn", "vocab", "seq", "dtype")},
        "sequences": args.sequences, "lengths": [args.min_length, args.max_length], "layouts": results,
        "vectorized_thd_rope": vectorized_rope.active,
        "summary": summary(results, padding_fraction, 1 - real_tokens / (len(rows["packed"]) * args.seq)),
        "core_attention": core_attention(args, rows["packed"]) if args.core_attention else None,
        "context_parallel": cp_communication(args) if args.context_parallel else None}, args.out)


def summary(results: dict[str, Any], padding_fraction: float, packed_padding_fraction: float) -> dict[str, Any]:
    """Ratios of real tokens/s and the targets, eager and graphed side by side (None where a layout is missing or
    failed); the graphed targets compare `packed_graph` with the faster full rows (eager or graphed) and eager
    padded rows."""
    speed = {name: result.get("real_tokens_per_s") for name, result in results.items()}
    busy = {name: result.get("gpu_busy_fraction") for name, result in results.items()}

    def ratio(numerator: str, denominator: str) -> float | None:
        top, bottom = speed.get(numerator), speed.get(denominator)
        return top / bottom if top and bottom else None

    fastest_full = max((v for k, v in speed.items() if k in ("full", "full_graph") and v), default=None)
    targets = {"target_packed_over_full": 0.95, "target_packed_over_padded": 1 + padding_fraction,
               "target_packed_over_padded_all_graphed": 3.0,  # issue 41: P5 at the default settings
               "target_full_tokens_per_s": 1.3 * 33.5e3, "target_full_gpu_busy_fraction": 0.9}
    graphed = {
        "packed_graph_over_fastest_full_tokens_per_s": speed["packed_graph"] / fastest_full
        if speed.get("packed_graph") and fastest_full else None,
        "packed_graph_over_full_graph_tokens_per_s": ratio("packed_graph", "full_graph"),
        "packed_graph_over_full_tokens_per_s": ratio("packed_graph", "full"),
        "packed_graph_over_padded_tokens_per_s": ratio("packed_graph", "padded"),
        "packed_graph_over_padded_graph_tokens_per_s": ratio("packed_graph", "padded_graph"),
        "full_graph_over_full_tokens_per_s": ratio("full_graph", "full"),
        "packed_graph_over_packed_tokens_per_s": ratio("packed_graph", "packed"),
    }
    met = {}
    if graphed["packed_graph_over_fastest_full_tokens_per_s"] is not None:
        met["packed_graph_over_full"] = graphed["packed_graph_over_fastest_full_tokens_per_s"] >= 0.95
    if graphed["packed_graph_over_padded_tokens_per_s"] is not None:
        met["packed_graph_over_padded"] = graphed["packed_graph_over_padded_tokens_per_s"] >= 1 + padding_fraction
    if graphed["packed_graph_over_padded_graph_tokens_per_s"] is not None:
        met["packed_graph_over_padded_graph"] = (graphed["packed_graph_over_padded_graph_tokens_per_s"]
                                                 >= targets["target_packed_over_padded_all_graphed"])
    if speed.get("full_graph"):
        met["full_graph_tokens_per_s"] = speed["full_graph"] >= targets["target_full_tokens_per_s"]
        met["full_graph_gpu_busy"] = (busy.get("full_graph") or 0) >= targets["target_full_gpu_busy_fraction"]
    return {
        "packed_over_full_tokens_per_s": ratio("packed", "full"),
        "packed_over_padded_tokens_per_s": ratio("packed", "padded"),
        "packed_over_packed_before_tokens_per_s": ratio("packed", "packed_before"),
        "packed_over_packed_upstream_rope_tokens_per_s": ratio("packed", "packed_upstream_rope"),
        "packed_varlen_over_packed_tokens_per_s": ratio("packed_varlen", "packed"),  # varlen_attn / flex_attention
        "packed_graph_varlen_over_packed_graph_tokens_per_s": ratio("packed_graph_varlen", "packed_graph"),
        **graphed,
        "padded_padding_fraction": padding_fraction,
        "packed_padding_fraction": packed_padding_fraction,
        **targets,
        "ideal_packed_over_padded": 1 / (1 - padding_fraction),
        "gpu_busy_fraction": busy,
        "graphed_targets_met": met,
    }


def core_attention(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The core attention alone on the packed rows (`SDPAttention` at the model's heads, random q, k, v), forward
    and backward of every row, through varlen_attn and through flex_attention; the rows' own `cu_seqlens` and the
    same padded to the whole-iteration graph's fixed count (`graph_padded`: empty sequences at the row's end, which
    cost varlen blocks that return at once and flex nothing). Per kernel: the GPU's kernel time and the wall time
    per row (a pass over the rows `--core-repeats` times after a warm-up that compiles flex), and the largest
    difference of the first row's output and gradients to the other kernel's, beside their largest magnitude."""
    if not torch.cuda.is_available():
        return {"error": "skipped: needs a GPU"}
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType
    from torch.autograd import DeviceType

    from bench.packing_profile import profiler
    from lightning_megatron.attention import SDPAttention
    from lightning_megatron.attention_varlen import varlen_refusal
    from lightning_megatron.cuda_graphs.options import SEQUENCES_PER_ROW
    from lightning_megatron.microbatch import CU_SEQLENS, packed_seq_params, with_fixed_sequence_count

    config = TransformerConfig(num_layers=1, hidden_size=args.hidden, num_attention_heads=args.heads,
                               num_query_groups=args.kv_groups, kv_channels=args.head_dim, attention_dropout=0.0,
                               hidden_dropout=0.0)
    attention = SDPAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    generator = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    q, k, v, grad = (torch.randn(args.seq, heads, args.head_dim, generator=generator, device="cuda", dtype=dtype)
                     for heads in (args.heads, args.kv_groups, args.kv_groups, args.heads))
    qkv = [t.requires_grad_() for t in (q, k, v)]

    def row_pass(packs: list[Any]) -> list[torch.Tensor]:
        """Forward and backward of every row; the first row's output and gradients."""
        first: list[torch.Tensor] = []
        for pack in packs:
            output = attention(*qkv, None, packed_seq_params=pack).view_as(grad)
            grads = torch.autograd.grad(output, qkv, grad)
            first = first or [output.float(), *(g.float() for g in grads)]
        return first

    results: dict[str, Any] = {}
    for boundaries in ("rows", "graph_padded"):
        fixed = [row if boundaries == "rows" else with_fixed_sequence_count(row, SEQUENCES_PER_ROW, args.seq - 1)
                 for row in rows]
        packs = [packed_seq_params({**row, CU_SEQLENS: row[CU_SEQLENS].cuda()}) for row in fixed]
        outputs, result = {}, {}
        for kernel in ("varlen", "flex"):
            with varlen_switched(kernel == "varlen"):
                refusal = varlen_refusal(attention.packed_call(*qkv, packs[0], AttnMaskType.causal))
                outputs[kernel] = row_pass(packs)  # warm-up: flex compiles
                torch.cuda.synchronize()
                started = time.perf_counter()
                for _ in range(args.core_repeats):
                    row_pass(packs)
                torch.cuda.synchronize()
                wall_ms = (time.perf_counter() - started) * 1e3 / (args.core_repeats * len(packs))
                with profiler() as prof:
                    row_pass(packs)
                    torch.cuda.synchronize()
            kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA and not e.is_user_annotation
                       and not e.name.startswith(("Memcpy", "Memset"))]
            kernel_ms = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
            result[kernel] = {"path": "varlen_attn" if refusal is None else f"flex_attention ({refusal})",
                              "gpu_kernel_ms_per_row": kernel_ms / len(packs), "wall_ms_per_row": wall_ms,
                              "kernels_per_row": len(kernels) / len(packs)}
        result["largest_difference"] = {name: {"varlen_vs_flex": float((a - b).abs().max()),
                                               "largest_magnitude": float(b.abs().max())}
                                        for name, a, b in zip(("output", "dq", "dk", "dv"), outputs["varlen"],
                                                              outputs["flex"])}
        varlen_ms, flex_ms = (result[kernel]["gpu_kernel_ms_per_row"] for kernel in ("varlen", "flex"))
        result["varlen_over_flex_gpu_kernel_time"] = varlen_ms / flex_ms
        results[boundaries] = result
    return {"rows": len(rows), "sequences_per_row_graph_padded": SEQUENCES_PER_ROW, **results}


if __name__ == "__main__":
    main()
