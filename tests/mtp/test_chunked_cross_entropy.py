"""The chunked cross-entropy is Megatron-Core's vocabulary-parallel one, value and gradient: bit for bit with its
plain steps in fp32; in bf16 the gradient, made in the forward and scaled in the backward, is rounded twice where
Megatron-Core rounds once; with its jit-fused steps to one rounding (torch.compile may generate other kernels for
other shapes)."""

import pytest
import torch

from lightning_megatron.mtp.chunked_cross_entropy import chunked_vocab_parallel_cross_entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_chunked_cross_entropy_is_megatron_cores(model_parallel, dtype, fused):
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    # the jit-fused steps compiled afresh, not found among what earlier tests in this process compiled for other
    # shapes: in one order under pytest-xdist, with dynamo's recompile limit (8) reached, the fused values were wrong
    torch._dynamo.reset()
    group = parallel_state.get_tensor_model_parallel_group()
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(7, 3, 500, generator=generator)).to(dtype).requires_grad_(True)
    target = torch.randint(0, 500, (7, 3), generator=generator)
    upstream = torch.randn(7, 3, generator=generator)  # a different weight per token, as a loss mask would give

    # Megatron-Core's functions overwrite their input; a clone keeps `logits` for ours
    megatron = (fused_vocab_parallel_cross_entropy(logits.clone(), target, group) if fused
                else vocab_parallel_cross_entropy(logits.clone(), target, tp_group=group))
    (megatron_gradient,) = torch.autograd.grad((megatron * upstream).sum(), logits)
    for chunk_tokens in (4, 21, 1000):  # uneven chunks, one chunk per token row group, everything at once
        ours = chunked_vocab_parallel_cross_entropy(logits, target, group, chunk_tokens=chunk_tokens, fused=fused)
        (gradient,) = torch.autograd.grad((ours * upstream).sum(), logits)
        if fused:
            torch.testing.assert_close(ours, megatron, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(ours, megatron)
        if fused or dtype == torch.bfloat16:  # within one bf16 ulp
            torch.testing.assert_close(gradient.float(), megatron_gradient.float(), rtol=2**-7, atol=1e-7)
        else:
            assert torch.equal(gradient, megatron_gradient)
        assert gradient.dtype == dtype and logits.grad is None


def test_a_chunk_size_below_one_is_rejected():
    with pytest.raises(ValueError, match="chunk_tokens: 0 must be at least 1"):
        chunked_vocab_parallel_cross_entropy(torch.zeros(2, 1, 4), torch.zeros(2, 1, dtype=torch.long), None, 0)
