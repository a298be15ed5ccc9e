"""MoE experts as two grouped GEMMs (`torch._grouped_mm`) instead of one small GEMM pair per expert.

Without Transformer Engine megatron-core builds `SequentialMLP` experts (megatron/core/models/backends.py:133-142),
whose forward (megatron/core/transformer/moe/experts.py:1318-1370) splits the permuted tokens per expert and runs
each expert's `MLP` in turn: on a GPU, 2 x experts small GEMMs and a host sync (`tokens_per_expert.tolist()`) a
layer, which made the 16-expert benchmark 7.1x the dense step of the same active FLOPs. `TEGroupedMLP`, the fast
path, needs Transformer Engine. PyTorch's own grouped GEMM (`torch._grouped_mm`, CUTLASS on Hopper) computes all
experts' GEMMs in one kernel from the same per-expert weights.

`megatron_core.grouped_mm_experts` keeps `SequentialMLP` (its parameters, names, checkpoints, the bridges' mappings,
the router, the token dispatcher and expert parallelism are untouched) and replaces only its forward, where it can:
CUDA tensors in bf16, more than one local expert, experts without biases, no FP8/FP4, widths aligned to 16 bytes. The
forward is `MLP.forward` (megatron/core/transformer/mlp.py:258-357: fc1, the gated or plain activation, the routing
probabilities per token, fc2; with `bias_activation_fusion` SwiGLU and the probabilities fused, as upstream's loop
fuses them, through `fast_swiglu`), so the result equals the loop's to rounding; the per-expert weights are
stacked for the GEMM and stacked again in backward rather than kept (a copy of every expert weight per layer would
otherwise live from forward to backward). Anything else, and the CPU, runs upstream's loop. A grouped GEMM the
device refuses (an unsupported GPU or layout) is logged once and that module goes back to the loop.

Under Megatron DDP the backward accumulates the experts' weight gradients as Megatron's own linear layers do with
`gradient_accumulation_fusion` (megatron/core/tensor_parallel/layers.py:658-721): added into every `main_grad` at
once (one upcast of the grouped GEMM's output, one `torch._foreach_add_`) and `grad_added_to_main_grad` set, so
DDP's hook (megatron/core/distributed/distributed_data_parallel.py:490-494) skips its one add per expert weight
(2,048 kernels and adds a step in `bench/moe.py`). torch 2.14's `_grouped_mm` refuses an `out_dtype` other than its
inputs' (ATen/native/GroupedMMUtils.h `_resolve_grouped_mm_out_dtype`, on CPU and CUDA alike), so the gradients are
computed in bf16 and rounded as the loop's are before the fp32 add; the upcast holds 4 bytes an expert weight of
the layer's projection for the add, and costs GPU time: for 16 experts of 1408 x 2048 on an H100, 348 us and 11
profiled CUDA events against 230 us and 35 for one add per weight (a mixed-dtype `_foreach_add_` takes that slow
path). The launches and hooks it saves are what a host-bound step waits on.

`megatron_core.grouped_experts_counts_on_device` spares the grouped layers the all-to-all dispatcher's host round trip:
upstream copies `tokens_per_expert` to the host for the loop's `.tolist()` and waits on that copy before the experts
(megatron/core/transformer/moe/token_dispatcher.py:913-952), the grouped forward needs the counts on the device; with
one TP x EP rank the wait is for nothing else but the sort by local expert, which keeps the order then (`:747-781`,
`:796-815`, splitting by host sizes, moe_utils.py:607-611): that wait goes. The other host sync a MoE layer a
microbatch, the grouped forward's blocking copy of host counts back to the device, goes for every dispatcher: counts
left on the host (pinned by the dispatcher's non-blocking copy, or its own) now come over without blocking. With
both, `bench/moe.py` on an H100 went from 1.68x to 1.57x the dense step (0.554 s to 0.512 s, 13,083 to 11,291
kernels, 135 to 7 host syncs: the dense step's).
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from lightning_megatron._compat._adjustment import Adjustment, Patches
from lightning_megatron._compat.fast_swiglu import fused_or_unfused_swiglu
from lightning_megatron._compat.no_te import no_transformer_engine

_LOG = logging.getLogger(__name__)
_ALIGNMENT_BYTES = 16
_COUNTS_ON_DEVICE = "_lightning_megatron_counts_on_device"  # set on a dispatcher per forward by `MoELayer.preprocess`
REFUSED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # experts whose grouped GEMM the device refused


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


def _on_cuda_without_te() -> bool:
    return torch.cuda.is_available() and no_transformer_engine() and grouped_mm_available()


def _accumulates_in_main_grads(weights: Sequence[torch.Tensor]) -> bool:
    """Megatron DDP's marks (distributed_data_parallel.py:122, param_and_grad_buffer.py:1360): its hook then skips the
    add of a weight whose `grad_added_to_main_grad` is set."""
    return all(hasattr(weight, "main_grad") and hasattr(weight, "grad_added_to_main_grad") for weight in weights)


def _add_to_main_grads(weights: Sequence[torch.Tensor], grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`grads` ([len(weights), out, in]) added into the weights' `main_grad`s in one foreach add, marked as Megatron's
    fused linear layers mark them (layers.py:692-721); returns the stand-ins DDP's hook then discards."""
    main_grads = [weight.main_grad for weight in weights]
    torch._foreach_add_(main_grads, list(grads.to(main_grads[0].dtype).unbind(0)))  # same dtype: the fused path
    for weight in weights:
        weight.grad_added_to_main_grad = True
    # Megatron returns an unused tensor of the weight's shape (zeros only for `zero_out_wgrad`, which
    # language_module.py:261 sets on the tied embedding alone); the bf16 gradients stand in without another copy
    return grads.unbind(0)


