"""mbridge: the default backend, for HF load and save of dense models without MTP training or LoRA."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_megatron._compat import import_mbridge
from lightning_megatron.attention import with_core_attention
from lightning_megatron.bridges.base import Bridge, BridgeError, register_backend
from lightning_megatron.bridges.sliced_load import load_mbridge
from lightning_megatron.families import rope_parameters
from lightning_megatron.hf_io import LoadReport
from lightning_megatron.options import ModelOptions

_PLAIN_ROPE_TYPES = ("default", "mrope")  # RoPE without scaling (Qwen2.5-VL's config names its sections `mrope`)


@register_backend
class MBridge(Bridge):
    name = "mbridge"
    supports_mtp_training = False
    supports_lora = False
    supports_vl = False
    moe_model_types = ("qwen3_moe", "qwen2_moe")

    def __init__(self, hf_path: str | Path, *, trust_remote_code: bool = False) -> None:
        super().__init__(hf_path, trust_remote_code=trust_remote_code)
        self._auto_bridge: Any = None

    def validate(self, options: ModelOptions) -> None:
        super().validate(options)
        rope_type = rope_parameters(self.hf_config)["rope_type"]
        if rope_type not in _PLAIN_ROPE_TYPES:
            raise BridgeError(
                f"{self.hf_path / 'config.json'}: bridge_type: mbridge builds plain RoPE and would not scale it as the "
                f"checkpoint's rope_scaling (rope_type: {rope_type!r}) asks: its models read only a `factor` "
                "(mbridge/models/llama.py:80, a linear interpolation), so the model would differ from the checkpoint; "
                "set bridge_type: megatron-bridge")

    def _build(self, options: ModelOptions, *, load_weights: bool) -> list[torch.nn.Module]:
        # mbridge reads the parallel state (virtual pipeline included) when its bridge is created: create it per build.
        self._auto_bridge = import_mbridge().AutoBridge.from_pretrained(
            str(self.hf_path), dtype=options.params_dtype, trust_remote_code=self.trust_remote_code
        )
        # Every mbridge model builds its layer specs here; set on the instance, it reaches only this build.
        build_spec = self._auto_bridge._get_transformer_layer_spec
        self._auto_bridge._get_transformer_layer_spec = with_core_attention(build_spec, options.attention_backend)
        on_cpu = not torch.cuda.is_available()
        self._auto_bridge.set_extra_args(
            use_cpu_initialization=on_cpu,
            perform_initialization=not load_weights,
            sequence_parallel=options.sequence_parallel,
            **options.config_overrides,
        )
        chunks = self._auto_bridge.get_model(
            wrap_with_ddp=False,
            bf16=False,
            fp16=False,
            use_cpu_initialization=on_cpu,
        )
        if load_weights:
            self.load_hf_weights(chunks)
        return chunks

    def load_hf_weights(self, chunks: list[torch.nn.Module], hf_path: str | Path | None = None, *,
                        sliced: bool = True) -> LoadReport:
        if not sliced:
            self._auto_bridge.load_weights(chunks, str(hf_path or self.hf_path))
            return LoadReport(library=True)
        return load_mbridge(self._auto_bridge, chunks, hf_path or self.hf_path)

    def export_hf_weights(self, chunks: list[torch.nn.Module], *, on_host: bool = True,
                          only: Collection[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._auto_bridge.export_weights(chunks):  # every tensor: mbridge cannot select
            if only is None or name in only:
                yield name, tensor.cpu() if on_host else tensor
