"""`lightning-megatron`: LightningCLI over `SFTModule`, `SFTDataModule` and `MegatronStrategy`.

    lightning-megatron fit --config configs/tiny/mtp_only.yaml
    lightning-megatron predict --config configs/tiny/generate.yaml --data.predict_path prompts.jsonl
    lightning-megatron fit --config configs/tiny/mtp_only.yaml --print_config
    lightning-megatron export --config configs/tiny/mtp_only.yaml --ckpt_path CKPT --output DIR

The optimizer is Megatron's (distributed, with fp32 main weights) and is configured on the model (`model.lr`,
`model.weight_decay`, `model.adam_beta1`, ...); LightningCLI's `optimizer:` and `lr_scheduler:` groups are refused
with a message that says so. `make_tiny_checkpoint: true` writes the project's tiny Qwen3+MTP checkpoint to
`trainer.strategy.init_args.hf_checkpoint` when nothing is there yet, so the CPU configs need no download.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from torch.utils.data import DataLoader

from lightning_megatron import _compat
from lightning_megatron.cli.user_errors import input_errors_reported
from lightning_megatron.contract import megatron_strategy
from lightning_megatron.data import SFTDataModule
from lightning_megatron.module import SFTModule

DEFAULT_STRATEGY = "lightning_megatron.strategy.MegatronStrategy"
TINY_CHECKPOINT_WAIT_S = 300


class MegatronTrainer(pl.Trainer):
    """Lightning's Trainer plus `export`, which LightningCLI turns into the `export` subcommand."""

    def export(self, model: pl.LightningModule, ckpt_path: str, output: str,
               lora: Literal["merged", "adapter"] = "merged", datamodule: pl.LightningDataModule | None = None
               ) -> Path:
        """Write an HF checkpoint of a saved training checkpoint's weights through the configured bridge.

        The run's own config builds the model as `fit` did (bridge, MTP head, LoRA adapters from its callbacks);
        the checkpoint loads at any parallel size it loads at (one process on CPU too). The files equal what `fit`'s
        `HFExport` writes at that step.

        Args:
            model: The run's module, built from its config as `fit` built it.
            ckpt_path: The training checkpoint to export (a folder `fit` saved, e.g. `.../checkpoints/last`).
            output: A new or empty folder for the HF checkpoint (export refuses to overwrite anything).
            lora: "merged" (the adapters folded into the weights, as `HFExport` does) or "adapter" (an HF PEFT
                adapter folder).
            datamodule: Not read: no data is needed.
        """
        from lightning_megatron.lora import export_lora_adapter

        target = Path(output)
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            raise FileExistsError(f"output: {target} exists and is not an empty folder; export refuses to overwrite "
                                  "it: give --output a new or empty folder, or remove that one first")
        with warnings.catch_warnings():  # no data on purpose: validate builds the model and loads ckpt_path
            warnings.filterwarnings("ignore", message="Total length of .* across ranks is zero")
            self.validate(model, dataloaders=DataLoader([]), ckpt_path=ckpt_path)
        strategy = megatron_strategy(self, "export")
        path = export_lora_adapter(strategy, target) if lora == "adapter" else strategy.export_hf(target)
        if self.is_global_zero:
            print(f"export: wrote {path} from {ckpt_path}")
        return path


