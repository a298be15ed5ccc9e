"""Messages about conditions the package handles, dropped so that commands and fits run quietly.

At import (`ADJUSTMENTS`), each reports a missing piece that the other adjustments already work around: torch's "No
CUDA runtime is found" (the CPU adjustments, `cpu.py`) and megatron-core's "Transformer Engine and Apex are not
installed" (the torch optimizers and the `no_te.py` adjustments); the commands install these before they import
megatron-core. At the first checkpoint save (`SAVE_ADJUSTMENTS`, installed by `prepare_megatron_core`),
megatron-core's "MCore's async save is deprecated ... set `async_strategy` to `nvrx`": its own synchronous save
writes through that writer (`TorchDistSaveShardedStrategy.save` calls `async_save(..., async_strategy="mcore")`), so
every save logs it, and the package's background saves use that writer too (nvidia-resiliency-ext is no
dependency), so the advice is nothing a user can follow. Only those exact messages from those exact modules are
dropped; every other warning and log record still shows.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import re
import sys
import warnings

from lightning_megatron._compat._adjustment import Adjustment, Patches
from lightning_megatron._compat.cpu import no_cuda

# torch ------------------------------------------------------------------------------------------------------------

_CPP_EXTENSION = "torch.utils.cpp_extension"
_NO_CUDA_RUNTIME = "No CUDA runtime is found"


def _cpp_extension_would_report_no_cuda_runtime() -> bool:
    return _CPP_EXTENSION not in sys.modules and no_cuda()


def _drop_warning_records(patches: Patches, logger_name: str, message_start: str) -> None:
    """Drop `logger_name`'s WARNING records whose message starts with `message_start`."""
    logger = logging.getLogger(logger_name)

    def keep(record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING and str(record.msg).startswith(message_start))

    logger.addFilter(keep)
    patches.on_revert(lambda: logger.removeFilter(keep))


def _drop_no_cuda_runtime_record(patches: Patches) -> None:
    _drop_warning_records(patches, _CPP_EXTENSION, _NO_CUDA_RUNTIME)


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


# megatron-core's checkpoint saves -------------------------------------------------------------------------------

_TORCH_DIST_STRATEGY = "megatron.core.dist_checkpointing.strategies.torch"
MCORE_ASYNC_SAVE_DEPRECATED = "MCore's async save is deprecated"


def _save_logs_the_mcore_async_notice() -> bool:
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return MCORE_ASYNC_SAVE_DEPRECATED in inspect.getsource(TorchDistSaveShardedStrategy.async_save)


def _drop_mcore_async_notice(patches: Patches) -> None:
    _drop_warning_records(patches, _TORCH_DIST_STRATEGY, MCORE_ASYNC_SAVE_DEPRECATED)


_SAVE_ADJUSTMENT = Adjustment(
    "megatron_core.quiet_mcore_async_save_notice",
    "megatron/core/dist_checkpointing/strategies/torch.py:749 logs 'MCore's async save is deprecated ... setting "
    "`async_strategy` to `nvrx`' at the first save of a process; the synchronous save itself writes through that "
    "writer (:727, in `save`, calls `async_save(..., async_strategy=\"mcore\")`), the package's background save "
    "uses it too, and nvidia-resiliency-ext is no dependency",
    _save_logs_the_mcore_async_notice,
    _drop_mcore_async_notice,
)

SAVE_ADJUSTMENTS = (_SAVE_ADJUSTMENT,)
