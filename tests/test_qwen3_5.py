"""Qwen3.5 (`qwen3_5_text`) end to end on the CPU through megatron-bridge: HF logits and the MTP head's at one process
and TP=2; bit-identical exports and restored MTP heads; packed rows; MTP-only (audited) and joint training at TP=2,
PP=2 and CP=2; the speculative evaluator with its head = greedy decoding; what its gated DeltaNet layers cannot do
(mbridge, trees, packed rows under CP) refused before any build or step.

The tiny checkpoint has Qwen3.5's layout: layer 0 gated DeltaNet (`linear_attn.*`), layer 1 gated full attention,
zero-centred norms, partial RoPE, and its MTP layer (`mtp.*`, full attention with a dense MLP). Without Transformer
Engine and `fla`, megatron-core builds it through `lightning_megatron._compat.gated_delta_net`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_megatron.bridges import BridgeError, create_bridge
from lightning_megatron.callbacks import MTPOnlyCallback
from lightning_megatron.data import SFTDataModule
from lightning_megatron.families import is_hf_mtp_tensor
from lightning_megatron.module import SFTModule
from lightning_megatron.mtp.restore import restore_mtp_head
from lightning_megatron.options import ModelOptions
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from lightning_megatron.testing.references import hf_mtp_reference_logits
from tests._adam import comparable_adam_eps
from tests._distributed import run_distributed
from tests.test_glm4_moe import _build_check_and_export, _tensors, assert_restoring_the_mtp_head_round_trips
from tests.test_moe import (
    LR,
    SEQ,
    _fit,
    _input_ids,
    _logits_difference,
    _mtp_only_module,
    fit_shortened_config,
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3_5")
    return {"mtp": make_tiny_checkpoint(root / "mtp", "qwen3_5_text", mtp=True),
            "plain": make_tiny_checkpoint(root / "plain", "qwen3_5_text"),
            # Qwen3.5-0.8B's: tied embeddings, heads wider than hidden / heads, as many DeltaNet key as value heads,
            # narrower than the attention heads
            "small": make_tiny_checkpoint(root / "small", "qwen3_5_text", mtp=True, tied=True, head_dim=32, config={
                "linear_num_key_heads": 4, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                "linear_value_head_dim": 8})}


def _mtp_head_difference(chunk: torch.nn.Module, hf_checkpoint: Path) -> float:
    """Max |Megatron's MTP-head logits - the independent HF reference's| (the vocabulary gathered over TP ranks)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    captured = {}
    chunk.mtp.register_forward_hook(lambda module, args, output: captured.update(hidden=output.detach().clone()))
    _logits_difference(chunk, hf_checkpoint)  # the forward that fills `captured`
    with torch.no_grad():
        weight = chunk.shared_embedding_or_output_weight() if chunk.share_embeddings_and_output_weights else None
        logits = gather_from_tensor_model_parallel_region(chunk.output_layer(captured["hidden"][SEQ:], weight)[0])
    reference = hf_mtp_reference_logits(hf_checkpoint, _input_ids())
    return float((logits.transpose(0, 1)[:, :-1] - reference).abs().max())


# one process ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mtp", [False, True])
def test_logits_mtp_head_and_round_trip(model_parallel, checkpoints, tmp_path, mtp):
    path = checkpoints["mtp"]
    result = _build_check_and_export(path, tmp_path / "export", mtp)  # GLM-4.5's checks: logits and export
    assert result["logits"] <= 1e-5
    assert result["export_unequal"] == []
    assert result["exported"] == {name for name in _tensors(path) if mtp or not is_hf_mtp_tensor(name)}
    if mtp:
        chunk = create_bridge("megatron-bridge", path).build(ModelOptions(mtp=True))[0]
        assert _mtp_head_difference(chunk, path) <= 1e-5


def test_tied_embeddings_and_other_deltanet_heads_logits_mtp_head_and_round_trip(model_parallel, checkpoints,
                                                                                 tmp_path):
    path = checkpoints["small"]
    result = _build_check_and_export(path, tmp_path / "export", True)
    assert result["logits"] <= 1e-5 and result["export_unequal"] == [] and result["exported"] == set(_tensors(path))
    chunk = create_bridge("megatron-bridge", path).build(ModelOptions(mtp=True))[0]
    assert _mtp_head_difference(chunk, path) <= 1e-5


