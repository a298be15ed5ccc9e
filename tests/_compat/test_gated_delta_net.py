"""Qwen3.5's gated DeltaNet model without Transformer Engine and `fla`: megatron-core fails to build it without each
adjustment, and with them each PyTorch path computes what transformers' Qwen3.5 modeling computes (its own PyTorch
fallbacks). On a GPU with `fla`, the kernels adjustment stays off and `fla`'s kernels agree with the PyTorch path."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_megatron._compat import gated_delta_net
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint

ADJUSTMENTS = {adjustment.name: adjustment for adjustment in gated_delta_net.ADJUSTMENTS}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gdn") / "qwen3_5", "qwen3_5_text")


def _provider(checkpoint: Path):
    from lightning_megatron.bridges import create_bridge

    provider = create_bridge("megatron-bridge", checkpoint).auto_bridge.to_megatron_provider(load_weights=False)
    provider.finalize()
    return provider


def _inputs(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.skipif(not gated_delta_net.no_transformer_engine(), reason="applies only without Transformer Engine")
def test_the_hybrid_decoder_is_built_from_local_specs(model_parallel, checkpoint):
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_block_with_experimental_attention_variant_spec as hybrid_block_spec,
    )
    from megatron.core.tensor_parallel import ColumnParallelLinear

    provider = _provider(checkpoint)
    adjustment = ADJUSTMENTS["megatron_core.hybrid_local_specs"]
    with adjustment.suspended(), pytest.raises(NameError, match="TESpecProvider"):
        hybrid_block_spec(provider)
    linear, full = hybrid_block_spec(provider).layer_specs
    assert linear.submodules.self_attention.submodules.in_proj is ColumnParallelLinear  # no fused input norm ...
    assert linear.submodules.input_layernorm is LocalSpecProvider().layer_norm(rms_norm=True)  # ... so its own
    assert full.submodules.self_attention.submodules.linear_qkv is ColumnParallelLinear
    assert full.submodules.input_layernorm is LocalSpecProvider().layer_norm(rms_norm=True)


def test_the_torch_norm_scales_by_one_plus_weight_as_qwen3_5_does(model_parallel):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    adjustment = ADJUSTMENTS["megatron_core.zero_centered_torch_norm"]
    adjustment.apply()
    config = copy.copy(TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                                         layernorm_zero_centered_gamma=True))
    with adjustment.suspended(), pytest.raises(AssertionError, match="zero_centered_gamma not supported"):
        WrappedTorchNorm(config, 8, eps=1e-6)
    norm = WrappedTorchNorm(config, 8, eps=1e-6)
    assert torch.equal(norm.weight, torch.zeros(8))  # a scale of one
    reference = Qwen3_5RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(_inputs(8, seed=1) * 0.1)
        reference.weight.copy_(norm.weight)
    x = _inputs(3, 8)
    assert torch.equal(norm(x), reference(x))
    plain = copy.copy(config)
    plain.layernorm_zero_centered_gamma = False
    plain_norm = WrappedTorchNorm(plain, 8)  # torch's (on CUDA its subclass of `megatron_core.fast_rms_norm`)
    assert isinstance(plain_norm, torch.nn.RMSNorm) and not isinstance(plain_norm, gated_delta_net.ZeroCenteredRMSNorm)


@pytest.mark.skipif(not gated_delta_net.fla_missing(), reason="applies only without fla")
def test_a_gated_deltanet_is_built_only_with_the_torch_kernels(model_parallel, checkpoint):
    from megatron.core.process_groups_config import ProcessGroupCollection

    provider = _provider(checkpoint)
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    with ADJUSTMENTS["megatron_core.gated_delta_net_torch_kernels"].suspended(), pytest.raises(
            ImportError, match="FLA is not installed"):
        provider.provide()
    assert type(provider.provide().decoder.layers[0].self_attention).__name__ == "GatedDeltaNet"


def test_the_torch_kernels_are_transformers_qwen3_5_fallbacks():
    from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    batch, seq, heads, dim, channels, width = 2, 70, 3, 8, 12, 4  # 70: more than one chunk of 64
    x, weight = _inputs(batch, seq, channels), _inputs(channels, width, seed=1)
    conv = torch.nn.Conv1d(channels, channels, width, groups=channels, padding=width - 1, bias=False)
    with torch.no_grad():
        conv.weight.copy_(weight.unsqueeze(1))
        expected = F.silu(conv(x.transpose(1, 2))[:, :, :seq]).transpose(1, 2)
    assert torch.equal(gated_delta_net.torch_causal_conv1d(x, weight, activation="silu")[0], expected)

    q, k, v = (_inputs(batch, seq, heads, dim, seed=seed) for seed in (2, 3, 4))
    assert torch.equal(gated_delta_net.torch_l2norm(q), hf.l2norm(q))
    g, beta = -F.softplus(_inputs(batch, seq, heads, seed=5)), torch.sigmoid(_inputs(batch, seq, heads, seed=6))
    ours, _ = torch_chunk_gated_delta_rule(gated_delta_net.torch_l2norm(q), gated_delta_net.torch_l2norm(k), v,
                                           g=g, beta=beta)
    theirs, _ = hf.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    assert torch.equal(ours, theirs)
    recurrent, _ = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, None, False, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ours, recurrent, rtol=0, atol=1e-5)  # the chunked form is the recurrence


def test_packed_sequences_run_each_from_a_zero_state():
    """With `cu_seqlens` (one packed row), the conv and the rule give each sequence what it gives alone."""
    bounds = [0, 5, 5, 70, 83]  # an empty sequence, one of more than one chunk
    x, weight = _inputs(1, 83, 12), _inputs(12, 4, seed=1)
    q, k, v = (gated_delta_net.torch_l2norm(_inputs(1, 83, 3, 8, seed=seed)) for seed in (2, 3, 4))
    g, beta = -F.softplus(_inputs(1, 83, 3, seed=5)), torch.sigmoid(_inputs(1, 83, 3, seed=6))
    packed_conv, _ = gated_delta_net.torch_causal_conv1d(x, weight, activation="silu", cu_seqlens=torch.tensor(bounds))
    packed_rule, _ = gated_delta_net.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta,
                                                                  cu_seqlens=torch.tensor(bounds))
    for part in (slice(0, 5), slice(5, 70), slice(70, 83)):
        alone, _ = gated_delta_net.torch_causal_conv1d(x[:, part], weight, activation="silu")
        assert torch.equal(packed_conv[:, part], alone)
        alone, _ = gated_delta_net.torch_chunk_gated_delta_rule(q[:, part], k[:, part], v[:, part], g=g[:, part],
                                                                beta=beta[:, part])
        assert torch.equal(packed_rule[:, part], alone)



@pytest.mark.parametrize("packed", [False, True])
def test_the_torch_rule_makes_no_host_tensor_for_device_inputs(packed):
    """The rule on device inputs (here `meta`, which no host copy can reach unnoticed) creates every tensor on that
    device: upstream's zero state is made on the host and copied (common.py:870), a synchronising copy per layer call
    that a CUDA graph capture refuses. (A packed row's `cu_seqlens` is read on the host by design.)"""
    from megatron.core.ssm.gated_delta_net import common
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostTensors(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outputs = out if isinstance(out, (tuple, list)) else [out]
            if any(isinstance(value, torch.Tensor) and value.device.type == "cpu" for value in outputs):
                self.ops.append(str(func))
            return out

    q, k, v = (torch.empty(1, 70, 3, 8, device="meta") for _ in range(3))
    g, beta = torch.empty(1, 70, 3, device="meta"), torch.empty(1, 70, 3, device="meta")
    packed_kwargs = {"cu_seqlens": torch.tensor([0, 30, 70])} if packed else {}
    with HostTensors() as upstream:
        common.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta)
    assert upstream.ops  # what the adjustment's rule avoids
    with HostTensors() as ours:
        output, _ = gated_delta_net.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, **packed_kwargs)
    assert ours.ops == [] and output.shape == (1, 70, 3, 8)

