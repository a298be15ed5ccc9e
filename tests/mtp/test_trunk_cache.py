"""The trunk cache of MTP-only training: two epochs with it equal two epochs without it (losses per step, final MTP
weights, the audit: bit for bit on CPU fp32) at 1 process, TP=2 with sequence parallelism and packing, PP=2, while
the later epoch runs no decoder layer; a cache made for other weights or data is refused naming both; a full disk
stops the run cleanly and leaves no shard behind."""

from __future__ import annotations

import json
import resource
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron.callbacks import MTPOnlyCallback
from lightning_megatron.module import SFTModule
from lightning_megatron.mtp.parameters import is_mtp_parameter
from lightning_megatron.mtp.trunk_cache import TrunkCacheMismatch, TrunkCacheWriteError
from lightning_megatron.strategy import MegatronStrategy
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from lightning_megatron.testing.datasets import RandomTokenDataset
from tests._distributed import run_distributed
from tests.mtp._helpers import Snapshot

SEQ, VOCAB, SAMPLES = 16, 384, 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("trunk_cache") / "qwen3_mtp", "qwen3", mtp=True)


class DecoderLayerCalls(pl.Callback):
    """Decoder-layer forwards per epoch on this rank (the MTP block's own layer is not counted)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from megatron.core.utils import unwrap_model

        self.per_epoch: list[int] = []
        for chunk in pl_module.model:
            for layer in unwrap_model(chunk).decoder.layers:
                layer.register_forward_hook(lambda *_: self.per_epoch.__setitem__(-1, self.per_epoch[-1] + 1))

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.per_epoch.append(0)


def _fit(root: Path, checkpoint: Path, *, cache: Path | None, data: Any = None, epochs: int = 2,
         log_every_n_steps: int = 1, accelerator: str = "cpu", cuda_graph_trunk: bool | None = None,
         callbacks: tuple[pl.Callback, ...] = (), module_kwargs: dict[str, Any] | None = None,
         callbacks_before: tuple[pl.Callback, ...] = (), **strategy_kwargs: Any) -> dict[str, Any]:
    """`log_every_n_steps` 1: every step's lm_loss is computed (from the cached hidden states in a cached step);
    larger: the main head is skipped on the steps in between (MTPOnlyCallback's on-demand main head).
    `callbacks_before`: callbacks whose hooks run before MTPOnlyCallback's (`callbacks`: after)."""
    options = dict(bridge_type="megatron-bridge", micro_batch_size=2, global_batch_size=4, precision="fp32",
                   use_distributed_optimizer=False) | strategy_kwargs
    snapshot, layers = Snapshot(), DecoderLayerCalls()
    mtp_only = MTPOnlyCallback(loss_chunk_tokens=8, trunk_cache_dir=None if cache is None else str(cache),
                               cuda_graph_trunk=cuda_graph_trunk)
    trainer = pl.Trainer(strategy=MegatronStrategy(hf_checkpoint=str(checkpoint), **options), accelerator=accelerator,
                         devices=options.get("tensor_model_parallel_size", 1) * options.get(
                             "pipeline_model_parallel_size", 1),
                         max_epochs=epochs, log_every_n_steps=log_every_n_steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=root, callbacks=[snapshot, layers, *callbacks_before, mtp_only, *callbacks])
    if data is None:  # shuffled: the second epoch meets the samples in another order
        data = DataLoader(RandomTokenDataset(SAMPLES, SEQ, VOCAB), batch_size=options["micro_batch_size"],
                          shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(0))
    trainer.fit(SFTModule(**dict(enable_mtp=True, lr=1e-2, mtp_detach_heads=True) | (module_kwargs or {})), data)
    torch.distributed.barrier()  # global rank 0 writes the audit at the end of fit
    cache_state = (None if mtp_only.trunk_cache is None else
                   {"written": mtp_only.trunk_cache.writes_done, "read": mtp_only.trunk_cache.reads})
    return {"metrics": snapshot.metrics, "steps": trainer.global_step, "layer_calls": layers.per_epoch,
            "mtp": {name: value for name, value in snapshot.after.items() if is_mtp_parameter(name)},
            "mtp_grads": snapshot.mtp_grads, "audit": json.loads((root / "mtp_only_audit.json").read_text()),
            "cache": cache_state, "graphs": [graph.counts() for graph in mtp_only.trunk_graphs]}


def _assert_equal_runs(cached: dict[str, Any], plain: dict[str, Any]) -> None:
    assert cached["steps"] == plain["steps"] > 2
    assert cached["metrics"] == plain["metrics"]  # every logged value of every step, exactly
    assert {"lm_loss", "mtp_loss", "mtp_accuracy"} <= set(cached["metrics"][-1])
    assert cached["mtp"].keys() == plain["mtp"].keys()
    for name, value in cached["mtp"].items():
        assert torch.equal(value, plain["mtp"][name]), name
    assert cached["audit"] == plain["audit"] and cached["audit"]["frozen_bit_identical"]


def test_two_epochs_from_the_cache_equal_two_epochs_without_it(process_group, checkpoint, tmp_path):
    plain = _fit(tmp_path / "plain", checkpoint, cache=None)
    cached = _fit(tmp_path / "cached", checkpoint, cache=tmp_path / "cache")
    _assert_equal_runs(cached, plain)
    assert plain["graphs"] == cached["graphs"] == []  # cuda_graph_trunk auto: a CPU run stays eager
    layers_per_epoch = plain["layer_calls"][0]
    assert plain["layer_calls"] == [layers_per_epoch, layers_per_epoch] and layers_per_epoch > 0
    assert cached["layer_calls"] == [layers_per_epoch, 0]  # the second epoch ran no decoder layer
    assert cached["cache"] == {"written": 8, "read": 8}  # samples
    again = _fit(tmp_path / "again", checkpoint, cache=tmp_path / "cache")  # a later run reads from its first step
    _assert_equal_runs(again, plain)
    assert again["layer_calls"] == [0, 0] and again["cache"] == {"written": 0, "read": 16}

    other_weights = make_tiny_checkpoint(tmp_path / "other", "qwen3", mtp=True, seed=1)
    other_data = DataLoader(RandomTokenDataset(SAMPLES, SEQ, VOCAB, seed=1), batch_size=2, drop_last=True)
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    for run, changed in (({"checkpoint": other_weights}, "frozen weights changed"),
                         ({"checkpoint": checkpoint, "data": other_data}, "data changed")):
        with pytest.raises(TrunkCacheMismatch, match=changed) as refusal:
            _fit(tmp_path / "refused", cache=tmp_path / "cache", **run)
        assert manifest["frozen_weights"] in str(refusal.value) and manifest["data"] in str(refusal.value)


def test_a_draft_probe_in_the_middle_of_a_cached_step_measures_its_own_rows_and_leaves_the_step_alone(
        process_group, checkpoint, tmp_path):
    """A weight sync whose callback runs before MTPOnlyCallback's probes the head while a cached step is planned:
    its forwards (no autograd) are not the step's, so they read no cached trunk state and count no step forward (the
    cache checks the step's forward count at its end); every version records what the same probe measures on the
    same weights once the step is over."""
    from lightning_megatron import DraftProbe, WeightSync
    from lightning_megatron.serving import served_version
    from tests.mtp.test_probe import TEMPERATURE, ProbeNamedRowsAtTheEnd, Rows

    rows = Rows(RandomTokenDataset(4, SEQ, VOCAB, seed=5), batch_size=2)
    sync = WeightSync("disk", every_n_steps=1, root=str(tmp_path / "versions"),
                      probe=DraftProbe(batches=1, temperature=TEMPERATURE, datamodule=rows))
    after = ProbeNamedRowsAtTheEnd(rows)
    cached = _fit(tmp_path / "cached", checkpoint, cache=tmp_path / "cache", callbacks_before=(sync,),
                  callbacks=(after,))
    assert cached["cache"]["read"] > 0 and sync.version == cached["steps"] > 2
    recorded = served_version(tmp_path / "versions")["draft_acceptance"]
    assert {**recorded, "seconds": 0} == {**after.result.as_json(), "seconds": 0}


def test_serving_weighted_self_distillation_from_the_cache_equals_it_without_the_cache(process_group, checkpoint,
                                                                                       tmp_path):
    """The self-distillation teacher (the MTP block's main hidden states) and the weighting's input ids are what a
    cached step hands the MTP block: the recipe's (a+) trains this way."""
    distill = {"mtp_loss_type": "self_distill", "mtp_distill_weighting": "sampled"}
    plain = _fit(tmp_path / "plain", checkpoint, cache=None, module_kwargs=distill)
    cached = _fit(tmp_path / "cached", checkpoint, cache=tmp_path / "cache", module_kwargs=distill)
    _assert_equal_runs(cached, plain)
    assert cached["layer_calls"][1] == 0 and cached["cache"]["read"] > 0


def test_a_full_disk_stops_the_run_and_leaves_no_shard(process_group, checkpoint, tmp_path):
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death by signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, limit[1]))  # the manifest fits, a shard does not
    try:
        with pytest.raises(TrunkCacheWriteError, match=r"File too large.*bytes per training token"):
            _fit(tmp_path / "full", checkpoint, cache=tmp_path / "cache")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    assert [path.name for path in (tmp_path / "cache").rglob("*") if path.is_file()] == ["manifest.json"]


