"""P6: tree packing against flat packing on a GRPO-like batch, the same sequences, one process, side by side.

The batch: `--prompts` prompts of about `--prompt-tokens` random tokens, each with `--responses` responses of about
`--response-tokens` tokens (lengths drawn +-25%), the loss on the responses. Two layouts of exactly these sequences,
through the same Qwen3-0.6B-shaped model (`bench/common.py`, built once through mbridge, bf16, the default core
attention), one microbatch per row of `--seq-length` tokens:

- `flat`: today's packing (`packing: true`): sequences first-fit into THD rows with `cu_seqlens`;
- `tree`: `packing: "tree"` (`lightning_megatron/data/tree.py`): the responses to one prompt merged into a trie, so
  each prompt runs once; `subtree_end` rows through the tree attention, rotary embeddings at each token's depth.

A step is the forward and backward passes of every row (Megatron's schedule, Megatron DDP's fp32 gradient buffers),
timed from synchronised start to synchronised end; the optimizer does not step, so every step sees the same weights
and computes the same loss. Runs alternate in mirrored rounds (flat, tree, tree, flat) with memory freed and the peak
counter reset before each; the first `--warmup` steps of each run are left out, the median of the rest is reported.
Throughput counts the tokens of the *original* sequences (prompt included, once per response) per second for both.

Loss, against the flat layouts' own bf16 noise. After the timed runs, with the same weights, one forward and backward
step of each of several equivalent flat layouts of exactly these sequences: the file order and `--permutations`
seeded permutations, each first-fit into THD rows, plus one padded row per sequence. They compute the same losses,
so what varies among them is only the bf16 reduction order that a layout implies. Reported for every layout: the
token-weighted batch loss and each sequence's own loss (the mean over its trained labels, read where the layout put
its tokens; in a tree row a node's label is the same for every sequence through it, so the tree gives per-sequence
losses too). The tree too is run in the file order and in the same `--permutations` orders (each order builds
other tries, so branches and whole tries land at other offsets and rows). In bf16 the tree's batch loss is noisier
than a flat layout's: the responses to one prompt all read the same single computation of that prompt, so their
rounding errors move together instead of averaging out over the responses. Averaging over the tree layouts
removes that noise but not a bias. Then, for the batch loss: the flat mean, the band (max - min over the flat
layouts), the distance of the tree layouts' mean to the flat mean, and `tree_within_flat_noise` = that distance <=
the band (the file-order tree alone and the tree layouts' band are reported too). Per sequence, a stronger
check: the tree's largest distance to the flat mean of a sequence, against the same figure for each flat layout
(its largest distance to the mean of the other flat layouts): `tree_within_flat_noise` = the tree strays no further
than the furthest flat layout. The same check runs in fp32 on the first `--fp32-prompts` prompts (a second model
in fp32; tree and flat agree to rounding there). Compiles: torch.compile frames counted by dynamo after the warm-up
and after the timed steps; equal means the tree attention's kernel does not recompile across microbatches.

`--tiny`: the tiny checkpoint in fp32 on the CPU, two prompts (what tests/bench/ runs).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    allocated_gib,
    checkpoint_scratch_bytes,
    emit,
    environment,
    fresh_memory,
    make_checkpoint,
    parse_with_tiny,
    peak_memory_gib,
    scratch_dir,
)
from lightning_megatron.data.packing import first_fit, pack_examples, pad_example
from lightning_megatron.data.tokenize import TokenizedExample
from lightning_megatron.data.tree import TreePacking, build_tree_rows
from lightning_megatron.microbatch import SEQUENCE_KEYS, SUBTREE_END
from lightning_megatron.module import SFTModule

ORDER = ("flat", "tree", "tree", "flat")


def grpo_batch(prompts: int, responses: int, prompt_tokens: int, response_tokens: int, vocab_size: int,
               seed: int = 0) -> list[TokenizedExample]:
    """Random prompts, each followed by `responses` random responses; lengths vary +-25% around the given ones."""
    rng = random.Random(seed)

    def tokens(mean: int) -> list[int]:
        length = rng.randint(max(1, mean * 3 // 4), max(1, mean * 5 // 4))
        return [rng.randrange(1, vocab_size) for _ in range(length)]

    examples = []
    for index in range(prompts):
        prompt = tokens(prompt_tokens)
        for _ in range(responses):
            response = tokens(response_tokens)
            ids = torch.tensor(prompt + response, dtype=torch.int64)
            mask = torch.tensor([False] * len(prompt) + [True] * len(response))
            examples.append(TokenizedExample(f"prompt{index}", ids, mask))
    return examples


@dataclass(frozen=True)
class Layout:
    """Rows of one layout of the batch and where each sequence lies in them: ``paths[j] = (row, positions)``,
    sequence ``j``'s token ``t`` is at ``rows[row][..][positions[t]]`` (as in ``TreePacking``)."""

    rows: list[dict[str, torch.Tensor]]
    paths: list[tuple[int, torch.Tensor]]


