"""Megatron-Core's vocabulary-parallel cross-entropy, computed in token chunks so no `[tokens, vocab]` fp32 tensor
lives longer than one chunk.

Megatron-Core's cross-entropy (fused or not) upcasts the whole logits tensor to fp32 and keeps the fp32 softmax
for the backward pass: at 4096 tokens and a 151936-token vocabulary that is 2.3 GiB held from the loss to its
backward, plus as much again while it is computed. `chunked_vocab_parallel_cross_entropy` runs the same steps
(`VocabParallelCrossEntropy`'s max, predicted logit and sum of exponentials, all-reduced over the tensor-parallel
group) on `chunk_tokens` rows at a time and keeps only the logits it was given (bf16 in training) and two fp32
numbers per token; the backward recomputes each chunk's softmax from them with the same operations, so the loss
and its gradient are Megatron-Core's. With `fused` (the model's `cross_entropy_loss_fusion`) the steps are
Megatron-Core's jit-fused ones (`fusions/fused_cross_entropy.py`, whose gradient is bf16), otherwise its plain ones.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

DEFAULT_CHUNK_TOKENS = 1024


def _vocab_range(partition_vocab_size: int, tp_group: Any) -> tuple[int, int]:
    from megatron.core.tensor_parallel.utils import VocabUtility

    return VocabUtility.vocab_range_from_per_partition_vocab_size(partition_vocab_size, tp_group.rank(),
                                                                  tp_group.size())


def _softmax_chunk(logits: torch.Tensor, logits_max: torch.Tensor, sum_exp_logits: torch.Tensor) -> torch.Tensor:
    """fp32 softmax of one chunk: `exp(logits - max) / sum`, the operations Megatron-Core's forward runs."""
    softmax = logits.to(torch.float32, copy=True)
    softmax -= logits_max.unsqueeze(-1)
    torch.exp(softmax, out=softmax)
    return softmax.div_(sum_exp_logits.unsqueeze(-1))


def _fp32_copy(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(torch.float32, copy=True)


def _upcast_by_megatron(logits: torch.Tensor) -> torch.Tensor:
    """What to hand `calculate_logits_max`, which upcasts with `.float()` and is then overwritten in place: bf16
    logits as they are (the upcast is a copy, fused with the max), fp32 ones copied (the upcast would be them)."""
    return logits.clone() if logits.dtype == torch.float32 else logits


class _ChunkedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, tp_group: Any, chunk_tokens: int,
                fused: bool) -> torch.Tensor:
        partition_vocab_size = logits.size(-1)
        logits_2d, target_1d = logits.reshape(-1, partition_vocab_size), target.reshape(-1)
        vocab_start, vocab_end = _vocab_range(partition_vocab_size, tp_group)
        rows = target_1d.numel()
        loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
        logits_max = torch.empty_like(loss)
        sum_exp_logits = torch.empty_like(loss)
        for start in range(0, rows, chunk_tokens):
            end = min(rows, start + chunk_tokens)
            chunk_loss, chunk_max, chunk_sum = (_fused_chunk_loss if fused else _chunk_loss)(
                logits_2d[start:end], target_1d[start:end], tp_group, vocab_start, vocab_end)
            loss[start:end], logits_max[start:end], sum_exp_logits[start:end] = chunk_loss, chunk_max, chunk_sum
        ctx.save_for_backward(logits, target, logits_max, sum_exp_logits)
        ctx.vocab_range, ctx.chunk_tokens, ctx.fused = (vocab_start, vocab_end), chunk_tokens, fused
        return loss.view_as(target)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        logits, target, logits_max, sum_exp_logits = ctx.saved_tensors
        partition_vocab_size = logits.size(-1)
        logits_2d, target_1d = logits.reshape(-1, partition_vocab_size), target.reshape(-1)
        grad_1d = grad_output.reshape(-1)
        grad_input = torch.empty_like(logits_2d)
        for start in range(0, target_1d.numel(), ctx.chunk_tokens):
            end = min(target_1d.numel(), start + ctx.chunk_tokens)
            grad_input[start:end] = (_fused_chunk_gradient if ctx.fused else _chunk_gradient)(
                logits_2d[start:end], target_1d[start:end], logits_max[start:end], sum_exp_logits[start:end],
                grad_1d[start:end], *ctx.vocab_range)
        return grad_input.view_as(logits), None, None, None, None