def _spawned(rank: int, world_size: int, root: str, checkpoint: str) -> dict[str, Any]:
    from lightning_megatron.data import SFTDataModule

    tmp, results = Path(root), {}
    rows = [{"prompt": f"What is {i} plus {i}?", "response": f"It is {2 * i}. Adding a number to itself doubles it."}
            for i in range(12)]
    (tmp / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    packed = dict(tensor_model_parallel_size=2, sequence_parallel=True, micro_batch_size=1, global_batch_size=2)
    for name, parallel in (("tp2_sp_packed", packed), ("pp2", dict(pipeline_model_parallel_size=2))):
        runs = []
        for cache in (None, tmp / f"{name}_cache"):
            data = (SFTDataModule(train_path=str(tmp / "train.jsonl"), seq_length=48, packing=True,
                                  cache_dir=str(tmp / "data_cache")) if name == "tp2_sp_packed" else None)
            runs.append(_fit(tmp / f"{name}_{'cached' if cache else 'plain'}", Path(checkpoint),
                             cache=cache, data=data, log_every_n_steps=2, **parallel))
        results[name] = runs
    return results


@pytest.mark.slow
def test_the_cache_under_tensor_and_pipeline_parallelism_and_packing(checkpoint, tmp_path):
    """TP=2 with sequence parallelism on packed rows (each TP rank caches its sequence slice), then PP=2 (the first
    stage sends placeholders while the last reads)."""
    for rank, result in enumerate(run_distributed(_spawned, tmp_path, str(tmp_path), str(checkpoint))):
        for name, (plain, cached) in result.items():
            _assert_equal_runs(cached, plain)
            per_epoch = plain["layer_calls"][0]
            assert cached["layer_calls"] == [per_epoch, 0], (name, rank)
            last_stage = name != "pp2" or rank == 1
            assert (cached["cache"]["read"] > 0) == last_stage, (name, rank, cached["cache"])


def test_the_cache_needs_the_chunked_main_head() -> None:
    for refused in (dict(loss_chunk_tokens=None), dict(skip_main_head_backward=False)):
        with pytest.raises(ValueError, match="trunk_cache_dir needs skip_main_head_backward: true and loss_chunk"):
            MTPOnlyCallback(trunk_cache_dir="cache", **refused)
