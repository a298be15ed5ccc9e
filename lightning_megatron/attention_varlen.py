"""Packed rows through PyTorch's variable-length FlashAttention (`torch.nn.attention.varlen.varlen_attn`).

Why: on an H100 profile of a Qwen3-0.6B step (issue 41: packed rows of 4096, the default settings) flex_attention
took 112 ms of the step's 767 ms of GPU time. FlashAttention 2's varlen kernel reads a packed row as Megatron hands
it over ([t, heads, d] and int32 `cu_seqlens`), sees only each sequence's own keys by construction and needs neither
a block mask per microbatch nor a compile.

`SDPAttention` asks `varlen_refusal` where it chooses a packed row's path; what is refused keeps the layout path
(flex_attention on CUDA, the dense mask elsewhere). Covered: a packed THD row, causal per sequence (`causal`,
`padding_causal`), optionally with a sliding window (W, 0), on a CUDA device of compute capability 8.0 or newer
(not ROCm), bf16 or fp16, any number of key/value groups (GQA), query/key and value heads of one size, a multiple of
8 and at most 256, with torch's `varlen_attn(..., scale=, window_size=)` (torch 2.11 or newer). Refused, each with
its reason (`REFUSALS`): the switch not on (`OPT_IN`), an older torch, another device, fp32, other head sizes, bidirectional rows,
attention dropout (the kernel has none), context parallelism (each rank's queries see the whole row's keys) and slot
padding (`cu_seqlens_padded`: the tokens past a sequence in its slot get zeros on the layout path). A packed row
carries no other mask: trees (`subtree_end`) and explicit masks never come with `packed_seq_params`.

What the call is made of is known on the host, so nothing is read back from the device and a CUDA graph captures it:
- `max_q = max_k =` the row length, whatever `max_seqlen` says: every sequence fits. FlashAttention launches
  ceil(max / 128) query blocks per sequence and head, and those past a sequence's end return at once; under the
  whole-iteration graph `max_seqlen` is the row length - 1 anyway (one bound for every replayed row).
- the row's `cu_seqlens` with the row's end appended: the kernel writes only the tokens of its sequences (forward
  and backward), so tokens after the last boundary, which the microbatch contract excludes (`check_microbatch`),
  would read uninitialised memory; appended, they are one more causal sequence (on the contract's rows it is empty).
  The layout path gives them zeros; no token of a sequence sees them on either path.
- fewer key/value heads go in as they are (FlashAttention 2 shares each among its group of query heads; torch 2.11's
  `varlen_attn` takes them without a flag, later ones with `enable_gqa=True`, which is passed where it exists).
Under the whole-iteration graph `cu_seqlens` are its static buffers, padded to `cuda_graph_sequences_per_row`
sequences (empty ones at the row's end): each costs the kernel blocks that return at once (ceil(row / 128) per head
forward, as many backward), and its backward a float32 dQ accumulator of (row + 128 x sequences) rows x heads x
head_dim (303 MB for 256 sequences in a row of 4096 at Qwen3-0.6B's 16 heads of 128, freed after each layer);
`bench/packing.py` (`packed_graph_varlen` against `packed_graph`, and `core_attention`) measures what that costs
against flex_attention. torch 2.11 and 2.14 run FlashAttention 2 for these calls; later torch may choose cuDNN for
them (its `varlen_attn` picks the backend).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from lightning_megatron._compat.compiled import switched_on

OPT_IN = "LIGHTNING_MEGATRON_FAST_VARLEN"
"""1 takes varlen_attn where it applies; unset or 0 keeps flex_attention for packed rows on CUDA. Off by default until a
GPU run shows it faster: an earlier H200 measurement (`../shared/research/cuda-graphs-and-host-overhead.md`) timed
varlen_attn at 1.36 ms against flex's 0.63 ms for one row of 4096 (wall time), and under the whole-iteration graph
each of the 256 padded sequences costs it blocks that flex skips (`bench/packing.py`'s `core_attention` measures
both). Read at every call, so a benchmark or a test can switch it between calls; any value but 0 or 1 is refused."""

FLASH_DTYPES = (torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class PackedCall:
    """What decides a packed row's path, all known on the host: shapes, dtypes, device and options, no values."""

    device: torch.device
    capability: tuple[int, int] | None  # the CUDA device's compute capability; None elsewhere
    dtype: torch.dtype
    query_heads: int
    key_heads: int
    head_dim: int  # the queries' and the keys'
    value_head_dim: int
    causal: bool
    window: tuple[int, int] | None  # Megatron's (left, right) sliding window, None without
    dropout_p: float  # attention dropout in effect (0 outside training)
    cp_size: int
    slot_padding: bool  # `cu_seqlens_padded` given

    @classmethod
    def of(cls, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, packed: Any, *, causal: bool,
           window: tuple[int, int] | None, dropout_p: float, cp_size: int) -> PackedCall:
        """The call of [t, heads, d] `query`, `key` and `value` with `PackedSeqParams` `packed`."""
        device = query.device
        return cls(device=device, capability=_capability(device) if device.type == "cuda" else None,
                   dtype=query.dtype, query_heads=query.size(1), key_heads=key.size(1), head_dim=query.size(-1),
                   value_head_dim=value.size(-1), causal=causal, window=None if window is None else tuple(window),
                   dropout_p=dropout_p, cp_size=cp_size, slot_padding=packed.cu_seqlens_q_padded is not None)


