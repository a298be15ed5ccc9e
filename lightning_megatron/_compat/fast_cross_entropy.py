"""Megatron-Core's fused ("native") vocabulary-parallel cross-entropy without Transformer Engine, from kernels Inductor
generates, the logits' gradient made in the forward.

megatron-bridge sets `cross_entropy_loss_fusion=True` with `cross_entropy_fusion_impl='native'`, so without TE every
main-head and MTP loss goes through `fused_vocab_parallel_cross_entropy` (`fusions/fused_cross_entropy.py:136`,
called from `LanguageModule.compute_language_model_loss`, `models/common/language_module/language_module.py:192`).
Its jit-fused steps upcast the whole logits to an fp32 copy, subtract the max in place, exponentiate in place, divide
in place, keep that fp32 softmax for the backward, and there scatter the target's -1, scale and cast to bf16. On an
H100 profile of a graphed Qwen3-0.6B joint SFT + MTP step (8 rows of 4096 tokens, vocabulary 151936, 767 ms of GPU
time) its three largest Triton kernels took ~118 ms over 16 calls: ~7 ms a call for 1.24 GB of bf16 logits, where
reading them three times and writing their gradient once takes ~1.5 ms at an H100's ~3.3 TB/s.

The adjustment puts `fused_vocab_parallel_cross_entropy` in `language_module`'s place (it imported the function by
name: `language_module.py:17`; the call at `:192` finds it there) and in `fused_cross_entropy`'s. On bf16 CUDA
logits it is `GradientInForward` with `COMPILED`, four `torch.compile`d functions of plain torch ops over the rows
[tokens, vocab / TP], each one pass over the logits that Inductor turns into one kernel reading bf16 and computing in
float32 in registers (no fp32 copy of the logits is made, so the rows need no chunks), three in the forward:

1. `logits_max`, each row's max, all-reduced (MAX) over the tensor-parallel group;
2. `predicted_and_sum_exp`, the target's logit minus the max where this shard holds the target (else 0) and the sum
   of exp(logit - max), one [rows, 2] tensor all-reduced (SUM) over the group, as upstream's one all-reduce;
   then loss = log(sum) - predicted;
3. `softmax_minus_one_hot`, the gradient of the loss sum, `exp(logit - max) / sum - one_hot(target)`, in the logits'
   dtype; only where the logits want a gradient.

and one in the backward:

4. `scale_rows`, that gradient times the incoming per-token gradient, in place, and handed on. Eager, the `mul_` of
   bf16 rows by a broadcast float32 column runs PyTorch's generic kernel for inputs of mixed dtypes
   (`elementwise_kernel<128, 4, gpu_kernel_impl<BinaryFunctor<float, float, float, ...>>>`, one element per thread
   step, casting each): in a Qwen3-0.6B SFT + MTP step on an H200 that kernel ran 16 times (a main-head and an
   MTP loss per microbatch) for 2.65 ms each, 7.7% of the step's GPU time (`bench/results/h200_2026-12-06/
   sizes.json`), about five times what one read and one write of the bf16 gradient take. Compiled, it is one
   pass over the gradient with the same float32 product and one rounding: bit for bit eager's.

`mtp/chunked_cross_entropy.py` runs its chunks through `GradientInForward` too (its backward the eager `scale_rows`),
and with `fused` on bf16 CUDA logits takes these kernels, all rows at once. Kept from the forward to the backward:
one bf16 logits-sized tensor, where upstream keeps an fp32 one.

Values: the float32 math is `VocabParallelCrossEntropy`'s (the unfused steps) bit for bit, loss and gradient; in bf16
the loss is upstream's within float32 rounding (other summation orders), and the gradient is rounded to bf16 twice
(`softmax - one_hot`, then the product) where upstream rounds once (`tests/_compat/test_fast_cross_entropy.py`
bounds both). Only bf16 logits take the compiled path: upstream's fused backward casts the gradient to bf16 whatever
the logits' dtype (`fusions/fused_cross_entropy.py:82`), which fp32 logits would not get here; fp16, fp32, CPU
tensors and the TE implementation keep upstream's function. A call first met inside a CUDA graph capture runs the
same math eagerly there (`compiled.py`); a compile that fails is logged once, and every call then runs upstream's
function.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_megatron._compat import compiled
from lightning_megatron._compat._adjustment import Adjustment, Patches
from lightning_megatron._compat.compiled import State, triton_available
from lightning_megatron._compat.no_te import no_transformer_engine

STATE = State("cross-entropy: torch.compile failed (%s); the loss runs Megatron-Core's fused cross-entropy from now "
              "on", logging.getLogger(__name__))
"""Whether the replacement takes the compiled path: the adjustment is applied and nothing refused it."""


# the math: what the compiled kernels are made from, and what runs where they cannot --------------------------------


def _shard_column(target: torch.Tensor, vocab_start: int, vocab_end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether this shard holds each row's target [rows, 1], and its column here (0 where it does not)."""
    held = (target >= vocab_start) & (target < vocab_end)
    return held, torch.where(held, target - vocab_start, 0)


