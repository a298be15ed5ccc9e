"""What the run decides for the data, handed to a data module in one typed call instead of read off the trainer.

`MegatronStrategy` hands them to a data module that takes them (`TakesDataSettings`) once the parallel state
exists and before Lightning calls the data module's `setup`; a value the data module was given itself wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from lightning_megatron.distributed import ParallelSizes


@dataclass(frozen=True)
class DataSettings:
    """`hf_checkpoint`: whose tokenizer makes the rows; `micro_batch_size`: rows per microbatch; `parallel`: the
    parallel sizes (context parallelism cuts every sequence into `2 * parallel.context` chunks); `mtp_head`: the
    model runs an MTP head (which rolls input ids and labels along the row)."""

    hf_checkpoint: str | None
    micro_batch_size: int
    parallel: ParallelSizes
    mtp_head: bool


@runtime_checkable
class TakesDataSettings(Protocol):
    """A data module that follows the run's `DataSettings` (`SFTDataModule`)."""

    def take_data_settings(self, settings: DataSettings) -> None: ...


def hand_data_settings(datamodule: object, settings: DataSettings) -> None:
    """Give `settings` to a data module that takes them; any other data module (or none) goes on as it is."""
    if isinstance(datamodule, TakesDataSettings):
        datamodule.take_data_settings(settings)
