"""`megatron_core.fast_cross_entropy`: Megatron-Core's fused ("native") vocabulary-parallel cross-entropy from three
`torch.compile`d passes on CUDA, the logits' gradient made in the forward. On the CPU: the adjustment is not applied
there, and applied it replaces the name the loss calls and leaves every CPU call upstream's; the math the compiled
functions are made from is `VocabParallelCrossEntropy`'s bit for bit in float32 and within the derived bound of
the exact values in bf16, as upstream's fused function is, at TP=1 and at TP=2 (targets on the other shard);
Inductor's CPU backend compiles it once for every row count. On a GPU: bf16 at Qwen3-0.6B's logits [4096, 151936]
within the bound, as upstream's, the chunked cross-entropy's fused path on the same kernels; a capture after a
warm-up replays right; a tiny fit through the whole-iteration graph trains as with upstream's cross-entropy."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_megatron._compat import compiled, fast_cross_entropy
from lightning_megatron._compat.fast_cross_entropy import (
    COMPILED,
    EAGER,
    STATE,
    Kernels,
    cross_entropy,
    logits_max,
    predicted_and_sum_exp,
    scale_rows,
    softmax_minus_one_hot,
)
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from tests._compat._compiled import GRAPHED, applied, assert_trains_alike, fits_with_and_without, kernels_run
from tests._distributed import run_distributed, run_in_fresh_process

ADJUSTMENT = fast_cross_entropy.ADJUSTMENTS[0]
U32, U16 = 2.0**-24, 2.0**-8  # float32's and bf16's unit roundoff

# The bounds, from the arithmetic. Every implementation computes S = sum_i exp(x_i - m) over the V logits of a row in
# float32 (m the row's max, so S >= 1): each term within ~2 u32 of exact (the float32 shift and exp), the sum in any
# order within (V - 1) u32 relatively (Higham, a sum of positive terms), so log S within delta_S = (V + 1) u32 of
# exact; the loss log S - (x_t - m) adds a rounding of each part and of the difference: |loss - exact| <=
# delta_S + 4 u32 (max|x| + |loss|), doubled for safety. The gradient w (exp(x_i - m) / S - [i = t]) shares S's
# error with the loss: relatively |loss - exact| + (2 max|x| + 8) u32 of |w softmax_i| in float32, plus each bf16
# rounding (u16 of the value: upstream's fused function rounds once, the gradient made in the forward twice, the
# difference, then the product with w); 2^-125 covers values below float32's normal range.
TINY = 2.0**-125


def _loss_bound(vocab: int, logits: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    largest = logits.detach().abs().max().double()
    return 2 * ((vocab + 1) * U32 + 4 * U32 * (largest + exact.abs()))


def _exact(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The float64 loss, gradient of (loss * weight).sum() and |weight softmax| of full-vocabulary logits."""
    x = logits.detach().double().reshape(-1, logits.shape[-1])
    softmax = torch.softmax(x, -1)
    rows, target_1d, weight_1d = torch.arange(x.shape[0]), target.reshape(-1), weight.double().reshape(-1, 1)
    loss = torch.logsumexp(x, -1) - x[rows, target_1d]
    one_hot = torch.zeros_like(x)
    one_hot[rows, target_1d] = 1.0
    return {"loss": loss.view_as(target), "grad": ((softmax - one_hot) * weight_1d).view_as(logits),
            "scale": (softmax * weight_1d.abs()).view_as(logits)}


def _assert_within_bounds(loss: torch.Tensor, grad: torch.Tensor, exact: dict[str, torch.Tensor],
                          logits: torch.Tensor, bf16_roundings: int, what: str) -> None:
    vocab = logits.shape[-1]  # the whole vocabulary's, whatever shard the gradient is of
    loss_error = (loss.double() - exact["loss"]).abs()
    assert bool((loss_error <= _loss_bound(vocab, logits, exact["loss"])).all()), (what, loss_error.max())
    largest = logits.detach().abs().max().double()
    float32_part = (loss_error.unsqueeze(-1) + (2 * largest + 8) * U32) * exact["scale"]
    bound = (bf16_roundings * U16 + U16**2) * exact["grad"].abs() + float32_part + TINY
    grad_error = (grad.double() - exact["grad"]).abs()
    assert bool((grad_error <= bound).all()), (what, grad_error.max())


