"""A reversible, idempotent upstream adjustment: what every workaround in `_compat` is made of."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any


class Patches:
    """Records each change an adjustment makes so that it can be undone (tests show the failure without it)."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def setattr(self, target: Any, name: str, value: Any) -> None:
        missing = object()
        original = target.__dict__.get(name, missing) if hasattr(target, "__dict__") else getattr(target, name)
        setattr(target, name, value)
        if original is missing:
            self._undo.append(lambda: delattr(target, name))
        else:
            self._undo.append(lambda: setattr(target, name, original))

    def on_revert(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def revert(self) -> None:
        while self._undo:
            self._undo.pop()()


@dataclass
class Adjustment:
    """One workaround: `works_around` names the upstream file:line, `needed` is the condition it is applied under."""

    name: str
    works_around: str
    needed: Callable[[], bool]
    install: Callable[[Patches], None]
    _patches: Patches | None = field(default=None, repr=False)

    @property
    def active(self) -> bool:
        return self._patches is not None

    def apply(self) -> bool:
        """Apply once, and only when needed; returns whether it is active."""
        if self._patches is None and self.needed():
            patches = Patches()
            self.install(patches)
            self._patches = patches
        return self.active

    def revert(self) -> None:
        if self._patches is not None:
            self._patches.revert()
            self._patches = None

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Run a block as if this adjustment had never been applied (used by the tests that show it is needed)."""
        was_active = self.active
        self.revert()
        try:
            yield
        finally:
            if was_active:
                self.apply()
