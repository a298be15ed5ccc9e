"""SFT data: JSONL reading and validation, tokenization with response masks, padding or packing, the CP split."""

from lightning_megatron.data.context_parallel import split_for_context_parallel
from lightning_megatron.data.datamodule import SFTDataModule
from lightning_megatron.data.jsonl import DataValidationError, Example, read_jsonl
from lightning_megatron.data.packing import PackedSFTDataset, PaddedSFTDataset, PromptDataset, first_fit
from lightning_megatron.data.tokenize import TokenizedExample, tokenize_example, tokenize_examples

__all__ = [
    "DataValidationError",
    "Example",
    "PackedSFTDataset",
    "PaddedSFTDataset",
    "PromptDataset",
    "SFTDataModule",
    "TokenizedExample",
    "first_fit",
    "read_jsonl",
    "split_for_context_parallel",
    "tokenize_example",
    "tokenize_examples",
]
