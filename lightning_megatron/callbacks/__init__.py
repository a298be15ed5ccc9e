"""Every Lightning callback of the package: those that shape what Megatron trains (they run before the model is
wrapped), and those that report on it, export it or stop it cleanly."""

from lightning_megatron.callbacks.continuations import ContinuationWriter
from lightning_megatron.callbacks.export import HFExport
from lightning_megatron.callbacks.garbage_collection import ManualGarbageCollection
from lightning_megatron.callbacks.lora import LoRACallback
from lightning_megatron.callbacks.monitoring import TokensPerSecond, TrainingCurves
from lightning_megatron.callbacks.mtp_only import MTPOnlyCallback
from lightning_megatron.callbacks.preemption import PreemptionCheckpoint
from lightning_megatron.callbacks.weight_sync import WeightSync

__all__ = ["ContinuationWriter", "HFExport", "LoRACallback", "ManualGarbageCollection", "MTPOnlyCallback",
           "PreemptionCheckpoint", "TokensPerSecond", "TrainingCurves", "WeightSync"]
