"""SFT data: JSONL, Parquet and saved HF datasets reading and validation, tokenization with response masks into a
memory-mapped cache shared by ranks and runs, padding, packing or tree packing, the CP split."""

from lightning_megatron.data.datamodule import SFTDataModule
from lightning_megatron.data.jsonl import DataValidationError, read_jsonl
from lightning_megatron.data.packing import first_fit
from lightning_megatron.data.tokenize import TokenizedExample, tokenize_example, tokenize_examples
from lightning_megatron.microbatch import split_for_context_parallel

__all__ = [
    "DataValidationError",
    "SFTDataModule",
    "TokenizedExample",
    "first_fit",
    "read_jsonl",
    "split_for_context_parallel",
    "tokenize_example",
    "tokenize_examples",
]