def logits_max(logits: torch.Tensor) -> torch.Tensor:
    """Pass 1: each row's largest logit [rows, 1], float32 (upstream's `calculate_logits_max`)."""
    return logits.float().amax(-1, keepdim=True)


def predicted_and_sum_exp(logits: torch.Tensor, target: torch.Tensor, row_max: torch.Tensor, vocab_start: int,
                          vocab_end: int) -> torch.Tensor:
    """Pass 2, [rows, 2] float32: each row's target logit minus `row_max` where this shard holds the target, else 0,
    and its sum of exp(logit - `row_max`) (upstream's `calculate_predicted_logits`: the same float32 operations)."""
    held, column = _shard_column(target, vocab_start, vocab_end)
    predicted = torch.where(held, logits.gather(-1, column.long()).float() - row_max, 0.0)
    sum_exp = torch.exp(logits.float() - row_max).sum(-1, keepdim=True)
    return torch.cat((predicted, sum_exp), dim=-1)


def softmax_minus_one_hot(logits: torch.Tensor, target: torch.Tensor, row_max: torch.Tensor,
                          predicted_and_sum: torch.Tensor, vocab_start: int, vocab_end: int) -> torch.Tensor:
    """Pass 3: the loss sum's gradient by the logits, `exp(logit - max) / sum - one_hot(target)` in float32 (upstream's
    softmax and its update of the target's column), cast to the logits' dtype."""
    held, column = _shard_column(target, vocab_start, vocab_end)
    softmax = torch.exp(logits.float() - row_max) / predicted_and_sum[:, 1:]
    is_target = held & (torch.arange(logits.shape[-1], device=logits.device) == column)
    return torch.where(is_target, softmax - 1.0, softmax).to(logits.dtype)


def scale_rows(gradient: torch.Tensor, row_grad: torch.Tensor) -> None:
    """The backward's one pass: each row of the loss sum's gradient [rows, vocab / TP] times its token's incoming
    gradient [rows, 1], in float32, written back into the gradient in its dtype (one rounding of the float32
    product: what eager `mul_` computes, bit for bit)."""
    gradient.mul_(row_grad)


# the compiled kernels ---------------------------------------------------------------------------------------------


class CompiledKernel(compiled.CompiledKernel):
    """One of the functions above through `torch.compile` (`compiled.CompiledKernel`), one compiled copy per vocabulary
    shard width; a failed compile sends every call back to upstream's function (`STATE`)."""

    state = STATE


Step = Callable[[torch.Tensor, torch.Tensor, Any, int, int, bool], tuple[torch.Tensor, torch.Tensor | None]]
"""(logits [rows, vocab / TP], target [rows], TP group, this shard's vocabulary start and end, whether the gradient is
wanted) -> (the per-token loss [rows] float32, the loss sum's gradient by the logits in their dtype, or None)."""


Scale = Callable[[torch.Tensor, torch.Tensor], None]
"""(the loss sum's gradient [rows, vocab / TP], the incoming gradient [rows, 1]) -> None: the gradient scaled in
place (`scale_rows`)."""


