"""A disk delta's files: the tensors that change are spread over several files (written at once), in the full
version written for deltas and in each delta after it; every version is bit-equal to a full save of the same weights
and loads in transformers; a base whose files mix changing and unchanged tensors is still refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightning_megatron.bridges import create_bridge
from lightning_megatron.families import is_hf_mtp_tensor
from lightning_megatron.options import ModelOptions
from lightning_megatron.serving.disk import (
    INDEX_FILE,
    delta_base,
    publish_latest,
    version_folder,
    weight_map,
    write_delta_version,
)
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("disk_delta") / "qwen3_mtp", "qwen3", mtp=True)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder, from the files its index names (a stray file would not count)."""
    files_of = weight_map(folder)
    loaded = {file: load_file(folder / file) for file in set(files_of.values())}
    return {name: loaded[file][name] for name, file in files_of.items()}


def _unequal(folder: Path, expected: Path) -> list[str]:
    ours, theirs = _tensors(folder), _tensors(expected)
    return sorted(name for name in ours.keys() | theirs.keys()
                  if name not in ours or name not in theirs or ours[name].dtype != theirs[name].dtype
                  or not torch.equal(ours[name], theirs[name]))


def test_deltas_onto_a_full_version_spread_the_mtp_head_over_files_and_equal_a_full_save(model_parallel, checkpoint,
                                                                                         tmp_path):
    _check_deltas_equal_full_saves(checkpoint, tmp_path, cuda=torch.cuda.is_available())


@pytest.mark.gpu
def test_a_gpu_models_deltas_are_staged_from_the_gpu_and_equal_a_full_save(model_parallel, checkpoint, tmp_path):
    """The export's tensors stay on the GPU: each file's thread copies them through its pinned buffers."""
    _check_deltas_equal_full_saves(checkpoint, tmp_path, cuda=True)


def _check_deltas_equal_full_saves(checkpoint: Path, tmp_path: Path, cuda: bool) -> None:
    import transformers

    bridge = create_bridge("megatron-bridge", checkpoint)
    chunks = bridge.build(ModelOptions(mtp=True))
    assert next(chunks[0].parameters()).is_cuda == cuda
    specs = bridge.hf_tensor_specs()
    head = {name: spec for name, spec in specs.items() if is_hf_mtp_tensor(name)}
    root = tmp_path / "versions"
    first = bridge.save_hf(chunks, version_folder(root, 1), separate=head)
    publish_latest(root, first)
    files_of = weight_map(first)
    head_files = {files_of[name] for name in head}
    assert len(head_files) == min(8, len(head)) > 1  # as many files as threads write at once, one tensor at least
    assert all(is_hf_mtp_tensor(name) for name, file in files_of.items() if file in head_files)
    loads = sorted(sum(head[name].nbytes for name in head if files_of[name] == file) for file in head_files)
    assert loads[-1] - loads[0] <= max(spec.nbytes for spec in head.values())  # about equal bytes per file

    base = first
    for version in (2, 3):  # a delta onto the full version, then onto that delta
        with torch.no_grad():
            for chunk in chunks:
                for name, parameter in chunk.named_parameters():
                    if ".mtp." in f".{name}":
                        parameter.add_(0.25)
        assert delta_base(root, version - 1, head, specs) == base
        folder = write_delta_version(base, version_folder(root, version), head,
                                     bridge.export_hf_tensors(chunks, only=set(head), on_host=False),
                                     {"weight_version.json": "{}\n"})
        publish_latest(root, folder)
        expected = bridge.save_hf(chunks, tmp_path / f"full{version}")
        assert _unequal(folder, expected) == []
        new_files = {weight_map(folder)[name] for name in head}
        assert new_files == {f"model-v0000000{version}-{index:05d}-of-{len(new_files):05d}.safetensors"
                             for index in range(1, len(new_files) + 1)} and len(new_files) == len(head_files)
        for file in set(files_of.values()) - head_files:  # the trunk's bytes: version 1's, linked
            assert (folder / file).stat().st_ino == (first / file).stat().st_ino
        assert sorted(path.name for path in folder.glob("*.safetensors")) == sorted(set(weight_map(folder).values()))
        index = json.loads((folder / INDEX_FILE).read_text())
        assert index["metadata"] == json.loads((first / INDEX_FILE).read_text())["metadata"]
        base = folder

    changed, before = _tensors(base), _tensors(first)
    assert all(not torch.equal(changed[name], before[name]) for name in head)  # the deltas did change the head
    loaded = transformers.AutoModelForCausalLM.from_pretrained(base, dtype="auto").state_dict()
    reference = transformers.AutoModelForCausalLM.from_pretrained(expected, dtype="auto").state_dict()
    assert loaded.keys() == reference.keys()
    assert all(torch.equal(loaded[name], reference[name]) for name in loaded)


def test_a_base_whose_files_mix_changing_and_unchanged_tensors_is_refused(model_parallel, checkpoint, tmp_path):
    """Its files would be linked into the delta with the old values of tensors that changed: written in full."""
    bridge = create_bridge("megatron-bridge", checkpoint)
    chunks = bridge.build(ModelOptions(mtp=True))
    specs = bridge.hf_tensor_specs()
    head = {name for name in specs if is_hf_mtp_tensor(name)}
    norms = {name for name in specs if name.endswith("layernorm.weight") and name not in head}
    root = tmp_path / "versions"
    for version, separate in ((1, ()), (2, head), (3, head | norms)):
        folder = bridge.save_hf(chunks, version_folder(root, version), separate=separate)
        publish_latest(root, folder)
        files_of = weight_map(folder)
        shared = next(name for name in sorted(head)  # a head tensor whose file holds another head tensor too
                      if sum(files_of[other] == files_of[name] for other in head) > 1)
        accepted = {"head": delta_base(root, version, head, specs),
                    "head and norms": delta_base(root, version, head | norms, specs),
                    "part of the head": delta_base(root, version, head - {shared}, specs)}
        assert {case for case, base in accepted.items() if base is not None} == {
            1: set(), 2: {"head"}, 3: {"head and norms"}}[version], version
