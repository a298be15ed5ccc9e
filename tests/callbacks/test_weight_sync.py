"""WeightSync sends the weights being trained to a running engine (the package's receiver, a plain `transformers`
model in another process) in the three modes; after each sync the engine holds exactly what `save_hf` writes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import transformers
from safetensors.torch import load_file

from lightning_megatron.bridges import create_bridge
from lightning_megatron.callbacks import WeightSync
from lightning_megatron.hf_io import checkpoint_tensor_specs
from lightning_megatron.options import ModelOptions
from lightning_megatron.serving import CollectiveSender, ColocatedSender, WeightReceiver, WeightSyncError, read_latest
from lightning_megatron.serving.disk import versions
from lightning_megatron.serving.protocol import post_json
from lightning_megatron.serving.receiver import spawn_receiver
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from tests._distributed import free_port, run_distributed
from tests.callbacks._engine import (
    MIB,
    WIDE_VOCAB,
    assert_every_sync_matched,
    fit_with_syncs,
    receiver_tensors,
    unequal_to_export,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("weight_sync_checkpoints")
    tied = make_tiny_checkpoint(root / "tied", "qwen3", tied=True)
    tokenizer = Tokenizer.from_file(str(tied / "tokenizer.json"))  # the extra rows of the wide model are padding
    return {"wide_mtp": make_tiny_checkpoint(root / "wide_mtp", "qwen3", mtp=True, vocab_size=WIDE_VOCAB,
                                             tokenizer=tokenizer),
            "tied": tied}


@pytest.fixture(scope="module")
def receivers(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """One engine per checkpoint, shared by the tests of this module (each sync overwrites every tensor)."""
    log = tmp_path_factory.mktemp("receivers") / "receivers.log"
    started = {name: spawn_receiver(path, log=log, timeout_s=30) for name, path in checkpoints.items()}
    yield {name: url for name, (_, url) in started.items()}
    for process, _ in started.values():
        process.kill()
        process.wait()


@pytest.mark.parametrize("case", ["collective", "colocated", "disk"])
def test_one_process_engine_holds_what_save_hf_writes_after_each_sync(process_group, checkpoints, receivers,
                                                                       tmp_path, case):
    if case == "collective":  # bf16 training, fp32 checkpoint: the wire carries fp32, as save_hf writes
        checkpoint, bridge_options = "wide_mtp", dict(bridge_type="megatron-bridge", precision="bf16")
        sync = WeightSync("collective", every_n_steps=2, engine_url=receivers[checkpoint], bucket_mb=1, timeout_s=60)
    elif case == "colocated":
        checkpoint, bridge_options = "tied", {}
        sync = WeightSync("colocated", every_n_steps=2, engine_url=receivers[checkpoint], bucket_mb=1, timeout_s=60)
    else:
        checkpoint, bridge_options = "wide_mtp", dict(bridge_type="megatron-bridge")
        sync = WeightSync("disk", every_n_steps=1, root=str(tmp_path / "versions"), keep_last=2,
                          engine_url=receivers[checkpoint], timeout_s=60)
    result = fit_with_syncs(tmp_path, checkpoints[checkpoint], [sync], receivers[checkpoint], **bridge_options)

    expected_versions = [1, 2, 3] if case == "disk" else [2, 3]  # every N steps, and when training ends
    assert_every_sync_matched(result["compared"], expected_versions)
    if case == "collective":
        specs = checkpoint_tensor_specs(checkpoints[checkpoint])
        for report in result["reports"][0]:
            sent = [name for request in report.requests for name in request]
            assert sorted(sent) == sorted(specs)  # every tensor once, MTP head included
            assert len(report.requests) >= 3
            for request in report.requests:  # a tensor larger than a bucket goes alone; others share 1 MiB
                sizes = [specs[name].nbytes for name in request]
                assert (len(request) == 1 and sizes[0] > MIB) or sum(sizes) <= MIB, request
            assert ["model.embed_tokens.weight"] in report.requests and ["lm_head.weight"] in report.requests
    if case == "colocated":  # tied: the checkpoint has no lm_head.weight, and none was sent
        sent = [name for request in result["reports"][0][-1].requests for name in request]
        assert "lm_head.weight" not in sent and "model.embed_tokens.weight" in sent
        assert not list(Path("/dev/shm").glob(f"lightning-megatron-weights-{os.getpid()}-*"))  # freed at teardown
    if case == "disk":
        root = tmp_path / "versions"
        assert read_latest(root) == root / "v00000003"
        assert sorted(path.name for path in root.iterdir()) == ["latest", "v00000002", "v00000003"]  # keep_last=2


def _distributed_syncs(rank: int, world_size: int, workdir: str, checkpoints: dict[str, str],
                       urls: dict[str, str]) -> dict:
    """TP=2 (collective, MTP head, untied), then PP=2 (colocated and disk on one engine, tied) in the same ranks."""
    results = {}
    for case in ("tp2", "pp2"):
        if case == "tp2":
            url = urls["wide_mtp"]
            syncs = [WeightSync("collective", every_n_steps=2, engine_url=url, bucket_mb=1, timeout_s=60)]
            options = dict(tensor_model_parallel_size=2, bridge_type="megatron-bridge")
            checkpoint = checkpoints["wide_mtp"]
        else:
            url = urls["tied"]
            syncs = [WeightSync("colocated", every_n_steps=2, engine_url=url, bucket_mb=1, timeout_s=60),
                     WeightSync("disk", every_n_steps=2, root=f"{workdir}/versions", engine_url=url, timeout_s=60)]
            options = dict(pipeline_model_parallel_size=2)
            checkpoint = checkpoints["tied"]
        result = fit_with_syncs(Path(workdir) / case, Path(checkpoint), syncs, url, devices=world_size, **options)
        results[case] = {"compared": result["compared"], "versions": result["versions"],
                         "sent": [[name for request in report.requests for name in request]
                                  for reports in result["reports"] for report in reports]}
    return results


@pytest.mark.slow
def test_tensor_and_pipeline_parallel_ranks_sync_the_whole_model(checkpoints, receivers, tmp_path):
    results = run_distributed(_distributed_syncs, tmp_path, str(tmp_path),
                              {name: str(path) for name, path in checkpoints.items()}, receivers)
    for case in ("tp2", "pp2"):
        assert_every_sync_matched(results[0][case]["compared"], [2, 3])
        assert results[1][case]["compared"] == []  # rank 0 alone compares (and sends)
        for result in results:
            assert all(version == 3 for version in result[case]["versions"])
        names = set(checkpoint_tensor_specs(checkpoints["wide_mtp" if case == "tp2" else "tied"]))
        for sent in results[0][case]["sent"]:  # every tensor once (a tied embedding too), or nothing (disk)
            assert len(sent) == len(set(sent)) and (not sent or set(sent) == names)
    assert read_latest(tmp_path / "versions") == tmp_path / "versions" / "v00000003"


def _in_process_receiver(checkpoint: Path, dtype: torch.dtype | None = None) -> WeightReceiver:
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype or "auto")
    return WeightReceiver(model, checkpoint, timeout_s=20).start()


@pytest.mark.parametrize("mismatch", ["names_and_shapes", "dtype"])
def test_a_manifest_the_engine_cannot_take_fails_before_any_byte_moves(model_parallel, checkpoints, receivers,
                                                                       mismatch):
    if mismatch == "names_and_shapes":  # over a collective, to an engine of another model: vocab 384, no MTP head
        bridge, options = create_bridge("megatron-bridge", checkpoints["wide_mtp"]), ModelOptions(mtp=True)
        url, receiver, sender_class = receivers["tied"], None, CollectiveSender
        message = r"nothing was loaded: \d+ name.*'mtp\..*model.embed_tokens.weight: sent as \(5000, 64\) float32, " \
                  r"served as \(384, 64\) float32"
    else:  # colocated, to an engine running in bf16 while the checkpoint (and so the wire) is fp32
        bridge, options = create_bridge("mbridge", checkpoints["tied"]), ModelOptions()
        receiver = _in_process_receiver(checkpoints["tied"], torch.bfloat16)
        url, sender_class = receiver.url, ColocatedSender
        message = "sent as .* float32, served as .* bfloat16"
    names = sorted(checkpoint_tensor_specs(checkpoints["tied"]))
    before = (receiver_tensors(url, names), post_json(f"{url}/model_info", {}, 60)["weight_version"])
    chunks = bridge.build(options)
    sender = sender_class(url, bucket_bytes=MIB, timeout_s=20, device=torch.device("cpu"))
    exported: list[str] = []

    def counted(tensors):
        for name, tensor in tensors:
            exported.append(name)
            yield name, tensor

    try:
        with pytest.raises(WeightSyncError, match=message):
            sender.sync(counted(bridge.export_hf_tensors(chunks)), bridge.hf_tensor_specs(), 1, is_sender=True)
        assert exported == []  # refused before the export (and so before any transfer) started
        after = (receiver_tensors(url, names), post_json(f"{url}/model_info", {}, 60)["weight_version"])
        assert after[1] == before[1]
        assert all(torch.equal(after[0][name], before[0][name]) for name in names)
    finally:
        sender.close()
        if receiver is not None:
            receiver.close()


def test_a_receiver_killed_mid_sync_fails_the_sync_in_time_and_the_next_one_succeeds(model_parallel, checkpoints,
                                                                                     tmp_path):
    checkpoint, timeout_s = checkpoints["wide_mtp"], 10.0
    bridge = create_bridge("megatron-bridge", checkpoint)
    chunks = bridge.build(ModelOptions(mtp=True))
    port = free_port()
    process, url = spawn_receiver(checkpoint, port=port, timeout_s=timeout_s, log=tmp_path / "receiver.log")
    sender = CollectiveSender(url, bucket_bytes=MIB // 4, timeout_s=timeout_s, device=torch.device("cpu"))

    def killing_the_engine_after(tensors, count):
        for index, item in enumerate(tensors):
            if index == count:
                process.send_signal(signal.SIGKILL)
                process.wait()
            yield item

    try:
        started = time.monotonic()
        with pytest.raises(WeightSyncError):
            sender.sync(killing_the_engine_after(bridge.export_hf_tensors(chunks), 6), bridge.hf_tensor_specs(), 1,
                        is_sender=True)
        assert time.monotonic() - started < timeout_s + 5  # no hang: a dead engine fails the sync on time
        process, url = spawn_receiver(checkpoint, port=port, timeout_s=timeout_s, log=tmp_path / "receiver.log")
        report = sender.sync(bridge.export_hf_tensors(chunks), bridge.hf_tensor_specs(), 2, is_sender=True)
        assert len(report.requests) > 2
        export = bridge.save_hf(chunks, tmp_path / "export")
        assert unequal_to_export(url, export) == []
        assert post_json(f"{url}/model_info", {}, 60)["weight_version"] == "2"
    finally:
        sender.close()
        process.kill()
        process.wait()


_KILLED_DURING_A_DISK_SYNC = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    import lightning.pytorch as pl
    from lightning_megatron import staged_write
    from lightning_megatron.callbacks import WeightSync
    from tests.callbacks._engine import fit_with_syncs

    create_file = staged_write.create_file

    def dies_half_way_through_version_3(file, layout):
        if file.parent.name.startswith(".v00000003"):
            with open(file, "wb") as handle:
                handle.write(b"half a file")
            os.kill(os.getpid(), signal.SIGKILL)
        return create_file(file, layout)

    if __name__ == "__main__":
        workdir, hf_checkpoint = Path(sys.argv[1]), Path(sys.argv[2])
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3])
        staged_write.create_file = dies_half_way_through_version_3
        saver = pl.callbacks.ModelCheckpoint(dirpath=workdir / "ckpts", every_n_train_steps=2, save_top_k=-1)
        sync = WeightSync("disk", every_n_steps=1, root=str(workdir / "versions"), keep_last=3)
        fit_with_syncs(workdir, hf_checkpoint, [sync], None, steps=4, extra_callbacks=(saver,))
""")


