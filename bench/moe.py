"""What an MoE layer costs without grouped GEMM: an MoE model against the dense model of the same active FLOPs.

Side by side in one process, the same tokens per step: a plain Megatron-Core training step (local layer spec,
Float16Module + DDP + distributed optimizer, forward-backward over the microbatches, optimizer step; EP=1) of
  - an MoE model: every layer's MLP is `--experts` SwiGLU experts of FFN `--moe-ffn`, `--top-k` per token, softmax
    router with the aux-loss load balancing, the all-to-all token dispatcher;
  - its dense equivalent: the same attention, one SwiGLU MLP of FFN `top_k x moe_ffn`: the same matmul FLOPs per
    token as the experts a token visits (only the router's `h x experts` projection is extra; FLOPs leave it out).
The local spec always builds `SequentialMLP` experts (megatron/core/models/backends.py), which loops over the
experts and runs two small GEMMs per expert; a grouped GEMM (`TEGroupedMLP`, Transformer Engine) runs each
projection of all local experts as one kernel. Without TE on a GPU, `_compat.grouped_experts` runs
`SequentialMLP`'s experts as two `torch._grouped_mm` GEMMs: the MoE model runs twice, with it (`moe`) and with
upstream's loop (`moe_expert_loop`, the adjustment suspended), beside the dense model. The JSON says which backend
ran, and each run's `profile` one more step under torch.profiler (`bench.packing_profile.profile_figures`: GPU
busy time, syncs and their sources, top kernels, and the MoE layer's router / preprocess / dispatch / experts /
combine as CPU ranges), to show where the MoE step's gap to the dense one goes. Model FLOPs and MFU count the
active parameters (`bench/common.py`'s formula with FFN `top_k x moe_ffn`). Default shape:
hidden 2048, 16 layers, 16 experts top 4 of FFN 1408 (2.4B total, 0.7B active parameters); `--tiny` is CPU-sized.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bench.attention import device, measure_steps, random_microbatches, trainable
from bench.common import add_step_options, emit, environment, fresh_memory, parse_with_tiny, release_model
from bench.packing_profile import profile_step
from lightning_megatron.distributed import init_single_process

MOE_RANGES = tuple(  # the MoE layer's four phases as CPU ranges of the profiled step
    ("megatron.core.transformer.moe.moe_layer", f"MoELayer.{method}", f"## moe {label}")
    for method, label in (("route", "router"), ("preprocess", "preprocess"), ("dispatch", "dispatch"),
                          ("routed_experts_compute", "experts"), ("combine", "combine")))

TINY = dict(hidden=64, layers=2, heads=4, kv_groups=2, head_dim=16, experts=4, top_k=2, moe_ffn=32, vocab=512,
            seq=64, micro_batch=2, microbatches=2, steps=2, warmup=1, dtype="fp32")


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="a CPU-sized shape (explicit flags still win)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-groups", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--moe-ffn", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq", type=int, default=2048)
    add_step_options(parser)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    args = parse_with_tiny(parser, TINY)
    args.ffn = args.top_k * args.moe_ffn  # the dense model a token sees: what both runs' FLOPs count
    return args


def _build(args: argparse.Namespace, moe: bool) -> tuple[torch.nn.Module, Any]:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from lightning_megatron.attention import with_core_attention

    bf16 = args.dtype == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    mlp: dict[str, Any] = dict(ffn_hidden_size=args.ffn)
    if moe:
        mlp = dict(ffn_hidden_size=args.moe_ffn, moe_ffn_hidden_size=args.moe_ffn, num_moe_experts=args.experts,
                   moe_router_topk=args.top_k, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3,
                   moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32")
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_query_groups=args.kv_groups, kv_channels=args.head_dim, normalization="RMSNorm", layernorm_epsilon=1e-6,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, qk_layernorm=True, hidden_dropout=0.0,
        attention_dropout=0.0, bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype,
        use_cpu_initialization=not torch.cuda.is_available(), **mlp,
    )
    spec = get_gpt_layer_local_spec(num_experts=args.experts if moe else None, qk_layernorm=True,
                                    normalization="RMSNorm")
    torch.manual_seed(0)
    model = GPTModel(config, with_core_attention(spec, "sdpa"), vocab_size=args.vocab, max_sequence_length=args.seq,
                     position_embedding_type="rope", rotary_base=1_000_000,
                     share_embeddings_and_output_weights=True).to(device())
    return trainable(config, model, bf16=bf16)


def _run(args: argparse.Namespace, moe: bool) -> dict[str, Any]:
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.utils import unwrap_model

    fresh_memory()
    model, optimizer = _build(args, moe)
    parameters = sum(p.numel() for p in model.parameters())
    experts = type(unwrap_model(model).decoder.layers[0].mlp).__name__
    if moe:
        experts = type(unwrap_model(model).decoder.layers[0].mlp.experts).__name__
    microbatches = random_microbatches(args)
    positions = torch.arange(args.seq, device=device()).expand(args.micro_batch, args.seq)
    forward_backward = get_forward_backward_func()

    def loss_func(per_token_loss: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = per_token_loss.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    def forward_step(data_iterator: Any, chunk: torch.nn.Module) -> tuple[torch.Tensor, Callable]:
        batch = next(data_iterator)
        return chunk(batch["input_ids"], positions, None, labels=batch["labels"]), loss_func

    def step() -> float:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(forward_step_func=forward_step, data_iterator=iter(microbatches), model=[model],
                                  num_microbatches=args.microbatches, seq_length=args.seq,
                                  micro_batch_size=args.micro_batch, forward_only=False)
        optimizer.step()
        get_moe_metrics_tracker().clear()
        return statistics.mean(float(value["lm loss"]) for value in losses)

    result = {**measure_steps(step, args), "parameters": parameters, "mlp_backend": experts}
    result["profile"] = profile_step(step, result["step_s"], MOE_RANGES if moe else ())  # where the gap goes
    release_model([model])  # else the next run's peak (and an 80 GB GPU) holds this model, its grads and optimizer
    del model, optimizer, step
    fresh_memory()
    return result


def main() -> None:
    from lightning_megatron._compat.grouped_experts import MEGATRON_CORE_ADJUSTMENTS

    args = _parse_args()
    init_single_process()
    grouped = MEGATRON_CORE_ADJUSTMENTS[0]
    moe = _run(args, moe=True)
    with grouped.suspended():
        loop = _run(args, moe=True)
    dense = _run(args, moe=False)
    active_per_layer = (args.hidden * args.heads * args.head_dim * 2 + 2 * args.hidden * args.kv_groups
                        * args.head_dim + 3 * args.hidden * args.top_k * args.moe_ffn + args.hidden * args.experts)
    emit({
        **environment(),
        "shape": {key: getattr(args, key) for key in ("hidden", "layers", "heads", "kv_groups", "head_dim",
                                                       "experts", "top_k", "moe_ffn", "vocab", "seq", "micro_batch",
                                                       "microbatches", "dtype")},
        "expert_parallel_size": 1,
        "active_parameters": args.layers * active_per_layer + args.vocab * args.hidden,
        "experts_grouped_gemm": grouped.active,
        "moe": moe,
        "moe_expert_loop": loop,
        "dense_equivalent": dense,
        "moe_over_dense_step_time": moe["step_s"] / dense["step_s"],
        "expert_loop_over_dense_step_time": loop["step_s"] / dense["step_s"],
        "grouped_over_expert_loop_step_time": moe["step_s"] / loop["step_s"],
        "moe_over_dense_peak_memory": (moe["peak_memory_gib"] / dense["peak_memory_gib"]
                                       if moe["peak_memory_gib"] else None),
        "note": (f"experts ran as {moe['mlp_backend']}, "
                 + ("their GEMMs grouped by torch._grouped_mm (_compat.grouped_experts)" if grouped.active else
                    f"a Python loop over the {args.experts} experts with two small GEMMs each (no CUDA, or no "
                    "torch._grouped_mm)")
                 + "; moe_expert_loop: upstream's loop in the same process. The step-time gap to the dense model of "
                 "the same active FLOPs is what the router, the permutation and the all-to-all cost"),
    }, args.out)


if __name__ == "__main__":
    main()
