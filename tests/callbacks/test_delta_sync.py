"""Delta weight syncs: after MTP-only or LoRA steps a sync sends only the tensors that changed, and the engine ends
bit-equal to a full sync of the same step; an engine that does not hold the base version gets a full sync; a disk
delta shares every unchanged file with the version before (what goes wrong: test_delta_sync_recovery.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_megatron.callbacks import LoRACallback, MTPOnlyCallback, WeightSync
from lightning_megatron.families import is_hf_mtp_tensor
from lightning_megatron.hf_io import checkpoint_tensor_specs
from lightning_megatron.serving import WeightSyncError, read_latest, served_version
from lightning_megatron.serving.disk import VERSION_FILE, read_version_record, weight_map
from lightning_megatron.serving.protocol import post_json
from lightning_megatron.serving.receiver import spawn_receiver
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from tests._distributed import run_distributed
from tests.callbacks._engine import assert_every_sync_matched, fit_with_syncs, unequal_to_export

MTP_BRIDGE = dict(bridge_type="megatron-bridge")


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


def test_a_glm_mtp_only_delta_sends_its_mtp_layer_but_not_the_copies_of_the_frozen_embedding_and_head(
        process_group, tmp_path):
    """GLM-4.5 stores its MTP layer as one more decoder layer (routed experts inside) with copies of the embedding
    and the LM head; MTP-only training changes the layer, not what it copies, nor the routers' expert bias (updated
    only at a positive moe_router_bias_update_rate)."""
    from lightning_megatron.families import mtp_names
    from lightning_megatron.hf_io import read_json
    from lightning_megatron.testing.checkpoints import MoEShape

    checkpoint = make_tiny_checkpoint(tmp_path / "glm4_moe", "glm4_moe", mtp=True,
                                      moe=MoEShape(routed_scaling_factor=2.5))
    config = read_json(checkpoint / "config.json")
    process, url = spawn_receiver(checkpoint, log=tmp_path / "receiver.log", timeout_s=30)
    sync = _sync("colocated", url, tmp_path)
    try:
        result = fit_with_syncs(tmp_path, checkpoint, [sync], url, steps=2, extra_callbacks=(MTPOnlyCallback(),),
                                **MTP_BRIDGE)
    finally:
        process.kill()
        process.wait()
    assert_every_sync_matched(result["compared"], [1, 2])
    specs = checkpoint_tensor_specs(checkpoint)
    copies = set(mtp_names("glm4_moe").copy_names(0, config).values())
    # the router's expert bias is a buffer its rate (GLM's: 0) would update, not a trained parameter
    layer = sorted(name for name in specs if is_hf_mtp_tensor(name, config) and name not in copies
                   and not name.endswith("e_score_correction_bias"))
    assert copies and copies <= set(specs) and len(layer) > len(copies)
    assert [report.base_version for report in sync.reports] == [None, 1]
    assert _sent(sync.reports[1]) == layer


def test_pruning_keeps_this_runs_versions_and_drops_the_newer_ones_an_earlier_run_left(tmp_path):
    """A run resumed from an earlier step (or a new run into the same root) publishes versions below those an
    earlier run wrote: those are stale (`latest` never names them again) and must not outlast this run's own."""
    from lightning_megatron.serving.disk import prune, publish_latest, version_folder, versions

    for version in (1, 2, 3, 4, 5):  # the earlier run's
        version_folder(tmp_path, version).mkdir()
    publish_latest(tmp_path, version_folder(tmp_path, 2))  # this run, resumed at step 1, has just written version 2
    prune(tmp_path, keep_last=2)
    assert sorted(versions(tmp_path)) == [1, 2] and read_latest(tmp_path) == version_folder(tmp_path, 2)
    prune(tmp_path, keep_last=1)
    assert sorted(versions(tmp_path)) == [2]


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


