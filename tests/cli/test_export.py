"""`lightning-megatron export`: a mid-run training checkpoint to HF files bit-identical to what `fit` itself exports
at that step, at TP=2 (2 gloo processes) and at 1 process, for an MTP model and for a LoRA run (merged and as an
adapter); an output folder that is not empty is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import yaml

from lightning_megatron.cli.megatron_cli import main
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from tests._distributed import run_distributed

ROOT = Path(__file__).resolve().parents[2]
EXPORT_STEP = 2
LORA = {"target_modules": ["linear_qkv", "linear_fc2"], "rank": 4, "alpha": 8}
# (run, what fit exports at EXPORT_STEP and the matching `export --lora`): the MTP run is a full fine-tune
RUNS = {"mtp": [("hf", None)], "lora": [("hf", "merged"), ("adapter", "adapter")]}


class ExportAtStep(pl.Callback):
    """What `fit` exports at `step` (HFExport's `strategy.export_hf`, or the LoRA adapter), mid-run."""

    def __init__(self, dirpath: str, step: int, adapter: bool = False) -> None:
        self.dirpath, self.step, self.adapter = dirpath, step, adapter

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            from lightning_megatron.lora import export_lora_adapter

            trainer.strategy.export_hf(Path(self.dirpath) / "hf")
            if self.adapter:
                export_lora_adapter(trainer.strategy, Path(self.dirpath) / "adapter")


def _config(tmp: Path, hf_checkpoint: Path, run: str) -> Path:
    callbacks: list[dict] = [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(tmp / run / "ckpts"), "every_n_train_steps": EXPORT_STEP, "save_top_k": -1}},
        {"class_path": "tests.cli.test_export.ExportAtStep",
         "init_args": {"dirpath": str(tmp / run / "fit_export"), "step": EXPORT_STEP, "adapter": run == "lora"}},
    ]
    if run == "lora":
        callbacks.insert(0, {"class_path": "lightning_megatron.callbacks.LoRACallback", "init_args": LORA})
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 2, "max_steps": EXPORT_STEP + 1, "logger": False,
                    "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0,
                    "limit_val_batches": 0, "default_root_dir": str(tmp / run), "callbacks": callbacks,
                    "strategy": {"class_path": "lightning_megatron.MegatronStrategy",
                                 "init_args": {"hf_checkpoint": str(hf_checkpoint), "bridge_type": "megatron-bridge",
                                               "tensor_model_parallel_size": 2, "micro_batch_size": 2,
                                               "global_batch_size": 2, "precision": "fp32"}}},
        "model": {"enable_mtp": True, "lr": 1.0e-2, "warmup_steps": 1},
        "data": {"train_path": str(ROOT / "configs/data/tiny_sft.jsonl"), "seq_length": 64},
    }
    path = tmp / f"{run}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _export(config: Path, ckpt: Path, output: Path, lora: str | None, *extra: str) -> None:
    main(["export", "--config", str(config), "--ckpt_path", str(ckpt), "--output", str(output),
          *(["--lora", lora] if lora else []), *extra])


def _fit_and_export_at_tp2(rank: int, world_size: int, tmp: str, hf_checkpoint: str) -> None:
    for run, exports in RUNS.items():
        config = _config(Path(tmp), Path(hf_checkpoint), run)
        main(["fit", "--config", str(config)])
        ckpt = Path(tmp) / run / "ckpts" / f"epoch=0-step={EXPORT_STEP}.ckpt"
        for name, lora in exports:
            _export(config, ckpt, Path(tmp) / run / f"tp2_{name}", lora)


def _files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())
            if path.suffix in (".safetensors", ".json")}


@pytest.mark.slow
def test_export_equals_fits_own_export_at_tp2_and_at_one_process(process_group, tmp_path: Path) -> None:
    hf_checkpoint = make_tiny_checkpoint(tmp_path / "qwen3_mtp", "qwen3", mtp=True)
    run_distributed(_fit_and_export_at_tp2, tmp_path, str(tmp_path), str(hf_checkpoint))
    one_process = ("--trainer.devices", "1", "--trainer.strategy.init_args.tensor_model_parallel_size", "1")
    for run, exports in RUNS.items():
        config, ckpt = tmp_path / f"{run}.yaml", tmp_path / run / "ckpts" / f"epoch=0-step={EXPORT_STEP}.ckpt"
        for name, lora in exports:
            _export(config, ckpt, tmp_path / run / f"one_{name}", lora, *one_process)
            fits_own = _files(tmp_path / run / "fit_export" / name)
            assert any(file.endswith(".safetensors") for file in fits_own)
            assert _files(tmp_path / run / f"tp2_{name}") == fits_own, (run, name, "TP=2")
            assert _files(tmp_path / run / f"one_{name}") == fits_own, (run, name, "1 process")
    # the MTP head is in the export, and it trained
    import safetensors.torch

    exported = safetensors.torch.load_file(tmp_path / "mtp" / "one_hf" / "model.safetensors")
    original = safetensors.torch.load_file(hf_checkpoint / "model.safetensors")
    mtp_names = [name for name in exported if "mtp" in name]
    assert mtp_names and any(not (exported[name] == original[name]).all() for name in mtp_names)
    merged = safetensors.torch.load_file(tmp_path / "lora" / "one_hf" / "model.safetensors")
    assert any(not (merged[name] == original[name]).all() for name in merged)  # the trained adapters, folded in
    with pytest.raises(FileExistsError, match="output: .* is not an empty folder.*--output"):
        _export(tmp_path / "mtp.yaml", tmp_path / "mtp" / "ckpts" / f"epoch=0-step={EXPORT_STEP}.ckpt",
                tmp_path / "mtp" / "one_hf", None, *one_process)
