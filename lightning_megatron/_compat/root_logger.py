"""megatron-bridge imports `megatron.training.training`, which calls `logging.basicConfig(level=logging.INFO)` when
imported (`megatron/training/training.py:36`). In a process that had not configured logging, every library's INFO
records (Megatron-Core's whole optimizer and DDP configs among them) go to stdout from then on. This adjustment
imports that module itself and gives the root logger back the level it had; its handler stays (it is also what
prints WARNING and above)."""

from __future__ import annotations

import importlib
import logging
import sys

from lightning_megatron._compat._adjustment import Adjustment, Patches

_MODULE = "megatron.training.training"


def _import_would_configure_logging() -> bool:
    return _MODULE not in sys.modules and not logging.getLogger().handlers


def _import_keeping_the_root_level(patches: Patches) -> None:
    root = logging.getLogger()
    level = root.level
    importlib.import_module(_MODULE)
    if root.level != level:
        changed_to = root.level
        root.setLevel(level)
        patches.on_revert(lambda: root.setLevel(changed_to))


ADJUSTMENTS = (
    Adjustment(
        "megatron_training.root_logger_level",
        "megatron/training/training.py:36 logging.basicConfig(level=INFO) at import turns on every library's INFO",
        _import_would_configure_logging,
        _import_keeping_the_root_level,
    ),
)
