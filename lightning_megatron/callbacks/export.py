"""Export the trained weights as a Hugging Face checkpoint when fit ends, from a config as from Python."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info

from lightning_megatron.contract import megatron_strategy


class HFExport(pl.Callback):
    """At the end of fit, write an HF checkpoint of the current weights through the strategy's bridge
    (`MegatronStrategy.export_hf`: atomic, every tensor of the source checkpoint accounted for).

    Args:
        dirpath: the folder the HF checkpoint is written to.
    """

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        path = megatron_strategy(trainer, "HFExport").export_hf(self.dirpath)
        rank_zero_info(f"HFExport: wrote the HF checkpoint {path}")
