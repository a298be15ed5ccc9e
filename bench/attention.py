"""Core attention without Transformer Engine: Megatron-Core's local attention against SDPAttention, and plain HF.

For one model shape and the same tokens per step, side by side in one process: a plain Megatron-Core training step
(local layer spec, Float16Module + DDP + distributed optimizer, forward-backward over the microbatches, optimizer
step) with each core attention, and plain HF transformers Qwen3 (SDPA attention, fp32 weights with bf16 autocast,
AdamW fused on CUDA). Random weights and tokens. Prints one JSON object: median step time after warm-up, tokens/s,
model FLOPs and MFU (`bench/common.py`; no MTP layer here) and peak GPU memory (null on CPU) for each. Defaults are
the Qwen3-0.6B shape; `--tiny` is a CPU-sized one. The `hf` variant is P4 of the benchmarks (bench/README.md): plain
HF transformers beside our Megatron runs, the same tokens per step.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import add_step_options, emit, environment, fresh_memory, parse_with_tiny, peak_memory_gib
from bench.flops import ModelShape, model_flops, peak_flops, throughput
from lightning_megatron.distributed import init_single_process

TINY = dict(hidden=64, layers=2, heads=4, kv_groups=2, head_dim=16, ffn=128, vocab=512, seq=64, micro_batch=2,
            microbatches=2, steps=2, warmup=1, dtype="fp32")


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    add_shape_options(parser)
    parser.add_argument("--seq", type=int, default=2048)
    add_step_options(parser)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--variants", nargs="+", default=["hf", "sdpa", "local"], choices=["hf", "sdpa", "local"])
    return parse_with_tiny(parser, TINY)


def add_shape_options(parser: argparse.ArgumentParser) -> None:
    """`--tiny` and the model shape (default Qwen3-0.6B's) of a benchmark built by `gpt_model`."""
    parser.add_argument("--tiny", action="store_true", help="a CPU-sized shape (explicit flags still win)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-groups", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=3072)
    parser.add_argument("--vocab", type=int, default=151936)


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def random_microbatches(args: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    """`--microbatches` microbatches of random tokens, the same on every run (and in every arm of a comparison)."""
    generator = torch.Generator().manual_seed(0)
    microbatches = []
    for _ in range(args.microbatches):
        tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=generator).to(device())
        microbatches.append({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]})
    return microbatches


def _shape(args: argparse.Namespace) -> ModelShape:
    return ModelShape(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_groups=args.kv_groups,
                      head_dim=args.head_dim, ffn=args.ffn, vocab=args.vocab, mtp_layers=0)


def measure_steps(step: Callable[[], float], args: argparse.Namespace) -> dict[str, Any]:
    """Median step time after warm-up, its throughput, and the peak memory since the model was built (the caller
    resets it)."""
    times, loss = [], float("nan")
    for index in range(args.warmup + args.steps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        loss = step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if index >= args.warmup:
            times.append(time.perf_counter() - started)
    sequences = args.micro_batch * args.microbatches
    flops = model_flops(_shape(args), sequences, args.seq)
    return {**throughput(statistics.median(times), sequences * args.seq, flops, peak_flops(args.peak_tflops)),
            "peak_memory_gib": peak_memory_gib(), "last_loss": loss}


def gpt_model(args: argparse.Namespace, backend: str, **config_overrides: Any) -> tuple[Any, torch.nn.Module]:
    """A Qwen3-like Megatron-Core GPT (local spec, `backend` core attention) of `args`' shape on `device()`, with
    the same random weights on every call."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from lightning_megatron.attention import with_core_attention

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_query_groups=args.kv_groups, kv_channels=args.head_dim, ffn_hidden_size=args.ffn,
        normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=args.dtype == "bf16", params_dtype=dtype, pipeline_dtype=dtype,
        use_cpu_initialization=not torch.cuda.is_available(), **config_overrides,
    )
    spec = with_core_attention(get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"), backend)
    torch.manual_seed(0)  # the same weights for each core attention: their losses agree
    tensor_parallel.model_parallel_cuda_manual_seed(0, force_reset_rng=True)
    model = GPTModel(config, spec, vocab_size=args.vocab, max_sequence_length=args.seq, position_embedding_type="rope",
                     rotary_base=1_000_000, share_embeddings_and_output_weights=True).to(device())
    return config, model


def trainable(config: Any, model: torch.nn.Module, bf16: bool) -> tuple[torch.nn.Module, Any]:
    """`model` wrapped as a plain Megatron-Core loop trains it (Float16Module in bf16, DDP with the distributed
    optimizer) and its Adam optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    if bf16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    model = DistributedDataParallel(config, ddp_config, model)
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-5, bf16=bf16, use_distributed_optimizer=True, clip_grad=1.0), [model]
    )
    return model, optimizer


