"""What a model is asked to be beyond its HF config: the options every room reads, and nothing else.

A leaf: it imports nothing of `lightning_megatron`, so the bridges, the strategy, the module and the CLI can all
name these types without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

BridgeType = Literal["mbridge", "megatron-bridge"]
AttentionBackend = Literal["auto", "sdpa", "local"]
ATTENTION_BACKENDS: tuple[AttentionBackend, ...] = ("auto", "sdpa", "local")


@dataclass(frozen=True)
class ModelOptions:
    """What the Megatron model should be beyond what the HF config says.

    `mtp`: keep the checkpoint's MTP head (`False` drops it, and an export then declares zero MTP layers).
    `attention_backend`: the core attention of every layer (MTP included): "sdpa" (PyTorch's fused kernels,
    `attention.SDPAttention`), "local" (Megatron-Core's `DotProductAttention`), or "auto" (SDPA without Transformer
    Engine, Transformer Engine's own attention with it).
    `config_overrides`: any `TransformerConfig` field (dropout, recompute, fusions, ...).
    `random_weights`: Megatron's random initialization instead of the checkpoint's weights (benchmarks of a
    shape no checkpoint exists for: only config.json is needed).
    """

    params_dtype: torch.dtype = torch.float32
    mtp: bool = False
    mtp_loss_scaling_factor: float = 0.1
    mtp_detach_heads: bool = False
    sequence_parallel: bool = False
    attention_backend: AttentionBackend = "auto"
    config_overrides: dict[str, Any] = field(default_factory=dict)
    random_weights: bool = False
