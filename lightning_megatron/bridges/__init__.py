"""Bridge backends: HF checkpoints in and out of Megatron-Core, behind one small protocol (`base.Bridge`).

Each backend module registers its class by name (`@base.register_backend`) and declares on it what it can do
(`supports_mtp_training`, `supports_lora`, `supports_vl`, `moe_model_types`, `reads_model_config_before_build`); a
method a backend cannot serve refuses, naming the backends that can. This factory is the one place a `bridge_type`
string is looked up: everywhere else a capability is asked of the bridge or its registered class.
"""

from __future__ import annotations

from pathlib import Path

from lightning_megatron.bridges import mbridge, megatron_bridge
from lightning_megatron.bridges.base import Bridge, BridgeError, capable_backends, registered_backends
from lightning_megatron.options import BridgeType, ModelOptions

# The backends register themselves when their modules are imported (above); their libraries load only at build.
BACKEND_MODULES = (mbridge, megatron_bridge)


def backend_class(bridge_type: BridgeType | str) -> type[Bridge]:
    """The backend class registered as `bridge_type`, for asking its capabilities before a bridge is built."""
    backends = registered_backends()
    if bridge_type not in backends:
        raise BridgeError(f"bridge_type: {bridge_type!r} is not one of {', '.join(map(repr, backends))}")
    return backends[bridge_type]


def create_bridge(bridge_type: BridgeType | str, hf_path: str | Path, *, trust_remote_code: bool = False) -> Bridge:
    """The backend named by `bridge_type` for one HF checkpoint; it imports its library when it builds a model."""
    return backend_class(bridge_type)(hf_path, trust_remote_code=trust_remote_code)


__all__ = ["Bridge", "BridgeError", "BridgeType", "ModelOptions", "backend_class", "capable_backends",
           "create_bridge", "registered_backends"]
