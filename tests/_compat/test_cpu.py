"""Each CPU adjustment: Megatron-Core fails here without it, and the path it unblocks works with it."""

import contextlib

import pytest
import torch

from lightning_megatron._compat import (
    context_parallel,
    cpu,
    gated_delta_net,
    moe,
    mtp_stage,
    no_te,
    packed_mtp_roll,
    packed_rope,
    prepare_megatron_core,
    quiet,
)
from tests._megatron import tiny_gpt, token_batch

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU adjustments apply only without CUDA")

ADJUSTMENTS = {adjustment.name: adjustment for adjustment in cpu.ADJUSTMENTS}


def _ddp_and_optimizer(model, distributed: bool = True, **optimizer_overrides):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=distributed), model)
    model.config.finalize_model_grads_func = finalize_model_grads
    optimizer_config = OptimizerConfig(**{"optimizer": "adam", "lr": 1e-3, "bf16": False,
                                          "use_distributed_optimizer": distributed, **optimizer_overrides})
    return ddp, get_megatron_optimizer(optimizer_config, [ddp])


def _backward(ddp) -> None:
    batch = token_batch()
    per_token = ddp(batch["input_ids"], batch["position_ids"], None, labels=batch["labels"],
                    loss_mask=batch["loss_mask"])
    ((per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()).backward()


@cpu_only
def test_all_apply_once_and_are_idempotent(process_group):
    stack_depth = len(torch.overrides._get_current_function_mode_stack())
    expected = [*ADJUSTMENTS, *(adjustment.name for adjustment in (*no_te.MEGATRON_CORE_ADJUSTMENTS,
                                                                    *context_parallel.ADJUSTMENTS,
                                                                    *moe.MEGATRON_CORE_ADJUSTMENTS,
                                                                    *packed_rope.ADJUSTMENTS,
                                                                    *packed_mtp_roll.ADJUSTMENTS,
                                                                    *mtp_stage.ADJUSTMENTS,
                                                                    *quiet.SAVE_ADJUSTMENTS,
                                                                    *gated_delta_net.ADJUSTMENTS))]
    assert prepare_megatron_core() == expected
    assert prepare_megatron_core() == expected
    assert len(torch.overrides._get_current_function_mode_stack()) == stack_depth


@cpu_only
def test_current_device(model_parallel):
    from megatron.core.utils import GlobalMemoryBuffer

    with ADJUSTMENTS["cpu.current_device"].suspended():
        with pytest.raises(RuntimeError, match="NVIDIA driver|CUDA"):
            GlobalMemoryBuffer().get_tensor((4, 4), torch.float32, "attention")
    assert GlobalMemoryBuffer().get_tensor((4, 4), torch.float32, "attention").device.type == "cpu"


@cpu_only
def test_cuda_tensors_and_type_names(model_parallel):
    from megatron.core.transformer.utils import get_default_causal_mask

    with ADJUSTMENTS["cpu.cuda_tensors"].suspended():
        with pytest.raises(RuntimeError, match="NVIDIA driver|CUDA"):
            get_default_causal_mask(4)
        with pytest.raises(RuntimeError, match="NVIDIA driver|CUDA"):
            _ddp_and_optimizer(tiny_gpt())
        assert torch.zeros(1).type() == "torch.FloatTensor"  # distrib_optimizer.py:466 would reject this
    assert get_default_causal_mask(4).device.type == "cpu"
    assert torch.zeros(1).type() == "torch.cuda.FloatTensor"


@cpu_only
def test_cuda_tensors_pinned_for_the_context_parallel_rotary_slice(model_parallel):
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

    cp_group = SimpleNamespace(size=lambda: 2, rank=lambda: 1)  # the function reads nothing else of the group
    with ADJUSTMENTS["cpu.cuda_tensors"].suspended():
        with pytest.raises(RuntimeError, match="NVIDIA driver|CUDA"):
            get_pos_emb_on_this_cp_rank(torch.arange(8.0)[:, None], 0, cp_group)
    # rank 1 of 2 holds chunks 1 and 2 of 4
    assert get_pos_emb_on_this_cp_rank(torch.arange(8.0)[:, None], 0, cp_group).flatten().tolist() == [2, 3, 4, 5]


@cpu_only
def test_cuda_tensors_optimizer_clips_gradients(model_parallel):
    clip = 1e-3
    ddp, optimizer = _ddp_and_optimizer(tiny_gpt(), distributed=False, optimizer="sgd", lr=1.0,
                                        weight_decay=0.0, clip_grad=clip)
    before = [p.detach().clone() for p in ddp.parameters()]
    _backward(ddp)
    ddp.finish_grad_sync()
    updated, grad_norm, _ = optimizer.step()
    step_norm = torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(ddp.parameters(), before)))
    assert updated and grad_norm > clip
    assert float(step_norm) == pytest.approx(clip, rel=1e-3)  # SGD with lr 1 moves by exactly the clipped gradient


