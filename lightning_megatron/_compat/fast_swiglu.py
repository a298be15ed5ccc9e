"""Megatron-Core's SwiGLU (the MLP's gated SiLU) fused on CUDA: one kernel forward and one backward, where upstream's
default runs seven, for every MLP of every layer, the MTP layer's and MoE experts' included.

Megatron-Core computes the activation between `linear_fc1` and `linear_fc2` unfused unless `bias_activation_fusion`
is set, and it is off by default (`transformer/transformer_config.py:482`): `MLP.forward`'s `glu`
(`transformer/mlp.py:319-333`) chunks fc1's output into [gate, linear], then SiLU, `linear + glu_linear_offset` (0)
and the product, each a kernel over [tokens, ffn], and autograd's backward adds two products, SiLU's gradient and the
chunk's concatenation. On an H100 profile of the Qwen3-0.6B joint SFT + MTP step, unfused bf16 elementwise kernels
took ~64 ms of 767 (1856 multiplies, 2352 adds a step), the MLPs' among them. Upstream's fused path
(`bias_activation_fusion=True`: `mlp.py:276-316` -> `fusions/fused_bias_swiglu.py:209-251`) is plain `torch.compile`
(`jit.py:20-21`) of functions that compile at their first call, whatever a CUDA graph capture is doing then.

The adjustment, on CUDA without Transformer Engine (Inductor generates the kernels with Triton):

1. makes `bias_activation_fusion` True by default where fusing is exact to rounding and Megatron-Core accepts it
   (`unfused_reason`: a gated SiLU without Transformer Engine's activation module, `glu_linear_offset` 0, no
   `activation_func_clamp_value`, which the fused path would ignore, no FP8 input store; the checks of
   `transformer_config.py:2114-2145` then validate it as for a config that sets it). The field reads through
   `FusedByDefault`, a descriptor on `TransformerConfig`: a config keeps the value it was given (a bridge's True,
   its False), and reads True where it was given False and its fields allow the fusion, also in a copy (the MoE
   experts' `deepcopy`, `experts.py:1281`) or after a field changes. A config's False cannot be told from
   upstream's default: a model whose user set the field (`config_overrides`) reads it as given (`keep_as_given`, which
   the bridges call), and `LIGHTNING_MEGATRON_FAST_SWIGLU=0` keeps every model unfused. Configs that
   redeclare the field (megatron-bridge's Qwen3-VL and Qwen3.5-VL providers, True) keep their own default. Nothing
   is stored: a revert (or `suspended()`) gives every config, built before or after, upstream's value (but for a
   `dataclasses.replace` made meanwhile, which passes the True it read as given).
2. puts `bias_swiglu_impl` and `weighted_bias_swiglu_impl` in `mlp`'s place (called at `mlp.py:280,309`) and
   `bias_swiglu_impl` in `moe/shared_experts.py`'s (`:281`): `SwiGLUFunction` with the `COMPILED` kernels for a
   CUDA tensor of bf16, fp16 or fp32, computing `silu(gate) * linear` (times the routing probabilities of a MoE
   expert's tokens, `per_token_scale`) in float32 and rounding once, the gradient `g * linear * s * (1 + gate *
   (1 - s))` and `g * silu(gate)` (s = sigmoid(gate)) in one kernel, and the probabilities' gradient in the same
   pass. The grouped experts (`grouped_experts.py`) call it as upstream's experts do. Only fc1's output is kept for
   the backward, where upstream's unfused path also keeps SiLU's output. A bias is added first, as upstream's
   unfused path does (upstream's weighted fusion refuses one); upstream's FP8 input store and CPU offloading keep
   upstream's function.

`compiled.py` compiles one copy per width (the dense MLP, the MoE experts', the shared expert's), the rows dynamic
(packed rows, micro-batches, validation and each expert's token count share it), in the first (eager) training
step; a call first met inside a CUDA graph capture runs the same math eagerly there, and a compile that fails is
logged once, after which every call runs upstream's unfused ops. CPU tensors always run upstream's unfused ops, bit
for bit (`unfused_swiglu`). In bf16 the fused results are within a bf16 rounding of the exact ones where upstream's
unfused path rounds SiLU, the product and each gradient term apart (`tests/_compat/test_fast_swiglu.py` bounds
both). Checkpoints do not change: the activation has no parameters, and no checkpoint holds the config.

`bias_dropout_fusion` (`fusions/fused_bias_dropout.py`) is left as it is: with `hidden_dropout` 0 and no bias the
unfused bias-dropout-add is one add kernel, `F.dropout(x, p=0)` returning its input without a kernel (ATen's
`_dropout_impl` returns early at p == 0, `is_fused_kernel_acceptable` requires p > 0), and its backward none (the
add hands its gradient to both inputs); the fused one (`torch.compile` of the same function) can at best match that.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lightning_megatron._compat import compiled
from lightning_megatron._compat._adjustment import Adjustment, Patches
from lightning_megatron._compat.compiled import State, triton_available
from lightning_megatron._compat.no_te import no_transformer_engine

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FIELD = "bias_activation_fusion"

STATE = State("SwiGLU: torch.compile failed (%s); the MLPs run Megatron-Core's unfused SwiGLU from now on",
              logging.getLogger(__name__))
"""Whether the replacements take the compiled path: the adjustment is applied and nothing refused it."""


# the math: what the compiled kernels are made from, and what runs where they cannot --------------------------------


def swiglu_forward(x: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """`silu(gate) * linear` of the halves [gate, linear] of `x`'s rows [M, 2F], times the rows' `weights` [M, 1]
    where given, in float32 and cast to x's dtype."""
    gate, linear = x.float().chunk(2, dim=-1)
    output = F.silu(gate) * linear
    if weights is not None:
        output = output * weights.float()
    return output.to(x.dtype)


