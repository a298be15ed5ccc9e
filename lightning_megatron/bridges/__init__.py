"""Bridge backends: HF checkpoints in and out of Megatron-Core, behind one small protocol (`base.Bridge`)."""

from __future__ import annotations

from pathlib import Path

from lightning_megatron.bridges.base import Bridge, BridgeError
from lightning_megatron.options import BridgeType, ModelOptions


def create_bridge(bridge_type: BridgeType, hf_path: str | Path, *, trust_remote_code: bool = False) -> Bridge:
    """The backend named by `bridge_type` for one HF checkpoint; imports only that backend's library."""
    if bridge_type == "mbridge":
        from lightning_megatron.bridges.mbridge import MBridge

        return MBridge(hf_path, trust_remote_code=trust_remote_code)
    if bridge_type == "megatron-bridge":
        from lightning_megatron.bridges.megatron_bridge import MegatronBridge

        return MegatronBridge(hf_path, trust_remote_code=trust_remote_code)
    raise BridgeError(f"bridge_type: {bridge_type!r} is not one of 'mbridge', 'megatron-bridge'")


__all__ = ["Bridge", "BridgeError", "BridgeType", "ModelOptions", "create_bridge"]
