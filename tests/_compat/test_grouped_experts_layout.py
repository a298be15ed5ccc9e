"""`megatron_core.grouped_mm_experts` over Megatron DDP's buffers: where the distributed optimizer laid a layer's
experts out at one stride (the last expert first), the grouped GEMMs read a view of the weights instead of a stack
and add their gradients into a view of the `main_grad`s, and the layer (`grouped_experts_counts_on_device`'s
`MoELayer.preprocess`) sorts its tokens in that order; equal to upstream's loop, a refusal included."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from lightning_megatron._compat import grouped_experts
from tests._compat._compiled import applied
from tests._compat.test_grouped_experts import (  # noqa: F401  (fixtures)
    TOKENS,
    _aux_loss_scale_left_as_found,
    _experts,
    _forward_and_grads,
    _grouped_mm_on,
    _lift_the_device_check,
    _moe_layer,
    _routed_tokens,
    checkpoint,
)


def _ddp(module: torch.nn.Module, *, distributed_optimizer: bool) -> torch.nn.Module:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer)
    return DistributedDataParallel(module.config, config, module)


def test_an_expert_layout_reads_where_megatron_ddp_put_the_weights(model_parallel, checkpoint) -> None:
    """The distributed optimizer's buffers hold a layer's experts at one stride, the last expert first (fc1 and fc2
    interleaved): views over both buffers in that order, equal to the stacked weights and `main_grad`s. Without it
    the weights are separate tensors (stacked) while their `main_grad`s still lie at one stride; without DDP the
    weights are laid out in one tensor per linear (below) in the experts' own order. A weight moved is read again."""
    experts = _experts(checkpoint, torch.bfloat16)
    count = len(experts.local_experts)
    alone = grouped_experts.expert_layout(experts)
    assert alone.in_expert_order and alone.main_grad_strides == (None, None) and None not in alone.weight_strides
    _ddp(experts, distributed_optimizer=True)
    layout = grouped_experts.expert_layout(experts)
    assert layout is not alone and layout.order == tuple(reversed(range(count)))
    for fc in (1, 2):
        weights = [getattr(expert, f"linear_fc{fc}").weight for expert in experts.local_experts]
        in_order = [weights[expert] for expert in layout.order]
        view, main_grads = layout.weights(fc, weights), layout.main_grads(fc, weights)
        assert view.data_ptr() == in_order[0].data_ptr() and torch.equal(view, torch.stack(in_order))
        assert main_grads.data_ptr() == in_order[0].main_grad.data_ptr()
        assert torch.equal(main_grads, torch.stack([weight.main_grad for weight in in_order]))
        main_grads[1, 0, 0] = 7.0  # a view: written where expert order[1]'s `main_grad` lies
        assert in_order[1].main_grad[0, 0] == 7.0
    assert grouped_experts.expert_layout(experts) is layout  # cached while nothing moved
    separate = _experts(checkpoint, torch.bfloat16)
    _ddp(separate, distributed_optimizer=False)
    layout = grouped_experts.expert_layout(separate)
    assert layout.order == tuple(reversed(range(count))) and layout.weight_strides == (None, None)
    assert None not in layout.main_grad_strides
    weight = separate.local_experts[0].linear_fc1.weight
    weight.data = weight.data.clone()
    assert grouped_experts.expert_layout(separate) is not layout


