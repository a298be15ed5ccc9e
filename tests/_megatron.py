"""Tiny Megatron-Core GPT models built directly (no bridge), for tests of the CPU layer and the parallel plumbing."""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
from megatron.core.transformer import TransformerConfig

VOCAB = 128
SEQ = 32


def tiny_gpt(mtp_layers: int = 1, **config_overrides) -> GPTModel:
    """A 2-layer GPT (hidden 64) with `mtp_layers` MTP layers, for the current parallel state."""
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        mtp_num_layers=mtp_layers or None, mtp_loss_scaling_factor=0.1,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        **config_overrides,
    )
    layer_spec = get_gpt_layer_local_spec()
    last_stage = parallel_state.is_pipeline_last_stage()
    mtp_spec = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False) if mtp_layers and last_stage else None
    return GPTModel(config, layer_spec, vocab_size=VOCAB, max_sequence_length=SEQ, mtp_block_spec=mtp_spec,
                    pre_process=parallel_state.is_pipeline_first_stage(), post_process=last_stage)


def token_batch(seed: int = 0, batch: int = 2, seq: int = SEQ) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, seq + 1), generator=generator)
    loss_mask = torch.ones(batch, seq)
    loss_mask[:, : seq // 4] = 0  # a prompt the loss ignores
    return {
        "input_ids": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "position_ids": torch.arange(seq).expand(batch, seq),
        "loss_mask": loss_mask,
    }
