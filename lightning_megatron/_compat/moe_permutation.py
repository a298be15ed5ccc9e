"""The all-to-all dispatcher's token permutation with gathers only: no atomic adds of bf16 rows.

Without Transformer Engine's fused permutation (`moe_permute_fusion` needs it) megatron-core permutes a MoE layer's
tokens with `index_select` (megatron/core/transformer/moe/moe_utils.py:447-465), whose backward adds every row
back into its token with `index_add_`, and restores them with `scatter_add_` (:535-565): on a GPU both are atomic
adds of bf16 rows, the slowest kernels of `bench/moe.py`'s MoE layer besides its GEMMs (25 ms of a 0.51 s step on
an H100: `bench/results/h100_2026-12-06b/moe.json`'s profile, `indexFuncLargeIndex` and
`_scatter_gather_elementwise_kernel`, each at about a tenth of the memory bandwidth).

Each token the router sends to exactly `moe_router_topk` experts: dropless top-k routing (router.py's `topk`),
without the padding for quantization. The rows of one token, sorted by token (`sorted_indices.argsort(stable=True)`,
once per layer, kept with the permutation), then lie in k consecutive places, so adding them back is a gather and a
sum over k, and the restore's backward is the permutation's gather again. The sum over k adds in float32 and rounds
once (upstream's atomics round after every add, in no fixed order): equal to bf16 rounding, and deterministic.

`megatron_core.moe_permutation_by_gather` applies on CUDA, where upstream's `permute` and `unpermute` still take
those paths (read from their source), and per call only inside `MoEAlltoAllTokenDispatcher.dispatch_preprocess` and
`combine_postprocess` (the full routing map, every token's k rows), unfused, dropless, unpadded, without merging
probabilities in `unpermute` (the all-to-all dispatcher applies them in the experts), when the rows number tokens x k.
Everything else, and the CPU, runs upstream's code.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from lightning_megatron._compat._adjustment import Adjustment, Patches

# the top-k of the all-to-all dispatcher call running now, where each token has exactly that many rows
_ROWS_PER_TOKEN: contextvars.ContextVar[int | None] = contextvars.ContextVar("rows_per_token", default=None)
# a permutation's `sorted_indices` -> its rows sorted by token, for the restore that undoes it (keyed by identity:
# tensors compare by value)
_ROWS_BY_TOKEN = WeakIdKeyDictionary()


class _GatherRows(torch.autograd.Function):
    """`tokens[sorted_indices]`, whose backward sums each token's k rows (`rows_by_token`: their places, k by k)."""

    @staticmethod
    def forward(ctx: Any, tokens: torch.Tensor, sorted_indices: torch.Tensor, rows_by_token: torch.Tensor,
                rows_per_token: int) -> torch.Tensor:
        ctx.save_for_backward(rows_by_token)
        ctx.rows_per_token = rows_per_token
        return tokens.index_select(0, sorted_indices)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (rows_by_token,) = ctx.saved_tensors
        return _sum_rows_per_token(grad, rows_by_token, ctx.rows_per_token), None, None, None


