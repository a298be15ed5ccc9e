"""Core attention on PyTorch's fused kernels, for Megatron-Core's local (no Transformer Engine) layer specs.

Megatron-Core's local `DotProductAttention` materialises the full [b, heads, sq, sk] score matrix and softmax,
and cannot run packed (THD) sequences. `SDPAttention` has the same constructor and forward, so TP, PP and the MTP
layer use it unchanged, and computes the same attention with `torch.nn.functional.scaled_dot_product_attention`,
whose flash, memory-efficient and cuDNN kernels never hold the scores. `with_core_attention` puts it (or the local
attention) into a layer, block or MTP block spec.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import math
from typing import Any, Literal, TypeVar

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

AttentionBackend = Literal["auto", "sdpa", "local"]
ATTENTION_BACKENDS: tuple[AttentionBackend, ...] = ("auto", "sdpa", "local")

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)


class SDPAttention(MegatronModule):
    """`DotProductAttention` computed by `scaled_dot_product_attention`; same inputs, outputs and options.

    Inputs are [s, b, heads, head_dim] per TP rank ([t, heads, head_dim] for packed THD sequences), the output is
    [s, b, heads * head_dim] ([t, heads * head_dim]). An explicit `attention_mask` (bool, True = masked) is used as
    given, as the local attention does; with `padding_causal` the causal mask is added to it, as Transformer Engine
    does. A query row that masks every key gets zeros (the local attention averages all values there).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                f"context_parallel_size={config.context_parallel_size}: SDPAttention, like Megatron-Core's local "
                "DotProductAttention, has no context parallelism; set context_parallel_size: 1, or install "
                "Transformer Engine and set attention_backend: auto"
            )
        if config.softmax_type != "vanilla":
            raise ValueError(
                f"softmax_type={config.softmax_type!r}: scaled_dot_product_attention has no softmax offset; "
                "set attention_backend: local"
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        tp_size = pg_collection.tp.size()
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)
        # The local attention divides by `layer_number` under apply_query_key_layer_scaling and multiplies it back
        # inside its fp32 softmax; the net scale is this one.
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        self.window_size = (
            config.window_size
            if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
            else None
        )
        self.attention_dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias: SDPAttention, like DotProductAttention, takes none; use Transformer "
                             "Engine's attention (attention_backend: auto with Transformer Engine installed)")
        mask_type = attn_mask_type or self.attn_mask_type
        if packed_seq_params is not None:
            return self._packed_forward(query, key, value, mask_type, packed_seq_params)
        # [s, b, heads, d] -> [b, heads, s, d]
        context = self._attend(*(t.permute(1, 2, 0, 3) for t in (query, key, value)), attention_mask, mask_type)
        # [b, heads, sq, d] -> [sq, b, heads * d]
        return context.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), -1)

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        mask_type: AttnMaskType,
    ) -> torch.Tensor:
        """Attention on [b, heads, s, d] tensors; key and value may have fewer heads (GQA)."""
        sq, sk = query.size(2), key.size(2)
        is_causal = mask_type in _CAUSAL_TYPES and sq > 1  # one query: decoding against a KV cache, as upstream
        if self.window_size is not None:  # as upstream, the sliding window replaces any other mask
            attention_mask, is_causal = _sliding_window_mask(sq, sk, self.window_size, query.device), False
        elif attention_mask is not None:
            attention_mask = attention_mask.bool()
            if is_causal and mask_type == AttnMaskType.padding_causal:
                attention_mask = attention_mask | _causal_mask(sq, sk, query.device)
            is_causal = False
        if is_causal and sq != sk:
            raise ValueError(f"causal attention needs as many queries as keys; got {sq} queries and {sk} keys")
        dropout_p = self.attention_dropout_p if self.training else 0.0
        with self._dropout_rng(dropout_p):
            return F.scaled_dot_product_attention(
                query,
                key,
                value,
                attn_mask=None if attention_mask is None else attention_mask.logical_not(),  # SDPA: True = attend
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=self.softmax_scale,
                enable_gqa=key.size(1) != query.size(1),  # repeat_interleave order: query head h uses group h // n
            )

    def _dropout_rng(self, dropout_p: float) -> contextlib.AbstractContextManager:
        """Megatron's model-parallel RNG stream, as DotProductAttention draws its dropout from (unless SP)."""
        if dropout_p == 0.0 or self.config.sequence_parallel:
            return contextlib.nullcontext()
        return tensor_parallel.get_cuda_rng_tracker().fork()

    def _packed_forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask_type: AttnMaskType,
        packed: PackedSeqParams,
    ) -> torch.Tensor:
        """THD: each sequence of the pack attends only to itself, one SDPA call per sequence (exact, and every
        kernel, dropout included, stays available). Tokens between padded sequences get zeros."""
        if packed.qkv_format != "thd":
            raise ValueError(f"packed_seq_params.qkv_format={packed.qkv_format!r}: SDPAttention packs only 'thd'")
        # Megatron's Attention squeezes the dummy batch dimension of THD tensors: [t, heads, d].
        query, key, value = (t.squeeze(1) if t.dim() == 4 else t for t in (query, key, value))
        q_spans = _sequence_spans(packed.cu_seqlens_q, packed.cu_seqlens_q_padded)
        kv_spans = _sequence_spans(packed.cu_seqlens_kv, packed.cu_seqlens_kv_padded)
        pieces, position = [], 0
        for (q_start, q_length), (kv_start, kv_length) in zip(q_spans, kv_spans, strict=True):
            if q_start > position:
                pieces.append(query.new_zeros(q_start - position, query.size(1), value.size(2)))
            # [len, heads, d] -> [1, heads, len, d]
            q = query[q_start : q_start + q_length].transpose(0, 1).unsqueeze(0)
            k, v = (t[kv_start : kv_start + kv_length].transpose(0, 1).unsqueeze(0) for t in (key, value))
            pieces.append(self._attend(q, k, v, None, mask_type)[0].transpose(0, 1))
            position = q_start + q_length
        if query.size(0) > position:
            pieces.append(query.new_zeros(query.size(0) - position, query.size(1), value.size(2)))
        return torch.cat(pieces).reshape(query.size(0), -1)


