"""megatron-bridge (NVIDIA): the backend for MTP training, LoRA and newer architectures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_megatron._compat import import_megatron_bridge
from lightning_megatron.attention import with_core_attention
from lightning_megatron.bridges.base import Bridge, apply_parallel_state, register_backend
from lightning_megatron.bridges.sliced_load import load_megatron_bridge
from lightning_megatron.bridges.vl import prepare_vl_provider
from lightning_megatron.hf_io import LoadReport
from lightning_megatron.moe import router_settings
from lightning_megatron.mtp.parameters import check_mtp_training_versions
from lightning_megatron.options import ModelOptions


@register_backend
class MegatronBridge(Bridge):
    name = "megatron-bridge"
    supports_mtp_training = True
    supports_lora = True
    supports_vl = True
    moe_model_types = ("qwen3_moe", "glm4_moe")
    reads_model_config_before_build = True

    def __init__(self, hf_path: str | Path, *, trust_remote_code: bool = False) -> None:
        super().__init__(hf_path, trust_remote_code=trust_remote_code)
        self._auto_bridge: Any = None

    def validate(self, options: ModelOptions) -> None:
        super().validate(options)
        if options.mtp:
            check_mtp_training_versions()

    @property
    def auto_bridge(self) -> Any:
        """megatron-bridge's `AutoBridge` for this checkpoint (weights are streamed from safetensors on load)."""
        if self._auto_bridge is None:
            auto_bridge_class = import_megatron_bridge().AutoBridge
            self._auto_bridge = auto_bridge_class.from_hf_pretrained(
                str(self.hf_path), trust_remote_code=self.trust_remote_code
            )
        return self._auto_bridge

    def router_updates_expert_bias(self, options: ModelOptions) -> bool:
        # the provider's fields, then the checkpoint's router settings (`moe`), then the options' overrides
        fields = {**router_settings(self.hf_config), **options.config_overrides}
        provider = self.auto_bridge.to_megatron_provider(load_weights=False)
        enabled = fields.get("moe_router_enable_expert_bias",
                             getattr(provider, "moe_router_enable_expert_bias", False))
        return bool(enabled) and fields.get("moe_router_bias_update_rate", provider.moe_router_bias_update_rate) > 0

    def export_adapter_weights(self, chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.auto_bridge.export_adapter_weights(chunks, cpu=True, show_progress=False)

    def _build(self, options: ModelOptions, *, load_weights: bool) -> list[torch.nn.Module]:
        provider = self.auto_bridge.to_megatron_provider(load_weights=False)
        apply_parallel_state(provider, options)
        provider.params_dtype = provider.pipeline_dtype = options.params_dtype
        provider.bf16 = options.params_dtype == torch.bfloat16
        provider.fp16 = options.params_dtype == torch.float16
        provider.perform_initialization = not load_weights  # weights about to be overwritten need no random init
        if options.mtp:
            provider.mtp_loss_scaling_factor = options.mtp_loss_scaling_factor
            provider.mtp_detach_heads = options.mtp_detach_heads
            if options.mtp_depths > 1:  # one layer object (`mtp.layers.0`): loaded from and exported to one HF layer
                provider.mtp_num_layers, provider.mtp_use_repeated_layer = options.mtp_depths, True
        else:
            provider.mtp_num_layers = None
        for key, value in options.config_overrides.items():
            setattr(provider, key, value)
        # The MTP block spec is built from this layer spec, so the MTP layer gets the same attention.
        layer_spec = provider.transformer_layer_spec
        provider.transformer_layer_spec = with_core_attention(layer_spec, options.attention_backend)
        prepare_vl_provider(provider, self.hf_config, options.attention_backend)
        provider.finalize()
        chunks = provider.provide_distributed_model(
            wrap_with_ddp=False, mixed_precision_wrapper=None, use_cpu_initialization=not torch.cuda.is_available()
        )
        if load_weights:
            self.load_hf_weights(chunks)
        return chunks

    def load_hf_weights(self, chunks: list[torch.nn.Module], hf_path: str | Path | None = None, *,
                        sliced: bool = True) -> LoadReport:
        if not sliced:
            self.auto_bridge.load_hf_weights(chunks, None if hf_path is None else str(hf_path))
            return LoadReport(library=True)
        pretrained = self.auto_bridge.hf_pretrained if hf_path is None else (
            self.auto_bridge._pretrained_wrapper_cls.from_pretrained(str(hf_path),
                                                                     trust_remote_code=self.trust_remote_code))
        return load_megatron_bridge(self.auto_bridge, chunks, hf_path or self.hf_path, pretrained)

    def export_hf_weights(self, chunks: list[torch.nn.Module], *, on_host: bool = True
                          ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.auto_bridge.export_hf_weights(chunks, cpu=on_host, show_progress=False):
            yield name, tensor