@dataclass(frozen=True)
class Kernels:
    """The three forward passes as a `Step`, with the all-reduces between them that upstream's fused forward makes,
    and the backward's `scale_rows`."""

    logits_max: Callable[..., torch.Tensor] = logits_max
    predicted_and_sum_exp: Callable[..., torch.Tensor] = predicted_and_sum_exp
    softmax_minus_one_hot: Callable[..., torch.Tensor] = softmax_minus_one_hot
    scale_rows: Scale = scale_rows

    def __call__(self, logits: torch.Tensor, target: torch.Tensor, tp_group: Any, vocab_start: int, vocab_end: int,
                 wants_gradient: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        target = target.view(-1, 1)  # as many dimensions as the logits: the rows are dynamic in each compiled copy
        row_max = self.logits_max(logits)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
        predicted_and_sum = self.predicted_and_sum_exp(logits, target, row_max, vocab_start, vocab_end)
        dist.all_reduce(predicted_and_sum, op=dist.ReduceOp.SUM, group=tp_group)
        loss = torch.log(predicted_and_sum[:, 1]) - predicted_and_sum[:, 0]
        gradient = (self.softmax_minus_one_hot(logits, target, row_max, predicted_and_sum, vocab_start, vocab_end)
                    if wants_gradient else None)
        return loss, gradient


EAGER = Kernels()
COMPILED = Kernels(CompiledKernel(logits_max), CompiledKernel(predicted_and_sum_exp),
                   CompiledKernel(softmax_minus_one_hot), CompiledKernel(scale_rows))


def vocab_range(partition_vocab_size: int, tp_group: Any) -> tuple[int, int]:
    """This rank's [start, end) of the vocabulary (`VocabUtility`, as upstream's forward asks it)."""
    from megatron.core.tensor_parallel.utils import VocabUtility

    return VocabUtility.vocab_range_from_per_partition_vocab_size(partition_vocab_size, tp_group.rank(),
                                                                  tp_group.size())


class GradientInForward(torch.autograd.Function):
    """Per-token cross-entropy of `[..., vocab / TP]` logits whose gradient `step` makes in the forward,
    `chunk_tokens` rows at a time (one call where all rows fit); the backward multiplies it by the incoming gradient
    in place with `scale` (`calculate_gradients`' last step) and hands it on: the only logits-sized tensor kept."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, tp_group: Any, chunk_tokens: int,
                step: Step, scale: Scale) -> torch.Tensor:
        partition_vocab_size = logits.size(-1)
        logits_2d, target_1d = logits.reshape(-1, partition_vocab_size), target.reshape(-1)
        vocab_start, vocab_end = vocab_range(partition_vocab_size, tp_group)
        rows, wants_gradient = target_1d.numel(), ctx.needs_input_grad[0]
        if rows <= chunk_tokens:
            loss, gradient = step(logits_2d, target_1d, tp_group, vocab_start, vocab_end, wants_gradient)
        else:
            loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
            gradient = torch.empty_like(logits_2d) if wants_gradient else None
            for start in range(0, rows, chunk_tokens):
                end = min(rows, start + chunk_tokens)
                loss[start:end], chunk_gradient = step(logits_2d[start:end], target_1d[start:end], tp_group,
                                                       vocab_start, vocab_end, wants_gradient)
                if gradient is not None:
                    gradient[start:end] = chunk_gradient
        ctx.gradient, ctx.logits_shape, ctx.scale = gradient, logits.shape, scale
        return loss.view_as(target)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None]:
        gradient, ctx.gradient = ctx.gradient, None
        ctx.scale(gradient, grad_output.reshape(-1, 1))
        return gradient.view(ctx.logits_shape), None, None, None, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group: Any,
                  kernels: Kernels = COMPILED) -> torch.Tensor:
    """Per-token cross-entropy of `[..., vocab / TP]` logits against `[...]` targets over the tensor-parallel group,
    all rows at once through `kernels` (the compiled ones by default, `EAGER` for the same math without compiling)."""
    return GradientInForward.apply(logits, target, tp_group, max(1, target.numel()), kernels, kernels.scale_rows)


def takes_compiled_path(logits: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether `cross_entropy` computes what upstream's fused function does for these arguments on CUDA: bf16 logits
    (upstream's gradient is bf16), one target per row."""
    return (STATE.compiles and logits.is_cuda and logits.dtype == torch.bfloat16 and logits.numel() > 0
            and target.device == logits.device and tuple(target.shape) == tuple(logits.shape[:-1]))


# the adjustment ---------------------------------------------------------------------------------------------------


OPT_IN = "LIGHTNING_MEGATRON_FAST_CROSS_ENTROPY"
"""On by default (unset or 1); 0 keeps Megatron-Core's fused cross-entropy. On an H200, forward + backward at
[4096, 151936] takes 2.30 ms against upstream's 7.43 ms (`bench/results/h200_2026-12-06b/cross_entropy.json`; 4.32
ms before the backward's scale was compiled)."""


def opted_in() -> bool:
    """`LIGHTNING_MEGATRON_FAST_CROSS_ENTROPY`: unset or 1 applies the adjustment (where its condition holds), 0 leaves
    Megatron-Core's fused cross-entropy, anything else is refused (`compiled.switched_on`)."""
    return compiled.switched_on(OPT_IN, "Megatron-Core's fused cross-entropy",
                                "the cross-entropy from compiled kernels on a GPU without Transformer Engine")


def upstream_is_the_native_fusion() -> bool:
    """Whether megatron-core still computes the fused cross-entropy as replaced here (the max all-reduced, then the
    predicted logits and sums in one all-reduce, a bf16 gradient) and `compute_language_model_loss` still calls it
    through `language_module`'s own name."""
    from megatron.core.fusions import fused_cross_entropy as fused
    from megatron.core.models.common.language_module import language_module

    forward = inspect.getsource(fused._VocabParallelCrossEntropy.forward)
    return (all(line in forward for line in (
                "torch.distributed.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX, group=tp_group)",
                "predicted_logits_sum_exp_logits, op=torch.distributed.ReduceOp.SUM, group=tp_group")) and
            "grad_input = grad_input.to(torch.bfloat16)" in inspect.getsource(fused.calculate_gradients)
            and "loss = fused_vocab_parallel_cross_entropy(logits, labels, self.pg_collection.tp)"
            in inspect.getsource(language_module.LanguageModule.compute_language_model_loss))


def _fused_cross_entropy_is_slow_here() -> bool:
    return (opted_in() and torch.cuda.is_available() and no_transformer_engine() and triton_available()
            and upstream_is_the_native_fusion())


def _install_fast_cross_entropy(patches: Patches) -> None:
    from megatron.core.fusions import fused_cross_entropy as fused
    from megatron.core.models.common.language_module import language_module

    upstream = fused.fused_vocab_parallel_cross_entropy

    def fused_vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                           tp_group: Any) -> torch.Tensor:
        """Upstream's `fused_vocab_parallel_cross_entropy` (same arguments and result, to bf16 rounding of the
        gradient), through the compiled kernels where `takes_compiled_path`."""
        if takes_compiled_path(vocab_parallel_logits, target):
            return cross_entropy(vocab_parallel_logits, target, tp_group)
        return upstream(vocab_parallel_logits, target, tp_group)

    patches.setattr(fused, "fused_vocab_parallel_cross_entropy", fused_vocab_parallel_cross_entropy)
    patches.setattr(language_module, "fused_vocab_parallel_cross_entropy", fused_vocab_parallel_cross_entropy)
    STATE.active = True
    patches.on_revert(STATE.deactivate)


ADJUSTMENTS = (
    Adjustment(
        "megatron_core.fast_cross_entropy",
        "megatron/core/fusions/fused_cross_entropy.py:12-148 fused_vocab_parallel_cross_entropy (native, no TE: an "
        "fp32 copy of the logits, ~7 ms a call at Qwen3-0.6B's [4096, 151936] on an H100), bound by name at "
        "models/common/language_module/language_module.py:17 and called at :192 for the main head and MTP",
        _fused_cross_entropy_is_slow_here,
        _install_fast_cross_entropy,
    ),
)
