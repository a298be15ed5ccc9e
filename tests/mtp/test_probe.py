"""The draft probe (`DraftProbe`, `SFTModule.draft_acceptance`): the MTP head's teacher-forced acceptance per depth.

At depth 1 the probe's greedy and sampled acceptance are validation's `val_mtp_acceptance` /
`val_mtp_sampled_acceptance` on the same batches; with `mtp_depths=2` both depths equal a direct computation from
the logits of the model's own MTP block (padded and packed rows, one process); at TP=2 with sequence parallelism
they equal the one-process figures and validation's. The probe reads the trainer's validation data or a data module
it is given, leaves the module's train/eval modes, every RNG and training itself as they were, and refuses bad
options, a module without an MTP head and a trainer without validation data.

The direct computation: the MTP block's output (the main decoder's hidden states and one per depth), full-vocabulary
fp32 logits from the model's output layer, and per depth k and position t (plain indexing on whole rows): the draft
`q = mtp_k[t]` against the main head `p = main[t + k]`, counted where `loss_mask[t + k]` is set and t + k is in
t's sequence; greedy `argmax q == argmax p`, sampled `sum_x min(softmax(p / T), softmax(q / T))`.
"""

from __future__ import annotations

import math
import random
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_megatron.data.packing import collate_packed
from lightning_megatron.module import SFTModule
from lightning_megatron.mtp.probe import DraftAcceptance, DraftProbe
from lightning_megatron.strategy import MegatronStrategy
from lightning_megatron.testing.datasets import RandomTokenDataset
from tests._distributed import run_distributed
from tests.mtp._helpers import SAMPLES, SEQ, VOCAB, block_logits, fit
from tests.test_context_parallel import SequencesDataset

TEMPERATURE, DEPTHS, ROWS = 0.7, 2, 4
# validation's metrics are float32 (`PooledAcceptance.compute`): half a float32 step below 1, pooled float64 sums
# and fp32 softmaxes over a 384-token vocabulary leave the rest far below it
FLOAT32_ROUNDING = 2.0 ** -24


class Rows(pl.LightningDataModule):
    """`dataset` as validation data, one row per microbatch (a probe set the user names)."""

    def __init__(self, dataset: Dataset, batch_size: int = 1) -> None:
        super().__init__()
        self.dataset, self.batch_size = dataset, batch_size

    def val_dataloader(self) -> DataLoader:
        collate = collate_packed if getattr(self.dataset, "packed", False) else None
        return DataLoader(self.dataset, batch_size=self.batch_size, collate_fn=collate)


class NoRows(pl.LightningDataModule):
    """A data module without validation data (as `SFTDataModule` without `val_path`)."""

    def val_dataloader(self) -> list:
        return []


def _direct(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], temperature: float
            ) -> tuple[list[float], list[float], int]:
    """(greedy, sampled) acceptance per depth, pooled over `batches`, from the model's own MTP block output, and
    the positions counted at depth 1."""
    accepted, overlap, counted = [0.0] * DEPTHS, [0.0] * DEPTHS, [0.0] * DEPTHS
    for batch in batches:
        main, *drafts = block_logits(model, batch)
        seq = main.size(1)
        ends = batch["cu_seqlens"][1:].tolist() if "cu_seqlens" in batch else [seq]
        sequence = torch.bucketize(torch.arange(seq), torch.tensor(ends), right=True)
        for k, draft in enumerate(drafts, start=1):
            mask = batch["loss_mask"][:, k:].bool() & (sequence[:-k] == sequence[k:])
            p = torch.softmax(main[:, k:] / temperature, -1)
            q = torch.softmax(draft[:, :-k] / temperature, -1)
            greedy = draft[:, :-k].argmax(-1) == main[:, k:].argmax(-1)
            accepted[k - 1] += float((greedy & mask).sum())
            overlap[k - 1] += float((torch.minimum(p, q).sum(-1) * mask).sum())
            counted[k - 1] += float(mask.sum())
    return [a / c for a, c in zip(accepted, counted)], [o / c for o, c in zip(overlap, counted)], int(counted[0])


class ProbeAfterValidation(pl.Callback):
    """When validation ends: each probe's figures, and (one process) the direct computation on `direct_batches`."""

    def __init__(self, probes: dict[str, DraftProbe], direct_batches: list | None = None) -> None:
        self.probes, self.direct_batches = probes, direct_batches

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from megatron.core.utils import unwrap_model

        self.results = {name: probe.measure(trainer, pl_module) for name, probe in self.probes.items()}
        if self.direct_batches is not None:
            self.direct = {temperature: _direct(unwrap_model(pl_module.model[0]), self.direct_batches, temperature)
                           for temperature in (TEMPERATURE, 1.0)}


