"""Qwen3.5 and Qwen3.5-MoE as Qwen publishes them (`qwen3_5`: `Qwen3_5ForConditionalGeneration`; `qwen3_5_moe`:
`Qwen3_5MoeForConditionalGeneration`; a vision tower beside the text model) trained text-only: the text model and its
MTP head built through megatron-bridge's text bridge under the multimodal checkpoint's names
(`lightning_megatron.bridges.language_model`), every export the whole multimodal checkpoint again with the vision
tower's tensors copied bit for bit; restore-MTP and the speculative evaluator read it as it is.

`tests/test_qwen3_5.py` and `tests/test_qwen3_5_moe.py` hold the text models' own checks (packing, TP, EP, PP, CP,
joint training, refusals); the same checks run here, on both families, where the multimodal layout changes what is
read or written. The MTP-only fits on the multimodal checkpoints on two processes are the tiny configs'
(`test_the_tiny_qwen3_5_config_trains_the_mtp_head_on_two_processes` at TP=2,
`test_the_tiny_qwen3_5_moe_config_trains_the_mtp_head_on_two_processes` at EP=2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_megatron.bridges import BridgeError, create_bridge
from lightning_megatron.callbacks import MTPOnlyCallback
from lightning_megatron.families import LANGUAGE_MODEL_TYPES, MODEL_FAMILIES, is_hf_mtp_tensor, text_model_config
from lightning_megatron.moe import router_settings
from lightning_megatron.mtp.restore import restore_mtp_head
from lightning_megatron.options import ModelOptions
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from tests._distributed import run_distributed
from tests.test_glm4_moe import (
    _tensors,
    assert_logits_mtp_head_and_round_trip,
    assert_restoring_the_mtp_head_round_trips,
)
from tests.test_moe import _fit, _mtp_only_module
from tests.test_qwen3_5 import (
    assert_tensor_parallel,
    assert_the_speculative_decoder_is_greedy_decoding,
    tensor_parallel_case,
)


@pytest.fixture(scope="module", params=LANGUAGE_MODEL_TYPES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp(request.param) / "mtp", request.param, mtp=True)


def _family(checkpoint: Path) -> str:
    return json.loads((checkpoint / "config.json").read_text())["model_type"]


def _vision_tower(checkpoint: Path) -> dict[str, torch.Tensor]:
    prefixes = MODEL_FAMILIES[_family(checkpoint)].language_model.other_prefixes
    return {name: tensor for name, tensor in _tensors(checkpoint).items() if name.startswith(prefixes)}


def test_the_router_is_read_from_the_text_config(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    settings = router_settings(config)
    assert settings == router_settings(text_model_config(config))
    assert bool(settings) is MODEL_FAMILIES[_family(checkpoint)].moe


@pytest.mark.parametrize("mtp", [False, True])
def test_logits_mtp_head_and_round_trip_with_the_vision_tower(model_parallel, checkpoint, tmp_path, mtp):
    assert_logits_mtp_head_and_round_trip(checkpoint, tmp_path, mtp)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert (config["model_type"], config["text_config"]["mtp_num_hidden_layers"]) == (_family(checkpoint), int(mtp))
    assert _vision_tower(tmp_path / "export").keys() == _vision_tower(checkpoint).keys() != set()


def test_restoring_the_mtp_head_of_the_multimodal_checkpoint_round_trips(model_parallel, checkpoint, tmp_path):
    assert_restoring_the_mtp_head_round_trips(checkpoint, tmp_path)


def test_a_fresh_head_is_written_under_the_multimodal_names(model_parallel, checkpoint, tmp_path):
    bridge = create_bridge("megatron-bridge", checkpoint)
    finetuned = bridge.save_hf(bridge.build(ModelOptions(mtp=False)), tmp_path / "finetuned")
    restored = restore_mtp_head(finetuned, tmp_path / "restored", init="copy-last-layer")
    written, original = _tensors(restored), _tensors(checkpoint)
    assert {n: tuple(t.shape) for n, t in written.items()} == {n: tuple(t.shape) for n, t in original.items()}
    assert torch.equal(written["mtp.layers.0.self_attn.q_proj.weight"],
                       written["model.language_model.layers.1.self_attn.q_proj.weight"])
    if MODEL_FAMILIES[_family(checkpoint)].moe:  # the last layer's packed experts, stored one by one
        assert torch.equal(written["mtp.layers.0.mlp.experts.3.down_proj.weight"],
                           written["model.language_model.layers.1.mlp.experts.down_proj"][3])


def test_mtp_only_keeps_everything_but_the_head_and_exports_the_multimodal_checkpoint(process_group, checkpoint,
                                                                                       tmp_path):
    _fit(tmp_path, checkpoint, 2, bridge_type="megatron-bridge", module=_mtp_only_module(),
         callbacks=(MTPOnlyCallback(),), export=tmp_path / "hf")
    assert json.loads((tmp_path / "mtp_only_audit.json").read_text())["frozen_bit_identical"]
    exported, original = _tensors(tmp_path / "hf"), _tensors(checkpoint)
    assert exported.keys() == original.keys()
    config = json.loads((checkpoint / "config.json").read_text())
    assert {name for name in original if not torch.equal(exported[name], original[name])} == {
        name for name in original if is_hf_mtp_tensor(name, config)}


def test_joint_training_moves_the_text_model_and_its_head_and_keeps_the_vision_tower(process_group, checkpoint,
                                                                                     tmp_path):
    metrics = _fit(tmp_path, checkpoint, 2, bridge_type="megatron-bridge", module=_mtp_only_module(),
                   export=tmp_path / "hf")
    assert {"lm_loss", "mtp_loss"} <= set(metrics.steps[-1])
    exported, original = _tensors(tmp_path / "hf"), _tensors(checkpoint)
    assert exported.keys() == original.keys()
    changed = {name for name in original if not torch.equal(exported[name], original[name])}
    vision_tower = _vision_tower(checkpoint)
    assert changed.isdisjoint(vision_tower)
    assert {"model.language_model.embed_tokens.weight", "lm_head.weight", "mtp.fc.weight"} <= changed
    assert all(torch.equal(exported[name], tensor) for name, tensor in vision_tower.items())


def test_the_speculative_decoder_reads_the_text_model_and_its_head(checkpoint):
    assert_the_speculative_decoder_is_greedy_decoding(checkpoint)


def test_mbridge_is_refused_before_the_build_naming_megatron_bridge(checkpoint):
    with pytest.raises(BridgeError, match=rf"bridge_type: mbridge does not map the (gated DeltaNet|experts) .*"
                                          rf"'{_family(checkpoint)}' checkpoints.*; set bridge_type: megatron-bridge"):
        create_bridge("mbridge", checkpoint).validate(ModelOptions())


@pytest.mark.slow
def test_tensor_parallel_logits_mtp_head_and_export(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path / "qwen3_5", "qwen3_5", mtp=True)
    for result in run_distributed(tensor_parallel_case, tmp_path, str(tmp_path), str(checkpoint)):
        assert_tensor_parallel(result, checkpoint)