def _frozen_experts_forwards(experts: torch.nn.Module, device: str, monkeypatch: pytest.MonkeyPatch
                             ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[int]]:
    """Frozen experts (as MTP-only's trunk or a LoRA base leaves them) on `device`: the forward and input gradient
    with their weights stacked for the GEMMs (the layout read before any forward, passed in: what every forward did
    before the lay-out), then two forwards that read the layout themselves; the stacks of the last forward."""
    experts.requires_grad_(False)
    before = grouped_experts._read_layout(experts)
    assert before.weight_strides == (None, None)  # apart: each forward would stack them
    values = {name: parameter.detach().clone() for name, parameter in experts.named_parameters()}
    hidden, shares, probs = _routed_tokens(experts, device, next(experts.parameters()).dtype)
    stacked = _forward_and_grads(functools.partial(grouped_experts.grouped_experts_forward, rows_in=before),
                                 experts, hidden, shares, probs)
    _forward_and_grads(grouped_experts.grouped_experts_forward, experts, hidden, shares, probs)  # lays them out
    stacks = _stacks_counted(monkeypatch)
    laid_out = _forward_and_grads(grouped_experts.grouped_experts_forward, experts, hidden, shares, probs)
    monkeypatch.undo()
    assert {name for name, value in stacked.items() if value is not None} == {"output", "hidden.grad"}
    assert all(torch.equal(parameter, values[name]) for name, parameter in experts.named_parameters())
    layout = grouped_experts.expert_layout(experts)
    assert layout.in_expert_order and None not in layout.weight_strides and layout.main_grad_strides == (None, None)
    for fc in (1, 2):
        weights = [getattr(expert, f"linear_fc{fc}").weight for expert in experts.local_experts]
        assert layout.weights(fc, weights).data_ptr() == weights[0].data_ptr()
        assert weights[0].untyped_storage().nbytes() == len(weights) * weights[0].numel() * weights[0].element_size()
    return {name: stacked[name] for name in ("output", "hidden.grad")}, laid_out, stacks


@pytest.mark.skipif(not _grouped_mm_on("cpu"), reason="this torch has no CPU kernel for torch._grouped_mm")
def test_frozen_experts_are_laid_out_once_in_one_tensor_per_linear_and_compute_what_the_stacks_did(
        model_parallel, checkpoint, monkeypatch) -> None:
    """Frozen experts lie apart (Megatron DDP manages no frozen weight), so every forward stacked them: 4.4 GB a
    GLM-4.5-Air MoE layer and microbatch. The first forward that reads their layout moves them into one tensor per
    linear; the same `Parameter`s keep their values, each a view of its row, and later forwards stack nothing and
    compute bit for bit what the stacked weights did (the same GEMMs over the same values, laid out alike)."""
    stacked, laid_out, stacks = _frozen_experts_forwards(_experts(checkpoint, torch.float32), "cpu", monkeypatch)
    assert stacks == [] and all(torch.equal(laid_out[name], stacked[name]) for name in stacked)


def test_weights_that_are_not_parameters_are_left_where_they_are(model_parallel, checkpoint) -> None:
    """A weight made per access (a LoRA layer's merged weight) is no parameter to move: the layout is read as it is
    (stacked per use), and nothing is moved."""
    experts = _experts(checkpoint, torch.float32).requires_grad_(False)
    for expert in experts.local_experts:
        weight = expert.linear_fc1.weight
        del expert.linear_fc1._parameters["weight"]
        expert.linear_fc1.weight = weight.detach()
    addresses = [expert.linear_fc1.weight.data_ptr() for expert in experts.local_experts]
    assert grouped_experts.expert_layout(experts).weight_strides[0] is None
    assert [expert.linear_fc1.weight.data_ptr() for expert in experts.local_experts] == addresses


