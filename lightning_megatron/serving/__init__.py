"""Serving the trained weights: send them to an inference engine (disk, colocated, collective) and a stand-in engine.

`lightning_megatron.callbacks.WeightSync` drives these from a training run; nothing here knows Lightning.
"""

from lightning_megatron.serving.disk import read_latest, served_version
from lightning_megatron.serving.protocol import WeightSyncError
from lightning_megatron.serving.receiver import WeightReceiver
from lightning_megatron.serving.sender import CollectiveSender, ColocatedSender, SyncReport

__all__ = ["CollectiveSender", "ColocatedSender", "SyncReport", "WeightReceiver", "WeightSyncError", "read_latest",
           "served_version"]