@pytest.mark.parametrize("mode", ["colocated", "collective"])
def test_an_engine_restarted_between_syncs_gets_a_full_sync(process_group, checkpoint, tmp_path, mode):
    """Collective: the restarted engine's end of the update group is gone too; the sync builds a new one."""
    from tests._distributed import free_port

    port = free_port()
    process, url = spawn_receiver(checkpoint, port=port, log=tmp_path / "receiver.log", timeout_s=30)
    restart = RestartEngine(checkpoint, port, after_version=2, log=tmp_path / "receiver.log")
    restart.process = process
    sync = _sync(mode, url, tmp_path)
    try:
        result = fit_with_syncs(tmp_path, checkpoint, [sync], url, extra_callbacks=(MTPOnlyCallback(), restart),
                                **MTP_BRIDGE)
    finally:
        restart.process.kill()
        restart.process.wait()
    assert [report.base_version for report in sync.reports] == [None, 1, None]  # version 3: in full
    assert_every_sync_matched(result["compared"], [1, 2, 3])


@pytest.mark.parametrize("resumed", [True, False], ids=["resumed_past_the_sync", "fresh_fit"])
def test_a_fit_that_does_not_start_at_the_synced_step_syncs_in_full_first(process_group, checkpoint, tmp_path,
                                                                         resumed):
    """The RL loop's rounds reuse one WeightSync: a joint round syncs version 2 and trains step 3 unsynced; the next
    round, MTP-only, resumes from step 3 (or starts afresh from the checkpoint's weights): the trunk differs from
    version 2 beyond what the new fit trains, so its first sync is full and the disk holds the model's weights."""
    sync = WeightSync("disk", every_n_steps=2, root=str(tmp_path / "versions"), sync_on_train_end=False)
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpts", save_last=True)
    fit_with_syncs(tmp_path / "joint", checkpoint, [sync], None, steps=3, extra_callbacks=(saver,), **MTP_BRIDGE)
    assert sync.version == 2
    result = fit_with_syncs(tmp_path / "mtp_only", checkpoint, [sync], None, steps=4 if resumed else 2,
                            ckpt_path=str(tmp_path / "ckpts" / "last.ckpt") if resumed else None,
                            extra_callbacks=(MTPOnlyCallback(),), **MTP_BRIDGE)
    assert sync.reports[-1].version == (4 if resumed else 2) and sync.reports[-1].base_version is None
    export = result["trainer"].strategy.export_hf(tmp_path / "export")
    assert _unequal_folders(read_latest(tmp_path / "versions"), export) == []


