"""Delta syncs after something went wrong: a damaged or mismatched disk base (a full version instead), an engine
holding another version (the delta refused, naming both, nothing changed), a trainer that died half-way through an
update (no trace of it in the next one), a sender whose first sync was a delta (its next full sync sends everything)."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_megatron.bridges import create_bridge
from lightning_megatron.callbacks import MTPOnlyCallback
from lightning_megatron.families import is_hf_mtp_tensor
from lightning_megatron.hf_io import checkpoint_tensor_specs
from lightning_megatron.options import ModelOptions
from lightning_megatron.serving import ColocatedSender, WeightReceiver, WeightSyncError
from lightning_megatron.serving.protocol import post_json
from tests.callbacks._engine import MIB, fit_with_syncs, receiver_tensors, unequal_to_export
from tests.callbacks.test_delta_sync import MTP_BRIDGE, _sent, _sync


def test_a_disk_delta_is_written_only_onto_a_base_whose_files_hold_the_tensors_as_the_model_has_them(tmp_path):
    """A base whose tensors differ in dtype or shape from the model's now, or whose file is truncated or gone, would be
    linked into the new version as it is: a full version is written instead."""
    from safetensors.torch import save_file

    from lightning_megatron.hf_io import TensorSpec
    from lightning_megatron.serving.disk import INDEX_FILE, delta_base, publish_latest, version_folder

    folder = version_folder(tmp_path, 3)
    folder.mkdir()
    save_file({"trunk.weight": torch.zeros(4, 2)}, folder / "trunk.safetensors")
    save_file({"mtp.weight": torch.zeros(2)}, folder / "mtp.safetensors")
    (folder / INDEX_FILE).write_text(json.dumps({"weight_map": {"trunk.weight": "trunk.safetensors",
                                                                "mtp.weight": "mtp.safetensors"}}))
    publish_latest(tmp_path, folder)
    specs = {"trunk.weight": TensorSpec("trunk.weight", (4, 2), torch.float32),
             "mtp.weight": TensorSpec("mtp.weight", (2,), torch.float32)}
    assert delta_base(tmp_path, 3, {"mtp.weight"}, specs) == folder
    assert delta_base(tmp_path, 2, {"mtp.weight"}, specs) is None  # not the version latest names
    for name, changed in (("trunk.weight", TensorSpec("trunk.weight", (4, 2), torch.bfloat16)),
                          ("trunk.weight", TensorSpec("trunk.weight", (2, 4), torch.float32))):
        assert delta_base(tmp_path, 3, {"mtp.weight"}, {**specs, name: changed}) is None
    index = (folder / INDEX_FILE).read_text()
    for damaged in ("{not json", '{"metadata": {}}', "", "[]", '{"weight_map": {"mtp.weight": 3}}'):
        (folder / INDEX_FILE).write_text(damaged)  # every later sync raised reading it (and could never write again)
        assert delta_base(tmp_path, 3, {"mtp.weight"}, specs) is None
    (folder / INDEX_FILE).write_text(index)
    assert delta_base(tmp_path, 3, {"mtp.weight"}, specs) == folder
    trunk = folder / "trunk.safetensors"
    trunk.write_bytes(trunk.read_bytes()[:-4])  # truncated
    assert delta_base(tmp_path, 3, {"mtp.weight"}, specs) is None
    trunk.unlink()
    assert delta_base(tmp_path, 3, {"mtp.weight"}, specs) is None


def test_what_a_killed_run_left_hidden_in_the_root_goes_when_the_next_one_starts(tmp_path):
    """A version written again (a resumed run) retires the old folder as `.vNNNNNNNN.old-PID` and deletes it: a run
    killed in that deletion left a whole checkpoint there for ever."""
    from lightning_megatron.serving.disk import remove_partials, version_folder

    leftovers = [tmp_path / ".v00000004.partial-123", tmp_path / ".v00000004.old-123"]
    for folder in [*leftovers, version_folder(tmp_path, 2)]:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"weights")
    remove_partials(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["v00000002"]


@pytest.mark.parametrize("mode", ["colocated", "collective"])
def test_a_full_sync_after_a_delta_of_the_same_sender_sends_every_tensor(process_group, checkpoint, engine, tmp_path,
                                                                         mode):
    """A fit's sender is new (the last fit's closed at teardown), so its first sync may be a delta (on demand after
    the fit, or a round resumed at the synced step): its staging buffer, sized for that delta, grows for a full sync
    (it stayed delta-sized: the full sync failed copying a tensor past its end)."""
    sync = _sync(mode, engine, tmp_path)
    result = fit_with_syncs(tmp_path, checkpoint, [sync], None, steps=1, extra_callbacks=(MTPOnlyCallback(),),
                            **MTP_BRIDGE)
    trainer = result["trainer"]
    try:
        reports = [sync.sync(trainer), sync.sync(trainer, full=True)]
    finally:
        sync.teardown(trainer, trainer.lightning_module, "fit")
    assert [report.base_version for report in reports] == [1, None]
    assert _sent(reports[1]) == sorted(checkpoint_tensor_specs(checkpoint))
    assert unequal_to_export(engine, trainer.strategy.export_hf(tmp_path / "export")) == []


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


@pytest.mark.parametrize("aborted", ["delta", "full"])
def test_an_update_left_half_sent_by_a_dead_trainer_leaves_no_trace_in_the_next_one(checkpoint, aborted):
    """A trainer dies after the first bucket of an update of version 2's engine, the run resumed at step 2 sends a
    delta onto 2 of other tensors. A half delta was staged, not applied: the engine applies the new delta alone (it
    applied the staged tensors with it). A half full sync was applied: the engine holds no version any more, so the
    delta is refused (it kept claiming version 2 and took the delta: a mix of weights no sync carried)."""
    import transformers
    from safetensors.torch import load_file

    receiver = WeightReceiver(transformers.AutoModelForCausalLM.from_pretrained(checkpoint), checkpoint,
                              timeout_s=20).start()
    specs = checkpoint_tensor_specs(checkpoint)
    held = load_file(checkpoint / "model.safetensors")
    norms = [name for name in sorted(specs) if name.endswith("layernorm.weight") and not is_hf_mtp_tensor(name)][:3]
    mtp = {name: specs[name] for name in specs if is_hf_mtp_tensor(name)}

    def dies_after_the_first_bucket():
        for name in norms:  # the first bucket (two norms) goes out as the third is staged
            yield name, held[name] * 2
        raise RuntimeError("the trainer died")

    senders = [ColocatedSender(receiver.url, bucket_bytes=2 * specs[norms[0]].nbytes, timeout_s=20,
                               device=torch.device("cpu")) for _ in range(2)]
    try:
        senders[0].sync(iter(held.items()), specs, 2, is_sender=True)
        with pytest.raises(RuntimeError, match="the trainer died"):
            senders[0].sync(dies_after_the_first_bucket(), {name: specs[name] for name in norms}, 3, is_sender=True,
                            base_version=2 if aborted == "delta" else None)
        delta = (((name, held[name] + 1) for name in mtp), mtp, 3)
        if aborted == "delta":
            senders[1].sync(*delta, is_sender=True, base_version=2)
            served = receiver_tensors(receiver.url, [*norms, *mtp])
            assert [name for name in norms if not torch.equal(served[name], held[name])] == []
            assert all(torch.equal(served[name], held[name] + 1) for name in mtp)
        else:
            assert post_json(f"{receiver.url}/model_info", {}, 60)["weight_version"] is None
            with pytest.raises(WeightSyncError, match="a delta onto weight version 2 cannot apply: this engine holds "
                                                      "version None"):
                senders[1].sync(*delta, is_sender=True, base_version=2)
    finally:
        for sender in senders:
            sender.close()
        receiver.close()
