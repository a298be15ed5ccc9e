"""The only code that knows CUDA or Transformer Engine is missing.

Every workaround is an `Adjustment`: applied only when its condition holds, idempotent, reversible (the tests show
each failure without it), and documented with the upstream file it works around. Nothing here imports the rest of
`lightning_megatron` but the family table (`lightning_megatron.families`, a leaf), whose HF names the
megatron-bridge mappings read.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from lightning_megatron._compat import (
    context_parallel,
    cpu,
    deepseek,
    fast_cross_entropy,
    fast_rms_norm,
    fast_rope,
    fast_swiglu,
    fused_adam,
    gated_delta_net,
    grouped_experts,
    mbridge,
    moe,
    moe_permutation,
    mtp_stage,
    no_te,
    packed_mtp_roll,
    packed_rope,
    peft,
    quiet,
    root_logger,
    vl,
)
from lightning_megatron._compat._adjustment import Adjustment
from lightning_megatron._compat.kept_tracebacks import imports_keeping_no_frames


def prepare_megatron_core() -> list[str]:
    """Make Megatron-Core runnable on this machine; returns the names of the active adjustments.

    The CPU adjustments apply only without CUDA; the no-Apex/TE ones wherever those are missing (GPU machine too);
    megatron-core's notice that its own checkpoint writer is deprecated is dropped wherever it still logs it. The
    compiled RMSNorm comes last: it swaps the class of the norm the earlier `WrappedTorchNorm` adjustments built.
    """
    adjustments = (*cpu.ADJUSTMENTS, *no_te.MEGATRON_CORE_ADJUSTMENTS, *fused_adam.ADJUSTMENTS,
                   *context_parallel.ADJUSTMENTS,
                   *moe.MEGATRON_CORE_ADJUSTMENTS, *grouped_experts.MEGATRON_CORE_ADJUSTMENTS,
                   *moe_permutation.MEGATRON_CORE_ADJUSTMENTS,
                   *packed_rope.ADJUSTMENTS, *fast_rope.ADJUSTMENTS, *fast_cross_entropy.ADJUSTMENTS,
                   *fast_swiglu.ADJUSTMENTS, *packed_mtp_roll.ADJUSTMENTS, *mtp_stage.ADJUSTMENTS,
                   *quiet.SAVE_ADJUSTMENTS, *gated_delta_net.ADJUSTMENTS, *fast_rms_norm.ADJUSTMENTS)
    return [adjustment.name for adjustment in adjustments if adjustment.apply()]


def quiet_handled_warnings() -> list[str]:
    """Drop the warnings and log records about what `_compat` handles (no CUDA runtime, no Transformer Engine or
    Apex) and the libraries' notices to each other that a user cannot act on (`quiet.py`); returns the names of the
    active adjustments. Commands call it first, before anything imports megatron-core."""
    return [adjustment.name for adjustment in quiet.ADJUSTMENTS if adjustment.apply()]


def import_megatron_bridge() -> ModuleType:
    """`megatron.bridge`, importable and using local layer specs when Transformer Engine is missing.

    Needs no CUDA adjustment itself; on CPU also call `prepare_megatron_core()` before building models. Its first
    import keeps no frame of the caller (`kept_tracebacks.py`): a fit that imports it would otherwise never be freed.
    """
    with imports_keeping_no_frames():  # the adjustments import parts of megatron-bridge already
        for adjustment in (*quiet.BRIDGE_IMPORT_ADJUSTMENTS, *root_logger.ADJUSTMENTS,
                           *no_te.MEGATRON_BRIDGE_ADJUSTMENTS, *vl.MEGATRON_BRIDGE_ADJUSTMENTS,
                           *moe.MEGATRON_BRIDGE_ADJUSTMENTS, *deepseek.MEGATRON_BRIDGE_ADJUSTMENTS):
            adjustment.apply()
        return importlib.import_module("megatron.bridge")


def import_mbridge() -> ModuleType:
    """`mbridge`, working against megatron-core 0.19 and transformers 5, with local layer specs when TE is missing."""
    for adjustment in (*mbridge.ADJUSTMENTS, *moe.MBRIDGE_ADJUSTMENTS):
        adjustment.apply()
    return importlib.import_module("mbridge")


def import_peft() -> ModuleType:
    """`peft`, loading adapters written against per-expert names onto transformers 5's fused MoE models with the
    shared experts' and dense MLPs' adapters applied too (`peft.py`)."""
    for adjustment in peft.ADJUSTMENTS:
        adjustment.apply()
    return importlib.import_module("peft")


__all__ = ["Adjustment", "import_mbridge", "import_megatron_bridge", "import_peft", "prepare_megatron_core",
           "quiet_handled_warnings"]
