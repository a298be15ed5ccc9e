"""megatron-bridge (NVIDIA): the backend for MTP training, LoRA and newer architectures."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_megatron._compat import import_megatron_bridge
from lightning_megatron.attention import with_core_attention
from lightning_megatron.bridges.base import Bridge, BridgeError, apply_parallel_state, register_backend
from lightning_megatron.bridges.language_model import language_model_auto_bridge, use_text_config
from lightning_megatron.bridges.sliced_load import load_megatron_bridge
from lightning_megatron.bridges.vl import prepare_vl_provider
from lightning_megatron.distributed import cpu_group
from lightning_megatron.families import MTP_MODEL_TYPES, language_model, mtp_names, rope_parameters
from lightning_megatron.hf_io import LoadReport, read_json
from lightning_megatron.moe import router_settings
from lightning_megatron.mtp.parameters import check_mtp_training_versions
from lightning_megatron.options import ModelOptions


@register_backend
class MegatronBridge(Bridge):
    name = "megatron-bridge"
    supports_mtp_training = True
    supports_lora = True
    supports_vl = True
    exports_selected_tensors = True
    moe_model_types = ("qwen3_moe", "glm4_moe", "deepseek_v3", "qwen3_5_moe_text", "qwen3_5_moe")
    linear_attention_model_types = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")
    reads_model_config_before_build = True

    def __init__(self, hf_path: str | Path, *, trust_remote_code: bool = False) -> None:
        super().__init__(hf_path, trust_remote_code=trust_remote_code)
        self._auto_bridge: Any = None
        self._tasks: tuple[tuple[int, ...], list[Any]] | None = None
        self._adapter_exporter: tuple[tuple[int, ...], Any] | None = None

    def validate(self, options: ModelOptions) -> None:
        super().validate(options)
        if options.mtp:
            check_mtp_training_versions()

    @property
    def auto_bridge(self) -> Any:
        """megatron-bridge's `AutoBridge` for this checkpoint (weights are streamed from safetensors on load); for a
        multimodal checkpoint trained as its text model, the text bridge's (`bridges.language_model`)."""
        if self._auto_bridge is None:
            auto_bridge_class = import_megatron_bridge().AutoBridge
            layout = language_model(self.hf_config)
            if layout is not None:
                self._auto_bridge = language_model_auto_bridge(auto_bridge_class, self.hf_path, self.hf_config, layout,
                                                               trust_remote_code=self.trust_remote_code)
            else:
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

    def export_adapter_weights(self, chunks: list[torch.nn.Module], *, on_host: bool = True
                               ) -> Iterator[tuple[str, torch.Tensor]]:
        # `AutoBridge.export_adapter_weights` asks a new model bridge each time, which walks every parameter and
        # gathers the adapters' names across pipeline stages before the first tensor; one kept for these chunks
        # remembers what it found (megatron-bridge caches it on the instance)
        key = _chunks_key(chunks)
        if self._adapter_exporter is None or self._adapter_exporter[0] != key:
            self._adapter_exporter = (key, self.auto_bridge._model_bridge)
        yield from self._adapter_exporter[1].stream_adapter_weights_megatron_to_hf(chunks, cpu=on_host,
                                                                                   show_progress=False)

    def adapted_hf_modules(self, chunks: list[torch.nn.Module]) -> list[str]:
        # the tasks `export_adapter_weights` streams, before any of them gathers its tensors (names: across PP)
        tasks = self.auto_bridge._model_bridge.build_adapter_conversion_tasks(chunks)
        names = {task.linear_in_task.mapping.hf_param for base in tasks.values() for task in base}
        return sorted(name.rsplit(".lora_", 1)[0] for name in names if name is not None)

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
        rope = rope_parameters(self.hf_config)
        provider.rotary_percent = _rotary_percent(rope, provider)
        _fill_yarn_defaults(rope, provider)
        provider.share_embeddings_and_output_weights = _ties_embeddings(self.hf_config, provider)
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
        pretrained = self.auto_bridge.hf_pretrained
        if hf_path is not None:
            pretrained = self.auto_bridge._pretrained_wrapper_cls.from_pretrained(
                str(hf_path), trust_remote_code=self.trust_remote_code)
            if language_model(self.hf_config) is not None:
                use_text_config(pretrained, read_json(Path(hf_path) / "config.json"))
        return load_megatron_bridge(self.auto_bridge, chunks, hf_path or self.hf_path, pretrained)

    def export_hf_weights(self, chunks: list[torch.nn.Module], *, on_host: bool = True,
                          only: Collection[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        all_tasks = self._conversion_tasks(chunks)
        tasks = None if only is None else [task for task in all_tasks if not _hf_names(task).isdisjoint(only)]
        # megatron-bridge looks for LoRA adapters to merge at every export (walking every parameter, gathering the
        # names across pipeline stages): a model without any (no wrapped linear's weight, on any stage) skips that
        adapted = any(_ADAPTED_WEIGHT in task.global_param_name for task in all_tasks)
        for name, tensor in self.auto_bridge.export_hf_weights(chunks, cpu=on_host, show_progress=False,
                                                               conversion_tasks=tasks, merge_adapter_weights=adapted):
            yield name, tensor

    def changed_hf_names(self, chunks: list[torch.nn.Module], changed: Collection[int]) -> set[str]:
        names: set[str] = set()
        for task in self._conversion_tasks(chunks):
            if task.param_weight is not None and (id(task.param_weight) in changed
                                                  or _adapter_changed(chunks, task, changed)):
                names |= _hf_names(task)
        if dist.is_initialized():  # each pipeline stage knows its own parameters
            gathered: list[set[str] | None] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, names, group=cpu_group())
            names = set().union(*gathered)
        return names | self._mtp_copies_of(names)

    def _mtp_copies_of(self, names: set[str]) -> set[str]:
        """The copies of main-model tensors a family's MTP layers store (GLM-4.5's embedding and LM head): written
        with their originals, so they change with them."""
        model_type = self.hf_config.get("model_type")
        if not self.options.mtp or model_type not in MTP_MODEL_TYPES:
            return set()
        layout = mtp_names(model_type)
        return {copy for i in range(self.checkpoint_mtp_layers)
                for copy, source in layout.copy_sources(i, self.hf_config).items() if source in names}

    def _conversion_tasks(self, chunks: list[torch.nn.Module]) -> list[Any]:
        """megatron-bridge's conversion tasks of these chunks (one per Megatron parameter, in the same order on every
        rank), built once: building them walks every parameter and gathers the names across pipeline stages."""
        key = _chunks_key(chunks)
        if self._tasks is None or self._tasks[0] != key:
            self._tasks = (key, [task for task in self.auto_bridge.get_conversion_tasks(chunks) if task is not None])
        return self._tasks[1]


# The families whose megatron-bridge provider shares no embedding whatever the checkpoint says
# (glm/glm45_bridge.py:67, deepseek/deepseek_v3_bridge.py:61 set share_embeddings_and_output_weights = False).
_TIES_IGNORED = ("glm4_moe", "deepseek_v3")


def _ties_embeddings(hf_config: dict[str, Any], provider: Any) -> bool:
    """Whether the output layer is the input embedding: the checkpoint's `tie_word_embeddings` (False when absent, as
    transformers' Glm4MoeConfig and DeepseekV3Config default it) where the provider ignores it, since a tied
    checkpoint stores no `lm_head.weight` and its output layer would be left uninitialised; the provider's own
    elsewhere."""
    if hf_config.get("model_type") in _TIES_IGNORED:
        return bool(hf_config.get("tie_word_embeddings", False))
    return bool(provider.share_embeddings_and_output_weights)


def _rotary_percent(rope: dict[str, Any], provider: Any) -> float:
    """The share of each head that transformers' modeling rotates: the `partial_rotary_factor` of the checkpoint's
    RoPE (`families.rope_parameters`: in `rope_parameters`, or at the top of a published config.json). megatron-bridge
    reads the config attribute (megatron/bridge/models/conversion/model_bridge.py:458), which transformers 5 leaves at
    the class default where config.json gives the factor only in `rope_parameters` (`Glm4MoeConfig`: 0.5 beside a
    factor of 1.0 there)."""
    if provider.multi_latent_attention:
        return provider.rotary_percent
    return float(rope.get("partial_rotary_factor", provider.rotary_percent))


def _fill_yarn_defaults(rope: dict[str, Any], provider: Any) -> None:
    """YaRN as transformers computes it where config.json leaves fields out (Qwen3's model cards add only `rope_type`,
    `factor` and `original_max_position_embeddings`). megatron-bridge copies the fields config.json gives and leaves
    the others None (megatron/bridge/models/conversion/model_bridge.py:595-602), which Megatron-Core's YaRN cannot
    compute with (a TypeError in the first forward); transformers' defaults are beta_fast 32, beta_slow 1, a truncated
    correction range, and an attention factor of 0.1 ln(factor) + 1 unless both `mscale` and `mscale_all_dim` are
    given (modeling_rope_utils.py `_compute_yarn_parameters`), which is Megatron's mscale 1 over mscale_all_dim 0.
    Multi-latent attention (DeepSeek-V3) takes its YaRN fields elsewhere (`mscale`, `rotary_scaling_factor`)."""
    if provider.multi_latent_attention or provider.position_embedding_type != "yarn":
        return
    if rope.get("attention_factor") is not None:
        raise BridgeError(f"rope_scaling: attention_factor {rope['attention_factor']} has no Megatron-Core YaRN "
                          "equivalent here; remove it (transformers then derives it from factor, mscale and "
                          "mscale_all_dim) or use a checkpoint without it")
    provider.yarn_beta_fast = rope.get("beta_fast") or 32.0
    provider.yarn_beta_slow = rope.get("beta_slow") or 1.0
    if not (rope.get("mscale") and rope.get("mscale_all_dim")):
        provider.yarn_mscale, provider.yarn_mscale_all_dim = 1.0, 0.0
    provider.yarn_correction_range_round_to_int = rope.get("truncate", True)


def _chunks_key(chunks: list[torch.nn.Module]) -> tuple[int, ...]:
    """What the conversion plans of these chunks depend on: the chunks, and how many parameters their modules
    register (LoRA adds adapters, and wraps the linears' weights under other names). Asked at every export: the
    modules' registries are read directly (`Module.parameters()` walks them through generators, 8x slower)."""
    registered, modules = 0, list(chunks)
    while modules:
        module = modules.pop()
        registered += len(module._parameters)
        modules.extend(child for child in module._modules.values() if child is not None)  # None: unset
    return (*(id(chunk) for chunk in chunks), registered)


# what megatron-bridge's export looks for in a conversion task's name to merge a LoRA adapter into its weight
# (model_bridge.py `stream_weights_megatron_to_hf`: "to_wrap.weight" in task.global_param_name)
_ADAPTED_WEIGHT = "to_wrap.weight"


def _hf_names(task: Any) -> set[str]:
    """The HF tensor names a conversion task writes (one, or several for a fused Megatron weight)."""
    hf_param = task.mapping.hf_param
    return {hf_param} if isinstance(hf_param, str) else set(hf_param.values())


def _adapter_changed(chunks: list[torch.nn.Module], task: Any, changed: Collection[int]) -> bool:
    """Whether the LoRA adapter beside a wrapped linear's weight (`...linear_qkv.to_wrap.weight` beside
    `...linear_qkv.adapter.*`) changed: the export merges it into that weight."""
    base, wrapped, _ = task.param_name.partition(".to_wrap.weight")
    if not wrapped:
        return False
    adapter = chunks[task.vp_stage or 0].get_submodule(f"{base}.adapter")
    return any(id(parameter) in changed for parameter in adapter.parameters())
