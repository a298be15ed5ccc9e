"""GLM-4.5 (`glm4_moe`) end to end on the CPU through megatron-bridge: HF logits and the MTP head's at one process,
TP=2 and EP=2; bit-identical exports and restored MTP heads; packed rows and tree rows; MTP-only (audited) and joint
training at EP=2 and PP=2, and at CP=2 against CP=1 on packed and padded rows; mbridge refused before any build.

The tiny checkpoint has GLM-4.5's layout: layer 0 dense, layer 1 MoE (sigmoid routing with an expert bias, one
shared expert, routed_scaling_factor 2.5 as in GLM-4.5), q/k/v biases, partial RoPE, and its MTP layer stored as
decoder layer 2 (routed experts, eh_proj, enorm, hnorm, shared_head.norm, copies of the embedding and LM head).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lightning_megatron.bridges import BridgeError, create_bridge
from lightning_megatron.callbacks import MTPOnlyCallback
from lightning_megatron.families import is_hf_mtp_tensor, mtp_names
from lightning_megatron.module import SFTModule
from lightning_megatron.moe import SIGMOID_ROUTER_DEFAULTS, router_settings
from lightning_megatron.mtp.restore import restore_mtp_head
from lightning_megatron.options import ModelOptions
from lightning_megatron.testing.checkpoints import MoEShape, make_tiny_checkpoint
from lightning_megatron.testing.references import hf_mtp_reference_logits
from tests._adam import comparable_adam_eps
from tests._distributed import run_distributed
from tests.test_moe import (
    LR,
    SAMPLES,
    SEQ,
    _assert_only_mtp_moved,
    _fit,
    _input_ids,
    _logits_difference,
    _mtp_only_module,
    _same_tensors,
    fit_shortened_config,
)

GLM = MoEShape(routed_scaling_factor=2.5)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("glm4_moe")
    return {"mtp": make_tiny_checkpoint(root / "mtp", "glm4_moe", mtp=True, moe=GLM),
            "plain": make_tiny_checkpoint(root / "plain", "glm4_moe", moe=GLM),
            # GLM-4.6's q/k norms; heads wider than hidden / heads (GLM-4.5-Air: 96 x 128 over 4096); RoPE on every
            # channel, given in rope_parameters only (transformers 5 keeps the attribute at its default, 0.5); two
            # shared experts, one MLP of 2 x moe_intermediate_size (every published GLM checkpoint has one)
            "variant": make_tiny_checkpoint(root / "variant", "glm4_moe", mtp=True, moe=GLM, head_dim=32,
                                            config={"use_qk_norm": True, "partial_rotary_factor": 1.0,
                                                    "n_shared_experts": 2}),
            # the LM head tied to the embedding (no lm_head.weight; megatron-bridge's GLM-4.5 provider unties it)
            "tied": make_tiny_checkpoint(root / "tied", "glm4_moe", mtp=True, moe=GLM, tied=True)}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def _mtp_head_difference(chunk: torch.nn.Module, hf_checkpoint: Path) -> float:
    """Max |Megatron's MTP-head logits - the independent HF reference's| (one process)."""
    captured = {}
    chunk.mtp.register_forward_hook(lambda module, args, output: captured.update(hidden=output.detach().clone()))
    input_ids = _input_ids()
    _logits_difference(chunk, hf_checkpoint)  # the forward that fills `captured`
    weight = chunk.shared_embedding_or_output_weight() if chunk.share_embeddings_and_output_weights else None
    with torch.no_grad():
        logits, _ = chunk.output_layer(captured["hidden"][SEQ:], weight)
    return float((logits.transpose(0, 1)[:, :-1] - hf_mtp_reference_logits(hf_checkpoint, input_ids)).abs().max())


def _build_check_and_export(hf_checkpoint: Path, export: Path, mtp: bool) -> dict[str, Any]:
    from megatron.core import parallel_state

    bridge = create_bridge("megatron-bridge", hf_checkpoint)
    tensor_parallel = parallel_state.get_tensor_model_parallel_world_size() > 1
    chunks = bridge.build(ModelOptions(mtp=mtp, sequence_parallel=tensor_parallel))
    result = {"logits": _logits_difference(chunks[0], hf_checkpoint)}
    bridge.save_hf(chunks, export)
    result["exported"] = set(_tensors(export))
    result["export_unequal"] = [name for name, tensor in _tensors(export).items()
                                if not torch.equal(tensor, _tensors(hf_checkpoint)[name])]
    return result


# one process ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mtp", [False, True])
def test_logits_mtp_head_and_round_trip(model_parallel, checkpoints, tmp_path, mtp):
    assert_logits_mtp_head_and_round_trip(checkpoints["mtp"], tmp_path, mtp)


def test_qk_norms_wide_heads_full_rotary_and_two_shared_experts_logits_mtp_head_and_round_trip(model_parallel,
                                                                                               checkpoints, tmp_path):
    assert_logits_mtp_head_and_round_trip(checkpoints["variant"], tmp_path, True)


def test_tied_embeddings_logits_mtp_head_and_round_trip(model_parallel, checkpoints, tmp_path):
    """The output layer is the embedding, and the export writes the MTP layer's copy of the LM head from it."""
    assert_logits_mtp_head_and_round_trip(checkpoints["tied"], tmp_path, True)


