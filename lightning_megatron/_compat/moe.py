"""Mixture-of-Experts without CUDA or Transformer Engine: token dispatch on CPU/gloo, and both bridges' MoE models on
the local spec (which always builds `SequentialMLP` experts, megatron/core/models/backends.py:133-142).

Found by running a tiny Qwen3-MoE through both bridges at EP=1 and EP=2 (see the project's MoE research notes).
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch

from lightning_megatron._compat._adjustment import Adjustment, Patches
from lightning_megatron._compat.cpu import NoOpStream, no_cuda
from lightning_megatron._compat.no_te import no_transformer_engine
from lightning_megatron.families import mtp_names

# megatron-core ----------------------------------------------------------------------------------------------------


def _stream_events_are_none() -> bool:
    return no_cuda() and NoOpStream().record_event() is None


def _install_stream_events(patches: Patches) -> None:
    """The all-to-all dispatcher records an event on its device-to-host stream and later waits on it."""
    patches.setattr(NoOpStream, "record_event", lambda self, *args, **kwargs: NoOpStream())


def _install_split_sizes_as_numpy(patches: Patches) -> None:
    """Upstream turns CUDA split-size tensors into numpy arrays (which c10d accepts) but leaves CPU ones tensors."""
    from megatron.core.transformer.moe import token_dispatcher

    move = token_dispatcher.maybe_move_tensor_to_cpu

    @functools.wraps(move)
    def move_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    patches.setattr(token_dispatcher, "maybe_move_tensor_to_cpu", move_to_cpu)


def _install_uneven_gathers_on_gloo(patches: Patches) -> None:
    """Under sequence parallelism the dispatcher all-gathers (and in backward reduce-scatters) different numbers of
    tokens per tensor-parallel rank; gloo's all_gather needs equal sizes and its reduce_scatter takes no split list.
    Pad to the largest share and gather, or all-reduce and keep this rank's share: the same result."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    @functools.wraps(gather)
    def gather_along_first_dim(input_: torch.Tensor, group: Any, output_split_sizes: Any = None,
                               use_global_buffer: bool = False) -> torch.Tensor:
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(size) for size in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        shares = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(shares, padded.contiguous(), group=group)
        return torch.cat([share[:size] for share, size in zip(shares, sizes)])

    @functools.wraps(reduce_scatter)
    def reduce_scatter_along_first_dim(input_: torch.Tensor, group: Any, input_split_sizes: Any = None,
                                       use_global_buffer: bool = False) -> torch.Tensor:
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        summed = input_.contiguous().clone()
        dist.all_reduce(summed, group=group)
        sizes = [int(size) for size in input_split_sizes]
        start = sum(sizes[: dist.get_rank(group)])
        return summed[start : start + sizes[dist.get_rank(group)]].contiguous()

    patches.setattr(mappings, "_gather_along_first_dim", gather_along_first_dim)
    patches.setattr(mappings, "_reduce_scatter_along_first_dim", reduce_scatter_along_first_dim)


MEGATRON_CORE_ADJUSTMENTS = (
    Adjustment(
        "moe.cpu_stream_events",
        "megatron/core/transformer/moe/token_dispatcher.py:946-950 d2h_event = stream.record_event(); "
        "d2h_event.synchronize() (None from the CPU stream stand-in)",
        _stream_events_are_none,
        _install_stream_events,
    ),
    Adjustment(
        "moe.gloo_all_to_all_split_sizes",
        "megatron/core/transformer/moe/moe_utils.py:1184 converts only CUDA split sizes to numpy, so "
        "tensor_parallel/mappings.py:460 all_to_all_single gets tensors (TypeError) on CPU",
        no_cuda,
        _install_split_sizes_as_numpy,
    ),
    Adjustment(
        "moe.gloo_uneven_gathers",
        "megatron/core/tensor_parallel/mappings.py:154 all_gather of unequal shares (token_dispatcher.py:739 under "
        "sequence parallelism): 'ProcessGroupGloo::allgather: invalid tensor size'; mappings.py:197 its backward",
        no_cuda,
        _install_uneven_gathers_on_gloo,
    ),
)


# megatron-bridge --------------------------------------------------------------------------------------------------


