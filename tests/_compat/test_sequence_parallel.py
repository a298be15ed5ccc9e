"""Sequence parallelism with PyTorch's norms (no Apex / Transformer Engine): Megatron-Core refuses to build the norm
without the adjustment; with it the norm is PyTorch's, its parameters are marked for the tensor-parallel gradient sum
that Apex's and TE's norms get, and the model without sequence parallelism is unchanged. (That TP=2 + SP trains with
the same gradients as TP=2 is checked in tests/test_tree_rotary.py.)"""

import copy

import pytest
import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from lightning_megatron._compat import no_te

ADJUSTMENT = {adjustment.name: adjustment for adjustment in no_te.MEGATRON_CORE_ADJUSTMENTS}[
    "megatron_core.sequence_parallel_torch_norm"]


def _config(sequence_parallel: bool) -> TransformerConfig:
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm")
    config = copy.copy(config)
    config.sequence_parallel = sequence_parallel  # TransformerConfig refuses it at TP=1, where the norm only reads it
    return config


def test_torch_norm_builds_under_sequence_parallelism_only_with_the_adjustment(model_parallel):
    ADJUSTMENT.apply()
    with ADJUSTMENT.suspended():
        with pytest.raises(AssertionError, match="sequence parallel not supported by torch LayerNorm"):
            WrappedTorchNorm(_config(True), 8)
    norm = WrappedTorchNorm(_config(True), 8)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel is True
    plain = WrappedTorchNorm(_config(False), 8)
    assert isinstance(plain, torch.nn.RMSNorm) and not hasattr(plain.weight, "sequence_parallel")
