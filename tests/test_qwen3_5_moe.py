"""Qwen3.5-MoE (`qwen3_5_moe_text`) end to end on the CPU through megatron-bridge: HF logits and the MTP head's at one
process, TP=2 and EP=2; bit-identical exports and restored MTP heads; packed rows; MTP-only (audited) and joint
training at EP=2, PP=2 and CP=2 (unpacked rows); the speculative evaluator with its MoE head = greedy decoding; tree
rows and packed rows under CP refused before any data is read; mbridge refused before any build.

The tiny checkpoint has Qwen3.5-35B-A3B's layout: layer 0 gated DeltaNet, layer 1 gated full attention, each with
4 routed experts (softmax top 2, renormalised) stored packed (`mlp.experts.gate_up_proj`, `down_proj`) beside a
sigmoid-gated shared expert, and its MTP layer (`mtp.*`, full attention) with the same MoE, its experts stored one by
one. The checks are tests/test_glm4_moe.py's and tests/test_qwen3_5.py's, run on this checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_megatron.bridges import BridgeError, create_bridge
from lightning_megatron.families import is_hf_mtp_tensor
from lightning_megatron.mtp.restore import restore_mtp_head
from lightning_megatron.options import ModelOptions
from lightning_megatron.testing.checkpoints import MoEShape, make_tiny_checkpoint
from tests._distributed import run_distributed
from tests.test_glm4_moe import (
    _parallel_case,
    _tensors,
    assert_logits_mtp_head_and_round_trip,
    assert_packed_equals_one_sequence_per_row,
    assert_parallel_results,
    assert_restoring_the_mtp_head_round_trips,
)
from tests.test_moe import SAMPLES, fit_shortened_config
from tests.test_qwen3_5 import (
    _mtp_head_difference,
    assert_the_fresh_head_norms_scale_by_one,
    assert_the_speculative_decoder_is_greedy_decoding,
    assert_tree_rows_and_packed_rows_under_context_parallelism_are_refused,
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3_5_moe")
    return {"mtp": make_tiny_checkpoint(root / "mtp", "qwen3_5_moe_text", mtp=True),
            "plain": make_tiny_checkpoint(root / "plain", "qwen3_5_moe_text")}


# one process ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mtp", [False, True])
def test_logits_mtp_head_and_round_trip(model_parallel, checkpoints, tmp_path, mtp):
    assert_logits_mtp_head_and_round_trip(checkpoints["mtp"], tmp_path, mtp)


def test_qwen3_6s_packed_mtp_experts_load_export_and_restore_bit_for_bit(model_parallel, tmp_path):
    """Qwen3.6 stores its MTP layer's experts packed too (megatron-bridge picks the mapping by the checkpoint's
    names): the same logits, MTP head and exports, and a restored head keeps the layout."""
    path = make_tiny_checkpoint(tmp_path / "qwen3_6", "qwen3_5_moe_text", mtp=True,
                                moe=MoEShape(packed_mtp_experts=True))
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in _tensors(path)
    assert_logits_mtp_head_and_round_trip(path, tmp_path, mtp=True)
    assert_restoring_the_mtp_head_round_trips(path, tmp_path)


def test_the_layers_and_the_router_are_the_checkpoints(model_parallel, checkpoints):
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.utils import get_model_config

    chunk = create_bridge("megatron-bridge", checkpoints["mtp"]).build(ModelOptions(mtp=True))[0]
    config = get_model_config(chunk)
    assert (config.linear_attention_freq, config.attention_output_gate) == ([1, 0], True)
    assert (config.moe_router_score_function, config.moe_router_pre_softmax, config.moe_router_topk) == (
        "softmax", False, 2)
    assert (config.moe_shared_expert_gate, config.moe_shared_expert_intermediate_size) == (True, 64)
    assert isinstance(chunk.decoder.layers[0].self_attention, GatedDeltaNet)
    mtp_layer = chunk.mtp.layers[0].mtp_model_layer
    assert not isinstance(mtp_layer.self_attention, GatedDeltaNet)
    assert type(mtp_layer.mlp).__name__ == "MoELayer"
    assert torch.equal(mtp_layer.mlp.shared_experts.gate_weight,
                       _tensors(checkpoints["mtp"])["mtp.layers.0.mlp.shared_expert_gate.weight"])


def test_mbridge_is_refused_before_the_build_naming_megatron_bridge(model_parallel, checkpoints):
    with pytest.raises(BridgeError, match=r"bridge_type: mbridge does not map .*'qwen3_5_moe_text' checkpoints"
                                          r".*; set bridge_type: megatron-bridge"):
        create_bridge("mbridge", checkpoints["mtp"]).validate(ModelOptions())


def test_restoring_the_mtp_head_round_trips_bit_for_bit(model_parallel, checkpoints, tmp_path):
    assert_restoring_the_mtp_head_round_trips(checkpoints["mtp"], tmp_path)


def test_a_head_copied_from_the_last_layer_stores_its_packed_experts_one_by_one(model_parallel, checkpoints,
                                                                                tmp_path):
    restored = restore_mtp_head(checkpoints["plain"], tmp_path / "restored", init="copy-last-layer")
    written, expected = _tensors(restored), _tensors(checkpoints["mtp"])
    assert {n: tuple(t.shape) for n, t in written.items()} == {n: tuple(t.shape) for n, t in expected.items()}
    gate, up = written["model.layers.1.mlp.experts.gate_up_proj"][3].chunk(2)
    assert torch.equal(written["mtp.layers.0.mlp.experts.3.gate_proj.weight"], gate)
    assert torch.equal(written["mtp.layers.0.mlp.experts.3.up_proj.weight"], up)
    assert torch.equal(written["mtp.layers.0.mlp.experts.3.down_proj.weight"],
                       written["model.layers.1.mlp.experts.down_proj"][3])
    assert_the_fresh_head_norms_scale_by_one(written)
    assert _mtp_head_difference(create_bridge("megatron-bridge", restored).build(ModelOptions(mtp=True))[0],
                                restored) <= 1e-5


def test_tree_rows_and_packed_rows_under_context_parallelism_are_refused_before_any_data_is_read(checkpoints):
    assert_tree_rows_and_packed_rows_under_context_parallelism_are_refused(checkpoints["mtp"])


def test_packed_thd_equals_one_sequence_per_row(model_parallel, checkpoints):
    """Gated DeltaNet layers (each sequence from a zero state), THD attention, routed and shared experts and the MTP
    rolls on a pack made by the data pipeline, against one sequence per padded row: losses and every gradient. The
    padded rows route their padding too, so the load-balancing loss (over all routed tokens) is left out."""
    assert_packed_equals_one_sequence_per_row(checkpoints["mtp"], config_overrides={"moe_aux_loss_coeff": 0.0})


def test_the_draft_head_equals_the_reference_and_speculative_decoding_is_greedy(checkpoints):
    assert_the_speculative_decoder_is_greedy_decoding(checkpoints["mtp"])


# two processes: TP=2, EP=2, MTP-only and joint training, context parallelism --------------------------------------


@pytest.mark.slow
def test_tensor_expert_and_context_parallel_mtp_only_and_joint_training(checkpoints, tmp_path):
    """Also a joint fit at CP=2 on unpacked rows against EP=2 (CP=1) on the same global batches: megatron-core's head
    all-to-all around the gated DeltaNet, SDPA over the gathered keys in the attention layers, the experts on each
    rank's chunks (packed rows under CP are refused before any data is read, above)."""
    results = run_distributed(_parallel_case, tmp_path, str(tmp_path), str(checkpoints["mtp"]), SAMPLES,
                              ("ep2", "pp2", "cp2"), False)
    assert all("cp2" in result["joint"] for result in results)
    assert_parallel_results(results, checkpoints["mtp"])


@pytest.mark.slow
def test_the_tiny_qwen3_5_moe_config_trains_the_mtp_head_on_two_processes(tmp_path):
    """`lightning-megatron fit --config configs/tiny/qwen3_5_moe_mtp_only.yaml`, shortened, writing under tmp_path: the
    multimodal form (`qwen3_5_moe`) at EP=2, its export the original but for the MTP head."""
    fit_shortened_config("configs/tiny/qwen3_5_moe_mtp_only.yaml", tmp_path)
    assert json.loads((tmp_path / "mtp_only_audit.json").read_text())["frozen_bit_identical"]
    exported, original = _tensors(tmp_path / "hf"), _tensors(tmp_path / "tiny")
    assert exported.keys() == original.keys() and any(name.startswith("model.visual.") for name in original)
    assert {name for name in original if not torch.equal(exported[name], original[name])} == {
        name for name in original if is_hf_mtp_tensor(name)}
