"""Plain torch functions through `torch.compile`, for the adjustments that replace slow eager CUDA kernels without
Transformer Engine (`fast_rms_norm.py`, `fast_rope.py`): what compiles, when a call runs eagerly instead, and how a
compile that fails is refused once.

Each function has one compiled copy per shape past the rows (dim 0), made at that shape's first call: dynamo counts
graphs against its recompile limit (8 by default; hitting it under `fullgraph=True` is an error) per code object, so
the shapes of all the models one process trains never share a limit. The rows are marked dynamic and
`dynamic=False` keeps every other size static, so a copy compiles once per dtype and layout, whatever the sequence
length, micro-batch or validation shape. A compile cannot run inside a CUDA graph capture: a call there whose
signature has not run compiled yet runs the function eagerly. A compile that fails (no Triton, no C compiler for
Triton's launcher, a graph break) is logged once, and the adjustment's `State` then sends every call back to
upstream's kernels.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass
class State:
    """Whether an adjustment's replacements take the compiled path: it is applied and no compile failed."""

    refusal: str  # the warning logged once when a compile fails, with "%s" for the error
    logger: logging.Logger
    active: bool = False
    refused: str | None = None  # why compiling failed: upstream's kernels run from then on

    @property
    def compiles(self) -> bool:
        return self.active and self.refused is None

    def refuse(self, error: Exception) -> None:
        if self.refused is None:
            self.refused = f"{type(error).__name__}: {error}".splitlines()[0][:300]
            self.logger.warning(self.refusal, self.refused)

    def deactivate(self) -> None:
        self.active = False


def signature(args: tuple[Any, ...]) -> tuple:
    """What a compiled function's graphs differ by: each tensor's dtype, shape past the rows, strides and whether it
    has one row (dynamo specialises that size), the other arguments' values, the grad and inference modes."""
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            *((arg.dtype, arg.shape[1:], arg.stride(), arg.shape[0] == 1) if isinstance(arg, torch.Tensor) else arg
              for arg in args))


def with_own_code(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` with a code object of its own: dynamo keeps its graphs, and counts them against its recompile
    limit, per code object."""
    return types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                              function.__defaults__, function.__closure__)


class CompiledKernel:
    """A plain function through `torch.compile`, one compiled copy per shape of the first argument past its rows;
    its eager self once compiling failed (`state.refused`), and inside a CUDA graph capture for a signature that has
    not run compiled yet. Every tensor argument with as many dimensions as the first shares its rows (dim 0, marked
    dynamic). Each adjustment subclasses it with its own `state`."""

    state: ClassVar[State]

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.ran: set[tuple] = set()  # the signatures that ran compiled
        self._by_shape: dict[tuple[int, ...], Callable[..., Any]] = {}

    def compiled(self, shape: tuple[int, ...]) -> Callable[..., Any]:
        if shape not in self._by_shape:
            self._by_shape[shape] = torch.compile(with_own_code(self.function), dynamic=False, fullgraph=True)
        return self._by_shape[shape]

    def __call__(self, *args: Any) -> Any:
        if self.state.refused is not None:
            return self.function(*args)
        call_signature = signature(args)
        capturing = args[0].is_cuda and torch.cuda.is_current_stream_capturing()
        if capturing and call_signature not in self.ran:
            return self.function(*args)
        try:
            compiled = self.compiled(tuple(args[0].shape[1:]))
            for arg in args:
                if isinstance(arg, torch.Tensor) and arg.dim() == args[0].dim():
                    torch._dynamo.maybe_mark_dynamic(arg, 0)  # the rows: one graph for every count
            result = compiled(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:
            if capturing:  # the capture is broken already: the caller's fallback decides
                raise
            self.state.refuse(error)
            return self.function(*args)
        self.ran.add(call_signature)
        return result


def triton_available() -> bool:
    """Whether Inductor can generate CUDA kernels here (Triton importable and the GPU new enough for it)."""
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return importlib.util.find_spec("triton") is not None
    return has_triton()


def switched_on(variable: str, off: str, on: str, *, default: bool = True) -> bool:
    """An adjustment's environment switch: 1 applies it (where its condition holds), 0 leaves upstream's kernels
    (`off`), unset is `default`; any other value is refused (a `false` that silently did nothing would be taken for
    upstream's kernels, in a benchmark too)."""
    value = os.environ.get(variable, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{variable}={value!r} is not 0 or 1: set it to 0 ({off}) or 1 ({on}), or leave it unset "
                         f"(the default: {on if default else off})")
    return value == "1" or (value == "" and default)
