"""`megatron_core.fast_swiglu`: Megatron-Core's SwiGLU fused by default on CUDA, forward and backward from
`torch.compile`d functions. On the CPU: upstream still leaves the fusion off, the adjustment is not applied there
(nor where the switch is 0), and applied it fuses exactly the configs Megatron-Core accepts (the others say why),
keeps what a config was given, follows copies and field changes and is gone after a revert; a model built through
megatron-bridge fuses every MLP, the MTP layer's too; every CPU call is upstream's unfused SwiGLU bit for bit, dense,
weighted by routing probabilities and with a bias; the math the compiled functions are made from, eager and through
Inductor's CPU backend (once for every row count), equals autograd's gradient of the unfused ops within the bound of
their float32 arithmetic, under activation recompute too. On a GPU: bf16 within the derived bound of the exact
values (as upstream's unfused ops are) at the MLP widths of Qwen3-0.6B/4B/8B and a MoE expert's with probabilities,
fp32, one kernel each way, five kernels fewer an MLP, a call first met inside a CUDA graph capture eager there, and
tiny fits graphed and eager that train as with upstream's SwiGLU."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_megatron._compat import fast_swiglu
from lightning_megatron._compat.fast_swiglu import (
    COMPILED,
    EAGER,
    STATE,
    Kernels,
    swiglu,
    swiglu_forward,
    swiglu_grads,
    swiglu_input_grad,
    unfused_reason,
    unfused_swiglu,
)
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from tests._compat._compiled import (
    GRAPHED,
    applied,
    assert_trains_alike,
    fits_with_and_without,
    kernels_run,
    on_the_cpu,
)
from tests._distributed import run_in_fresh_process

ADJUSTMENT = fast_swiglu.ADJUSTMENTS[0]
U32, U16 = 2.0**-24, 2.0**-8  # float32's and bf16's unit roundoff
SLACK = 2.0**-20  # 16 u32: what float32 arithmetic adds, relatively to a result's magnitude (derived below)


def _config(**fields: Any) -> Any:
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=16, **fields)


SWIGLU = dict(gated_linear_unit=True, activation_func=F.silu)


@pytest.fixture
def fused_here(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The adjustment applied as a GPU machine applies it, and applied again after a `suspended()` block."""
    monkeypatch.setattr(ADJUSTMENT, "needed", lambda: True)
    with applied(ADJUSTMENT):
        yield


def test_upstream_still_runs_swiglu_unfused_unless_asked() -> None:
    """The condition's upstream check holds for the pinned Megatron-Core: a gated SiLU config reads unfused by
    default, and `MLP.forward` calls the fused functions by its module's names. An upgrade that fuses by default
    fails here first."""
    assert fast_swiglu.upstream_runs_swiglu_unfused()
    with ADJUSTMENT.suspended():
        assert _config(**SWIGLU).bias_activation_fusion is False


def test_the_cpu_keeps_upstreams_swiglu(process_group) -> None:
    from megatron.core.fusions import fused_bias_swiglu
    from megatron.core.transformer import mlp

    if torch.cuda.is_available():
        pytest.skip("the CPU's condition; the GPU tests below cover CUDA")
    assert not ADJUSTMENT.needed() and not ADJUSTMENT.active and not STATE.active
    assert _config(**SWIGLU).bias_activation_fusion is False
    assert mlp.bias_swiglu_impl is fused_bias_swiglu.bias_swiglu_impl


def test_the_switch_at_0_leaves_it_off_where_it_would_apply(monkeypatch) -> None:
    """CUDA and Triton as on the GPU machine: unset or 1 applies it, 0 does not."""
    assert fast_swiglu.upstream_runs_swiglu_unfused()  # megatron-core imported before CUDA is said to be there
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fast_swiglu, "triton_available", lambda: True)
    for value, needed in (("", True), ("1", True), ("0", False)):
        monkeypatch.setenv(fast_swiglu.OPT_IN, value)
        assert ADJUSTMENT.needed() is needed, value


