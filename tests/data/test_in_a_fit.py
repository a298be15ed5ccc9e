"""SFTDataModule under a real fit: the training rows shuffled with the data module's own seed, and training data too
small for one global batch refused instead of a fit that ends without a step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_megatron.data import SFTDataModule
from lightning_megatron.module import SFTModule
from lightning_megatron.strategy import MegatronStrategy
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fit_data") / "qwen3")


class FirstBatch(pl.Callback):
    def __init__(self) -> None:
        self.input_ids: torch.Tensor | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.input_ids is None:
            self.input_ids = batch[0]["input_ids"].clone()  # the first microbatch of the first global batch


def _fit(tmp_path: Path, checkpoint: Path, datamodule: SFTDataModule, global_batch_size: int) -> FirstBatch:
    first = FirstBatch()
    strategy = MegatronStrategy(hf_checkpoint=str(checkpoint), micro_batch_size=2,
                                global_batch_size=global_batch_size, precision="fp32")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path, callbacks=[first])
    trainer.fit(SFTModule(lr=1e-3), datamodule)
    return first


def _train_file(tmp_path: Path, rows: int) -> str:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Question {i}?", "response": f"Answer {i}."}) + "\n"
                            for i in range(rows)))
    return str(path)


def test_the_training_rows_are_shuffled_with_the_data_seed_not_the_runs_seed(process_group, tmp_path: Path,
                                                                             checkpoint: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")  # what seed_everything(7) sets, and Lightning's own sampler reads
    datamodule = SFTDataModule(_train_file(tmp_path, 16), seq_length=32, seed=1, cache_dir=str(tmp_path / "cache"))
    first = _fit(tmp_path, checkpoint, datamodule, global_batch_size=2)

    rows = datamodule.datasets["train"]
    order = list(DistributedSampler(rows, num_replicas=1, rank=0, shuffle=True, seed=1))
    expected = torch.stack([rows[index]["input_ids"] for index in order[:2]])
    assert torch.equal(first.input_ids, expected)
    assert order[:2] != list(DistributedSampler(rows, num_replicas=1, rank=0, shuffle=True, seed=7))[:2]


def test_training_data_smaller_than_one_global_batch_is_refused(process_group, tmp_path: Path,
                                                                checkpoint: Path) -> None:
    datamodule = SFTDataModule(_train_file(tmp_path, 7), seq_length=32, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"gives each data-parallel rank \(1 in all\) 3 full microbatches of "
                                         r"micro_batch_size=2 rows, fewer than the 4 that one global batch "
                                         r"\(global_batch_size=8\) needs, so fit would train nothing"):
        _fit(tmp_path, checkpoint, datamodule, global_batch_size=8)