def flat_layout(examples: Sequence[TokenizedExample], seq_length: int, pad_id: int,
                order: Sequence[int] | None = None) -> Layout:
    """Today's packing: the sequences, taken in `order` (default: as given), first-fit into THD rows."""
    order = list(range(len(examples))) if order is None else list(order)
    rows, paths = [], {}
    for row, members in enumerate(first_fit([len(examples[index]) for index in order], seq_length)):
        sequences = [order[member] for member in members]
        rows.append(pack_examples([examples[index] for index in sequences], seq_length, pad_id))
        start = 0
        for index in sequences:
            paths[index] = (row, torch.arange(start, start + len(examples[index])))
            start += len(examples[index])
    return Layout(rows, [paths[index] for index in range(len(examples))])


def equivalent_layouts(examples: Sequence[TokenizedExample], tree: TreePacking, seq_length: int, pad_id: int,
                       permutations: int) -> dict[str, Layout]:
    """The flat layouts (file order, `permutations` seeded permutations, one padded row per sequence) and the tree
    layouts (`tree`, in file order, and the trees built from the same permutations) of exactly these sequences."""
    layouts = {"flat": flat_layout(examples, seq_length, pad_id)}
    trees = {"tree": Layout(tree.rows, tree.paths)}
    for seed in range(permutations):
        order = list(range(len(examples)))
        random.Random(seed).shuffle(order)
        layouts[f"flat_permutation{seed}"] = flat_layout(examples, seq_length, pad_id, order)
        permuted = build_tree_rows([examples[index] for index in order], seq_length, pad_id)
        paths = dict(zip(order, permuted.paths))
        trees[f"tree_permutation{seed}"] = Layout(permuted.rows, [paths[index] for index in range(len(examples))])
    longest = max(len(example) for example in examples)
    layouts["padded"] = Layout([pad_example(example, longest, pad_id) for example in examples],
                               [(index, torch.arange(len(example))) for index, example in enumerate(examples)])
    return layouts | trees


def sequence_losses(per_token_losses: list[torch.Tensor], layout: Layout,
                    examples: Sequence[TokenizedExample]) -> list[float]:
    """Each sequence's mean loss over its trained labels (token `t`'s label is trained iff response token `t + 1`),
    read from the per-token losses of the rows where `layout` put it."""
    losses = []
    for (row, positions), example in zip(layout.paths, examples):
        trained = positions[:-1][example.response_mask[1:]]
        losses.append(float(per_token_losses[row][trained].double().mean()))
    return losses