class Refusal(NamedTuple):
    applies: Callable[[PackedCall], bool]
    reason: Callable[[PackedCall], str]


def _switched_off(call: PackedCall) -> bool:
    return not switched_on(OPT_IN, "flex_attention for packed rows", "varlen_attn where it applies", default=False)


def _head_dims_fit(call: PackedCall) -> bool:
    return call.head_dim == call.value_head_dim and call.head_dim % 8 == 0 and call.head_dim <= MAX_HEAD_DIM


REFUSALS: tuple[Refusal, ...] = (  # in order: the first that applies is the reason
    Refusal(_switched_off, lambda call: f"{OPT_IN} is not 1 (opt-in)"),
    Refusal(lambda call: varlen_kernel() is None,
            lambda call: f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn taking scale and "
                         "window_size (torch 2.11 or newer)"),
    Refusal(lambda call: call.device.type != "cuda" or torch.version.hip is not None,
            lambda call: f"the row is on {call.device.type}{' (ROCm)' if torch.version.hip else ''}, not a CUDA "
                         "device"),
    Refusal(lambda call: call.capability is None or call.capability < (8, 0),
            lambda call: f"compute capability {call.capability}: FlashAttention 2 needs 8.0 or newer"),
    Refusal(lambda call: call.dtype not in FLASH_DTYPES,
            lambda call: f"dtype {call.dtype}: FlashAttention takes bf16 or fp16"),
    Refusal(lambda call: not _head_dims_fit(call),
            lambda call: f"head sizes {call.head_dim} (queries, keys) and {call.value_head_dim} (values): "
                         f"FlashAttention takes one size, a multiple of 8, at most {MAX_HEAD_DIM}"),
    Refusal(lambda call: not call.causal, lambda call: "bidirectional (not causal) packed rows"),
    Refusal(lambda call: call.window is not None and call.window[0] < 0,
            lambda call: f"window_size {call.window}: a sliding window needs a left size of 0 or more"),
    Refusal(lambda call: call.dropout_p > 0.0,
            lambda call: f"attention dropout {call.dropout_p} while training: varlen_attn has none"),
    Refusal(lambda call: call.cp_size > 1,
            lambda call: f"context_parallel_size {call.cp_size}: each rank's queries see the whole row's keys"),
    Refusal(lambda call: call.slot_padding,
            lambda call: "cu_seqlens_padded (slot padding): the tokens past a sequence in its slot get zeros"),
)


def varlen_refusal(call: PackedCall) -> str | None:
    """Why the packed row of `call` keeps the layout path (the first row of `REFUSALS` that applies), or None: it
    takes `varlen_attention`."""
    return next((row.reason(call) for row in REFUSALS if row.applies(call)), None)


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, *,
                     scale: float, window: tuple[int, int] | None) -> torch.Tensor:
    """Each packed sequence's causal attention to itself: [t, heads, d] queries, [t, groups, d] keys and values,
    `cu_seqlens` the row's boundaries (from 0; a call `varlen_refusal` lets through) -> [t, heads, d]."""
    length = query.size(0)
    boundaries = with_row_end(cu_seqlens.to(device=query.device, dtype=torch.int32), length)
    return varlen_kernel()(query, key, value, boundaries, boundaries, length, length,
                           **varlen_keywords(query.size(1), key.size(1), scale, window, _parameters()))


def with_row_end(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """`cu_seqlens` with `length` appended: the tokens after the last boundary become one more sequence (an empty
    one where the boundaries end at the row's end), made on the device with no host read."""
    return F.pad(cu_seqlens, (0, 1), value=length)


def varlen_keywords(query_heads: int, key_heads: int, scale: float, window: tuple[int, int] | None,
                    parameters: Mapping[str, Any]) -> dict[str, Any]:
    """`varlen_attn`'s keyword arguments: causal is `window_size=(-1, 0)`, a sliding window of W keys back
    `(W, 0)`; `enable_gqa` where the signature (`parameters`) has it and the heads differ."""
    keywords: dict[str, Any] = {"scale": scale, "window_size": (-1, 0) if window is None else (window[0], 0)}
    if key_heads != query_heads and "enable_gqa" in parameters:
        keywords["enable_gqa"] = True
    return keywords


@functools.cache
def varlen_kernel() -> Callable[..., torch.Tensor] | None:
    """torch's `varlen_attn` where it takes `scale` and `window_size` (torch 2.11 or newer), else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn if takes_scale_and_window(varlen_attn) else None


def takes_scale_and_window(function: Callable[..., Any]) -> bool:
    """Whether `function` takes `scale` and `window_size` (torch 2.10's `varlen_attn` takes `is_causal` instead)."""
    parameters = inspect.signature(function).parameters
    return "scale" in parameters and "window_size" in parameters


@functools.cache
def _parameters() -> Mapping[str, Any]:
    return inspect.signature(varlen_kernel()).parameters


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)
