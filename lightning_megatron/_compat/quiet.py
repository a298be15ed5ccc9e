"""Import-time messages about conditions the rest of `_compat` handles, dropped so that every command starts quietly.

Each message reports a missing piece that the other adjustments already work around: torch's "No CUDA runtime is
found" (the CPU adjustments, `cpu.py`) and megatron-core's "Transformer Engine and Apex are not installed" (the
torch optimizers and the `no_te.py` adjustments). Only those exact messages from those exact modules are dropped;
every other warning and log record still shows. The commands install these before they import megatron-core.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
import warnings

from lightning_megatron._compat._adjustment import Adjustment, Patches
from lightning_megatron._compat.cpu import _no_cuda

# torch ------------------------------------------------------------------------------------------------------------

_CPP_EXTENSION = "torch.utils.cpp_extension"
_NO_CUDA_RUNTIME = "No CUDA runtime is found"


def _cpp_extension_would_report_no_cuda_runtime() -> bool:
    return _CPP_EXTENSION not in sys.modules and _no_cuda()


def _drop_no_cuda_runtime_record(patches: Patches) -> None:
    logger = logging.getLogger(_CPP_EXTENSION)

    def keep(record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING and str(record.msg).startswith(_NO_CUDA_RUNTIME))

    logger.addFilter(keep)
    patches.on_revert(lambda: logger.removeFilter(keep))


_TORCH_ADJUSTMENT = Adjustment(
    "torch.quiet_no_cuda_runtime",
    "torch/utils/cpp_extension.py:183 _find_cuda_home logs 'No CUDA runtime is found' at import (:364), which "
    "megatron/core/tensor_parallel/random.py:17 `from torch.utils.cpp_extension import load_inline` triggers",
    _cpp_extension_would_report_no_cuda_runtime,
    _drop_no_cuda_runtime_record,
)


# megatron-core ----------------------------------------------------------------------------------------------------

_NO_TE_OR_APEX = "Transformer Engine and Apex are not installed"
# the modules that warn: megatron.core.optimizer, .optimizer.optimizer, .optimizer.clip_grads and megatron_fsdp's
# mixed_precision (importable as megatron.core.distributed.fsdp.src.megatron_fsdp or as megatron_fsdp)
_WARNING_MODULES = r"(megatron\.core\.|megatron_fsdp\.)"


def _neither_transformer_engine_nor_apex() -> bool:
    return all(importlib.util.find_spec(name) is None for name in ("transformer_engine", "apex"))


def _ignore_no_te_or_apex_warnings(patches: Patches) -> None:
    warnings.filterwarnings("ignore", message=re.escape(_NO_TE_OR_APEX), category=UserWarning,
                            module=_WARNING_MODULES)
    entry = warnings.filters[0]

    def remove() -> None:
        if entry in warnings.filters:
            warnings.filters.remove(entry)
            warnings._filters_mutated()  # what filterwarnings itself calls: modules' cached decisions are stale

    patches.on_revert(remove)


_MEGATRON_CORE_ADJUSTMENT = Adjustment(
    "megatron_core.quiet_no_te_or_apex",
    "megatron/core/optimizer/__init__.py:25, optimizer/optimizer.py:29, optimizer/clip_grads.py:32, "
    "distributed/fsdp/src/megatron_fsdp/mixed_precision.py:115 warn 'Transformer Engine and Apex are not "
    "installed' at import (the torch fallbacks they announce are what runs)",
    _neither_transformer_engine_nor_apex,
    _ignore_no_te_or_apex_warnings,
)

ADJUSTMENTS = (_TORCH_ADJUSTMENT, _MEGATRON_CORE_ADJUSTMENT)
