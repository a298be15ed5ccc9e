"""Each DeepSeek-V3 adjustment: a tiny DeepSeek-V3 (MLA, YaRN, group-limited routing, one MTP layer) fails here
without it, and builds, matches HF and exports every tensor bit for bit with it.

Built through megatron-bridge's own DeepSeekV3Bridge settings, with the package's SDPA core attention in the layer
spec (megatron-core's local attention takes no separate key and value head sizes).
"""

from __future__ import annotations

import importlib.util
from functools import partial
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file

from lightning_megatron._compat import deepseek
from lightning_megatron.attention import with_core_attention
from lightning_megatron.testing.checkpoints import MoEShape, make_tiny_checkpoint
from tests._compat.test_bridges import (  # noqa: F401  (fixtures)
    _assert_matches_hf,
    _megatron_bridge_model,
    input_ids,
    megatron_bridge,
    parallel_state_1x1,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None, reason="the adjustments apply only without TE"
)

ADJUSTMENTS = {adjustment.name: adjustment for adjustment in deepseek.MEGATRON_BRIDGE_ADJUSTMENTS}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("deepseek_v3"), "deepseek_v3", mtp=True,
                                moe=MoEShape(routed_scaling_factor=2.5, n_group=2, topk_group=1))


def _model(megatron_bridge: ModuleType, path: Path) -> torch.nn.Module:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = with_core_attention(partial(get_gpt_decoder_block_spec, use_transformer_engine=False), "sdpa")
    # the shared expert on the default stream, as lightning_megatron.moe sets it
    return _megatron_bridge_model(megatron_bridge, path, transformer_layer_spec=spec, moe_shared_expert_overlap=False)


def test_megatron_bridge_deepseek_v3_local_fusions(megatron_bridge: ModuleType, checkpoint: Path, input_ids) -> None:
    with ADJUSTMENTS["megatron_bridge.deepseek_v3_local_fusions"].suspended():
        with pytest.raises(ValueError, match="fused permutation is not available"):
            _model(megatron_bridge, checkpoint)
    _assert_matches_hf(_model(megatron_bridge, checkpoint), checkpoint, input_ids)


def test_megatron_bridge_deepseek_v3_mtp_copies(megatron_bridge: ModuleType, checkpoint: Path) -> None:
    model = _model(megatron_bridge, checkpoint)
    bridge = megatron_bridge.AutoBridge.from_hf_pretrained(checkpoint)
    hf = load_file(checkpoint / "model.safetensors")
    copies = {"model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight"}  # DeepSeek-V3's index
    with ADJUSTMENTS["megatron_bridge.deepseek_v3_mtp_copies"].suspended():
        assert set(hf) - dict(bridge.export_hf_weights([model], cpu=True, show_progress=False)).keys() == copies
    exported = dict(bridge.export_hf_weights([model], cpu=True, show_progress=False))
    assert exported.keys() == hf.keys()
    assert [name for name in hf if not torch.equal(hf[name], exported[name])] == []


def test_the_mtp_copies_follow_deepseeks_own_export_hook(megatron_bridge: ModuleType) -> None:
    """The copies are added after DeepSeek's hook (which keeps a source checkpoint's rotary inv_freq), not instead."""
    from megatron.bridge.models.deepseek.deepseek_v3_bridge import DeepSeekV3Bridge

    hook = DeepSeekV3Bridge.maybe_modify_converted_hf_weight
    assert hook.__wrapped__.__qualname__ == "DeepSeekV3Bridge.maybe_modify_converted_hf_weight"


def test_megatron_core_mla_query_without_lora(megatron_bridge: ModuleType, tmp_path: Path, input_ids) -> None:
    """Moonlight's layout (`q_lora_rank: null`: the query projected by `q_proj` alone): refused by Megatron-Core's
    MLA without the adjustment; with it, HF's logits (the export and the MTP head: tests/test_deepseek_v3.py)."""
    checkpoint = make_tiny_checkpoint(tmp_path / "moonlight", "deepseek_v3", mtp=True, config={
        "q_lora_rank": None})
    with ADJUSTMENTS["megatron_core.mla_query_without_lora"].suspended():
        with pytest.raises(ValueError, match="q_lora_rank is None"):
            _model(megatron_bridge, checkpoint)
    _assert_matches_hf(_model(megatron_bridge, checkpoint), checkpoint, input_ids)
