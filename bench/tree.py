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

Loss: the token-weighted loss of the batch. The tree run's difference from the flat run is set against the flat run's
own noise: the largest difference between flat runs that compute the same thing in another order (the rounds, the
rows packed in reversed sequence order, and one padded row per sequence). Compiles: torch.compile frames counted by
dynamo after the warm-up and after the timed steps; equal means the tree attention's kernel does not recompile across
microbatches.

`--tiny`: the tiny checkpoint in fp32 on the CPU, two prompts (what tests/test_bench.py runs).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    allocated_gib,
    emit,
    environment,
    fresh_memory,
    make_checkpoint,
    parse_with_tiny,
    peak_memory_gib,
)
from lightning_megatron.data.packing import first_fit, pack_examples, pad_example
from lightning_megatron.data.tokenize import TokenizedExample
from lightning_megatron.data.tree import build_tree_rows
from lightning_megatron.layout import SEQUENCE_KEYS, SUBTREE_END
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


def flat_rows(examples: list[TokenizedExample], seq_length: int, pad_id: int) -> list[dict[str, torch.Tensor]]:
    bins = first_fit([len(example) for example in examples], seq_length)
    return [pack_examples([examples[i] for i in members], seq_length, pad_id) for members in bins]


def as_microbatch(row: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """One row as a `[1, s]` microbatch on `device` (`cu_seqlens` and `max_seqlen` keep their shapes)."""
    return {key: (value.unsqueeze(0) if key in (*SEQUENCE_KEYS, SUBTREE_END) else value).to(device)
            for key, value in row.items()}


def build_model(checkpoint: Path, bf16: bool) -> list[torch.nn.Module]:
    """Model chunks as the strategy makes them (bridge build, Float16Module, Megatron DDP), TP = PP = 1."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.transformer.module import Float16Module
    from megatron.core.utils import get_model_config

    from lightning_megatron.bridges import ModelOptions, create_bridge

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


def step(model: list[torch.nn.Module], module: SFTModule, microbatches: list[dict[str, torch.Tensor]]) -> float:
    """Forward and backward of every microbatch, through `SFTModule`'s forward step and loss (as a fit runs them);
    returns the token-weighted loss."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator: Any, chunk: torch.nn.Module) -> tuple:
        microbatch = next(data_iterator)
        return module.forward_step(chunk, microbatch), partial(module.loss_func, microbatch)

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny checkpoint, fp32, CPU-sized batch")
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: the Qwen3-0.6B shape, made locally")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--responses", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--response-tokens", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=6656, help="tokens per row, both layouts")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    args = parse_with_tiny(parser, dict(prompts=2, responses=4, prompt_tokens=24, response_tokens=8, seq_length=128,
                                        steps=2, warmup=1))
    from lightning_megatron.demo import init_single_process

    init_single_process()
    bf16 = not args.tiny
    checkpoint = args.checkpoint or make_checkpoint(Path(tempfile.mkdtemp()) / "qwen3", tiny=args.tiny)
    vocab_size = json.loads((Path(checkpoint) / "config.json").read_text())["vocab_size"]
    pad_id = 0
    examples = grpo_batch(args.prompts, args.responses, args.prompt_tokens, args.response_tokens, vocab_size)
    longest = max(len(example) for example in examples)
    tree = build_tree_rows(examples, args.seq_length, pad_id)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    layouts = {
        "flat": flat_rows(examples, args.seq_length, pad_id),
        "tree": tree.rows,
        "flat_reversed": flat_rows(examples[::-1], args.seq_length, pad_id),
        "padded": [pad_example(example, longest, pad_id) for example in examples],
    }
    microbatches = {name: [as_microbatch(row, device) for row in rows] for name, rows in layouts.items()}

    model, module = build_model(checkpoint, bf16), SFTModule()
    runs: dict[str, list[dict[str, Any]]] = {"flat": [], "tree": []}
    for name in ORDER:
        runs[name].append(timed_run(model, module, microbatches[name], args.warmup, args.steps))
    reference_losses = {name: step(model, module, microbatches[name]) for name in ("flat_reversed", "padded")}

    original_tokens = tree.original_tokens
    figures = {}
    for name, rounds in runs.items():
        step_s = statistics.median(t for run in rounds for t in run["step_times_s"])
        peaks = [run["peak_memory_gib"] for run in rounds if run["peak_memory_gib"] is not None]
        figures[name] = {
            "rows": len(layouts[name]), "step_s": step_s, "original_tokens_per_s": original_tokens / step_s,
            "peak_memory_gib": max(peaks) if peaks else None, "losses": [run["losses"] for run in rounds],
            "frames_compiled": [run["frames_compiled"] for run in rounds],
        }
    flat_losses = [loss for run in runs["flat"] for loss in run["losses"]]
    tree_losses = [loss for run in runs["tree"] for loss in run["losses"]]
    flat_loss = flat_losses[0]
    noise = max(abs(loss - flat_loss) for loss in [*flat_losses, *reference_losses.values()])
    tree_difference = max(abs(loss - flat_loss) for loss in tree_losses)
    recompiles = sum(run["frames_compiled"]["after_steps"] - run["frames_compiled"]["after_warmup"]
                     for rounds in runs.values() for run in rounds)
    result = {
        "benchmark": "tree",
        **environment(),
        "settings": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
        | {"precision": "bf16" if bf16 else "fp32", "bridge": "mbridge", "order": list(ORDER)},
        "batch": {"sequences": len(examples), "original_tokens": original_tokens, "tree_tokens": tree.tree_tokens,
                  "tree_token_ratio": tree.tree_token_ratio, "flat_rows": len(layouts["flat"]),
                  "tree_rows": len(layouts["tree"])},
        "runs": figures,
        "tree_over_flat": {
            "original_tokens_per_s": (figures["tree"]["original_tokens_per_s"]
                                      / figures["flat"]["original_tokens_per_s"]),
            "step_time": figures["tree"]["step_s"] / figures["flat"]["step_s"],
            "peak_memory": (figures["tree"]["peak_memory_gib"] / figures["flat"]["peak_memory_gib"]
                            if figures["flat"]["peak_memory_gib"] else None),
        },
        "loss": {"flat": flat_loss, "tree_minus_flat_max_abs": tree_difference, "flat_noise_max_abs": noise,
                 "flat_reversed": reference_losses["flat_reversed"], "padded": reference_losses["padded"],
                 "tree_within_flat_noise": tree_difference <= noise},
        "recompiles_after_warmup": recompiles,
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