class _GroupedLinear(torch.autograd.Function):
    """`x @ W_e^T` for each expert's rows (`offs`: cumulative row counts), the weights stacked only while used."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, offs: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, offs, *weights)
        return torch._grouped_mm(x, torch.stack(weights).transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, offs, *weights = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = torch._grouped_mm(grad, torch.stack(weights), offs=offs) if ctx.needs_input_grad[0] else None
        trained = ctx.needs_input_grad[2:]
        if not any(trained):  # frozen experts (LoRA, MTP-only's trunk): a third of the GEMMs and their memory saved
            return (grad_x, None, *(None for _ in trained))
        grad_weights = torch._grouped_mm(grad.t(), x, offs=offs)  # [experts, out, in], in x's dtype
        if all(trained) and _accumulates_in_main_grads(weights):  # under Megatron DDP
            return (grad_x, None, *_add_to_main_grads(weights, grad_weights))
        return (grad_x, None,
                *(g if wanted else None for g, wanted in zip(grad_weights.unbind(0), trained, strict=True)))


def grouped_experts_forward(experts: Any, hidden: torch.Tensor, tokens_per_expert: torch.Tensor,
                            probs: torch.Tensor) -> tuple[torch.Tensor, None]:
    """`SequentialMLP.forward` of `experts` as two grouped GEMMs (its rows are already permuted by expert)."""
    config = experts.config
    if config.moe_apply_probs_on_input:  # as upstream: the probabilities scale the input, then count as 1
        hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
        probs = torch.ones_like(probs)
    # counts the dispatcher left on the host (pinned by its non-blocking copy, or its own) come over without a sync
    offs = torch.cumsum(tokens_per_expert.to(hidden.device, non_blocking=True), 0).to(torch.int32)
    fc1 = [expert.linear_fc1.weight for expert in experts.local_experts]
    fc2 = [expert.linear_fc2.weight for expert in experts.local_experts]
    intermediate = _GroupedLinear.apply(hidden, offs, *fc1)
    if config.bias_activation_fusion and config.gated_linear_unit and config.activation_func is F.silu:
        # upstream's fused branch (mlp.py:276-285): SwiGLU and the probabilities in one kernel (`fast_swiglu`)
        return _GroupedLinear.apply(fused_or_unfused_swiglu(intermediate, probs.unsqueeze(-1)), offs, *fc2), None
    if config.gated_linear_unit:
        gate, linear = torch.chunk(intermediate, 2, dim=-1)
        if (clamp := config.activation_func_clamp_value) is not None:
            gate, linear = gate.clamp(max=clamp), linear.clamp(min=-clamp, max=clamp)
        intermediate = config.activation_func(gate) * (linear + config.glu_linear_offset)
    else:
        intermediate = config.activation_func(intermediate)
    intermediate = (intermediate * probs.unsqueeze(-1)).to(hidden.dtype)
    return _GroupedLinear.apply(intermediate, offs, *fc2), None


def grouped_experts_apply(experts: Any, hidden: torch.Tensor) -> bool:
    """Whether `grouped_experts_forward` computes what upstream's loop would for these experts and tokens here."""
    config = experts.config
    first = experts.local_experts[0] if len(experts.local_experts) else None
    return (hidden.is_cuda and hidden.dtype == torch.bfloat16 and first is not None
            and len(experts.local_experts) > 1 and experts not in REFUSED
            and not (config.fp8 or config.fp4) and not config.use_te_activation_func
            and first.linear_fc1.bias is None and first.linear_fc2.bias is None
            and all(size * hidden.element_size() % _ALIGNMENT_BYTES == 0
                    for size in (*first.linear_fc1.weight.shape, *first.linear_fc2.weight.shape)))


