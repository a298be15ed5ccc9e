"""Megatron-Core's vocabulary-parallel cross-entropy, computed in token chunks so no `[tokens, vocab]` fp32 tensor
lives longer than one chunk.

Megatron-Core's cross-entropy (fused or not) upcasts the whole logits tensor to fp32 and keeps the fp32 softmax
for the backward pass: at 4096 tokens and a 151936-token vocabulary that is 2.3 GiB held from the loss to its
backward, plus as much again while it is computed. `chunked_vocab_parallel_cross_entropy` runs the same steps
(`VocabParallelCrossEntropy`'s max, predicted logit and sum of exponentials, all-reduced over the tensor-parallel
group) on `chunk_tokens` rows at a time and keeps only the logits it was given (bf16 in training) and two fp32
numbers per token; the backward recomputes each chunk's softmax from them with the same operations, so the loss
and its gradient are Megatron-Core's to fp32 rounding (the fused kernel rounds the gradient to bf16 as well).
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


class _ChunkedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, tp_group: Any,
                chunk_tokens: int) -> torch.Tensor:
        from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

        partition_vocab_size = logits.size(-1)
        logits_2d, target_1d = logits.reshape(-1, partition_vocab_size), target.reshape(-1)
        vocab_start, vocab_end = _vocab_range(partition_vocab_size, tp_group)
        rows = target_1d.numel()
        loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
        logits_max = torch.empty_like(loss)
        sum_exp_logits = torch.empty_like(loss)
        for start in range(0, rows, chunk_tokens):
            end = min(rows, start + chunk_tokens)
            chunk = logits_2d[start:end].to(torch.float32, copy=True)
            chunk_max = chunk.max(dim=-1)[0]
            dist.all_reduce(chunk_max, op=dist.ReduceOp.MAX, group=tp_group)
            _, _, predicted, sum_exp, _ = VocabParallelCrossEntropy.calculate_predicted_logits(
                chunk, target_1d[start:end], chunk_max, vocab_start, vocab_end)
            del chunk
            dist.all_reduce(predicted, op=dist.ReduceOp.SUM, group=tp_group)
            dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=tp_group)
            loss[start:end] = torch.log(sum_exp) - predicted
            logits_max[start:end], sum_exp_logits[start:end] = chunk_max, sum_exp
        ctx.save_for_backward(logits, target, logits_max, sum_exp_logits)
        ctx.vocab_range, ctx.chunk_tokens = (vocab_start, vocab_end), chunk_tokens
        return loss.view_as(target)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, target, logits_max, sum_exp_logits = ctx.saved_tensors
        vocab_start, vocab_end = ctx.vocab_range
        partition_vocab_size = logits.size(-1)
        logits_2d, target_1d = logits.reshape(-1, partition_vocab_size), target.reshape(-1)
        grad_1d = grad_output.reshape(-1)
        grad_input = torch.empty_like(logits_2d)
        for start in range(0, target_1d.numel(), ctx.chunk_tokens):
            end = min(target_1d.numel(), start + ctx.chunk_tokens)
            softmax = _softmax_chunk(logits_2d[start:end], logits_max[start:end], sum_exp_logits[start:end])
            chunk_target = target_1d[start:end]
            outside = (chunk_target < vocab_start) | (chunk_target >= vocab_end)
            local_target = torch.where(outside, 0, chunk_target - vocab_start)
            rows = torch.arange(end - start, device=softmax.device)
            softmax[rows, local_target] -= 1.0 - outside.float()
            softmax.mul_(grad_1d[start:end].unsqueeze(-1))
            grad_input[start:end] = softmax
        return grad_input.view_as(logits), None, None, None


def chunked_vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group: Any,
                                         chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> torch.Tensor:
    """Per-token cross-entropy of `[..., vocab / TP]` logits against `[...]` targets, `chunk_tokens` at a time."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: {chunk_tokens} must be at least 1")
    return _ChunkedVocabParallelCrossEntropy.apply(logits, target, tp_group, chunk_tokens)


def chunked_language_model_loss(model: torch.nn.Module, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Any:
    """A drop-in for `model.compute_language_model_loss(labels [b, s], logits [s, b, v]) -> loss [b, s]` (what
    `GPTModel` hands `process_mtp_loss`) that computes it with `chunked_vocab_parallel_cross_entropy`."""

    def compute_language_model_loss(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        loss = chunked_vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous(), model.tp_group,
                                                    chunk_tokens)
        return loss.transpose(0, 1).contiguous()

    return compute_language_model_loss
