"""mbridge 0.15 against megatron-core 0.19 and transformers 5, and without Transformer Engine.

mbridge hard-codes TE layer specs and only knows TE's fused layernorm names: without TE the local (plain PyTorch)
specs are built and their names mapped. It also trails megatron-core 0.19 and transformers 5
(`ModelType.encoder_and_decoder`, `rope_theta`) and shares a name table across bridges. Needed on the GPU machine
too, which has no TE.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

from lightning_megatron._compat._adjustment import Adjustment, Patches
from lightning_megatron._compat.no_te import no_transformer_engine


def _building_local_specs(build_spec: Callable[..., Any]) -> Callable[..., Any]:
    """`build_spec` with `use_transformer_engine=False`; `functools.wraps` keeps its signature for upstream's checks."""

    @functools.wraps(build_spec)
    def build_local_spec(*args: Any, **kwargs: Any) -> Any:
        return build_spec(*args, **{**kwargs, "use_transformer_engine": False})

    return build_local_spec


_NOT_A_MODEL_TYPE = object()


def _model_type_lacks_encoder_and_decoder() -> bool:
    from megatron.core.transformer.enums import ModelType

    return not hasattr(ModelType, "encoder_and_decoder")


def _install_encoder_and_decoder_sentinel(patches: Patches) -> None:
    """mbridge only compares against it, so a value equal to no model type restores the decoder-only path."""
    from megatron.core.transformer.enums import ModelType

    patches.setattr(ModelType, "encoder_and_decoder", _NOT_A_MODEL_TYPE)


def _install_mbridge_local_layer_spec(patches: Patches) -> None:
    from mbridge.core import llm_bridge

    local_block_spec = _building_local_specs(llm_bridge.get_gpt_decoder_block_spec)
    patches.setattr(llm_bridge, "get_gpt_decoder_block_spec", local_block_spec)


def _configs_lack_rope_theta() -> bool:
    import transformers

    return not hasattr(transformers.Qwen2Config(), "rope_theta")


@contextlib.contextmanager
def _rope_theta_exposed(hf_config: Any) -> Iterator[None]:
    """Gives `hf_config` the `rope_theta` attribute of transformers 4 only while mbridge builds the model, so that
    `save_weights` does not write a stray `rope_theta` into config.json."""
    if hasattr(hf_config, "rope_theta"):
        yield
        return
    hf_config.rope_theta = hf_config.rope_parameters["rope_theta"]
    try:
        yield
    finally:
        del hf_config.rope_theta


def _install_rope_theta_while_building(patches: Patches) -> None:
    from mbridge.core.llm_bridge import LLMBridge

    make_model_provider = LLMBridge._model_provider

    def model_provider_with_rope_theta(bridge: LLMBridge, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        provide = make_model_provider(bridge, *args, **kwargs)

        @functools.wraps(provide)
        def provide_with_rope_theta(*provide_args: Any, **provide_kwargs: Any) -> Any:
            with _rope_theta_exposed(bridge.hf_config):
                return provide(*provide_args, **provide_kwargs)

        return provide_with_rope_theta

    patches.setattr(LLMBridge, "_model_provider", model_provider_with_rope_theta)


# mbridge maps names by substring; the local spec keeps the layernorms that TE fuses into linear_qkv / linear_fc1
# (qk layernorms are separate modules in both specs, and already mapped).
_LOCAL_SPEC_NAMES = {
    "_OTHER_MAPPING": {"input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]},
    "_MLP_MAPPING": {"pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"]},
}


def _mbridge_name_tables() -> tuple[type, ...]:
    """The bridges of the families we use: qwen2 (and qwen3, which inherits its tables) and llama."""
    from mbridge.models.llama import LLaMABridge
    from mbridge.models.qwen2 import Qwen2Bridge

    return (Qwen2Bridge, LLaMABridge)


def _name_tables_lack_local_spec_names() -> bool:
    return no_transformer_engine() and any(
        name not in getattr(bridge, table)
        for bridge in _mbridge_name_tables()
        for table, entries in _LOCAL_SPEC_NAMES.items()
        for name in entries
    )


def _install_local_spec_names(patches: Patches) -> None:
    for bridge in _mbridge_name_tables():
        for table, entries in _LOCAL_SPEC_NAMES.items():
            patches.setattr(bridge, table, {**getattr(bridge, table), **entries})


def _tied_bridge_rewrites_class_mapping() -> bool:
    """Runs qwen2's tied-embedding hook on a bare bridge, then restores the class table it may have rewritten."""
    from mbridge.models.qwen2 import Qwen2Bridge

    table = Qwen2Bridge._DIRECT_MAPPING
    original = dict(table)
    bridge = object.__new__(Qwen2Bridge)
    bridge.hf_config = types.SimpleNamespace(tie_word_embeddings=True)
    bridge._adjust_mapping_for_shared_weights()
    rewritten = table != original
    table.clear()
    table.update(original)
    return rewritten


def _install_per_bridge_direct_mapping(patches: Patches) -> None:
    from mbridge.core.bridge import Bridge

    init = Bridge.__init__

    @functools.wraps(init)
    def init_with_own_direct_mapping(bridge: Bridge, *args: Any, **kwargs: Any) -> None:
        bridge._DIRECT_MAPPING = dict(bridge._DIRECT_MAPPING)  # what the tied-embedding hook then rewrites
        init(bridge, *args, **kwargs)

    patches.setattr(Bridge, "__init__", init_with_own_direct_mapping)


ADJUSTMENTS = (
    Adjustment(
        "mbridge.model_type_encoder_and_decoder",
        "mbridge/core/util.py:83 ModelType.encoder_and_decoder, removed in megatron-core 0.19 (transformer/enums.py)",
        _model_type_lacks_encoder_and_decoder,
        _install_encoder_and_decoder_sentinel,
    ),
    Adjustment(
        "mbridge.local_layer_spec",
        "mbridge/core/llm_bridge.py:149 get_gpt_decoder_block_spec(..., use_transformer_engine=True)",
        no_transformer_engine,
        _install_mbridge_local_layer_spec,
    ),
    Adjustment(
        "mbridge.rope_theta",
        "mbridge/core/llm_bridge.py:124, models/llama.py:92 hf_config.rope_theta (rope_parameters in transformers 5)",
        _configs_lack_rope_theta,
        _install_rope_theta_while_building,
    ),
    Adjustment(
        "mbridge.local_spec_names",
        "mbridge/core/bridge.py:646 NotImplementedError: Unsupported parameter name: decoder.layers.0.input_layernorm",
        _name_tables_lack_local_spec_names,
        _install_local_spec_names,
    ),
    Adjustment(
        "mbridge.per_bridge_direct_mapping",
        "mbridge/models/qwen2.py:60 a tied model rewrites the class-wide _DIRECT_MAPPING for every later bridge",
        _tied_bridge_rewrites_class_mapping,
        _install_per_bridge_direct_mapping,
    ),
)
