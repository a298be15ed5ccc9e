"""The frozen trunk's forward in MTP-only training, replayed from CUDA graphs (`graphed_forward.GraphedForward`).

With every non-MTP parameter frozen and a first pipeline stage's inputs needing no grad, Megatron-Core's decoder
(`GPTModel.decoder`, a `TransformerBlock`: every decoder layer and the final norm) records no autograd, and it is
the same kernels for every microbatch of the same shape: most of a host-bound 0.6B MTP-only step's 5,456 kernel
launches. `graph_frozen_trunk` replaces each such decoder's forward with one CUDA graph per input signature; what
comes after it (the MTP block, both heads, the trunk cache's capture of the decoder's output, which is a forward
hook of the decoder and so still runs) is unchanged, and cached epochs of the trunk cache never call the decoder.

Graphed (first version): full or padded rows (no `packed_seq_params`, no attention mask), one process per model
replica without tensor, context or sequence parallelism (no collectives or RNG forks inside the graph), the
first pipeline stage's chunk (later stages read the received `input_tensor`, which needs grad), no recomputation,
no FP8/FP4, no MoE layers (data-dependent token routing), no dropout while training, no CPU offloading, no
Megatron CUDA graphs of its own. A chunk that cannot be graphed stays eager (`unsupported_reason`), and a call
with inputs outside this list (packed rows, trees) runs eagerly, counted per reason in `GraphedForward.eager_calls`
and logged once. The graphs' memory: one shared private pool per decoder (about one layer's forward working set)
plus static inputs and output, at most `max_graphs` signatures.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from lightning_megatron.cuda_graphs.graphed_forward import GraphedForward

logger = logging.getLogger(__name__)

MAX_GRAPHS = 4  # signatures kept per decoder: training's shape, validation's, a last partial batch's


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why this (unwrapped) GPTModel chunk's decoder cannot be graphed, or None."""
    config = model.config
    decoder = getattr(model, "decoder", None)
    checks = (
        (decoder is None, "no decoder on this chunk"),
        (not torch.cuda.is_available() or any(p.device.type != "cuda" for p in model.parameters()),
         "the model is not on a CUDA device"),
        (decoder is not None and not decoder.pre_process,
         "a later pipeline stage (its decoder reads the received input_tensor)"),
        (config.tensor_model_parallel_size > 1, "tensor parallelism"),
        (config.context_parallel_size > 1, "context parallelism"),
        (config.sequence_parallel, "sequence parallelism"),
        (config.recompute_granularity is not None, f"recompute_granularity: {config.recompute_granularity}"),
        (bool(config.fp8 or getattr(config, "fp4", None)), "FP8/FP4"),
        (bool(config.num_moe_experts), "MoE layers (data-dependent token routing)"),
        (bool(getattr(config, "cpu_offloading", False)
              or getattr(config, "fine_grained_activation_offloading", False)), "activation offloading"),
        (getattr(config, "cuda_graph_impl", "none") != "none", "Megatron-Core's own CUDA graphs (cuda_graph_impl)"),
        (decoder is not None and any(p.requires_grad for p in decoder.parameters()),
         "trainable decoder parameters"),
    )
    return next((reason for failed, reason in checks if failed), None)


def _call_reason(decoder: torch.nn.Module, arguments: dict[str, Any]) -> str | None:
    """Why this decoder call runs eagerly (inputs the first version does not graph), or None."""
    config = decoder.config
    if arguments.get("packed_seq_params") is not None:
        return "packed rows (packed_seq_params)"
    if arguments.get("attention_mask") is not None:
        return "an attention mask (tree rows or an explicit mask)"
    for name in ("context", "context_mask", "attention_bias", "inference_context", "inference_params"):
        if arguments.get(name) is not None:
            return f"{name} given"
    if arguments.get("extract_layer_indices"):
        return "extract_layer_indices given"
    if decoder.training and (config.hidden_dropout or config.attention_dropout):
        return "dropout while training"
    return None


def graph_frozen_trunk(chunks: list[torch.nn.Module], *, required: bool = False,
                       max_graphs: int = MAX_GRAPHS) -> list[GraphedForward]:
    """Graph the decoder of every chunk (unwrapped GPTModels, their non-MTP parameters already frozen) that
    `unsupported_reason` allows; returns the `GraphedForward`s (`remove()` each to undo). The others stay eager,
    logged once; `required`: logged as a warning (the user asked for the graphs)."""
    from megatron.core.utils import unwrap_model

    graphed = []
    for index, chunk in enumerate(chunks):
        model = unwrap_model(chunk)
        reason = unsupported_reason(model)
        if reason is not None:
            logger.log(logging.WARNING if required else logging.INFO,
                       "cuda_graph_trunk: model chunk %d's trunk stays eager: %s", index, reason)
            continue
        decoder = model.decoder
        graphed.append(GraphedForward(decoder, refuse=lambda arguments, d=decoder: _call_reason(d, arguments),
                                      max_graphs=max_graphs, name=f"cuda_graph_trunk (chunk {index})"))
    return graphed
