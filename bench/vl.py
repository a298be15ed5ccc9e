"""VL: image + text SFT of a Qwen2.5-VL-3B-shaped model (random weights), packed THD rows vs one sequence per
padded row, side by side in one process on the same sequences.

The model is built by megatron-bridge from a locally written Qwen2.5-VL config (text: hidden 2048, 36 layers, 16/2
heads, FFN 11008, vocab 151936, tied embeddings; vision: 32 blocks of 1280, 16 heads, FFN 3420, full attention
every 8th block, patch 14, merge 2), randomly initialised on the GPU, bf16. Each step trains on the same set of
SFT-like sequences (a prompt, one image of 224-448 pixels a side, a question, a response of 64-1536 tokens;
response-only loss) laid out two ways: `padded`, one sequence per `[1, seq]` row, and `packed`, first-fit into THD
rows of `seq` tokens with `cu_seqlens`. A step is VLSFTModule's forward and backward over every row, then a fused
AdamW step. Reported per layout: median step time after warm-up, real (non-pad) tokens/s, tokens/s of everything
processed (padding included), peak GPU memory; and packed over padded. Both layouts train the same model and
optimizer one after the other (packed continues from padded's weights; the losses are there to show training
runs, not to be compared). `--tiny` is a CPU-sized run of the same code (tiny Qwen2.5-VL, fp32).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import (
    TINY_SCRATCH_BYTES,
    emit,
    environment,
    fresh_memory,
    parse_with_tiny,
    peak_memory_gib,
    scratch_dir,
)
from lightning_megatron.distributed import init_single_process
from lightning_megatron.vl.data import PackedVLDataset, PaddedVLDataset, VLTokenizedExample, collate_vl

QWEN25_VL_3B: dict[str, Any] = dict(
    num_layers=36, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, intermediate_size=11008,
    vocab_size=151936, vision_depth=32, vision_hidden_size=1280, vision_num_heads=16, vision_intermediate_size=3420,
    vision_full_attention_every=8, tied=True, dtype=torch.bfloat16,
)
TINY = dict(seq=256, sequences=6, image_sides=[28, 56], response_tokens=[8, 48], steps=2, warmup=1, dtype="fp32")


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="a CPU-sized run (explicit flags still win)")
    parser.add_argument("--seq", type=int, default=4096, help="row length, packed and padded")
    parser.add_argument("--sequences", type=int, default=24, help="SFT sequences per step")
    parser.add_argument("--image-sides", type=int, nargs=2, default=[224, 448], help="image side range, pixels")
    parser.add_argument("--response-tokens", type=int, nargs=2, default=[64, 1536], help="response length range")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per layout (after warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--checkpoint", type=Path, default=None, help="a Qwen-VL checkpoint (default: write one)")
    return parse_with_tiny(parser, TINY)


def _sequences(args: argparse.Namespace, config: dict[str, Any]) -> list[VLTokenizedExample]:
    """SFT-like image + text sequences with random token ids and pixels (deterministic), as the data path makes
    them: the image's tokens in place, the loss on the response only."""
    generator = torch.Generator().manual_seed(0)
    vision = config["vision_config"]
    patch, merge = vision["patch_size"], vision["spatial_merge_size"]
    text_config = config.get("text_config", config)
    # ordinary text ids: past the tiny tokenizer's specials, below a real Qwen vocabulary's (151643 on)
    low, high = 16, min(1000, text_config["vocab_size"])

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=generator))

    sequences = []
    for index in range(args.sequences):
        side = randint(*args.image_sides) // (patch * merge) * (patch * merge) or patch * merge
        grid = torch.tensor([[1, side // patch, side // patch]])
        image_tokens = int(grid.prod()) // merge**2
        prompt = torch.randint(low, high, (randint(16, 96),), generator=generator).tolist()
        question = torch.randint(low, high, (randint(8, 48),), generator=generator).tolist()
        response = torch.randint(low, high, (randint(*args.response_tokens),), generator=generator).tolist()
        ids = (prompt + [config["vision_start_token_id"]] + [config["image_token_id"]] * image_tokens
               + [config["vision_end_token_id"]] + question + response)[: args.seq]
        mask = [0] * (len(ids) - len(response)) + [1] * len(response)
        pixels = torch.randn(int(grid.prod()), 3 * vision["temporal_patch_size"] * patch * patch, generator=generator)
        sequences.append(VLTokenizedExample(f"synthetic:{index}", torch.tensor(ids), torch.tensor(mask[: len(ids)],
                                                                                                  dtype=torch.bool),
                                            pixels, grid))
    return sequences


def _to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


def _run(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rows: list[dict[str, torch.Tensor]],
         args: argparse.Namespace) -> dict[str, Any]:
    from lightning_megatron.vl.module import VLSFTModule

    module = VLSFTModule()
    device = next(model.parameters()).device
    rows = [_to(row, device) for row in rows]
    response_tokens = sum(int(row["loss_mask"].sum()) for row in rows)
    fresh_memory()
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for row in rows:
            loss_sum, _, _ = module.loss_func(row, module.forward_step(model, row))
            (loss_sum / response_tokens).backward()
            total += float(loss_sum.detach())
        optimizer.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(total / response_tokens)
    step_s = statistics.median(times)
    processed = sum(row["input_ids"].numel() for row in rows)  # padding included
    return {"rows": len(rows), "processed_tokens_per_step": processed, "step_s": step_s,
            "tokens_per_s_processed": processed / step_s, "losses": losses, "peak_memory_gib": peak_memory_gib()}


def main() -> None:
    from lightning_megatron.bridges import create_bridge
    from lightning_megatron.hf_io import read_json
    from lightning_megatron.options import ModelOptions
    from lightning_megatron.testing.vl import make_tiny_vl_checkpoint

    args = _parse_args()
    init_single_process()
    with scratch_dir("vl_", TINY_SCRATCH_BYTES) as tmp:  # a tiny checkpoint, or a config-only one of the 3B shape
        checkpoint = args.checkpoint
        if checkpoint is None:
            shape = {} if args.tiny else QWEN25_VL_3B
            checkpoint = make_tiny_vl_checkpoint(tmp / "vl", "qwen2_5_vl", with_weights=args.tiny, **shape)
        config = read_json(checkpoint / "config.json")
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        options = ModelOptions(params_dtype=dtype, config_overrides={
            "calculate_per_token_loss": True, "cross_entropy_loss_fusion": False, "bias_activation_fusion": False})
        bridge = create_bridge("megatron-bridge", checkpoint)
        built_at = time.perf_counter()
        model = bridge.build(options, load_weights=args.tiny)[0].to(dtype)
        build_s = time.perf_counter() - built_at
    model.train()
    fused = torch.cuda.is_available()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused)
    sequences = _sequences(args, config)
    real_tokens = sum(len(sequence) for sequence in sequences)
    layouts = {
        "padded": [collate_vl([row]) for row in PaddedVLDataset(sequences, args.seq, 0)],
        "packed": [collate_vl([row]) for row in PackedVLDataset(sequences, args.seq, 0)],
    }
    results = {}
    for name, rows in layouts.items():
        results[name] = _run(model, optimizer, rows, args)
        results[name]["real_tokens_per_s"] = real_tokens / results[name]["step_s"]
    padded, packed = results["padded"], results["packed"]
    parameters = sum(p.numel() for p in model.parameters())
    emit({
        **environment(),
        "benchmark": "vl_packed_vs_padded",
        "model": {"family": "qwen2_5_vl", "parameters": parameters, "dtype": args.dtype,
                  "shape": "tiny" if args.tiny else "Qwen2.5-VL-3B", "build_s": build_s},
        "seq_length": args.seq, "sequences_per_step": len(sequences), "real_tokens_per_step": real_tokens,
        "image_tokens_per_step": sum(int(s.image_grid_thw.prod()) // 4 for s in sequences),
        "padding_fraction_padded": 1 - real_tokens / padded["processed_tokens_per_step"],
        "padded": padded, "packed": packed,
        "packed_over_padded_real_tokens_per_s": packed["real_tokens_per_s"] / padded["real_tokens_per_s"],
        "packed_over_padded_peak_memory": (packed["peak_memory_gib"] / padded["peak_memory_gib"]
                                           if packed["peak_memory_gib"] else None),
    }, args.out)


if __name__ == "__main__":
    main()