def _upstream() -> Callable[..., torch.Tensor]:
    with ADJUSTMENT.suspended():
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    return fused_vocab_parallel_cross_entropy


def _plain(logits: torch.Tensor, target: torch.Tensor, tp_group: Any) -> torch.Tensor:
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits, target, tp_group=tp_group)


def _loss_and_grad(apply: Callable[..., torch.Tensor], logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor,
                   tp_group: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token loss and the gradient of (loss * weight).sum(); upstream's functions get a clone (they may
    overwrite fp32 logits)."""
    leaf = logits.detach().requires_grad_()
    loss = apply(leaf.clone(), target, tp_group)
    (grad,) = torch.autograd.grad((loss * weight).sum(), leaf)
    return loss.detach(), grad


def _inputs(tokens: int, batch: int, vocab: int, generator: torch.Generator, dtype: torch.dtype,
            device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits [s, b, vocab] of spread 3 (a softmax far from uniform), targets, a weight per token (a loss mask's)."""
    logits = (3 * torch.randn(tokens, batch, vocab, generator=generator)).to(device, dtype)
    target = torch.randint(0, vocab, (tokens, batch), generator=generator).to(device)
    return logits, target, torch.rand(tokens, batch, generator=generator).to(device)


def _eager(logits: torch.Tensor, target: torch.Tensor, tp_group: Any) -> torch.Tensor:
    return cross_entropy(logits, target, tp_group, EAGER)


def _tp_group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def test_the_cpu_keeps_upstreams_cross_entropy(process_group) -> None:
    if torch.cuda.is_available():
        pytest.skip("the CPU's condition; the GPU tests below cover CUDA")
    from megatron.core.models.common.language_module import language_module

    assert not ADJUSTMENT.needed() and not ADJUSTMENT.active and not STATE.active
    assert language_module.fused_vocab_parallel_cross_entropy is _upstream()


def test_upstream_is_still_the_native_fusion() -> None:
    """The condition's source check holds for the pinned Megatron-Core: an upgrade that changes the all-reduces, the
    gradient's dtype or how the loss finds the function fails here first."""
    assert fast_cross_entropy.upstream_is_the_native_fusion()


def test_applied_it_replaces_the_name_the_loss_calls_and_leaves_cpu_calls_upstreams(model_parallel) -> None:
    """`compute_language_model_loss` calls `language_module`'s name (bound by its import): the adjustment replaces
    it and the fusion module's; a CPU call still computes upstream's result bit for bit; a revert (here a suspension)
    puts upstream's function back in both places."""
    from megatron.core.fusions import fused_cross_entropy as fused
    from megatron.core.models.common.language_module import language_module

    upstream = _upstream()
    logits, target, weight = _inputs(5, 2, 64, torch.Generator().manual_seed(0), torch.bfloat16)
    expected = _loss_and_grad(upstream, logits, target, weight, _tp_group())
    with applied(ADJUSTMENT):
        replacement = language_module.fused_vocab_parallel_cross_entropy
        assert replacement is not upstream and fused.fused_vocab_parallel_cross_entropy is replacement
        got = _loss_and_grad(replacement, logits, target, weight, _tp_group())
        assert all(torch.equal(value, reference) for value, reference in zip(got, expected, strict=True))
        with ADJUSTMENT.suspended():
            assert language_module.fused_vocab_parallel_cross_entropy is upstream
            assert fused.fused_vocab_parallel_cross_entropy is upstream