def set_provider_fields(patches: Patches, bridge_class: type, fields: dict[str, Any]) -> None:
    """`bridge_class.provider_bridge` followed by setting `fields` on the provider it returns."""
    provider_bridge = bridge_class.provider_bridge

    @functools.wraps(provider_bridge)
    def provider_bridge_with_fields(bridge: Any, hf_pretrained: Any) -> Any:
        provider = provider_bridge(bridge, hf_pretrained)
        for name, value in fields.items():
            setattr(provider, name, value)
        return provider

    patches.setattr(bridge_class, "provider_bridge", provider_bridge_with_fields)


def _install_qwen3_moe_unfused_permutation(patches: Patches) -> None:
    from megatron.bridge.models.qwen.qwen3_moe_bridge import Qwen3MoEBridge

    # TE's fused permutation; the unfused one computes the same
    set_provider_fields(patches, Qwen3MoEBridge, {"moe_permute_fusion": False})


def _install_qwen35_moe_unfused_permutation(patches: Patches) -> None:
    from megatron.bridge.models.qwen.qwen35_bridge import Qwen35MoEBridge

    # TE's fused permutation; the unfused one computes the same
    set_provider_fields(patches, Qwen35MoEBridge, {"moe_permute_fusion": False})


def _install_glm45_local_fusions(patches: Patches) -> None:
    from megatron.bridge.models.glm.glm45_bridge import GLM45Bridge

    set_provider_fields(patches, GLM45Bridge, {
        "moe_permute_fusion": False,  # TE's fused permutation; the unfused one computes the same
        "persist_layer_norm": False,  # Apex's persistent layer norm, refused by the local spec's torch norm
        "moe_shared_expert_overlap": False,  # the shared expert on a second CUDA stream
    })


def _glm45_maps_no_sequential_experts() -> bool:
    from megatron.bridge.models.glm.glm45_bridge import GLM45Bridge

    registry = GLM45Bridge.mapping_registry(_glm45_bridge_for_names())
    return not any(".local_experts." in mapping.megatron_param for mapping in registry.mappings)


def _glm45_bridge_for_names() -> Any:
    """A bridge object that can list its mappings without a checkpoint (no MTP layer, no fused experts)."""
    from types import SimpleNamespace

    from megatron.bridge.models.glm.glm45_bridge import GLM45Bridge

    bridge = object.__new__(GLM45Bridge)
    bridge.hf_config = SimpleNamespace(num_nextn_predict_layers=0, num_hidden_layers=1)
    bridge.hf_pretrained = None
    return bridge


def _install_glm45_sequential_expert_names(patches: Patches) -> None:
    """The local spec's `SequentialMLP` experts, in the decoder and in the MTP layers, beside the `TEGroupedMLP`
    names GLM-4.5's registry maps."""
    from megatron.bridge.models.glm.glm45_bridge import GLM45Bridge

    install_sequential_expert_names(patches, GLM45Bridge)


_GROUPED_TO_SEQUENTIAL = ((".mlp.experts.linear_fc1.weight*", ".mlp.experts.local_experts.*.linear_fc1.weight"),
                          (".mlp.experts.linear_fc2.weight*", ".mlp.experts.local_experts.*.linear_fc2.weight"))


def install_sequential_expert_names(patches: Patches, bridge_class: type) -> None:
    """`bridge_class`'s registry maps the local spec's `SequentialMLP` experts
    (`experts.local_experts.{k}.linear_fc1.weight`) the way it maps the `TEGroupedMLP` names
    (`experts.linear_fc1.weight{k}`), wherever it maps only the latter (per-expert or packed HF experts alike)."""
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.param_mapping import (
        AutoMapping,
        FusedExpertMapping,
        FusedGatedExpertMapping,
        GatedMLPMapping,
    )

    mapping_registry = bridge_class.mapping_registry

    def sequential_mapping(mapping: Any, name: str) -> Any:
        if isinstance(mapping, (FusedGatedExpertMapping, FusedExpertMapping)):  # one packed HF tensor
            return type(mapping)(name, mapping.hf_param, mapping.permute_dims, mapping.transpose_on_export)
        if isinstance(mapping, GatedMLPMapping):
            return GatedMLPMapping(megatron_param=name, gate=mapping.hf_param["gate"], up=mapping.hf_param["up"])
        if type(mapping) is AutoMapping:
            return AutoMapping(megatron_param=name, hf_param=mapping.hf_param)
        return None

    @functools.wraps(mapping_registry)
    def mapping_registry_with_sequential_experts(bridge: Any) -> Any:
        registry = mapping_registry(bridge)
        mapped = {mapping.megatron_param for mapping in registry.mappings}
        sequential = []
        for mapping in registry.mappings:
            for grouped, local in _GROUPED_TO_SEQUENTIAL:
                name = mapping.megatron_param.removesuffix(grouped) + local
                if mapping.megatron_param.endswith(grouped) and name not in mapped:
                    sequential.append(sequential_mapping(mapping, name))
        return MegatronMappingRegistry(*registry.mappings, *filter(None, sequential))

    patches.setattr(bridge_class, "mapping_registry", mapping_registry_with_sequential_experts)