def assert_logits_mtp_head_and_round_trip(path: Path, tmp_path: Path, mtp: bool) -> None:
    """HF logits and the MTP head's (1e-5) at one process; the export bit-identical, the MTP layer kept or dropped."""
    result = _build_check_and_export(path, tmp_path / "export", mtp)
    assert result["logits"] <= 1e-5
    assert result["export_unequal"] == []
    config = json.loads((path / "config.json").read_text())
    assert result["exported"] == {name for name in _tensors(path) if mtp or not is_hf_mtp_tensor(name, config)}
    if mtp:
        chunk = create_bridge("megatron-bridge", path).build(ModelOptions(mtp=True))[0]
        assert _mtp_head_difference(chunk, path) <= 1e-5


def test_the_router_is_the_checkpoints(model_parallel, checkpoints):
    from megatron.core.utils import get_model_config

    chunk = create_bridge("megatron-bridge", checkpoints["mtp"]).build(ModelOptions(mtp=True))[0]
    config = get_model_config(chunk)
    assert (config.moe_router_score_function, config.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert (config.moe_router_topk_scaling_factor, config.moe_router_bias_update_rate) == (2.5, 0.0)
    assert (config.moe_layer_freq, config.moe_shared_expert_intermediate_size) == ([0, 1], 32)
    assert type(chunk.decoder.layers[0].mlp).__name__ == "MLP"  # first_k_dense_replace: 1
    assert type(chunk.mtp.layers[0].mtp_model_layer.mlp).__name__ == "MoELayer"  # as GLM-4.5 stores it
    hf = _tensors(checkpoints["mtp"])
    assert torch.equal(chunk.mtp.layers[0].mtp_model_layer.mlp.router.expert_bias,
                       hf["model.layers.2.mlp.gate.e_score_correction_bias"])


def test_router_settings_refuse_what_megatron_cannot_route():
    base = {"model_type": "glm4_moe", "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "num_hidden_layers": 2, "first_k_dense_replace": 1, "norm_topk_prob": True}
    assert router_settings(base)["moe_router_score_function"] == "sigmoid"
    # HF's shared experts are one MLP of moe_intermediate_size * n_shared_experts (modeling_glm4_moe.py:378-380);
    # megatron-bridge's GLM-4.5 bridge sizes it moe_intermediate_size alone (glm/glm45_bridge.py:88), and a checkpoint
    # with two would fail to load (a shape error) without the size from here
    assert router_settings({**base, "n_shared_experts": 2})["moe_shared_expert_intermediate_size"] == 64
    # none: HF's shared MLP of no channels adds zero; Megatron-Core refuses a size of 0 and builds none for None
    assert router_settings({**base, "n_shared_experts": 0})["moe_shared_expert_intermediate_size"] is None
    with pytest.raises(ValueError, match="norm_topk_prob: false with sigmoid routing"):
        router_settings({**base, "norm_topk_prob": False})
    with pytest.raises(ValueError, match=r"group-limited routing \(n_group: 2"):
        router_settings({**base, "n_group": 2, "topk_group": 1})


@pytest.mark.parametrize("model_type", ["glm4_moe", "deepseek_v3"])
def test_router_fields_a_config_leaves_out_mean_what_they_mean_in_transformers(model_type):
    """A config.json without first_k_dense_replace, routed_scaling_factor, ... gets transformers' class defaults
    (GLM-4.5: one dense layer; DeepSeek-V3: three, scaled by 2.5, 8 groups), not 0 dense layers and a scale of 1."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type)
    assert {key: getattr(defaults, key) for key in SIGMOID_ROUTER_DEFAULTS[model_type]} == \
        SIGMOID_ROUTER_DEFAULTS[model_type]
    settings = router_settings({"model_type": model_type, "n_routed_experts": 16, "num_experts_per_tok": 8,
                                "moe_intermediate_size": 4, "num_hidden_layers": 4})
    dense = defaults.first_k_dense_replace
    assert settings["moe_layer_freq"] == [0] * dense + [1] * (4 - dense)
    assert settings["moe_router_topk_scaling_factor"] == defaults.routed_scaling_factor
    assert settings["moe_shared_expert_intermediate_size"] == 4 * defaults.n_shared_experts
    assert settings.get("moe_router_num_groups", 1) == defaults.n_group


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_a_top_1_router_is_hfs_exactly_where_router_settings_accept_it(norm_topk_prob):
    """Megatron-Core weights a lone top-1 sigmoid as it is (moe_utils.topk_routing_with_score_function), HF with
    norm_topk_prob divides it by itself: the same weights without it; refused, naming both fields, with it."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

    hf = Glm4MoeMoE(Glm4MoeConfig(hidden_size=8, moe_intermediate_size=4, n_routed_experts=4, num_experts_per_tok=1,
                                  norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5))
    logits = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    hf_experts, hf_weights = hf.route_tokens_to_experts(logits)
    weights, experts = topk_routing_with_score_function(logits, 1, use_pre_softmax=False, scaling_factor=2.5,
                                                        score_function="sigmoid",
                                                        expert_bias=hf.gate.e_score_correction_bias, dense_output=True)
    assert torch.equal(experts, hf_experts)
    config = {"model_type": "glm4_moe", "n_routed_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 4,
              "num_hidden_layers": 2, "first_k_dense_replace": 1, "norm_topk_prob": norm_topk_prob}
    if norm_topk_prob:
        assert not torch.allclose(weights, hf_weights)
        with pytest.raises(ValueError, match=r"num_experts_per_tok: 1 with norm_topk_prob: true .* use a checkpoint "
                                             r"with num_experts_per_tok > 1 or norm_topk_prob: false"):
            router_settings(config)
    else:
        torch.testing.assert_close(weights, hf_weights, rtol=0, atol=1e-6)
        assert router_settings(config)["moe_router_topk"] == 1


def test_an_mtp_layer_after_dense_layers_only_is_refused_before_the_build(model_parallel, tmp_path):
    """first_k_dense_replace: num_hidden_layers: HF's MTP layer (past the dense ones) has routed experts, Megatron-Core
    would build it as the last (dense) decoder layer; without the MTP layer the checkpoint builds."""
    path = make_tiny_checkpoint(tmp_path / "dense", "glm4_moe", mtp=True, moe=MoEShape(first_dense_layers=2))
    bridge = create_bridge("megatron-bridge", path)
    with pytest.raises(BridgeError, match=r"first_k_dense_replace: 2 makes all 2 decoder layers dense.*set mtp: "
                                          r"false, or use a checkpoint with first_k_dense_replace < num_hidden_layers"):
        bridge.validate(ModelOptions(mtp=True))
    bridge.validate(ModelOptions(mtp=False))


def test_mbridge_is_refused_before_the_build_naming_megatron_bridge(model_parallel, checkpoints):
    with pytest.raises(BridgeError, match=r"bridge_type: mbridge does not map the experts of 'glm4_moe' checkpoints "
                                          r".*; set bridge_type: megatron-bridge"):
        create_bridge("mbridge", checkpoints["mtp"]).validate(ModelOptions())


def test_restoring_the_mtp_head_round_trips_bit_for_bit(model_parallel, checkpoints, tmp_path):
    assert_restoring_the_mtp_head_round_trips(checkpoints["mtp"], tmp_path)


def assert_restoring_the_mtp_head_round_trips(original: Path, tmp_path: Path) -> None:
    """Export without MTP, restore the head from the original, build and export again: bit for bit."""
    bridge = create_bridge("megatron-bridge", original)
    finetuned = bridge.save_hf(bridge.build(ModelOptions(mtp=False)), tmp_path / "finetuned")
    original_config = json.loads((original / "config.json").read_text())
    assert not any(is_hf_mtp_tensor(name, original_config) for name in _tensors(finetuned))
    restored = restore_mtp_head(finetuned, tmp_path / "restored", source=original)
    assert _same_tensors(original, restored) == []
    assert json.loads((restored / "config.json").read_text()) == json.loads((original / "config.json").read_text())
    bridge = create_bridge("megatron-bridge", restored)
    assert _same_tensors(original, bridge.save_hf(bridge.build(ModelOptions(mtp=True)), tmp_path / "exported")) == []


def test_a_head_copied_from_the_last_layer_has_its_experts_and_the_shared_tensors(model_parallel, checkpoints,
                                                                                  tmp_path):
    restored = assert_head_copied_from_the_last_layer(checkpoints, tmp_path, "self_attn.q_proj.bias")
    written = _tensors(restored)
    chunk = create_bridge("megatron-bridge", restored).build(ModelOptions(mtp=True))[0]
    assert torch.equal(chunk.mtp.layers[0].mtp_model_layer.mlp.router.expert_bias,
                       written["model.layers.1.mlp.gate.e_score_correction_bias"])


def assert_head_copied_from_the_last_layer(checkpoints: dict[str, Path], tmp_path: Path, attention_tensor: str
                                           ) -> Path:
    """`--init copy-last-layer` on the plain checkpoint: the MTP checkpoint's names and shapes, the shared tensors'
    copies, and layer 1's experts, expert bias and `attention_tensor` in MTP layer 2; returns the restored folder."""
    restored = restore_mtp_head(checkpoints["plain"], tmp_path / "restored", init="copy-last-layer")
    written, expected = _tensors(restored), _tensors(checkpoints["mtp"])
    assert {n: tuple(t.shape) for n, t in written.items()} == {n: tuple(t.shape) for n, t in expected.items()}
    config = json.loads((restored / "config.json").read_text())
    for main, copy in mtp_names(config["model_type"]).copy_names(0, config).items():
        assert torch.equal(written[copy], written[main])
    for name in ("mlp.experts.3.up_proj.weight", "mlp.gate.e_score_correction_bias", attention_tensor):
        assert torch.equal(written[f"model.layers.2.{name}"], written[f"model.layers.1.{name}"])
    return restored


def test_mtp_only_refuses_a_router_that_updates_its_expert_bias(process_group, checkpoints, tmp_path):
    module = _mtp_only_module()
    module.model_options = lambda: ModelOptions(mtp=True, config_overrides={"moe_router_bias_update_rate": 1e-3})
    with pytest.raises(ValueError, match=r"set config_overrides.moe_router_bias_update_rate: 0"):
        _fit(tmp_path, checkpoints["mtp"], 1, bridge_type="megatron-bridge", module=module,
             callbacks=(MTPOnlyCallback(),))


def test_packed_thd_equals_one_sequence_per_row(model_parallel, checkpoints):
    """The GLM-4.5 model with its MTP layer (partial RoPE, routed experts, THD attention, MTP rolls) on a pack made by
    the data pipeline, against the same sequences one per padded row: per-token losses and every gradient (the
    load-balancing coefficient is the checkpoint's 0, and no expert capacity drops tokens)."""
    assert_packed_equals_one_sequence_per_row(checkpoints["mtp"])


def assert_packed_equals_one_sequence_per_row(hf_checkpoint: Path,
                                              config_overrides: dict[str, Any] | None = None) -> None:
    """A pack made by the data pipeline against the same sequences one per padded row, through the model with its
    MTP layer (and `config_overrides`): per-token losses (1e-5) and every gradient, to 1e-5 plus 1e-5 of the
    gradient's largest entry. The gradients of the summed loss are sums over the tokens of terms up to O(10), which
    the two layouts' kernels add in other orders, and an entry summed from terms that large keeps their rounding
    however small the sum (DeepSeek-V3's embedding on one AVX-512 machine: 6.7e-6 apart, its largest entry 6.8)."""
    from torch.utils.data import default_collate

    from lightning_megatron.data.packing import collate_packed, pack_examples, pad_example
    from lightning_megatron.data.tokenize import TokenizedExample
    from tests.test_attention import _per_token_loss_and_grads

    generator = torch.Generator().manual_seed(0)
    lengths, row = [9, 1, 6, 5], 32
    examples = [TokenizedExample(f"s:{i}", torch.randint(0, 384, (n,), generator=generator),
                                 torch.rand(n, generator=generator) < 0.7) for i, n in enumerate(lengths)]
    packed = collate_packed([pack_examples(examples, row, pad_id=0)])
    rows = default_collate([pad_example(example, row, pad_id=0) for example in examples])
    options = ModelOptions(mtp=True, config_overrides=config_overrides or {})
    chunk = create_bridge("megatron-bridge", hf_checkpoint).build(options)[0]
    packed_loss, packed_grads = _per_token_loss_and_grads(chunk, packed)
    rows_loss, rows_grads = _per_token_loss_and_grads(chunk, rows)
    for index, (start, n) in enumerate(zip(packed["cu_seqlens"][:-1].tolist(), lengths)):
        torch.testing.assert_close(packed_loss[0, start:start + n], rows_loss[index, :n], rtol=0, atol=1e-5)
    assert any(name.startswith("mtp.") and ".local_experts." in name for name in packed_grads)
    for name, grad in rows_grads.items():
        tolerance = 1e-5 + 1e-5 * float(grad.abs().max())
        torch.testing.assert_close(packed_grads[name], grad, rtol=0, atol=tolerance, msg=name)


def test_tree_rows_equal_each_sequence_alone(model_parallel, checkpoints):
    """Tree-packed rows through the model without its MTP layer: the partial RoPE's table (the first half of each
    head's channels rotated) gathered at each token's depth (`tree_rotary`), the experts routing every token."""
    assert_tree_rows_equal_each_sequence_alone(checkpoints["plain"])


def assert_tree_rows_equal_each_sequence_alone(hf_checkpoint: Path) -> None:
    """Each sequence's logits along its path in the tree rows equal the sequence run alone (1e-5)."""
    from tests.test_tree_rotary import _max_path_difference, branched_examples

    chunk = create_bridge("megatron-bridge", hf_checkpoint).build(ModelOptions())[0].eval()
    with torch.no_grad():
        assert _max_path_difference(chunk, branched_examples()) <= 1e-5


# two processes: TP=2, EP=2, MTP-only and joint training, context parallelism --------------------------------------

JOINT_LAYOUTS = {"ep2": dict(expert_model_parallel_size=2), "pp2": dict(pipeline_model_parallel_size=2),
                 "cp2": dict(context_parallel_size=2)}
CONTEXT_PARALLEL_STEPS = 2  # the second step's losses and the export follow every gradient of the first


def _parallel_case(rank: int, world_size: int, tmp: str, hf_checkpoint: str, mtp_only_samples: int = SAMPLES,
                   joint: tuple[str, ...] = ("ep2", "pp2"), context_parallel_rows: bool = False) -> dict[str, Any]:
    """TP=2 and EP=2 builds, an MTP-only fit at EP=2 (on `mtp_only_samples` sequences), joint fits in the `joint`
    layouts of `JOINT_LAYOUTS` and, with `context_parallel_rows`, joint fits at CP=2 and CP=1 on packed and on padded
    rows (`tests/test_context_parallel.py`)."""
    from megatron.core import parallel_state, tensor_parallel

    from lightning_megatron._compat import prepare_megatron_core
    from tests.test_context_parallel import _joint_fits

    root, checkpoint = Path(tmp), Path(hf_checkpoint)
    prepare_megatron_core()
    result: dict[str, Any] = {}
    for name, sizes in (("tp2", dict(tensor_model_parallel_size=2)), ("ep2", dict(expert_model_parallel_size=2))):
        parallel_state.initialize_model_parallel(**sizes)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        result[name] = _build_check_and_export(checkpoint, root / f"{name}_export", mtp=True)
        parallel_state.destroy_model_parallel()

    mtp_only = _fit(root / "mtp_only", checkpoint, 3, world_size, bridge_type="megatron-bridge",
                    module=_mtp_only_module(), callbacks=(MTPOnlyCallback(),), expert_model_parallel_size=2,
                    samples=mtp_only_samples)
    _assert_only_mtp_moved(mtp_only)
    result["mtp_only"] = [step["mtp_loss"] for step in mtp_only.steps]
    torch.distributed.barrier()  # rank 0 writes the audit at the end of its fit
    result["audit"] = json.loads((root / "mtp_only" / "mtp_only_audit.json").read_text())
    result["joint"] = {name: _fit(root / f"joint_{name}", checkpoint, 2, world_size, bridge_type="megatron-bridge",
                                  module=_comparable_joint_module(), **JOINT_LAYOUTS[name]).steps for name in joint}
    if context_parallel_rows:
        result["context_parallel"] = _joint_fits(root / f"context_parallel{rank}", hf_checkpoint, alignment=4,
                                                 steps=CONTEXT_PARALLEL_STEPS)
    return result


def _comparable_joint_module() -> SFTModule:
    """Joint SFT + MTP whose Adam steps are Lipschitz in the gradients (tests/_adam.py), so two layouts' fits stay
    within the 1e-5 their losses are compared to."""
    return SFTModule(enable_mtp=True, lr=LR, warmup_steps=1, adam_eps=comparable_adam_eps(LR))


@pytest.mark.slow
def test_tensor_expert_and_context_parallel_mtp_only_and_joint_training(checkpoints, tmp_path):
    """Also joint fits at CP=2 against CP=1 (DP=2) on the same global batches, packed and padded: the losses every
    step and the exports (1e-5); the partial RoPE cut for CP, keys and values gathered by the SDPA core attention."""
    results = run_distributed(_parallel_case, tmp_path, str(tmp_path), str(checkpoints["mtp"]), SAMPLES,
                              ("ep2", "pp2"), True)
    assert_parallel_results(results, checkpoints["mtp"])


def assert_parallel_results(results: list[dict[str, Any]], hf_checkpoint: Path) -> None:
    """`_parallel_case`'s ranks: TP=2 and EP=2 logits and exports, the MTP-only audit and falling MTP loss, the other
    joint fits equal to EP=2's (1e-5), and CP=2 fits equal to CP=1's where they ran."""
    from tests.test_context_parallel import _compare_fits

    for result in results:
        for name in ("tp2", "ep2"):
            assert result[name]["logits"] <= 1e-5
            assert result[name]["export_unequal"] == []
            assert result[name]["exported"] == set(_tensors(hf_checkpoint))
        assert result["audit"]["frozen_bit_identical"]
        assert result["mtp_only"][-1] < result["mtp_only"][0]
        joint = result["joint"]
        assert len(joint) >= 2 and all(len(steps) == 2 for steps in joint.values())
        # PP=2: the MoE layer and the MTP layer on stage 1; CP=2: DP=1, every row cut over the two ranks
        for name, steps in joint.items():
            for expert_parallel, layout in zip(joint["ep2"], steps):
                for metric in ("lm_loss", "mtp_loss"):
                    assert layout[metric] == pytest.approx(expert_parallel[metric], abs=1e-5), (name, metric)
        if "context_parallel" in result:
            fits = result["context_parallel"]
            for packed in (False, True):
                _compare_fits(fits["joint", packed, 1], fits["joint", packed, 2], ("lm_loss", "mtp_loss"),
                              CONTEXT_PARALLEL_STEPS)


@pytest.mark.slow
def test_the_tiny_glm_config_trains_the_mtp_head_on_two_processes(tmp_path):
    """`lightning-megatron fit --config configs/tiny/glm4_moe_mtp_only.yaml`, shortened, writing under tmp_path."""
    fit_shortened_config("configs/tiny/glm4_moe_mtp_only.yaml", tmp_path)
    assert json.loads((tmp_path / "mtp_only_audit.json").read_text())["frozen_bit_identical"]
    exported = _tensors(tmp_path / "hf")
    assert exported.keys() == _tensors(tmp_path / "tiny").keys()  # the MTP layer 2 and its copies included