def _validate(workdir: Path, hf_checkpoint: str, dataset: Dataset, callback: ProbeAfterValidation,
              **strategy_kwargs: Any) -> dict[str, float]:
    """Validation's metrics over `ROWS` rows, two global batches of two microbatches."""
    options = dict(bridge_type="megatron-bridge", micro_batch_size=1, global_batch_size=2, precision="fp32")
    trainer = pl.Trainer(strategy=MegatronStrategy(hf_checkpoint=hf_checkpoint, **options | strategy_kwargs),
                         accelerator="cpu", devices=torch.distributed.get_world_size(), logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=ROWS // 2,
                         default_root_dir=workdir, callbacks=[callback])
    module = SFTModule(enable_mtp=True, mtp_depths=DEPTHS, mtp_sampling_temperature=TEMPERATURE)
    trainer.validate(module, Rows(dataset).val_dataloader())
    return {key: float(value) for key, value in trainer.callback_metrics.items()}


def _probes(dataset: Dataset) -> dict[str, DraftProbe]:
    return {"validation": DraftProbe(batches=ROWS // 2, temperature=TEMPERATURE),
            "named": DraftProbe(batches=ROWS // 2, temperature=TEMPERATURE, datamodule=Rows(dataset)),
            "hot": DraftProbe(batches=ROWS // 2, temperature=1.0),
            "one_batch": DraftProbe(batches=1, temperature=TEMPERATURE)}


def _assert_depth_one_is_validation(result: DraftAcceptance, metrics: dict[str, float]) -> None:
    assert result.greedy[0] == pytest.approx(metrics["val_mtp_acceptance"], rel=0, abs=FLOAT32_ROUNDING)
    assert result.sampled[0] == pytest.approx(metrics["val_mtp_sampled_acceptance"], rel=0, abs=FLOAT32_ROUNDING)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_probe_is_validation_at_depth_one_and_the_direct_computation_at_every_depth(
        process_group, checkpoints, tmp_path, packed):
    dataset = SequencesDataset(packed, alignment=4, rows=ROWS)
    collate = collate_packed if packed else torch.utils.data.default_collate
    callback = ProbeAfterValidation(_probes(dataset), [collate([dataset[index]]) for index in range(ROWS)])
    metrics = _validate(tmp_path, str(checkpoints["qwen3_mtp"]), dataset, callback)
    results = callback.results
    _assert_depth_one_is_validation(results["validation"], metrics)
    assert results["named"].greedy == results["validation"].greedy  # the same rows, read from the named data module
    assert results["named"].sampled == results["validation"].sampled
    for name, temperature in (("validation", TEMPERATURE), ("hot", 1.0)):
        greedy, sampled, positions = callback.direct[temperature]
        assert results[name].positions == positions
        assert results[name].greedy == pytest.approx(greedy, rel=0, abs=1e-12)  # ratios of the same integers
        assert results[name].sampled == pytest.approx(sampled, rel=0, abs=1e-6)
    result = results["validation"]
    assert abs(result.sampled[1] - result.sampled[0]) > 1e-3  # two depths, each its own figure
    assert all(0.05 < value < 0.95 for value in result.sampled)
    # the temperature changes the sampled acceptance of a random head, not the greedy one
    assert results["hot"].greedy == result.greedy and abs(results["hot"].sampled[0] - result.sampled[0]) > 1e-3
    assert (result.batches, result.temperature, results["hot"].temperature) == (ROWS // 2, TEMPERATURE, 1.0)
    assert results["one_batch"].batches == 1 and 0 < results["one_batch"].positions < result.positions


LAYOUTS = {"tp2_sp": dict(tensor_model_parallel_size=2, sequence_parallel=True), "dp2": {},
           "pp2": dict(pipeline_model_parallel_size=2), "cp2": dict(context_parallel_size=2)}


def _parallel_probes(rank: int, world_size: int, tmp: str, hf_checkpoint: str) -> dict:
    dataset, results = SequencesDataset(False, alignment=4, rows=ROWS), {}
    for layout, parallel in LAYOUTS.items():
        callback = ProbeAfterValidation(_probes(dataset))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            metrics = _validate(Path(tmp) / f"rank{rank}" / layout, hf_checkpoint, dataset, callback, **parallel)
        results[layout] = (metrics, {name: result.as_json() for name, result in callback.results.items()})
        results[layout, "no_update"] = [str(w.message) for w in caught if "before the ``update``" in str(w.message)]
    return results


@pytest.mark.slow
def test_the_probe_under_tp_dp_pp_and_cp_is_validation_and_the_one_process_figures(process_group, checkpoints,
                                                                                   tmp_path):
    """Two gloo processes: TP=2 with sequence parallelism (vocabulary-parallel argmax and softmax sums), DP=2 (the
    rows split over the ranks, the counts pooled), PP=2 (counted on the last stage, sent to the first) and CP=2
    (each rank counts its chunks, the roll crossing them): on every rank the probe's depth 1 is validation's, and
    every depth equals the one-process probe."""
    dataset = SequencesDataset(False, alignment=4, rows=ROWS)
    callback = ProbeAfterValidation(_probes(dataset))
    _validate(tmp_path / "one", str(checkpoints["qwen3_mtp"]), dataset, callback)
    ranks = run_distributed(_parallel_probes, tmp_path, str(tmp_path), str(checkpoints["qwen3_mtp"]))
    for layout in LAYOUTS:
        for metrics, records in (rank[layout] for rank in ranks):
            for name, record in records.items():
                ours, reference = DraftAcceptance.from_json(record), callback.results[name]
                assert ours.greedy == pytest.approx(reference.greedy, rel=0, abs=1e-12), (layout, name)
                assert ours.sampled == pytest.approx(reference.sampled, rel=0, abs=1e-5), (layout, name)
                assert (ours.positions, ours.batches) == (reference.positions, reference.batches), (layout, name)
            _assert_depth_one_is_validation(DraftAcceptance.from_json(records["validation"]), metrics)
        first, second = ({name: record | {"seconds": None} for name, record in rank[layout][1].items()}
                         for rank in ranks)
        assert first == second, layout  # every rank returns the same figures
        # a pipeline stage without the MTP head (rank 0 at PP=2) still updates the pooled metrics, so torchmetrics
        # does not warn there that compute came before any update
        assert all(rank[layout, "no_update"] == [] for rank in ranks), layout


class DrawingRows(RandomTokenDataset):
    """Rows that draw from every global RNG when read: a probe that read them and did not restore the states would
    move them."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        torch.rand(1), random.random(), np.random.rand()
        return super().__getitem__(index)


def _rng_states() -> tuple:
    from megatron.core import tensor_parallel

    tracker = {name: state.clone() for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items()}
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy(), tracker


class ProbeEveryStep(pl.Callback):
    """After every training step: the probe, with the modes and RNG states before and after it."""

    def __init__(self, probe: DraftProbe) -> None:
        self.probe, self.results, self.unchanged = probe, [], []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        modes, states = [m.training for m in pl_module.modules()], _rng_states()
        self.results.append(self.probe.measure(trainer, pl_module))
        after = _rng_states()
        self.unchanged.append({
            "modes": [m.training for m in pl_module.modules()] == modes and pl_module.training,
            "torch": torch.equal(after[0], states[0]), "python": after[1] == states[1],
            "numpy": np.array_equal(after[2], states[2]),
            "megatron": after[3].keys() == states[3].keys() and all(torch.equal(after[3][k], states[3][k])
                                                                    for k in states[3])})


def test_the_probe_leaves_training_as_it_was(process_group, checkpoints, tmp_path):
    """Joint training, the probe after every step on a named data module whose rows draw from every RNG: every mode
    and RNG state is back after each probe, and the logged metrics and final weights are bit-equal to a run without
    the probe."""
    probe = ProbeEveryStep(DraftProbe(batches=2, temperature=TEMPERATURE,
                                      datamodule=Rows(DrawingRows(8, SEQ, VOCAB), batch_size=2)))
    probed, _ = fit(tmp_path / "probed", checkpoints["qwen3_mtp"], 2, mtp_only=False, callbacks=(probe,))
    plain, _ = fit(tmp_path / "plain", checkpoints["qwen3_mtp"], 2, mtp_only=False)
    assert len(probe.results) == 2 and all(result.batches == 2 for result in probe.results)
    assert probe.results[0].sampled != probe.results[1].sampled  # the head trained between the two probes
    assert all(all(checks.values()) for checks in probe.unchanged), probe.unchanged
    assert probed.metrics == plain.metrics
    assert all(torch.equal(probed.after[name], plain.after[name]) for name in plain.after)


@pytest.mark.parametrize(("options", "message"), [
    ({"batches": 0}, r"batches: 0 must be an integer > 0"),
    ({"batches": 2.5}, r"batches: 2.5 must be an integer > 0"),
    ({"temperature": 0.0}, r"temperature: 0.0 must be finite and > 0"),
    ({"temperature": -1.0}, r"temperature: -1.0 must be finite and > 0"),
    ({"temperature": math.inf}, r"temperature: inf must be finite and > 0"),
    ({"temperature": "0.7"}, r"temperature: '0.7' must be finite and > 0"),
    ({"datamodule": DataLoader([])}, r"datamodule: DataLoader is not a LightningDataModule"),
])
def test_bad_options_name_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        DraftProbe(**options)


def test_a_module_without_a_draft_head_and_a_trainer_without_validation_data_are_refused(process_group):
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    with pytest.raises(TypeError, match="MeasuresDraftAcceptance: SFTModule with enable_mtp: true.*got LightningModule"):
        DraftProbe().measure(trainer, pl.LightningModule())
    with pytest.raises(ValueError, match=r"SFTModule\(enable_mtp=True\).*this module has enable_mtp: false"):
        SFTModule().draft_acceptance([], 1.0)
    with pytest.raises(ValueError, match=r"no validation data to probe.*DraftProbe\(datamodule=\.\.\.\)"):
        DraftProbe().measure(trainer, SFTModule(enable_mtp=True))
    with pytest.raises(ValueError, match=r"NoRows.val_dataloader\(\) makes no loader"):
        DraftProbe(datamodule=NoRows()).measure(trainer, SFTModule(enable_mtp=True))


def test_the_record_round_trips_through_json_and_names_its_metrics():
    import json

    result = DraftAcceptance(greedy=(0.5, math.nan), sampled=(0.625, 0.25), temperature=0.7, positions=12,
                             batches=2, seconds=0.125)
    record = json.loads(json.dumps(result.as_json(), allow_nan=False))
    assert record["greedy"] == [0.5, None]
    back = DraftAcceptance.from_json(record)
    assert back.greedy[0] == 0.5 and math.isnan(back.greedy[1]) and back.sampled == result.sampled
    assert (back.temperature, back.positions, back.batches, back.seconds) == (0.7, 12, 2, 0.125)
    assert set(result.as_metrics()) == {"draft_acceptance/greedy_depth1", "draft_acceptance/sampled_depth1",
                                        "draft_acceptance/greedy_depth2", "draft_acceptance/sampled_depth2",
                                        "draft_acceptance/probe_seconds"}
    with pytest.raises(ValueError, match=r"without \['seconds'\]"):
        DraftAcceptance.from_json({key: value for key, value in record.items() if key != "seconds"})


class ProbeNamedRowsAtTheEnd(pl.Callback):
    """When training ends, on the weights of the last sync: a probe of `rows` named as its data module."""

    def __init__(self, rows: Rows) -> None:
        self.rows = rows

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.result = DraftProbe(batches=1, temperature=TEMPERATURE, datamodule=self.rows).measure(trainer, pl_module)


def test_a_sync_before_the_first_validation_probes_the_loaders_given_to_fit_and_none_is_refused_at_fit_start(
        process_group, checkpoints, tmp_path):
    """Lightning sets the validation loaders up when training starts only if the first epoch validates: a sync before
    any validation (here in the first epoch of validation every second epoch, no sanity check) probes the loaders
    `fit` was given, the same rows as when named; a run with nothing to probe is refused when fit starts, before any
    step."""
    from lightning_megatron.callbacks import WeightSync
    from lightning_megatron.serving import served_version

    sync = WeightSync("disk", every_n_steps=1, root=str(tmp_path / "versions"),
                      probe=DraftProbe(batches=1, temperature=TEMPERATURE))
    named = ProbeNamedRowsAtTheEnd(Rows(RandomTokenDataset(SAMPLES, SEQ, VOCAB), batch_size=2))
    fit(tmp_path / "given", checkpoints["qwen3_mtp"], 1, validate_every=8, callbacks=(sync, named),
        trainer_kwargs={"check_val_every_n_epoch": 2})
    recorded = DraftAcceptance.from_json(served_version(tmp_path / "versions")["draft_acceptance"])
    assert (recorded.batches, recorded.positions) == (1, named.result.positions) and recorded.positions > 0
    assert (recorded.greedy, recorded.sampled) == (named.result.greedy, named.result.sampled)

    unprobed = WeightSync("disk", every_n_steps=1, root=str(tmp_path / "unprobed"), probe=DraftProbe(batches=1))
    steps = pl.callbacks.LambdaCallback(on_train_batch_start=lambda *args: pytest.fail("a step ran"))
    with pytest.raises(ValueError, match=r"no validation data to probe.*DraftProbe\(datamodule=\.\.\.\)"):
        fit(tmp_path / "none", checkpoints["qwen3_mtp"], 1, callbacks=(unprobed, steps))