def _qwen35_moe_maps_no_sequential_mtp_experts() -> bool:
    from megatron.bridge.models.qwen.qwen35_bridge import Qwen35MoEBridge

    registry = Qwen35MoEBridge.mapping_registry(object.__new__(Qwen35MoEBridge))  # no checkpoint: per-expert names
    # "mtp.": the prefix of Megatron's MTP parameters (GPTModel.mtp), not an HF name
    return not any(mapping.megatron_param.startswith("mtp.") and ".local_experts." in mapping.megatron_param
                   for mapping in registry.mappings)


def _install_qwen35_moe_sequential_mtp_expert_names(patches: Patches) -> None:
    """The local spec's `SequentialMLP` experts in Qwen3.5-MoE's MTP layer (its decoder's are mapped upstream)."""
    from megatron.bridge.models.qwen.qwen35_bridge import Qwen35MoEBridge

    install_sequential_expert_names(patches, Qwen35MoEBridge)


def _glm45_exports_no_mtp_copies() -> bool:
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge
    from megatron.bridge.models.glm.glm45_bridge import GLM45Bridge

    return GLM45Bridge.maybe_modify_converted_hf_weight is MegatronModelBridge.maybe_modify_converted_hf_weight


def _install_glm45_mtp_copies(patches: Patches) -> None:
    """GLM-4.5 checkpoints store copies of the embedding and the LM head inside each MTP layer
    (`families.MTPNames.copies`); Megatron's MTP layers share the model's own, so the export writes them again
    from the shared tensors, only for a model built with its MTP layers (as upstream's GLM-4.7-Flash bridge does,
    glm/glm47_flash_bridge.py:116-148, but for every MTP layer the model has)."""
    from megatron.bridge.models.glm.glm45_bridge import GLM45Bridge

    install_mtp_copies(patches, GLM45Bridge, "glm4_moe")


def install_mtp_copies(patches: Patches, bridge_class: type, model_type: str) -> None:
    """`bridge_class`'s export writes the copies of main-model tensors the family's MTP layers store (`model_type`'s
    `MTPNames.copies`) from the tensors they copy, after the bridge's own `maybe_modify_converted_hf_weight`."""
    from megatron.core.utils import get_model_config

    stream = bridge_class.stream_weights_megatron_to_hf
    modify = bridge_class.maybe_modify_converted_hf_weight
    patches.setattr(bridge_class, "_exports_mtp", False)

    @functools.wraps(stream)
    def stream_noting_mtp(bridge: Any, megatron_model: Any, *args: Any, **kwargs: Any) -> Any:
        chunks = megatron_model if isinstance(megatron_model, list) else [megatron_model]
        bridge._exports_mtp = bool(get_model_config(chunks[0]).mtp_num_layers)
        yield from stream(bridge, megatron_model, *args, **kwargs)

    @functools.wraps(modify)
    def with_mtp_copies(bridge: Any, task: Any, converted: dict[str, torch.Tensor], hf_state_dict: Any
                        ) -> dict[str, torch.Tensor]:
        converted = modify(bridge, task, converted, hf_state_dict)
        names = mtp_names(model_type)
        config = {"num_hidden_layers": bridge.hf_config.num_hidden_layers,
                  "tie_word_embeddings": bool(bridge.hf_config.tie_word_embeddings)}
        # the HF MTP layers the registry maps (a repeated MTP layer, `mtp_depths` > 1, is still one of them)
        for i in range(bridge.hf_config.num_nextn_predict_layers if bridge._exports_mtp else 0):
            for copy, source in names.copy_sources(i, config).items():
                if source in converted and copy not in converted:
                    converted[copy] = converted[source].clone()
        return converted

    patches.setattr(bridge_class, "stream_weights_megatron_to_hf", stream_noting_mtp)
    patches.setattr(bridge_class, "maybe_modify_converted_hf_weight", with_mtp_copies)


