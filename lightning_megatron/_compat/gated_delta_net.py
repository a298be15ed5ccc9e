"""Megatron-Core 0.19's gated DeltaNet models (Qwen3.5: linear-attention layers between full-attention ones) without
Transformer Engine and without `fla` (flash-linear-attention).

Upstream builds the hybrid decoder from TE modules only, refuses the zero-centred RMSNorm Qwen3.5 uses in its torch
norm, and takes the causal convolution, the l2norm and the chunked gated delta rule from `fla`'s Triton kernels,
refusing to build a GatedDeltaNet without them. Each adjustment here applies only under its condition, so a GPU
machine with `fla` installed (`pip install lightning-megatron[gdn]`) runs `fla`'s kernels. The PyTorch paths compute
what transformers' Qwen3.5 modeling computes without `fla` (`models/qwen3_5/modeling_qwen3_5.py`: `l2norm`, the
`nn.Conv1d` + SiLU path of `Qwen3_5GatedDeltaNet.forward`, `torch_chunk_gated_delta_rule`, `Qwen3_5RMSNorm`), so the
Megatron model's logits equal the HF model's; packed sequences (`cu_seqlens`) run one by one, each from a zero state
(no carried state: that is inference's, which megatron-core's GatedDeltaNet does not do).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from lightning_megatron._compat._adjustment import Adjustment, Patches
from lightning_megatron._compat.no_te import no_transformer_engine


def fla_missing() -> bool:
    """Whether `fla`'s kernels are unavailable (not installed), as megatron-core's own import finds them."""
    return importlib.util.find_spec("fla") is None


def fla_refuses_gated_backward(triton_version: str, compute_capability: tuple[int, int], tilelang: bool) -> bool:
    """Whether fla's gated delta rule raises in its backward on this machine: with Triton from 3.4.0 up to 3.7.1 on
    Hopper (compute capability 9.x) and no tilelang, its `chunk_bwd_dqkwg` computes wrong gradients, so fla refuses
    it (fla-core 0.6.0 `fla/ops/common/chunk_o.py:727-732`, flash-linear-attention #640; seen on the H200 with torch
    2.11's Triton)."""
    from packaging.version import Version

    return (not tilelang and compute_capability[0] == 9
            and Version("3.4.0") <= Version(triton_version) < Version("3.7.1"))


def fla_unusable() -> str | None:
    """Why the gated DeltaNet cannot train with `fla`'s kernels here (then the PyTorch path runs), or None."""
    if fla_missing():
        return "fla is not installed (pip install lightning-megatron[gdn] on a GPU machine)"
    if not torch.cuda.is_available():
        return None
    import triton

    tilelang = importlib.util.find_spec("tilelang") is not None
    if fla_refuses_gated_backward(triton.__version__, torch.cuda.get_device_capability(), tilelang):
        return (f"fla refuses the gated delta rule's backward with Triton {triton.__version__} on this Hopper GPU "
                "(wrong gradients below Triton 3.7.1); upgrade Triton to 3.7.1 or install tilelang for fla's kernels")
    return None


def _fla_unusable() -> bool:
    return fla_unusable() is not None


# megatron-core: the hybrid layer specs -----------------------------------------------------------------------------


def _install_local_hybrid_specs(patches: Patches) -> None:
    """The hybrid decoder's layers from local (plain PyTorch) modules: the GatedDeltaNet's input projection without a
    fused norm (so the layer keeps its own `input_layernorm`), and the full-attention layers from the local GPT spec."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as specs
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    def local_backend(config: Any) -> LocalSpecProvider:
        return LocalSpecProvider()

    def gated_delta_net_spec(config: Any, backend: Any = None) -> ModuleSpec:
        backend = backend or LocalSpecProvider()
        return ModuleSpec(
            module=GatedDeltaNet,
            submodules=GatedDeltaNetSubmodules(
                in_proj=backend.column_parallel_linear(),
                out_norm=backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=False),
                out_proj=backend.row_parallel_linear(),
            ),
            metainfo={"fuse_input_layernorm": False},
        )

    def self_attention_spec(config: Any, backend: Any = None) -> ModuleSpec:
        layer = get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
            qk_layernorm=config.qk_layernorm, multi_latent_attention=config.multi_latent_attention,
            normalization=config.normalization, qk_l2_norm=config.qk_l2_norm,
        )
        attention = copy.copy(layer.submodules.self_attention)
        attention.metainfo = {**attention.metainfo, "fuse_input_layernorm": False}
        return attention

    patches.setattr(specs, "_get_backend_spec_provider", local_backend)
    patches.setattr(specs, "get_gated_delta_net_module_spec", gated_delta_net_spec)
    patches.setattr(specs, "_get_self_attention_module_spec", self_attention_spec)


# megatron-core: the zero-centred RMSNorm ---------------------------------------------------------------------------


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """RMSNorm scaling by `1 + weight` (`layernorm_zero_centered_gamma`, Qwen3.5's `Qwen3_5RMSNorm`): normalised in
    float32, scaled, then cast back, as transformers computes it; the weight starts at zero (a scale of one)."""

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return (hidden * (1.0 + self.weight.float())).type_as(x)


def _torch_norm_refuses_zero_centered_gamma() -> bool:
    from megatron.core.transformer import torch_norm

    return "not config.layernorm_zero_centered_gamma" in inspect.getsource(torch_norm.WrappedTorchNorm)


def _install_zero_centered_torch_norm(patches: Patches) -> None:
    """The torch norm with `layernorm_zero_centered_gamma`: upstream's norm (with whatever else is adjusted, e.g.
    sequence parallelism's parameter marks), then the same parameters' values and marks in a `ZeroCenteredRMSNorm`."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    previous_new = WrappedTorchNorm.__new__

    def new(cls: type, config: Any, hidden_size: int, *args: Any, **kwargs: Any) -> Any:
        if not config.layernorm_zero_centered_gamma or config.normalization != "RMSNorm":
            return previous_new(cls, config, hidden_size, *args, **kwargs)
        plain = copy.copy(config)
        plain.layernorm_zero_centered_gamma = False
        norm = previous_new(cls, plain, hidden_size, *args, **kwargs)
        zero_centered = ZeroCenteredRMSNorm(norm.normalized_shape, eps=norm.eps, dtype=norm.weight.dtype)
        zero_centered.weight.__dict__.update(norm.weight.__dict__)  # e.g. `sequence_parallel`
        return zero_centered

    patches.setattr(WrappedTorchNorm, "__new__", staticmethod(new))


# megatron-core: the GatedDeltaNet's kernels without fla ------------------------------------------------------------


def _per_sequence(kernel: Callable[..., tuple[torch.Tensor, None]], cu_seqlens: torch.Tensor,
                  *sequences: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """`kernel` on each packed sequence of a one-row batch (`cu_seqlens`: where each starts and ends along dim 1)
    by itself, the outputs concatenated: the packed row's result, each sequence starting from a zero state."""
    bounds = cu_seqlens.tolist()
    outputs = [kernel(*(tensor[:, start:end] for tensor in sequences), **kwargs)[0]
               for start, end in zip(bounds[:-1], bounds[1:]) if end > start]
    return torch.cat(outputs, dim=1), None


def torch_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        activation: str | None = None, initial_state: torch.Tensor | None = None,
                        output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
                        **kwargs: Any) -> tuple[torch.Tensor, None]:
    """`fla.modules.convolution.causal_conv1d` for `x` [batch, seq, channels] and a depthwise `weight` [channels,
    width]: transformers' `nn.Conv1d` (left padding width - 1, cut to the sequence) and SiLU; packed sequences
    (`cu_seqlens`) each by itself."""
    if initial_state is not None or output_final_state:
        raise NotImplementedError("the PyTorch causal conv1d (no fla) starts every sequence from zeros and returns no "
                                  "state; install fla-core for a carried state")
    if cu_seqlens is not None:
        return _per_sequence(torch_causal_conv1d, cu_seqlens, x, weight=weight, bias=bias, activation=activation)
    width = weight.shape[-1]
    out = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1, groups=x.shape[-1])
    out = out[..., : x.shape[1]]
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise NotImplementedError(f"causal conv1d activation {activation!r}: the PyTorch path has silu only")
    return out.transpose(1, 2), None


def torch_l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`fla.modules.l2norm.l2norm` over the last dimension: transformers' `x * rsqrt(sum(x * x) + eps)`, in float32
    (as fla computes it) and cast to `output_dtype` (default: `x`'s)."""
    hidden = x.float()
    out = hidden * torch.rsqrt((hidden * hidden).sum(dim=-1, keepdim=True) + eps)
    return out.to(output_dtype or x.dtype)


def torch_chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                                 **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """megatron-core's `torch_chunk_gated_delta_rule` (transformers' chunked rule), packed sequences (`cu_seqlens`)
    each by itself, as `fla.ops.gated_delta_rule.chunk_gated_delta_rule` computes them. Without a state given, the
    zero state is made on the inputs' device: upstream makes it on the host and copies it over (common.py:870), a
    pageable host-to-device copy per layer call, which synchronises the GPU and fails inside a CUDA graph capture."""
    from megatron.core.ssm.gated_delta_net import common

    if cu_seqlens is None:
        if kwargs.get("initial_state") is None:
            kwargs["initial_state"] = _zero_state(k, v)
        return common.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, **kwargs)
    if kwargs.get("initial_state") is not None or kwargs.get("output_final_state"):
        raise NotImplementedError("the PyTorch gated delta rule (no fla) runs packed sequences from a zero state and "
                                  "returns none; install fla-core for a carried state")
    return _per_sequence(lambda *args: common.torch_chunk_gated_delta_rule(
        *args[:3], g=args[3], beta=args[4], initial_state=_zero_state(args[1], args[2])), cu_seqlens, q, k, v, g, beta)


def _zero_state(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The recurrent state a sequence starts from, [batch, heads, key dim, value dim] in float32 (the dtype the rule
    computes in) on `v`'s device; `k` and `v` are [batch, seq, heads, dim]."""
    return torch.zeros(k.shape[0], k.shape[2], k.shape[3], v.shape[3], dtype=torch.float32, device=v.device)


def _install_torch_gated_delta_net_kernels(patches: Patches) -> None:
    """The three kernels megatron-core imports from fla, as PyTorch: the conv, l2norm and chunked rule above (the rule
    is megatron-core's own, which upstream uses only in `deterministic_mode`, taught packed sequences); `HAVE_FLA`
    then says the kernels GatedDeltaNet needs are there."""
    _set_kernels(patches, _torch_kernels())


def _torch_kernels() -> dict[str, Any]:
    return {"causal_conv1d": torch_causal_conv1d, "l2norm": torch_l2norm,
            "chunk_gated_delta_rule": torch_chunk_gated_delta_rule, "HAVE_FLA": True}


def _set_kernels(patches: Patches, kernels: dict[str, Any], layers: tuple[torch.nn.Module, ...] = ()) -> None:
    """`kernels` under their names wherever megatron-core's gated DeltaNet modules hold them, and the rule of each
    given GatedDeltaNet, which megatron-core binds when it builds the layer (gdn.py:59-62)."""
    from megatron.core.ssm import gated_delta_net as package
    from megatron.core.ssm.gated_delta_net import common, gdn

    for module in (common, gdn, package):
        for name, value in kernels.items():
            if name in vars(module):
                patches.setattr(module, name, value)
    for layer in layers:
        patches.setattr(layer, "gated_delta_rule", kernels["chunk_gated_delta_rule"])


@contextlib.contextmanager
def torch_kernels(*layers: torch.nn.Module) -> Iterator[None]:
    """The PyTorch path of the gated DeltaNet within a block, whether or not `fla` is installed (what a machine
    without it runs, for a comparison with fla's kernels): the three kernels as the adjustment installs them, and the
    rule of each given GatedDeltaNet; undone after."""
    patches = Patches()
    _set_kernels(patches, _torch_kernels(), layers)
    try:
        yield
    finally:
        patches.revert()


@contextlib.contextmanager
def fla_kernels(*layers: torch.nn.Module) -> Iterator[None]:
    """fla's kernels within a block, also where the adjustment put the PyTorch ones in because fla refuses its
    backward on this machine (then only forwards may run in it: a benchmark's fla side); undone after."""
    from fla.modules.convolution import causal_conv1d
    from fla.modules.l2norm import l2norm
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    patches = Patches()
    _set_kernels(patches, {"causal_conv1d": causal_conv1d, "l2norm": l2norm,
                           "chunk_gated_delta_rule": chunk_gated_delta_rule}, layers)
    try:
        yield
    finally:
        patches.revert()


ADJUSTMENTS = (
    Adjustment(
        "megatron_core.hybrid_local_specs",
        "megatron/core/models/gpt/experimental_attention_variant_module_specs.py:439-453 builds the hybrid (gated "
        "DeltaNet) decoder from TESpecProvider only (NameError without TE), :76 fuses the input norm into in_proj, "
        ":476 takes the full-attention layers from the TE spec",
        no_transformer_engine,
        _install_local_hybrid_specs,
    ),
    Adjustment(
        "megatron_core.zero_centered_torch_norm",
        "megatron/core/transformer/torch_norm.py:44-46 asserts `not config.layernorm_zero_centered_gamma` (the norm "
        "used without Apex/TE), so Qwen3.5's `1 + weight` RMSNorm cannot be built",
        _torch_norm_refuses_zero_centered_gamma,
        _install_zero_centered_torch_norm,
    ),
    Adjustment(
        "megatron_core.gated_delta_net_torch_kernels",
        "megatron/core/ssm/gated_delta_net/common.py:43-54,141-145 takes causal_conv1d, l2norm and "
        "chunk_gated_delta_rule from fla and refuses to build a GatedDeltaNet without it; gdn.py:59-62,214,"
        "common.py:411 call them; fla-core 0.6.0 fla/ops/common/chunk_o.py:727-732 refuses the backward on Hopper "
        "with Triton 3.4.0-3.7.1 (`fla_unusable`)",
        _fla_unusable,
        _install_torch_gated_delta_net_kernels,
    ),
)