def as_microbatch(row: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """One row as a `[1, s]` microbatch on `device` (`cu_seqlens` and `max_seqlen` keep their shapes)."""
    return {key: (value.unsqueeze(0) if key in (*SEQUENCE_KEYS, SUBTREE_END) else value).to(device)
            for key, value in row.items()}


def build_model(checkpoint: Path, bf16: bool) -> list[torch.nn.Module]:
    """Model chunks as the strategy makes them (bridge build, Float16Module, Megatron DDP), TP = PP = 1."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.transformer.module import Float16Module
    from megatron.core.utils import get_model_config

    from lightning_megatron.bridges import create_bridge
    from lightning_megatron.options import ModelOptions

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    overrides = {"calculate_per_token_loss": True} | ({} if bf16 else {"cross_entropy_loss_fusion": False})
    options = ModelOptions(params_dtype=torch.bfloat16 if bf16 else torch.float32, config_overrides=overrides)
    chunks = [chunk.to(device) for chunk in create_bridge("mbridge", checkpoint).build(options)]
    config = get_model_config(chunks[0])
    if bf16:
        config.bf16 = True
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    model = [DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), chunk)
             for chunk in chunks]
    config.no_sync_func = model[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return model


def step(model: list[torch.nn.Module], module: SFTModule, microbatches: list[dict[str, torch.Tensor]],
         per_token_losses: list[torch.Tensor] | None = None) -> float:
    """Forward and backward of every microbatch, through `SFTModule`'s forward step and loss (as a fit runs them);
    returns the token-weighted loss. With `per_token_losses`, each row's per-token loss is appended to it (CPU)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def loss_func(microbatch: dict[str, torch.Tensor], output: torch.Tensor) -> tuple:
        if per_token_losses is not None:
            per_token_losses.append(output.detach()[0].float().cpu())
        return module.loss_func(microbatch, output)

    def forward_step(data_iterator: Any, chunk: torch.nn.Module) -> tuple:
        microbatch = next(data_iterator)
        return module.forward_step(chunk, microbatch), partial(loss_func, microbatch)

    for chunk in model:
        chunk.zero_grad_buffer()
    reduced = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(microbatches), model=model,
        num_microbatches=len(microbatches), seq_length=microbatches[0]["input_ids"].shape[1], micro_batch_size=1,
        forward_only=False,
    )
    totals = sum(values["lm_loss"].double() for values in reduced)
    return float(totals[0] / totals[1])