class MegatronCLI(LightningCLI):
    """LightningCLI with the Megatron strategy as the default and the checks a Megatron run needs before it starts;
    `export` writes an HF checkpoint of a training checkpoint."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("trainer_class", MegatronTrainer)
        kwargs.setdefault("model_class", SFTModule)
        kwargs.setdefault("datamodule_class", SFTDataModule)
        kwargs.setdefault("trainer_defaults", {"strategy": {"class_path": DEFAULT_STRATEGY}})
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(*args, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {**LightningCLI.subcommands(), "export": {"model", "datamodule"}}

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--make_tiny_checkpoint", type=bool, default=False,
            help="Write the project's tiny Qwen3+MTP checkpoint (made locally, no download) to "
                 "trainer.strategy.init_args.hf_checkpoint if that folder does not exist yet.",
        )
        parser.add_argument(
            "--tiny_checkpoint_family",
            type=Literal["qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3", "qwen3_5_text", "qwen3_5",
                         "qwen3_5_moe_text", "qwen3_5_moe"],
            default="qwen3",
            help="The family make_tiny_checkpoint writes (with its MTP layer): qwen3, qwen3_moe (4 experts, top 2), "
                 "glm4_moe (GLM-4.5's layout: a dense first layer, then 4 sigmoid-routed experts with an expert "
                 "bias and a shared expert), deepseek_v3 (GLM-4.5's MoE layout with multi-head latent attention "
                 "and YaRN RoPE), qwen3_5_text (Qwen3.5's text model: gated DeltaNet and gated full-attention "
                 "layers), qwen3_5 (that text model in the multimodal form Qwen publishes, with a vision tower), "
                 "qwen3_5_moe_text (Qwen3.5's layers with 4 softmax-routed experts and a gated shared expert) or "
                 "qwen3_5_moe (that text model in the multimodal form Qwen publishes).",
        )

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        for group in ("optimizer", "lr_scheduler"):
            if config.get(group) is not None:
                raise ValueError(
                    f"{group}: not used with MegatronStrategy: the optimizer is Megatron's (it owns the DDP gradient "
                    "buffers and the fp32 main weights) and is configured on the model: model.lr, model.min_lr_ratio, "
                    "model.warmup_steps, model.weight_decay, model.adam_beta1, model.adam_beta2, model.adam_eps. "
                    f"Remove the {group}: section (or --{group}) and set those instead."
                )
        strategy = config.trainer.strategy
        if not (hasattr(strategy, "class_path") and hasattr(strategy, "init_args")):
            raise ValueError(f"trainer.strategy: {strategy!r} is not a MegatronStrategy; give class_path: "
                             f"{DEFAULT_STRATEGY} with its init_args (or leave trainer.strategy out)")
        if config.make_tiny_checkpoint:
            hf_checkpoint = strategy.init_args.get("hf_checkpoint")
            if not hf_checkpoint:
                raise ValueError("make_tiny_checkpoint: true needs trainer.strategy.init_args.hf_checkpoint: the "
                                 "folder to write the tiny checkpoint to")
            from lightning_megatron.testing.checkpoints import make_tiny_checkpoint

            family = config.tiny_checkpoint_family
            ensure_tiny_checkpoint(Path(hf_checkpoint), make=lambda path: make_tiny_checkpoint(path, family, mtp=True))


def ensure_tiny_checkpoint(path: Path, make: Callable[[Path], Path] | None = None) -> Path:
    """The tiny checkpoint at `path` (Qwen3+MTP unless `make` writes another), made here on first use (by local
    rank 0; other ranks wait)."""
    from lightning_megatron.testing.checkpoints import make_tiny_checkpoint

    if (path / "config.json").is_file():
        return path
    if os.environ.get("LOCAL_RANK", "0") == "0":
        return make(path) if make is not None else make_tiny_checkpoint(path, "qwen3", mtp=True)
    deadline = time.monotonic() + TINY_CHECKPOINT_WAIT_S
    while not (path / "config.json").is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(f"local rank 0 did not write the tiny checkpoint {path} in {TINY_CHECKPOINT_WAIT_S} s")
        time.sleep(0.5)
    return path


def main(args: list[str] | None = None) -> None:
    """The `lightning-megatron` console script (`args` defaults to the command line); a mistake in the config ends
    it with one `error: ...` block, as jsonargparse's own refusals do (`cli/user_errors.py`); called with `args`
    from Python, the mistake's exception is raised."""
    _compat.quiet_handled_warnings()
    with input_errors_reported(on_the_command_line=args is None):
        MegatronCLI(args=args)


if __name__ == "__main__":
    main()
