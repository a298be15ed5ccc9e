"""`megatron_core.moe_permutation_by_gather`: the all-to-all dispatcher's permutation and restore without atomic adds
(no `index_add_`, no `scatter_add_`) give a whole MoE layer's output and every gradient as upstream's do: bit for
bit with two experts a token (a sum of two rows is the same in any order and rounds once either way), within the
float32 rounding of a three-row sum otherwise; only inside the dispatcher's calls (the full routing map) and only
where upstream would add atomically on a GPU (the CPU keeps upstream's ops)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_megatron._compat import grouped_experts, moe_permutation
from lightning_megatron.bridges import create_bridge
from lightning_megatron.options import ModelOptions
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from lightning_megatron.testing.experts import MoEShape
from tests._compat._compiled import applied
from tests._compat.test_grouped_experts import _aux_loss_scale_left_as_found  # noqa: F401  (fixture)

TOKENS = 24


@pytest.fixture(scope="module", params=[2, 3], ids=["top2", "top3"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    top_k = request.param
    path = tmp_path_factory.mktemp("moe_permutation") / f"qwen3_moe_top{top_k}"
    return make_tiny_checkpoint(path, "qwen3_moe", moe=MoEShape(top_k=top_k)), top_k


def _layer(checkpoint: Path, dtype: torch.dtype) -> torch.nn.Module:
    chunks = create_bridge("megatron-bridge", checkpoint).build(ModelOptions(params_dtype=dtype))
    return chunks[0].decoder.layers[0].mlp


def _run(layer: torch.nn.Module, hidden: torch.Tensor) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The layer's output and every gradient, and the atomic-add ops its forward and backward ran."""
    layer.zero_grad(set_to_none=True)
    hidden = hidden.detach().clone().requires_grad_()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        output, _ = layer(hidden)
        output.backward(torch.linspace(-1, 1, output.numel(), device=output.device).reshape_as(output).to(output.dtype))
    atomic = [event.name for event in profiler.events() if event.name in ("aten::index_add_", "aten::scatter_add_")]
    return {"output": output.detach(), "hidden.grad": hidden.grad,
            **{f"{name}.grad": parameter.grad for name, parameter in layer.named_parameters()}}, atomic


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_layer_permuted_by_gathers_equals_upstream_without_atomic_adds(model_parallel, checkpoint, monkeypatch,
                                                                        dtype) -> None:
    path, top_k = checkpoint
    layer = _layer(path, dtype)
    assert type(layer.token_dispatcher).__name__ == "MoEAlltoAllTokenDispatcher"
    assert layer.config.moe_router_topk == top_k
    hidden = torch.randn(TOKENS // 2, 2, layer.config.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(dtype)
    with moe_permutation.PERMUTATION_BY_GATHER.suspended():
        upstream, upstream_atomics = _run(layer, hidden)
    assert sorted(set(upstream_atomics)) == ["aten::index_add_", "aten::scatter_add_"]
    monkeypatch.setattr(moe_permutation, "gathers_pay_off", lambda tokens: True)
    with applied(moe_permutation.PERMUTATION_BY_GATHER), grouped_experts.GROUPED_MM_EXPERTS.suspended():
        ours, atomics = _run(layer, hidden)
    assert atomics == []
    assert ours.keys() == upstream.keys() and all(upstream[name] is not None for name in upstream)
    for name in upstream:
        if top_k == 2 or name not in ("output", "hidden.grad"):  # a + b either way, rounded once; the same rows
            assert torch.equal(ours[name], upstream[name]), name
            continue
        # three rows: upstream rounds both partial sums (to bf16 in bf16), ours the sum once; within k rounding
        # steps of the largest magnitude, as the GPU tests compare
        step = 2**-23 if dtype == torch.float32 else 2**-7
        bound = step * upstream[name].float().abs().max().item() * top_k
        torch.testing.assert_close(ours[name].float(), upstream[name].float(), rtol=0, atol=bound, msg=name)


def test_only_the_dispatchers_calls_on_the_gpu_take_gathers(model_parallel, checkpoint, monkeypatch) -> None:
    """Outside `dispatch_preprocess` / `combine_postprocess` (any other caller's routing map may give a token any
    number of rows) and on the CPU, `permute` and `unpermute` are upstream's."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    path, top_k = checkpoint
    tokens = torch.randn(6, 8)
    routing_map = torch.zeros(6, 4, dtype=torch.bool)
    routing_map[:, :top_k] = True
    gathers = []
    gather = moe_permutation._GatherRows.apply
    monkeypatch.setattr(moe_permutation._GatherRows, "apply", lambda *args: gathers.append(1) or gather(*args))
    with applied(moe_permutation.PERMUTATION_BY_GATHER):
        assert token_dispatcher.permute is not moe_utils.permute
        rows, _, sorted_indices, _, _ = token_dispatcher.permute(tokens, routing_map, num_out_tokens=6 * top_k)
        assert torch.equal(rows, tokens[sorted_indices]) and gathers == []
        layer = _layer(path, torch.float32)
        layer(torch.randn(3, 2, layer.config.hidden_size))  # the CPU: upstream's ops inside the dispatcher too
        assert gathers == []
        monkeypatch.setattr(moe_permutation, "gathers_pay_off", lambda tokens: True)
        layer(torch.randn(3, 2, layer.config.hidden_size))
        assert gathers == [1]
    assert token_dispatcher.permute is moe_utils.permute


def test_the_cpu_does_not_apply_it() -> None:
    if torch.cuda.is_available():
        pytest.skip("the CPU's condition; the GPU test below covers CUDA")
    assert not moe_permutation.PERMUTATION_BY_GATHER.needed()
    assert moe_permutation._upstream_permutes_with_atomic_adds()


@pytest.mark.gpu
def test_on_the_gpu_a_bf16_layer_permutes_by_gathers_and_equals_upstream(model_parallel, checkpoint) -> None:
    """With the grouped experts, as training runs it: no atomic add, the output and every gradient within a few bf16
    steps of upstream's (upstream's atomics round each partial sum to bf16 in no fixed order)."""
    assert moe_permutation.PERMUTATION_BY_GATHER.active
    path, _ = checkpoint
    layer = _layer(path, torch.bfloat16).cuda()
    hidden = torch.randn(TOKENS // 2, 2, layer.config.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to("cuda", torch.bfloat16)
    _run(layer, hidden)  # compiles `fast_swiglu`'s kernels on the first call
    ours, atomics = _run(layer, hidden)
    assert atomics == []
    with moe_permutation.PERMUTATION_BY_GATHER.suspended():
        upstream, upstream_atomics = _run(layer, hidden)
    assert upstream_atomics
    for name in upstream:
        scale = upstream[name].float().abs().max().item() or 1.0
        torch.testing.assert_close(ours[name].float(), upstream[name].float(), rtol=0, atol=4 * 2**-8 * scale,
                                   msg=name)
