"""`GraphedForward` on a small frozen module, on a GPU: what a replay returns and what the graphs keep.

Each input signature is warmed up eagerly, captured, then replayed, and every call returns exactly what the eager
forward returned for that input; past `max_graphs` signatures the least recently used graph is dropped and made again
when its signature comes back. Between calls the graphs keep allocated only their static inputs and outputs, the
cuBLAS workspaces of the stream they were captured on and a few bytes of RNG state per graph (their working set sits
in their private pool, which the allocator counts as reserved, not allocated): the memory `MTPOnlyCallback`'s trunk
graphs add to a step's peak.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch

from lightning_megatron.cuda_graphs.graphed_forward import GraphedForward

WIDTH = 256
RNG_STATE_BYTES = 2 * 512


def _frozen_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH))
    return module.cuda().requires_grad_(False)


@pytest.mark.gpu
def test_each_signature_replays_what_eager_returned_and_the_least_recently_used_graph_is_dropped():
    module = _frozen_mlp()
    inputs = {rows: torch.randn(rows, WIDTH, device="cuda") for rows in (8, 16, 32)}
    expected = {rows: module(x) for rows, x in inputs.items()}
    graphed = GraphedForward(module, max_graphs=2)
    try:
        for rows in (8, 8, 8, 16, 16, 16, 32, 32, 8, 8):
            torch.testing.assert_close(module(inputs[rows]), expected[rows], rtol=0, atol=0)
        # 8, 16 and 32 each warmed up and captured; 32's capture dropped 8's graph, so 8 went round again
        assert graphed.counts() == {"warmups": 4, "captures": 4, "replays": 2, "eager": {}}
        assert [_key_rows(key) for key in graphed.graphs] == [32, 8]
    finally:
        graphed.remove()


def _key_rows(key: tuple) -> int:
    """The row count of a signature's tensor argument (`GraphedForward._key`: (name, shape, stride, dtype))."""
    (shape,) = [entry[1] for entry in key if isinstance(entry, tuple) and len(entry) == 4]
    return shape[0]


def _allocated_after(step: Callable[[], object]) -> int:
    """Bytes allocated after `step()` ran and its results were dropped, less those allocated before."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    step()
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before


@pytest.mark.gpu
def test_between_calls_the_graphs_hold_their_static_buffers_and_their_capture_streams_blas_workspace():
    module = _frozen_mlp()
    x = torch.randn(64, WIDTH, device="cuda")
    module(x)  # the current stream's cuBLAS workspace is made here, before anything is counted

    def on_a_new_stream() -> None:
        with torch.cuda.stream(torch.cuda.Stream()):
            module(x)

    per_stream = _allocated_after(on_a_new_stream)  # what running the module on another stream leaves behind
    assert per_stream > 0  # cuBLAS keeps one workspace per handle and stream
    graphed = GraphedForward(module)
    try:
        held = _allocated_after(lambda: [module(x) for _ in range(3)])  # warm-up, capture, replay
        assert graphed.counts()["captures"] == 1 and graphed.counts()["replays"] == 1
        (entry,) = graphed.graphs.values()
        static = sum(t.untyped_storage().nbytes() for t in (*entry.inputs.values(), entry.output))
        assert static == 2 * x.numel() * x.element_size()
        # and the CUDA generator's state that each capture registers (`CUDAGraph.capture_begin`): int64 tensors
        # in the allocator's smallest blocks (512 bytes), one or two
        assert static + per_stream <= held <= static + per_stream + RNG_STATE_BYTES
    finally:
        graphed.remove()
