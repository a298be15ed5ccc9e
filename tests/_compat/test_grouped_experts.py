"""`megatron_core.grouped_mm_experts`: MoE experts as two grouped GEMMs equal `SequentialMLP`'s loop over experts,
forward and every gradient, on a real Qwen3-MoE layer built through megatron-bridge, with Megatron-Core's unfused
SwiGLU and with the fused one (`fast_swiglu`); under Megatron DDP their weight gradients land in `main_grad` as the
loop's do, added once; applied only on CUDA (the CPU keeps upstream's loop), and on the GPU only where a grouped GEMM
computes what the loop does. `megatron_core.grouped_experts_counts_on_device`: the all-to-all dispatcher of a layer
whose experts run grouped neither copies their counts to the host nor waits for it, with the same results."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_megatron._compat import fast_swiglu, grouped_experts
from lightning_megatron._compat.cpu import NoOpStream
from lightning_megatron.bridges import create_bridge
from lightning_megatron.options import ModelOptions
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from tests._compat._compiled import applied

TOKENS = 40


def _grouped_mm_on(device: str) -> bool:
    """Whether this torch has `_grouped_mm` for float32 on `device` (the CPU kernel came after torch 2.11)."""
    if not grouped_experts.grouped_mm_available():
        return False
    try:
        torch._grouped_mm(torch.ones(2, 8, device=device), torch.ones(1, 8, 8, device=device),
                          offs=torch.tensor([2], dtype=torch.int32, device=device))
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("grouped_experts") / "qwen3_moe", "qwen3_moe")


@pytest.fixture(autouse=True)
def _aux_loss_scale_left_as_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """A MoE layer's backward outside Megatron's schedules leaves the class-level aux-loss scale a 0-d tensor
    (megatron/core/transformer/moe/moe_utils.py:315-318), which the schedules' later `copy_` of their [1]-shaped
    scale refuses (:331-334) in every MoE fit after this file: each test leaves it as it found it."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    monkeypatch.setattr(MoEAuxLossAutoScaler, "main_loss_backward_scale",
                        MoEAuxLossAutoScaler.main_loss_backward_scale)


def _experts(checkpoint: Path, dtype: torch.dtype) -> torch.nn.Module:
    chunks = create_bridge("megatron-bridge", checkpoint).build(ModelOptions(params_dtype=dtype))
    return chunks[0].decoder.layers[0].mlp.experts


