"""Delta weight syncs: after MTP-only or LoRA steps a sync sends only the tensors that changed, and the engine ends
bit-equal to a full sync of the same step; an engine that does not hold the base version gets a full sync or, sent
a delta anyway, refuses it and keeps what it had; a disk delta shares every unchanged file with the version before."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_megatron.bridges import create_bridge
from lightning_megatron.callbacks import LoRACallback, MTPOnlyCallback, WeightSync
from lightning_megatron.families import is_hf_mtp_tensor
from lightning_megatron.hf_io import checkpoint_tensor_specs
from lightning_megatron.options import ModelOptions
from lightning_megatron.serving import ColocatedSender, WeightReceiver, WeightSyncError, read_latest
from lightning_megatron.serving.disk import VERSION_FILE, read_version_record, weight_map
from lightning_megatron.serving.protocol import post_json
from lightning_megatron.serving.receiver import spawn_receiver
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from tests._distributed import run_distributed
from tests.callbacks._engine import MIB, assert_every_sync_matched, fit_with_syncs, receiver_tensors

MTP_BRIDGE = dict(bridge_type="megatron-bridge")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("delta_sync") / "qwen3_mtp", "qwen3", mtp=True)


@pytest.fixture(scope="module")
def engine(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    """One engine for the module's fits: each fit's first sync is full, so what an earlier test left does not
    matter."""
    process, url = spawn_receiver(checkpoint, log=tmp_path_factory.mktemp("engine") / "receiver.log", timeout_s=30)
    yield url
    process.kill()
    process.wait()


def _sync(mode: str, url: str | None, root: Path) -> WeightSync:
    if mode == "disk":
        return WeightSync("disk", every_n_steps=1, root=str(root / "versions"), keep_last=3, engine_url=url,
                          timeout_s=60)
    return WeightSync(mode, every_n_steps=1, engine_url=url, bucket_mb=1, timeout_s=60)


def _sent(report: Any) -> list[str]:
    return sorted(name for request in report.requests for name in request)


@pytest.mark.parametrize("mode", ["colocated", "collective", "disk"])
def test_after_mtp_only_steps_a_sync_sends_only_the_mtp_head_and_the_engine_equals_a_full_sync(
        process_group, checkpoint, engine, tmp_path, mode):
    sync = _sync(mode, engine, tmp_path)
    result = fit_with_syncs(tmp_path, checkpoint, [sync], engine, extra_callbacks=(MTPOnlyCallback(),), **MTP_BRIDGE)

    assert_every_sync_matched(result["compared"], [1, 2, 3])  # after each: bit-equal to save_hf of that step
    specs = checkpoint_tensor_specs(checkpoint)
    mtp_names = sorted(name for name in specs if is_hf_mtp_tensor(name))
    reports = sync.reports
    assert [report.base_version for report in reports] == [None, 1, 2]
    assert reports[1].bytes == reports[2].bytes == sum(specs[name].nbytes for name in mtp_names)
    assert reports[1].bytes < reports[0].bytes / 2
    if mode != "disk":
        assert _sent(reports[0]) == sorted(specs)
        assert _sent(reports[1]) == _sent(reports[2]) == mtp_names
        return
    root = tmp_path / "versions"
    assert read_latest(root) == root / "v00000003"
    folders = [root / f"v0000000{version}" for version in (1, 2, 3)]
    files = [weight_map(folder) for folder in folders]
    assert all(files_of.keys() == specs.keys() for files_of in files)  # every version a complete checkpoint
    for earlier, later in zip(folders, folders[1:]):
        shared = {files[0][name] for name in specs if not is_hf_mtp_tensor(name)}  # the trunk's files
        for file in shared:  # the same bytes on the disk (a hard link), not a copy
            assert (earlier / file).stat().st_ino == (later / file).stat().st_ino
        assert {weight_map(later)[name] for name in mtp_names}.isdisjoint(shared)
    assert [read_version_record(folder)["base_version"] for folder in folders] == [None, 1, 2]
    assert json.loads((folders[2] / VERSION_FILE).read_text())["version"] == 3


class RestartEngine(pl.Callback):
    """Replace the engine by a fresh one (same port, the checkpoint's weights, no version) after `after_version`."""

    def __init__(self, checkpoint: Path, port: int, after_version: int, log: Path) -> None:
        self.checkpoint, self.port, self.after_version, self.log_file = checkpoint, port, after_version, log
        self.process: Any = None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.after_version:
            self.process.kill()
            self.process.wait()
            self.process, _ = spawn_receiver(self.checkpoint, port=self.port, log=self.log_file, timeout_s=30)


def test_an_engine_restarted_between_syncs_gets_a_full_sync(process_group, checkpoint, tmp_path):
    from tests._distributed import free_port

    port = free_port()
    process, url = spawn_receiver(checkpoint, port=port, log=tmp_path / "receiver.log", timeout_s=30)
    restart = RestartEngine(checkpoint, port, after_version=2, log=tmp_path / "receiver.log")
    restart.process = process
    sync = _sync("colocated", url, tmp_path)
    try:
        result = fit_with_syncs(tmp_path, checkpoint, [sync], url, extra_callbacks=(MTPOnlyCallback(), restart),
                                **MTP_BRIDGE)
    finally:
        restart.process.kill()
        restart.process.wait()
    assert [report.base_version for report in sync.reports] == [None, 1, None]  # version 3: in full
    assert_every_sync_matched(result["compared"], [1, 2, 3])


def test_a_delta_onto_another_version_is_refused_naming_both_and_nothing_changes(model_parallel, checkpoint):
    import transformers

    bridge = create_bridge("megatron-bridge", checkpoint)
    chunks = bridge.build(ModelOptions(mtp=True))
    with torch.no_grad():
        for chunk in chunks:
            for parameter in chunk.parameters():
                parameter.add_(0.5)  # unlike what the engine holds
    receiver = WeightReceiver(transformers.AutoModelForCausalLM.from_pretrained(checkpoint), checkpoint,
                              timeout_s=20).start()
    sender = ColocatedSender(receiver.url, bucket_bytes=MIB // 64, timeout_s=20, device=torch.device("cpu"))
    specs = bridge.hf_tensor_specs()
    mtp = {name: spec for name, spec in specs.items() if is_hf_mtp_tensor(name)}
    try:
        sender.sync(bridge.export_hf_tensors(chunks), specs, 2, is_sender=True, metadata={"note": "full"})
        before = receiver_tensors(receiver.url, sorted(specs))
        with pytest.raises(WeightSyncError, match="a delta onto weight version 1 cannot apply: this engine holds "
                                                  "version 2; nothing was changed"):
            sender.sync(bridge.export_hf_tensors(chunks, only=set(mtp)), mtp, 3, is_sender=True, base_version=1)
        after = receiver_tensors(receiver.url, sorted(specs))
        assert all(torch.equal(before[name], after[name]) for name in specs)
        info = post_json(f"{receiver.url}/model_info", {}, 60)
        assert info["weight_version"] == "2"
        assert info["weight_version_metadata"] == {"version": 2, "base_version": None, "note": "full"}
    finally:
        sender.close()
        receiver.close()
