"""`CudaGraphOptions`: what the user asked of CUDA graphs, parsed once from the options that name them.

Two owners hold the options: `MegatronStrategy` (`cuda_graph`, `cuda_graph_sequences_per_row`) and
`MTPOnlyCallback` (`cuda_graph_trunk`). Each parses its own here when it is made; the callback joins the strategy's
part to its own before the model is built, so the rest of the run reads one object, never the option values.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal

CudaGraph = Literal["auto", "none", "full_iteration"]
CUDA_GRAPHS: tuple[CudaGraph, ...] = ("auto", "none", "full_iteration")
SEQUENCES_PER_ROW = 256  # packed rows' fixed count of cu_seqlens sequences (empty ones are nearly free)


class IterationGraph(Enum):
    """`MegatronStrategy(cuda_graph=...)`: training steps replayed from one captured CUDA graph."""

    AUTO = "auto"  # where the refusal table lets it; elsewhere eager, said in one line
    REQUIRED = "full_iteration"  # the same, but what the table refuses stops the run, naming the fix
    OFF = "none"  # always eager


class TrunkGraphs(Enum):
    """`MTPOnlyCallback(cuda_graph_trunk=...)`: the frozen trunk's forward from CUDA graphs."""

    AUTO = "null"  # where it applies; elsewhere eager, logged once
    REQUIRED = "true"  # the same, but a CPU run is refused and chunks left eager are warned about
    OFF = "false"  # always eager


@dataclass(frozen=True)
class CudaGraphOptions:
    """The run's CUDA graphs. `full_iteration`: training steps replayed from one captured graph (the strategy's
    `cuda_graph`), packed rows padded to `sequences_per_row` sequences; `frozen_trunk`: MTP-only training's frozen
    trunk from CUDA graphs (the MTP-only callback's `cuda_graph_trunk`)."""

    full_iteration: IterationGraph = IterationGraph.AUTO
    sequences_per_row: int = SEQUENCES_PER_ROW
    frozen_trunk: TrunkGraphs = TrunkGraphs.AUTO

    @classmethod
    def parse(cls, cuda_graph: str = "auto", cuda_graph_sequences_per_row: int = SEQUENCES_PER_ROW,
              cuda_graph_trunk: bool | None = None) -> CudaGraphOptions:
        """The options of the user's values; raises, naming the option, on a value that has no meaning."""
        if cuda_graph not in CUDA_GRAPHS:
            raise ValueError(f"cuda_graph: {cuda_graph!r} is not one of {', '.join(map(repr, CUDA_GRAPHS))}")
        full_iteration = IterationGraph(cuda_graph)
        count = cuda_graph_sequences_per_row
        if isinstance(count, bool) or not isinstance(count, int) or (full_iteration is not IterationGraph.OFF
                                                                     and count < 1):  # only the graph reads it
            raise ValueError(f"cuda_graph_sequences_per_row: {cuda_graph_sequences_per_row!r} must be a positive "
                             f"integer (default {SEQUENCES_PER_ROW})")
        trunk = {None: TrunkGraphs.AUTO, True: TrunkGraphs.REQUIRED, False: TrunkGraphs.OFF}[cuda_graph_trunk]
        return cls(full_iteration, cuda_graph_sequences_per_row, trunk)