def test_lora_syncs_send_the_adapted_linears_merged_or_the_adapters_alone(process_group, tmp_path_factory,
                                                                         tmp_path):
    """Merged (colocated): after the first sync only the wrapped linears go, merged, and the engine equals the merged
    export; adapter form (disk): each version is the PEFT folder `export_lora_adapter` writes, and nothing else,
    which the engine told to load it serves by name over its base weights as the merged model."""
    from safetensors.torch import load_file

    from lightning_megatron.lora import export_lora_adapter

    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("lora_sync") / "qwen3", "qwen3")
    engines = [spawn_receiver(checkpoint, log=tmp_path / "receiver.log", timeout_s=30) for _ in range(2)]
    (_, url), (_, adapter_url) = engines  # the second keeps the base weights and is told to load each adapter
    merged = _sync("colocated", url, tmp_path)
    adapter = WeightSync("disk", every_n_steps=1, root=str(tmp_path / "adapters"), keep_last=2, lora_form="adapter",
                         engine_url=adapter_url)
    try:
        result = fit_with_syncs(tmp_path, checkpoint, [merged, adapter], url, module_kwargs={"enable_mtp": False},
                                extra_callbacks=(LoRACallback(target_modules=["linear_qkv"], rank=4, alpha=8),),
                                **MTP_BRIDGE)
        request = {"input_ids": [5, 17, 42, 99, 3], "sampling_params": {"max_new_tokens": 8}}
        with_adapter, with_merged = (post_json(f"{engine}/generate", {**request, **extra}, 60)["output_ids"]
                                     for engine, extra in ((adapter_url, {"lora_path": "v00000003"}), (url, {})))
        with pytest.raises(WeightSyncError, match="does not load as a PEFT adapter of this model"):
            post_json(f"{adapter_url}/load_lora_adapter", {"lora_name": "broken", "lora_path": str(tmp_path)}, 60)
        # version 1's folder was pruned: the engine was told to unload its adapter (it served a deleted folder)
        with pytest.raises(WeightSyncError, match="no LoRA adapter 'v00000001' is loaded"):
            post_json(f"{adapter_url}/generate", {**request, "lora_path": "v00000001"}, 60)
    finally:
        for process, _ in engines:
            process.kill()
            process.wait()
    assert with_adapter == with_merged  # the adapter the engine loaded, over its base weights, is the merged model
    assert_every_sync_matched(result["compared"], [1, 2, 3])  # the engine equals the merged export of each step
    specs = checkpoint_tensor_specs(checkpoint)
    adapted = sorted(name for name in specs if any(f"self_attn.{p}_proj.weight" in name for p in "qkv"))
    assert [report.base_version for report in merged.reports] == [None, 1, 2]
    assert _sent(merged.reports[0]) == sorted(specs)
    assert _sent(merged.reports[1]) == _sent(merged.reports[2]) == adapted

    folder = read_latest(tmp_path / "adapters")
    assert sorted(path.name for path in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                              VERSION_FILE]
    expected = export_lora_adapter(result["trainer"].strategy, tmp_path / "expected_adapter")
    assert json.loads((folder / "adapter_config.json").read_text()) == \
        json.loads((expected / "adapter_config.json").read_text())
    ours, theirs = (load_file(path / "adapter_model.safetensors") for path in (folder, expected))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert all(report.bytes < merged.reports[0].bytes / 10 for report in adapter.reports)


def test_a_resumed_run_writing_an_adapter_version_again_has_the_engine_load_it_in_place_of_the_old_one(
        process_group, tmp_path):
    """Syncs every step, checkpoints every step: the run resumed at step 1 writes version 2 again, whose adapter the
    engine still holds under that name from the first run (vLLM refuses a second adapter under a loaded name, as the
    package's receiver does): the sync unloads it first (the resumed fit failed at that sync)."""
    checkpoint = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3")
    process, url = spawn_receiver(checkpoint, log=tmp_path / "receiver.log", timeout_s=30)
    try:
        for run, resume in (("first", None), ("resumed", str(tmp_path / "ckpts" / "epoch=0-step=1.ckpt"))):
            sync = WeightSync("disk", every_n_steps=1, root=str(tmp_path / "adapters"), keep_last=3,
                              lora_form="adapter", engine_url=url)
            savers = [] if resume else [pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1,
                                                                     save_top_k=-1)]
            fit_with_syncs(tmp_path / run, checkpoint, [sync], None, steps=2, ckpt_path=resume,
                           module_kwargs={"enable_mtp": False}, **MTP_BRIDGE,
                           extra_callbacks=(LoRACallback(target_modules=["linear_qkv"], rank=4, alpha=8), *savers))
        assert [report.version for report in sync.reports] == [2]
        request = {"input_ids": [5, 17, 42], "sampling_params": {"max_new_tokens": 4}, "lora_path": "v00000002"}
        assert len(post_json(f"{url}/generate", request, 60)["output_ids"]) == 4
    finally:
        process.kill()
        process.wait()


class CountSteps(pl.Callback):
    """How many training steps began: a refusal at setup leaves it at 0."""

    def __init__(self) -> None:
        self.started = 0

    def on_train_batch_start(self, *args: Any) -> None:
        self.started += 1