def test_the_math_is_vocab_parallel_cross_entropys_in_float32(model_parallel) -> None:
    """float32, the functions `torch.compile` wraps (`EAGER`): the same operations as upstream's unfused steps, so
    loss and gradient are bit-identical to `vocab_parallel_cross_entropy`'s; upstream's fused function (its own
    compiled steps, a bf16 gradient) and ours are each within the bound of the exact values."""
    logits, target, weight = _inputs(7, 3, 500, torch.Generator().manual_seed(0), torch.float32)
    got = _loss_and_grad(_eager, logits, target, weight, _tp_group())
    plain = _loss_and_grad(_plain, logits, target, weight, _tp_group())
    assert got[1].dtype == torch.float32
    assert all(torch.equal(value, reference) for value, reference in zip(got, plain, strict=True))
    exact = _exact(logits, target, weight)
    _assert_within_bounds(*got, exact, logits, 0, "ours")
    _assert_within_bounds(*_loss_and_grad(_upstream(), logits, target, weight, _tp_group()), exact, logits, 1, "fused")


def test_in_bf16_the_math_is_within_rounding_as_megatron_cores_fused(model_parallel) -> None:
    """bf16 logits: ours (the gradient rounded in the forward, then its product with the weight) and upstream's
    fused function (rounded once) each within the bound of the exact values; the gradient in bf16."""
    logits, target, weight = _inputs(7, 3, 500, torch.Generator().manual_seed(1), torch.bfloat16)
    got = _loss_and_grad(_eager, logits, target, weight, _tp_group())
    fused = _loss_and_grad(_upstream(), logits, target, weight, _tp_group())
    assert got[1].dtype == fused[1].dtype == torch.bfloat16
    exact = _exact(logits, target, weight)
    _assert_within_bounds(*got, exact, logits, 2, "ours")
    _assert_within_bounds(*fused, exact, logits, 1, "fused")


