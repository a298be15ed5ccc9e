"""SFT data: JSONL, Parquet and saved HF datasets reading and validation, tokenization with response masks into a
memory-mapped cache shared by ranks and runs, padding, packing or tree packing, the CP split."""

from lightning_megatron.data.cache import TokenizedRows, open_or_build
from lightning_megatron.data.datamodule import SFTDataModule
from lightning_megatron.data.jsonl import DataValidationError, Example, read_jsonl
from lightning_megatron.data.packing import PackedSFTDataset, PaddedSFTDataset, PromptDataset, first_fit
from lightning_megatron.data.sources import read_examples
from lightning_megatron.data.tokenize import TokenizedExample, tokenize_example, tokenize_examples
from lightning_megatron.data.tree import TreePacking, TreeSFTDataset, build_tree_rows
from lightning_megatron.microbatch import split_for_context_parallel

__all__ = [
    "DataValidationError",
    "Example",
    "PackedSFTDataset",
    "PaddedSFTDataset",
    "PromptDataset",
    "SFTDataModule",
    "TokenizedExample",
    "TokenizedRows",
    "TreePacking",
    "TreeSFTDataset",
    "build_tree_rows",
    "first_fit",
    "open_or_build",
    "read_examples",
    "read_jsonl",
    "split_for_context_parallel",
    "tokenize_example",
    "tokenize_examples",
]
