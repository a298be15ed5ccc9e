"""MoE experts as two grouped GEMMs (`torch._grouped_mm`) instead of one small GEMM pair per expert.

Without Transformer Engine megatron-core builds `SequentialMLP` experts (megatron/core/models/backends.py:133-142),
whose forward (megatron/core/transformer/moe/experts.py:1318-1370) splits the permuted tokens per expert and runs
each expert's `MLP` in turn: on a GPU, 2 x experts small GEMMs and a host sync (`tokens_per_expert.tolist()`) a
layer, which made the 16-expert benchmark 7.1x the dense step of the same active FLOPs. `TEGroupedMLP`, the fast
path, needs Transformer Engine. PyTorch's own grouped GEMM (`torch._grouped_mm`, CUTLASS on Hopper) computes all
experts' GEMMs in one kernel from the same per-expert weights.

The adjustment keeps `SequentialMLP` (its parameters, names, checkpoints, the bridges' mappings, the router, the
token dispatcher and expert parallelism are untouched) and replaces only its forward, where it can: CUDA tensors in
bf16, more than one local expert, experts without biases, no FP8/FP4, widths aligned to 16 bytes. The forward is
`MLP.forward` (megatron/core/transformer/mlp.py:258-357: fc1, the gated or plain activation, the routing
probabilities per token, fc2; with `bias_activation_fusion` SwiGLU and the probabilities fused, as upstream's loop
fuses them, through `fast_swiglu`), so the result equals the loop's to rounding; the per-expert weights are
stacked for the GEMM and stacked again in backward rather than kept (a copy of every expert weight per layer would
otherwise live from forward to backward). Anything else, and the CPU, runs upstream's loop. A grouped GEMM the
device refuses (an unsupported GPU or layout) is logged once and that module goes back to the loop.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from lightning_megatron._compat._adjustment import Adjustment, Patches
from lightning_megatron._compat.fast_swiglu import fused_or_unfused_swiglu
from lightning_megatron._compat.no_te import no_transformer_engine

_LOG = logging.getLogger(__name__)
_ALIGNMENT_BYTES = 16
REFUSED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # experts whose grouped GEMM the device refused


def grouped_mm_available() -> bool:
    return hasattr(torch, "_grouped_mm")


def _on_cuda_without_te() -> bool:
    return torch.cuda.is_available() and no_transformer_engine() and grouped_mm_available()


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
        grad_weights = torch._grouped_mm(grad.t(), x, offs=offs).unbind(0)  # [experts, out, in]
        return (grad_x, None, *(g if wanted else None for g, wanted in zip(grad_weights, trained, strict=True)))


def grouped_experts_forward(experts: Any, hidden: torch.Tensor, tokens_per_expert: torch.Tensor,
                            probs: torch.Tensor) -> tuple[torch.Tensor, None]:
    """`SequentialMLP.forward` of `experts` as two grouped GEMMs (its rows are already permuted by expert)."""
    config = experts.config
    if config.moe_apply_probs_on_input:  # as upstream: the probabilities scale the input, then count as 1
        hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
        probs = torch.ones_like(probs)
    offs = torch.cumsum(tokens_per_expert.to(device=hidden.device), 0).to(torch.int32)
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
        return loop(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs)

    patches.setattr(SequentialMLP, "forward", forward)


# megatron-core ----------------------------------------------------------------------------------------------------

MEGATRON_CORE_ADJUSTMENTS = (
    Adjustment(
        "megatron_core.grouped_mm_experts",
        "megatron/core/transformer/moe/experts.py:1318-1370 SequentialMLP.forward runs one expert after another "
        "(TEGroupedMLP, the grouped GEMM, needs Transformer Engine: megatron/core/models/backends.py:133-142)",
        _on_cuda_without_te,
        _install_grouped_experts,
    ),
)
