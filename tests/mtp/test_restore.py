"""Restoring an MTP head keeps the fine-tuned checkpoint as it was and gives megatron-bridge an MTP head to load."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightning_megatron.bridges import create_bridge
from lightning_megatron.cli.restore_mtp import main
from lightning_megatron.mtp.restore import MTPRestoreError, restore_mtp_head
from lightning_megatron.options import ModelOptions
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint

MTP_PREFIXES = ("mtp.", "model.mtp_layers.")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    made = {
        "qwen3": make_tiny_checkpoint(root / "qwen3", "qwen3"),
        "qwen3_mtp": make_tiny_checkpoint(root / "qwen3_mtp", "qwen3", mtp=True),
        "mimo": make_tiny_checkpoint(root / "mimo", "mimo", mtp=True),
        "llama": make_tiny_checkpoint(root / "llama", "llama"),
        "qwen2": make_tiny_checkpoint(root / "qwen2", "qwen2"),
    }
    made["mimo_without_mtp"] = _strip_mtp(made["mimo"], root / "mimo_without_mtp")
    return made


def _strip_mtp(path: Path, out: Path) -> Path:
    """What an mtp=False export of MiMo writes, made without Megatron (the round-trip test uses the real export)."""
    shutil.copytree(path, out)
    tensors = load_file(out / "model.safetensors")
    save_file({n: t for n, t in tensors.items() if not n.startswith(MTP_PREFIXES)}, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}, indent=2) + "\n")
    return out


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def _assert_bit_identical(expected: dict[str, torch.Tensor], written: dict[str, torch.Tensor]) -> None:
    assert written.keys() == expected.keys()
    assert [n for n in expected if expected[n].dtype != written[n].dtype] == []
    assert [n for n in expected if not torch.equal(_bits(expected[n]), _bits(written[n]))] == []


def _split(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    mtp = {n: t for n, t in tensors.items() if n.startswith(MTP_PREFIXES)}
    return {n: t for n, t in tensors.items() if n not in mtp}, mtp


def _assert_other_files_identical(finetuned: Path, restored: Path) -> None:
    """Every file but the tensors and config.json is a byte-for-byte copy, and nothing else was added."""
    others = {p.name for p in finetuned.iterdir()} - {"model.safetensors", "config.json"}
    assert {p.name for p in restored.iterdir()} - {"model.safetensors", "config.json"} == others
    assert [name for name in others if (finetuned / name).read_bytes() != (restored / name).read_bytes()] == []


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("name", ["qwen3_mtp", "mimo"])
def test_round_trip_restores_the_original_and_loads_through_megatron_bridge(model_parallel, checkpoints, tmp_path,
                                                                              name):
    original, remote_code = checkpoints[name], name == "mimo"
    bridge = create_bridge("megatron-bridge", original, trust_remote_code=remote_code)
    finetuned = bridge.save_hf(bridge.build(ModelOptions(mtp=False)), tmp_path / "finetuned")
    assert not any(n.startswith(MTP_PREFIXES) for n in load_file(finetuned / "model.safetensors"))

    restored = restore_mtp_head(finetuned, tmp_path / "restored", source=original)

    _assert_bit_identical(load_file(original / "model.safetensors"), load_file(restored / "model.safetensors"))
    assert _config(restored) == _config(original)
    assert _config(restored) == {**_config(finetuned), "num_nextn_predict_layers": 1}
    _assert_other_files_identical(finetuned, restored)

    bridge = create_bridge("megatron-bridge", restored, trust_remote_code=remote_code)
    assert bridge.auto_bridge.to_megatron_provider(load_weights=False).mtp_num_layers == 1
    chunks = bridge.build(ModelOptions(mtp=True))
    assert any(n.startswith("mtp.layers.0.") for n, _ in chunks[0].named_parameters())
    exported = bridge.save_hf(chunks, tmp_path / "exported")
    _assert_bit_identical(load_file(original / "model.safetensors"), load_file(exported / "model.safetensors"))


@pytest.mark.parametrize("source_dtype", [torch.float32, torch.bfloat16])
def test_backbone_comes_from_the_finetuned_checkpoint_and_the_head_from_the_source(tmp_path, source_dtype):
    # A different seed stands for fine-tuning: every backbone tensor differs from the source's.
    finetuned = make_tiny_checkpoint(tmp_path / "finetuned", "qwen3", seed=1)
    source = make_tiny_checkpoint(tmp_path / "source", "qwen3", mtp=True, dtype=source_dtype)

    restored = restore_mtp_head(finetuned, tmp_path / "restored", source=source)

    backbone, mtp = _split(load_file(restored / "model.safetensors"))
    _assert_bit_identical(load_file(finetuned / "model.safetensors"), backbone)
    _, source_mtp = _split(load_file(source / "model.safetensors"))
    _assert_bit_identical({n: t.float() for n, t in source_mtp.items()}, mtp)  # cast to the fine-tuned float32
    assert _config(restored) == {**_config(finetuned), "num_nextn_predict_layers": 1}
    _assert_other_files_identical(finetuned, restored)


@pytest.mark.parametrize("init", ["random", "copy-last-layer"])
@pytest.mark.parametrize("name", ["qwen3", "mimo_without_mtp"])
def test_a_fresh_head_loads_through_megatron_bridge(model_parallel, checkpoints, tmp_path, init, name):
    finetuned = checkpoints[name]
    restored = restore_mtp_head(finetuned, tmp_path / "restored", init=init)
    backbone, mtp = _split(load_file(restored / "model.safetensors"))
    _assert_bit_identical(load_file(finetuned / "model.safetensors"), backbone)
    _assert_other_files_identical(finetuned, restored)
    assert _config(restored) == {**_config(finetuned), "num_nextn_predict_layers": 1}

    bridge = create_bridge("megatron-bridge", restored, trust_remote_code=name.startswith("mimo"))
    parameters = dict(bridge.build(ModelOptions(mtp=True))[0].named_parameters())
    layer = "mtp.layers.0.mtp_model_layer."
    mtp_layer = {n.removeprefix(layer): p for n, p in parameters.items() if n.startswith(layer)}
    last_decoder_layer = {n.removeprefix("decoder.layers.1."): p for n, p in parameters.items()
                          if n.startswith("decoder.layers.1.")}
    assert mtp_layer.keys() == last_decoder_layer.keys()
    copied = {n for n in mtp_layer if torch.equal(mtp_layer[n], last_decoder_layer[n])}
    assert copied == (set(mtp_layer) if init == "copy-last-layer" else set())
    assert all(torch.equal(parameters[f"mtp.layers.0.{norm}.weight"], torch.ones(64))
               for norm in ("enorm", "hnorm", "final_layernorm"))
    projection = parameters["mtp.layers.0.eh_proj.weight"]
    assert projection.shape == (64, 128) and abs(projection.std().item() - 0.02) < 0.002
    if init == "random":
        biases = [p for n, p in mtp_layer.items() if n.endswith(".bias")]
        assert len(biases) == (1 if name.startswith("mimo") else 0) and all(torch.equal(b, 0 * b) for b in biases)


def test_the_same_seed_makes_the_same_head_and_another_seed_another(checkpoints, tmp_path):
    heads = [_split(load_file(restore_mtp_head(checkpoints["qwen3"], tmp_path / f"{i}", init="random", seed=seed)
                              / "model.safetensors"))[1] for i, seed in enumerate([0, 0, 1])]
    _assert_bit_identical(heads[0], heads[1])
    assert not torch.equal(heads[0]["mtp.fc.weight"], heads[2]["mtp.fc.weight"])


def _with_tensor(path: Path, out: Path, name: str, tensor: torch.Tensor | None) -> Path:
    """A copy of a checkpoint with one tensor replaced (or, with None, removed)."""
    shutil.copytree(path, out)
    tensors = load_file(out / "model.safetensors")
    tensors.pop(name)
    if tensor is not None:
        tensors[name] = tensor
    save_file(tensors, out / "model.safetensors")
    return out


@pytest.mark.parametrize(("source_kwargs", "message"), [
    ({"hidden_size": 32}, r"hidden_size: the fine-tuned checkpoint .* has 64, the source .* has 32"),
    ({"vocab_size": 512}, r"vocab_size: the fine-tuned checkpoint .* has 384, the source .* has 512"),
])
def test_a_source_of_another_size_is_refused(checkpoints, tmp_path, source_kwargs, message):
    source = make_tiny_checkpoint(tmp_path / "source", "qwen3", mtp=True, **source_kwargs)
    with pytest.raises(MTPRestoreError, match=message):
        restore_mtp_head(checkpoints["qwen3"], tmp_path / "restored", source=source)
    assert not (tmp_path / "restored").exists()


def test_an_mtp_tensor_of_another_shape_is_refused_naming_it_and_both_shapes(checkpoints, tmp_path):
    name = "mtp.layers.0.mlp.up_proj.weight"
    source = _with_tensor(checkpoints["qwen3_mtp"], tmp_path / "source", name, torch.zeros(96, 64))
    message = (rf"{name}: the source .* has shape \(96, 64\), the fine-tuned checkpoint needs \(128, 64\) "
               r"\(the shape of its model.layers.1.mlp.up_proj.weight\)")
    with pytest.raises(MTPRestoreError, match=message):
        restore_mtp_head(checkpoints["qwen3"], tmp_path / "restored", source=source)

    source = _with_tensor(checkpoints["qwen3_mtp"], tmp_path / "source2", "mtp.fc.weight", torch.zeros(64, 64))
    message = r"mtp.fc.weight: .* shape \(64, 64\), .* needs \(64, 128\) \(from its hidden_size"
    with pytest.raises(MTPRestoreError, match=message):
        restore_mtp_head(checkpoints["qwen3"], tmp_path / "restored", source=source)


def test_a_source_missing_an_mtp_tensor_is_refused_naming_it(checkpoints, tmp_path):
    source = _with_tensor(checkpoints["mimo"], tmp_path / "source", "model.mtp_layers.0.input_proj.weight", None)
    with pytest.raises(MTPRestoreError, match=r"lacks MTP tensor\(s\) the head needs: model.mtp_layers.0.input_proj"):
        restore_mtp_head(checkpoints["mimo_without_mtp"], tmp_path / "restored", source=source)


def test_a_source_of_another_family_is_refused(checkpoints, tmp_path):
    message = r"model_type: the fine-tuned checkpoint .* is 'qwen3', the source .* is 'mimo'"
    with pytest.raises(MTPRestoreError, match=message):
        restore_mtp_head(checkpoints["qwen3"], tmp_path / "restored", source=checkpoints["mimo"])


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_a_family_without_mapped_mtp_weights_is_refused_naming_the_supported_ones(checkpoints, tmp_path, name):
    with pytest.raises(MTPRestoreError, match=rf"model_type '{name}'; .* supported for qwen3, mimo"):
        restore_mtp_head(checkpoints[name], tmp_path / "restored", init="random")


def test_a_source_without_an_mtp_head_is_refused(checkpoints, tmp_path):
    finetuned = make_tiny_checkpoint(tmp_path / "finetuned", "qwen3", seed=1)
    with pytest.raises(MTPRestoreError, match=r"source: .* has no MTP head .*num_nextn_predict_layers"):
        restore_mtp_head(finetuned, tmp_path / "restored", source=checkpoints["qwen3"])


def test_a_finetuned_checkpoint_that_has_an_mtp_head_is_refused(checkpoints, tmp_path):
    with pytest.raises(MTPRestoreError, match=r"finetuned: .* already has an MTP head .* 15 mtp.\* tensor"):
        restore_mtp_head(checkpoints["qwen3_mtp"], tmp_path / "restored", init="random")


@pytest.mark.parametrize("mode", [{}, {"init": "random", "source": "somewhere"}])
def test_exactly_one_of_source_and_init(checkpoints, tmp_path, mode):
    with pytest.raises(MTPRestoreError, match="exactly one of source .* or init"):
        restore_mtp_head(checkpoints["qwen3"], tmp_path / "restored", **mode)


def test_an_unknown_init_is_refused(checkpoints, tmp_path):
    with pytest.raises(MTPRestoreError, match=r"init: 'zeros' is not one of random, copy-last-layer"):
        restore_mtp_head(checkpoints["qwen3"], tmp_path / "restored", init="zeros")


@pytest.mark.parametrize("output", ["finetuned", "source", "parent"])
def test_an_output_that_would_replace_an_input_is_refused(tmp_path, output):
    finetuned = make_tiny_checkpoint(tmp_path / "in" / "finetuned", "qwen3", seed=1)
    source = make_tiny_checkpoint(tmp_path / "in" / "source", "qwen3", mtp=True)
    before = finetuned.joinpath("model.safetensors").read_bytes()
    target = {"finetuned": finetuned, "source": source, "parent": tmp_path / "in"}[output]
    label = "source" if output == "source" else "finetuned"
    with pytest.raises(MTPRestoreError, match=rf"output: .* is \(or contains\) the {label} checkpoint"):
        restore_mtp_head(finetuned, target, source=source)
    assert finetuned.joinpath("model.safetensors").read_bytes() == before


def test_an_output_that_is_not_a_checkpoint_folder_is_not_replaced(checkpoints, tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(MTPRestoreError, match="output: .* exists and is not an HF checkpoint folder"):
        restore_mtp_head(checkpoints["qwen3"], tmp_path / "notes", init="random")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"


def test_a_failed_write_leaves_no_output_and_keeps_an_earlier_one(checkpoints, tmp_path, monkeypatch):
    import lightning_megatron.staged_write as staged_write

    def disk_full(filename, layout):
        Path(filename).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(staged_write, "create_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        restore_mtp_head(checkpoints["qwen3"], tmp_path / "out" / "restored", init="random")
    assert list((tmp_path / "out").iterdir()) == []

    monkeypatch.undo()
    earlier = restore_mtp_head(checkpoints["qwen3"], tmp_path / "out" / "restored", init="random", seed=1)
    earlier_bytes = (earlier / "model.safetensors").read_bytes()
    monkeypatch.setattr(staged_write, "create_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        restore_mtp_head(checkpoints["qwen3"], earlier, init="random")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["restored"]
    assert (earlier / "model.safetensors").read_bytes() == earlier_bytes


def _command(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lightning_megatron.cli.restore_mtp", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_command_line(checkpoints, tmp_path):
    done = _command(checkpoints["mimo_without_mtp"], tmp_path / "restored", "--source", checkpoints["mimo"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"wrote {tmp_path / 'restored'}"
    _assert_bit_identical(load_file(checkpoints["mimo"] / "model.safetensors"),
                          load_file(tmp_path / "restored" / "model.safetensors"))

    refused = _command(checkpoints["llama"], tmp_path / "other", "--init", "random")
    assert refused.returncode == 1
    assert "lightning-megatron-restore-mtp: error: finetuned:" in refused.stderr and "qwen3, mimo" in refused.stderr
    assert not (tmp_path / "other").exists()



def test_command_line_needs_source_or_init(checkpoints, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main([str(checkpoints["qwen3"]), str(tmp_path / "restored")])
    assert exited.value.code == 2
    assert "one of the arguments --source --init is required" in capsys.readouterr().err
