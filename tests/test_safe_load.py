"""Loading trusts nothing in a folder: pickles that would run code are refused before they run, a damaged, missing,
extra or differently-sharded checkpoint file fails with its name and the fix, remote code needs the explicit option,
and fit, predict, export and restore on local paths never reach the network."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_megatron import checkpoint as megatron_checkpoint
from lightning_megatron.bridges import BridgeError, create_bridge
from lightning_megatron.checkpoint import CheckpointError
from lightning_megatron.safe_load import UnsafeFileError
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from tests._distributed import run_distributed
from tests.test_strategy import _fit


class CreatesAFile:
    """A pickle payload: unpickling it runs `touch <path>`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.path}",)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("safety") / "qwen3", "qwen3")


@pytest.fixture(scope="module")
def saved(process_group: None, tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One step of fit and the checkpoint it writes; each test damages its own copy."""
    root = tmp_path_factory.mktemp("saved")
    result = _fit(root, tiny, 1, use_distributed_optimizer=True)
    result["trainer"].save_checkpoint(root / "saved.ckpt")
    return {"strategy": result["trainer"].strategy, "path": root / "saved.ckpt"}


def _copy(saved: dict[str, Any], tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved["path"], tmp_path / "copy.ckpt"))


def _torch_payload(marker: Path, wrap: Any = lambda payload: {"epoch": 0, "state": payload}) -> bytes:
    """A torch.save file whose unpickling creates `marker`."""
    stream = io.BytesIO()
    torch.save(wrap(CreatesAFile(marker)), stream)
    return stream.getvalue()


def _update_manifest(folder: Path) -> None:
    """What an attacker who edits files also does: make the manifest match them (it is a checksum, not a signature)."""
    files = json.loads((folder / megatron_checkpoint.MANIFEST).read_text())["files"]
    updated = {name: megatron_checkpoint._describe(folder / name) for name in files}
    (folder / megatron_checkpoint.MANIFEST).write_text(json.dumps({"files": updated}))


def _replace_common_state(folder: Path, payload: bytes) -> None:
    """Point Megatron's `common_state` object (the optimizer's param groups) at `payload`, appended to its shard."""
    from lightning_megatron.safe_load import load_dcp_metadata

    metadata = load_dcp_metadata(folder / "megatron" / ".metadata")
    (index,) = [index for index in metadata.storage_data if index.fqn.startswith("common_state")]
    info = metadata.storage_data[index]
    shard = folder / "megatron" / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as stream:
        stream.write(payload)
    metadata.storage_data[index] = type(info)(info.relative_path, offset, len(payload), info.transform_descriptors)
    (folder / "megatron" / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("target", ["lightning.pt", "rng/rank0.pt", "megatron/.metadata", "common_state"])
def test_a_pickle_that_would_run_code_is_refused_before_it_runs(saved, tmp_path, target):
    probe = tmp_path / "probe"
    torch.load(io.BytesIO(_torch_payload(probe)), weights_only=False)
    assert probe.is_file()  # the payload is live: loaded the unsafe way, it creates its file

    folder = _copy(saved, tmp_path)
    marker = tmp_path / "created_by_the_payload"
    if target == "common_state":  # inside a Megatron shard: torch.distributed.checkpoint would unpickle it
        _replace_common_state(folder, _torch_payload(marker, lambda payload: [{"optimizer": payload}]))
        _update_manifest(folder)
        where = r"__0_0\.distcp \(common_state"
    else:
        payload = pickle.dumps(CreatesAFile(marker)) if target.endswith(".metadata") else _torch_payload(marker)
        (folder / target).write_bytes(payload)
        where = target.replace(".", r"\.")
    if target.startswith(("megatron", "common")):  # upstream, Megatron's own loader runs the payload
        _load_with_megatron_alone(folder / "megatron")
        assert marker.is_file()
        marker.unlink()
    with pytest.raises(UnsafeFileError, match=rf"{where}.*: refused to load: it holds .*system"):
        saved["strategy"].load_checkpoint(folder)
    assert not marker.exists()


def _load_with_megatron_alone(folder: Path) -> None:
    """What megatron.core.dist_checkpointing reads first: `.metadata` (plain pickle), then the common state."""
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict
    from torch.distributed.checkpoint.api import CheckpointException

    with contextlib.suppress(Exception, CheckpointException):  # the payload has run by the time it fails
        load_common_state_dict(str(folder))


def test_the_saved_checkpoint_lists_every_file_and_resumes(saved):
    manifest = json.loads((saved["path"] / megatron_checkpoint.MANIFEST).read_text())["files"]
    assert {"lightning.pt", "rng/rank0.pt", "megatron/.metadata", "megatron/metadata.json"} <= set(manifest)
    assert any(name.endswith(".distcp") for name in manifest)
    assert saved["strategy"].load_checkpoint(saved["path"])["global_step"] == 1


def test_the_saved_layout_keeps_its_on_disk_keys_and_values(saved):
    from lightning_megatron.safe_load import load_torch_file

    layout = load_torch_file(saved["path"] / "lightning.pt")["megatron_layout"]
    assert list(layout.items()) == [
        ("tensor_model_parallel_size", 1), ("pipeline_model_parallel_size", 1),
        ("virtual_pipeline_model_parallel_size", None), ("context_parallel_size", 1),
        ("expert_model_parallel_size", 1), ("expert_tensor_parallel_size", 1), ("data_parallel_size", 1),
        ("optimizer_sharding", "fully_reshardable"),
    ]


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _zero_the_middle(file: Path) -> None:
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle: middle + 256] = bytes(256)
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, message", [
    (_truncate, r"__0_0\.distcp is \d+ bytes, but \d+ were written: it is truncated.*copy the checkpoint folder"),
    (_zero_the_middle, r"__0_0\.distcp differs from the file that was written \(CRC-32.*copy the checkpoint folder"),
    (Path.unlink, r"__0_0\.distcp is missing.*copy the checkpoint folder"),
], ids=["truncated", "zeroed", "missing"])
def test_a_damaged_or_missing_shard_is_named_with_the_fix(saved, tmp_path, damage, message):
    folder = _copy(saved, tmp_path)
    damage(folder / "megatron" / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=message):
        saved["strategy"].load_checkpoint(folder)


def test_a_damaged_shard_without_a_manifest_is_still_named(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    (folder / megatron_checkpoint.MANIFEST).unlink()  # a checkpoint from before manifests existed
    _truncate(folder / "megatron" / "__0_0.distcp")
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: .* cannot be read .*the file is damaged"):
        saved["strategy"].load_checkpoint(folder)


def test_a_file_megatron_would_read_that_we_did_not_write_is_refused(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    torch.save({"args": None}, folder / "megatron" / "common.pt")  # Megatron's legacy common state: it would load it
    with pytest.raises(CheckpointError, match=r"common\.pt was not written by MegatronStrategy.*remove it"):
        saved["strategy"].load_checkpoint(folder)


def _resharding_case(rank: int, world_size: int, tmp: str, hf_checkpoint: str) -> dict[str, Any]:
    """Save at TP=2 in both optimizer formats, then resume each at TP=1 x DP=2."""
    results: dict[str, Any] = {}
    for sharding in ("fully_reshardable", "dp_reshardable"):
        saver = pl.callbacks.ModelCheckpoint(dirpath=Path(tmp) / sharding, filename="step1")
        _fit(Path(tmp) / f"{sharding}-tp2", Path(hf_checkpoint), 1, devices=world_size, callbacks=(saver,),
             trainer_kwargs=dict(enable_checkpointing=True), tensor_model_parallel_size=2,
             checkpoint_optimizer_sharding=sharding)
        try:
            resumed = _fit(Path(tmp) / f"{sharding}-dp2", Path(hf_checkpoint), 2, devices=world_size,
                           ckpt_path=str(Path(tmp) / sharding / "step1.ckpt"))
            results[sharding] = {"losses": len(resumed["losses"]), "step": resumed["trainer"].global_step}
        except CheckpointError as error:
            results[sharding] = {"error": str(error)}
    return results


@pytest.mark.slow
def test_a_checkpoint_that_cannot_take_other_parallel_sizes_names_them(tiny, tmp_path):
    results = run_distributed(_resharding_case, tmp_path, str(tmp_path), str(tiny))
    for result in results:
        assert result["fully_reshardable"] == {"losses": 1, "step": 2}  # resharded TP=2 -> DP=2, one more step
        error = result["dp_reshardable"]["error"]
        assert "step1.ckpt" in error and "'dp_reshardable'" in error
        assert "tensor_model_parallel_size: saved 2, now 1" in error
        assert "data_parallel_size" not in error  # dp_reshardable takes any data-parallel size
        assert "Resume with the saved sizes" in error


def test_strategy_refuses_an_optimizer_format_it_cannot_write():
    from lightning_megatron.strategy import MegatronStrategy

    with pytest.raises(ValueError, match="checkpoint_optimizer_sharding: 'other'"):
        MegatronStrategy(hf_checkpoint="unused", checkpoint_optimizer_sharding="other")
    with pytest.raises(ValueError, match="dp_reshardable is a format of the distributed optimizer"):
        MegatronStrategy(hf_checkpoint="unused", checkpoint_optimizer_sharding="dp_reshardable",
                         use_distributed_optimizer=False)


# ---------------------------------------------------------------------------------------------------- remote code


@pytest.mark.parametrize("bridge_type", ["mbridge", "megatron-bridge"])
def test_remote_code_is_refused_with_the_option_to_set_before_a_bridge_is_made(tmp_path, bridge_type):
    mimo = make_tiny_checkpoint(tmp_path / "mimo", "mimo", mtp=True)
    with pytest.raises(BridgeError, match=(
        r"mimo/config\.json: model_type 'mimo' is defined by remote code .*configuration_mimo\.py, modeling_mimo\.py"
        r".*set trust_remote_code: true under the strategy's init_args")):
        create_bridge(bridge_type, mimo)
    assert create_bridge(bridge_type, mimo, trust_remote_code=True).hf_config["model_type"] == "mimo"


def test_an_auto_map_for_a_model_transformers_knows_needs_no_remote_code(tiny, tmp_path):
    folder = Path(shutil.copytree(tiny, tmp_path / "qwen3_with_auto_map"))
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_qwen3.Qwen3Config"}
    (folder / "config.json").write_text(json.dumps(config))
    assert create_bridge("mbridge", folder).hf_config["model_type"] == "qwen3"


# ---------------------------------------------------------------------------------------------------- network


def _offline_case(rank: int, world_size: int, tmp: str, hf_checkpoint: str) -> dict[str, Any]:
    """Fit (megatron-bridge), export, restore the MTP head, predict (mbridge), all under the socket guard."""
    from tests._network import ATTEMPTS, block_network

    block_network()
    import huggingface_hub

    with contextlib.suppress(Exception):  # the guard sees hub traffic (huggingface_hub wraps its OSError)
        huggingface_hub.model_info("Qwen/Qwen3-0.6B")
    guard_works = bool(ATTEMPTS)
    ATTEMPTS.clear()

    from lightning_megatron import MegatronStrategy, SFTDataModule, SFTModule
    from lightning_megatron.callbacks import ContinuationWriter
    from lightning_megatron.mtp.restore import restore_mtp_head

    work = Path(tmp)
    rows = [{"prompt": f"What is {index} + 1?", "response": f"{index + 1}."} for index in range(4)]
    data = work / "rows.jsonl"
    if rank == 0:
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    options = dict(accelerator="cpu", devices=world_size, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False)
    strategy = MegatronStrategy(hf_checkpoint=hf_checkpoint, bridge_type="megatron-bridge", precision="fp32")
    trainer = pl.Trainer(strategy=strategy, max_steps=1, **options)
    trainer.fit(SFTModule(), datamodule=SFTDataModule(str(data), seq_length=32))  # exported without its MTP head
    strategy.export_hf(work / "export")
    if rank == 0:
        restore_mtp_head(work / "export", work / "restored", source=hf_checkpoint)
    trainer.strategy.barrier()
    predictor = pl.Trainer(strategy=MegatronStrategy(hf_checkpoint=str(work / "restored"), precision="fp32"),
                           callbacks=[ContinuationWriter(str(work / "continuations.jsonl"))], **options)
    predictor.predict(SFTModule(max_new_tokens=2), datamodule=SFTDataModule(predict_path=str(data), seq_length=32))
    written = work / "continuations.jsonl"  # rank 0 writes it
    return {"guard_works": guard_works, "attempts": list(ATTEMPTS),
            "continuations": len(written.read_text().splitlines()) if rank == 0 else None}


@pytest.mark.slow
def test_fit_export_restore_and_predict_never_reach_the_network(tmp_path, monkeypatch):
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(variable, raising=False)
    hf_checkpoint = make_tiny_checkpoint(tmp_path / "qwen3_mtp", "qwen3", mtp=True)
    results = run_distributed(_offline_case, tmp_path, str(tmp_path), str(hf_checkpoint))
    for result in results:
        assert result["guard_works"]
        assert result["attempts"] == []
    assert results[0]["continuations"] == 4


def test_the_rng_file_loads_weights_only_and_puts_the_draws_back_each_time_it_is_set(model_parallel, tmp_path):
    """What a rank's `rng/rank{r}.pt` holds reads with `weights_only` and, set (twice, as a retried load sets the
    same loaded states again), makes Python, NumPy and torch draw what they drew after it was taken."""
    import random

    import numpy as np

    torch.save(megatron_checkpoint._rng_states(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(3))
    states = torch.load(tmp_path / "rng.pt", weights_only=True)
    for _ in range(2):
        megatron_checkpoint._set_rng_states(states)
        got = (random.random(), np.random.rand(), torch.rand(3))
        assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])