def _clipped_step(clip: float) -> tuple[float, list[torch.Tensor]]:
    ddp, optimizer = _ddp_and_optimizer(tiny_gpt(), distributed=False, optimizer="sgd", lr=1.0,
                                        weight_decay=0.0, clip_grad=clip)
    _backward(ddp)
    ddp.finish_grad_sync()
    _, grad_norm, _ = optimizer.step()
    return grad_norm, [p.main_grad.detach().clone() for p in ddp.parameters()]


def test_grad_norm_on_device_equals_upstreams_without_a_sync_per_tensor(model_parallel):
    """Without Apex/TE upstream's gradient norm reads every parameter's norm back to the host (a synchronisation per
    tensor on a GPU); the adjustment computes the same norm on the device and clips by the same factor."""
    from megatron.core.optimizer import clip_grads

    adjustment = next(a for a in no_te.MEGATRON_CORE_ADJUSTMENTS if a.name == "megatron_core.grad_norm_on_device")
    prepare_megatron_core()
    assert adjustment.active
    host_reads = []
    upstream_float = torch.Tensor.__float__

    def counted_float(tensor: torch.Tensor) -> float:
        host_reads.append(tensor.numel())
        return upstream_float(tensor)

    torch.manual_seed(0)
    with adjustment.suspended(), pytest.MonkeyPatch.context() as patch:
        assert clip_grads.l2_norm_impl is not no_te._l2_norm_on_device
        patch.setattr(torch.Tensor, "__float__", counted_float)
        upstream_norm, upstream_grads = _clipped_step(clip=1e-3)
    upstream_reads, host_reads[:] = len(host_reads), []
    torch.manual_seed(0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "__float__", counted_float)
        norm, grads = _clipped_step(clip=1e-3)
    parameters = len(grads)
    assert upstream_reads >= parameters > 1 and len(host_reads) < upstream_reads - parameters + 2
    assert norm == pytest.approx(upstream_norm, rel=1e-6) and norm > 1e-3
    for ours, theirs in zip(grads, upstream_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


@pytest.mark.gpu
def test_grad_norm_on_device_makes_no_host_sync_on_cuda():
    from megatron.core.optimizer import clip_grads

    prepare_megatron_core()
    grads = [torch.randn(n, device="cuda") for n in (7, 1000, 33)]
    expected = torch.linalg.vector_norm(torch.cat(grads)).item()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        norm, _ = clip_grads.l2_norm_impl(0, None, [grads], False)
        clip_grads.multi_tensor_scale_impl(0, None, [grads, grads], 0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert norm.item() == pytest.approx(expected, rel=1e-5)
    assert torch.linalg.vector_norm(torch.cat(grads)).item() == pytest.approx(expected / 2, rel=1e-5)


@cpu_only
def test_cuda_tensors_distributed_optimizer_steps(model_parallel):
    ddp, optimizer = _ddp_and_optimizer(tiny_gpt(), clip_grad=1.0)
    before = [p.detach().clone() for p in ddp.parameters()]
    _backward(ddp)
    ddp.finish_grad_sync()
    updated, grad_norm, _ = optimizer.step()
    assert updated and grad_norm > 0
    assert all(not torch.equal(p, b) for p, b in zip(ddp.parameters(), before))


def test_streams(model_parallel):
    from megatron.core.distributed import finalize_model_grads

    ddp, _ = _ddp_and_optimizer(tiny_gpt())
    _backward(ddp)
    with ADJUSTMENTS["cpu.streams"].suspended():
        with pytest.raises((RuntimeError, AssertionError), match="NVIDIA driver|CUDA"):
            finalize_model_grads([ddp])
    finalize_model_grads([ddp])
    assert all(p.main_grad.abs().sum() > 0 for p in ddp.parameters())


@cpu_only
def test_rng_tracker(model_parallel):
    from megatron.core import tensor_parallel

    with ADJUSTMENTS["cpu.rng_tracker"].suspended():
        with pytest.raises(RuntimeError, match="NVIDIA driver|CUDA"):
            tensor_parallel.model_parallel_cuda_manual_seed(7, force_reset_rng=True)

    def dropout_masks() -> tuple[torch.Tensor, torch.Tensor]:
        tensor_parallel.model_parallel_cuda_manual_seed(7, force_reset_rng=True)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            model_parallel = torch.rand(8)
        with tensor_parallel.get_cuda_rng_tracker().fork("data-parallel-rng"):
            data_parallel = torch.rand(8)
        return model_parallel, data_parallel

    default_state = torch.get_rng_state()
    first, second = dropout_masks(), dropout_masks()
    assert torch.equal(first[0], second[0])  # a named stream is reproducible from the seed
    assert not torch.equal(first[0], first[1])  # and the streams differ
    assert torch.equal(torch.get_rng_state(), default_state)  # forking leaves the default generator alone


@pytest.mark.gpu
def test_with_cuda_no_cpu_adjustment_applies_and_the_no_te_ones_do():
    """On a GPU without Transformer Engine or Apex: none of the CPU stand-ins, every workaround for the missing
    libraries (optimizer state, context parallelism, packed RoPE and MTP roll), each only where its condition holds."""
    groups = (*no_te.MEGATRON_CORE_ADJUSTMENTS, *context_parallel.ADJUSTMENTS, *packed_rope.ADJUSTMENTS,
              *packed_mtp_roll.ADJUSTMENTS, *moe.MEGATRON_CORE_ADJUSTMENTS)
    # an applied adjustment is no longer `needed` (its condition reads the patched upstream), so ask first
    expected = {adjustment.name for adjustment in groups if adjustment.active or adjustment.needed()}
    applied = prepare_megatron_core()
    assert not {adjustment.name for adjustment in cpu.ADJUSTMENTS} & set(applied)
    assert {name for name in applied if name in {adjustment.name for adjustment in groups}} == expected


def test_a_fresh_distributed_optimizer_has_a_state_dict_to_load_a_checkpoint_into(model_parallel):
    """Loading a checkpoint builds the optimizer's sharded state dict before any step; without Apex/TE upstream
    asserts on the empty state. With the adjustment the fresh state dict says step 0 and loads back."""
    adjustment = no_te.MEGATRON_CORE_ADJUSTMENTS[0]
    prepare_megatron_core()
    _, optimizer = _ddp_and_optimizer(tiny_gpt(mtp_layers=0))
    (distributed,) = optimizer.chained_optimizers
    with adjustment.suspended(), pytest.raises(AssertionError):
        distributed.state_dict()
    state = distributed.state_dict()
    assert {group["step"] for group in state["optimizer"]["param_groups"]} == {0}
    distributed.load_state_dict(state)
    assert {float(s["step"]) for s in distributed.optimizer.state.values()} == {0.0}


def test_loaded_optimizer_states_need_no_step_tensor(model_parallel):
    """Checkpoints keep Adam's `step` in the param groups; without Apex/TE the per-parameter state has a `step`
    tensor too, which upstream then looks for among the loaded tensors."""
    adjustment = no_te.MEGATRON_CORE_ADJUSTMENTS[1]
    prepare_megatron_core()
    ddp, optimizer = _ddp_and_optimizer(tiny_gpt(mtp_layers=0))
    (distributed,) = optimizer.chained_optimizers
    distributed.load_state_dict(distributed.state_dict())  # what loading a checkpoint does first
    model_param = next(iter(distributed.model_param_group_index_map))
    group_index, group_order = distributed.model_param_group_index_map[model_param]
    main_param = distributed.optimizer.param_groups[group_index]["params"][group_order]
    loaded = {"param": torch.full_like(main_param, 0.5), "exp_avg": torch.full_like(main_param, 0.25),
              "exp_avg_sq": torch.full_like(main_param, 0.125)}
    with torch.no_grad():
        with adjustment.suspended(), pytest.raises(KeyError, match="step"):
            distributed._set_main_param_and_optimizer_states(model_param, loaded)
        distributed._set_main_param_and_optimizer_states(model_param, loaded)
    assert torch.equal(main_param, loaded["param"])
    assert torch.equal(distributed.optimizer.state[main_param]["exp_avg_sq"], loaded["exp_avg_sq"])


@pytest.mark.parametrize("adjusted", [False, True], ids=["upstream", "adjusted"])
def test_each_parameter_keeps_its_own_adam_step_after_loading(model_parallel, adjusted):
    """Upstream loads one shared `step` tensor into every parameter's state; each Adam step then adds 1 per
    parameter to it (bias correction wrong after a resume). With the adjustment every step counts once."""
    adjustment = no_te.MEGATRON_CORE_ADJUSTMENTS[2]
    prepare_megatron_core()
    ddp, optimizer = _ddp_and_optimizer(tiny_gpt(mtp_layers=0))
    (distributed,) = optimizer.chained_optimizers
    with contextlib.nullcontext() if adjusted else adjustment.suspended():
        ddp.zero_grad_buffer()
        _backward(ddp)
        optimizer.step()
        distributed.load_state_dict(distributed.state_dict())  # what resuming from a checkpoint does
        ddp.zero_grad_buffer()
        _backward(ddp)
        optimizer.step()
    steps = {float(state["step"]) for state in distributed.optimizer.state.values()}
    if adjusted:
        assert steps == {2.0}
    else:
        assert steps == {1.0 + len(distributed.optimizer.state)}
