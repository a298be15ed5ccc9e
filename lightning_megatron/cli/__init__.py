"""Every command of the package, in one table: what a user runs, and the function it calls.

Each command module reads top to bottom and is thin: it parses its arguments and calls the library. This module
imports none of them, so `lightning-megatron-restore-mtp --help` loads neither Lightning nor Megatron-Core.
`pyproject.toml`'s `[project.scripts]` lists the same console scripts (a test keeps the two equal).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Command:
    """One entry point: its console-script name (None: run with `python -m`), the `module:function` it calls."""

    script: str | None
    target: str
    what: str


COMMANDS = (
    Command("lightning-megatron", "lightning_megatron.cli.megatron_cli:main",
            "LightningCLI over SFTModule, SFTDataModule and MegatronStrategy: fit, validate, test, predict, export"),
    Command("lightning-megatron-vl", "lightning_megatron.cli.vl:main",
            "the same for vision-language SFT (VLSFTModule, VLSFTDataModule)"),
    Command("lightning-megatron-restore-mtp", "lightning_megatron.cli.restore_mtp:main",
            "put an MTP head back into an HF checkpoint exported without one"),
    Command("lightning-megatron-speculative", "lightning_megatron.cli.speculative:main",
            "speculative decoding with a checkpoint's MTP head: the acceptance report"),
    Command(None, "lightning_megatron.cli.quickstart:main",
            "`make demo`: the whole MTP story on a tiny model in about three minutes"),
    Command(None, "lightning_megatron.cli.check_install:main",
            "an installation check: a tiny checkpoint through each bridge into Megatron-Core and back"),
)


def main(args: list[str] | None = None) -> Any:
    """`python -m lightning_megatron.cli`: the `lightning-megatron` command."""
    module, function = COMMANDS[0].target.split(":")
    return getattr(importlib.import_module(module), function)(args)
