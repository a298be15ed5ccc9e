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


_APPLIED: list[Adjustment] = []
"""The active adjustments in the order they were applied: a later one may wrap what an earlier one installed (two
adjustments of `WrappedTorchNorm.__new__` each call the `__new__` they found), so an earlier one is only ever undone
with the later ones lifted off first and put back after."""


@dataclass
class Adjustment:
    """One workaround: `works_around` names the upstream file:line, `needed` is the condition it is applied under."""

    name: str
    works_around: str
    needed: Callable[[], bool]
    install: Callable[[Patches], None]
    _patches: Patches | None = field(default=None, repr=False)
    _suspensions: int = field(default=0, repr=False)  # the `suspended()` blocks running: `apply()` waits for them

    @property
    def active(self) -> bool:
        return self._patches is not None

    def apply(self) -> bool:
        """Apply once, only when needed and not suspended; returns whether it is active."""
        if self._patches is None and not self._suspensions and self.needed():
            patches = Patches()
            self.install(patches)
            self._patches = patches
            _APPLIED.append(self)
        return self.active

    def revert(self) -> None:
        """Undo this adjustment; the ones applied after it stay applied (lifted off, then applied again on top of
        what is left: reverting this one's patches alone would restore what they wrapped, dropping theirs)."""
        if self._patches is not None:
            with _lifted(_APPLIED.index(self) + 1):
                self._undo()

    def _undo(self) -> None:
        assert self._patches is not None
        self._patches.revert()
        self._patches = None
        _APPLIED.remove(self)

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Run a block as if this adjustment had never been applied (used by the tests that show it is needed), even
        where the block applies adjustments itself (a fit's `MegatronStrategy.setup_environment` runs
        `prepare_megatron_core()` before it builds the model: without the hold, a fit meant to run upstream's code
        would build with the adjustment again); then, if it was active, apply it again at its place in the order."""
        place = _APPLIED.index(self) if self.active else None
        self.revert()
        self._suspensions += 1
        try:
            yield
        finally:
            self._suspensions -= 1
            if place is not None:
                with _lifted(place):
                    self.apply()


@contextlib.contextmanager
def _lifted(place: int) -> Iterator[None]:
    """The adjustments applied from `place` on undone for a block, then applied again in their order."""
    later = _APPLIED[place:]
    for adjustment in reversed(later):
        adjustment._undo()
    try:
        yield
    finally:
        for adjustment in later:
            adjustment.apply()