def _bf16_microbatches(layer: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(TOKENS // 2, 2, layer.config.hidden_size, generator=generator).to(torch.bfloat16),
             torch.randn(TOKENS // 2, 2, layer.config.hidden_size, generator=generator).to(torch.bfloat16))
            for _ in range(2)]


def _layer_microbatches(layer: torch.nn.Module, ddp: torch.nn.Module, microbatches: list[tuple[torch.Tensor, ...]]):
    """Each microbatch's output and input gradient, every `main_grad` after all of them, and each one's share."""
    ddp.zero_grad_buffer()
    results: dict[str, torch.Tensor] = {}
    shares: dict[str, list[torch.Tensor]] = {name: [] for name, _ in layer.named_parameters()}
    for index, (hidden, grad) in enumerate(microbatches):
        before = {name: parameter.main_grad.clone() for name, parameter in layer.named_parameters()}
        hidden = hidden.clone().requires_grad_()
        output, _ = layer(hidden)
        output.backward(grad)
        results[f"output {index}"], results[f"hidden.grad {index}"] = output.detach(), hidden.grad
        for name, parameter in layer.named_parameters():
            shares[name].append(parameter.main_grad - before[name])
    return results | {name: parameter.main_grad.clone() for name, parameter in layer.named_parameters()}, shares


def _layer_and_the_loops_results(checkpoint, distributed_optimizer: bool) -> tuple[Any, ...]:
    """A bf16 MoE layer under Megatron DDP, two microbatches for it, and upstream's results on them (both
    adjustments set aside)."""
    grouped, counts = grouped_experts.MEGATRON_CORE_ADJUSTMENTS
    layer = _moe_layer(checkpoint, torch.bfloat16)
    ddp = _ddp(layer, distributed_optimizer=distributed_optimizer)
    microbatches = _bf16_microbatches(layer)
    with grouped.suspended(), counts.suspended():
        return layer, ddp, microbatches, _layer_microbatches(layer, ddp, microbatches)

def _assert_layer_results_close(ours: dict[str, torch.Tensor], loop: dict[str, torch.Tensor],
                                loop_shares: dict[str, list[torch.Tensor]]) -> None:
    """Outputs and input gradients: float32 sums of the same bf16 products in another order, rounded to bf16 once
    on either path (two bf16 steps of the largest value). `main_grad`s: the bound of the DDP test above."""
    for name in loop:
        if name.startswith(("output", "hidden")):
            scale = loop[name].float().abs().max().item() or 1.0
            torch.testing.assert_close(ours[name].float(), loop[name].float(), rtol=0, atol=2 * 2**-8 * scale,
                                       msg=name)
            continue
        bound = 2**-7 * sum(share.abs() for share in loop_shares[name]) + 2**-16 * loop[name].abs().max()
        assert ((ours[name] - loop[name]).abs() <= bound).all(), name


def _stacks_counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    stacks, stack = [], torch.stack
    monkeypatch.setattr(torch, "stack", lambda tensors, *args, **kwargs: stacks.append(len(tensors)) or stack(
        tensors, *args, **kwargs))
    return stacks


@pytest.mark.skipif(not _grouped_mm_on("cpu"), reason="this torch has no CPU kernel for torch._grouped_mm")
@pytest.mark.parametrize("distributed_optimizer", [True, False])
def test_a_layer_under_megatron_ddp_sorts_its_tokens_in_the_buffers_order_and_equals_the_loop(
        model_parallel, checkpoint, monkeypatch, distributed_optimizer) -> None:
    """A whole bf16 layer (router, all-to-all dispatcher, experts, combine) under Megatron DDP, two microbatches: its
    tokens go to the experts sorted in the buffers' order (the last expert first), the grouped GEMMs read the
    weights where they lie (no stack, with the distributed optimizer) and add their gradients into the `main_grad`s'
    view; the output, the input's gradient and every `main_grad` equal the loop's, both adjustments set aside, within
    the bound of the DDP test above (each microbatch's share rounded to bf16 once on either path)."""
    grouped, counts = grouped_experts.MEGATRON_CORE_ADJUSTMENTS
    layer, ddp, microbatches, (loop, loop_shares) = _layer_and_the_loops_results(checkpoint, distributed_optimizer)
    received = []
    forward = grouped_experts.grouped_experts_forward
    monkeypatch.setattr(grouped_experts, "grouped_experts_forward",
                        lambda *args, **kwargs: received.append(kwargs["rows_in"]) or forward(*args, **kwargs))
    _lift_the_device_check(monkeypatch)
    stacks = _stacks_counted(monkeypatch)
    with applied(grouped), applied(counts):
        ours, _ = _layer_microbatches(layer, ddp, microbatches)
    monkeypatch.undo()
    layout = grouped_experts.expert_layout(layer.experts)
    assert received == [layout, layout] and layout.order == tuple(reversed(range(len(layer.experts.local_experts))))
    assert None not in layout.main_grad_strides
    assert stacks == ([] if distributed_optimizer else [len(layout.order)] * 8)  # fc1, fc2; forward, backward; x2
    assert all(parameter.grad_added_to_main_grad for parameter in layer.experts.parameters())
    _assert_layer_results_close(ours, loop, loop_shares)


@pytest.mark.skipif(not _grouped_mm_on("cpu"), reason="this torch has no CPU kernel for torch._grouped_mm")
def test_a_layer_refused_after_sorting_its_tokens_in_the_buffers_order_runs_the_loop_in_that_order(
        model_parallel, checkpoint, monkeypatch) -> None:
    """The grouped GEMM refused on the second microbatch, whose tokens the layer already sorted in the buffers'
    order: the loop runs the experts in that order, and DDP's hook adds their gradients, equal to the loop's
    throughout (bound as above); the layer's next forward keeps the experts' order."""
    grouped, counts = grouped_experts.MEGATRON_CORE_ADJUSTMENTS
    layer, ddp, microbatches, (loop, loop_shares) = _layer_and_the_loops_results(checkpoint, True)
    calls, grouped_mm = [], torch._grouped_mm

    def refused_from_the_second_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) > 2 * 3:  # the first microbatch: two GEMMs forward, four backward (fc2's weight GEMM too)
            raise RuntimeError("refused here")
        return grouped_mm(*args, **kwargs)

    _lift_the_device_check(monkeypatch)
    monkeypatch.setattr(torch, "_grouped_mm", refused_from_the_second_forward)
    with applied(grouped), applied(counts):
        ours, _ = _layer_microbatches(layer, ddp, microbatches)
        assert layer.experts in grouped_experts.REFUSED and layer.experts in grouped_experts.TOKENS_IN_GROUP_ORDER
        layer(microbatches[0][0])
        assert layer.experts not in grouped_experts.TOKENS_IN_GROUP_ORDER
    grouped_experts.REFUSED.discard(layer.experts)
    _assert_layer_results_close(ours, loop, loop_shares)


@pytest.mark.gpu
def test_on_the_gpu_a_layer_under_the_distributed_optimizer_reads_its_experts_where_they_lie_and_equals_the_loop(
        model_parallel, checkpoint, monkeypatch) -> None:
    """CUDA's grouped GEMM (CUTLASS) over views whose experts lie one fc1 + fc2 apart, the last expert first, and
    one add into the `main_grad`s' view: no stack, no refusal, and the outputs, input gradients and `main_grad`s
    equal the loop's (cuBLAS, one GEMM an expert) within a few bf16 steps of their magnitudes, as the GPU tests
    above."""
    grouped, counts = grouped_experts.MEGATRON_CORE_ADJUSTMENTS
    assert grouped.active and counts.active
    layer = _moe_layer(checkpoint, torch.bfloat16).cuda()
    ddp = _ddp(layer, distributed_optimizer=True)
    microbatches = [(hidden.cuda(), grad.cuda()) for hidden, grad in _bf16_microbatches(layer)]
    _layer_microbatches(layer, ddp, microbatches)  # compiles `fast_swiglu`'s kernels on the first call
    with grouped.suspended(), counts.suspended():
        loop, _ = _layer_microbatches(layer, ddp, microbatches)
    stacks = _stacks_counted(monkeypatch)
    ours, _ = _layer_microbatches(layer, ddp, microbatches)
    monkeypatch.undo()
    layout = grouped_experts.expert_layout(layer.experts)
    assert stacks == [] and not layout.in_expert_order and layer.experts not in grouped_experts.REFUSED
    assert None not in (*layout.weight_strides, *layout.main_grad_strides)
    for name in loop:
        scale = loop[name].float().abs().max().item() or 1.0
        torch.testing.assert_close(ours[name].float(), loop[name].float(), rtol=0, atol=4 * 2**-8 * scale, msg=name)


@pytest.mark.gpu
def test_on_the_gpu_frozen_bf16_experts_are_laid_out_once_and_compute_what_the_stacks_did(
        model_parallel, checkpoint, monkeypatch) -> None:
    """As on the CPU, through CUDA's grouped GEMM in bf16: no stack after the lay-out, bit for bit the stacked
    weights' output and input gradient."""
    assert grouped_experts.GROUPED_MM_EXPERTS.active
    experts = _experts(checkpoint, torch.bfloat16).cuda()
    assert grouped_experts.grouped_experts_apply(experts, torch.zeros(1, experts.config.hidden_size,
                                                                      dtype=torch.bfloat16, device="cuda"))
    stacked, laid_out, stacks = _frozen_experts_forwards(experts, "cuda", monkeypatch)
    assert stacks == [] and all(torch.equal(laid_out[name], stacked[name]) for name in stacked)
