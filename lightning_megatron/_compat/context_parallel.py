"""Megatron-Core 0.19's MTP loss under context parallelism normalises by CP-local token counts.

`process_mtp_loss` (`transformer/multi_token_prediction.py:760`) divides each rank's masked MTP cross-entropy by the
loss-mask tokens *that rank* holds (`num_tokens` from `roll_tensor`, `:851`) and, with `calculate_per_token_loss`,
rescales by the rank-local `original_num_tokens = loss_mask.sum()` (`:838`). A microbatch cut over CP ranks then
weighs its MTP tokens differently from the same microbatch on one rank (CP=1), so MTP gradients and the logged MTP
loss depend on the CP size. The replacement below is upstream's function with both counts summed over the CP group:
each rank's logged value is its share of the microbatch's loss (the ranks' values add up to the CP=1 value), and
gradients equal CP=1's. At CP=1 upstream's function runs unchanged.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.distributed as dist

from lightning_megatron._compat._adjustment import Adjustment, Patches


def _has_local_mtp_counts() -> bool:
    from megatron.core.transformer import multi_token_prediction

    return "original_num_tokens = loss_mask.sum()" in inspect.getsource(multi_token_prediction.process_mtp_loss)


def _summed_over(group: Any, count: torch.Tensor) -> torch.Tensor:
    total = count.detach().clone()
    dist.all_reduce(total, group=group)
    return total


def _process_mtp_loss_over_cp(hidden_states: torch.Tensor, labels: torch.Tensor | None,
                              loss_mask: torch.Tensor | None, output_layer: Any, output_weight: torch.Tensor | None,
                              runtime_gather_output: bool | None, is_training: bool, compute_language_model_loss: Any,
                              config: Any, cp_group: Any = None, tp_group: Any = None, packed_seq_params: Any = None,
                              scale_logits_fn: Any = None, input_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Upstream's `process_mtp_loss` (megatron-core 0.19.2) with CP-global token counts."""
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import (
        MTPLossAutoScaler,
        MTPLossLoggingHelper,
        _compute_mtp_acceptance_counts,
        roll_tensor,
    )

    hidden_states_list = torch.chunk(hidden_states, 1 + config.mtp_num_layers, dim=0)
    hidden_states = hidden_states_list[0]
    roll = functools.partial(roll_tensor, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)
    derived_labels = labels is None
    if derived_labels:
        if input_ids is None:
            return hidden_states
        labels, _ = roll(input_ids)
    if config.mtp_detach_heads:
        output_weight = (output_weight if output_weight is not None else output_layer.weight).detach()
    mtp_labels = labels.clone()
    if loss_mask is None:
        loss_mask = torch.ones_like(mtp_labels)
    if derived_labels:
        loss_mask, _ = roll(loss_mask)
    original_num_tokens = _summed_over(cp_group, loss_mask.sum())
    for depth in range(config.mtp_num_layers):
        mtp_logits, _ = output_layer(hidden_states_list[depth + 1], weight=output_weight,
                                     runtime_gather_output=runtime_gather_output)
        if scale_logits_fn is not None:
            mtp_logits = scale_logits_fn(mtp_logits)
        mtp_labels, _ = roll(mtp_labels)
        loss_mask, local_num_tokens = roll(loss_mask)
        num_tokens = _summed_over(cp_group, local_num_tokens)
        mtp_loss = loss_mask * compute_language_model_loss(mtp_labels, mtp_logits)
        if is_training:
            mtp_loss_for_log = torch.sum(mtp_loss) * (num_tokens > 0).to(mtp_loss.dtype) / num_tokens.clamp(min=1)
            correct, total = _compute_mtp_acceptance_counts(mtp_logits, mtp_labels, loss_mask, output_layer,
                                                            runtime_gather_output, tp_group)
            MTPLossLoggingHelper.save_metrics_to_tracker(
                mtp_loss_for_log, correct, total, depth, config.mtp_num_layers,
                avg_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
            )
        mtp_loss_scale = config.mtp_loss_scaling_factor / config.mtp_num_layers
        if config.calculate_per_token_loss:
            scaled = mtp_loss_scale * mtp_loss * (original_num_tokens / num_tokens.clamp(min=1))
        else:
            scaled = mtp_loss_scale * mtp_loss / num_tokens.clamp(min=1)
        hidden_states = MTPLossAutoScaler.apply(hidden_states, scaled)
    return hidden_states


def _install_cp_global_mtp_counts(patches: Patches) -> None:
    from megatron.core.models.gpt import gpt_model

    upstream = gpt_model.process_mtp_loss
    signature = inspect.signature(upstream)

    @functools.wraps(upstream)
    def process_mtp_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
        arguments = signature.bind(*args, **kwargs).arguments
        cp_group = arguments.get("cp_group")
        if cp_group is None or cp_group.size() == 1:
            return upstream(*args, **kwargs)
        return _process_mtp_loss_over_cp(**arguments)

    patches.setattr(gpt_model, "process_mtp_loss", process_mtp_loss)


ADJUSTMENTS = (
    Adjustment(
        "context_parallel.mtp_token_counts",
        "transformer/multi_token_prediction.py:838,851 process_mtp_loss normalises MTP by CP-local token counts",
        _has_local_mtp_counts,
        _install_cp_global_mtp_counts,
    ),
)
