"""Both bridge backends load HF checkpoints into Megatron-Core exactly and save them back bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from lightning_megatron.bridges import BridgeError, create_bridge
from lightning_megatron.mtp.parameters import check_mtp_training_versions
from lightning_megatron.options import ModelOptions
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from lightning_megatron.testing.references import hf_mtp_reference_logits
from tests._distributed import run_distributed

SEQ = 16
HIDDEN = 64
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        "qwen3": make_tiny_checkpoint(root / "qwen3", "qwen3"),
        "qwen3_tied": make_tiny_checkpoint(root / "qwen3_tied", "qwen3", tied=True),
        "qwen2": make_tiny_checkpoint(root / "qwen2", "qwen2"),
        "llama": make_tiny_checkpoint(root / "llama", "llama"),
        "qwen3_mtp": make_tiny_checkpoint(root / "qwen3_mtp", "qwen3", mtp=True),
        "mimo": make_tiny_checkpoint(root / "mimo", "mimo", mtp=True),
        "qwen3_4_layers": make_tiny_checkpoint(root / "qwen3_4_layers", "qwen3", num_layers=4),
    }


def _input_ids() -> torch.Tensor:
    return torch.randint(0, 384, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _megatron_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        return model(input_ids=input_ids, position_ids=positions, attention_mask=None)


def _hf_logits(path: Path, input_ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              trust_remote_code=path.name == "mimo")
    with torch.no_grad():
        return model(input_ids).logits


def _assert_same_tensors(original: Path, exported: Path) -> None:
    expected, written = load_file(original / "model.safetensors"), load_file(exported / "model.safetensors")
    assert written.keys() == expected.keys()
    unequal = [name for name in expected if not torch.equal(expected[name], written[name])]
    assert unequal == []


@pytest.mark.parametrize("bridge_type", ["mbridge", "megatron-bridge"])
@pytest.mark.parametrize("name", ["qwen3", "qwen3_tied", "qwen2", "llama"])
def test_logits_and_round_trip(model_parallel, checkpoints, tmp_path, bridge_type, name):
    bridge = create_bridge(bridge_type, checkpoints[name])
    chunks = bridge.build(ModelOptions())
    input_ids = _input_ids()

    difference = (_megatron_logits(chunks[0], input_ids) - _hf_logits(checkpoints[name], input_ids)).abs().max()
    assert difference <= 1e-5

    exported = bridge.save_hf(chunks, tmp_path / "export")
    _assert_same_tensors(checkpoints[name], exported)
    assert json.loads((exported / "config.json").read_text()) == json.loads((checkpoints[name] / "config.json").read_text())
    assert (exported / "tokenizer.json").read_bytes() == (checkpoints[name] / "tokenizer.json").read_bytes()


def _qkv(weights: dict[str, torch.Tensor], prefix: str, suffix: str = "weight") -> torch.Tensor:
    """Megatron's fused QKV layout: per KV group, its query heads, then its key head, then its value head."""
    q = weights[f"{prefix}.q_proj.{suffix}"].reshape(KV_HEADS, HEADS // KV_HEADS * HEAD_DIM, -1)
    k = weights[f"{prefix}.k_proj.{suffix}"].reshape(KV_HEADS, HEAD_DIM, -1)
    v = weights[f"{prefix}.v_proj.{suffix}"].reshape(KV_HEADS, HEAD_DIM, -1)
    fused = torch.cat([q, k, v], dim=1)
    return fused.reshape(-1, fused.shape[-1]) if suffix == "weight" else fused.reshape(-1)


def _expected_mtp_parameters(name: str, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Where each HF MTP tensor must land in Megatron, written out by hand from the two formats."""
    layer = "mtp.layers.0.mtp_model_layer"
    if name == "qwen3_mtp":
        src = "mtp.layers.0"
        expected = {
            "mtp.layers.0.eh_proj.weight": hf["mtp.fc.weight"],  # both concatenate [embedding, hidden]
            "mtp.layers.0.enorm.weight": hf["mtp.pre_fc_norm_embedding.weight"],
            "mtp.layers.0.hnorm.weight": hf["mtp.pre_fc_norm_hidden.weight"],
            "mtp.layers.0.final_layernorm.weight": hf["mtp.norm.weight"],
            f"{layer}.self_attention.q_layernorm.weight": hf[f"{src}.self_attn.q_norm.weight"],
            f"{layer}.self_attention.k_layernorm.weight": hf[f"{src}.self_attn.k_norm.weight"],
        }
    else:
        src = "model.mtp_layers.0"
        hidden_first = hf[f"{src}.input_proj.weight"]
        expected = {
            # MiMo concatenates [hidden, embedding], Megatron [embedding, hidden]: the halves swap.
            "mtp.layers.0.eh_proj.weight": torch.cat([hidden_first[:, HIDDEN:], hidden_first[:, :HIDDEN]], dim=1),
            "mtp.layers.0.enorm.weight": hf[f"{src}.token_layernorm.weight"],
            "mtp.layers.0.hnorm.weight": hf[f"{src}.hidden_layernorm.weight"],
            "mtp.layers.0.final_layernorm.weight": hf[f"{src}.final_layernorm.weight"],
            f"{layer}.self_attention.linear_qkv.bias": _qkv(hf, f"{src}.self_attn", "bias"),
        }
    expected.update({
        f"{layer}.input_layernorm.weight": hf[f"{src}.input_layernorm.weight"],
        f"{layer}.pre_mlp_layernorm.weight": hf[f"{src}.post_attention_layernorm.weight"],
        f"{layer}.self_attention.linear_qkv.weight": _qkv(hf, f"{src}.self_attn"),
        f"{layer}.self_attention.linear_proj.weight": hf[f"{src}.self_attn.o_proj.weight"],
        f"{layer}.mlp.linear_fc1.weight": torch.cat([hf[f"{src}.mlp.gate_proj.weight"], hf[f"{src}.mlp.up_proj.weight"]]),
        f"{layer}.mlp.linear_fc2.weight": hf[f"{src}.mlp.down_proj.weight"],
    })
    return expected


@pytest.mark.parametrize("name", ["qwen3_mtp", "mimo"])
def test_megatron_bridge_mtp_head(model_parallel, checkpoints, tmp_path, name):
    path = checkpoints[name]
    bridge = create_bridge("megatron-bridge", path, trust_remote_code=name == "mimo")
    chunks = bridge.build(ModelOptions(mtp=True))
    model = chunks[0]
    parameters = dict(model.named_parameters())

    expected = _expected_mtp_parameters(name, load_file(path / "model.safetensors"))
    mtp_parameters = {n for n in parameters if n.startswith("mtp.")}
    assert set(expected) <= mtp_parameters
    unequal = [n for n, tensor in expected.items() if not torch.equal(parameters[n], tensor)]
    assert unequal == []

    captured = {}
    model.mtp.register_forward_hook(lambda module, args, output: captured.update(hidden=output.detach().clone()))
    input_ids = _input_ids()
    _megatron_logits(model, input_ids)
    mtp_logits, _ = model.output_layer(captured["hidden"][SEQ:])
    reference = hf_mtp_reference_logits(path, input_ids)
    assert (mtp_logits.transpose(0, 1)[:, :-1] - reference).abs().max() <= 1e-5

    _assert_same_tensors(path, bridge.save_hf(chunks, tmp_path / "export"))


def test_dropping_the_mtp_head_is_declared_in_the_export(model_parallel, checkpoints, tmp_path):
    bridge = create_bridge("megatron-bridge", checkpoints["qwen3_mtp"])
    chunks = bridge.build(ModelOptions(mtp=False))
    assert not any(".mtp." in f".{n}" for n, _ in chunks[0].named_parameters())
    exported = bridge.save_hf(chunks, tmp_path / "export")
    written = load_file(exported / "model.safetensors")
    assert not any(name.startswith("mtp.") for name in written)
    assert json.loads((exported / "config.json").read_text())["num_nextn_predict_layers"] == 0
    _hf_logits(exported, _input_ids())  # and it still loads in transformers


def test_save_that_would_omit_a_tensor_raises_and_writes_nothing(model_parallel, checkpoints, tmp_path):
    from lightning_megatron.bridges.mbridge import MBridge

    class DropsOneTensor(MBridge):
        def export_hf_weights(self, chunks, **options):
            return ((n, t) for n, t in super().export_hf_weights(chunks, **options) if n != "model.norm.weight")

    bridge = DropsOneTensor(checkpoints["qwen3"])
    chunks = bridge.build(ModelOptions())
    with pytest.raises(BridgeError, match="omit 1 tensor.*model.norm.weight"):
        bridge.save_hf(chunks, tmp_path / "export")
    assert list(tmp_path.iterdir()) == []


def test_save_replaces_an_existing_export_atomically(model_parallel, checkpoints, tmp_path):
    bridge = create_bridge("mbridge", checkpoints["qwen2"])
    chunks = bridge.build(ModelOptions())
    first = bridge.save_hf(chunks, tmp_path / "export")
    (first / "stale.txt").write_text("from an earlier export")
    second = bridge.save_hf(chunks, tmp_path / "export")
    assert not (second / "stale.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


@pytest.mark.parametrize("option", ["mtp", "lora"])
def test_mbridge_refuses_mtp_training_and_lora_before_building(checkpoints, option):
    """MTP through the bridge's own check of the build options; LoRA through `LoRACallback`'s check, which the
    callback makes before the model is built (`validate_megatron_setup`)."""
    from lightning_megatron.lora import check_lora_supported

    bridge = create_bridge("mbridge", checkpoints["qwen3_mtp"])
    with pytest.raises(BridgeError, match="set bridge_type: megatron-bridge"):
        if option == "mtp":
            bridge.validate(ModelOptions(mtp=True))
        else:
            check_lora_supported(bridge, mtp_only=False)


def test_mtp_on_a_checkpoint_without_an_mtp_head_says_how_to_restore_it(checkpoints):
    bridge = create_bridge("megatron-bridge", checkpoints["qwen3"])
    with pytest.raises(BridgeError, match="declares no MTP layers.*restore"):
        bridge.validate(ModelOptions(mtp=True))


@pytest.mark.parametrize("installed", [
    {"megatron-core": "0.18.9", "megatron-bridge": "0.6.2"},
    {"megatron-core": "0.19.0rc1", "megatron-bridge": "0.6.2"},
    {"megatron-core": "0.19.2", "megatron-bridge": "0.5.1"},
    {"megatron-core": "0.19.2", "megatron-bridge": "0.6.0rc1"},
    {"megatron-core": "0.19.2", "megatron-bridge": None},
])
def test_mtp_training_version_gate_rejects(installed):
    with pytest.raises(RuntimeError, match="MTP training needs megatron-(core|bridge)>=0.(19|6).0"):
        check_mtp_training_versions(installed)


@pytest.mark.parametrize("installed", [
    {"megatron-core": "0.19.0", "megatron-bridge": "0.6.0"},
    {"megatron-core": "0.19.0+vendor.1", "megatron-bridge": "0.6.2"},
])
def test_mtp_training_version_gate_accepts(installed):
    check_mtp_training_versions(installed)


def _sharded_build_and_export(rank: int, world_size: int, bridge_type: str, tp: int, pp: int, vpp: int | None,
                              path: str, out: str):
    from megatron.core import parallel_state, tensor_parallel

    from lightning_megatron._compat import prepare_megatron_core

    prepare_megatron_core()
    parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vpp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
    bridge = create_bridge(bridge_type, path)
    chunks = bridge.build(ModelOptions())
    parameters = {name: p.detach().clone() for name, p in chunks[0].named_parameters()}
    chunk_layers = [[n for n, _ in chunk.named_parameters() if n.endswith("mlp.linear_fc2.weight")] for chunk in chunks]
    bridge.save_hf(chunks, out)
    result = {"tp_rank": parallel_state.get_tensor_model_parallel_rank(),
              "pp_rank": parallel_state.get_pipeline_model_parallel_rank(), "parameters": parameters,
              "chunk_layers": chunk_layers}
    if tp > 1:  # a vocabulary that TP does not divide is named before any model is built
        odd = make_tiny_checkpoint(Path(out).parent / f"vocab_391_rank{rank}", "llama", vocab_size=391)
        with pytest.raises(BridgeError) as refused:
            create_bridge(bridge_type, odd).build(ModelOptions())
        result["odd_vocabulary"] = str(refused.value)
    parallel_state.destroy_model_parallel()
    return result


@pytest.mark.slow
@pytest.mark.parametrize("bridge_type", ["mbridge", "megatron-bridge"])
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_sharded_ranks_hold_their_slice_and_export_the_original(checkpoints, tmp_path, bridge_type, tp, pp):
    path = checkpoints["qwen3"]
    results = run_distributed(_sharded_build_and_export, tmp_path, bridge_type, tp, pp, None, str(path),
                              str(tmp_path / "export"))
    hf = load_file(path / "model.safetensors")
    for result in results:
        parameters, tp_rank, pp_rank = result["parameters"], result["tp_rank"], result["pp_rank"]
        if tp == 2:
            assert result["odd_vocabulary"].startswith("tensor_model_parallel_size: 2 must divide the checkpoint's "
                                                       "vocab_size (391, ")
            assert result["odd_vocabulary"].endswith("391 has no factor from 2 to 8, so use "
                                                     "tensor_model_parallel_size: 1")
            rows = slice(tp_rank * HIDDEN, (tp_rank + 1) * HIDDEN)  # column-parallel: output rows split
            columns = slice(tp_rank * HIDDEN // 2, (tp_rank + 1) * HIDDEN // 2)  # row-parallel: input columns split
            assert torch.equal(parameters["decoder.layers.1.mlp.linear_fc2.weight"],
                               hf["model.layers.1.mlp.down_proj.weight"][:, rows])
            assert torch.equal(parameters["decoder.layers.1.self_attention.linear_proj.weight"],
                               hf["model.layers.1.self_attn.o_proj.weight"][:, columns])
            vocab_rows = parameters["embedding.word_embeddings.weight"].shape[0]
            start = tp_rank * vocab_rows
            expected_rows = hf["model.embed_tokens.weight"][start:start + vocab_rows]
            assert torch.equal(parameters["embedding.word_embeddings.weight"][: len(expected_rows)], expected_rows)
        else:
            assert [n for n in parameters if n.startswith("decoder.layers.")] == [
                n for n in parameters if n.startswith("decoder.layers.0.")]  # one layer per stage
            assert ("embedding.word_embeddings.weight" in parameters) == (pp_rank == 0)
            assert ("output_layer.weight" in parameters) == (pp_rank == 1)
            # the stage's local layer 0 is global layer `pp_rank`
            assert torch.equal(parameters["decoder.layers.0.mlp.linear_fc2.weight"],
                               hf[f"model.layers.{pp_rank}.mlp.down_proj.weight"])
    _assert_same_tensors(path, tmp_path / "export")


@pytest.mark.slow
@pytest.mark.parametrize("bridge_type", ["mbridge", "megatron-bridge"])
def test_virtual_pipeline_chunks_export_the_original(checkpoints, tmp_path, bridge_type):
    path = checkpoints["qwen3_4_layers"]
    results = run_distributed(_sharded_build_and_export, tmp_path, bridge_type, 1, 2, 2, str(path),
                              str(tmp_path / "export"))
    for result in results:
        assert [len(layers) for layers in result["chunk_layers"]] == [1, 1]  # 4 layers = 2 stages x 2 chunks x 1
    _assert_same_tensors(path, tmp_path / "export")


def _collective_write(rank: int, world_size: int, root: str) -> dict[str, object]:
    import time

    from lightning_megatron import atomic as base

    move = base.move_into_place

    def slow_move(staging: Path, path: Path) -> None:  # the leader renames late; the others must wait for it
        time.sleep(1.0)
        move(staging, path)

    def failing_move(staging: Path, path: Path) -> None:
        raise OSError("disk full")

    def write(folder: Path) -> None:
        (folder / f"rank{rank}.txt").write_text(str(rank))

    base.move_into_place = slow_move
    base.write_atomically(Path(root) / "done", write, every_rank=True)
    present = sorted(path.name for path in (Path(root) / "done").iterdir())
    base.move_into_place = failing_move
    try:
        base.write_atomically(Path(root) / "failed", write, every_rank=True)
        failure = ""
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        failure = str(error)
    return {"present": present, "failure": failure}


def test_a_collective_write_returns_on_every_rank_only_once_the_folder_is_in_place(tmp_path):
    results = run_distributed(_collective_write, tmp_path, str(tmp_path))
    assert [result["present"] for result in results] == [["rank0.txt", "rank1.txt"]] * 2
    assert results[0]["failure"] == "disk full" and "rank 0 failed: OSError: disk full" in results[1]["failure"]
    assert not (tmp_path / "failed").exists() and not list(tmp_path.glob(".failed.partial-*"))