def test_torch_kernels_put_the_pytorch_path_in_place_for_a_block_only():
    """`torch_kernels` (a benchmark's PyTorch side beside fla's): megatron-core's three kernels and the given layer's
    rule, bound when it was built, are the PyTorch ones inside the block and what they were after it."""
    from megatron.core.ssm.gated_delta_net import common, gdn

    def kernels() -> dict[tuple[str, str], object]:
        return {(module.__name__, name): getattr(module, name) for module in (common, gdn)
                for name in ("causal_conv1d", "l2norm", "chunk_gated_delta_rule") if name in vars(module)}

    layer = torch.nn.Module()
    layer.gated_delta_rule = built_with = object()
    before = kernels()
    with gated_delta_net.torch_kernels(layer):
        assert layer.gated_delta_rule is gated_delta_net.torch_chunk_gated_delta_rule
        assert gdn.causal_conv1d is gated_delta_net.torch_causal_conv1d and common.l2norm is gated_delta_net.torch_l2norm
    assert layer.gated_delta_rule is built_with and kernels() == before


@pytest.mark.parametrize(("triton", "capability", "tilelang", "refused"), [
    ("3.6.0", (9, 0), False, True), ("3.4.0", (9, 0), False, True), ("3.7.1", (9, 0), False, False),
    ("3.3.1", (9, 0), False, False), ("3.6.0", (8, 0), False, False), ("3.6.0", (10, 0), False, False),
    ("3.6.0", (9, 0), True, False)])
