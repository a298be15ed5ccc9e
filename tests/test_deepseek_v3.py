"""DeepSeek-V3 (`deepseek_v3`) end to end on the CPU through megatron-bridge: HF logits and the MTP head's at one
process, TP=2 and EP=2; bit-identical exports and restored MTP heads; packed rows and tree rows; MTP-only (audited)
and joint training, at CP=2 against CP=1 too; the speculative evaluator; group-limited routing as HF routes or
refused; mbridge refused before any build.

The tiny checkpoint has DeepSeek-V3's layout: multi-head latent attention (q-LoRA, key heads of 24 = 16 + 8 rotated
channels, value heads of 12) with YaRN RoPE (mscale 1, mscale_all_dim 1 as DeepSeek-V3), layer 0 dense, layer 1
MoE (4 experts in 2 groups, top 2 within the best group, sigmoid routing with an expert bias, one shared expert,
routed_scaling_factor 2.5), and its MTP layer stored as decoder layer 2 with its copies of the embedding and LM head.
The multi-process cases are tests/test_glm4_moe.py's, run on this checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_megatron.bridges import BridgeError, create_bridge
from lightning_megatron.moe import router_settings
from lightning_megatron.options import ModelOptions
from lightning_megatron.testing.checkpoints import MoEShape, make_tiny_checkpoint
from lightning_megatron.testing.references import hf_mtp_reference_logits
from tests._distributed import run_distributed
from tests.test_glm4_moe import (
    _parallel_case,
    _tensors,
    assert_head_copied_from_the_last_layer,
    assert_logits_mtp_head_and_round_trip,
    assert_packed_equals_one_sequence_per_row,
    assert_parallel_results,
    assert_restoring_the_mtp_head_round_trips,
    assert_tree_rows_equal_each_sequence_alone,
)
from tests.test_moe import _input_ids, fit_shortened_config

DEEPSEEK = MoEShape(routed_scaling_factor=2.5, n_group=2, topk_group=1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek_v3")
    return {"mtp": make_tiny_checkpoint(root / "mtp", "deepseek_v3", mtp=True, moe=DEEPSEEK),
            "plain": make_tiny_checkpoint(root / "plain", "deepseek_v3", moe=DEEPSEEK),
            # Moonlight's layout: the query projected by q_proj alone (q_lora_rank: null), two shared experts, one
            # expert group, plain RoPE
            "moonlight": make_tiny_checkpoint(root / "moonlight", "deepseek_v3", mtp=True, moe=MoEShape(
                routed_scaling_factor=2.446), config={"q_lora_rank": None, "n_shared_experts": 2, "rope_parameters": {
                    "rope_type": "default", "rope_theta": 5e4}}),
            # routed experts alone: no shared-expert tensors (HF builds a shared MLP of no channels)
            "unshared": make_tiny_checkpoint(root / "unshared", "deepseek_v3", mtp=True, moe=DEEPSEEK,
                                             config={"n_shared_experts": 0})}


# one process ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mtp", [False, True])
def test_logits_mtp_head_and_round_trip(model_parallel, checkpoints, tmp_path, mtp):
    assert_logits_mtp_head_and_round_trip(checkpoints["mtp"], tmp_path, mtp)


def test_a_query_without_lora_logits_mtp_head_and_round_trip(model_parallel, checkpoints, tmp_path):
    assert_logits_mtp_head_and_round_trip(checkpoints["moonlight"], tmp_path, True)


def test_no_shared_experts_logits_mtp_head_round_trip_and_draft_head(model_parallel, checkpoints, tmp_path):
    """n_shared_experts: 0 builds no shared expert (Megatron-Core refuses a size of 0), and the reference and the
    speculative evaluator's target and draft head load the checkpoint without the shared MLP's empty tensors."""
    from lightning_megatron.speculative import load_mtp_head, load_target

    path = checkpoints["unshared"]
    assert_logits_mtp_head_and_round_trip(path, tmp_path, True)
    target = load_target(path)
    input_ids = _input_ids()
    positions = torch.arange(input_ids.shape[1] - 1).expand(input_ids.shape[0], -1)
    with torch.no_grad():
        hidden = target.model(input_ids=input_ids).last_hidden_state[:, :-1]
        draft = load_mtp_head(path, target)(hidden, input_ids[:, 1:], positions)
    assert float((draft - hf_mtp_reference_logits(path, input_ids)).abs().max()) <= 1e-5


def test_mla_yarn_and_the_router_are_the_checkpoints(model_parallel, checkpoints):
    from megatron.core.utils import get_model_config

    from lightning_megatron.attention import SDPAttention

    chunk = create_bridge("megatron-bridge", checkpoints["mtp"]).build(ModelOptions(mtp=True))[0]
    config = get_model_config(chunk)
    assert config.multi_latent_attention and (config.q_lora_rank, config.kv_lora_rank) == (32, 16)
    assert (config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == (16, 8, 12)
    assert (config.rope_type, config.rotary_scaling_factor, config.original_max_position_embeddings) == ("yarn", 4, 128)
    assert (config.mscale, config.mscale_all_dim) == (1.0, 1.0)
    for attention in (chunk.decoder.layers[0].self_attention, chunk.mtp.layers[0].mtp_model_layer.self_attention):
        assert type(attention.core_attention) is SDPAttention
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (2, 1)
    assert (config.moe_router_score_function, config.moe_router_topk_scaling_factor) == ("sigmoid", 2.5)
    assert (config.moe_layer_freq, config.moe_router_bias_update_rate) == ([0, 1], 0.0)
    assert type(chunk.mtp.layers[0].mtp_model_layer.mlp).__name__ == "MoELayer"
    assert torch.equal(chunk.mtp.layers[0].mtp_model_layer.mlp.router.expert_bias,
                       _tensors(checkpoints["mtp"])["model.layers.2.mlp.gate.e_score_correction_bias"])


def _hf_and_megatron_routes(top_k: int, groups: int, group_topk: int) -> tuple[torch.Tensor, ...]:
    """The experts and weights HF's DeepseekV3MoE and Megatron-Core's router pick for the same random logits."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = DeepseekV3Config(hidden_size=8, moe_intermediate_size=4, n_routed_experts=16, n_group=groups,
                              topk_group=group_topk, num_experts_per_tok=top_k, routed_scaling_factor=2.5)
    hf = DeepseekV3MoE(config)
    generator = torch.Generator().manual_seed(0)
    hf.gate.e_score_correction_bias.copy_(0.1 * torch.randn(16, generator=generator))
    logits = torch.randn(256, 16, generator=generator)
    hf_experts, hf_weights = hf.route_tokens_to_experts(logits)
    weights, experts = topk_routing_with_score_function(
        logits, top_k, use_pre_softmax=False, num_groups=groups, group_topk=group_topk, scaling_factor=2.5,
        score_function="sigmoid", expert_bias=hf.gate.e_score_correction_bias, dense_output=True)
    hf_order, order = hf_experts.argsort(dim=-1), experts.argsort(dim=-1)
    return (hf_experts.gather(1, hf_order), hf_weights.gather(1, hf_order), experts.gather(1, order),
            weights.gather(1, order))


