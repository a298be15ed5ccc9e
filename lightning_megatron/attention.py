"""Core attention on PyTorch's fused kernels, for Megatron-Core's local (no Transformer Engine) layer specs.

Megatron-Core's local `DotProductAttention` materialises the full [b, heads, sq, sk] score matrix and softmax,
and runs neither packed (THD) sequences nor context parallelism. `SDPAttention` has the same constructor and
forward, so TP, PP and the MTP layer use it unchanged, and serves every layout of `lightning_megatron.microbatch`:

- padded rows (no structure, CP=1): `scaled_dot_product_attention` with `is_causal` or the explicit bool mask; its
  flash / memory-efficient / cuDNN kernels never hold the scores.
- packed THD (`packed_seq_params`), a "may attend" structure (an integer `attention_mask` = `subtree_end`, trees),
  and context parallelism (CP > 1): one layout, "key k is visible to query q iff lower[k] <= q < end[k]" in whole-
  row positions, built once per microbatch and reused by every layer (cached on the microbatch's tensors). With
  CP > 1 each rank all-gathers K and V over the CP group (autograd-aware: the backward reduce-scatters their
  gradients) and masks with its queries' positions in Megatron's load-balanced chunk layout.
  On CUDA the layout becomes a flex_attention `BlockMask` (built once per microbatch from the layout's bounds with a
  few tensor ops and no host read, `lightning_megatron.attention_layout` says why; the compiled kernel is compiled
  once per shape): block-sparse, so fully masked blocks (other sequences, other branches) cost nothing and no
  seq x seq tensor is ever made; one kernel serves packed, tree and CP rows alike, which varlen SDPA / nested
  tensors cannot (no trees, no CP offsets). `bench/packing.py` (P5) measures it against full unpadded rows.
  On the CPU (flex has no CPU backward) and with attention dropout (flex has none), the same layout becomes a dense
  bool mask for SDPA: exact, O(s^2) memory.
- packed THD rows that are plain causal per sequence (optionally a sliding window), bf16 or fp16 on a CUDA GPU, CP=1:
  torch's variable-length FlashAttention (`varlen_attn`) instead of the layout, where `attention_varlen.varlen_refusal`
  (a table of what it does not cover, each with its reason) lets them through; `LIGHTNING_MEGATRON_FAST_VARLEN=0`
  keeps flex_attention.

`with_core_attention` puts it (or the local attention) into a layer, block or MTP block spec.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

from lightning_megatron.attention_layout import Layout, build_layout
from lightning_megatron.attention_varlen import PackedCall, varlen_attention, varlen_refusal
from lightning_megatron.microbatch import packed_row_bounds
from lightning_megatron.options import ATTENTION_BACKENDS, AttentionBackend

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)


class SDPAttention(MegatronModule):
    """`DotProductAttention` computed by `scaled_dot_product_attention`; same inputs, outputs and options.

    Inputs are [s, b, heads, head_dim] per TP rank ([t, heads, head_dim] for packed THD sequences), the output is
    [s, b, heads * head_dim] ([t, heads * head_dim]). An explicit `attention_mask` (bool, True = masked) is used as
    given, as the local attention does; with `padding_causal` the causal mask is added to it, as Transformer Engine
    does. A query row that masks every key gets zeros (the local attention averages all values there). An integer
    `attention_mask` [b, s] is a `subtree_end` structure, and `packed_seq_params` (THD) a packed row, as
    `lightning_megatron.microbatch` defines them; with CP > 1 the inputs are this rank's tokens in Megatron's
    load-balanced layout and the layouts' positions are the whole row's.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.softmax_type != "vanilla":
            raise ValueError(
                f"softmax_type={config.softmax_type!r}: scaled_dot_product_attention has no softmax offset; "
                "set attention_backend: local"
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        self.cp_group = getattr(pg_collection, "cp", None)
        tp_size = pg_collection.tp.size()
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)
        # The local attention divides by `layer_number` under apply_query_key_layer_scaling and multiplies it back
        # inside its fp32 softmax; the net scale is this one. Multi-latent attention's key heads (`k_channels`)
        # differ from its value heads (`v_channels`) and set the scale, as in Transformer Engine's attention;
        # scaled_dot_product_attention takes values of any head size.
        key_channels = config.kv_channels if k_channels is None else k_channels
        self.softmax_scale = 1.0 / math.sqrt(key_channels) if softmax_scale is None else softmax_scale
        self.window_size = (
            config.window_size
            if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
            else None
        )
        self.attention_dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    # `lightning_megatron.cuda_graphs.full_iteration` sets it in the graph's own steps (warm-up, capture): causal
    # rows without a mask take the layout path (flex_attention on CUDA) instead of SDPA's cuDNN kernel, whose
    # backward cannot be captured in a CUDA graph
    causal_rows_through_layout: bool = False

    @property
    def cp_size(self) -> int:
        return self.cp_group.size() if self.cp_group is not None else 1

    @property
    def dropout_p(self) -> float:
        """The attention dropout in effect: none outside training."""
        return self.attention_dropout_p if self.training else 0.0

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
        structure = attention_mask if _is_structure(attention_mask) else None
        if packed_seq_params is not None:
            return self._packed_forward(query, key, value, mask_type, packed_seq_params)
        through_layout = (self.causal_rows_through_layout and query.is_cuda and attention_mask is None
                          and mask_type in _CAUSAL_TYPES and query.size(0) > 1)
        if structure is not None or (self.cp_size > 1 and query.size(0) > 1) or through_layout:
            return self._structured_forward(query, key, value, mask_type, structure)
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
        dropout_p = self.dropout_p
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
        """THD: each sequence of the pack attends only to itself; a token in no sequence (the slot padding of
        `cu_seqlens_padded`) gets zeros. Tensors are [t, heads, d] (this CP rank's tokens), output [t, heads * d].
        varlen_attn where `varlen_refusal` lets the row through, else the layout."""
        if packed.qkv_format != "thd":
            raise ValueError(f"packed_seq_params.qkv_format={packed.qkv_format!r}: SDPAttention packs only 'thd'")
        # Megatron's Attention squeezes the dummy batch dimension of THD tensors: [t, heads, d].
        query, key, value = (t.squeeze(1) if t.dim() == 4 else t for t in (query, key, value))
        if varlen_refusal(self.packed_call(query, key, value, packed, mask_type)) is None:
            return varlen_attention(query, key, value, packed.cu_seqlens_q, scale=self.softmax_scale,
                                    window=self.window_size).reshape(query.size(0), -1)
        layout = self._layout((packed.cu_seqlens_q, packed.cu_seqlens_q_padded), query.size(0), query.device,
                              lambda length: _packed_bounds(packed, length), mask_type)
        # [t, heads, d] -> [1, heads, t, d]; K and V of the whole row under CP
        q = query.transpose(0, 1).unsqueeze(0)
        k, v = (self._gather_context_parallel(t).transpose(0, 1).unsqueeze(0) for t in (key, value))
        return self._attend_layout(q, k, v, layout)[0].transpose(0, 1).reshape(query.size(0), -1)

    def packed_call(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, packed: PackedSeqParams,
                    mask_type: AttnMaskType) -> PackedCall:
        """What decides whether a packed row ([t, heads, d] tensors) takes varlen_attn (`varlen_refusal`)."""
        return PackedCall.of(query, key, value, packed, causal=mask_type in _CAUSAL_TYPES, window=self.window_size,
                             dropout_p=self.dropout_p, cp_size=self.cp_size)

    def _structured_forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask_type: AttnMaskType,
        subtree_end: torch.Tensor | None,
    ) -> torch.Tensor:
        """[s, b, heads, d] rows with a `subtree_end` structure, or causal / unmasked rows cut for CP > 1."""
        if subtree_end is not None:
            subtree_end = subtree_end.reshape(subtree_end.size(0), -1)
            if self.cp_size > 1 or subtree_end.size(1) != query.size(0):
                raise ValueError(f"attention_mask (subtree_end) of shape {tuple(subtree_end.shape)} does not fit "
                                 f"{query.size(0)} queries; tree rows need context_parallel_size: 1")
            layout = self._layout((subtree_end,), query.size(0), query.device,
                                  lambda length: _tree_bounds(subtree_end), AttnMaskType.causal)
        else:
            layout = self._layout((), query.size(0), query.device,
                                  lambda length: _row_bounds(length, query.device), mask_type)
        q = query.permute(1, 2, 0, 3)
        k, v = (self._gather_context_parallel(t).permute(1, 2, 0, 3) for t in (key, value))
        context = self._attend_layout(q, k, v, layout)
        return context.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), -1)

    def _gather_context_parallel(self, tensor: torch.Tensor) -> torch.Tensor:
        """All ranks' tokens along dim 0 (rank order); the backward sums the gradients and keeps this rank's."""
        if self.cp_size == 1:
            return tensor
        return gather_from_sequence_parallel_region(tensor, tensor_parallel_output_grad=True, group=self.cp_group)

    def _layout(self, keys: tuple, local_length: int, device: torch.device,
                bounds: Callable[[int], tuple[torch.Tensor, ...]], mask_type: AttnMaskType) -> Layout:
        """The microbatch's visibility on this CP rank; one per microbatch, shared by every layer."""
        cp_size = self.cp_size
        return build_layout(keys, local_length, device, bounds, causal=mask_type in _CAUSAL_TYPES,
                            window=self.window_size, cp_rank=self.cp_group.rank() if cp_size > 1 else 0,
                            cp_size=cp_size)

    def _attend_layout(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: Layout
                       ) -> torch.Tensor:
        """[b, heads, s, d] attention under `layout`: flex_attention on CUDA, SDPA with the dense mask elsewhere."""
        dropout_p = self.dropout_p
        enable_gqa = key.size(1) != query.size(1)
        if query.is_cuda and dropout_p == 0.0:
            return _compiled_flex_attention()(query, key, value, block_mask=layout.block_mask(query.size(0)),
                                              scale=self.softmax_scale, enable_gqa=enable_gqa)
        with self._dropout_rng(dropout_p):
            context = F.scaled_dot_product_attention(query, key, value, attn_mask=layout.dense_mask(),
                                                     dropout_p=dropout_p, scale=self.softmax_scale,
                                                     enable_gqa=enable_gqa)
        scale = layout.dense_output_scale()
        return context if scale is None else context * scale[:, None, :, None].to(context.dtype)


def _is_structure(attention_mask: torch.Tensor | None) -> bool:
    """An integer attention_mask is a `subtree_end` structure; a bool (or float) one is a mask."""
    return attention_mask is not None and not attention_mask.dtype.is_floating_point and \
        attention_mask.dtype != torch.bool


def _packed_bounds(packed: PackedSeqParams, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(t[None] for t in packed_row_bounds(packed.cu_seqlens_q, length, packed.cu_seqlens_q_padded))


def _tree_bounds(subtree_end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    end = subtree_end.long()
    position = torch.arange(end.size(1), device=end.device).expand_as(end)
    return position, end, torch.ones_like(end, dtype=torch.bool)


def _row_bounds(length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence filling the row (causal rows cut for CP), made on the device (no blocking copy)."""
    return (torch.zeros(1, length, dtype=torch.long, device=device),
            torch.full((1, length), length, dtype=torch.long, device=device),
            torch.ones(1, length, dtype=torch.bool, device=device))


@functools.cache
def _compiled_flex_attention() -> Any:
    """flex_attention compiled once per process; the BlockMask is an input, so microbatches of the same shape
    reuse the compiled kernel."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


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