def megatron_step(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    fresh_memory()
    model, optimizer = trainable(*gpt_model(args, backend), bf16=args.dtype == "bf16")
    microbatches = random_microbatches(args)
    positions = torch.arange(args.seq, device=device()).expand(args.micro_batch, args.seq)

    def loss_func(per_token_loss: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = per_token_loss.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    def forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Callable]:
        batch = next(data_iterator)
        return model(batch["input_ids"], positions, None, labels=batch["labels"]), loss_func

    forward_backward = get_forward_backward_func()

    def step() -> float:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(forward_step_func=forward_step, data_iterator=iter(microbatches), model=[model],
                                  num_microbatches=args.microbatches, seq_length=args.seq,
                                  micro_batch_size=args.micro_batch, forward_only=False)
        optimizer.step()
        return statistics.mean(float(loss["lm loss"]) for loss in losses)

    result = measure_steps(step, args)
    del model, optimizer
    # The local attention keeps its [b * heads, sq, sk] score buffer in Megatron's global memory buffer.
    parallel_state.destroy_global_memory_buffer()
    parallel_state._set_global_memory_buffer()
    fresh_memory()
    return result


def hf_step(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_groups, head_dim=args.head_dim,
        max_position_embeddings=args.seq, rms_norm_eps=1e-6, tie_word_embeddings=True,
    )
    config._attn_implementation = "sdpa"
    fresh_memory()
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).to(device()).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=torch.cuda.is_available())
    microbatches = random_microbatches(args)
    autocast = functools.partial(torch.autocast, device().type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")

    def step() -> float:
        losses = []
        for batch in microbatches:
            with autocast():
                logits = model(input_ids=batch["input_ids"]).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten())
            (loss / args.microbatches).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return statistics.mean(losses)

    result = measure_steps(step, args)
    del model, optimizer
    fresh_memory()
    return result


def main() -> None:
    args = _parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    init_single_process()
    results: dict[str, Any] = {}
    for variant in args.variants:
        results[variant] = hf_step(args) if variant == "hf" else megatron_step(args, variant)
    report: dict[str, Any] = {
        "benchmark": "attention",
        **environment(),
        "shape": {key: getattr(args, key) for key in ("hidden", "layers", "heads", "kv_groups", "head_dim", "ffn",
                                                     "vocab", "seq", "micro_batch", "microbatches", "dtype")},
        "tokens_per_step": args.micro_batch * args.microbatches * args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "megatron": {backend: results[backend] for backend in ("local", "sdpa") if backend in results},
        "hf_transformers_sdpa": results.get("hf"),
    }
    if {"local", "sdpa"} <= results.keys():
        report["sdpa_over_local_step_time"] = results["sdpa"]["step_s"] / results["local"]["step_s"]
    if {"hf", "sdpa"} <= results.keys():
        report["sdpa_over_hf_step_time"] = results["sdpa"]["step_s"] / results["hf"]["step_s"]
    emit(report, args.out)


if __name__ == "__main__":
    main()
