"""Callbacks that shape what Megatron trains (they run before the model is wrapped) or report on it."""

from lightning_megatron.callbacks.continuations import ContinuationWriter
from lightning_megatron.callbacks.export import HFExport
from lightning_megatron.callbacks.garbage_collection import ManualGarbageCollection
from lightning_megatron.callbacks.monitoring import TokensPerSecond, TrainingCurves
from lightning_megatron.callbacks.mtp_only import MTPOnlyCallback
from lightning_megatron.callbacks.weight_sync import WeightSync
from lightning_megatron.preemption import PreemptionCheckpoint

__all__ = ["ContinuationWriter", "HFExport", "ManualGarbageCollection", "MTPOnlyCallback", "PreemptionCheckpoint", "TokensPerSecond", "TrainingCurves", "WeightSync"]
