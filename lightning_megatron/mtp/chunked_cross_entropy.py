"""Megatron-Core's vocabulary-parallel cross-entropy, computed in token chunks so no `[tokens, vocab]` fp32 tensor
lives longer than one chunk, each chunk's gradient made in the forward.

Megatron-Core's cross-entropy (fused or not) upcasts the whole logits tensor to fp32 and keeps the fp32 softmax
for the backward pass: at 4096 tokens and a 151936-token vocabulary that is 2.3 GiB held from the loss to its
backward, plus as much again while it is computed. `chunked_vocab_parallel_cross_entropy` runs the same steps
(`VocabParallelCrossEntropy`'s max, predicted logit and sum of exponentials, all-reduced over the tensor-parallel
group, then the softmax) on `chunk_tokens` rows at a time. While a chunk's softmax exists it also makes that
chunk's gradient of the loss sum, `softmax - one_hot(target)` (Megatron-Core's own update), and keeps it in the
logits' dtype; the backward only multiplies it by the incoming per-token gradient, in place, and hands it on.

Why this and not a recompute or a fused linear + cross-entropy: the recompute (the previous implementation) kept
the logits and ran max / exp / softmax over them a second time in the backward; keeping the gradient instead costs
the same memory (one logits-sized tensor in the logits' dtype: the logits themselves are no longer kept, so
Megatron-Core frees them after the MTP loss, having read them for `mtp_accuracy`) and the backward becomes one
in-place multiply with no fp32 temporaries. A fused linear + cross-entropy would never materialise the bf16 logits
at all, but megatron-core 0.19.2 ships none, and Megatron-Core's MTP path computes the logits itself (its output
layer) and reads them after the loss (`_compute_mtp_acceptance_counts`), so the logits exist anyway.

Values: the loss is Megatron-Core's bit for bit; so is the gradient in fp32 (the same operations, the multiply by
the incoming gradient only later). In bf16 the gradient is rounded twice (`softmax - one_hot`, then the product)
where Megatron-Core rounds once: within one bf16 rounding. With `fused` (the model's `cross_entropy_loss_fusion`)
the forward steps are Megatron-Core's jit-fused ones (`fusions/fused_cross_entropy.py`), otherwise its plain ones;
on bf16 CUDA logits without TE, `fused` takes `_compat.fast_cross_entropy`'s compiled kernels (the same arithmetic,
no fp32 temporaries, so no chunks). The chunk loop and the in-place backward are its `GradientInForward`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_megatron._compat import fast_cross_entropy

DEFAULT_CHUNK_TOKENS = 1024


def _upcast_by_megatron(logits: torch.Tensor) -> torch.Tensor:
    """What to hand `calculate_logits_max`, which upcasts with `.float()` and is then overwritten in place: bf16
    logits as they are (the upcast is a copy, fused with the max), fp32 ones copied (the upcast would be them)."""
    return logits.clone() if logits.dtype == torch.float32 else logits


def _minus_one_hot(softmax: torch.Tensor, target_mask: torch.Tensor, masked_target: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """`softmax - one_hot(target)` in place (targets on other vocabulary shards subtract nothing), in `dtype`: the
    update of `VocabParallelCrossEntropy.calculate_gradients`, before its multiply by the incoming gradient."""
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

    grad_2d, arange_1d, softmax_update, grad_input = (
        VocabParallelCrossEntropy.prepare_gradient_calculation_operands(softmax, target_mask))
    grad_2d[arange_1d, masked_target] -= softmax_update
    return grad_input.to(dtype)


def _plain_chunk(logits: torch.Tensor, target: torch.Tensor, tp_group: Any, vocab_start: int, vocab_end: int,
                 wants_gradient: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(loss, gradient) of one chunk (a `fast_cross_entropy.Step`): `_VocabParallelCrossEntropy.forward`'s steps."""
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

    chunk = logits.to(torch.float32, copy=True)
    chunk_max = chunk.max(dim=-1)[0]
    dist.all_reduce(chunk_max, op=dist.ReduceOp.MAX, group=tp_group)
    target_mask, masked_target, predicted, sum_exp, exp_logits = VocabParallelCrossEntropy.calculate_predicted_logits(
        chunk, target, chunk_max, vocab_start, vocab_end)
    dist.all_reduce(predicted, op=dist.ReduceOp.SUM, group=tp_group)
    dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=tp_group)
    softmax, loss = VocabParallelCrossEntropy.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
    return loss, _minus_one_hot(softmax, target_mask, masked_target, logits.dtype) if wants_gradient else None


def _fused_chunk(logits: torch.Tensor, target: torch.Tensor, tp_group: Any, vocab_start: int, vocab_end: int,
                 wants_gradient: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same from the fused `_VocabParallelCrossEntropy.forward`'s jit-fused steps."""
    from megatron.core.fusions import fused_cross_entropy as fused

    chunk, chunk_max = fused.calculate_logits_max(_upcast_by_megatron(logits))
    dist.all_reduce(chunk_max, op=dist.ReduceOp.MAX, group=tp_group)
    target_mask, masked_target, predicted_and_sum, exp_logits = fused.calculate_predicted_logits(
        chunk, target, chunk_max, vocab_start, vocab_end)
    dist.all_reduce(predicted_and_sum, op=dist.ReduceOp.SUM, group=tp_group)
    softmax, loss = fused.calculate_cross_entropy_loss(exp_logits, predicted_and_sum)
    return loss, _minus_one_hot(softmax, target_mask, masked_target, logits.dtype) if wants_gradient else None


def chunked_vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group: Any,
                                         chunk_tokens: int = DEFAULT_CHUNK_TOKENS, fused: bool = False
                                         ) -> torch.Tensor:
    """Per-token cross-entropy of `[..., vocab / TP]` logits against `[...]` targets, `chunk_tokens` at a time;
    `fused`: Megatron-Core's jit-fused steps (bf16 logit gradients), else its plain ones. Where the compiled
    cross-entropy applies (`_compat.fast_cross_entropy`: bf16 CUDA logits without TE), `fused` takes its kernels
    instead, all rows at once: they make no fp32 temporaries to bound."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: {chunk_tokens} must be at least 1")
    if fused and fast_cross_entropy.takes_compiled_path(logits, target):
        return fast_cross_entropy.cross_entropy(logits, target, tp_group)
    return fast_cross_entropy.GradientInForward.apply(logits, target, tp_group, chunk_tokens,
                                                      _fused_chunk if fused else _plain_chunk,
                                                      fast_cross_entropy.scale_rows)


def chunked_language_model_loss(model: torch.nn.Module, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Any:
    """A drop-in for `model.compute_language_model_loss(labels [b, s], logits [s, b, v]) -> loss [b, s]` (what
    `GPTModel` hands `process_mtp_loss`) that computes it with `chunked_vocab_parallel_cross_entropy`."""

    def compute_language_model_loss(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        loss = chunked_vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous(), model.tp_group,
                                                    chunk_tokens, fused=model.config.cross_entropy_loss_fusion)
        return loss.transpose(0, 1).contiguous()

    return compute_language_model_loss
