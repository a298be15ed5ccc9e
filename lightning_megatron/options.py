"""What a model is asked to be beyond its HF config: the options every room reads, and nothing else.

A leaf: it imports nothing of `lightning_megatron`, so the bridges, the strategy, the module and the CLI can all
name these types without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

BridgeType = Literal["mbridge", "megatron-bridge"]
AttentionBackend = Literal["auto", "sdpa", "local"]
ATTENTION_BACKENDS: tuple[AttentionBackend, ...] = ("auto", "sdpa", "local")


@dataclass(frozen=True)
class ModelOptions:
    """What the Megatron model should be beyond what the HF config says.

    `mtp`: keep the checkpoint's MTP head (`False` drops it, and an export then declares zero MTP layers).
    `mtp_depths`: the drafting depths the MTP head runs at (K): the checkpoint's one MTP layer applied K times, each
    depth reading the previous depth's output (Megatron-Core's `mtp_num_layers = K` with `mtp_use_repeated_layer`);
    one set of weights, so an export still writes one MTP layer.
    `attention_backend`: the core attention of every layer (MTP included): "sdpa" (PyTorch's fused kernels,
    `attention.SDPAttention`), "local" (Megatron-Core's `DotProductAttention`), or "auto" (SDPA without Transformer
    Engine, Transformer Engine's own attention with it).
    `config_overrides`: any `TransformerConfig` field (dropout, recompute, fusions, ...).
    `random_weights`: Megatron's random initialization instead of the checkpoint's weights (benchmarks of a
    shape no checkpoint exists for: only config.json is needed).
    """

    params_dtype: torch.dtype = torch.float32
    mtp: bool = False
    mtp_depths: int = 1
    mtp_loss_scaling_factor: float = 0.1
    mtp_detach_heads: bool = False
    sequence_parallel: bool = False
    attention_backend: AttentionBackend = "auto"
    config_overrides: dict[str, Any] = field(default_factory=dict)
    random_weights: bool = False

    def under_strategy(self, *, precision: str, sequence_parallel: bool,
                       attention_backend: AttentionBackend) -> ModelOptions:
        """These options with what `MegatronStrategy` decides: the parameters' dtype, sequence parallelism, the core
        attention, and `TransformerConfig` fields of its own (the module's `config_overrides` win)."""
        overrides: dict[str, Any] = {"calculate_per_token_loss": True}  # token-weighted over microbatches and DP x CP
        if precision == "fp32":
            # megatron-core's fused ("native") cross-entropy returns bf16 logit gradients whatever the dtype
            # (fusions/fused_cross_entropy.py:73); megatron-bridge turns it on by default
            overrides["cross_entropy_loss_fusion"] = False
        return replace(self, params_dtype=torch.bfloat16 if precision == "bf16" else torch.float32,
                       sequence_parallel=sequence_parallel, attention_backend=attention_backend,
                       config_overrides={**overrides, **self.config_overrides})


def check_strategy_options(*, tensor_model_parallel_size: int, pipeline_model_parallel_size: int,
                           virtual_pipeline_model_parallel_size: int | None, context_parallel_size: int,
                           expert_model_parallel_size: int, sequence_parallel: bool, micro_batch_size: int,
                           global_batch_size: int | None, precision: str, attention_backend: str, clip_grad: float,
                           timeout_minutes: int) -> None:
    """`MegatronStrategy`'s own checks of its arguments, before anything runs; each error names the option."""
    _check_positive(tensor_model_parallel_size=tensor_model_parallel_size,
                    pipeline_model_parallel_size=pipeline_model_parallel_size,
                    context_parallel_size=context_parallel_size,
                    expert_model_parallel_size=expert_model_parallel_size, micro_batch_size=micro_batch_size,
                    timeout_minutes=timeout_minutes)
    if virtual_pipeline_model_parallel_size is not None:
        _check_positive(virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size)
        if pipeline_model_parallel_size == 1:
            raise ValueError("virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1; "
                             "leave it unset (null) without pipeline parallelism")
    if context_parallel_size > 1 and attention_backend == "local":
        raise ValueError("context_parallel_size > 1 needs attention_backend: sdpa or auto (Megatron-Core's local "
                         "DotProductAttention has no context parallelism)")
    if sequence_parallel and tensor_model_parallel_size == 1:
        raise ValueError("sequence_parallel: true needs tensor_model_parallel_size > 1")
    if global_batch_size is not None:
        _check_positive(global_batch_size=global_batch_size)
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision: {precision!r} is not one of 'bf16', 'fp32'")
    if clip_grad < 0:
        raise ValueError(f"clip_grad: {clip_grad} must be >= 0 (0 disables clipping)")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: {value!r} must be a positive integer")


def check_trainer_options(trainer: Any) -> None:
    """Raise on Lightning Trainer options that MegatronStrategy replaces with its own, naming the one to set."""
    if trainer.gradient_clip_val:
        raise ValueError("Trainer(gradient_clip_val=...) is not used with MegatronStrategy: Megatron's optimizer "
                         "clips; set MegatronStrategy(clip_grad=...) instead")
    if trainer.accumulate_grad_batches != 1:
        raise ValueError("Trainer(accumulate_grad_batches=...) is not used with MegatronStrategy: set "
                         "MegatronStrategy(global_batch_size=...) and Megatron accumulates the microbatches")
    if trainer.precision != "32-true":
        raise ValueError(f"Trainer(precision={trainer.precision!r}) is not used with MegatronStrategy: set "
                         "MegatronStrategy(precision='bf16' or 'fp32') and leave the Trainer's precision unset")