def compiled_frames() -> int:
    """Frames torch.compile has compiled so far in this process (a recompile adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def timed_run(model: list[torch.nn.Module], module: SFTModule, microbatches: list[dict[str, torch.Tensor]],
              warmup: int, steps: int) -> dict[str, Any]:
    fresh_memory()
    allocated_at_start = allocated_gib()
    times, losses, frames_after_warmup = [], [], None
    for index in range(warmup + steps):
        if index == warmup:
            frames_after_warmup = compiled_frames()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        losses.append(step(model, module, microbatches))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"step_times_s": times[warmup:], "losses": losses, "peak_memory_gib": peak_memory_gib(),
            "allocated_at_start_gib": allocated_at_start,
            "frames_compiled": {"after_warmup": frames_after_warmup, "after_steps": compiled_frames()}}


def loss_check(model: list[torch.nn.Module], module: SFTModule, examples: Sequence[TokenizedExample],
               layouts: dict[str, Layout], device: torch.device) -> dict[str, Any]:
    """One forward and backward step of every layout (same weights): batch and per-sequence losses, set against the
    spread among the flat layouts (`noise_summary`)."""
    batch_losses, per_sequence = {}, {}
    for name, layout in layouts.items():
        per_token_losses: list[torch.Tensor] = []
        microbatches = [as_microbatch(row, device) for row in layout.rows]
        batch_losses[name] = step(model, module, microbatches, per_token_losses)
        per_sequence[name] = sequence_losses(per_token_losses, layout, examples)
    summary = noise_summary(batch_losses, per_sequence)
    summary["per_sequence"]["trained_tokens"] = [int(example.response_mask[1:].sum()) for example in examples]
    return summary


def noise_summary(batch_losses: dict[str, float], per_sequence: dict[str, list[float]]) -> dict[str, Any]:
    """The tree layouts' losses (names starting with `tree`) against the flat layouts' spread; see the module
    docstring. Per sequence, the file-order `tree` is compared."""
    flat_names = [name for name in batch_losses if not name.startswith("tree")]
    flat = torch.tensor([batch_losses[name] for name in flat_names], dtype=torch.float64)
    trees = torch.tensor([value for name, value in batch_losses.items() if name.startswith("tree")],
                         dtype=torch.float64)
    flat_mean, band = float(flat.mean()), float(flat.max() - flat.min())
    tree_minus_mean = float(trees.mean()) - flat_mean

    flat_sequences = torch.tensor([per_sequence[name] for name in flat_names], dtype=torch.float64)  # [layouts, seqs]
    sequence_mean = flat_sequences.mean(0)
    sequence_band = flat_sequences.amax(0) - flat_sequences.amin(0)
    tree_distance = (torch.tensor(per_sequence["tree"], dtype=torch.float64) - sequence_mean).abs()
    others_mean = (flat_sequences.sum(0) - flat_sequences) / max(1, len(flat_names) - 1)
    layout_distance = (flat_sequences - others_mean).abs().amax(1)
    return {
        "batch": batch_losses,
        "flat_layouts": len(flat_names),
        "flat_mean": flat_mean,
        "flat_band": band,
        "flat_std": float(flat.std()) if len(flat_names) > 1 else 0.0,
        "tree_layouts": len(trees),
        "tree_band": float(trees.max() - trees.min()),
        "tree_minus_flat_mean": tree_minus_mean,
        "tree_file_order_minus_flat_mean": batch_losses["tree"] - flat_mean,
        "tree_within_flat_noise": abs(tree_minus_mean) <= band,
        "per_sequence": {
            "sequences": len(sequence_mean),
            "tree_minus_flat_mean_max_abs": float(tree_distance.max()),
            "flat_layout_minus_others_mean_max_abs": dict(zip(flat_names, layout_distance.tolist())),
            "flat_band_max": float(sequence_band.max()),
            "flat_band_median": float(sequence_band.median()),
            "tree_within_own_band": int((tree_distance <= sequence_band).sum()),
            "tree_within_flat_noise": bool(tree_distance.max() <= layout_distance.max()),
            "losses": per_sequence,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny checkpoint, fp32, CPU-sized batch")
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: the Qwen3-0.6B shape, made locally")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--responses", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--response-tokens", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=6656, help="tokens per row, both layouts")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run (after warm-up)")
    parser.add_argument("--warmup", type=int, default=1, help="steps left out at the start of each run")
    parser.add_argument("--permutations", type=int, default=6,
                        help="seeded permutations of the sequences packed as extra flat and tree layouts for the "
                             "noise band")
    parser.add_argument("--fp32-prompts", type=int, default=1,
                        help="prompts (with their responses) of the fp32 loss check on a second model; 0: none")
    args = parse_with_tiny(parser, dict(prompts=2, responses=4, prompt_tokens=24, response_tokens=8, seq_length=128,
                                        steps=2, warmup=1))
    if args.permutations < 0 or not 0 <= args.fp32_prompts <= args.prompts:
        parser.error(f"--permutations ({args.permutations}) must be >= 0 and --fp32-prompts ({args.fp32_prompts}) "
                     f"between 0 and --prompts ({args.prompts})")
    from lightning_megatron.distributed import init_single_process

    init_single_process()
    with scratch_dir("tree_", 0 if args.checkpoint else checkpoint_scratch_bytes(args.tiny)) as folder:
        emit(measure(args, args.checkpoint or make_checkpoint(folder / "qwen3", tiny=args.tiny)), args.out)


def measure(args: argparse.Namespace, checkpoint: Path) -> dict[str, Any]:
    """The flat and tree runs and the loss checks of `checkpoint`: the benchmark's JSON."""
    bf16 = not args.tiny
    vocab_size = json.loads((Path(checkpoint) / "config.json").read_text())["vocab_size"]
    pad_id = 0
    examples = grpo_batch(args.prompts, args.responses, args.prompt_tokens, args.response_tokens, vocab_size)
    tree = build_tree_rows(examples, args.seq_length, pad_id)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    layouts = equivalent_layouts(examples, tree, args.seq_length, pad_id, args.permutations)
    microbatches = {name: [as_microbatch(row, device) for row in layouts[name].rows] for name in ("flat", "tree")}

    seconds = {}
    started = time.perf_counter()
    model, module = build_model(checkpoint, bf16), SFTModule()
    runs: dict[str, list[dict[str, Any]]] = {"flat": [], "tree": []}
    for name in ORDER:
        runs[name].append(timed_run(model, module, microbatches[name], args.warmup, args.steps))
    seconds["build_and_timed_runs"] = time.perf_counter() - started
    started = time.perf_counter()
    loss = {"precision": "bf16" if bf16 else "fp32"} | loss_check(model, module, examples, layouts, device)
    seconds["loss_check"] = time.perf_counter() - started
    if args.fp32_prompts:
        del model, microbatches
        fresh_memory()
        started = time.perf_counter()
        subset = examples[: args.fp32_prompts * args.responses]
        subset_layouts = equivalent_layouts(subset, build_tree_rows(subset, args.seq_length, pad_id),
                                            args.seq_length, pad_id, args.permutations)
        try:
            loss["fp32"] = {"precision": "fp32"} | loss_check(build_model(checkpoint, bf16=False), module, subset,
                                                              subset_layouts, device)
        except RuntimeError as error:  # a sanity line (e.g. a kernel without an fp32 build) must not cost the figures
            loss["fp32"] = {"precision": "fp32", "error": f"{type(error).__name__}: {error}"[:2000]}
        seconds["fp32_loss_check"] = time.perf_counter() - started

    original_tokens = tree.original_tokens
    figures = {}
    for name, rounds in runs.items():
        step_s = statistics.median(t for run in rounds for t in run["step_times_s"])
        peaks = [run["peak_memory_gib"] for run in rounds if run["peak_memory_gib"] is not None]
        figures[name] = {
            "rows": len(layouts[name].rows), "step_s": step_s, "original_tokens_per_s": original_tokens / step_s,
            "peak_memory_gib": max(peaks) if peaks else None, "losses": [run["losses"] for run in rounds],
            "frames_compiled": [run["frames_compiled"] for run in rounds],
        }
    recompiles = sum(run["frames_compiled"]["after_steps"] - run["frames_compiled"]["after_warmup"]
                     for rounds in runs.values() for run in rounds)
    result = {
        "benchmark": "tree",
        **environment(),
        "settings": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
        | {"precision": "bf16" if bf16 else "fp32", "bridge": "mbridge", "order": list(ORDER)},
        "batch": {"sequences": len(examples), "original_tokens": original_tokens, "tree_tokens": tree.tree_tokens,
                  "tree_token_ratio": tree.tree_token_ratio, "flat_rows": len(layouts["flat"].rows),
                  "tree_rows": len(layouts["tree"].rows)},
        "runs": figures,
        "tree_over_flat": {
            "original_tokens_per_s": (figures["tree"]["original_tokens_per_s"]
                                      / figures["flat"]["original_tokens_per_s"]),
            "step_time": figures["tree"]["step_s"] / figures["flat"]["step_s"],
            "peak_memory": (figures["tree"]["peak_memory_gib"] / figures["flat"]["peak_memory_gib"]
                            if figures["flat"]["peak_memory_gib"] else None),
        },
        "loss": loss,
        "recompiles_after_warmup": recompiles,
        "seconds": seconds,
    }
    return result


if __name__ == "__main__":
    main()
