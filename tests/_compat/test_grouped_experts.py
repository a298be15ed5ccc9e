"""`megatron_core.grouped_mm_experts`: MoE experts as two grouped GEMMs equal `SequentialMLP`'s loop over experts,
forward and every gradient, on a real Qwen3-MoE layer built through megatron-bridge, with Megatron-Core's unfused
SwiGLU and with the fused one (`fast_swiglu`); applied only on CUDA (the CPU keeps upstream's loop), and on the GPU
only where a grouped GEMM computes what the loop does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_megatron._compat import fast_swiglu, grouped_experts
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

    adjustment = grouped_experts.MEGATRON_CORE_ADJUSTMENTS[0]
    with adjustment.suspended():
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
    adjustment = grouped_experts.MEGATRON_CORE_ADJUSTMENTS[0]
    if torch.cuda.is_available():
        pytest.skip("the CPU's condition; the GPU test below covers CUDA")
    assert not adjustment.active and not adjustment.needed()
    experts = _experts(checkpoint, torch.float32)
    assert not grouped_experts.grouped_experts_apply(experts, torch.zeros(4, experts.config.hidden_size))


@pytest.mark.gpu
def test_on_the_gpu_bf16_experts_take_the_grouped_gemm_and_equal_the_loop(model_parallel, checkpoint) -> None:
    """bf16: both paths round each GEMM's output to bf16 (8 bits of mantissa), so the outputs and gradients agree
    to a few bf16 steps of their own magnitudes, not bit for bit. Both fuse SwiGLU with the probabilities
    (`fast_swiglu`: the loop's MLPs through upstream's weighted fusion, the grouped forward directly)."""
    adjustment = grouped_experts.MEGATRON_CORE_ADJUSTMENTS[0]
    assert adjustment.active
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
