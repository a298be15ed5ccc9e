"""SFT data: JSONL reading and validation, tokenization with response masks, padding, packing or tree packing, the
CP split."""

from lightning_megatron.data.datamodule import SFTDataModule
from lightning_megatron.data.jsonl import DataValidationError, Example, read_jsonl
from lightning_megatron.data.packing import PackedSFTDataset, PaddedSFTDataset, PromptDataset, first_fit
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
    "TreePacking",
    "TreeSFTDataset",
    "build_tree_rows",
    "first_fit",
    "read_jsonl",
    "split_for_context_parallel",
    "tokenize_example",
    "tokenize_examples",
]
