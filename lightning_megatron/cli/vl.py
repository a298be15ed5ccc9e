"""`lightning-megatron-vl`: the `lightning-megatron` CLI with `VLSFTModule` and `VLSFTDataModule` (image + text SFT
of a Qwen2.5-VL or Qwen3-VL checkpoint). Same strategy, trainer and checks; `--make_tiny_checkpoint true` writes a
tiny VL checkpoint of `--tiny_vl_family` (made locally, no download) where the strategy's `hf_checkpoint` points.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser

from lightning_megatron import _compat
from lightning_megatron.cli.megatron_cli import MegatronCLI, ensure_tiny_checkpoint
from lightning_megatron.cli.user_errors import input_errors_reported
from lightning_megatron.testing.vl import VLFamily, make_tiny_vl_checkpoint
from lightning_megatron.vl.data import VLSFTDataModule
from lightning_megatron.vl.module import VLSFTModule


class VLMegatronCLI(MegatronCLI):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("model_class", VLSFTModule)
        kwargs.setdefault("datamodule_class", VLSFTDataModule)
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        super().add_arguments_to_parser(parser)
        parser.add_argument("--tiny_vl_family", type=VLFamily, default="qwen3_vl",
                            help="The family --make_tiny_checkpoint writes: qwen2_5_vl or qwen3_vl.")

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        hf_checkpoint = config.trainer.strategy.init_args.get("hf_checkpoint") if hasattr(
            config.trainer.strategy, "init_args") else None
        if config.make_tiny_checkpoint and hf_checkpoint:
            family = config.tiny_vl_family
            ensure_tiny_checkpoint(Path(hf_checkpoint), make=lambda path: make_tiny_vl_checkpoint(path, family))
        super().before_instantiate_classes()


def main(args: list[str] | None = None) -> None:
    """The `lightning-megatron-vl` console script (`args` defaults to the command line; see `megatron_cli.main`)."""
    _compat.quiet_handled_warnings()
    with input_errors_reported(on_the_command_line=args is None):
        VLMegatronCLI(args=args)


if __name__ == "__main__":
    main()