def _sequence_spans(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor | None) -> list[tuple[int, int]]:
    """(start, length) of each packed sequence; with padding, sequence i starts at cu_seqlens_padded[i]."""
    bounds = cu_seqlens.tolist()
    starts = bounds[:-1] if cu_seqlens_padded is None else cu_seqlens_padded.tolist()[:-1]
    return [(start, end - begin) for start, begin, end in zip(starts, bounds[:-1], bounds[1:], strict=True)]


def _causal_mask(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(diagonal=1)


def _sliding_window_mask(sq: int, sk: int, window: tuple[int, int], device: torch.device) -> torch.Tensor:
    """megatron/core/transformer/utils.py `get_sliding_window_causal_mask`, on `device`: True = masked."""
    offset = torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None] - (sk - sq)
    return (offset < -window[0]) | (offset > window[1])


def core_attention_class(backend: AttentionBackend) -> type[MegatronModule] | None:
    """The core attention `backend` names: "auto" is SDPA without Transformer Engine and `None` (keep what the
    spec has) with it."""
    if backend == "auto":
        return None if importlib.util.find_spec("transformer_engine") else SDPAttention
    if backend == "sdpa":
        return SDPAttention
    if backend == "local":
        return DotProductAttention
    raise ValueError(f"attention_backend: {backend!r} is not one of {', '.join(map(repr, ATTENTION_BACKENDS))}")


Spec = TypeVar("Spec")


def with_core_attention(spec: Spec, backend: AttentionBackend) -> Spec:
    """`spec` with every core attention set by `backend`: a layer, block or MTP block spec, or a function building
    one (wrapped, its signature kept). A new spec; `spec` itself is left as it is."""
    attention = core_attention_class(backend)
    if attention is None:
        return spec
    if callable(spec) and not dataclasses.is_dataclass(spec):  # a ModuleSpec is callable too
        build_spec = spec

        @functools.wraps(build_spec)
        def build_spec_with_core_attention(*args: Any, **kwargs: Any) -> Any:
            return _replace_core_attention(build_spec(*args, **kwargs), attention)

        return build_spec_with_core_attention
    return _replace_core_attention(spec, attention)


def _is_core_attention(value: Any) -> bool:
    module = value.module if isinstance(value, ModuleSpec) else value
    return module in (DotProductAttention, SDPAttention) or getattr(module, "__name__", None) == "TEDotProductAttention"


def _replace_core_attention(node: Any, attention: type) -> Any:
    """Walks specs (dataclasses) and lists of them, copying only what changes."""
    if isinstance(node, (list, tuple)):
        items = [_replace_core_attention(item, attention) for item in node]
        return node if all(new is old for new, old in zip(items, node)) else type(node)(items)
    if not dataclasses.is_dataclass(node) or isinstance(node, type):
        return node
    changes = {}
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        if field.name == "core_attention" and _is_core_attention(value):
            new_value: Any = attention
        else:
            new_value = _replace_core_attention(value, attention)
        if new_value is not value:
            changes[field.name] = new_value
    return dataclasses.replace(node, **changes) if changes else node
