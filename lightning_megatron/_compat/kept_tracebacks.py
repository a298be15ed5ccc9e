"""Imports that keep no frame of their caller.

A library that keeps the exception of an optional import it could not make keeps its traceback, and through each
frame's `f_back` every frame on the stack at the time, with their locals: pulp's solver classes keep `err`
(pulp/apis/cplex_api.py:272-273, pulp/apis/copt_api.py:282-283), and megatron-bridge imports pulp (through
modelopt). Imported first inside `trainer.fit` (the megatron-bridge backend imports it when it builds the model),
that kept the trainer, the module and so the whole model for the life of the process. Not an `Adjustment`: it
patches nothing, it forgets tracebacks that nobody reads (pulp only formats the message), and cannot be undone.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from types import ModuleType


@contextlib.contextmanager
def imports_keeping_no_frames() -> Iterator[None]:
    """The modules imported inside the block forget the tracebacks of the exceptions they keep (as module globals
    or class attributes)."""
    before = set(sys.modules)
    try:
        yield
    finally:
        for name in set(sys.modules) - before:
            module = sys.modules.get(name)
            if isinstance(module, ModuleType):
                _forget_kept_tracebacks(module)


def _forget_kept_tracebacks(module: ModuleType) -> None:
    for value in list(vars(module).values()):
        if isinstance(value, BaseException):
            _forget_traceback(value)
        elif isinstance(value, type) and value.__module__ == module.__name__:
            for attribute in list(vars(value).values()):
                if isinstance(attribute, BaseException):
                    _forget_traceback(attribute)


def _forget_traceback(error: BaseException) -> None:
    """The error's traceback, and those of the errors it was raised from or during, are dropped."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = None
        pending += [current.__cause__, current.__context__]