@pytest.mark.parametrize(("top_k", "groups", "group_topk"), [(2, 4, 1), (4, 4, 2), (5, 4, 2), (3, 4, 4), (3, 4, 1),
                                                             (6, 4, 2)])
def test_group_limited_routing_is_hfs_exactly_where_router_settings_accept_it(top_k, groups, group_topk):
    """Megatron-Core scores a group by its best top_k // topk_group experts, HF by its best 2: the same routes where
    that is 2 or every group is kept; router_settings refuses the rest, naming the fields."""
    hf_experts, hf_weights, experts, weights = _hf_and_megatron_routes(top_k, groups, group_topk)
    config = {"model_type": "deepseek_v3", "n_routed_experts": 16, "num_experts_per_tok": top_k, "n_group": groups,
              "topk_group": group_topk, "moe_intermediate_size": 4, "num_hidden_layers": 2}
    if top_k // group_topk == 2 or group_topk == groups:
        assert torch.equal(experts, hf_experts)
        torch.testing.assert_close(weights, hf_weights, rtol=0, atol=1e-6)
        assert router_settings(config)["moe_router_num_groups"] == groups
    else:
        assert not torch.equal(experts, hf_experts)
        with pytest.raises(ValueError, match=rf"num_experts_per_tok: {top_k} with topk_group: {group_topk} of "
                                             rf"n_group: {groups} is not routable the HF way"):
            router_settings(config)