def test_a_decoder_ending_in_deltanet_refuses_an_mtp_layer_and_restores_it_from_full_attention(checkpoints,
                                                                                             tmp_path):
    """Megatron-Core builds the MTP layer as the last decoder layer; Qwen3.5's is full attention: refused before any
    build, naming layer_types. restore-MTP copies the last full-attention layer (layer 1 of 3)."""
    plain = make_tiny_checkpoint(tmp_path / "plain", "qwen3_5_text", num_layers=3)
    restored = restore_mtp_head(plain, tmp_path / "restored", init="copy-last-layer")
    written = _tensors(restored)
    assert torch.equal(written["mtp.layers.0.self_attn.q_proj.weight"], written["model.layers.1.self_attn.q_proj.weight"])
    with pytest.raises(BridgeError, match=r"layer_types ends with 'linear_attention'.* set mtp: false"):
        create_bridge("megatron-bridge", restored).validate(ModelOptions(mtp=True))
    create_bridge("megatron-bridge", restored).validate(ModelOptions(mtp=False))


def test_a_pattern_declared_by_full_attention_interval_alone_is_read_as_transformers_reads_it(tmp_path):
    """A config.json with `full_attention_interval` and no `layer_types` (transformers derives them: every 2nd layer
    full attention here): the MTP layer on a decoder ending in DeltaNet is refused, and restore-MTP copies layer 1."""
    plain = make_tiny_checkpoint(tmp_path / "plain", "qwen3_5_text", num_layers=3)
    config = json.loads((plain / "config.json").read_text())
    assert config.pop("layer_types") == ["linear_attention", "full_attention", "linear_attention"]
    (plain / "config.json").write_text(json.dumps({**config, "full_attention_interval": 2}))
    restored = restore_mtp_head(plain, tmp_path / "restored", init="copy-last-layer")
    written = _tensors(restored)
    assert torch.equal(written["mtp.layers.0.self_attn.q_proj.weight"], written["model.layers.1.self_attn.q_proj.weight"])
    with pytest.raises(BridgeError, match=r"layer_types ends with 'linear_attention'.* set mtp: false"):
        create_bridge("megatron-bridge", restored).validate(ModelOptions(mtp=True))


def test_the_layers_are_gated_deltanet_and_gated_attention(model_parallel, checkpoints):
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.utils import get_model_config

    chunk = create_bridge("megatron-bridge", checkpoints["mtp"]).build(ModelOptions(mtp=True))[0]
    config = get_model_config(chunk)
    assert (config.linear_attention_freq, config.attention_output_gate, config.rotary_percent) == ([1, 0], True, 0.25)
    assert isinstance(chunk.decoder.layers[0].self_attention, GatedDeltaNet)
    assert not isinstance(chunk.decoder.layers[1].self_attention, GatedDeltaNet)
    assert not isinstance(chunk.mtp.layers[0].mtp_model_layer.self_attention, GatedDeltaNet)


def test_restoring_the_mtp_head_round_trips_bit_for_bit(model_parallel, checkpoints, tmp_path):
    assert_restoring_the_mtp_head_round_trips(checkpoints["mtp"], tmp_path)


def test_a_head_copied_from_the_last_layer_is_a_full_attention_layer(model_parallel, checkpoints, tmp_path):
    restored = restore_mtp_head(checkpoints["plain"], tmp_path / "restored", init="copy-last-layer")
    written, expected = _tensors(restored), _tensors(checkpoints["mtp"])
    assert {n: tuple(t.shape) for n, t in written.items()} == {n: tuple(t.shape) for n, t in expected.items()}
    assert torch.equal(written["mtp.layers.0.self_attn.q_proj.weight"], written["model.layers.1.self_attn.q_proj.weight"])
    assert_the_fresh_head_norms_scale_by_one(written)
    assert _mtp_head_difference(create_bridge("megatron-bridge", restored).build(ModelOptions(mtp=True))[0],
                                restored) <= 1e-5


def assert_the_fresh_head_norms_scale_by_one(written: dict[str, torch.Tensor]) -> None:
    """A fresh head's own norms (not copied from a decoder layer) scale by 1: Qwen3.5's scale by 1 + weight, so their
    weights are zeros (`families.zero_centered_norms`), not ones."""
    for norm in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        assert torch.count_nonzero(written[norm]) == 0, norm


def test_mbridge_is_refused_before_the_build_naming_megatron_bridge(model_parallel, checkpoints):
    with pytest.raises(BridgeError, match=r"bridge_type: mbridge does not map the gated DeltaNet .* 'qwen3_5_text' "
                                          r"checkpoints; set bridge_type: megatron-bridge"):
        create_bridge("mbridge", checkpoints["mtp"]).validate(ModelOptions())


def test_tree_rows_and_packed_rows_under_context_parallelism_are_refused_before_any_data_is_read(checkpoints):
    assert_tree_rows_and_packed_rows_under_context_parallelism_are_refused(checkpoints["mtp"])