def _tensor_parallel_case(rank: int, world_size: int) -> dict[str, Any]:
    """Each rank's half of the same logits (the targets on either half): our math against upstream's on the shard,
    and the shards' losses and gradients against the exact values of the whole vocabulary."""
    from lightning_megatron._compat import prepare_megatron_core

    prepare_megatron_core()
    group, vocab = dist.group.WORLD, 96
    shard = slice(rank * vocab // world_size, (rank + 1) * vocab // world_size)
    results: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits, target, weight = _inputs(6, 2, vocab, torch.Generator().manual_seed(0), dtype)
        local = logits[..., shard].contiguous()
        results[dtype] = {"ours": _loss_and_grad(_eager, local, target, weight, group),
                          "plain": _loss_and_grad(_plain, local, target, weight, group),
                          "fused": _loss_and_grad(_upstream(), local, target, weight, group),
                          "exact": _exact(logits, target, weight), "logits": logits, "shard": shard}
    return results


@pytest.mark.slow
def test_at_tensor_parallel_two_the_math_is_megatron_cores(tmp_path) -> None:
    """TP=2 over gloo, the vocabulary split in halves and targets on both: the max and the sums are all-reduced as
    upstream's are, so in float32 each shard's loss and gradient are `vocab_parallel_cross_entropy`'s bit for bit;
    in bf16, ours and the fused function's each within the bound of the whole vocabulary's exact values."""
    for rank, results in enumerate(run_distributed(_tensor_parallel_case, tmp_path)):
        for dtype, case in results.items():
            exact, shard = case["exact"], case["shard"]
            exact_shard = {"loss": exact["loss"], **{key: exact[key][..., shard] for key in ("grad", "scale")}}
            if dtype == torch.float32:
                assert all(torch.equal(value, reference)
                           for value, reference in zip(case["ours"], case["plain"], strict=True)), rank
            for name, roundings in (("ours", 0 if dtype == torch.float32 else 2), ("fused", 1)):
                _assert_within_bounds(*case[name], exact_shard, case["logits"], roundings, f"{rank} {dtype} {name}")


class _CpuKernel(compiled.CompiledKernel):
    """The compiled kernels on the CPU, with a state of their own: a failure here refuses nothing on the GPU."""

    state = compiled.State("cross-entropy on the CPU: torch.compile failed (%s)", logging.getLogger(__name__),
                           active=True)


def test_inductor_compiles_the_math_on_the_cpu_once_for_every_row_count(model_parallel) -> None:
    """A smoke test of the compiled path where no GPU is: Inductor's C++ backend compiles the three forward passes
    and the backward's scale, and their bf16 results are within the bound of the exact values, as the eager math's;
    a second row count runs the same graphs."""
    kernels = Kernels(_CpuKernel(logits_max), _CpuKernel(predicted_and_sum_exp), _CpuKernel(softmax_minus_one_hot),
                      _CpuKernel(scale_rows))
    generator = torch.Generator().manual_seed(0)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for tokens in (6, 9):
        logits, target, weight = _inputs(tokens, 2, 200, generator, torch.bfloat16)
        got = _loss_and_grad(lambda x, t, g: cross_entropy(x, t, g, kernels), logits, target, weight, _tp_group())
        _assert_within_bounds(*got, _exact(logits, target, weight), logits, 2, f"{tokens} rows")
    assert _CpuKernel.state.refused is None and all(kernel.ran for kernel in vars(kernels).values())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 4


def _scale_cases(rows: int, vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 gradient [rows, vocab] with a softmax's spread of magnitudes and a float32 incoming gradient per row
    [rows, 1] (a loss mask over a token count: values no bf16 holds exactly)."""
    generator = torch.Generator().manual_seed(rows)
    gradient = (torch.randn(rows, vocab, generator=generator) * torch.rand(rows, vocab, generator=generator) ** 8)
    row_grad = torch.rand(rows, 1, generator=generator) / 4093
    return gradient.to(device, torch.bfloat16), row_grad.to(device)


def test_the_compiled_backward_scale_is_eagers_bit_for_bit_in_place_on_the_cpu() -> None:
    """The backward's pass compiled by Inductor's C++ backend: each bf16 value is eager `mul_`'s (one rounding of the
    same float32 product), written into the gradient's own storage, for two row counts."""
    kernel = _CpuKernel(scale_rows)
    for rows in (5, 12):
        gradient, row_grad = _scale_cases(rows, 300, "cpu")
        expected = gradient.clone()
        expected.mul_(row_grad)
        storage = gradient.data_ptr()
        kernel(gradient, row_grad)
        assert gradient.data_ptr() == storage and torch.equal(gradient, expected), rows
    assert _CpuKernel.state.refused is None and kernel.ran


# the GPU ----------------------------------------------------------------------------------------------------------

TOKENS, VOCAB = 4096, 151936  # one packed row of Qwen3-0.6B's


@pytest.fixture(scope="module")
def nccl_group(process_group: None) -> Any:
    """A one-rank NCCL group, as a single-GPU run's tensor-parallel group: its all-reduces can be captured."""
    return dist.new_group([0], backend="nccl")


@pytest.mark.gpu
def test_on_the_gpu_the_compiled_cross_entropy_is_within_the_bound_as_upstreams(nccl_group) -> None:
    """bf16 logits [4096, 1, 151936] through the name the loss calls: ours and upstream's fused function each within
    the bound of the exact values; the chunked cross-entropy's fused path runs the same kernels (identical values);
    the compiled kernels ran (no refusal, no eager fallback)."""
    from megatron.core.models.common.language_module import language_module

    from lightning_megatron.mtp.chunked_cross_entropy import chunked_vocab_parallel_cross_entropy

    assert ADJUSTMENT.active, "on CUDA without Transformer Engine, with Triton, the adjustment applies"
    logits, target, weight = _inputs(TOKENS, 1, VOCAB, torch.Generator().manual_seed(0), torch.bfloat16, "cuda")
    got = _loss_and_grad(language_module.fused_vocab_parallel_cross_entropy, logits, target, weight, nccl_group)
    chunked = _loss_and_grad(lambda x, t, g: chunked_vocab_parallel_cross_entropy(x, t, g, fused=True), logits,
                             target, weight, nccl_group)
    assert all(torch.equal(value, reference) for value, reference in zip(chunked, got, strict=True))
    upstream = _loss_and_grad(_upstream(), logits, target, weight, nccl_group)
    exact = _exact(logits, target, weight)
    _assert_within_bounds(*got, exact, logits, 2, "ours")
    _assert_within_bounds(*upstream, exact, logits, 1, "upstream")
    assert STATE.refused is None and all(kernel.ran for kernel in vars(COMPILED).values())


@pytest.mark.gpu
def test_on_the_gpu_the_backward_scale_is_one_kernel_and_eagers_bit_for_bit() -> None:
    """At Qwen3-0.6B's logits [4096, 151936]: the compiled scale of the bf16 gradient by each row's float32
    incoming gradient runs one kernel, in place, and equals eager `mul_` bit for bit."""
    gradient, row_grad = _scale_cases(TOKENS, VOCAB, "cuda")
    expected = gradient.clone()
    expected.mul_(row_grad)
    COMPILED.scale_rows(gradient.clone(), row_grad)  # compiles
    storage = gradient.data_ptr()
    assert kernels_run(lambda: COMPILED.scale_rows(gradient, row_grad)) == 1
    assert gradient.data_ptr() == storage and torch.equal(gradient, expected)


@pytest.mark.gpu
def test_on_the_gpu_a_capture_after_a_warm_up_replays_right(nccl_group) -> None:
    """The loss and its gradient captured in a CUDA graph after an eager warm-up (which compiles): the capture runs
    the compiled kernels (no new signature), and a replay on new logits is within the bound of their exact values."""
    generator = torch.Generator().manual_seed(0)
    logits, target, weight = _inputs(256, 2, 4096, generator, torch.bfloat16, "cuda")
    static = logits.detach().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (cross_entropy(static, target, nccl_group) * weight).sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    signatures = [set(kernel.ran) for kernel in vars(COMPILED).values()]
    static.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = cross_entropy(static, target, nccl_group)
        (grad,) = torch.autograd.grad((loss * weight).sum(), static)
    assert [set(kernel.ran) for kernel in vars(COMPILED).values()] == signatures
    fresh = _inputs(256, 2, 4096, generator, torch.bfloat16, "cuda")[0]
    with torch.no_grad():
        static.copy_(fresh)
    graph.replay()
    _assert_within_bounds(loss, grad, _exact(fresh, target, weight), fresh, 2, "replayed")


# a tiny model's fit -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fast_cross_entropy") / "qwen3_mtp", "qwen3", mtp=True)


@pytest.mark.gpu
def test_on_the_gpu_a_tiny_fit_trains_as_with_upstreams_cross_entropy(checkpoint, tmp_path) -> None:
    """bf16 tiny Qwen3 + MTP at lr 1e-4 (megatron-bridge's native fused cross-entropy for both heads), joint training
    through the whole-iteration graph (4 steps: warm-up, capture, 2 replays), with the compiled cross-entropy and
    with upstream's: every step's losses and grad norms within bf16's rounding, the graph captured alike."""
    results = run_in_fresh_process(fits_with_and_without, tmp_path, "fast_cross_entropy", str(tmp_path), str(checkpoint))
    assert results["active"] and results["refused"] is None and all(results["compiled_signatures"])
    assert results["compiled"]["graph"] == results["upstream"]["graph"] == GRAPHED
    assert_trains_alike(results["compiled"]["metrics"], results["upstream"]["metrics"], "joint")
