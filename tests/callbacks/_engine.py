"""What the weight-sync tests share: the tiny checkpoints' shapes, a fit with `WeightSync` callbacks, and the checks
that compare an engine's tensors with what `save_hf` writes of the same weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import transformers
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from lightning_megatron.callbacks import WeightSync
from lightning_megatron.module import SFTModule
from lightning_megatron.serving.protocol import dtype_from_name, post_json
from lightning_megatron.strategy import MegatronStrategy
from lightning_megatron.testing.datasets import RandomTokenDataset

SEQ, SAMPLES = 16, 32
MIB = 1024**2
WIDE_VOCAB = 5000  # 5000 x 64 fp32 = 1.22 MiB: the embedding and the LM head are larger than a 1 MiB bucket


def receiver_tensors(url: str, names: list[str]) -> dict[str, torch.Tensor]:
    tensors = {}
    for name in names:
        reply = post_json(f"{url}/get_weights_by_name", {"name": name}, 60)
        values = torch.tensor(reply["values"], dtype=torch.float64)  # exact for every fp32 / bf16 value
        tensors[name] = values.to(dtype_from_name(reply["dtype"])).reshape(reply["shape"])
    return tensors


def unequal_to_export(url: str, export: Path) -> list[str]:
    """Names whose bits differ between the engine and `save_hf`'s export (dtype and shape included)."""
    expected = {name: tensor for file in sorted(export.glob("*.safetensors")) for name, tensor in load_file(file).items()}
    served = receiver_tensors(url, sorted(expected))
    return [name for name, tensor in expected.items()
            if served[name].dtype != tensor.dtype or not torch.equal(served[name], tensor)]


def greedy_matches_export(url: str, export: Path) -> bool:
    prompt = [5, 17, 42, 99, 3]
    served = post_json(f"{url}/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8}}, 60)
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype="auto").eval()
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return served["output_ids"] == output[0, len(prompt):].tolist()


class CompareAfterSync(pl.Callback):
    """After every sync (it runs after the WeightSync callbacks): the engine against `save_hf` of the same weights."""

    def __init__(self, syncs: list[WeightSync], url: str, workdir: Path) -> None:
        self.syncs, self.url, self.workdir = syncs, url, workdir
        self.results: list[dict[str, Any]] = []
        self._checked: int | None = None
        self._export = workdir

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._compare(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._compare(trainer)
        if trainer.is_global_zero:
            self.results[-1]["greedy_equal"] = greedy_matches_export(self.url, self._export)

    def _compare(self, trainer: pl.Trainer) -> None:
        version = self.syncs[0].version
        if version is None or version == self._checked:
            return
        self._checked = version
        self._export = trainer.strategy.export_hf(self.workdir / f"export-{version}")
        if trainer.is_global_zero:
            info = post_json(f"{self.url}/model_info", {}, 60)
            self.results.append({"version": version, "engine_version": info["weight_version"],
                                 "unequal": unequal_to_export(self.url, self._export), "greedy_equal": None})


def fit_with_syncs(workdir: Path, hf_checkpoint: Path, syncs: list[WeightSync], url: str | None, *, steps: int = 3,
                   devices: int = 1, extra_callbacks: tuple = (), ckpt_path: str | None = None,
                   module_kwargs: dict[str, Any] | None = None, logger: Any = False,
                   **strategy_kwargs: Any) -> dict[str, Any]:
    options = dict(micro_batch_size=2, global_batch_size=4, precision="fp32") | strategy_kwargs
    mtp = options.get("bridge_type") == "megatron-bridge"
    compare = CompareAfterSync(syncs, url, workdir) if url is not None else pl.Callback()
    trainer = pl.Trainer(strategy=MegatronStrategy(hf_checkpoint=str(hf_checkpoint), **options), accelerator="cpu",
                         devices=devices, max_steps=steps, logger=logger, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=workdir,
                         enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in extra_callbacks),
                         callbacks=[*syncs, compare, *extra_callbacks])
    results = compare.results if isinstance(compare, CompareAfterSync) else []
    vocab = transformers.AutoConfig.from_pretrained(hf_checkpoint).vocab_size
    loader = DataLoader(RandomTokenDataset(SAMPLES, SEQ, vocab), batch_size=options["micro_batch_size"], drop_last=True)
    trainer.fit(SFTModule(**{"enable_mtp": mtp, "lr": 1e-2, **(module_kwargs or {})}), loader, ckpt_path=ckpt_path)
    return {"compared": results, "reports": [sync.reports for sync in syncs],
            "versions": [sync.version for sync in syncs], "trainer": trainer}


def assert_every_sync_matched(compared: list[dict[str, Any]], versions: list[int]) -> None:
    assert [result["version"] for result in compared] == versions
    for result in compared:
        assert result["unequal"] == [], result
        assert result["engine_version"] == str(result["version"])
    assert compared[-1]["greedy_equal"] is True
