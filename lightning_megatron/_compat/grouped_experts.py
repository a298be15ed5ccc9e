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
fuses them, through `fast_swiglu`), so the result equals the loop's to rounding. The GEMMs read the weights as one
[experts, out, in] tensor: where Megatron DDP's distributed optimizer laid them out at one stride (`ExpertLayout`),
a view of its buffer, with the groups (and the tokens, sorted by the layer) in the buffer's order; elsewhere a
stack, made for the GEMM and again in backward rather than kept (a copy of every expert weight per layer would
otherwise live from forward to backward). Weights DDP does not manage (frozen: MTP-only's trunk, a LoRA base; or a
run without DDP) are stacked once instead, at the first forward, and stay so: each expert's `Parameter` becomes a
view of its row of one tensor per linear (`lay_out_in_one_tensor`: the same values, the separate tensors freed, so
no memory is added), where GLM-4.5-Air's 128 experts were otherwise copied, 4.4 GB per MoE layer, in every
microbatch's forward. Anything else, and the CPU, runs upstream's loop. A grouped GEMM the
device refuses (an unsupported GPU or layout) is logged once and that module goes back to the loop (over the
groups' order for a forward whose tokens were already sorted that way).

Under Megatron DDP the backward accumulates the experts' weight gradients as Megatron's own linear layers do with
`gradient_accumulation_fusion` (megatron/core/tensor_parallel/layers.py:658-721): added into every `main_grad` at
once and `grad_added_to_main_grad` set, so DDP's hook (megatron/core/distributed/distributed_data_parallel.py:490-494)
skips its one add per expert weight (2,048 kernels and adds a step in `bench/moe.py`). torch 2.14's `_grouped_mm`
refuses an `out_dtype` other than its inputs' (ATen/native/GroupedMMUtils.h `_resolve_grouped_mm_out_dtype`, on CPU
and CUDA alike), so the gradients are computed in bf16 and rounded as the loop's are before the fp32 add. Where the
`main_grad`s lie at one stride that add is one in-place add of the bf16 gradients into their view (10 bytes an
element moved); elsewhere one upcast and one `torch._foreach_add_` (18 bytes an element: a mixed-dtype foreach add
takes a slow path, 348 us against 230 us for 16 experts of 1408 x 2048 on an H100). The 2,048 launches and hooks
it saves are what a host-bound step waits on; the upcast and the stacks were about 55 ms of the 0.512 s MoE step
that followed (`bench/results/h100_2026-12-06b/moe.json`'s profile). With the views, the one add and the
permutation by gathers (`moe_permutation.py`) the step's GPU time fell from 0.391 s to 0.337 s
(`bench/results/h100_2026-12-06c/moe.json`).

`megatron_core.grouped_experts_counts_on_device` spares the grouped layers the all-to-all dispatcher's host round trip:
upstream copies `tokens_per_expert` to the host for the loop's `.tolist()` and waits on that copy before the experts
(megatron/core/transformer/moe/token_dispatcher.py:913-952), the grouped forward needs the counts on the device; with
one TP x EP rank the wait is for nothing else but the sort by local expert, which keeps the order then (`:747-781`,
`:796-815`, splitting by host sizes, moe_utils.py:607-611): that wait goes. The other host sync a MoE layer a
microbatch, the grouped forward's blocking copy of host counts back to the device, goes for every dispatcher: counts
left on the host (pinned by the dispatcher's non-blocking copy, or its own) now come over without blocking. With
both, `bench/moe.py` on an H100 went from 1.68x to 1.57x the dense step (0.554 s to 0.512 s, 13,083 to 11,291
kernels, 135 to 7 host syncs: the dense step's). At one TP x EP rank, dropless, the same `MoELayer.preprocess` sorts
the routing map's columns (and the probabilities') in the experts' `ExpertLayout` order, so the permutation hands
the experts their rows in the buffer's order (the combine undoes the same permutation).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
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
# experts whose layer sorted this forward's tokens in a layout's order -> that layout (set by `MoELayer.preprocess`)
TOKENS_IN_GROUP_ORDER: weakref.WeakKeyDictionary[torch.nn.Module, ExpertLayout] = weakref.WeakKeyDictionary()


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


def _on_cuda_without_te() -> bool:
    return torch.cuda.is_available() and no_transformer_engine() and grouped_mm_available()


def _accumulates_in_main_grads(weights: Sequence[torch.Tensor]) -> bool:
    """Megatron DDP's marks (distributed_data_parallel.py:122, param_and_grad_buffer.py:1360): its hook then skips the
    add of a weight whose `grad_added_to_main_grad` is set."""
    return all(hasattr(weight, "main_grad") and hasattr(weight, "grad_added_to_main_grad") for weight in weights)


@dataclass(frozen=True, eq=False)  # compared by identity: `order_index` is a tensor
class ExpertLayout:
    """Where a layer's expert weights (and their `main_grad`s) lie, and the order of the grouped GEMMs' groups.

    Megatron DDP with the distributed optimizer places every trained parameter in one buffer, in reverse order of
    registration (megatron/core/optimizer/distrib_optimizer.py:552, param_and_grad_buffer.py:1275-1299) and its
    `main_grad` in another (:1360-1362): a layer's experts then lie at one fixed stride (fc1 and fc2 interleaved,
    the last expert first) unless a bucket's padding falls between them. Where they do, one strided view stands for
    the stacked weights (no copy) and one for the `main_grad`s (one add of the bf16 gradients: no fp32 copy of
    them, no list of adds); the groups then follow the buffer's order (`order[g]` is group g's expert), and the
    layer's tokens are sorted in that order (`MoELayer.preprocess`, below). A stride is None where there is none
    (separate tensors under DDP without the distributed optimizer, padding): those weights are stacked, those
    gradients added per weight, in `order`. Only offsets are kept: the views are made per use, so a layout never
    holds a buffer that DDP let go."""

    order: tuple[int, ...]
    order_index: torch.Tensor  # `order` on the weights' device, to sort a routing map's columns by
    weight_strides: tuple[int | None, int | None]  # fc1's, fc2's, between consecutive groups, in elements
    main_grad_strides: tuple[int | None, int | None]
    addresses: tuple[int, ...]  # what it was read from: the weights' and `main_grad`s' data pointers

    @property
    def in_expert_order(self) -> bool:
        return self.order == tuple(range(len(self.order)))

    @functools.cached_property
    def in_experts_order(self) -> ExpertLayout:
        """For rows sorted by expert: the weights stacked in the experts' order, no views (they follow `order`)."""
        experts = tuple(range(len(self.order)))
        return ExpertLayout(experts, torch.arange(len(experts), device=self.order_index.device), (None, None),
                            (None, None), self.addresses)

    def weights(self, fc: int, weights: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """fc1's (`fc` 1) or fc2's weights as one [groups, out, in] view in group order, or None."""
        return self._view(weights[self.order[0]], self.weight_strides[fc - 1])

    def main_grads(self, fc: int, weights: Sequence[torch.Tensor]) -> torch.Tensor | None:
        return self._view(weights[self.order[0]].main_grad, self.main_grad_strides[fc - 1])

    def _view(self, first: torch.Tensor, stride: int | None) -> torch.Tensor | None:
        if stride is None:
            return None
        return first.detach().as_strided((len(self.order), *first.shape), (stride, *first.stride()))


def _addresses(experts: Any) -> tuple[int, ...]:
    weights = [weight for expert in experts.local_experts
               for weight in (expert.linear_fc1.weight, expert.linear_fc2.weight)]
    return (*(weight.data_ptr() for weight in weights),
            *(getattr(weight, "main_grad", weight).data_ptr() for weight in weights))


def _offsets_in_one_storage(tensors: Sequence[torch.Tensor]) -> list[int] | None:
    storage = tensors[0].untyped_storage().data_ptr()
    if any(tensor.untyped_storage().data_ptr() != storage for tensor in tensors):
        return None
    return [tensor.storage_offset() for tensor in tensors]


def _fixed_stride(tensors: Sequence[torch.Tensor]) -> int | None:
    """The stride at which `tensors` lie in this order, if they are contiguous, alike, in one storage, apart, and
    each one's start 16-byte aligned (`_grouped_mm`'s TMA loads): `torch.stack(tensors)` is then a view."""
    first = tensors[0]
    if not all(tensor.is_contiguous() and tensor.shape == first.shape and tensor.dtype == first.dtype
               for tensor in tensors):
        return None
    offsets = _offsets_in_one_storage(tensors)
    if offsets is None:
        return None
    stride = offsets[1] - offsets[0] if len(offsets) > 1 else first.numel()
    if (stride < first.numel() or any(later - earlier != stride for earlier, later in itertools.pairwise(offsets))
            or stride * first.element_size() % _ALIGNMENT_BYTES or first.data_ptr() % _ALIGNMENT_BYTES):
        return None
    return stride


def _read_layout(experts: Any) -> ExpertLayout:
    fc1 = [expert.linear_fc1.weight for expert in experts.local_experts]
    fc2 = [expert.linear_fc2.weight for expert in experts.local_experts]
    with_main_grads = _accumulates_in_main_grads([*fc1, *fc2])
    placed = [weight.main_grad for weight in fc1] if with_main_grads else fc1
    offsets = _offsets_in_one_storage(placed) or _offsets_in_one_storage(fc1)
    order = tuple(sorted(range(len(fc1)), key=offsets.__getitem__)) if offsets else tuple(range(len(fc1)))

    def stride(tensors: Sequence[torch.Tensor]) -> int | None:
        return _fixed_stride([tensors[expert] for expert in order])

    weight_strides = (stride(fc1), stride(fc2))
    main_grad_strides = ((stride([weight.main_grad for weight in fc1]), stride([weight.main_grad for weight in fc2]))
                         if with_main_grads else (None, None))
    if weight_strides == main_grad_strides == (None, None):  # nothing to gain from another order
        order = tuple(range(len(fc1)))
    return ExpertLayout(order, torch.tensor(order, device=fc1[0].device), weight_strides, main_grad_strides,
                        _addresses(experts))


_LAYOUTS: weakref.WeakKeyDictionary[torch.nn.Module, ExpertLayout] = weakref.WeakKeyDictionary()


def _to_lay_out(experts: Any, layout: ExpertLayout) -> bool:
    """Whether `experts`' weights are parameters (not, say, a LoRA layer's merged weight, made per access) that lie
    apart, Megatron DDP does not manage them, and stacked they would lie at one stride (alike, contiguous, 16-byte
    rows)."""
    if None not in layout.weight_strides or len(experts.local_experts) < 2:
        return False
    # registered parameters only: a property's weight is not evaluated (a LoRA merge per expert, every forward)
    linears = [[getattr(expert, linear)._parameters.get("weight") for expert in experts.local_experts]
               for linear in ("linear_fc1", "linear_fc2")]
    return (all(isinstance(weight, torch.nn.Parameter) for weights in linears for weight in weights)
            and not any(hasattr(weight, "main_grad") for weights in linears for weight in weights)
            and all(weight.is_contiguous() and weight.shape == weights[0].shape and weight.dtype == weights[0].dtype
                    and weight.device == weights[0].device for weights in linears for weight in weights)
            and all(weights[0].numel() * weights[0].element_size() % _ALIGNMENT_BYTES == 0 for weights in linears))


def lay_out_in_one_tensor(experts: Any) -> None:
    """Move each linear's expert weights into one [experts, out, in] tensor, each expert's `Parameter` a view of its
    row: the same values and `Parameter` objects; the separate tensors are freed once nothing else holds them."""
    with torch.no_grad():
        for linear in ("linear_fc1", "linear_fc2"):
            weights = [getattr(expert, linear).weight for expert in experts.local_experts]
            for weight, row in zip(weights, torch.stack([weight.detach() for weight in weights]).unbind(0),
                                   strict=True):
                weight.data = row


def expert_layout(experts: Any) -> ExpertLayout:
    """`experts`' layout, read again whenever a weight or `main_grad` moved (DDP wrapping a model, a reload).

    Weights Megatron DDP does not manage (no `main_grad`: frozen ones, or a run without DDP) that lie apart are laid
    out in one tensor per linear first (`lay_out_in_one_tensor`), once: they are stacked once instead of in every
    forward and backward."""
    layout = _LAYOUTS.get(experts)
    if layout is None or layout.addresses != _addresses(experts):
        layout = _read_layout(experts)
        if _to_lay_out(experts, layout):
            lay_out_in_one_tensor(experts)
            layout = _read_layout(experts)
        _LAYOUTS[experts] = layout
    return layout


class _GroupedLinear(torch.autograd.Function):
    """`x @ W_e^T` for each group's rows (`offs`: cumulative row counts; group g is expert `layout.order[g]`), the
    weights a view of where they lie or stacked only while used."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, offs: torch.Tensor, layout: ExpertLayout, fc: int,
                *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, offs, *weights)
        ctx.layout, ctx.fc = layout, fc
        return torch._grouped_mm(x, _grouped_weights(layout, fc, weights).transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, offs, *weights = ctx.saved_tensors
        layout, fc = ctx.layout, ctx.fc
        grad = grad.contiguous()
        grad_x = (torch._grouped_mm(grad, _grouped_weights(layout, fc, weights), offs=offs)
                  if ctx.needs_input_grad[0] else None)
        trained = ctx.needs_input_grad[4:]
        if not any(trained):  # frozen experts (LoRA, MTP-only's trunk): a third of the GEMMs and their memory saved
            return (grad_x, None, None, None, *(None for _ in trained))
        grad_groups = torch._grouped_mm(grad.t(), x, offs=offs)  # [experts, out, in] in group order, x's dtype
        if all(trained) and _accumulates_in_main_grads(weights):  # under Megatron DDP
            _add_to_main_grads(layout, fc, weights, grad_groups)
        grads: list[torch.Tensor | None] = [None] * len(weights)
        for group, expert in enumerate(layout.order):
            grads[expert] = grad_groups[group] if trained[expert] else None
        return (grad_x, None, None, None, *grads)


def _grouped_weights(layout: ExpertLayout, fc: int, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """[experts, out, in] in group order: the view where the weights lie at one stride, else a stack."""
    view = layout.weights(fc, weights)
    return view if view is not None else torch.stack([weights[expert] for expert in layout.order])


def _add_to_main_grads(layout: ExpertLayout, fc: int, weights: Sequence[torch.Tensor],
                       grad_groups: torch.Tensor) -> None:
    """`grad_groups` added into the weights' `main_grad`s and marked as Megatron's fused linear layers mark them
    (layers.py:692-721): one add into their view where they lie at one stride (bf16 read, fp32 added in place),
    else one upcast and one foreach add. The gradients returned after this are stand-ins DDP's hook discards
    (Megatron returns an unused tensor of the weight's shape: zeros only for `zero_out_wgrad`, which
    language_module.py:261 sets on the tied embedding alone)."""
    view = layout.main_grads(fc, weights)
    if view is not None:
        view.add_(grad_groups)
    else:
        main_grads = [weights[expert].main_grad for expert in layout.order]
        torch._foreach_add_(main_grads, list(grad_groups.to(main_grads[0].dtype).unbind(0)))  # same dtype: fused
    for weight in weights:
        weight.grad_added_to_main_grad = True


def _probabilities_on_input(experts: Any, hidden: torch.Tensor,
                            probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As upstream (experts.py:1326-1336): with `moe_apply_probs_on_input` the probabilities scale the input, then
    count as 1."""
    if not experts.config.moe_apply_probs_on_input:
        return hidden, probs
    return (probs.unsqueeze(-1) * hidden).to(hidden.dtype), torch.ones_like(probs)


def grouped_experts_forward(experts: Any, hidden: torch.Tensor, tokens_per_expert: torch.Tensor,
                            probs: torch.Tensor, *, rows_in: ExpertLayout | None = None) -> tuple[torch.Tensor, None]:
    """`SequentialMLP.forward` of `experts` as two grouped GEMMs. Its rows are already permuted by expert, in the
    experts' order or in `rows_in.order` (the counts too), `rows_in` read in this forward."""
    config = experts.config
    hidden, probs = _probabilities_on_input(experts, hidden, probs)
    layout = rows_in
    if layout is None:
        layout = expert_layout(experts)
        if not layout.in_expert_order:
            layout = layout.in_experts_order
    # counts the dispatcher left on the host (pinned by its non-blocking copy, or its own) come over without a sync
    offs = torch.cumsum(tokens_per_expert.to(hidden.device, non_blocking=True), 0).to(torch.int32)
    fc1 = [expert.linear_fc1.weight for expert in experts.local_experts]
    fc2 = [expert.linear_fc2.weight for expert in experts.local_experts]
    intermediate = _GroupedLinear.apply(hidden, offs, layout, 1, *fc1)
    if config.bias_activation_fusion and config.gated_linear_unit and config.activation_func is F.silu:
        # upstream's fused branch (mlp.py:276-285): SwiGLU and the probabilities in one kernel (`fast_swiglu`)
        intermediate = fused_or_unfused_swiglu(intermediate, probs.unsqueeze(-1))
        return _GroupedLinear.apply(intermediate, offs, layout, 2, *fc2), None
    if config.gated_linear_unit:
        gate, linear = torch.chunk(intermediate, 2, dim=-1)
        if (clamp := config.activation_func_clamp_value) is not None:
            gate, linear = gate.clamp(max=clamp), linear.clamp(min=-clamp, max=clamp)
        intermediate = config.activation_func(gate) * (linear + config.glu_linear_offset)
    else:
        intermediate = config.activation_func(intermediate)
    intermediate = (intermediate * probs.unsqueeze(-1)).to(hidden.dtype)
    return _GroupedLinear.apply(intermediate, offs, layout, 2, *fc2), None


def _loop_in_order(experts: Any, hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor,
                   order: Sequence[int]) -> tuple[torch.Tensor, None]:
    """Upstream's loop (experts.py:1350-1370, no FP8) over rows sorted in `order`: what a layer whose grouped GEMM
    is refused after its tokens were sorted that way runs."""
    hidden, probs = _probabilities_on_input(experts, hidden, probs)
    counts = tokens_per_expert.tolist()
    outputs = [experts.local_experts[expert](rows, row_probs)[0]
               for expert, rows, row_probs in zip(order, hidden.split(counts), probs.split(counts), strict=True)]
    return torch.cat(outputs), None


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
        rows_in = TOKENS_IN_GROUP_ORDER.get(self)
        if grouped_experts_apply(self, permuted_local_hidden_states):
            try:
                return grouped_experts_forward(self, permuted_local_hidden_states, tokens_per_expert,
                                               permuted_probs, rows_in=rows_in)
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
        if rows_in is not None:
            return _loop_in_order(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs,
                                  rows_in.order)
        return loop(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs)

    patches.setattr(SequentialMLP, "forward", forward)


def _experts_run_grouped(layer: Any, hidden: torch.Tensor) -> bool:
    """Whether `layer`'s experts will take the grouped forward for tokens like `hidden` (the dispatcher keeps their
    dtype and device)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    return (GROUPED_MM_EXPERTS.active and isinstance(layer.experts, SequentialMLP)
            and grouped_experts_apply(layer.experts, hidden))


def _one_rank_dropless(dispatcher: Any) -> bool:
    """One TP x EP rank, several local experts, no token dropping or padding: the dispatcher's experts are the
    layer's, in one chunk each, sorted by the routing map's columns (token_dispatcher.py:659-672, moe_utils.py:447-462),
    and the sort by local expert (:747-781) and its inverse (:796-815) keep the order."""
    return dispatcher.tp_size * dispatcher.ep_size == 1 and dispatcher.num_local_experts > 1 \
        and not dispatcher.drop_and_pad


def _sorts_keep_the_order(dispatcher: Any) -> bool:
    """`_one_rank_dropless`, and those sorts are the only reason besides the experts' counts to wait for the host
    copies (the sync point `before_permutation_2`, :607-611; token dropping or padding waits earlier, :543-546)."""
    return _one_rank_dropless(dispatcher) and dispatcher.cuda_sync_point == "before_permutation_2"


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
        grouped = _experts_run_grouped(self, hidden_states)
        setattr(self.token_dispatcher, _COUNTS_ON_DEVICE, grouped)
        TOKENS_IN_GROUP_ORDER.pop(self.experts, None)
        if grouped and isinstance(self.token_dispatcher, Dispatcher) and _one_rank_dropless(self.token_dispatcher):
            layout = expert_layout(self.experts)
            if not layout.in_expert_order:  # the columns in the layout's order: the permutation sorts rows by it
                index = layout.order_index
                routing_map, probs = routing_map.index_select(1, index), probs.index_select(1, index)
                TOKENS_IN_GROUP_ORDER[self.experts] = layout
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
    "unless marked as megatron/core/tensor_parallel/layers.py:692-721 marks it; the distributed optimizer's buffers "
    "hold the experts at one stride (megatron/core/optimizer/distrib_optimizer.py:552, "
    "megatron/core/distributed/param_and_grad_buffer.py:1275-1299, :1360-1362)",
    _on_cuda_without_te,
    _install_grouped_experts,
)

COUNTS_ON_DEVICE = Adjustment(
    "megatron_core.grouped_experts_counts_on_device",
    "megatron/core/transformer/moe/token_dispatcher.py:913-952 MoEAlltoAllTokenDispatcher copies tokens_per_expert "
    "to the host (:927-928) and waits for the copy (:948-950, at the sync point chosen at :598-611) for "
    "SequentialMLP's .tolist() (experts.py:1352); with one TP x EP rank the sorts by local expert (:747-781, "
    ":796-815) keep the order but split by host sizes (moe_utils.py:607-611); MoELayer.preprocess "
    "(moe_layer.py:447-487) decides per forward, and there sorts the routing map's columns in the order Megatron "
    "DDP's buffers hold the experts (permute sorts rows by them: moe_utils.py:447-462)",
    _counts_on_device_needed,
    _install_counts_on_device,
)

MEGATRON_CORE_ADJUSTMENTS = (GROUPED_MM_EXPERTS, COUNTS_ON_DEVICE)
