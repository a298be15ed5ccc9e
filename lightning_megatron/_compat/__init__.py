"""The only code that knows CUDA or Transformer Engine is missing.

Every workaround is an `Adjustment`: applied only when its condition holds, idempotent, reversible (the tests show
each failure without it), and documented with the upstream file it works around. Nothing here imports the rest of
`lightning_megatron`.
"""

from __future__ import annotations

from lightning_megatron._compat import cpu
from lightning_megatron._compat._adjustment import Adjustment


def prepare_megatron_core() -> list[str]:
    """Make Megatron-Core runnable on this machine (a no-op with CUDA); returns the names of the active adjustments."""
    return [adjustment.name for adjustment in cpu.ADJUSTMENTS if adjustment.apply()]


__all__ = ["Adjustment", "prepare_megatron_core"]
