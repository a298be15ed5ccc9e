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
no FP8/FP4, no expert parallelism or MoE token dropping, no dropout while training, no CPU offloading, no
Megatron CUDA graphs of its own (the `FROZEN_TRUNK` rows of `refusals.REFUSALS`). MoE layers are graphed: on one
rank, dropless, their routing has static shapes (tokens x top-k rows), and on a GPU without Transformer Engine the
grouped experts keep the token counts on the device (`_compat.grouped_experts`); a layer that still reads something
to the host fails the capture, and that signature then runs eagerly with the reason. A replayed trunk records no
load-balancing loss for its frozen routers (Megatron-Core computes them only with grad enabled,
megatron/core/transformer/moe/router.py:799; the capture runs under `no_grad`): there `SFTModule`'s
`moe_aux_loss` covers the MTP layer's router alone, the only one MTP-only trains. A chunk that cannot be graphed
stays eager, and a call with inputs outside this list (packed rows, trees) runs eagerly, counted per reason in
`GraphedForward.eager_calls` and logged once. The graphs' memory: one shared private pool per decoder (about one
layer's forward working set, reserved by the allocator but not allocated) plus static inputs and output and the
capture stream's cuBLAS workspaces (allocated: a step's allocated peak is that much higher than eager's), at most
`max_graphs` signatures.
"""

from __future__ import annotations

import logging

import torch

from lightning_megatron.cuda_graphs.graphed_forward import GraphedForward
from lightning_megatron.cuda_graphs.options import CudaGraphOptions, TrunkGraphs
from lightning_megatron.cuda_graphs.refusals import Mechanism, TrunkCall, reason

logger = logging.getLogger(__name__)

MAX_GRAPHS = 4  # signatures kept per decoder: training's shape, validation's, a last partial batch's


def graph_frozen_trunk(chunks: list[torch.nn.Module], options: CudaGraphOptions, *,
                       max_graphs: int = MAX_GRAPHS) -> list[GraphedForward]:
    """Graph the decoder of every chunk (unwrapped GPTModels, their non-MTP parameters already frozen) that the
    refusal table allows; returns the `GraphedForward`s (`remove()` each to undo). The others stay eager, logged once
    with the reason (a warning with `cuda_graph_trunk: true`: the user asked for the graphs); none with false."""
    from megatron.core.utils import unwrap_model

    if options.frozen_trunk is TrunkGraphs.OFF:
        return []
    required = options.frozen_trunk is TrunkGraphs.REQUIRED
    graphed = []
    for index, chunk in enumerate(chunks):
        model = unwrap_model(chunk)
        why = reason(Mechanism.FROZEN_TRUNK, model)
        if why is not None:
            logger.log(logging.WARNING if required else logging.INFO,
                       "cuda_graph_trunk: model chunk %d's trunk stays eager: %s", index, why)
            continue
        decoder = model.decoder
        graphed.append(GraphedForward(
            decoder, refuse=lambda arguments, d=decoder: reason(Mechanism.FROZEN_TRUNK, TrunkCall(d, arguments)),
            max_graphs=max_graphs, name=f"cuda_graph_trunk (chunk {index})"))
    return graphed
