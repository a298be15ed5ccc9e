"""`megatron_core.fast_rms_norm`: Megatron-Core's RMSNorms (torch's and the zero-centred one) with the forward and
both gradients from `torch.compile`d functions on CUDA. On the CPU: the adjustment is not applied there and the norm
stays torch's; the swapped class keeps torch's parameters, names, state dict and sequence-parallel marks; the math the
compiled functions are made from equals torch's norms in float32, forward and both gradients (a function that does
not compile is refused once: `test_compiled.py`). On a GPU: bf16 results equal to torch's norm within bf16's
rounding at Qwen3-0.6B/4B/8B's norm shapes (the key heads as the strided view of the fused QKV output Megatron-Core
hands over), a norm first met inside a CUDA graph capture runs eagerly there, and tiny fits (joint through the
whole-iteration graph, MTP-only through the frozen trunk's graphs) train as with torch's norms."""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_megatron._compat import fast_rms_norm
from lightning_megatron._compat.fast_rms_norm import (
    COMPILED,
    EAGER,
    FAST_CLASSES,
    STATE,
    FastRMSNorm,
    rms_norm,
)
from lightning_megatron._compat.gated_delta_net import ZeroCenteredRMSNorm
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from tests._compat._compiled import GRAPHED, applied, assert_trains_alike, joint_fit
from tests._distributed import run_in_fresh_process

ADJUSTMENT = fast_rms_norm.ADJUSTMENTS[0]
EPS = 1e-6


def _config(*, sequence_parallel: bool = False, zero_centered: bool = False) -> Any:
    from megatron.core.transformer import TransformerConfig

    config = copy.copy(TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                                         layernorm_zero_centered_gamma=zero_centered))
    config.sequence_parallel = sequence_parallel  # TransformerConfig refuses it at TP=1, where the norm only reads it
    return config


def test_the_cpu_keeps_torchs_norm(model_parallel) -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if torch.cuda.is_available():
        pytest.skip("the CPU's condition; the GPU tests below cover CUDA")
    assert not ADJUSTMENT.needed() and not ADJUSTMENT.active and not STATE.active
    assert type(WrappedTorchNorm(_config(), 8, eps=EPS)) is torch.nn.RMSNorm
    assert type(WrappedTorchNorm(_config(zero_centered=True), 8, eps=EPS)) is ZeroCenteredRMSNorm


@pytest.mark.parametrize("zero_centered", [False, True], ids=["rms_norm", "zero_centered"])
def test_the_swapped_norm_keeps_torchs_parameters_state_dict_and_marks(model_parallel, zero_centered) -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = _config(sequence_parallel=True, zero_centered=zero_centered)
    with ADJUSTMENT.suspended():
        upstream = WrappedTorchNorm(config, 8, eps=EPS)
    with applied(ADJUSTMENT):
        assert STATE.active
        norm = WrappedTorchNorm(config, 8, eps=EPS)
    assert type(norm) is FAST_CLASSES[type(upstream)] and isinstance(norm, type(upstream))
    assert [name for name, _ in norm.named_parameters()] == [name for name, _ in upstream.named_parameters()]
    assert norm.state_dict().keys() == upstream.state_dict().keys() == {"weight"}
    assert (norm.normalized_shape, norm.eps, norm.elementwise_affine) == (upstream.normalized_shape, EPS, True)
    assert norm.weight.sequence_parallel is upstream.weight.sequence_parallel is True
    assert torch.equal(norm.weight, upstream.weight)  # the same initial scale (ones, or zeros for 1 + weight)
    upstream.load_state_dict({"weight": torch.linspace(-0.5, 0.5, 8)})
    norm.load_state_dict(upstream.state_dict())  # a checkpoint of either loads into the other
    x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(norm(x), upstream(x))  # off CUDA (and once reverted) the forward is torch's
    if not torch.cuda.is_available():
        assert not STATE.active and type(WrappedTorchNorm(config, 8, eps=EPS)) is type(upstream)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fast_rms_norm") / "qwen3_mtp", "qwen3", mtp=True)


def _built_norms(checkpoint: Path) -> list[str]:
    """The norm classes of a tiny Qwen3 built as a fit builds it: `MegatronStrategy.setup_environment` runs
    `prepare_megatron_core()`, then the megatron-bridge backend builds the model."""
    from lightning_megatron._compat import prepare_megatron_core
    from lightning_megatron.bridges import ModelOptions, create_bridge

    prepare_megatron_core()
    chunks = create_bridge("megatron-bridge", checkpoint).build(ModelOptions())
    return sorted({type(module).__name__ for chunk in chunks for module in chunk.modules()
                   if isinstance(module, torch.nn.RMSNorm)})