def _input_grad(grad: torch.Tensor, x: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    gate, linear = x.float().chunk(2, dim=-1)
    scaled = grad.float() if weights is None else grad.float() * weights.float()
    sigmoid = torch.sigmoid(gate)
    return torch.cat((scaled * linear * sigmoid * (1 + gate * (1 - sigmoid)), scaled * F.silu(gate)), dim=-1)


def swiglu_input_grad(grad: torch.Tensor, x: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """The loss's gradient by `x` [M, 2F] from its gradient by the output [M, F]: by the gate `g w linear s (1 + gate
    (1 - s))` (SiLU's derivative as torch's `silu_backward` writes it, s = sigmoid(gate)), by the linear half
    `g w silu(gate)`; in float32, cast to x's dtype."""
    return _input_grad(grad, x, weights).to(x.dtype)


def swiglu_grads(grad: torch.Tensor, x: torch.Tensor,
                 weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`swiglu_input_grad` and the gradient by the rows' weights [M, 1] (float32): each row's sum of `g silu(gate)
    linear`."""
    gate, linear = x.float().chunk(2, dim=-1)
    weights_grad = (grad.float() * (F.silu(gate) * linear)).sum(dim=-1, keepdim=True)
    return _input_grad(grad, x, weights).to(x.dtype), weights_grad


def unfused_swiglu(x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Megatron-Core's unfused SwiGLU (`mlp.py:319-340` with `glu_linear_offset` 0: adding 0 changes no value), what
    the CPU and every call the compiled path does not take run, autograd's gradient included."""
    gate, linear = torch.chunk(x, 2, dim=-1)
    output = F.silu(gate) * linear
    if weights is not None:
        output = (output * weights).to(x.dtype)
    return output


# the compiled kernels ---------------------------------------------------------------------------------------------


class CompiledKernel(compiled.CompiledKernel):
    """One of the functions above through `torch.compile` (`compiled.CompiledKernel`), one compiled copy per width;
    a failed compile sends every call back to upstream's unfused ops (`STATE`)."""

    state = STATE


@dataclass(frozen=True)
class Kernels:
    forward: Callable[..., torch.Tensor] = swiglu_forward
    input_grad: Callable[..., torch.Tensor] = swiglu_input_grad
    grads: Callable[..., tuple[torch.Tensor, torch.Tensor]] = swiglu_grads


EAGER = Kernels()
COMPILED = Kernels(CompiledKernel(swiglu_forward), CompiledKernel(swiglu_input_grad), CompiledKernel(swiglu_grads))


class SwiGLUFunction(torch.autograd.Function):
    """SwiGLU of rows [M, 2F] (times per-row weights [M, 1] or None) with `kernels`' forward and gradients: autograd
    stays here, so the kernels are plain functions; the weights' gradient is made only where they want one (routing
    probabilities do, the probabilities a MoE applies on the input do not)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weights: torch.Tensor | None, kernels: Kernels) -> torch.Tensor:
        ctx.save_for_backward(x, weights)
        ctx.kernels = kernels
        return kernels.forward(x, weights)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weights = ctx.saved_tensors
        grad = grad.contiguous()
        wants_x, wants_weights = ctx.needs_input_grad[:2]
        if wants_weights:
            grad_x, grad_weights = ctx.kernels.grads(grad, x, weights)
            return grad_x if wants_x else None, grad_weights.to(weights.dtype), None
        return ctx.kernels.input_grad(grad, x, weights) if wants_x else None, None, None


def swiglu(x: torch.Tensor, weights: torch.Tensor | None = None, kernels: Kernels = COMPILED) -> torch.Tensor:
    """SwiGLU of `x`'s last dimension [..., 2F] (times `weights` [..., 1]) through `SwiGLUFunction` (`kernels`: the
    compiled ones by default, `EAGER` for the same math without compiling)."""
    rows = x.reshape(-1, x.shape[-1])  # a view where the strides allow one
    scale = None if weights is None else weights.reshape(-1, 1)
    return SwiGLUFunction.apply(rows, scale, kernels).view(*x.shape[:-1], x.shape[-1] // 2)


def takes_compiled_path(x: torch.Tensor, weights: torch.Tensor | None) -> bool:
    """Whether `swiglu` computes what `unfused_swiglu` does for these arguments on CUDA: a float tensor of even
    width, weights one per row where given."""
    return (STATE.compiles and x.is_cuda and x.dtype in _DTYPES and x.dim() >= 2 and x.numel() > 0
            and x.shape[-1] % 2 == 0
            and (weights is None or (weights.device == x.device and weights.dtype in _DTYPES
                                     and weights.shape == (*x.shape[:-1], 1))))


def fused_or_unfused_swiglu(x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU of `x` (times `weights`): fused where `takes_compiled_path`, upstream's unfused ops elsewhere."""
    if takes_compiled_path(x, weights):
        return swiglu(x, weights)
    return unfused_swiglu(x, weights)


# the default ------------------------------------------------------------------------------------------------------


def _name(function: Callable[..., Any]) -> str:
    if isinstance(function, types.FunctionType | types.BuiltinFunctionType):
        return function.__name__
    return repr(function)


def unfused_reason(config: Any) -> str | None:
    """Why the adjustment leaves `config`'s MLPs on Megatron-Core's unfused activation; None where it fuses them."""
    if not config.gated_linear_unit:
        return "gated_linear_unit is false: no gate to fuse"
    if config.activation_func is not F.silu:
        return f"activation_func is {_name(config.activation_func)}, not silu: only SwiGLU is fused here"
    if config.use_te_activation_func:
        return ("use_te_activation_func is true: Transformer Engine's activation module runs it (Megatron-Core "
                "refuses both, transformer_config.py:2140)")
    if config.glu_linear_offset != 0:
        return (f"glu_linear_offset is {config.glu_linear_offset}: Megatron-Core's fused SwiGLU has none "
                "(transformer_config.py:2134)")
    if config.activation_func_clamp_value is not None:
        return (f"activation_func_clamp_value is {config.activation_func_clamp_value}: Megatron-Core's fused SwiGLU "
                "ignores the clamp (mlp.py:308-316)")
    if config.activation_func_fp8_input_store:
        return "activation_func_fp8_input_store is true: the fused path would keep its input in FP8"
    return None


class FusedByDefault:
    """`TransformerConfig.bias_activation_fusion` while the adjustment is applied: the value a config was given
    (kept where dataclasses keep it, the instance's `__dict__`), or True where that is False and `unfused_reason` is
    None. The class itself reads its dataclass default."""

    def __init__(self, default: bool) -> None:
        self.default = default

    def __get__(self, config: Any, owner: type | None = None) -> bool:
        if config is None:
            return self.default
        given = config.__dict__.get(FIELD, self.default)
        return bool(given) or (not config.__dict__.get(_KEPT_AS_GIVEN, False) and unfused_reason(config) is None)

    def __set__(self, config: Any, value: bool) -> None:
        config.__dict__[FIELD] = value


_KEPT_AS_GIVEN = "_lightning_megatron_keeps_bias_activation_fusion"


def keep_as_given(model: torch.nn.Module) -> None:
    """Every config of `model`'s Megatron modules (the MoE experts' copies included) reads `bias_activation_fusion`
    as it was given, fused or not, from now on: for a model whose user set the field (`ModelOptions.
    config_overrides`), which a config's False could not otherwise tell from upstream's default."""
    from megatron.core.transformer.module import MegatronModule

    for module in model.modules():
        if isinstance(module, MegatronModule):
            module.config.__dict__[_KEPT_AS_GIVEN] = True


# the adjustment ---------------------------------------------------------------------------------------------------


OPT_IN = "LIGHTNING_MEGATRON_FAST_SWIGLU"
"""On by default (unset or 1); 0 keeps Megatron-Core's unfused SwiGLU. On an H200, forward + backward took 1.9-2.8x
less GPU time than upstream's unfused ops at the Qwen3-0.6B/4B/8B widths (`bench/results/h200_2026-12-06/
swiglu.json`)."""


def opted_in() -> bool:
    """`LIGHTNING_MEGATRON_FAST_SWIGLU`: unset or 1 applies the adjustment (where its condition holds), 0 leaves
    Megatron-Core's unfused SwiGLU, anything else is refused (`compiled.switched_on`)."""
    return compiled.switched_on(OPT_IN, "Megatron-Core's unfused SwiGLU",
                                "the MLPs' SwiGLU from compiled kernels on a GPU without Transformer Engine")


def upstream_runs_swiglu_unfused() -> bool:
    """Whether megatron-core still leaves the fusion off by default and `MLP.forward` still calls the fused SwiGLU
    by its module's name (where the replacement is found)."""
    from megatron.core.transformer import mlp
    from megatron.core.transformer.transformer_config import TransformerConfig

    default = next(field.default for field in dataclasses.fields(TransformerConfig) if field.name == FIELD)
    source = inspect.getsource(mlp.MLP.forward)
    return default is False and "bias_swiglu_impl(" in source and "weighted_bias_swiglu_impl(" in source


def _unfused_swiglu_is_slow_here() -> bool:
    return (opted_in() and torch.cuda.is_available() and no_transformer_engine() and triton_available()
            and upstream_runs_swiglu_unfused())


def _install_fast_swiglu(patches: Patches) -> None:
    from megatron.core.fusions import fused_bias_swiglu
    from megatron.core.transformer import mlp
    from megatron.core.transformer.moe import shared_experts
    from megatron.core.transformer.transformer_config import TransformerConfig

    upstream_impl = fused_bias_swiglu.bias_swiglu_impl
    upstream_weighted_impl = fused_bias_swiglu.weighted_bias_swiglu_impl

    def bias_swiglu_impl(input: torch.Tensor, bias: torch.Tensor | None, fp8_input_store: bool = False,
                         cpu_offload_input: bool = False) -> torch.Tensor:
        """Upstream's `bias_swiglu_impl` (same arguments, the result to the dtype's rounding) through
        `fused_or_unfused_swiglu`."""
        if fp8_input_store or cpu_offload_input:
            return upstream_impl(input, bias, fp8_input_store, cpu_offload_input)
        return fused_or_unfused_swiglu(input if bias is None else input + bias)

    def weighted_bias_swiglu_impl(input: torch.Tensor, bias: torch.Tensor | None, weights: torch.Tensor,
                                  fp8_input_store: bool = False) -> torch.Tensor:
        """Upstream's `weighted_bias_swiglu_impl` through `fused_or_unfused_swiglu`, a bias added first."""
        if fp8_input_store:
            return upstream_weighted_impl(input, bias, weights, fp8_input_store)
        return fused_or_unfused_swiglu(input if bias is None else input + bias, weights)

    patches.setattr(mlp, "bias_swiglu_impl", bias_swiglu_impl)
    patches.setattr(mlp, "weighted_bias_swiglu_impl", weighted_bias_swiglu_impl)
    patches.setattr(shared_experts, "bias_swiglu_impl", bias_swiglu_impl)
    patches.setattr(TransformerConfig, FIELD, FusedByDefault(TransformerConfig.__dict__[FIELD]))
    STATE.active = True
    patches.on_revert(STATE.deactivate)


ADJUSTMENTS = (
    Adjustment(
        "megatron_core.fast_swiglu",
        "megatron/core/transformer/transformer_config.py:482 leaves bias_activation_fusion off, so "
        "megatron/core/transformer/mlp.py:319-333 runs SwiGLU as chunk, SiLU, add and multiply (autograd's backward "
        "four more kernels) in every MLP; its fused path (mlp.py:276-316, fusions/fused_bias_swiglu.py:209-251) "
        "compiles at its first call (jit.py:20-21), inside a CUDA graph capture too",
        _unfused_swiglu_is_slow_here,
        _install_fast_swiglu,
    ),
)
