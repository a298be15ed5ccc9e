"""Megatron-Core as a first-class PyTorch Lightning citizen.

The public classes are imported on first use, so that `import lightning_megatron` (and its `_compat` leaf) stays
cheap for tools that need only part of it.
"""

from __future__ import annotations

import importlib
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


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lightning_megatron' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
