"""`megatron_core.fast_rope`: Megatron-Core's unfused RoPE with the forward and the gradient from `torch.compile`d
functions on CUDA. On the CPU: the adjustment is not applied there, and applied it leaves every CPU call upstream's;
the math the compiled functions are made from is upstream's bit for bit in float32, forward and gradient, for the
query heads and the key heads' strided view, partial rotary and `mscale`, and for packed rows through `packed_rope`;
Inductor's CPU backend compiles it into kernels that compute it, once for every row count. On a GPU: bf16 results
within the derived bound of the float64 reference, as upstream's are, at Qwen3-0.6B/8B's query and key shapes
(partial rotary, `mscale` and a packed row too), one kernel forward and one backward; calls upstream's alone
handles run upstream's code; a call first met inside a CUDA graph capture runs eagerly there; a tiny fit through the
whole-iteration graph trains as with upstream's RoPE."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_megatron._compat import compiled, fast_rope, packed_rope
from lightning_megatron._compat.fast_rope import COMPILED, EAGER, STATE, Kernels, rope, rope_backward, rope_forward
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from tests._compat._compiled import GRAPHED, applied, assert_trains_alike, fits_with_and_without, kernels_run
from tests._compat.test_packed import _CpGroup
from tests._distributed import run_in_fresh_process

ADJUSTMENT = fast_rope.ADJUSTMENTS[0]
THETA = 1e6  # Qwen3's rope_theta


def _rope_utils() -> Any:
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils


def _upstream() -> Callable[..., torch.Tensor]:
    with ADJUSTMENT.suspended():
        return _rope_utils()._apply_rotary_pos_emb_bshd


def _freqs(tokens: int, rot_dim: int, device: str = "cpu") -> torch.Tensor:
    """Megatron's RoPE table [tokens, 1, 1, rot_dim] (`RotaryEmbedding`: each position times the inverse
    frequencies, twice), float32."""
    inverse = 1.0 / THETA ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    angles = torch.outer(torch.arange(tokens, dtype=torch.float32), inverse)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :].to(device)


def _any_freqs(tokens: int, rot_dim: int, generator: torch.Generator) -> torch.Tensor:
    """Angles up to 100 radians [tokens, 1, 1, rot_dim] whose halves differ (Megatron's table repeats its angles,
    which would hide a mixed-up half)."""
    return torch.rand(tokens, 1, 1, rot_dim, generator=generator) * 100


def _heads(tokens: int, groups: int, per_group: int, head_dim: int, generator: torch.Generator,
           dtype: torch.dtype = torch.float32, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The query and key heads as Megatron-Core's attention hands them to RoPE without q/k norms
    (attention.py `get_query_key_value_tensors`): [s, 1, heads, head_dim] split out of the fused QKV projection's
    output, the queries reshaped (a copy), the keys a strided view."""
    mixed = torch.randn(tokens, 1, groups, (per_group + 2) * head_dim, generator=generator).to(device, dtype)
    query, key, _ = torch.split(mixed, [per_group * head_dim, head_dim, head_dim], dim=3)
    return {"query": query.reshape(tokens, 1, groups * per_group, head_dim), "key": key}