@pytest.mark.slow
def test_latest_names_a_complete_folder_after_kill_9_and_versions_increase_across_a_resume(
        process_group, checkpoints, receivers, tmp_path):
    script, log = tmp_path / "killed_run.py", tmp_path / "killed_run.log"
    script.write_text(_KILLED_DURING_A_DISK_SYNC)
    with log.open("w") as output:
        run = subprocess.Popen([sys.executable, str(script), str(tmp_path), str(checkpoints["tied"]),
                                str(free_port())], cwd=ROOT, stdout=output,
                               stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                               start_new_session=True)
        try:
            returncode = run.wait(timeout=300)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.pid, signal.SIGKILL)
    assert returncode == -signal.SIGKILL, log.read_text()[-3000:]

    root = tmp_path / "versions"
    assert read_latest(root) == root / "v00000002"
    assert sorted(path.name for path in root.glob("v*")) == ["v00000001", "v00000002"]
    assert list(root.glob(".v00000003.partial-*"))  # the half-written version is hidden, never named
    assert load_file(read_latest(root) / "model.safetensors").keys() == \
        load_file(checkpoints["tied"] / "model.safetensors").keys()

    sync = WeightSync("disk", every_n_steps=1, root=str(root), keep_last=3, engine_url=receivers["tied"])
    restored: list[int | None] = []
    seen = pl.callbacks.LambdaCallback(on_train_start=lambda trainer, module: restored.append(sync.version))
    resumed = fit_with_syncs(tmp_path / "resumed", checkpoints["tied"], [sync], receivers["tied"], steps=4,
                   extra_callbacks=(seen,), ckpt_path=str(tmp_path / "ckpts" / "epoch=0-step=2.ckpt"))
    assert restored == [2]
    assert [result["version"] for result in resumed["compared"]] == [3, 4]  # after the restored version 2
    assert all(result["unequal"] == [] for result in resumed["compared"])
    assert read_latest(root) == root / "v00000004"
    assert sorted(path.name for path in root.iterdir()) == ["latest", "v00000002", "v00000003", "v00000004"]