def _install_grouped_experts(patches: Patches) -> None:
    from megatron.core.transformer.moe.experts import SequentialMLP

    loop = SequentialMLP.forward

    @functools.wraps(loop)
    def forward(self: Any, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor) -> Any:
        if grouped_experts_apply(self, permuted_local_hidden_states):
            try:
                return grouped_experts_forward(self, permuted_local_hidden_states, tokens_per_expert,
                                               permuted_probs)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as error:  # a device or layout the grouped GEMM does not take: the loop, from now
                REFUSED.add(self)
                _LOG.warning("MoE experts: torch._grouped_mm refused (%s); this layer's experts run one by one", error)
                weights = [weight for expert in self.local_experts
                           for weight in (expert.linear_fc1.weight, expert.linear_fc2.weight)]
                if _accumulates_in_main_grads(weights):  # the loop's gradients go through DDP's hook again
                    for weight in weights:
                        weight.grad_added_to_main_grad = False
        return loop(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs)

    patches.setattr(SequentialMLP, "forward", forward)


def _experts_run_grouped(layer: Any, hidden: torch.Tensor) -> bool:
    """Whether `layer`'s experts will take the grouped forward for tokens like `hidden` (the dispatcher keeps their
    dtype and device)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    return (GROUPED_MM_EXPERTS.active and isinstance(layer.experts, SequentialMLP)
            and grouped_experts_apply(layer.experts, hidden))


def _sorts_keep_the_order(dispatcher: Any) -> bool:
    """One TP x EP rank, several local experts, dropless: the sort by local expert (token_dispatcher.py:747-781) and
    its inverse (:796-815) keep the order, and they are the only reason besides the experts' counts to wait for the
    host copies (the sync point `before_permutation_2`, :607-611; token dropping or padding waits earlier, :543-546)."""
    return (dispatcher.tp_size * dispatcher.ep_size == 1 and dispatcher.num_local_experts > 1
            and not dispatcher.drop_and_pad and dispatcher.cuda_sync_point == "before_permutation_2")


def _upstream_copies_counts_to_the_host() -> bool:
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    return ("tokens_per_expert = maybe_move_tensor_to_cpu(" in inspect.getsource(
        MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize)
            and "split_sizes.tolist()" in inspect.getsource(moe_utils.sort_chunks_by_idxs))


def _counts_on_device_needed() -> bool:
    return _on_cuda_without_te() and _upstream_copies_counts_to_the_host()


def _install_counts_on_device(patches: Patches) -> None:
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as Dispatcher

    preprocess = MoELayer.preprocess
    dtoh_and_synchronize = Dispatcher._maybe_dtoh_and_synchronize
    dispatch_postprocess, combine_preprocess = Dispatcher.dispatch_postprocess, Dispatcher.combine_preprocess

    @functools.wraps(preprocess)
    def preprocess_noting_grouped_experts(self: Any, hidden_states: torch.Tensor, probs: torch.Tensor,
                                          routing_map: torch.Tensor) -> Any:
        setattr(self.token_dispatcher, _COUNTS_ON_DEVICE, _experts_run_grouped(self, hidden_states))
        return preprocess(self, hidden_states, probs, routing_map)

    @functools.wraps(dtoh_and_synchronize)
    def maybe_dtoh_and_synchronize(self: Any, point: str, tokens_per_expert: torch.Tensor | None = None) -> Any:
        if not getattr(self, _COUNTS_ON_DEVICE, False):
            return dtoh_and_synchronize(self, point, tokens_per_expert)
        if not _sorts_keep_the_order(self):  # the all-to-all's splits still come to the host, and are waited for
            dtoh_and_synchronize(self, point, None)
        return tokens_per_expert

    @functools.wraps(dispatch_postprocess)
    def dispatch_postprocess_in_order(self: Any, global_input_tokens: torch.Tensor, global_probs: torch.Tensor) -> Any:
        if not (getattr(self, _COUNTS_ON_DEVICE, False) and _sorts_keep_the_order(self)):
            return dispatch_postprocess(self, global_input_tokens, global_probs)
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return global_input_tokens, tokens_per_expert, global_probs

    @functools.wraps(combine_preprocess)
    def combine_preprocess_in_order(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        if getattr(self, _COUNTS_ON_DEVICE, False) and _sorts_keep_the_order(self):
            return hidden_states
        return combine_preprocess(self, hidden_states)

    patches.setattr(MoELayer, "preprocess", preprocess_noting_grouped_experts)
    patches.setattr(Dispatcher, "_maybe_dtoh_and_synchronize", maybe_dtoh_and_synchronize)
    patches.setattr(Dispatcher, "dispatch_postprocess", dispatch_postprocess_in_order)
    patches.setattr(Dispatcher, "combine_preprocess", combine_preprocess_in_order)


# megatron-core ----------------------------------------------------------------------------------------------------

GROUPED_MM_EXPERTS = Adjustment(
    "megatron_core.grouped_mm_experts",
    "megatron/core/transformer/moe/experts.py:1318-1370 SequentialMLP.forward runs one expert after another "
    "(TEGroupedMLP, the grouped GEMM, needs Transformer Engine: megatron/core/models/backends.py:133-142); "
    "megatron/core/distributed/distributed_data_parallel.py:490-494 adds each expert weight's gradient on its own "
    "unless marked as megatron/core/tensor_parallel/layers.py:692-721 marks it",
    _on_cuda_without_te,
    _install_grouped_experts,
)

COUNTS_ON_DEVICE = Adjustment(
    "megatron_core.grouped_experts_counts_on_device",
    "megatron/core/transformer/moe/token_dispatcher.py:913-952 MoEAlltoAllTokenDispatcher copies tokens_per_expert "
    "to the host (:927-928) and waits for the copy (:948-950, at the sync point chosen at :598-611) for "
    "SequentialMLP's .tolist() (experts.py:1352); with one TP x EP rank the sorts by local expert (:747-781, "
    ":796-815) keep the order but split by host sizes (moe_utils.py:607-611); MoELayer.preprocess "
    "(moe_layer.py:447-487) decides per forward",
    _counts_on_device_needed,
    _install_counts_on_device,
)

MEGATRON_CORE_ADJUSTMENTS = (GROUPED_MM_EXPERTS, COUNTS_ON_DEVICE)
