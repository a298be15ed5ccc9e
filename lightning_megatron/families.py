"""One declarative table per model family: what the rest of the package must know about each HF layout.

A leaf: it imports nothing of `lightning_megatron`.
"""

from __future__ import annotations

from typing import Any

# The config keys under which model families declare their MTP layers.
MTP_CONFIG_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")


def checkpoint_mtp_layers(hf_config: dict[str, Any]) -> int:
    """How many MTP layers an HF config declares (0 when none), whatever key its family uses."""
    return max((int(hf_config.get(key) or 0) for key in MTP_CONFIG_KEYS), default=0)
