"""`LoRACallback`: LoRA adapters on a frozen model, added before Megatron wraps it (`lightning_megatron.lora`)."""

from __future__ import annotations

from typing import override

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn

from lightning_megatron.callbacks.mtp_only import MTPOnlyCallback
from lightning_megatron.contract import MegatronStrategyContract, megatron_strategy
from lightning_megatron.lora import DEFAULT_TARGET_MODULES, LoRAConfig, add_lora_adapters, check_lora_supported


class LoRACallback(pl.Callback):
    """Train LoRA adapters on a frozen model; arguments are `LoRAConfig`'s.

    Needs `MegatronStrategy(bridge_type="megatron-bridge")`. Export afterwards with `lora.export_lora_adapter` or
    `lora.export_lora_merged`.
    """

    def __init__(
        self,
        target_modules: list[str] | None = None,
        rank: int = 8,
        alpha: int = 16,
        dropout: float = 0.0,
    ) -> None:
        self.config = LoRAConfig(
            target_modules=list(DEFAULT_TARGET_MODULES) if target_modules is None else list(target_modules),
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