def test_adapters_the_peft_form_cannot_name_are_refused_before_the_first_step(process_group, tmp_path):
    """Qwen3.5-MoE stores its decoder's experts fused (`mlp.experts.gate_up_proj`): the default targets adapt each
    expert, which no tensor of the checkpoint names, so the adapter form is refused when the fit starts (it was
    refused at the first sync, after the training steps), naming the merged form."""
    from lightning_megatron.testing.checkpoints import MoEShape

    checkpoint = make_tiny_checkpoint(tmp_path / "qwen3_5_moe", "qwen3_5_moe_text", moe=MoEShape())
    sync = WeightSync("disk", every_n_steps=1, root=str(tmp_path / "adapters"), lora_form="adapter")
    steps = CountSteps()
    with pytest.raises(ValueError, match=r"WeightSync\(lora_form='adapter'\): the adapters of \['model\.layers\.0\.mlp"
                                         r"\.experts\.0\.down_proj'.* name no tensor of .*; set lora_form: merged"):
        fit_with_syncs(tmp_path, checkpoint, [sync], None, steps=1, module_kwargs={"enable_mtp": False},
                       extra_callbacks=(LoRACallback(rank=4, alpha=8), steps), **MTP_BRIDGE)
    assert steps.started == 0 and sync.reports == []
    assert not (tmp_path / "adapters").exists()


@pytest.mark.parametrize(("options", "message"), [
    (dict(mode="colocated", engine_url="http://127.0.0.1:1", lora_form="adapter"),
     r"lora_form: 'adapter' writes PEFT folders .* use mode='disk', or lora_form='merged'"),
    (dict(lora_form="peft"), r"lora_form: 'peft' is not one of 'merged', 'adapter'"),
    (dict(mode="colocated", engine_url="127.0.0.1:30000"), r"engine_url: '127.0.0.1:30000' is not an HTTP address"),
    (dict(mode="colocated", engine_url="http://127.0.0.1:1", root="versions"), r"root: mode 'colocated' .* writes "
                                                                                 r"nothing under root"),
    (dict(keep_last=1.5), r"keep_last: 1.5 must be an integer >= 1"),
    (dict(every_n_steps=True), r"every_n_steps: True must be an integer >= 1"),
    (dict(mode="collective", engine_url="http://127.0.0.1:1", backend="mpi"), r"backend: 'mpi' is not one of"),
    (dict(delta="no"), r"delta: 'no' must be true or false"),
    (dict(probe={"batches": 2}), r"probe: \{'batches': 2\} is not a DraftProbe"),
    # refused here, not at the first sync after training steps (an OverflowError, a zero-byte bucket, no rendezvous)
    (dict(mode="colocated", engine_url="http://127.0.0.1:1", timeout_s=float("inf")),
     r"timeout_s: inf must be a finite number > 0 \(the seconds one request or broadcast may take"),
    (dict(mode="colocated", engine_url="http://127.0.0.1:1", bucket_mb=1e-9),
     r"bucket_mb: 1e-09 is less than one byte; give the MiB one request carries"),
    (dict(mode="colocated", engine_url="http://127.0.0.1:1", bucket_mb="1024"),
     r"bucket_mb: '1024' must be a finite number > 0"),
    (dict(mode="collective", engine_url="http://127.0.0.1:1", master_port=70000),
     r"master_port: 70000 is not a TCP port; give an integer in 1..65535, or 0 for a free one"),
    (dict(mode="collective", engine_url="http://127.0.0.1:1", master_address=""), r"master_address: '' is not a host"),
    (dict(mode="colocated", engine_url="http://"), r"engine_url: 'http://' is not an HTTP address"),
    (dict(root=""), r"root: mode 'disk' writes versioned HF folders under root; set root to a folder"),
    (dict(mode="collective", engine_url="http://127.0.0.1:1", engine="vllm"),
     r"engine: 'vllm' shapes the disk mode's requests; mode 'collective' sends SGLang's .* use mode='disk'"),
])
def test_bad_options_are_refused_naming_the_field_and_the_fix(options, message):
    options = {"mode": "disk", **options}
    with pytest.raises(ValueError, match=message):
        WeightSync(**({"root": "versions"} if options["mode"] == "disk" else {}) | options)