def test_a_model_built_while_suspended_has_torchs_norms(model_parallel, checkpoint, monkeypatch) -> None:
    """The GPU fits' "torch" run: its condition holds (forced here, as on a GPU), so the `prepare_megatron_core()`
    of the strategy's setup inside `suspended()` would apply the adjustment again unless the suspension holds it."""
    monkeypatch.setattr(ADJUSTMENT, "needed", lambda: True)
    with applied(ADJUSTMENT):
        with ADJUSTMENT.suspended():
            assert _built_norms(checkpoint) == ["RMSNorm"] and not ADJUSTMENT.active and not STATE.active
        assert ADJUSTMENT.active and STATE.active
        assert _built_norms(checkpoint) == ["FastRMSNorm"]


def _key_heads(sequence: int, batch: int, groups: int, head_dim: int, generator: torch.Generator,
               dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """The key heads as Megatron-Core's attention hands them to `k_layernorm`: [s, b, groups, head_dim] split out
    of the fused QKV projection's output (2 query heads a group here), strided, not copied
    (megatron/core/transformer/attention.py `get_query_key_value_tensors`)."""
    mixed = torch.randn(sequence, batch, groups, 4 * head_dim, generator=generator).to(device, dtype)
    _, key, _ = torch.split(mixed, [2 * head_dim, head_dim, head_dim], dim=3)
    return key


def _inputs(layout: str, generator: torch.Generator) -> torch.Tensor:
    if layout == "hidden":
        return torch.randn(6, 2, 64, generator=generator)
    key = _key_heads(6, 2, 2, 16, generator)
    assert not key.is_contiguous() and key.reshape(-1, 16).data_ptr() == key.data_ptr()  # rows as a view
    return key


def _torch_norm(offset: float, width: int) -> torch.nn.Module:
    return torch.nn.RMSNorm(width, eps=EPS) if offset == 0 else ZeroCenteredRMSNorm(width, eps=EPS)


def _forward_and_grads(forward: Any, x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor,
                       input_trains: bool) -> dict[str, torch.Tensor | None]:
    x = x.detach().clone().requires_grad_(input_trains)
    output = forward(x)
    if output.requires_grad:
        output.backward(grad)
    return {"output": output.detach(), "input grad": x.grad, "weight grad": weight.grad}


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["rms_norm", "zero_centered"])
@pytest.mark.parametrize("layout", ["hidden", "key_heads"])
@pytest.mark.parametrize(("input_trains", "weight_trains"), [(True, True), (True, False), (False, True)],
                         ids=["both_train", "frozen_weight", "input_without_grad"])
def test_the_math_equals_torchs_norm_forward_and_gradients(offset, layout, input_trains, weight_trains) -> None:
    """float32 on the CPU, the functions `torch.compile` wraps (`EAGER`): the same formulas as torch's decomposition,
    a few float32 roundings (2^-24 each) over rows of 64 and sums of at most 24 rows apart, far below 1e-6 of each
    tensor's largest value."""
    generator = torch.Generator().manual_seed(0)
    x = _inputs(layout, generator)
    width = x.shape[-1]
    reference = _torch_norm(offset, width)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(width, generator=generator) * 0.3 + (1 - offset))
    reference.weight.requires_grad_(weight_trains)
    weight = reference.weight.detach().clone().requires_grad_(weight_trains)
    grad = torch.randn(x.shape, generator=generator)
    got = _forward_and_grads(lambda rows: rms_norm(rows, weight, EPS, offset, EAGER), x, weight, grad, input_trains)
    expected = _forward_and_grads(reference, x, reference.weight, grad, input_trains)
    assert [name for name, value in got.items() if value is None] == [
        name for name, value in expected.items() if value is None] == (
        [] if input_trains and weight_trains else ["weight grad"] if input_trains else ["input grad"])
    for name, value in expected.items():
        if value is not None:
            torch.testing.assert_close(got[name], value, rtol=1e-6, atol=1e-6 * float(value.abs().max()), msg=name)


# the GPU ----------------------------------------------------------------------------------------------------------

TOKENS = 4096
SHAPES = {  # hidden, query heads, key heads (all of head_dim 128)
    "qwen3_0.6b": (1024, 16, 8),
    "qwen3_4b": (2560, 32, 8),
    "qwen3_8b": (4096, 32, 8),
}
HEAD_DIM = 128


