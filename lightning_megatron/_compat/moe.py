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


def _install_qwen3_moe_unfused_permutation(patches: Patches) -> None:
    from megatron.bridge.models.qwen.qwen3_moe_bridge import Qwen3MoEBridge

    provider_bridge = Qwen3MoEBridge.provider_bridge

    @functools.wraps(provider_bridge)
    def provider_bridge_unfused(bridge: Any, hf_pretrained: Any) -> Any:
        provider = provider_bridge(bridge, hf_pretrained)
        provider.moe_permute_fusion = False  # TE's fused permutation; the unfused one computes the same
        return provider

    patches.setattr(Qwen3MoEBridge, "provider_bridge", provider_bridge_unfused)


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
