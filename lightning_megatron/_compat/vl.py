"""megatron-bridge 0.6's Qwen vision-language models without Transformer Engine, and a config the Qwen2.5-VL
bridge forgets.

- Qwen2.5-VL: the bridge never copies ``mrope_section`` from the HF text config, so the provider keeps its default
  ``[16, 24, 24]`` (right only for head_dim 128) and the first forward of any other shape fails in MRoPE.
- Qwen3-VL: the provider and the model hard-code Transformer Engine specs for the language layers and the vision
  tower (layers and patch mergers). Without TE the provider's own layer spec (local, with the core attention the
  bridge chose) builds the language layers, and the local ViT spec, torch norms and Megatron's parallel linears the
  vision tower; ``provider.vision_transformer_layer_spec`` (a spec or a function returning one) overrides the ViT
  layer spec, e.g. to give the vision tower an attention that runs its packed (one sequence per image) layout.
- Qwen3-VL with packed rows and context parallelism cuts each sequence with Transformer Engine's
  ``thd_get_partitioned_indices`` (through Megatron-Core's ``get_batch_on_this_cp_rank``); without TE the same
  load-balanced chunks are computed in torch.
- Qwen3-VL, TE or not: its patch mergers apply the vision MLP's tanh-approximated GELU where Hugging Face's apply the
  exact one, so image embeddings differ from the checkpoint's own model by ~1e-3.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from collections.abc import Iterator
from typing import Any

from lightning_megatron._compat._adjustment import Adjustment, Patches
from lightning_megatron._compat.no_te import no_transformer_engine


def _qwen25_vl_bridge_drops_mrope_section() -> bool:
    from megatron.bridge.models.qwen_vl.qwen25_vl_bridge import Qwen25VLBridge

    return "mrope_section" not in inspect.getsource(Qwen25VLBridge.provider_bridge)


def _install_qwen25_vl_mrope_section(patches: Patches) -> None:
    """Copies ``rope_parameters["mrope_section"]`` as the Qwen3-VL bridge does (qwen3_vl_bridge.py:107)."""
    from megatron.bridge.models.qwen_vl.qwen25_vl_bridge import Qwen25VLBridge

    provider_bridge = Qwen25VLBridge.provider_bridge

    @functools.wraps(provider_bridge)
    def provider_bridge_with_mrope_section(bridge: Any, hf_pretrained: Any) -> Any:
        provider = provider_bridge(bridge, hf_pretrained)
        text_config = hf_pretrained.config.text_config
        rope = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
        if rope.get("mrope_section"):
            provider.mrope_section = list(rope["mrope_section"])
        return provider

    patches.setattr(Qwen25VLBridge, "provider_bridge", provider_bridge_with_mrope_section)


def _resolved_spec(spec: Any, provider: Any, vp_stage: int | None) -> Any:
    """A layer spec, or what a spec-building function (taking the provider, maybe ``vp_stage``) returns; a copy,
    because Qwen3VLModel sets the attention module of the spec it is given in place."""
    if callable(spec) and not hasattr(spec, "submodules"):
        parameters = inspect.signature(spec).parameters
        if "vp_stage" in parameters:
            spec = spec(provider, vp_stage=vp_stage)
        elif parameters:
            spec = spec(provider)
        else:
            spec = spec()
    return copy.deepcopy(spec)


@contextlib.contextmanager
def _module_attributes(module: Any, **values: Any) -> Iterator[None]:
    originals = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in originals.items():
            setattr(module, name, value)


def _install_qwen3_vl_local_specs(patches: Patches) -> None:
    from megatron.bridge.models.qwen_vl import qwen3_vl_provider
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl import model as qwen3_vl_model
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    # The patch mergers: TE's norm (LayerNorm from config.normalization) and linears -> torch's and Megatron's own.
    patches.setattr(qwen3_vl_model, "TENorm", WrappedTorchNorm)
    patches.setattr(qwen3_vl_model, "TEColumnParallelLinear", ColumnParallelLinear)
    patches.setattr(qwen3_vl_model, "TERowParallelLinear", RowParallelLinear)
    upstream_provide = qwen3_vl_provider.Qwen3VLModelProvider.provide

    @functools.wraps(upstream_provide)
    def provide_with_local_specs(provider: Any, pre_process: Any = None, post_process: Any = None,
                                 vp_stage: int | None = None) -> Any:
        language_spec = _resolved_spec(provider.transformer_layer_spec, provider, vp_stage)
        vision_spec = _resolved_spec(
            getattr(provider, "vision_transformer_layer_spec", None) or get_vit_layer_with_local_spec, provider, None
        )
        with (
            _module_attributes(qwen3_vl_provider, get_gpt_layer_with_transformer_engine_spec=lambda **_: language_spec),
            _module_attributes(qwen3_vl_model, get_vit_layer_with_transformer_engine_spec=lambda: vision_spec),
        ):
            return upstream_provide(provider, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)

    patches.setattr(qwen3_vl_provider.Qwen3VLModelProvider, "provide", provide_with_local_specs)


def _qwen3_vl_merger_uses_tanh_gelu() -> bool:
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.utils import Qwen3VLVisionPatchMerger

    return "self.activation_func = self.config.activation_func" in inspect.getsource(Qwen3VLVisionPatchMerger)


def _install_qwen3_vl_merger_exact_gelu(patches: Patches) -> None:
    """HF's patch mergers use ``nn.GELU()`` (exact); upstream reuses the vision MLP's tanh approximation."""
    import torch.nn.functional as F
    from megatron.bridge.models.qwen_vl.modelling_qwen3_vl.utils import Qwen3VLVisionPatchMerger

    upstream_init = Qwen3VLVisionPatchMerger.__init__

    @functools.wraps(upstream_init)
    def init_with_exact_gelu(merger: Any, *args: Any, **kwargs: Any) -> None:
        upstream_init(merger, *args, **kwargs)
        merger.activation_func = F.gelu

    patches.setattr(Qwen3VLVisionPatchMerger, "__init__", init_with_exact_gelu)


def _thd_partitioning_needs_transformer_engine() -> bool:
    from megatron.core import utils

    return utils.tex is None


def _thd_get_partitioned_indices(cu_seqlens: Any, total_tokens: int, world_size: int, rank: int) -> Any:
    """Transformer Engine's ``thd_get_partitioned_indices``: per packed sequence (each divisible into
    ``2 * world_size`` chunks), chunk ``rank`` then chunk ``2 * world_size - 1 - rank``."""
    import torch

    bounds = cu_seqlens.tolist()
    pieces = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        chunk = (end - start) // (2 * world_size)
        for index in (rank, 2 * world_size - 1 - rank):
            pieces.append(torch.arange(start + index * chunk, start + (index + 1) * chunk))
    indices = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    return indices[indices < total_tokens].to(cu_seqlens.device)


def _install_thd_partitioned_indices(patches: Patches) -> None:
    from types import SimpleNamespace

    from megatron.core import utils

    patches.setattr(utils, "tex", SimpleNamespace(thd_get_partitioned_indices=_thd_get_partitioned_indices))


MEGATRON_BRIDGE_ADJUSTMENTS = (
    Adjustment(
        "megatron_bridge.qwen25_vl_mrope_section",
        "megatron/bridge/models/qwen_vl/qwen25_vl_bridge.py:73 never sets mrope_section; the [16, 24, 24] default "
        "(qwen25_vl_provider.py:35) fails at rotary_pos_embedding.py:357 split_with_sizes for head_dim != 128",
        _qwen25_vl_bridge_drops_mrope_section,
        _install_qwen25_vl_mrope_section,
    ),
    Adjustment(
        "megatron_bridge.qwen3_vl_local_specs",
        "megatron/bridge/models/qwen_vl/qwen3_vl_provider.py:148 get_gpt_layer_with_transformer_engine_spec and "
        "modelling_qwen3_vl/model.py:305-310 the TE ViT spec, TENorm, TE linears: TypeError without TE",
        no_transformer_engine,
        _install_qwen3_vl_local_specs,
    ),
    Adjustment(
        "megatron_bridge.qwen3_vl_merger_gelu",
        "megatron/bridge/models/qwen_vl/modelling_qwen3_vl/utils.py:160 the patch mergers use the vision MLP's "
        "tanh GELU; HF's Qwen3VLVisionPatchMerger uses nn.GELU() (exact): image embeddings ~4e-4 off",
        _qwen3_vl_merger_uses_tanh_gelu,
        _install_qwen3_vl_merger_exact_gelu,
    ),
    Adjustment(
        "megatron_core.thd_partitioned_indices",
        "megatron/core/utils.py:2441 tex.thd_get_partitioned_indices (Transformer Engine) cuts packed rows for CP, "
        "as Qwen3-VL's forward does after fusing the images (packed_seq_utils.py:68): tex is None without TE",
        _thd_partitioning_needs_transformer_engine,
        _install_thd_partitioned_indices,
    ),
)