def test_the_receiver_refuses_a_checkpoint_that_is_no_local_folder_by_name(tmp_path):
    """`--checkpoint` is read from the disk (its safetensors headers); transformers took a missing path for a hub
    name and answered about repo ids."""
    for checkpoint in (tmp_path / "missing", "Qwen/Qwen3-0.6B"):
        with pytest.raises(ValueError, match=r"checkpoint: .* is not an HF checkpoint folder \(no config.json in it\); "
                                             r"give the local folder"):
            WeightReceiver.from_pretrained(checkpoint)


class PreemptAt(pl.Callback):
    """SIGTERM to this process during the step that ends at `step` (PreemptionCheckpoint acts on it at its end)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step - 1:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_fit_preempted_before_its_sync_at_a_due_step_syncs_that_version_when_resumed(process_group, checkpoints,
                                                                                      tmp_path):
    """PreemptionCheckpoint listed before WeightSync saves step 2 and ends the run before version 2 is synced; the
    resumed fit starts at step 2 and sends it then (it went on to version 4: 2 was skipped)."""
    from lightning_megatron.callbacks import PreemptionCheckpoint

    root = tmp_path / "versions"
    sync = WeightSync("disk", every_n_steps=2, root=str(root))
    with pytest.raises(SystemExit):
        fit_with_syncs(tmp_path, checkpoints["tied"], [], None, steps=4,
                       extra_callbacks=(PreemptAt(2), PreemptionCheckpoint(str(tmp_path / "ckpts")), sync))
    assert sync.reports == []
    resumed = WeightSync("disk", every_n_steps=2, root=str(root), keep_last=3)
    fit_with_syncs(tmp_path / "resumed", checkpoints["tied"], [resumed], None, steps=4,
                   ckpt_path=str(tmp_path / "ckpts" / "last.ckpt"))
    assert [report.version for report in resumed.reports] == [2, 4]
    assert sorted(versions(root)) == [2, 4]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["colocated", "collective"])
def test_gpu_hand_over_through_cuda_ipc_and_nccl(model_parallel, checkpoints, tmp_path, mode):
    if mode == "collective" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs the engine on a second GPU")
    checkpoint = checkpoints["wide_mtp"]
    bridge = create_bridge("megatron-bridge", checkpoint)
    chunks = bridge.build(ModelOptions(mtp=True))
    engine_device = "cuda:0" if mode == "colocated" else "cuda:1"
    process, url = spawn_receiver(checkpoint, device=engine_device, timeout_s=60, log=tmp_path / "receiver.log")
    sender_class: Any = ColocatedSender if mode == "colocated" else CollectiveSender
    sender = sender_class(url, bucket_bytes=MIB, timeout_s=60, device=torch.device("cuda", 0))
    try:
        report = sender.sync(bridge.export_hf_tensors(chunks, on_host=False), bridge.hf_tensor_specs(), 1,
                             is_sender=True)
        assert len(report.requests) >= 3
        assert unequal_to_export(url, bridge.save_hf(chunks, tmp_path / "export")) == []
    finally:
        sender.close()
        process.kill()
        process.wait()


def _corrupt(folder: Path, how: str) -> Path:
    """Break the last safetensors file of `folder` (the others are fine: a receiver that loaded file by file would
    already have changed weights when it reached it), or its version record (read after the weights were loaded,
    it left them loaded under the old version)."""
    from safetensors.torch import save_file

    if how == "version record":
        (folder / "weight_version.json").write_text('{"version": 8, ')
        return folder / "weight_version.json"
    file = sorted(folder.glob("*.safetensors"))[-1]
    tensors = load_file(file)
    name = sorted(tensors)[0]
    if how == "truncated":
        file.write_bytes(file.read_bytes()[:-7])
    elif how == "zero-length":
        file.write_bytes(b"")
    elif how == "wrong dtype":
        save_file({**tensors, name: tensors[name].to(torch.float16)}, file, metadata={"format": "pt"})
    else:
        save_file({**tensors, name: tensors[name].reshape(-1)[1:]}, file, metadata={"format": "pt"})
    return file


@pytest.mark.parametrize("how", ["truncated", "zero-length", "wrong dtype", "wrong shape", "version record"])
def test_the_engine_refuses_an_unreadable_sync_folder_by_file_and_keeps_serving_the_last_version(
        checkpoints, receivers, tmp_path, how):
    from lightning_megatron.hf_io import write_safetensors
    from lightning_megatron.serving import disk

    url, original = receivers["tied"], checkpoints["tied"]
    source = load_file(original / "model.safetensors")
    disk.notify_engine(url, "sglang", original, 7, 60)
    served = receiver_tensors(url, sorted(source))
    assert all(torch.equal(served[name], tensor) for name, tensor in source.items())

    broken = tmp_path / "v00000008"
    broken.mkdir()
    write_safetensors(broken, {name: tensor * 2 for name, tensor in source.items()}, shard_bytes=4096)
    assert len(list(broken.glob("*.safetensors"))) >= 3
    bad_file = _corrupt(broken, how)
    with pytest.raises(WeightSyncError, match=f"answered (400|500).*{bad_file.name}"):
        disk.notify_engine(url, "sglang", broken, 8, 60)
    assert post_json(f"{url}/model_info", {}, 60)["weight_version"] == "7"
    assert post_json(f"{url}/model_info", {}, 60)["model_path"] == str(original.resolve())
    served = receiver_tensors(url, sorted(source))
    assert [name for name, tensor in source.items() if not torch.equal(served[name], tensor)] == []


def test_a_shared_memory_bucket_never_closed_is_unlinked_when_collected():
    """A colocated sync on demand after fit has no teardown to close its sender: its staging file in shared memory
    goes when the sender is collected (or the process exits), not never."""
    import gc

    from lightning_megatron.serving.protocol import SharedBuffer

    buffer = SharedBuffer(64, torch.device("cpu"))
    path = buffer.path
    assert path is not None and path.exists()
    del buffer
    gc.collect()
    assert not path.exists()