def _pair_magnitude(x: torch.Tensor, rot_dim: int, mscale: float) -> torch.Tensor:
    """Per feature, mscale (|x1| + |x2|) of its rotated pair: the most |x1 cos| + |x2 sin| can be; 0 where passed."""
    x = x.double().abs()
    pair = (x[..., :rot_dim // 2] + x[..., rot_dim // 2:rot_dim]) * mscale
    return torch.cat((pair, pair, torch.zeros_like(x[..., rot_dim:])), dim=-1)


def _output_and_grad(apply: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor,
                     grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = t.detach().requires_grad_()  # the same strides: a view stays a view
    output = apply(t)
    output.backward(grad)
    return output.detach(), t.grad


def test_the_cpu_keeps_upstreams_rope(process_group) -> None:
    if torch.cuda.is_available():
        pytest.skip("the CPU's condition; the GPU tests below cover CUDA")
    assert not ADJUSTMENT.needed() and not ADJUSTMENT.active and not STATE.active
    assert _rope_utils()._apply_rotary_pos_emb_bshd is _upstream()


def test_upstream_still_rotates_half_unfused() -> None:
    """The condition's source check holds for the pinned Megatron-Core: an upgrade that changes the math fails here
    first."""
    assert fast_rope._rotates_half_unfused()


OPTIONS = [dict(), dict(mscale=0.7), dict(rotary_interleaved=True), dict(mla_rotary_interleaved=True, mscale=1.3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_applied_it_leaves_every_cpu_call_upstreams(process_group, dtype) -> None:
    """The module's function is replaced (`apply_rotary_pos_emb` and `packed_rope` find it there), every CPU call
    still computes upstream's result bit for bit, and a revert (here a suspension) puts upstream's function back."""
    upstream = _upstream()
    t = _heads(6, 2, 2, 16, torch.Generator().manual_seed(0), dtype)["key"]
    with applied(ADJUSTMENT):
        assert ADJUSTMENT.active and STATE.compiles
        replacement = _rope_utils()._apply_rotary_pos_emb_bshd
        assert replacement is not upstream
        for options in OPTIONS:
            for rot_dim in (16, 8):
                expected = upstream(t, _freqs(6, rot_dim), **options)
                assert torch.equal(replacement(t, _freqs(6, rot_dim), **options), expected), (options, rot_dim)
    with ADJUSTMENT.suspended():
        assert _rope_utils()._apply_rotary_pos_emb_bshd is upstream and not STATE.active


@pytest.mark.parametrize("mscale", [1.0, 0.7])
@pytest.mark.parametrize("rot_dim", [16, 8], ids=["full", "partial"])
@pytest.mark.parametrize("heads", ["query", "key"])
def test_the_math_is_upstreams_in_float32(heads, rot_dim, mscale) -> None:
    """float32 on the CPU, the functions `torch.compile` wraps (`EAGER`): the same products and sums as upstream's
    (x1 c1 - x2 s1 is x1 c1 + (-x2) s1 exactly; the gradient's halves accumulate as autograd does upstream's), so
    the output and the gradient are bit-identical; the passed-through features are copied, their gradient too."""
    generator = torch.Generator().manual_seed(0)
    t = _heads(6, 2, 2, 16, generator)[heads]
    freqs, grad = _any_freqs(6, rot_dim, generator), torch.randn(6, 1, t.shape[2], 16, generator=generator)
    got = _output_and_grad(lambda x: rope(x, freqs, mscale, EAGER), t, grad)
    expected = _output_and_grad(lambda x: _upstream()(x, freqs, mscale=mscale), t, grad)
    for name, value, reference in zip(("output", "grad"), got, expected, strict=True):
        assert value.dtype == reference.dtype and torch.equal(value, reference), name


@pytest.mark.parametrize(("cp_size", "cp_rank"), [(1, 0), (2, 1)])
def test_packed_rows_through_the_math_are_upstreams(process_group, monkeypatch, cp_size, cp_rank) -> None:
    """`packed_rope` applies RoPE to the whole row [t, 1, heads, dim] with the freqs gathered per token, through
    whatever `_apply_rotary_pos_emb_bshd` the module holds: with the math there (what the adjustment installs on
    CUDA), float32 results bit-identical to upstream's."""
    lengths = [8, 4, 12, 20, 4]
    generator = torch.Generator().manual_seed(0)
    t = torch.randn(sum(lengths) // cp_size, 3, 16, generator=generator)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    freqs, grad = _any_freqs(max(lengths), 8, generator), torch.randn(t.shape, generator=generator)

    def packed(x: torch.Tensor) -> torch.Tensor:
        return packed_rope.apply_rotary_pos_emb_thd(x, cu_seqlens, freqs, cp_group=_CpGroup(cp_size, cp_rank),
                                                    mscale=0.7)

    expected = _output_and_grad(packed, t, grad)

    def math(x: torch.Tensor, table: torch.Tensor, rotary_interleaved: bool, mla_rotary_interleaved: bool,
             mscale: float) -> torch.Tensor:
        assert not rotary_interleaved and not mla_rotary_interleaved and x.shape[1] == table.shape[1] == 1
        return rope(x, table, mscale, EAGER)

    monkeypatch.setattr(_rope_utils(), "_apply_rotary_pos_emb_bshd", math)
    for name, value, reference in zip(("output", "grad"), _output_and_grad(packed, t, grad), expected, strict=True):
        assert torch.equal(value, reference), name


class _CpuKernel(compiled.CompiledKernel):
    """The compiled kernels on the CPU, with a state of their own: a failure here refuses nothing on the GPU."""

    state = compiled.State("RoPE on the CPU: torch.compile failed (%s)", logging.getLogger(__name__), active=True)


@pytest.mark.parametrize("rot_dim", [16, 8], ids=["full", "partial"])
def test_inductor_compiles_the_math_on_the_cpu_once_for_every_row_count(process_group, rot_dim) -> None:
    """A smoke test of the compiled path where no GPU is: Inductor's C++ backend compiles both functions for the key
    heads' strided view with `mscale`, and their float32 results are upstream's within a few float32 roundings
    (2^-24 each) of each feature pair's magnitude (|x1| + |x2|) mscale, the passed-through features exactly; a
    second row count runs the same graphs."""
    kernels = Kernels(_CpuKernel(rope_forward), _CpuKernel(rope_backward))
    generator = torch.Generator().manual_seed(0)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for tokens in (6, 9):
        t = _heads(tokens, 2, 2, 16, generator)["key"]
        freqs, grad = _any_freqs(tokens, rot_dim, generator), torch.randn(tokens, 1, 2, 16, generator=generator)
        got = _output_and_grad(lambda x: rope(x, freqs, 0.7, kernels), t, grad)
        expected = _output_and_grad(lambda x: _upstream()(x, freqs, mscale=0.7), t, grad)
        for name, value, reference, x in zip(("output", "grad"), got, expected, (t, grad), strict=True):
            bound = 2.0**-20 * _pair_magnitude(x, rot_dim, 0.7)
            assert bool(((value.double() - reference.double()).abs() <= bound).all()), (tokens, name)
    assert _CpuKernel.state.refused is None and kernels.forward.ran and kernels.backward.ran
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 2


# the GPU ----------------------------------------------------------------------------------------------------------

TOKENS, HEAD_DIM = 4096, 128
SHAPES = {"qwen3_0.6b": (16, 8), "qwen3_8b": (32, 8)}  # query heads, key heads (head_dim 128)


def _assert_within_bf16_rounding(got: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, rounds: str,
                                 who: str) -> None:
    """bf16 results against float64 (unit roundoff u = 2^-8). The compiled kernels compute in float32 and round once:
    u |exact|, plus float32's cos, sin and products, 2^-20 of the pair's magnitude m (a cos or sin of float32 is off
    by a few 2^-24). Upstream rounds cos and sin, both products and their sum: u |exact| + (2u + 4u^2) m, the
    same 2^-20 m besides; the two results are thus within the sum of both bounds of each other. The passed-through
    features are exact in both. A wrong sign, half or scale is off by about m."""
    u = 2.0**-8
    slack = {"once": 2.0**-20, "upstream": 2 * u + 4 * u**2 + 2.0**-20}[rounds]
    bound = u * exact.abs() + slack * magnitude
    error = (got.double() - exact).abs()
    worst = int(torch.argmax(error - bound))
    assert bool((error <= bound).all()), (f"{who}: error {error.flatten()[worst]:.3e} over its bound "
                                          f"{bound.flatten()[worst]:.3e}")


Case = tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor], float]


def _gpu_cases(shape: str, generator: torch.Generator) -> dict[str, Case]:
    """name: (t, freqs, apply(t, freqs, mscale), mscale) at the model's shape over 4096 tokens, bf16: the query and
    key heads, and at 0.6B partial rotary (GLM-4.5's half), a YaRN-like mscale and a packed row of the key heads."""
    rope_utils = _rope_utils()
    heads, groups = SHAPES[shape]
    inputs = _heads(TOKENS, groups, heads // groups, HEAD_DIM, generator, torch.bfloat16, "cuda")
    freqs = _freqs(TOKENS, HEAD_DIM, "cuda")

    def bshd(t: torch.Tensor, table: torch.Tensor, mscale: float) -> torch.Tensor:
        return rope_utils._apply_rotary_pos_emb_bshd(t, table, mscale=mscale)  # the module's, at call time

    cases = {name: (t, freqs, bshd, 1.0) for name, t in inputs.items()}
    if shape == "qwen3_0.6b":
        cu_seqlens = torch.tensor([0, 1000, 3000, 3001, TOKENS], dtype=torch.int32, device="cuda")

        def packed(t: torch.Tensor, table: torch.Tensor, mscale: float) -> torch.Tensor:
            return packed_rope.apply_rotary_pos_emb_thd(t, cu_seqlens, table, cp_group=_CpGroup(1, 0), mscale=mscale)

        cases |= {"key partial": (inputs["key"], _freqs(TOKENS, HEAD_DIM // 2, "cuda"), bshd, 1.0),
                  "query mscale": (inputs["query"], freqs, bshd, 1.2),
                  "packed key": (inputs["key"].squeeze(1), freqs, packed, 1.0)}
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_on_the_gpu_the_compiled_rope_is_within_bf16_rounding_as_upstreams(process_group, shape) -> None:
    """Each case, forward and gradient: the compiled results and upstream's each within their bound of the float64
    reference (upstream's function on float64 copies); a full-rotary call runs one kernel forward and one backward;
    the compiled kernels ran (no refusal, no eager fallback)."""
    assert ADJUSTMENT.active, "on CUDA without Transformer Engine, with Triton, the adjustment applies"
    generator = torch.Generator().manual_seed(0)
    for name, (t, freqs, apply, mscale) in _gpu_cases(shape, generator).items():
        grad = torch.randn(t.shape, generator=generator).to("cuda", torch.bfloat16)
        rot_dim = freqs.shape[-1]
        got = _output_and_grad(lambda x: apply(x, freqs, mscale), t, grad)
        with ADJUSTMENT.suspended():
            upstream = _output_and_grad(lambda x: apply(x, freqs, mscale), t, grad)
            exact = _output_and_grad(lambda x: apply(x, freqs.double(), mscale), t.double(), grad.double())
        for index, what in enumerate(("output", "grad")):
            magnitude = _pair_magnitude((t, grad)[index], rot_dim, mscale)
            _assert_within_bf16_rounding(got[index], exact[index], magnitude, "once", f"{shape} {name} {what}")
            _assert_within_bf16_rounding(upstream[index], exact[index], magnitude, "upstream",
                                         f"{shape} {name} {what} upstream")
        if rot_dim == HEAD_DIM and name != "packed key":
            x = t.detach().requires_grad_()
            output = apply(x, freqs, mscale)
            assert kernels_run(lambda: apply(x, freqs, mscale)) == 1
            assert kernels_run(lambda: output.backward(grad)) == 1
    assert STATE.refused is None and COMPILED.forward.ran and COMPILED.backward.ran


@pytest.mark.gpu
def test_on_the_gpu_calls_only_upstream_handles_run_upstreams_code(process_group) -> None:
    """Interleaved rotary, Qwen3-VL's per-row freqs [s, b, 1, dim], freqs with a gradient, float64 and a tensor
    mscale: bit-identical to upstream's function, nothing compiled for them. A reference to the replacement kept
    past a revert (a module that imported it by name) runs upstream's code too."""
    upstream, replacement = _upstream(), _rope_utils()._apply_rotary_pos_emb_bshd
    assert replacement is not upstream
    t = torch.randn(64, 2, 4, 32, device="cuda", dtype=torch.bfloat16)
    freqs = _freqs(64, 32, "cuda")
    signatures = set(COMPILED.forward.ran)
    calls = [((t, freqs), dict(rotary_interleaved=True)), ((t, freqs), dict(mla_rotary_interleaved=True)),
             ((t, freqs.expand(64, 2, 1, 32).contiguous()), {}), ((t, freqs.clone().requires_grad_()), {}),
             ((t.double(), freqs), {}), ((t, freqs), dict(mscale=torch.tensor(1.2, device="cuda")))]
    for args, options in calls:
        assert torch.equal(replacement(*args, **options), upstream(*args, **options))
    with ADJUSTMENT.suspended():
        assert torch.equal(replacement(t, freqs), upstream(t, freqs))
    assert COMPILED.forward.ran == signatures


@pytest.mark.gpu
def test_on_the_gpu_a_rope_first_met_inside_a_capture_runs_eagerly_and_replays_right(process_group) -> None:
    """A shape no call compiled yet, first met inside a CUDA graph capture: no compile there (it cannot run inside
    a capture); the replay computes the math within bf16 rounding; the first call after the capture compiles."""
    rope_utils = _rope_utils()
    static = torch.randn(64, 1, 3, 32, device="cuda", dtype=torch.bfloat16)
    freqs = _freqs(64, 32, "cuda")
    signatures = set(COMPILED.forward.ran)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        output = rope_utils._apply_rotary_pos_emb_bshd(static, freqs)
    assert COMPILED.forward.ran == signatures
    static.copy_(torch.randn(64, 1, 3, 32, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    with ADJUSTMENT.suspended():
        exact = rope_utils._apply_rotary_pos_emb_bshd(static.double(), freqs.double())
    _assert_within_bf16_rounding(output, exact, _pair_magnitude(static, 32, 1.0), "once", "replayed")
    with torch.no_grad():
        rope_utils._apply_rotary_pos_emb_bshd(static, freqs)
    assert len(COMPILED.forward.ran) == len(signatures) + 1


# a tiny model's fit -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fast_rope") / "qwen3_mtp", "qwen3", mtp=True)


@pytest.mark.gpu
def test_on_the_gpu_a_tiny_fit_trains_as_with_upstreams_rope(checkpoint, tmp_path) -> None:
    """bf16 tiny Qwen3 + MTP at lr 1e-4, joint training through the whole-iteration graph (4 steps: warm-up,
    capture, 2 replays), with the compiled RoPE and with upstream's: every step's losses and grad norms within bf16's
    rounding, the graph captured alike."""
    results = run_in_fresh_process(fits_with_and_without, tmp_path, "fast_rope", str(tmp_path), str(checkpoint))
    assert results["active"] and results["refused"] is None and all(results["compiled_signatures"])
    assert results["compiled"]["graph"] == results["upstream"]["graph"] == GRAPHED
    assert_trains_alike(results["compiled"]["metrics"], results["upstream"]["metrics"], "joint")