@pytest.mark.parametrize(("module_kwargs", "options", "message"), [
    ({"enable_mtp": False}, dict(probe="probe"), r"probe: DraftProbe measures the draft \(MTP\) head, but SFTModule "
                                                 r"has none \(enable_mtp: false\)"),
    ({}, dict(lora_form="adapter"), r"lora_form: 'adapter' writes the LoRA adapters, but this run trains none"),
])
def test_a_probe_without_a_draft_head_and_adapters_without_lora_are_refused_before_the_model_is_built(
        process_group, checkpoint, tmp_path, module_kwargs, options, message):
    from lightning_megatron import DraftProbe

    if options.get("probe"):
        options = {**options, "probe": DraftProbe(batches=1)}
    sync = WeightSync("disk", every_n_steps=1, root=str(tmp_path / "versions"), **options)
    with pytest.raises(ValueError, match=message):
        fit_with_syncs(tmp_path, checkpoint, [sync], None, steps=1, module_kwargs=module_kwargs, **MTP_BRIDGE)
    assert not (tmp_path / "versions").exists()


class ProbeAgain(pl.Callback):
    """After each sync (it runs after the WeightSync callbacks): the probe measured once more on the same weights,
    the version record on the disk and the engine's."""

    def __init__(self, syncs: list[WeightSync], url: str, root: Path) -> None:
        self.syncs, self.url, self.root = syncs, url, root
        self.seen: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        version = self.syncs[0].version
        if version is None or (self.seen and self.seen[-1]["version"] == version):
            return
        assert self.syncs[0].probe is not None
        again = self.syncs[0].probe.measure(trainer, trainer.lightning_module)
        self.seen.append({"version": version, "again": again.as_json(),
                          "reports": [sync.reports[-1].metadata for sync in self.syncs],
                          "disk": served_version(self.root), "engine": served_version(self.url)})


class MetricsByStep(pl.loggers.logger.Logger):
    """What reaches a logger, by step."""

    name, version = "recorded", 0

    def __init__(self) -> None:
        super().__init__()
        self.by_step: dict[int, dict[str, float]] = {}

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.by_step.setdefault(step, {}).update(metrics)


def test_each_version_carries_the_draft_acceptance_the_probe_measured_on_its_weights(process_group, checkpoint,
                                                                                     engine, tmp_path):
    from lightning_megatron import DraftProbe
    from lightning_megatron.mtp.probe import DraftAcceptance
    from lightning_megatron.testing.datasets import RandomTokenDataset
    from tests.mtp.test_probe import Rows

    probe = DraftProbe(batches=2, temperature=0.7, datamodule=Rows(RandomTokenDataset(8, 16, 384, seed=7), 2))
    syncs = [WeightSync("colocated", every_n_steps=1, engine_url=engine, bucket_mb=1, timeout_s=60, probe=probe),
             WeightSync("disk", every_n_steps=1, root=str(tmp_path / "versions"), keep_last=3, probe=probe)]
    again, logger = ProbeAgain(syncs, engine, tmp_path / "versions"), MetricsByStep()
    fit_with_syncs(tmp_path, checkpoint, syncs, None, extra_callbacks=(MTPOnlyCallback(), again), logger=logger,
                   **MTP_BRIDGE)

    assert [seen["version"] for seen in again.seen] == [1, 2, 3]
    for seen in again.seen:
        measured = seen["again"]
        for recorded in (*seen["reports"], seen["disk"], seen["engine"]):
            assert {**recorded["draft_acceptance"], "seconds": 0} == {**measured, "seconds": 0}
        assert seen["disk"]["version"] == seen["engine"]["version"] == seen["version"]
        acceptance = DraftAcceptance.from_json(seen["engine"]["draft_acceptance"])
        assert acceptance.temperature == 0.7 and 0 < acceptance.positions
        logged = logger.by_step[seen["version"]]
        assert logged["draft_acceptance/sampled_depth1"] == acceptance.sampled[0]
        assert logged["draft_acceptance/greedy_depth1"] == acceptance.greedy[0]
    assert [seen["engine"]["base_version"] for seen in again.seen] == [None, 1, 2]
    first, last = (seen["again"]["sampled"][0] for seen in (again.seen[0], again.seen[-1]))
    assert first != last  # the head trained between the versions, and the record follows it