def _float64_reference(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, offset: float) -> dict[str, Any]:
    """The norm, its gradients and the magnitudes their float32 rounding scales with, in float64 from the same
    bf16 values, over rows [M, N]."""
    rows, weight, grad = (t.double() for t in (x.reshape(-1, x.shape[-1]), weight, grad.reshape(-1, x.shape[-1])))
    rstd = torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + EPS)
    normed = rows * rstd
    grad_normed = grad * (weight + offset)
    products = normed * grad_normed
    return {"output": normed * (weight + offset),
            "input grad": (grad_normed - normed * products.mean(-1, keepdim=True)) * rstd,
            "weight grad": (grad * normed).sum(0),
            "input grad scale": rstd * (grad_normed.abs() + normed.abs() * products.abs().mean(-1, keepdim=True)),
            "weight grad scale": (grad * normed).abs().sum(0)}


def _assert_within_bf16_rounding(got: dict[str, torch.Tensor], reference: dict[str, Any], who: str) -> None:
    """bf16 results of float32 math against float64: each value rounded to bf16 once (unit roundoff u = 2^-8, so
    at most 2^-8 of its magnitude), plus float32's own error: in the output a few roundings (2^-24) and the mean of
    N squares (at most N 2^-24 relative: 2^-12 at N = 4096); in the input gradient a difference that can cancel,
    bounded by its terms' magnitudes times N 2^-23; in the weight gradient a sum over M rows, within the
    probabilistic bound of a float32 sum, 2 sqrt(M) 2^-24 times the sum of the magnitudes (Higham & Mary, 2019;
    the worst case M 2^-24 would exceed the value itself at M = 131072). A wrong formula (a missing scale, a
    dropped term) is off by the value's own size."""
    rows, width = reference["output"].shape
    u = 2.0**-8
    bounds = {
        "output": (u + width * 2.0**-24) * reference["output"].abs(),
        "input grad": u * reference["input grad"].abs() + width * 2.0**-23 * reference["input grad scale"],
        "weight grad": u * reference["weight grad"].abs() + 2 * rows**0.5 * 2.0**-24 * reference["weight grad scale"],
    }
    for name, bound in bounds.items():
        error = (got[name].double().reshape(bound.shape) - reference[name]).abs()
        worst = int(torch.argmax(error - bound))
        assert bool((error <= bound).all()), (f"{who} {name}: error {error.flatten()[worst]:.3e} over its bound "
                                              f"{bound.flatten()[worst]:.3e}")


