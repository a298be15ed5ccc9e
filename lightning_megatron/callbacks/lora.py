"""`LoRACallback`: LoRA adapters on a frozen model, added before Megatron wraps it (`lightning_megatron.lora`)."""

from __future__ import annotations

from typing import Literal, override

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn

from lightning_megatron.callbacks.mtp_only import MTPOnlyCallback
from lightning_megatron.contract import MegatronStrategyContract, megatron_strategy
from lightning_megatron.lora import DEFAULT_TARGET_MODULES, LoRAConfig, add_lora_adapters, check_lora_supported


class LoRACallback(pl.Callback):
    """Train LoRA adapters on a frozen model: `W x + (alpha / rank) * B A x`, with `B` starting at zero.

    Needs `MegatronStrategy(bridge_type="megatron-bridge")`. Export afterwards with `lora.export_lora_adapter` or
    `lora.export_lora_merged`. The arguments are `lora.LoRAConfig`'s, checked when the callback is made.

    Args:
        target_modules: the linears that get adapters: module names (`linear_qkv`) or wildcard patterns over full
            names (`*.layers.0.*.linear_qkv`; layer numbers are local to the pipeline stage). Null (default): every
            attention and MLP linear, `linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2` (experts and the MTP
            layer included); multi-latent attention and gated DeltaNet layers name theirs otherwise, and a name that
            matches no linear of the model is refused, listing the model's. "all-linear" (PEFT's word): every linear
            of the transformer layers by the names the built model gives them, whatever the family, the MTP layer's
            `eh_proj` included; not the LM head (`lora.LoRAConfig`).
        rank: the adapters' rank (a positive integer).
        alpha: the adapters' scale is alpha / rank (> 0).
        dropout: dropout on the adapters' input while training, in [0, 1).
    """

    def __init__(
        self,
        target_modules: list[str] | Literal["all-linear"] | None = None,
        rank: int = 8,
        alpha: int = 16,
        dropout: float = 0.0,
    ) -> None:
        self.config = LoRAConfig(
            target_modules=list(DEFAULT_TARGET_MODULES) if target_modules is None else (
                target_modules if isinstance(target_modules, str) else list(target_modules)),
            rank=rank, alpha=alpha, dropout=dropout,
        )
        self._hooked_strategy: MegatronStrategyContract | None = None

    def validate_megatron_setup(self, strategy: MegatronStrategyContract, module: pl.LightningModule) -> None:
        """Called by MegatronStrategy before the model is built, so a bad combination costs no weight loading."""
        mtp_only = any(isinstance(callback, MTPOnlyCallback) for callback in module.trainer.callbacks)
        check_lora_supported(strategy.bridge, mtp_only)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = megatron_strategy(trainer, "LoRACallback")
        self.validate_megatron_setup(strategy, pl_module)
        if self._hooked_strategy is strategy:
            return  # the strategy keeps its hooks across fit / validate / test
        self._hooked_strategy = strategy
        strategy.register_pre_wrap_hook(
            lambda chunks: add_lora_adapters(chunks, self.config, training=trainer.state.fn == TrainerFn.FITTING)
        )