def _qwen3_moe_mtp_names() -> dict[str, str]:
    """Megatron name -> HF name of the Qwen3-MoE MTP layer's tensors outside its attention projections and experts."""
    hf = mtp_names("qwen3_moe")
    head, layer = hf.head(0), hf.layer.format(i=0)
    return {
        "mtp.layers.0.eh_proj.weight": head["projection"],
        "mtp.layers.0.enorm.weight": head["embedding_norm"],
        "mtp.layers.0.hnorm.weight": head["hidden_norm"],
        "mtp.layers.0.final_layernorm.weight": head["final_norm"],
        "mtp.layers.0.mtp_model_layer.self_attention.linear_qkv.layer_norm_weight": f"{layer}input_layernorm.weight",
        "mtp.layers.0.mtp_model_layer.self_attention.q_layernorm.weight": f"{layer}self_attn.q_norm.weight",
        "mtp.layers.0.mtp_model_layer.self_attention.k_layernorm.weight": f"{layer}self_attn.k_norm.weight",
        "mtp.layers.0.mtp_model_layer.self_attention.linear_proj.weight": f"{layer}self_attn.o_proj.weight",
        "mtp.layers.0.mtp_model_layer.pre_mlp_layernorm.weight": f"{layer}post_attention_layernorm.weight",
        "mtp.layers.0.mtp_model_layer.mlp.router.weight": f"{layer}mlp.gate.weight",
    }


def _qwen3_moe_maps_no_mtp() -> bool:
    from megatron.bridge.models.qwen.qwen3_moe_bridge import Qwen3MoEBridge

    registry = Qwen3MoEBridge.mapping_registry(object.__new__(Qwen3MoEBridge))
    # "mtp.": the prefix of Megatron's MTP parameters (GPTModel.mtp), not an HF name
    return not any(mapping.megatron_param.startswith("mtp.") for mapping in registry.mappings)


def _install_qwen3_moe_mtp_names(patches: Patches) -> None:
    """The MTP layer as Qwen3-Next lays it out (`mtp.fc`, `mtp.pre_fc_norm_*`, `mtp.norm`, `mtp.layers.0.*` with
    routed experts), which megatron-bridge maps for Qwen3-Next and dense Qwen3 but not Qwen3-MoE."""
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, GatedMLPMapping, QKVMapping
    from megatron.bridge.models.qwen.qwen3_moe_bridge import Qwen3MoEBridge

    mapping_registry = Qwen3MoEBridge.mapping_registry
    layer, hf_layer = "mtp.layers.*.mtp_model_layer", mtp_names("qwen3_moe").layer.format(i="*").removesuffix(".")

    @functools.wraps(mapping_registry)
    def mapping_registry_with_mtp(bridge: Any) -> Any:
        mtp_mappings = [AutoMapping(megatron_param=name, hf_param=hf_name)
                        for name, hf_name in _qwen3_moe_mtp_names().items()]
        attention, experts = f"{hf_layer}.self_attn", f"{hf_layer}.mlp.experts.*"
        mtp_mappings.append(QKVMapping(megatron_param=f"{layer}.self_attention.linear_qkv.weight",
                                       q=f"{attention}.q_proj.weight", k=f"{attention}.k_proj.weight",
                                       v=f"{attention}.v_proj.weight"))
        # SequentialMLP's names (the local spec), then TEGroupedMLP's
        for fc1, fc2 in ((f"{layer}.mlp.experts.local_experts.*.linear_fc1.weight",
                          f"{layer}.mlp.experts.local_experts.*.linear_fc2.weight"),
                         (f"{layer}.mlp.experts.linear_fc1.weight*", f"{layer}.mlp.experts.linear_fc2.weight*")):
            mtp_mappings.append(GatedMLPMapping(megatron_param=fc1, gate=f"{experts}.gate_proj.weight",
                                                up=f"{experts}.up_proj.weight"))
            mtp_mappings.append(AutoMapping(megatron_param=fc2, hf_param=f"{experts}.down_proj.weight"))
        return MegatronMappingRegistry(*mapping_registry(bridge).mappings, *mtp_mappings)

    patches.setattr(Qwen3MoEBridge, "mapping_registry", mapping_registry_with_mtp)