def test_fla_is_left_out_where_it_refuses_the_gated_backward(triton, capability, tilelang, refused):
    """fla-core 0.6.0's own condition (`fla/ops/common/chunk_o.py:727`): there the PyTorch path trains instead of
    a fit that would fail at its first backward (what the H200's torch 2.11 with Triton 3.6 did)."""
    assert gated_delta_net.fla_refuses_gated_backward(triton, capability, tilelang) is refused
    assert ADJUSTMENTS["megatron_core.gated_delta_net_torch_kernels"].needed is gated_delta_net._fla_unusable


@pytest.mark.gpu
@pytest.mark.skipif(gated_delta_net.fla_unusable() is not None,
                    reason="needs fla's kernels, usable here (the gdn extra; on Hopper Triton >= 3.7.1 or tilelang)")
def test_fla_kernels_agree_with_the_torch_path_on_a_gated_deltanet_layer(model_parallel, checkpoint):
    """One GatedDeltaNet layer of the tiny Qwen3.5 on the GPU in bf16: with `fla`'s Triton kernels (what megatron-core
    uses where `fla-core` is installed, the kernels adjustment off) and with the PyTorch path, on the same input; to
    bf16's resolution (2^-8 relative, a few roundings deep), gradients included."""
    from lightning_megatron.bridges import create_bridge
    from lightning_megatron.options import ModelOptions

    assert not ADJUSTMENTS["megatron_core.gated_delta_net_torch_kernels"].active
    chunk = create_bridge("megatron-bridge", checkpoint).build(ModelOptions(params_dtype=torch.bfloat16))[0]
    layer = chunk.decoder.layers[0].self_attention
    hidden = _inputs(256, 2, 64).cuda().bfloat16().requires_grad_()

    def forward_and_grads() -> list[torch.Tensor]:
        layer.zero_grad(set_to_none=True)
        hidden.grad = None
        out, _ = layer(hidden, attention_mask=None)
        out.float().square().sum().backward()
        return [out.detach().float(), hidden.grad.float(), layer.in_proj.weight.grad.float()]

    fast = forward_and_grads()
    with gated_delta_net.torch_kernels(layer):
        slow = forward_and_grads()
    assert layer.gated_delta_rule is not gated_delta_net.torch_chunk_gated_delta_rule  # fla's again after the block
    for fla_value, torch_value in zip(fast, slow, strict=True):
        scale = float(torch_value.abs().max())
        torch.testing.assert_close(fla_value, torch_value, rtol=0, atol=2e-2 * scale)
