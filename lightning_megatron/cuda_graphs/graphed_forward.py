"""A module's gradient-free forward replayed from CUDA graphs, one graph per input signature.

A forward that records no autograd (frozen parameters, inputs that need no grad) is the same sequence of kernels
for every call of the same shapes; on the GPU its cost at small shapes is the host's: a Qwen3-0.6B trunk forward is
over a thousand kernel launches (28 layers) for a few ms of GPU work. `GraphedForward` replaces `module.forward`
(its hooks still run around it) with: the first `warmup_calls` calls of a new signature (tensor shapes, dtypes,
strides and devices, the other arguments' values, which optional inputs are None, `module.training`, inference
mode) run eagerly; the next one copies its tensors into static buffers of its own, warms up once more on the
capture stream, captures the forward under `no_grad` into a CUDA graph, and replays it; later calls of that
signature copy their tensors into the static buffers, replay, and get a copy of the static output (the next replay
overwrites it, and a caller's backward may keep the tensor it was given).

Why a hand-rolled `torch.cuda.CUDAGraph` and not Megatron-Core 0.19.2's own graphs (`cuda_graph_impl="local"`,
`megatron/core/transformer/cuda_graphs.py`): those are made per `TransformerLayer` for training (forward and
backward graphs recorded over warm-up steps, created by `create_cudagraphs()` from the training loop), are chosen
when the model is built (the config of every layer, the trainable MTP layer included), and would still leave one
graph launch per layer and the eager glue between layers; a frozen trunk needs none of the backward machinery, so
one forward graph of the whole block is both simpler and fewer launches.

What it refuses, running the call eagerly instead (each reason counted in `eager_calls` and logged once):
positional arguments the forward cannot bind, arguments other than tensors, None and plain scalars (e.g. packed
sequence parameters objects), tensors that need grad or live off the module's CUDA device, trainable parameters,
autocast, another capture in progress, whatever the owner's `refuse(arguments)` names, and a signature whose
eager forward built an autograd graph or returned something other than one tensor, or whose capture failed
(reason kept for that signature). Forward hooks of submodules do not run during a replay (the module's own do).

Memory: the graphs of one `GraphedForward` share one private pool (replays never overlap and every output is
copied before the next replay, so sharing is safe), at most `max_graphs` graphs are kept (the least recently
used is dropped), and each holds static copies of its inputs and its output. Between calls that is all they keep
allocated, with the capture stream's cuBLAS workspaces (kept per handle and stream: 33 MiB on an H100) and a few
bytes of RNG state per graph; the working set of a replay stays in the private pool, which the allocator counts as
reserved, not allocated (tests/cuda_graphs/test_graphed_forward.py).
"""

from __future__ import annotations

import inspect
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

SCALARS = (bool, int, float, str)


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]  # static buffers, by argument name
    output: torch.Tensor