REFUSED = {  # config fields: the start of why they keep the unfused activation
    "silu_without_gate": (dict(activation_func=F.silu), "gated_linear_unit is false"),
    "gelu": (dict(), "gated_linear_unit is false"),
    "geglu": (dict(gated_linear_unit=True, activation_func=F.gelu), "activation_func is gelu, not silu"),
    "quick_geglu": (dict(gated_linear_unit=True, activation_func="quick_gelu"), "activation_func is quick_gelu"),
    "te_activation": (dict(SWIGLU, use_te_activation_func=True), "use_te_activation_func is true"),
    "glu_linear_offset": (dict(SWIGLU, glu_linear_offset=1.0), "glu_linear_offset is 1.0"),
    "clamp": (dict(SWIGLU, activation_func_clamp_value=7.0), "activation_func_clamp_value is 7.0"),
    "fp8_input_store": (dict(SWIGLU, activation_func_fp8_input_store=True), "activation_func_fp8_input_store is true"),
}


@pytest.mark.parametrize("name", ["swiglu", *REFUSED])
def test_applied_it_fuses_the_configs_megatron_core_accepts_and_the_others_say_why(process_group, name) -> None:
    """A config built while applied: SwiGLU reads fused, and Megatron-Core's own validation (run at construction
    with the value it reads) accepts it; every other activation keeps upstream's unfused path with the reason.
    Nothing is stored: the config was given False, and reads it once reverted."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    fields, reason = (SWIGLU, None) if name == "swiglu" else REFUSED[name]
    if fields.get("activation_func") == "quick_gelu":
        fields = dict(fields, activation_func=quick_gelu)
    with applied(ADJUSTMENT):
        config = _config(**fields)
        assert config.bias_activation_fusion is (reason is None)
        assert unfused_reason(config) is None if reason is None else unfused_reason(config).startswith(reason)
    with ADJUSTMENT.suspended():
        assert config.bias_activation_fusion is False and config.__dict__["bias_activation_fusion"] is False


def test_a_config_keeps_what_it_was_given_follows_copies_and_changes_and_a_revert_ends_it(process_group,
                                                                                          monkeypatch) -> None:
    """Upstream's value is what a config was given: a bridge's True stays True (GeLU with a bias, upstream's bias-GeLU
    fusion), a config made before the adjustment reads fused while it is applied, a deep copy (the MoE experts')
    too, a field turned off afterwards (a vision tower's copy without the gate) reads unfused; the class reads its
    dataclass default; a suspension and a revert give every config its given value back."""
    from megatron.core.transformer import TransformerConfig

    with ADJUSTMENT.suspended():
        before = _config(**SWIGLU)
    monkeypatch.setattr(ADJUSTMENT, "needed", lambda: True)
    with applied(ADJUSTMENT):
        fused, given = _config(**SWIGLU), _config(activation_func=F.gelu, add_bias_linear=True,
                                                  bias_activation_fusion=True)
        copied = copy.deepcopy(fused)
        assert before.bias_activation_fusion and fused.bias_activation_fusion and copied.bias_activation_fusion
        assert given.bias_activation_fusion and TransformerConfig.bias_activation_fusion is False
        copied.gated_linear_unit = False
        assert not copied.bias_activation_fusion and fused.bias_activation_fusion
        with ADJUSTMENT.suspended():
            assert not fused.bias_activation_fusion and given.bias_activation_fusion
        assert fused.bias_activation_fusion
    with ADJUSTMENT.suspended():
        assert [config.bias_activation_fusion for config in (before, fused, copied, given)] == [False, False, False,
                                                                                                 True]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fast_swiglu") / "qwen3_mtp", "qwen3", mtp=True)


def _mlp_fusion(checkpoint: Path, **config_overrides: Any) -> list[bool]:
    """Whether each MLP of a tiny Qwen3 + MTP built through megatron-bridge (as a fit builds it) fuses its
    activation, the MTP layer's last."""
    from megatron.core.transformer.mlp import MLP

    from lightning_megatron.bridges import ModelOptions, create_bridge

    chunks = create_bridge("megatron-bridge", checkpoint).build(ModelOptions(mtp=True,
                                                                             config_overrides=config_overrides))
    return [module.config.bias_activation_fusion for chunk in chunks for module in chunk.modules()
            if isinstance(module, MLP)]


def test_a_megatron_bridge_model_fuses_every_mlp_the_mtp_layers_too_unless_its_user_says_no(model_parallel,
                                                                                              checkpoint,
                                                                                              fused_here) -> None:
    from megatron.core.transformer import mlp

    assert _mlp_fusion(checkpoint) == [True, True, True]  # two decoder layers, the MTP layer
    assert _mlp_fusion(checkpoint, bias_activation_fusion=False) == [False, False, False]  # the user's value
    assert mlp.bias_swiglu_impl.__module__ == fast_swiglu.__name__
    with ADJUSTMENT.suspended():
        assert _mlp_fusion(checkpoint) == [False, False, False]


def _mlp(config: Any) -> torch.nn.Module:
    """Megatron-Core's MLP as its local spec builds it (`get_mlp_module_spec(use_te=False)`)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    return MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
               ffn_hidden_size=config.ffn_hidden_size)


def _mlp_results(mlp: torch.nn.Module, hidden: torch.Tensor, probs: torch.Tensor | None,
                 grad: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """The MLP's output and every gradient: the input's, the probabilities', the parameters'."""
    mlp.zero_grad(set_to_none=True)
    hidden = hidden.detach().clone().requires_grad_()
    probs = None if probs is None else probs.detach().clone().requires_grad_()
    output, bias = mlp(hidden, per_token_scale=probs)
    (output if bias is None else output + bias).backward(grad)
    return {"output": output.detach(), "input": hidden.grad, "probs": None if probs is None else probs.grad,
            **{name: parameter.grad for name, parameter in mlp.named_parameters()}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["dense", "expert_with_probabilities", "bias"])
def test_applied_every_cpu_call_is_upstreams_unfused_swiglu_bit_for_bit(model_parallel, fused_here, dtype,
                                                                         case) -> None:
    """An MLP on the CPU with the adjustment applied (the config reads fused: `MLP.forward` takes its fused branch,
    the replaced functions) and suspended (upstream's unfused branch): the same output and gradients, bit for bit.
    The cases are the dense MLP (the MTP layer's too), a MoE expert of `SequentialMLP` (the routing probabilities
    as `per_token_scale`: upstream's weighted fusion) and fc1 with a bias (added first, as the unfused path does)."""
    generator = torch.Generator().manual_seed(0)
    mlp = _mlp(_config(**SWIGLU, add_bias_linear=case == "bias", params_dtype=dtype)).to(dtype)
    hidden = torch.randn(6, 8, generator=generator).to(dtype)
    probs = torch.rand(6, generator=generator) if case == "expert_with_probabilities" else None
    grad = torch.randn(6, 8, generator=generator).to(dtype)
    assert mlp.config.bias_activation_fusion
    fused = _mlp_results(mlp, hidden, probs, grad)
    with ADJUSTMENT.suspended():
        assert not mlp.config.bias_activation_fusion
        upstream = _mlp_results(mlp, hidden, probs, grad)
    assert fused.keys() == upstream.keys()
    for name, value in upstream.items():
        assert (fused[name] is None and value is None) or torch.equal(fused[name], value), name


# the math ---------------------------------------------------------------------------------------------------------
#
# Against autograd's gradient of the unfused ops in float32 (same formulas, other association and other SiLU,
# sigmoid and exp code). With a = gate, b = linear, d the output's gradient, w a row's weight, s = sigmoid(a),
# F = 1 + a (1 - s): exp(-a) is within (2 + |a|) u32 relatively (a correctly rounded exp within 1; one that
# exponentiates 2 to a log2(e) rounded, as GPUs' fast exp2 does, within |a| u32 more), so each side computes s within
# (4 + |a|) u32 (1 + e^-a and the reciprocal one rounding each) and silu(a) within (5 + |a|) u32. Each output term
# y = silu(a) b w is then within (7 + |a|) u32 of exact on each side, and the gradient by b, d w silu(a), too: the two
# sides within 16 (1 + |a|) u32 = SLACK (1 + |a|) of |y|. The gradient by a, d w b s F: the product of its factors
# within (8 + |a|) u32 |d w b s F|, and F itself within (4 |a| + 1) u32 + u32 |F| absolutely (1 - s within
# (4 + |a|) u32 s + u32 (1 - s), times a: |a|^2 s stays below 1 where s is not ~1); so each side within
# 8 (1 + |a|) u32 |d w b| s (|F| + |a| + 1), the two within SLACK of that magnitude, which bounds also where F cancels
# (a near -1.28, where SiLU is flat). The gradient by w, the sum over a row's n features of d silu(a) b: each term as
# y, and a float32 sum in any order within (n - 1) u32 of the sum of the magnitudes (Higham). A wrong formula (a
# missing factor, a swapped half) is off by the value itself.


def _magnitudes(x: torch.Tensor, weights: torch.Tensor | None, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    """The magnitudes the bounds above scale, (1 + |a|) included: the output's, the input gradient's ([gate |
    linear] halves), the weights gradient's (the sum of its terms'), in float64."""
    gate, linear = x.double().chunk(2, dim=-1)
    w = torch.ones(1, dtype=torch.float64, device=x.device) if weights is None else weights.double().abs()
    sigmoid = torch.sigmoid(gate)
    silu, scale = (gate * sigmoid).abs(), 1 + gate.abs()
    d = grad.double().abs() * w
    flat = (1 + gate * (1 - sigmoid)).abs() + gate.abs() + 1
    return {"output": scale * silu * linear.abs() * w,
            "input": scale.repeat(1, 2) * torch.cat((d * linear.abs() * sigmoid * flat, d * silu), dim=-1),
            "weights": (scale * grad.double().abs() * silu * linear.abs()).sum(-1, keepdim=True)}


def _results(apply: Callable[..., torch.Tensor], x: torch.Tensor, weights: torch.Tensor | None,
             weights_train: bool, grad: torch.Tensor) -> dict[str, torch.Tensor | None]:
    x = x.detach().clone().requires_grad_()
    weights = None if weights is None else weights.detach().clone().requires_grad_(weights_train)
    output = apply(x, weights)
    output.backward(grad)
    return {"output": output.detach(), "input": x.grad, "weights": None if weights is None else weights.grad}


def _assert_within_float32_bounds(got: dict[str, Any], expected: dict[str, Any], magnitudes: dict[str, Any],
                                  width: int, who: str) -> None:
    bounds = {"output": SLACK, "input": SLACK, "weights": SLACK + (width - 1) * U32}
    assert [name for name, value in got.items() if value is None] == [
        name for name, value in expected.items() if value is None], who
    for name, value in expected.items():
        if value is not None:
            error = (got[name].double() - value.double()).abs()
            assert bool((error <= bounds[name] * magnitudes[name]).all()), f"{who} {name}: {float(error.max()):.3e}"


WEIGHTS = {"none": (False, False), "probabilities": (True, True), "frozen_probabilities": (True, False)}


def _inputs(rows: int, width: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """fc1's output [rows, 2 width] spread wide (SiLU's saturated ends and its flat point near -1.28 both met),
    routing probabilities [rows, 1], the output's gradient."""
    x = torch.randn(rows, 2 * width, generator=generator) * 4
    return x, torch.rand(rows, 1, generator=generator), torch.randn(rows, width, generator=generator)


@pytest.mark.parametrize("weights_case", WEIGHTS)
def test_the_math_equals_autograds_unfused_gradient_in_float32(weights_case) -> None:
    """float32 on the CPU, the functions `torch.compile` wraps (`EAGER`): the forward is the unfused ops' bit for
    bit (the same two roundings); the gradients within the bounds above; the probabilities' gradient only where
    they want one."""
    with_weights, weights_train = WEIGHTS[weights_case]
    x, weights, grad = _inputs(24, 16, torch.Generator().manual_seed(0))
    weights = weights if with_weights else None
    got = _results(lambda t, w: swiglu(t, w, EAGER), x, weights, weights_train, grad)
    expected = _results(unfused_swiglu, x, weights, weights_train, grad)
    assert torch.equal(got["output"], expected["output"])
    _assert_within_float32_bounds(got, expected, _magnitudes(x, weights, grad), 16, weights_case)


def test_under_activation_recompute_the_gradients_are_the_same() -> None:
    """Activation checkpointing as Megatron-Core's `tensor_parallel.checkpoint` does it (reentrant: the forward
    without saving, then again in the backward; Megatron-Core's own needs CUDA's RNG state, so torch's reentrant
    one stands in here, Megatron-Core's on the GPU below): the same gradients, bit for bit."""
    from torch.utils.checkpoint import checkpoint

    x, weights, grad = _inputs(6, 8, torch.Generator().manual_seed(1))

    def recomputed(t: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        return checkpoint(lambda a, b: swiglu(a, b, EAGER), t, w, use_reentrant=True)

    got = _results(recomputed, x, weights, True, grad)
    expected = _results(lambda t, w: swiglu(t, w, EAGER), x, weights, True, grad)
    assert all(torch.equal(got[name], expected[name]) for name in expected)


_CpuKernel = on_the_cpu("SwiGLU")


def test_inductor_compiles_the_math_on_the_cpu_once_for_every_row_count() -> None:
    """A smoke test of the compiled path where no GPU is: Inductor's C++ backend compiles the forward and both
    gradients (without weights, and with trained probabilities), within the bounds above of autograd's unfused
    gradients; a second row count runs the same graphs."""
    kernels = Kernels(_CpuKernel(swiglu_forward), _CpuKernel(swiglu_input_grad), _CpuKernel(swiglu_grads))
    generator = torch.Generator().manual_seed(2)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for rows in (6, 9):
        x, weights, grad = _inputs(rows, 16, generator)
        for case in ("none", "probabilities"):
            w = weights if case == "probabilities" else None
            got = _results(lambda t, v: swiglu(t, v, kernels), x, w, True, grad)
            expected = _results(unfused_swiglu, x, w, True, grad)
            _assert_within_float32_bounds(got, expected, _magnitudes(x, w, grad), 16, f"{rows} rows {case}")
    assert _CpuKernel.state.refused is None and all(kernel.ran for kernel in vars(kernels).values())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 4  # forward twice, each gradient once


# the GPU ----------------------------------------------------------------------------------------------------------

TOKENS = 4096
WIDTHS = {"qwen3_0.6b": 3072, "qwen3_4b": 9728, "qwen3_8b": 12288}  # ffn_hidden_size
EXPERT = (2048, 768)  # Qwen3-30B-A3B: an expert's tokens of a 4096-token row (top 8 of 128, one hot expert), width


def _exact(x: torch.Tensor, weights: torch.Tensor | None, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    """The output and the gradients in float64 from the same values (the unfused ops on float64 copies)."""
    return _results(unfused_swiglu, x.double(), None if weights is None else weights.double(), True, grad.double())


def _assert_within_bf16_bounds(got: dict[str, Any], exact: dict[str, Any], magnitudes: dict[str, Any],
                               roundings: int, width: int, who: str) -> None:
    """bf16 results against float64: each bf16 rounding of a value (u16 of it; the compiled kernels round once, the
    unfused ops round SiLU, then the product: two, and with probabilities three: the bf16 product, then its
    product with the float32 probabilities cast back; their gradients as many), plus the float32 arithmetic's
    SLACK of the magnitudes above (bf16 inputs are exact in float32). The probabilities' gradient stays float32: the
    sum's (n - 1) u32 of its terms' magnitudes, and each term's roundings of the bf16 values it is made from."""
    for name, value in exact.items():
        if value is None:
            continue
        if name == "weights":
            bound = ((roundings - 1) * U16 + SLACK + (width - 1) * U32) * magnitudes[name]
        else:
            bound = roundings * (U16 + U16**2) * value.abs() + SLACK * magnitudes[name]
        error = (got[name].double() - value).abs()
        worst = int(torch.argmax(error - bound))
        assert bool((error <= bound).all()), (f"{who} {name}: error {error.flatten()[worst]:.3e} over its bound "
                                              f"{bound.flatten()[worst]:.3e}")


def _gpu_cases() -> dict[str, tuple[int, int, bool]]:
    """name: (rows, width, with probabilities): the dense MLPs over a 4096-token microbatch, a MoE expert."""
    return {**{name: (TOKENS, width, False) for name, width in WIDTHS.items()}, "qwen3_30b_a3b_expert": (*EXPERT, True)}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(_gpu_cases()))
def test_on_the_gpu_the_compiled_swiglu_is_within_bf16_rounding_as_upstreams(process_group, case) -> None:
    """bf16 fc1 outputs at each width: the compiled results (one rounding) and upstream's unfused ops (two, three
    with probabilities) each within their bound of the float64 values; a dense call runs one kernel forward and
    one backward; the compiled kernels ran (no refusal, no eager fallback)."""
    assert ADJUSTMENT.active, "on CUDA without Transformer Engine, with Triton, the adjustment applies"
    rows, width, with_weights = _gpu_cases()[case]
    generator = torch.Generator().manual_seed(0)
    x, weights, grad = (t.cuda() for t in _inputs(rows, width, generator))
    x, grad = x.to(torch.bfloat16), grad.to(torch.bfloat16)
    weights = weights if with_weights else None
    exact, magnitudes = _exact(x, weights, grad), _magnitudes(x, weights, grad)
    for who, apply, roundings in (("compiled", fast_swiglu.fused_or_unfused_swiglu, 1),
                                  ("upstream", unfused_swiglu, 2 + with_weights)):
        _assert_within_bf16_bounds(_results(apply, x, weights, True, grad), exact, magnitudes, roundings, width,
                                   f"{case} {who}")
    if not with_weights:
        t = x.detach().requires_grad_()
        output = swiglu(t)
        assert kernels_run(lambda: swiglu(t)) == 1
        assert kernels_run(lambda: output.backward(grad)) == 1
    assert STATE.refused is None and COMPILED.forward.ran and COMPILED.input_grad.ran
    assert COMPILED.grads.ran or not with_weights


@pytest.mark.gpu
def test_on_the_gpu_an_fp32_model_takes_the_compiled_swiglu_within_float32_rounding(process_group) -> None:
    x, weights, grad = (t.cuda() for t in _inputs(512, 256, torch.Generator().manual_seed(3)))
    assert fast_swiglu.takes_compiled_path(x, weights)
    for w in (None, weights):
        got = _results(fast_swiglu.fused_or_unfused_swiglu, x, w, True, grad)
        expected = _results(unfused_swiglu, x, w, True, grad)
        _assert_within_float32_bounds(got, expected, _magnitudes(x, w, grad), 256, "fp32")


@pytest.mark.gpu
def test_on_the_gpu_an_mlp_runs_five_kernels_fewer(model_parallel) -> None:
    """Megatron-Core's MLP in bf16 on CUDA, forward and backward: upstream's unfused SwiGLU runs SiLU, the add of
    `glu_linear_offset` and the product, then two products, SiLU's gradient and the chunk's concatenation (7
    kernels); fused, one each way. The GEMMs are the same."""
    mlp = _mlp(_config(**SWIGLU, params_dtype=torch.bfloat16)).to("cuda", torch.bfloat16)
    hidden = torch.randn(TOKENS, 8, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(TOKENS, 8, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        output, _ = mlp(hidden.requires_grad_())
        output.backward(grad)

    assert mlp.config.bias_activation_fusion
    step()  # compiles
    fused = kernels_run(step)
    with ADJUSTMENT.suspended():
        upstream = kernels_run(step)
    assert upstream - fused >= 5, (upstream, fused)


@pytest.mark.gpu
def test_on_the_gpu_under_activation_recompute_the_gradients_are_the_same(model_parallel) -> None:
    """The compiled kernels under Megatron-Core's activation checkpointing: the forward rerun in the backward, the
    same kernels, the same gradients bit for bit."""
    from megatron.core import tensor_parallel

    x, weights, grad = (t.cuda() for t in _inputs(TOKENS, 256, torch.Generator().manual_seed(4)))
    x, grad = x.to(torch.bfloat16), grad.to(torch.bfloat16)

    def recomputed(t: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        return tensor_parallel.checkpoint(fast_swiglu.fused_or_unfused_swiglu, False, t, w)

    expected = _results(fast_swiglu.fused_or_unfused_swiglu, x, weights, True, grad)
    got = _results(recomputed, x, weights, True, grad)
    assert all(torch.equal(got[name], expected[name]) for name in expected)


@pytest.mark.gpu
def test_on_the_gpu_a_swiglu_first_met_inside_a_capture_runs_eagerly_and_replays_right(process_group) -> None:
    """A width no call compiled yet, first met inside a CUDA graph capture (a layer a warm-up did not run): no
    compile there (it cannot run inside a capture); the replay computes the math within bf16 rounding; the first
    call after the capture compiles."""
    static = torch.randn(64, 2 * 48, device="cuda", dtype=torch.bfloat16)
    signatures = set(COMPILED.forward.ran)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        output = fast_swiglu.fused_or_unfused_swiglu(static)
    assert COMPILED.forward.ran == signatures
    static.copy_(torch.randn(64, 2 * 48, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    gate, linear = static.double().chunk(2, dim=-1)
    exact = F.silu(gate) * linear
    assert bool(((output.double() - exact).abs() <= (U16 + SLACK) * exact.abs()).all())
    with torch.no_grad():
        fast_swiglu.fused_or_unfused_swiglu(static)
    assert len(COMPILED.forward.ran) == len(signatures) + 1


# tiny models' fits ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", ["full_iteration", "none"], ids=["graphed", "eager"])
def test_on_the_gpu_tiny_fits_train_as_with_upstreams_swiglu(checkpoint, tmp_path, cuda_graph) -> None:
    """bf16 tiny Qwen3 + MTP at lr 1e-4, joint training through the whole-iteration graph (4 steps: warm-up,
    capture, 2 replays) and eagerly, with the fused SwiGLU and with upstream's: every MLP fused in the one and not in
    the other, every step's losses and grad norms within bf16's rounding, the graph captured alike."""
    fits = functools.partial(fits_with_and_without, cuda_graph=cuda_graph)
    results = run_in_fresh_process(fits, tmp_path, "fast_swiglu", str(tmp_path), str(checkpoint))
    forward, input_grad, grads = results["compiled_signatures"]
    assert results["active"] and results["refused"] is None and forward and input_grad and not grads
    compiled, upstream = results["compiled"], results["upstream"]
    assert compiled["mlp_fusion"] == [True] and upstream["mlp_fusion"] == [False]
    assert compiled["graph"] == upstream["graph"] == (GRAPHED if cuda_graph == "full_iteration" else None)
    assert_trains_alike(compiled["metrics"], upstream["metrics"], cuda_graph)