MEGATRON_BRIDGE_ADJUSTMENTS = (
    Adjustment(
        "megatron_bridge.qwen35_moe_unfused_permutation",
        "megatron/bridge/models/qwen/qwen35_bridge.py:101 moe_permute_fusion=True: 'fused permutation is not "
        "available' without TE (megatron/core/transformer/transformer_config.py:2667)",
        no_transformer_engine,
        _install_qwen35_moe_unfused_permutation,
    ),
    Adjustment(
        "megatron_bridge.qwen35_moe_sequential_mtp_expert_names",
        "megatron/bridge/models/qwen/qwen35_bridge.py:363-391 maps the MTP layer's experts by TEGroupedMLP names "
        "only (its decoder's by both, :104-130): loading the local spec's SequentialMLP experts fails at "
        "model_bridge.py:1100 after 'No mapping found for megatron_param: "
        "mtp.layers.0.mtp_model_layer.mlp.experts.local_experts.0.linear_fc1.weight'",
        _qwen35_moe_maps_no_sequential_mtp_experts,
        _install_qwen35_moe_sequential_mtp_expert_names,
    ),
    Adjustment(
        "megatron_bridge.glm45_local_fusions",
        "megatron/bridge/models/glm/glm45_bridge.py:69,75,81 moe_permute_fusion=True: 'fused permutation is not "
        "available' without TE (megatron/core/transformer/transformer_config.py:2667); persist_layer_norm (Apex), "
        "moe_shared_expert_overlap (a second CUDA stream)",
        no_transformer_engine,
        _install_glm45_local_fusions,
    ),
    Adjustment(
        "megatron_bridge.glm45_sequential_expert_names",
        "megatron/bridge/models/glm/glm45_bridge.py:171-182, 254-269 map only TEGroupedMLP expert names: loading the local "
        "spec's SequentialMLP experts fails at model_bridge.py:1100 ('NoneType' object has no attribute "
        "'megatron_module', after 'No mapping found for megatron_param: ...local_experts.0.linear_fc1.weight')",
        _glm45_maps_no_sequential_experts,
        _install_glm45_sequential_expert_names,
    ),
    Adjustment(
        "megatron_bridge.glm45_mtp_copies",
        "megatron/bridge/models/glm/glm45_bridge.py:272-295 maps no copy of the embedding or LM head in the MTP "
        "layers, so the export omits two tensors of every GLM-4.5 checkpoint with MTP (its index lists them)",
        _glm45_exports_no_mtp_copies,
        _install_glm45_mtp_copies,
    ),
    Adjustment(
        "megatron_bridge.qwen3_moe_mtp_names",
        "megatron/bridge/models/qwen/qwen3_moe_bridge.py:77 mapping_registry has no mtp.* names although the provider "
        "builds the MTP layer from num_nextn_predict_layers (model_bridge.py:478): loading fails at "
        "model_bridge.py:1100 ('NoneType' object has no attribute 'megatron_module')",
        _qwen3_moe_maps_no_mtp,
        _install_qwen3_moe_mtp_names,
    ),
    Adjustment(
        "megatron_bridge.qwen3_moe_unfused_permutation",
        "megatron/bridge/models/qwen/qwen3_moe_bridge.py:68 moe_permute_fusion=True: 'fused permutation is not "
        "available' without TE (megatron/core/transformer/transformer_config.py:2667)",
        no_transformer_engine,
        _install_qwen3_moe_unfused_permutation,
    ),
)


# mbridge ----------------------------------------------------------------------------------------------------------


