"""Megatron-Core as a first-class PyTorch Lightning citizen.

The public classes are imported on first use, so that `import lightning_megatron` (and its `_compat` leaf) stays
cheap for tools that need only part of it.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "MegatronStrategy": "lightning_megatron.strategy",
    "MegatronLightningModule": "lightning_megatron.contract",
    "SFTModule": "lightning_megatron.module",
    "MTPOnlyCallback": "lightning_megatron.callbacks",
    "WeightSync": "lightning_megatron.callbacks",
    "DraftProbe": "lightning_megatron.mtp.probe",
    "SFTDataModule": "lightning_megatron.data",
}

__all__ = list(_EXPORTS)


class _ShownWhereLoggingIsNotConfigured(logging.Handler):
    """Prints the package's records in a process that configured no logging, where Python's last resort would drop
    everything below WARNING; once the root logger has a handler (a user's, or Megatron's `basicConfig`), the
    records reach the user through it instead, so each is printed once either way."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            sys.stderr.write(self.format(record) + "\n")


# What the package logs at INFO is meant to be read (`cuda_graph: auto`'s one line: what is graphed, or why not);
# under the root logger's default WARNING it would never be made. `logging.getLogger("lightning_megatron")
# .setLevel(logging.WARNING)` silences it.
_logger = logging.getLogger(__name__)
_logger.setLevel(logging.INFO)
_logger.addHandler(_ShownWhereLoggingIsNotConfigured())


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lightning_megatron' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