def assert_tree_rows_and_packed_rows_under_context_parallelism_are_refused(hf_checkpoint: Path) -> None:
    """A gated DeltaNet checkpoint's data refuses tree rows, and packed rows at CP=2, naming its model_type."""
    model_type = json.loads((hf_checkpoint / "config.json").read_text())["model_type"]
    for packing, context_parallel_size, message in (
            ("tree", 1, rf"packing='tree' cannot run '{model_type}' checkpoints: .* use packing: true"),
            (True, 2, rf"packing=True with context_parallel_size=2 is not supported for '{model_type}' .* set "
                      "packing: false")):
        data = SFTDataModule(train_path="unread.jsonl", hf_checkpoint=str(hf_checkpoint), seq_length=64,
                             packing=packing, micro_batch_size=1, context_parallel_size=context_parallel_size)
        with pytest.raises(ValueError, match=message):
            data.setup("fit")


def test_packed_thd_equals_one_sequence_per_row(model_parallel, checkpoints):
    """The Qwen3.5 model with its MTP layer (gated DeltaNet layers each sequence from a zero state, THD attention, MTP
    rolls) on a pack made by the data pipeline, against the same sequences one per padded row: per-token losses and
    every gradient."""
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
    chunk = create_bridge("megatron-bridge", checkpoints["mtp"]).build(ModelOptions(mtp=True))[0]
    packed_loss, packed_grads = _per_token_loss_and_grads(chunk, packed)
    rows_loss, rows_grads = _per_token_loss_and_grads(chunk, rows)
    for index, (start, n) in enumerate(zip(packed["cu_seqlens"][:-1].tolist(), lengths)):
        torch.testing.assert_close(packed_loss[0, start:start + n], rows_loss[index, :n], rtol=0, atol=1e-5)
    assert any(".self_attention.conv1d." in name for name in packed_grads)
    for name, grad in rows_grads.items():
        # the gradients of a summed loss, O(10), the two layouts' DeltaNet chunks and attention kernels summing in other
        # orders: fp32's rounding relative to the tensor's largest entry, since an entry summed from terms that large
        # keeps their rounding however small the sum (the embedding's on one AVX-512 machine: 2.0e-5 apart at most,
        # its largest entry 15.6)
        tolerance = 1e-5 + 1e-5 * float(grad.abs().max())
        torch.testing.assert_close(packed_grads[name], grad, rtol=0, atol=tolerance, msg=name)


# two processes: TP=2, PP=2, MTP-only and joint training ----------------------------------------------------------


def tensor_parallel_case(rank: int, world_size: int, tmp: str, hf_checkpoint: str) -> dict[str, Any]:
    """At TP=2 with sequence parallelism: HF logits and the MTP head's, and the export (`assert_tensor_parallel`)."""
    from megatron.core import parallel_state, tensor_parallel

    from lightning_megatron._compat import prepare_megatron_core

    checkpoint = Path(hf_checkpoint)
    prepare_megatron_core()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    result: dict[str, Any] = {"tp2": _build_check_and_export(checkpoint, Path(tmp) / "tp2_export", mtp=True)}
    chunk = create_bridge("megatron-bridge", checkpoint).build(ModelOptions(mtp=True))[0]
    result["tp2"]["mtp_head"] = _mtp_head_difference(chunk, checkpoint)
    # one DeltaNet key head for two ranks: named before any build (Megatron-Core asserts it in TransformerConfig)
    one_key_head = make_tiny_checkpoint(Path(tmp) / f"one_key_head{rank}", "qwen3_5_text",
                                        config={"linear_num_key_heads": 1})
    with pytest.raises(BridgeError) as refused:
        create_bridge("megatron-bridge", one_key_head).validate(ModelOptions())
    result["one_key_head"] = str(refused.value)
    parallel_state.destroy_model_parallel()
    return result


def assert_tensor_parallel(result: dict[str, Any], checkpoint: Path) -> None:
    assert result["tp2"]["logits"] <= 1e-5
    assert result["tp2"]["mtp_head"] <= 1e-5
    assert result["tp2"]["export_unequal"] == []
    assert result["tp2"]["exported"] == set(_tensors(checkpoint))
    assert result["one_key_head"].startswith("tensor_model_parallel_size x context_parallel_size = 2 x 1 must divide "
                                             "the checkpoint's linear_num_key_heads (1, ")