def _norm_pair(width: int, zero_centered: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The norm Megatron-Core builds (`WrappedTorchNorm`) with the adjustment and without it, same weight, bf16."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = _config(zero_centered=zero_centered)
    with ADJUSTMENT.suspended():
        upstream = WrappedTorchNorm(config, width, eps=EPS).to("cuda", torch.bfloat16)
    fast = WrappedTorchNorm(config, width, eps=EPS).to("cuda", torch.bfloat16)
    with torch.no_grad():
        upstream.weight.copy_(torch.linspace(0.5, 1.5, width) - float(zero_centered))
        fast.weight.copy_(upstream.weight)
    return fast, upstream


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_on_the_gpu_the_compiled_norms_equal_torchs_within_bf16_rounding(model_parallel, shape) -> None:
    """Each of a layer's norms at the model's shape over 4096 tokens: the hidden state's, the query heads' and the
    key heads' (the strided view of the fused QKV output), both the compiled and torch's within the bound above of
    the float64 reference, and the compiled one under inference mode too; the compiled kernels ran (no refusal, no
    eager fallback)."""
    assert ADJUSTMENT.active, "on CUDA without Transformer Engine, with Triton, the adjustment applies"
    hidden, heads, groups = SHAPES[shape]
    generator = torch.Generator().manual_seed(0)
    mixed = torch.randn(TOKENS, 1, groups, (heads // groups + 2) * HEAD_DIM, generator=generator)
    mixed = mixed.to("cuda", torch.bfloat16)
    query, key, _ = torch.split(mixed, [heads // groups * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=3)
    inputs = {"hidden": torch.randn(TOKENS, 1, hidden, generator=generator).to("cuda", torch.bfloat16),
              "query heads": query.reshape(TOKENS, 1, heads, HEAD_DIM), "key heads": key}
    for name, x in inputs.items():
        fast, upstream = _norm_pair(x.shape[-1], zero_centered=False)
        assert type(fast) is FastRMSNorm and type(upstream) is torch.nn.RMSNorm
        grad = torch.randn(x.shape, generator=generator).to("cuda", torch.bfloat16)
        reference = _float64_reference(x, upstream.weight, grad, offset=0.0)
        for who, norm in (("compiled", fast), ("torch", upstream)):
            results = _forward_and_grads(norm, x, norm.weight, grad, input_trains=True)
            _assert_within_bf16_rounding(results, reference, f"{shape} {name} {who}")
        with torch.inference_mode():  # validation's mode (a graph of its own): torch's output to one bf16 step
            torch.testing.assert_close(fast(x), results["output"], rtol=2**-7, atol=0)
    assert STATE.refused is None
    assert all(kernel.ran for kernel in (COMPILED.forward, COMPILED.input_grad, COMPILED.weight_grad))


@pytest.mark.gpu
def test_on_the_gpu_the_zero_centered_norm_equals_its_eager_self_within_bf16_rounding(model_parallel) -> None:
    """Qwen3.5's `1 + weight` norm (hidden 2048): compiled, and upstream's eager `ZeroCenteredRMSNorm`."""
    x = torch.randn(TOKENS, 1, 2048, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
    fast, upstream = _norm_pair(2048, zero_centered=True)
    assert type(fast) is fast_rms_norm.FastZeroCenteredRMSNorm and type(upstream) is ZeroCenteredRMSNorm
    reference = _float64_reference(x, upstream.weight, grad, offset=1.0)
    for who, norm in (("compiled", fast), ("eager", upstream)):
        _assert_within_bf16_rounding(_forward_and_grads(norm, x, norm.weight, grad, input_trains=True), reference,
                                     f"zero-centred {who}")


@pytest.mark.gpu
def test_on_the_gpu_a_norm_first_met_inside_a_capture_runs_eagerly_and_replays_right(model_parallel) -> None:
    """A width no call compiled yet, first met inside a CUDA graph capture: no compile there (it cannot run inside a
    capture); the replay computes what torch's norm does; the first call after the capture compiles."""
    width = 96
    fast, upstream = _norm_pair(width, zero_centered=False)
    static = torch.randn(64, width, device="cuda", dtype=torch.bfloat16)
    signatures = set(COMPILED.forward.ran)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        output = fast(static)
    assert COMPILED.forward.ran == signatures
    static.copy_(torch.randn(64, width, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    with torch.no_grad():  # two bf16 roundings of float32 values a few float32 steps apart: one bf16 step at most
        torch.testing.assert_close(output, upstream(static), rtol=2**-7, atol=0)
        fast(static)
    assert len(COMPILED.forward.ran) == len(signatures) + 1


# a tiny model's fits ------------------------------------------------------------------------------------------------

def _gpu_fits(root: str, checkpoint: str, out: str) -> None:
    """In a fresh process (NCCL, as a real single-GPU run): each fit with the compiled norms, then with torch's."""
    from lightning_megatron.distributed import free_port, init_single_process
    from tests.mtp.test_trunk_cache import _fit

    os.environ["MASTER_PORT"] = str(free_port())
    init_single_process()
    results: dict[str, Any] = {"active": ADJUSTMENT.active}
    for norms in ("compiled", "torch"):
        with contextlib.nullcontext() if norms == "compiled" else ADJUSTMENT.suspended():
            results[f"joint_{norms}"] = joint_fit(Path(root) / f"joint_{norms}", checkpoint)
            mtp_only = _fit(Path(root) / f"mtp_only_{norms}", Path(checkpoint), cache=None, epochs=1,
                            accelerator="gpu", precision="bf16", cuda_graph_trunk=True, module_kwargs={"lr": 1e-4})
            results[f"mtp_only_{norms}"] = {key: mtp_only[key] for key in ("metrics", "steps", "graphs")}
    results["refused"] = STATE.refused
    results["compiled_signatures"] = [len(kernel.ran) for kernel in (COMPILED.forward, COMPILED.input_grad,
                                                                     COMPILED.weight_grad)]
    torch.save(results, out)


@pytest.mark.gpu
def test_on_the_gpu_tiny_fits_train_as_with_torchs_norms(checkpoint, tmp_path) -> None:
    """bf16 tiny Qwen3 + MTP at lr 1e-4: joint training through the whole-iteration graph (4 steps: warm-up,
    capture, 2 replays) and an epoch of MTP-only training through the frozen trunk's graphs (8 steps), with the
    compiled norms and with torch's: every step's losses and grad norms within bf16's rounding, the graphs captured
    alike."""
    results = run_in_fresh_process(_gpu_fits, tmp_path, str(tmp_path), str(checkpoint))
    assert results["active"] and results["refused"] is None and all(results["compiled_signatures"])
    compiled, upstream = results["joint_compiled"], results["joint_torch"]
    assert compiled["norms"] == ["FastRMSNorm"] and upstream["norms"] == ["RMSNorm"]
    assert compiled["graph"] == upstream["graph"] == GRAPHED
    for run in ("joint", "mtp_only"):
        assert_trains_alike(results[f"{run}_compiled"]["metrics"], results[f"{run}_torch"]["metrics"], run)
    assert results["mtp_only_compiled"]["graphs"] == results["mtp_only_torch"]["graphs"]
    assert results["mtp_only_compiled"]["graphs"][0]["captures"] == 1