def _chunk_loss(logits: torch.Tensor, target: torch.Tensor, tp_group: Any, vocab_start: int,
                vocab_end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, max, sum of exponentials) of one chunk: `_VocabParallelCrossEntropy.forward`'s steps."""
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

    chunk = _fp32_copy(logits)
    chunk_max = chunk.max(dim=-1)[0]
    dist.all_reduce(chunk_max, op=dist.ReduceOp.MAX, group=tp_group)
    _, _, predicted, sum_exp, _ = VocabParallelCrossEntropy.calculate_predicted_logits(
        chunk, target, chunk_max, vocab_start, vocab_end)
    dist.all_reduce(predicted, op=dist.ReduceOp.SUM, group=tp_group)
    dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=tp_group)
    return torch.log(sum_exp) - predicted, chunk_max, sum_exp


def _chunk_gradient(logits: torch.Tensor, target: torch.Tensor, logits_max: torch.Tensor,
                    sum_exp_logits: torch.Tensor, grad_output: torch.Tensor, vocab_start: int,
                    vocab_end: int) -> torch.Tensor:
    """`_VocabParallelCrossEntropy.backward` of one chunk, its softmax recomputed."""
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

    softmax = _softmax_chunk(logits, logits_max, sum_exp_logits)
    target_mask = (target < vocab_start) | (target >= vocab_end)
    masked_target = torch.where(target_mask, 0, target - vocab_start)
    grad_2d, arange_1d, softmax_update, grad_input = (
        VocabParallelCrossEntropy.prepare_gradient_calculation_operands(softmax, target_mask))
    return VocabParallelCrossEntropy.calculate_gradients(grad_2d, arange_1d, masked_target, softmax_update,
                                                         grad_input, grad_output)


def _fused_chunk_loss(logits: torch.Tensor, target: torch.Tensor, tp_group: Any, vocab_start: int,
                      vocab_end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, max, sum of exponentials) of one chunk: the fused `_VocabParallelCrossEntropy.forward`'s steps."""
    from megatron.core.fusions import fused_cross_entropy as fused

    chunk, chunk_max = fused.calculate_logits_max(_upcast_by_megatron(logits))
    dist.all_reduce(chunk_max, op=dist.ReduceOp.MAX, group=tp_group)
    _, _, predicted_and_sum, exp_logits = fused.calculate_predicted_logits(chunk, target, chunk_max, vocab_start,
                                                                            vocab_end)
    dist.all_reduce(predicted_and_sum, op=dist.ReduceOp.SUM, group=tp_group)
    _, loss = fused.calculate_cross_entropy_loss(exp_logits, predicted_and_sum)
    return loss, chunk_max, predicted_and_sum[target.numel():]


def _fused_chunk_gradient(logits: torch.Tensor, target: torch.Tensor, logits_max: torch.Tensor,
                          sum_exp_logits: torch.Tensor, grad_output: torch.Tensor, vocab_start: int,
                          vocab_end: int) -> torch.Tensor:
    """The fused `_VocabParallelCrossEntropy.backward` of one chunk, its softmax recomputed by the same fused
    steps from the all-reduced max and sum the forward kept."""
    from megatron.core.fusions import fused_cross_entropy as fused

    chunk, _ = fused.calculate_logits_max(_upcast_by_megatron(logits))
    target_mask, masked_target_1d, _, exp_logits = fused.calculate_predicted_logits(
        chunk, target, logits_max, vocab_start, vocab_end)
    softmax, _ = fused.calculate_cross_entropy_loss(exp_logits, torch.cat((torch.zeros_like(sum_exp_logits),
                                                                           sum_exp_logits)))
    return fused.calculate_gradients(softmax, grad_output, target_mask, masked_target_1d)


def chunked_vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group: Any,
                                         chunk_tokens: int = DEFAULT_CHUNK_TOKENS, fused: bool = False
                                         ) -> torch.Tensor:
    """Per-token cross-entropy of `[..., vocab / TP]` logits against `[...]` targets, `chunk_tokens` at a time;
    `fused`: Megatron-Core's jit-fused steps (bf16 logit gradients), else its plain ones."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: {chunk_tokens} must be at least 1")
    return _ChunkedVocabParallelCrossEntropy.apply(logits, target, tp_group, chunk_tokens, fused)


def chunked_language_model_loss(model: torch.nn.Module, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Any:
    """A drop-in for `model.compute_language_model_loss(labels [b, s], logits [s, b, v]) -> loss [b, s]` (what
    `GPTModel` hands `process_mtp_loss`) that computes it with `chunked_vocab_parallel_cross_entropy`."""

    def compute_language_model_loss(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        loss = chunked_vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous(), model.tp_group,
                                                    chunk_tokens, fused=model.config.cross_entropy_loss_fusion)
        return loss.transpose(0, 1).contiguous()

    return compute_language_model_loss