class GraphedForward:
    """`module.forward` from CUDA graphs where it records no autograd (module docstring); `remove()` undoes it.

    `refuse(arguments)`: the owner's reason (a short text) to run a call eagerly, or None; `arguments` are the
    forward's bound arguments by name. `name` labels the log lines.
    """

    def __init__(self, module: torch.nn.Module, *, refuse: Callable[[dict[str, Any]], str | None] | None = None,
                 max_graphs: int = 4, warmup_calls: int = 1, name: str = "forward") -> None:
        if max_graphs < 1 or warmup_calls < 1:  # the eager warm-up is what shows the forward records no autograd
            raise ValueError(f"max_graphs: {max_graphs} and warmup_calls: {warmup_calls} must be at least 1")
        self.module: torch.nn.Module | None = module
        self.name = name
        self.refuse = refuse
        self.max_graphs, self.warmup_calls = max_graphs, warmup_calls
        self.eager_forward: Any = module.forward
        self._signature = inspect.signature(self.eager_forward)
        self._parameters = list(module.parameters())
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.replays = self.captures = self.warmups = 0
        self.eager_calls: Counter[str] = Counter()
        self._seen: OrderedDict[tuple, int] = OrderedDict()  # warm-up calls per signature not yet captured
        self._refused: dict[tuple, str] = {}  # signatures that stay eager, and why
        self._pool: Any = None
        self._stream: Any = None
        module.forward = self  # Module.__call__ runs hooks around `self.forward`

    def counts(self) -> dict[str, Any]:
        """Calls so far: eager warm-ups, captures, replays, and the eager ones by reason."""
        return {"warmups": self.warmups, "captures": self.captures, "replays": self.replays,
                "eager": dict(self.eager_calls)}

    def remove(self) -> None:
        """Give the module its eager forward back, free the graphs and let go of the module (the counts stay)."""
        if self.module is not None and vars(self.module).get("forward") is self:
            del self.module.forward
        self.graphs.clear()
        self._seen.clear()
        self._refused.clear()
        self._parameters = []
        self._pool = self.module = self.eager_forward = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError:
            return self._eager("arguments the forward cannot bind", args, kwargs)
        key, reason = self._key(bound.arguments)
        if reason is None and self.refuse is not None:
            reason = self.refuse(bound.arguments)
        if reason is None:
            reason = self._refused.get(key)
        if reason is not None:
            return self._eager(reason, args, kwargs)
        entry = self.graphs.get(key)
        if entry is not None:
            self.graphs.move_to_end(key)
            return self._replay(entry, bound.arguments)
        if self._seen.get(key, 0) < self.warmup_calls:
            return self._warm_up(key, bound)
        return self._capture(key, bound)

    # ------------------------------------------------------------------ per call

    def _key(self, arguments: dict[str, Any]) -> tuple[tuple, str | None]:
        if torch.cuda.is_current_stream_capturing():
            return (), "another CUDA graph capture in progress"
        if torch.is_autocast_enabled("cuda"):
            return (), "autocast"
        if any(parameter.requires_grad for parameter in self._parameters):
            return (), "trainable parameters"
        device = self._parameters[0].device if self._parameters else None
        key: list[Any] = [self.module.training, torch.is_inference_mode_enabled()]
        for name, value in arguments.items():
            if isinstance(value, torch.Tensor):
                if value.requires_grad:
                    return (), f"{name} requires grad"
                if value.device != device or value.device.type != "cuda":
                    return (), f"{name} on {value.device}, not the module's CUDA device"
                key.append((name, tuple(value.shape), value.stride(), value.dtype))
            elif value is None or isinstance(value, SCALARS):
                key.append((name, value))
            else:
                return (), f"{name} is a {type(value).__name__}"
        return tuple(key), None

    def _eager(self, reason: str, args: tuple, kwargs: dict) -> Any:
        if reason not in self.eager_calls:
            logger.warning("%s: eager, not from a CUDA graph: %s", self.name, reason)
        self.eager_calls[reason] += 1
        return self.eager_forward(*args, **kwargs)

    def _warm_up(self, key: tuple, bound: inspect.BoundArguments) -> Any:
        self.warmups += 1
        self._seen[key] = self._seen.get(key, 0) + 1
        self._seen.move_to_end(key)
        while len(self._seen) > 4 * self.max_graphs:
            self._seen.popitem(last=False)
        output = self.eager_forward(*bound.args, **bound.kwargs)
        reason = _output_reason(output)
        if reason is not None:
            self._refuse(key, reason)
        return output

    def _replay(self, entry: _Graph, arguments: dict[str, Any]) -> torch.Tensor:
        for name, buffer in entry.inputs.items():
            buffer.copy_(arguments[name])
        entry.graph.replay()
        self.replays += 1
        return entry.output.clone()

    def _capture(self, key: tuple, bound: inspect.BoundArguments) -> Any:
        self._seen.pop(key, None)
        static = inspect.BoundArguments(self._signature, {
            name: value.detach().clone() if isinstance(value, torch.Tensor) else value
            for name, value in bound.arguments.items()})
        try:
            graph, output = self._record(static)
        except Exception as error:  # noqa: BLE001 - that signature stays eager, with the reason logged
            logger.warning("%s: capturing a CUDA graph failed", self.name, exc_info=True)
            self._refuse(key, f"capture failed: {failure(error)}")
            return self._eager(self._refused[key], bound.args, bound.kwargs)
        while len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)
        inputs = {name: value for name, value in static.arguments.items() if isinstance(value, torch.Tensor)}
        entry = self.graphs[key] = _Graph(graph, inputs, output)
        self.captures += 1
        entry.graph.replay()  # capturing ran nothing: this call's output comes from the first replay
        return entry.output.clone()

    def _record(self, static: inspect.BoundArguments) -> tuple[Any, torch.Tensor]:
        if self._stream is None:  # one stream for warm-up and capture: per-stream library state is made once
            self._stream = torch.cuda.Stream(device=self._parameters[0].device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():  # lazy per-stream state (cuBLAS workspaces) made here
            reason = _output_reason(self.eager_forward(*static.args, **static.kwargs))
        torch.cuda.current_stream().wait_stream(stream)
        if reason is not None:
            raise RuntimeError(reason)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph, pool=self._pool, stream=stream,
                                               capture_error_mode="thread_local"):
            output = self.eager_forward(*static.args, **static.kwargs)
        if self._pool is None:
            self._pool = graph.pool()
        reason = _output_reason(output)
        if reason is not None:
            raise RuntimeError(reason)
        return graph, output

    def _refuse(self, key: tuple, reason: str) -> None:
        """This signature runs eagerly from now on (logged by `_eager` on its next call)."""
        self._refused[key] = reason
        self._seen.pop(key, None)


def failure(error: BaseException) -> str:
    """What failed, in one line: the error, and what failed inside a capture when ending the capture failed too."""
    def line(failed: BaseException) -> str:
        return f"{type(failed).__name__}: {' '.join(str(failed).split())[:300]}"

    cause = error.__context__
    return line(error) + (f" (after {line(cause)})" if cause is not None else "")


def _output_reason(output: Any) -> str | None:
    if not isinstance(output, torch.Tensor):
        return f"the forward returned a {type(output).__name__}, not one tensor"
    if output.requires_grad:
        return "the eager forward recorded autograd (its output requires grad)"
    return None
