"""Each MoE adjustment: a tiny Qwen3-MoE fails here without it, and builds, matches HF and exports with it.

Models are built through the bridges directly (their own router settings, no project overrides), as in
tests/_compat/test_bridges.py.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file

from lightning_megatron._compat import moe
from lightning_megatron.testing.checkpoints import MoEShape, make_tiny_checkpoint
from tests._compat.test_bridges import (  # noqa: F401  (fixtures)
    _assert_matches_hf,
    _logits,
    _mbridge_model,
    _megatron_bridge_model,
    input_ids,
    mbridge,
    megatron_bridge,
    parallel_state_1x1,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None, reason="the adjustments apply only without TE"
)
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU adjustments apply only without CUDA")

ADJUSTMENTS = {adjustment.name: adjustment for adjustment in
               (*moe.MEGATRON_CORE_ADJUSTMENTS, *moe.MEGATRON_BRIDGE_ADJUSTMENTS, *moe.MBRIDGE_ADJUSTMENTS)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    made: dict[bool, Path] = {}

    def get(mtp: bool = False) -> Path:
        if mtp not in made:
            made[mtp] = make_tiny_checkpoint(tmp_path_factory.mktemp(f"qwen3_moe_mtp{mtp}"), "qwen3_moe", mtp=mtp)
        return made[mtp]

    return get


@cpu_only
def test_cpu_stream_events(megatron_bridge: ModuleType, checkpoint, input_ids) -> None:
    path = checkpoint()
    model = _megatron_bridge_model(megatron_bridge, path)
    with ADJUSTMENTS["moe.cpu_stream_events"].suspended():
        with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'synchronize'"):
            _logits(model, input_ids)
    _assert_matches_hf(model, path, input_ids)


@cpu_only
def test_gloo_all_to_all_split_sizes(parallel_state_1x1: None) -> None:
    """The dispatcher's split sizes go to all_to_all_single (tensor_parallel/mappings.py:460) as this conversion
    returns them; Megatron skips the call for one rank, so it is made here directly on the one-process group."""
    import torch.distributed as dist
    from megatron.core.transformer.moe import token_dispatcher

    tokens, splits = torch.arange(6.0).reshape(3, 2), torch.tensor([3])

    def exchange() -> torch.Tensor:
        sizes = token_dispatcher.maybe_move_tensor_to_cpu(splits, as_numpy=True)
        output = torch.empty_like(tokens)
        dist.all_to_all_single(output, tokens, output_split_sizes=sizes, input_split_sizes=sizes)
        return output

    with ADJUSTMENTS["moe.gloo_all_to_all_split_sizes"].suspended():
        with pytest.raises(TypeError, match="incompatible function arguments"):
            exchange()
    assert torch.equal(exchange(), tokens)


def test_megatron_bridge_qwen3_moe_unfused_permutation(megatron_bridge: ModuleType, checkpoint, input_ids) -> None:
    path = checkpoint()
    with ADJUSTMENTS["megatron_bridge.qwen3_moe_unfused_permutation"].suspended():
        with pytest.raises(ValueError, match="fused permutation is not available"):
            _megatron_bridge_model(megatron_bridge, path)
    _assert_matches_hf(_megatron_bridge_model(megatron_bridge, path), path, input_ids)


def test_megatron_bridge_qwen3_moe_mtp_names(megatron_bridge: ModuleType, checkpoint, tmp_path: Path) -> None:
    path = checkpoint(mtp=True)
    with ADJUSTMENTS["megatron_bridge.qwen3_moe_mtp_names"].suspended():
        with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'megatron_module'"):
            _megatron_bridge_model(megatron_bridge, path)

    model = _megatron_bridge_model(megatron_bridge, path)
    hf = load_file(path / "model.safetensors")
    state = model.state_dict()
    layer = "mtp.layers.0.mtp_model_layer"
    assert torch.equal(state["mtp.layers.0.eh_proj.weight"], hf["mtp.fc.weight"])
    assert torch.equal(state[f"{layer}.mlp.router.weight"], hf["mtp.layers.0.mlp.gate.weight"])
    assert torch.equal(state[f"{layer}.mlp.experts.local_experts.3.linear_fc2.weight"],
                       hf["mtp.layers.0.mlp.experts.3.down_proj.weight"])
    megatron_bridge.AutoBridge.from_hf_pretrained(path).save_hf_weights([model], tmp_path)
    exported = load_file(tmp_path / "model.safetensors")
    assert exported.keys() == hf.keys()
    assert [name for name in hf if not torch.equal(hf[name], exported[name])] == []


def test_mbridge_moe_no_apex_fusions(mbridge: ModuleType, checkpoint, input_ids) -> None:
    path = checkpoint()
    with ADJUSTMENTS["mbridge.moe_no_apex_fusions"].suspended():
        with pytest.raises(AssertionError, match="persist_layer_norm not supported by torch LayerNorm"):
            _mbridge_model(mbridge, path)
    _assert_matches_hf(_mbridge_model(mbridge, path), path, input_ids)


def test_mbridge_moe_local_spec_names(mbridge: ModuleType, checkpoint, input_ids) -> None:
    path = checkpoint()
    with ADJUSTMENTS["mbridge.moe_local_spec_names"].suspended():
        with pytest.raises(NotImplementedError, match="Unsupported parameter name: decoder.layers.0.input_layernorm"):
            _mbridge_model(mbridge, path)
    _assert_matches_hf(_mbridge_model(mbridge, path), path, input_ids)


def test_mbridge_sequential_mlp_expert_names(mbridge: ModuleType, checkpoint, input_ids) -> None:
    path = checkpoint()
    with ADJUSTMENTS["mbridge.sequential_mlp_expert_names"].suspended():
        with pytest.raises(NotImplementedError, match=r"Unsupported parameter name: .*local_experts\.0\.linear_fc1"):
            _mbridge_model(mbridge, path)

    model = _mbridge_model(mbridge, path)
    _assert_matches_hf(model, path, input_ids)
    bridge = mbridge.AutoBridge.from_pretrained(str(path), dtype=torch.float32)
    hf, exported = load_file(path / "model.safetensors"), dict(bridge.export_weights([model]))
    assert exported.keys() == hf.keys()
    assert [name for name in hf if not torch.equal(hf[name], exported[name])] == []


def test_applying_twice_is_harmless(megatron_bridge: ModuleType, mbridge: ModuleType) -> None:
    from mbridge.core.bridge import Bridge
    from megatron.bridge.models.qwen.qwen3_moe_bridge import Qwen3MoEBridge

    before = (Qwen3MoEBridge.provider_bridge, Qwen3MoEBridge.mapping_registry,
              Bridge._weight_name_mapping_mcore_local_to_global)
    assert all(adjustment.apply() for adjustment in ADJUSTMENTS.values() if adjustment.needed() or adjustment.active)
    after = (Qwen3MoEBridge.provider_bridge, Qwen3MoEBridge.mapping_registry,
             Bridge._weight_name_mapping_mcore_local_to_global)
    assert all(now is then for now, then in zip(after, before, strict=True))


# GLM-4.5 through megatron-bridge's own GLM45Bridge settings (sigmoid routing with expert bias, a shared expert, the
# first layer dense, one MTP layer with routed experts)


@pytest.fixture(scope="module")
def glm_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("glm4_moe"), "glm4_moe", mtp=True,
                                moe=MoEShape(routed_scaling_factor=2.5))


def test_megatron_bridge_glm45_local_fusions(megatron_bridge: ModuleType, glm_checkpoint: Path, input_ids) -> None:
    with ADJUSTMENTS["megatron_bridge.glm45_local_fusions"].suspended():
        with pytest.raises(ValueError, match="fused permutation is not available"):
            _megatron_bridge_model(megatron_bridge, glm_checkpoint)
    _assert_matches_hf(_megatron_bridge_model(megatron_bridge, glm_checkpoint), glm_checkpoint, input_ids)


def test_megatron_bridge_glm45_sequential_expert_names(megatron_bridge: ModuleType, glm_checkpoint: Path,
                                                      input_ids) -> None:
    with ADJUSTMENTS["megatron_bridge.glm45_sequential_expert_names"].suspended():
        with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'megatron_module'"):
            _megatron_bridge_model(megatron_bridge, glm_checkpoint)

    model = _megatron_bridge_model(megatron_bridge, glm_checkpoint)
    hf, state = load_file(glm_checkpoint / "model.safetensors"), model.state_dict()
    name = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"
    assert torch.equal(state[name], hf["model.layers.1.mlp.experts.3.down_proj.weight"])
    assert torch.equal(state["mtp.layers.0.mtp_model_layer.mlp.experts.local_experts.3.linear_fc2.weight"],
                       hf["model.layers.2.mlp.experts.3.down_proj.weight"])
    assert torch.equal(state["decoder.layers.1.mlp.router.expert_bias"],
                       hf["model.layers.1.mlp.gate.e_score_correction_bias"])
    _assert_matches_hf(model, glm_checkpoint, input_ids)


def test_megatron_bridge_glm45_mtp_copies(megatron_bridge: ModuleType, glm_checkpoint: Path, tmp_path: Path) -> None:
    model = _megatron_bridge_model(megatron_bridge, glm_checkpoint)
    bridge = megatron_bridge.AutoBridge.from_hf_pretrained(glm_checkpoint)
    hf = load_file(glm_checkpoint / "model.safetensors")
    copies = {"model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight"}  # GLM-4.5-Air's index
    with ADJUSTMENTS["megatron_bridge.glm45_mtp_copies"].suspended():
        assert set(hf) - dict(bridge.export_hf_weights([model], cpu=True, show_progress=False)).keys() == copies
    exported = dict(bridge.export_hf_weights([model], cpu=True, show_progress=False))
    assert exported.keys() == hf.keys()
    assert [name for name in hf if not torch.equal(hf[name], exported[name])] == []


# Qwen3.5-MoE through megatron-bridge's own Qwen35MoEBridge settings (gated DeltaNet and gated attention layers with
# routed experts and a gated shared expert, the MTP layer's experts one by one, or packed as Qwen3.6 stores them)


@pytest.fixture(scope="module")
def qwen3_5_moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[bool], Path]:
    made: dict[bool, Path] = {}

    def get(packed_mtp_experts: bool = False) -> Path:
        if packed_mtp_experts not in made:
            made[packed_mtp_experts] = make_tiny_checkpoint(
                tmp_path_factory.mktemp(f"qwen3_5_moe_packed{packed_mtp_experts}"), "qwen3_5_moe_text", mtp=True,
                moe=MoEShape(packed_mtp_experts=packed_mtp_experts))
        return made[packed_mtp_experts]

    return get


def test_megatron_bridge_qwen35_moe_unfused_permutation(megatron_bridge: ModuleType, qwen3_5_moe_checkpoint,
                                                        input_ids) -> None:
    path = qwen3_5_moe_checkpoint()
    with ADJUSTMENTS["megatron_bridge.qwen35_moe_unfused_permutation"].suspended():
        with pytest.raises(ValueError, match="fused permutation is not available"):
            _megatron_bridge_model(megatron_bridge, path)
    _assert_matches_hf(_megatron_bridge_model(megatron_bridge, path), path, input_ids)


@pytest.mark.parametrize("packed_mtp_experts", [False, True])
def test_megatron_bridge_qwen35_moe_sequential_mtp_expert_names(megatron_bridge: ModuleType, qwen3_5_moe_checkpoint,
                                                                packed_mtp_experts: bool) -> None:
    path = qwen3_5_moe_checkpoint(packed_mtp_experts)
    with ADJUSTMENTS["megatron_bridge.qwen35_moe_sequential_mtp_expert_names"].suspended():
        with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'megatron_module'"):
            _megatron_bridge_model(megatron_bridge, path)

    model = _megatron_bridge_model(megatron_bridge, path)
    hf, state = load_file(path / "model.safetensors"), model.state_dict()
    experts = "mtp.layers.0.mtp_model_layer.mlp.experts.local_experts.3"
    down = hf["mtp.layers.0.mlp.experts.down_proj"][3] if packed_mtp_experts else (
        hf["mtp.layers.0.mlp.experts.3.down_proj.weight"])
    assert torch.equal(state[f"{experts}.linear_fc2.weight"], down)
    bridge = megatron_bridge.AutoBridge.from_hf_pretrained(path)
    exported = dict(bridge.export_hf_weights([model], cpu=True, show_progress=False))
    assert exported.keys() == hf.keys()
    assert [name for name in hf if not torch.equal(hf[name], exported[name])] == []