def test_a_probe_set_of_its_own_gets_the_runs_data_settings(process_group, checkpoint, tmp_path):
    """`DraftProbe(datamodule=SFTDataModule(val_path=...))` as a config names it: the tokenizer's checkpoint and the
    microbatch rows come from the strategy, as for the trainer's own data module."""
    from lightning_megatron import DraftProbe, SFTDataModule

    rows = SFTDataModule(val_path=str(Path(__file__).resolve().parents[2] / "configs/data/tiny_sft_val.jsonl"),
                         seq_length=128)
    sync = WeightSync("disk", every_n_steps=1, root=str(tmp_path / "versions"), probe=DraftProbe(batches=1,
                                                                                               datamodule=rows))
    fit_with_syncs(tmp_path, checkpoint, [sync], None, steps=1, **MTP_BRIDGE)
    recorded = served_version(tmp_path / "versions")["draft_acceptance"]
    assert recorded["batches"] == 1 and recorded["positions"] > 0


def _distributed_delta_syncs(rank: int, world_size: int, workdir: str, checkpoint: str,
                             urls: dict[str, str]) -> dict[str, Any]:
    """MTP-only fits at TP=2, then PP=2, each syncing every step in the three modes; at the end every engine and the
    last disk version against a full export of the same weights."""

    results = {}
    for case, parallel in (("tp2", dict(tensor_model_parallel_size=2)), ("pp2", dict(pipeline_model_parallel_size=2))):
        root = Path(workdir) / case
        syncs = [_sync("colocated", urls["colocated"], root), _sync("collective", urls["collective"], root),
                 _sync("disk", None, root)]
        result = fit_with_syncs(root, Path(checkpoint), syncs, None, devices=world_size,
                                extra_callbacks=(MTPOnlyCallback(),), **MTP_BRIDGE, **parallel)
        export = result["trainer"].strategy.export_hf(root / "export")
        results[case] = {"bases": [[report.base_version for report in sync.reports] for sync in syncs],
                         "sent": [[_sent(report) for report in sync.reports] for sync in syncs[:2]]}
        if rank == 0:
            results[case]["unequal"] = [unequal_to_export(urls[mode], export) for mode in ("colocated", "collective")]
            results[case]["disk_unequal"] = _unequal_folders(read_latest(root / "versions"), export)
    return results


def _unequal_folders(folder: Path, export: Path) -> list[str]:
    from safetensors.torch import load_file

    def tensors(path: Path) -> dict[str, torch.Tensor]:
        return {name: tensor for file in path.glob("*.safetensors") for name, tensor in load_file(file).items()}

    ours, expected = tensors(folder), tensors(export)
    return sorted(name for name in expected.keys() | ours.keys()
                  if name not in ours or name not in expected or not torch.equal(ours[name], expected[name]))


@pytest.mark.slow
def test_delta_syncs_under_tensor_and_pipeline_parallelism_leave_every_engine_equal_to_a_full_sync(
        checkpoint, tmp_path):
    started = {mode: spawn_receiver(checkpoint, log=tmp_path / f"{mode}.log", timeout_s=60)
               for mode in ("colocated", "collective")}
    try:
        results = run_distributed(_distributed_delta_syncs, tmp_path, str(tmp_path), str(checkpoint),
                                  {mode: url for mode, (_, url) in started.items()})
    finally:
        for process, _ in started.values():
            process.kill()
            process.wait()
    mtp_names = sorted(name for name in checkpoint_tensor_specs(checkpoint) if is_hf_mtp_tensor(name))
    for case in ("tp2", "pp2"):
        for result in results:
            assert result[case]["bases"] == [[None, 1, 2]] * 3  # every mode: a full sync, then deltas
        for sent in results[0][case]["sent"]:
            assert sent[1] == sent[2] == mtp_names
        assert results[0][case]["unequal"] == [[], []]
        assert results[0][case]["disk_unequal"] == []