def _mbridge_moe_bridges() -> tuple[type, ...]:
    from mbridge.models.qwen2moe import Qwen2MoEBridge
    from mbridge.models.qwen3moe import Qwen3MoEBridge

    return (Qwen2MoEBridge, Qwen3MoEBridge)


def _install_no_persistent_layer_norm(patches: Patches) -> None:
    for bridge_class in _mbridge_moe_bridges():
        build_config = bridge_class._build_config

        @functools.wraps(build_config)
        def build_config_without_apex_fusions(bridge: Any, _build_config: Any = build_config) -> Any:
            config = _build_config(bridge)
            config.persist_layer_norm = False  # Apex's persistent layer norm, refused by the local spec's torch norm
            config.moe_shared_expert_overlap = False  # overlaps the shared expert on a second CUDA stream
            return config

        patches.setattr(bridge_class, "_build_config", build_config_without_apex_fusions)


_INPUT_LAYERNORM = {"input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]}


def _moe_name_table_lacks_input_layernorm() -> bool:
    from mbridge.models.qwen2moe import Qwen2MoEBridge

    return no_transformer_engine() and "input_layernorm.weight" not in Qwen2MoEBridge._OTHER_MAPPING


def _install_moe_input_layernorm_name(patches: Patches) -> None:
    """Qwen2-MoE's table (which Qwen3-MoE inherits) already maps the local spec's `pre_mlp_layernorm`."""
    from mbridge.models.qwen2moe import Qwen2MoEBridge

    patches.setattr(Qwen2MoEBridge, "_OTHER_MAPPING", {**Qwen2MoEBridge._OTHER_MAPPING, **_INPUT_LAYERNORM})


_SEQUENTIAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def _install_sequential_mlp_expert_names(patches: Patches) -> None:
    """mbridge names experts as TEGroupedMLP does (`experts.linear_fc1.weight{k}`), in its name tables and in the
    expert-parallel paths of load and export; `SequentialMLP` names them `experts.local_experts.{k}.linear_fc1.weight`.
    The local-to-global map (used by both load and export) renames them; state-dict keys stay the module's."""
    from mbridge.core.bridge import Bridge

    local_to_global = Bridge._weight_name_mapping_mcore_local_to_global

    @functools.wraps(local_to_global)
    def local_to_global_with_sequential_experts(bridge: Any, model: Any, consider_ep: bool = True) -> dict[str, str]:
        names = local_to_global(bridge, model, consider_ep=False)
        ep_size, ep_rank = bridge.mpu.ep_size, bridge.mpu.ep_rank
        first_expert = ep_rank * bridge.config.num_moe_experts // ep_size if consider_ep and ep_size > 1 else 0

        def grouped_name(match: re.Match) -> str:
            return f".mlp.experts.{match[2]}.weight{int(match[1]) + first_expert}"

        return {local: _SEQUENTIAL_EXPERT.sub(grouped_name, name) for local, name in names.items()}

    patches.setattr(Bridge, "_weight_name_mapping_mcore_local_to_global", local_to_global_with_sequential_experts)


MBRIDGE_ADJUSTMENTS = (
    Adjustment(
        "mbridge.moe_no_apex_fusions",
        "mbridge/models/qwen3moe.py:24, qwen2moe.py persist_layer_norm=True: 'persist_layer_norm not supported by "
        "torch LayerNorm' (megatron/core/transformer/torch_norm.py:48); qwen2moe.py moe_shared_expert_overlap",
        no_transformer_engine,
        _install_no_persistent_layer_norm,
    ),
    Adjustment(
        "mbridge.moe_local_spec_names",
        "mbridge/core/bridge.py:646 Unsupported parameter name: decoder.layers.0.input_layernorm.weight "
        "(Qwen2MoEBridge's tables, which Qwen3MoEBridge uses)",
        _moe_name_table_lacks_input_layernorm,
        _install_moe_input_layernorm_name,
    ),
    Adjustment(
        "mbridge.sequential_mlp_expert_names",
        "mbridge/models/qwen2moe.py:104 Unsupported parameter name: ...mlp.experts.local_experts.0.linear_fc1.weight; "
        "mbridge/core/bridge.py:364-385, 507-520 know only TEGroupedMLP expert names",
        no_transformer_engine,
        _install_sequential_mlp_expert_names,
    ),
)