def _parallel_case(rank: int, world_size: int, tmp: str, hf_checkpoint: str) -> dict[str, Any]:
    root, checkpoint = Path(tmp), Path(hf_checkpoint)
    result = tensor_parallel_case(rank, world_size, tmp, hf_checkpoint)

    mtp_only = _fit(root / "mtp_only", checkpoint, 3, world_size, bridge_type="megatron-bridge",
                    module=_mtp_only_module(), callbacks=(MTPOnlyCallback(),), tensor_model_parallel_size=2)
    result["mtp_only"] = [step["mtp_loss"] for step in mtp_only.steps]
    torch.distributed.barrier()  # global rank 0 writes the audit at the end of fit
    result["audit"] = json.loads((root / "mtp_only" / "mtp_only_audit.json").read_text())
    for name, parallel in (("tp2", dict(tensor_model_parallel_size=2)), ("pp2", dict(pipeline_model_parallel_size=2)),
                           ("cp2", dict(context_parallel_size=2))):
        joint = _fit(root / f"joint_{name}", checkpoint, 2, world_size, bridge_type="megatron-bridge",
                     module=SFTModule(enable_mtp=True, lr=LR, warmup_steps=1, adam_eps=comparable_adam_eps(LR)),
                     **parallel)
        result["joint", name] = joint.steps
    return result


@pytest.mark.slow
def test_tensor_and_pipeline_parallel_mtp_only_and_joint_training(checkpoints, tmp_path):
    results = run_distributed(_parallel_case, tmp_path, str(tmp_path), str(checkpoints["mtp"]))
    for result in results:
        assert_tensor_parallel(result, checkpoints["mtp"])
        assert result["audit"]["frozen_bit_identical"]
        assert result["mtp_only"][-1] < result["mtp_only"][0]
        tp2 = result["joint", "tp2"]
        assert len(tp2) == 2
        # PP=2: the DeltaNet layer on stage 0; CP=2: megatron-core's head all-to-all around the DeltaNet, SDPA over the
        # gathered keys in the attention layers. The first step's losses are the same weights' in each layout; the
        # second's weights moved by Adam steps that differ by 0.125 times the gradients' rounding (tests/_adam.py),
        # which for gradients of norm ~16 is ~1e-6: compared relative to the loss.
        for other in (result["joint", "pp2"], result["joint", "cp2"]):
            for tensor_parallel, layout in zip(tp2, other, strict=True):
                for metric in ("lm_loss", "mtp_loss"):
                    assert layout[metric] == pytest.approx(tensor_parallel[metric], rel=1e-5, abs=1e-5)


def test_the_speculative_decoder_with_its_head_is_greedy_decoding(checkpoints):
    assert_the_speculative_decoder_is_greedy_decoding(checkpoints["mtp"])


def assert_the_speculative_decoder_is_greedy_decoding(checkpoint: Path) -> None:
    """The draft head loads and equals the independent reference (1e-5); 2-token drafting with it (the DeltaNet
    states put back after each rejected draft: `tests/speculative/` holds the batched, sampled and fitted-head cases)
    is greedy decoding of the gated DeltaNet target, token for token."""
    from lightning_megatron.speculative.decode import greedy_decode, speculative_decode
    from lightning_megatron.speculative.mtp_head import load_mtp_head, load_target

    target = load_target(checkpoint)
    head = load_mtp_head(checkpoint, target)
    input_ids = _input_ids()
    with torch.no_grad():
        hidden = target.model(input_ids).last_hidden_state
        drafted = head(hidden[:, :-1], input_ids[:, 1:], torch.arange(SEQ - 1).expand(len(input_ids), -1))
    assert float((drafted - hf_mtp_reference_logits(checkpoint, input_ids)).abs().max()) <= 1e-5
    prompt = input_ids[0, :5].tolist()
    greedy = greedy_decode(target, prompt, max_new_tokens=12, eos_token_ids=[])
    speculative = speculative_decode(target, head, prompt, max_new_tokens=12, eos_token_ids=[], num_draft_tokens=2)
    assert speculative.tokens == greedy.tokens and len(speculative.accepted) > 0


@pytest.mark.slow
def test_the_tiny_qwen3_5_config_trains_the_mtp_head_on_two_processes(tmp_path):
    """`lightning-megatron fit --config configs/tiny/qwen3_5_mtp_only.yaml`, shortened, writing under tmp_path."""
    fit_shortened_config("configs/tiny/qwen3_5_mtp_only.yaml", tmp_path)
    assert json.loads((tmp_path / "mtp_only_audit.json").read_text())["frozen_bit_identical"]
    exported, original = _tensors(tmp_path / "hf"), _tensors(tmp_path / "tiny")
    assert exported.keys() == original.keys()
    assert {name for name in original if not torch.equal(exported[name], original[name])} == {
        name for name in original if is_hf_mtp_tensor(name)}