class _SumRowsPerToken(torch.autograd.Function):
    """Each token's k rows summed (upstream's `scatter_add_` of the rows into zeros), whose backward is a gather."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, sorted_indices: torch.Tensor, rows_by_token: torch.Tensor,
                rows_per_token: int) -> torch.Tensor:
        ctx.save_for_backward(sorted_indices)
        return _sum_rows_per_token(rows, rows_by_token, rows_per_token)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (sorted_indices,) = ctx.saved_tensors
        return grad.index_select(0, sorted_indices), None, None, None


def gathers_pay_off(tokens: torch.Tensor) -> bool:
    """Atomic adds are the GPU's cost; the CPU keeps upstream's ops."""
    return tokens.is_cuda


def _sum_rows_per_token(rows: torch.Tensor, rows_by_token: torch.Tensor, rows_per_token: int) -> torch.Tensor:
    gathered = rows.index_select(0, rows_by_token)
    return gathered.view(-1, rows_per_token, rows.size(-1)).sum(1, dtype=torch.float32).to(rows.dtype)


def _rows_by_token(sorted_indices: torch.Tensor) -> torch.Tensor:
    rows = _ROWS_BY_TOKEN.get(sorted_indices)
    if rows is None:
        rows = _ROWS_BY_TOKEN[sorted_indices] = sorted_indices.argsort(stable=True)
    return rows


def permute_by_gather(permute: Any, tokens: torch.Tensor, routing_map: torch.Tensor,
                      probs: torch.Tensor | None = None, num_out_tokens: int | None = None, fused: bool = False,
                      drop_and_pad: bool = False, tokens_per_expert: torch.Tensor | None = None,
                      align_size: int = 0) -> tuple[Any, ...]:
    """Upstream's `permute` (moe_utils.py:337-465); its argsort path's rows gathered with a summing backward."""
    rows_per_token = _ROWS_PER_TOKEN.get()
    if (rows_per_token is None or fused or drop_and_pad or align_size or not gathers_pay_off(tokens)
            or num_out_tokens != tokens.size(0) * rows_per_token):
        return permute(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=fused,
                       drop_and_pad=drop_and_pad, tokens_per_expert=tokens_per_expert, align_size=align_size)
    num_tokens = tokens.size(0)
    # as upstream's argsort path (moe_utils.py:447-462): [experts, tokens] row-major, the routed ones first
    flat_sorted = routing_map.bool().T.contiguous().reshape(-1).argsort(descending=True, stable=True)
    flat_sorted = flat_sorted[:num_out_tokens]
    sorted_indices = flat_sorted % num_tokens
    permuted_probs = probs.T.contiguous().reshape(-1)[flat_sorted] if probs is not None else None
    rows = _GatherRows.apply(tokens, sorted_indices, _rows_by_token(sorted_indices), rows_per_token)
    return rows, permuted_probs, sorted_indices, None, tokens_per_expert


def unpermute_by_gather(unpermute: Any, permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
                        restore_shape: torch.Size, probs: torch.Tensor | None = None,
                        routing_map: torch.Tensor | None = None, fused: bool = False, drop_and_pad: bool = False,
                        pad_offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Upstream's `unpermute` (moe_utils.py:470-565) without merged probabilities: each token's rows summed."""
    rows_per_token = _ROWS_PER_TOKEN.get()
    if (rows_per_token is None or fused or drop_and_pad or probs is not None or pad_offsets is not None
            or not gathers_pay_off(permuted_tokens) or sorted_indices.numel() != restore_shape[0] * rows_per_token):
        return unpermute(permuted_tokens, sorted_indices, restore_shape, probs=probs, routing_map=routing_map,
                         fused=fused, drop_and_pad=drop_and_pad, pad_offsets=pad_offsets)
    return _SumRowsPerToken.apply(permuted_tokens, sorted_indices, _rows_by_token(sorted_indices), rows_per_token)


@contextlib.contextmanager
def _rows_per_token(dispatcher: Any) -> Iterator[None]:
    """Within the dispatcher's call: its top-k, where every token has exactly that many rows (dropless, no padding
    for quantization, unfused), else nothing (upstream's permutation)."""
    config = dispatcher.config
    exact = not (dispatcher.drop_and_pad or config.moe_router_padding_for_quantization or config.moe_permute_fusion)
    token = _ROWS_PER_TOKEN.set(config.moe_router_topk if exact else None)
    try:
        yield
    finally:
        _ROWS_PER_TOKEN.reset(token)


def _upstream_permutes_with_atomic_adds() -> bool:
    from megatron.core.transformer.moe import moe_utils

    return ("argsort(descending=True, stable=True)" in inspect.getsource(moe_utils.permute)
            and "tokens.index_select(0, sorted_indices)" in inspect.getsource(moe_utils.permute)
            and "scatter_add_" in inspect.getsource(moe_utils.unpermute))


def _needed() -> bool:
    return torch.cuda.is_available() and _upstream_permutes_with_atomic_adds()


def _install(patches: Patches) -> None:
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as Dispatcher

    dispatch_preprocess, combine_postprocess = Dispatcher.dispatch_preprocess, Dispatcher.combine_postprocess

    @functools.wraps(dispatch_preprocess)
    def dispatch_preprocess_by_gather(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _rows_per_token(self):
            return dispatch_preprocess(self, *args, **kwargs)

    @functools.wraps(combine_postprocess)
    def combine_postprocess_by_gather(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _rows_per_token(self):
            return combine_postprocess(self, *args, **kwargs)

    patches.setattr(token_dispatcher, "permute", functools.partial(permute_by_gather, token_dispatcher.permute))
    patches.setattr(token_dispatcher, "unpermute", functools.partial(unpermute_by_gather, token_dispatcher.unpermute))
    patches.setattr(Dispatcher, "dispatch_preprocess", dispatch_preprocess_by_gather)
    patches.setattr(Dispatcher, "combine_postprocess", combine_postprocess_by_gather)


PERMUTATION_BY_GATHER = Adjustment(
    "megatron_core.moe_permutation_by_gather",
    "megatron/core/transformer/moe/moe_utils.py:447-465 permute's index_select (backward: index_add_ of bf16 rows) "
    "and :535-565 unpermute's scatter_add_, atomic adds on a GPU, called by "
    "megatron/core/transformer/moe/token_dispatcher.py:659-672 and :884-891 without Transformer Engine's fused "
    "permutation",
    _needed,
    _install,
)

MEGATRON_CORE_ADJUSTMENTS = (PERMUTATION_BY_GATHER,)