def test_mbridge_is_refused_before_the_build_naming_megatron_bridge(model_parallel, checkpoints):
    with pytest.raises(BridgeError, match=r"bridge_type: mbridge does not map the experts of 'deepseek_v3' "
                                          r"checkpoints .*; set bridge_type: megatron-bridge"):
        create_bridge("mbridge", checkpoints["mtp"]).validate(ModelOptions())


def test_restoring_the_mtp_head_round_trips_bit_for_bit(model_parallel, checkpoints, tmp_path):
    assert_restoring_the_mtp_head_round_trips(checkpoints["mtp"], tmp_path)


def test_a_head_copied_from_the_last_layer_has_mla_experts_and_the_shared_tensors(model_parallel, checkpoints,
                                                                                  tmp_path):
    restored = assert_head_copied_from_the_last_layer(checkpoints, tmp_path, "self_attn.kv_b_proj.weight")
    assert create_bridge("megatron-bridge", restored).build(ModelOptions(mtp=True))


def test_packed_thd_equals_one_sequence_per_row(model_parallel, checkpoints):
    """MLA (its value heads padded to the key heads' size for THD by Megatron-Core, multi_latent_attention.py:85-108),
    YaRN, routed experts and the MTP rolls on a pack against one sequence per row: losses and every gradient."""
    assert_packed_equals_one_sequence_per_row(checkpoints["mtp"])


def test_tree_rows_equal_each_sequence_alone(model_parallel, checkpoints):
    """Tree-packed rows: every MLA layer's own YaRN table gathered at each token's depth (`tree_rotary`)."""
    assert_tree_rows_equal_each_sequence_alone(checkpoints["plain"])


def test_the_draft_head_equals_the_reference_and_speculative_decoding_is_greedy(checkpoints):
    """The speculative evaluator's HF draft head (MLA with its own KV cache, routed experts) against the cache-free
    reference, then 1- and 2-token drafting against greedy decoding, token for token."""
    from lightning_megatron.speculative import greedy_decode, load_mtp_head, load_target, speculative_decode

    path = checkpoints["mtp"]
    target = load_target(path)
    head = load_mtp_head(path, target)
    input_ids = _input_ids()
    positions = torch.arange(input_ids.shape[1] - 1).expand(input_ids.shape[0], -1)
    with torch.no_grad():
        hidden = target.model(input_ids=input_ids).last_hidden_state[:, :-1]
        draft = head(hidden, input_ids[:, 1:], positions)
    assert float((draft - hf_mtp_reference_logits(path, input_ids)).abs().max()) <= 1e-5
    for prompt in input_ids[:, :6].tolist():
        greedy = greedy_decode(target, prompt, 12, ())
        for drafts in (1, 2):
            assert speculative_decode(target, head, prompt, 12, (), num_draft_tokens=drafts).tokens == greedy.tokens


# two processes: TP=2, EP=2, MTP-only and joint training, context parallelism --------------------------------------


@pytest.mark.slow
def test_tensor_expert_and_context_parallel_mtp_only_and_joint_training(checkpoints, tmp_path):
    """MTP-only on 4 sequences, each step's global batch: the MTP loss falls on the sequences it trains on (new random
    sequences every step leave a change of this size within their own spread). Joint fits at CP=2 against CP=1 (DP=2)
    on the same global batches, packed and padded: losses every step and the exports (1e-5); MLA's YaRN rotary
    embedding cut for CP, its keys and values gathered by the SDPA core attention."""
    results = run_distributed(_parallel_case, tmp_path, str(tmp_path), str(checkpoints["mtp"]), 4, ("ep2", "pp2"),
                              True)
    assert_parallel_results(results, checkpoints["mtp"])


@pytest.mark.slow
def test_the_tiny_deepseek_config_trains_the_mtp_head_on_two_processes(tmp_path):
    """`lightning-megatron fit --config configs/tiny/deepseek_v3_mtp_only.yaml`, shortened, writing under tmp_path."""
    fit_shortened_config("configs/tiny/deepseek_v3_mtp_only.yaml", tmp_path)
    assert json.loads((tmp_path / "mtp_only_audit.json").read_text())["frozen_bit_identical"]
    assert _tensors(tmp_path / "hf").keys() == _tensors(tmp_path / "tiny").keys()