def _routed_tokens(experts: torch.nn.Module, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Permuted rows as the dispatcher hands them over: some experts get none, one gets most."""
    generator = torch.Generator().manual_seed(0)
    count = len(experts.local_experts)
    shares = torch.zeros(count, dtype=torch.long)
    shares[0], shares[-1] = 3, TOKENS - 3 - 5 * (count > 2)
    if count > 2:
        shares[1] = 5
    hidden = torch.randn(TOKENS, experts.config.hidden_size, generator=generator).to(device, dtype)
    probs = torch.rand(TOKENS, generator=generator).to(device, torch.float32)
    return hidden, shares, probs


def _forward_and_grads(forward, experts: torch.nn.Module, hidden: torch.Tensor, shares: torch.Tensor,
                       probs: torch.Tensor) -> dict[str, torch.Tensor]:
    experts.zero_grad(set_to_none=True)
    hidden = hidden.detach().clone().requires_grad_()
    output, bias = forward(experts, hidden, shares, probs)
    assert bias is None
    output.backward(torch.linspace(-1, 1, output.numel(), device=output.device).reshape_as(output).to(output.dtype))
    return {"output": output.detach(), "hidden.grad": hidden.grad,
            **{f"{name}.grad": parameter.grad for name, parameter in experts.named_parameters()}}


def _loop(experts: torch.nn.Module, hidden: torch.Tensor, shares: torch.Tensor, probs: torch.Tensor):
    from megatron.core.transformer.moe.experts import SequentialMLP

    with grouped_experts.GROUPED_MM_EXPERTS.suspended():
        return SequentialMLP.forward(experts, hidden, shares, probs)


@pytest.mark.skipif(not _grouped_mm_on("cpu"), reason="this torch has no CPU kernel for torch._grouped_mm")
@pytest.mark.parametrize("swiglu", ["unfused", "fused"])
def test_grouped_experts_equal_the_loop_forward_and_every_gradient(model_parallel, checkpoint, monkeypatch,
                                                                   swiglu) -> None:
    """Fused: the experts' config reads `bias_activation_fusion` (as on a GPU), so the loop's MLPs take upstream's
    weighted fusion and the grouped forward its own call of it; on the CPU both compute the unfused ops."""
    adjustment = fast_swiglu.ADJUSTMENTS[0]
    monkeypatch.setattr(adjustment, "needed", lambda: True)
    with applied(adjustment) if swiglu == "fused" else adjustment.suspended():
        experts = _experts(checkpoint, torch.float32)
        assert len(experts.local_experts) > 2 and experts.config.gated_linear_unit
        assert experts.config.bias_activation_fusion is (swiglu == "fused")
        routed = _routed_tokens(experts, "cpu", torch.float32)
        grouped = _forward_and_grads(grouped_experts.grouped_experts_forward, experts, *routed)
        loop = _forward_and_grads(_loop, experts, *routed)
    assert grouped.keys() == loop.keys() and all(loop[name] is not None for name in loop)
    for name in loop:  # the same products summed in another order: float32 rounding, far below 1e-5 at these sizes
        torch.testing.assert_close(grouped[name], loop[name], rtol=1e-5, atol=1e-6, msg=name)
    idle = [name for name in loop if name.startswith("local_experts.2.")]  # an expert without tokens
    assert idle and all(torch.count_nonzero(grouped[name]) == 0 for name in idle)


@pytest.mark.skipif(not _grouped_mm_on("cpu"), reason="this torch has no CPU kernel for torch._grouped_mm")
def test_frozen_experts_get_no_weight_gradient_and_the_same_input_gradient(model_parallel, checkpoint,
                                                                          monkeypatch) -> None:
    """LoRA and MTP-only freeze the experts: their weight GEMMs are skipped (two grouped GEMMs forward, two for the
    input's gradient, none for the weights'), the input's gradient is the loop's."""
    experts = _experts(checkpoint, torch.float32)
    experts.requires_grad_(False)
    routed = _routed_tokens(experts, "cpu", torch.float32)
    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *args, **kwargs: calls.append(1) or grouped_mm(*args, **kwargs))
    grouped = _forward_and_grads(grouped_experts.grouped_experts_forward, experts, *routed)
    monkeypatch.undo()
    assert len(calls) == 4
    loop = _forward_and_grads(_loop, experts, *routed)
    assert [name for name, grad in grouped.items() if grad is not None] == ["output", "hidden.grad"]
    torch.testing.assert_close(grouped["hidden.grad"], loop["hidden.grad"], rtol=1e-5, atol=1e-6)


def test_the_cpu_keeps_the_loop(model_parallel, checkpoint) -> None:
    if torch.cuda.is_available():
        pytest.skip("the CPU's condition; the GPU test below covers CUDA")
    for adjustment in grouped_experts.MEGATRON_CORE_ADJUSTMENTS:
        assert not adjustment.active and not adjustment.needed()
    experts = _experts(checkpoint, torch.float32)
    assert not grouped_experts.grouped_experts_apply(experts, torch.zeros(4, experts.config.hidden_size))


@pytest.mark.gpu
def test_on_the_gpu_bf16_experts_take_the_grouped_gemm_and_equal_the_loop(model_parallel, checkpoint) -> None:
    """bf16: both paths round each GEMM's output to bf16 (8 bits of mantissa), so the outputs and gradients agree
    to a few bf16 steps of their own magnitudes, not bit for bit. Both fuse SwiGLU with the probabilities
    (`fast_swiglu`: the loop's MLPs through upstream's weighted fusion, the grouped forward directly)."""
    assert grouped_experts.GROUPED_MM_EXPERTS.active
    experts = _experts(checkpoint, torch.bfloat16).cuda()
    assert experts.config.bias_activation_fusion
    routed = _routed_tokens(experts, "cuda", torch.bfloat16)
    assert grouped_experts.grouped_experts_apply(experts, routed[0])
    grouped = _forward_and_grads(lambda module, *args: module(*args), experts, *routed)
    assert experts not in grouped_experts.REFUSED  # the grouped GEMM ran, not the fallback
    loop = _forward_and_grads(_loop, experts, *routed)
    for name in loop:
        scale = loop[name].float().abs().max().item() or 1.0
        torch.testing.assert_close(grouped[name].float(), loop[name].float(), rtol=0, atol=4 * 2**-8 * scale,
                                   msg=name)


def _lift_the_device_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU stands in for the GPU: the grouped forward's predicate passes the float32 CPU tensors of these tests
    (their layout passes it on a GPU in bf16) and what it decides is what the tests check."""
    monkeypatch.setattr(grouped_experts, "grouped_experts_apply", lambda experts, hidden: len(
        experts.local_experts) > 1 and experts not in grouped_experts.REFUSED)


def _main_grads_after(forward, ddp: torch.nn.Module, microbatches: list[tuple[torch.Tensor, ...]]):
    """Each weight's `main_grad` after a backward per microbatch under Megatron DDP, and each microbatch's share."""
    ddp.zero_grad_buffer()
    shares: dict[str, list[torch.Tensor]] = {name: [] for name, _ in ddp.module.named_parameters()}
    for hidden, tokens, probs, grad in microbatches:
        before = {name: parameter.main_grad.clone() for name, parameter in ddp.module.named_parameters()}
        output, _ = forward(ddp.module, hidden.detach().clone().requires_grad_(), tokens, probs)
        output.backward(grad)
        for name, parameter in ddp.module.named_parameters():
            assert parameter.grad is None  # DDP's hook ran and let the gradient go
            shares[name].append(parameter.main_grad - before[name])
    return {name: parameter.main_grad.clone() for name, parameter in ddp.module.named_parameters()}, shares


@pytest.mark.skipif(not _grouped_mm_on("cpu"), reason="this torch has no CPU kernel for torch._grouped_mm")
def test_under_megatron_ddp_the_expert_weight_gradients_land_in_main_grad_once(model_parallel, checkpoint) -> None:
    """bf16 experts, fp32 `main_grad` (`grad_reduce_in_fp32`), two microbatches: the grouped backward adds every
    expert's weight gradient into its `main_grad` itself and marks it `grad_added_to_main_grad`, so DDP's hook (which
    adds the loop's) adds nothing. Both paths round each microbatch's gradient to bf16 before the fp32 add, from
    fp32 sums of the same products in another order: at most one bf16 step apart a microbatch (two roundings of half
    a step, 2^-8 of the value each: 2^-7 of each share), plus the order of fp32 sums over at most 40 rows (below
    2^-16 of the largest element). A gradient added twice misses that bound (checked)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    experts = _experts(checkpoint, torch.bfloat16)
    ddp = DistributedDataParallel(experts.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), experts)
    generator = torch.Generator().manual_seed(1)
    microbatches = []
    for _ in range(2):
        hidden, shares, probs = _routed_tokens(experts, "cpu", torch.bfloat16)
        hidden = hidden + torch.randn(hidden.shape, generator=generator).to(hidden.dtype)
        microbatches.append((hidden, shares, probs, torch.randn(hidden.shape, generator=generator).to(hidden.dtype)))
    grouped, _ = _main_grads_after(grouped_experts.grouped_experts_forward, ddp, microbatches)
    marked = {name: parameter.grad_added_to_main_grad for name, parameter in experts.named_parameters()}
    loop, loop_shares = _main_grads_after(_loop, ddp, microbatches)
    assert all(marked.values()) and not any(parameter.grad_added_to_main_grad for parameter in experts.parameters())

    def within_bound(main_grad: torch.Tensor, name: str) -> bool:
        bound = 2**-7 * sum(share.abs() for share in loop_shares[name]) + 2**-16 * loop[name].abs().max()
        return bool(((main_grad - loop[name]).abs() <= bound).all())

    trained = [name for name in loop if loop[name].abs().max() > 0]
    assert len(trained) == 6 and all(grouped[name].dtype == torch.float32 for name in loop)  # expert 2 got no token
    assert all(within_bound(grouped[name], name) for name in loop)
    assert not any(within_bound(2 * loop[name], name) for name in trained)


@pytest.mark.skipif(not _grouped_mm_on("cpu"), reason="this torch has no CPU kernel for torch._grouped_mm")
def test_experts_refused_after_a_grouped_microbatch_let_ddp_add_the_loop_gradients(model_parallel, checkpoint,
                                                                                  monkeypatch) -> None:
    """A grouped GEMM refused on the second microbatch: the loop takes over, and its gradients reach `main_grad`
    through DDP's hook (the marks of the first microbatch lifted), as if the loop had run both (bound as above)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    experts = _experts(checkpoint, torch.bfloat16)
    ddp = DistributedDataParallel(experts.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), experts)
    microbatches = []
    for seed in range(2):
        hidden, shares, probs = _routed_tokens(experts, "cpu", torch.bfloat16)
        grad = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(seed)).to(hidden.dtype)
        microbatches.append((hidden * (seed + 1), shares, probs, grad))
    loop, loop_shares = _main_grads_after(_loop, ddp, microbatches)
    forwards, grouped_mm = [], torch._grouped_mm

    def refused_from_the_second(*args, **kwargs):
        if len(forwards) > 1:
            raise RuntimeError("refused here")
        return grouped_mm(*args, **kwargs)

    def forward(module, *args):
        forwards.append(1)
        return module(*args)

    _lift_the_device_check(monkeypatch)
    monkeypatch.setattr(torch, "_grouped_mm", refused_from_the_second)
    with applied(grouped_experts.GROUPED_MM_EXPERTS):
        refused, _ = _main_grads_after(forward, ddp, microbatches)
    assert experts in grouped_experts.REFUSED
    grouped_experts.REFUSED.discard(experts)
    for name in loop:
        bound = 2**-7 * sum(share.abs() for share in loop_shares[name]) + 2**-16 * loop[name].abs().max()
        assert ((refused[name] - loop[name]).abs() <= bound).all(), name


class _HostTrips:
    """What upstream's all-to-all dispatcher does for the experts' counts while a MoE layer runs: the tensors it
    copies to the host (`maybe_move_tensor_to_cpu`), the waits for those copies and the sorts by local expert; and
    the counts the experts get."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from megatron.core.transformer.moe import token_dispatcher
        from megatron.core.transformer.moe.experts import SequentialMLP

        self.moved: list[torch.Tensor] = []
        self.waits = self.sorts = 0
        self.counts: torch.Tensor | None = None
        move, sort, experts = token_dispatcher.maybe_move_tensor_to_cpu, token_dispatcher.sort_chunks_by_idxs, \
            SequentialMLP.forward

        def moving(tensor, *args, **kwargs):
            if torch.is_tensor(tensor):
                self.moved.append(tensor)
            return move(tensor, *args, **kwargs)

        def sorting(*args, **kwargs):
            self.sorts += 1
            return sort(*args, **kwargs)

        def waiting(event) -> None:
            self.waits += 1

        def receiving(module, hidden, tokens_per_expert, probs):
            self.counts = tokens_per_expert
            return experts(module, hidden, tokens_per_expert, probs)

        monkeypatch.setattr(token_dispatcher, "maybe_move_tensor_to_cpu", moving)
        monkeypatch.setattr(token_dispatcher, "sort_chunks_by_idxs", sorting)
        monkeypatch.setattr(NoOpStream, "synchronize", waiting, raising=False)  # the CPU's `d2h_event`
        monkeypatch.setattr(SequentialMLP, "forward", receiving)


def _moe_layer(checkpoint: Path, dtype: torch.dtype) -> torch.nn.Module:
    chunks = create_bridge("megatron-bridge", checkpoint).build(ModelOptions(params_dtype=dtype))
    return chunks[0].decoder.layers[0].mlp


def _layer_forward_and_grads(layer: torch.nn.Module, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    hidden = hidden.detach().clone().requires_grad_()
    output, bias = layer(hidden)
    assert bias is None
    output.backward(torch.linspace(-1, 1, output.numel(), device=output.device).reshape_as(output).to(output.dtype))
    return {"output": output.detach(), "hidden.grad": hidden.grad,
            **{f"{name}.grad": parameter.grad for name, parameter in layer.named_parameters()}}


def _traced_run(layer: torch.nn.Module, hidden: torch.Tensor) -> tuple[dict[str, torch.Tensor], _HostTrips]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        trips = _HostTrips(monkeypatch)
        return _layer_forward_and_grads(layer, hidden), trips


@pytest.mark.skipif(not _grouped_mm_on("cpu"), reason="this torch has no CPU kernel for torch._grouped_mm")
def test_a_grouped_layer_keeps_the_counts_on_the_device_with_no_wait_and_the_same_result(model_parallel, checkpoint,
                                                                                       monkeypatch) -> None:
    """The project's all-to-all dispatcher at one TP x EP rank (the sorts by local expert keep the order): upstream
    copies the experts' counts to the host, waits for the copy and sorts there and back, a host sync a layer each
    (the loop reads the counts on the host, the grouped forward copied them back); applied, a layer whose experts run
    grouped does none of it and gives the same output and gradients, and one whose experts run the loop gets
    upstream's counts, trips and results, bit for bit."""
    grouped, counts = grouped_experts.MEGATRON_CORE_ADJUSTMENTS
    layer = _moe_layer(checkpoint, torch.float32)
    dispatcher = layer.token_dispatcher
    assert type(dispatcher).__name__ == "MoEAlltoAllTokenDispatcher" and len(layer.experts.local_experts) > 2
    hidden = torch.randn(TOKENS // 2, 2, layer.config.hidden_size, generator=torch.Generator().manual_seed(0))
    assert grouped_experts._upstream_copies_counts_to_the_host()
    with grouped.suspended(), counts.suspended():
        upstream, upstream_trips = _traced_run(layer, hidden)
    assert dispatcher.cuda_sync_point == "before_permutation_2" and grouped_experts._sorts_keep_the_order(dispatcher)
    assert upstream_trips.waits == 1 and upstream_trips.sorts == 2
    assert any(moved is upstream_trips.counts for moved in upstream_trips.moved)
    with applied(grouped), applied(counts):
        loop, loop_trips = _traced_run(layer, hidden)  # the CPU: the experts run the loop
        _lift_the_device_check(monkeypatch)
        ours, trips = _traced_run(layer, hidden)
        with grouped.suspended():  # `bench/moe.py`'s loop: the counts go to the host again
            _, suspended_trips = _traced_run(layer, hidden)
    assert (loop_trips.waits, loop_trips.sorts, len(loop_trips.moved)) == (1, 2, len(upstream_trips.moved))
    assert any(moved is loop_trips.counts for moved in loop_trips.moved)
    assert (trips.waits, trips.sorts, trips.moved) == (0, 0, [])
    assert torch.equal(trips.counts, upstream_trips.counts) and trips.counts.dtype == upstream_trips.counts.dtype
    assert loop.keys() == ours.keys() == upstream.keys() and all(upstream[name] is not None for name in upstream)
    for name in upstream:  # the loop bit for bit; grouped, float32 sums in another order (as above)
        assert torch.equal(loop[name], upstream[name]), name
        torch.testing.assert_close(ours[name], upstream[name], rtol=1e-5, atol=1e-6, msg=name)
    assert (suspended_trips.waits, suspended_trips.sorts) == (1, 2)
    assert any(moved is suspended_trips.counts for moved in suspended_trips.moved)


@pytest.mark.gpu
def test_on_the_gpu_a_bf16_moe_layer_runs_grouped_with_no_host_sync_and_equals_the_loop(model_parallel, checkpoint,
                                                                                      monkeypatch) -> None:
    """The layer's forward and backward (router, all-to-all dispatcher, grouped experts, combine) under
    `torch.cuda.set_sync_debug_mode("error")`, which raises at a blocking copy or `.item()`, and no CUDA event
    waited on (the dispatcher's `d2h_event.synchronize()`, which the mode does not see); the counts reach the experts
    on the device. Equal to upstream's loop, both adjustments set aside, within a few bf16 steps as above."""
    grouped, counts = grouped_experts.MEGATRON_CORE_ADJUSTMENTS
    assert grouped.active and counts.active
    layer = _moe_layer(checkpoint, torch.bfloat16).cuda()
    hidden = torch.randn(TOKENS // 2, 2, layer.config.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to("cuda", torch.bfloat16)
    _layer_forward_and_grads(layer, hidden)  # compiles `fast_swiglu`'s kernels on the first call
    received, waits = [], []
    forward, synchronize = grouped_experts.grouped_experts_forward, torch.cuda.Event.synchronize
    monkeypatch.setattr(grouped_experts, "grouped_experts_forward",
                        lambda experts, hidden, tokens, probs, **kwargs: received.append(tokens) or forward(
                            experts, hidden, tokens, probs, **kwargs))
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda event: waits.append(event) or synchronize(event))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ours = _layer_forward_and_grads(layer, hidden)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    monkeypatch.undo()
    assert len(received) == 1 and received[0].is_cuda and waits == []
    assert layer.experts not in grouped_experts.REFUSED
    with grouped.suspended(), counts.suspended():
        loop = _layer_forward_and_grads(layer, hidden)
    for name in loop:
        scale = loop[name].float().abs().max().item() or 1.0
        torch.testing.assert_close(ours[name].float(), loop[name].float(), rtol=0, atol=4 * 2**-8 * scale, msg=name)

