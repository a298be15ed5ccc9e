"""The visibility of one microbatch (its "layout") for `SDPAttention`, and the two masks made from it.

A layout says, in whole-row positions, which keys each of this rank's queries may see: key k is visible to query q
iff `key_lower[k] <= q < key_end[k]` (and `q - k <=` the left window). Packed rows, trees and context-parallel
chunks all reduce to it; it is built once per microbatch and shared by every layer (`_LAYOUT_CACHE`).

Two masks come from it:
- `dense_mask()`: [b, 1, sq, sk] bool for SDPA, the exact path (CPU, attention dropout). A token in no sequence (the
  slot padding of `cu_seqlens_padded`) sees only itself there, and its output is multiplied by zero after.
- `block_mask()`: flex_attention's BlockMask (CUDA). On the H200 (`bench/packing_profile.py`) the kernel time of a
  packed row equals a full row's; what cost more was the host: `create_block_mask` evaluates the mask function on
  every (query, key) pair through four nested vmaps (an s x s tensor and dozens of small kernels per microbatch),
  and deciding whether to multiply by the membership read the device (`bool(member.all())`, a sync per microbatch).
  Here the block mask comes from the per-key bounds with a few tensor ops and no host read: the queries' whole-row
  positions ascend (also in context parallelism's load-balanced order, chunk r then chunk 2cp-1-r of each
  sequence), so the queries that see key k form one contiguous range of query indices,
  `[searchsorted(key_lower[k]), searchsorted(visible_end[k]))`. A (query block, key block) pair is full when every
  key's range covers the query block and partial when some key's range meets it: [b, sq / 128, sk] booleans, never
  an s x s tensor. The result equals `create_block_mask`'s (block counts, indices and dense mask; tests compare
  them, and `BLOCK_MASK_BUILDER` keeps `create_block_mask` for the benchmark's before/after). On this path a token
  in no sequence sees no key (its keys' visible range is empty), and flex_attention gives zeros for a query that
  sees nothing: the same zeros as the dense path, with no multiply and no host read.

Context-parallel positions are computed on the device from `cu_seqlens` (the formula of
`lightning_megatron.microbatch.context_parallel_positions`, which reads boundaries on the host).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

BLOCK_SIZE = 128
"""flex_attention's sparse block (queries and keys); 64 did not compile on the H200 (research note)."""

BLOCK_MASK_BUILDER = "bounds"
"""How `Layout.block_mask` builds the BlockMask: "bounds" (tensor ops on the layout's bounds) or
"create_block_mask" (the mask function evaluated on every pair: the reference, kept for the benchmark)."""


@dataclasses.dataclass
class Layout:
    """Whole-row positions of this rank's queries (ascending) and of all keys; key k is visible to query q iff
    key_lower[k] <= q < key_end[k] (and q - k <= the left window). `key_member` / `query_member`: whether the
    token belongs to a sequence. All [b or 1, s]."""

    query_position: torch.Tensor
    key_position: torch.Tensor
    key_lower: torch.Tensor
    key_end: torch.Tensor
    query_member: torch.Tensor
    key_member: torch.Tensor
    window: tuple[int, int] | None
    _dense: torch.Tensor | None = None
    _block_masks: dict = dataclasses.field(default_factory=dict)

    def dense_mask(self) -> torch.Tensor:
        """[b or 1, 1, sq, sk] bool, True = attend (SDPA's meaning); a token of no sequence sees itself."""
        if self._dense is None:
            q = self.query_position[:, :, None]
            visible = (self.key_lower[:, None, :] <= q) & (q < self.key_end[:, None, :])
            if self.window is not None:
                visible &= q - self.key_position[:, None, :] <= self.window[0]
            self._dense = visible[:, None]
        return self._dense

    def dense_output_scale(self) -> torch.Tensor | None:
        """[b or 1, sq] membership to multiply the dense path's output by, None when every query is a member (a
        host read: the dense path is the CPU's, or CUDA's with attention dropout)."""
        return None if bool(self.query_member.all()) else self.query_member

    def visible_end(self) -> torch.Tensor:
        """The flex path's exclusive end per key: window folded in, and empty for a key of no sequence."""
        end = torch.where(self.key_member, self.key_end, self.key_lower)
        if self.window is not None:
            end = torch.minimum(end, self.key_position + self.window[0] + 1)
        return end

    def block_mask(self, batch: int) -> Any:
        """flex_attention's BlockMask of this layout for `batch` rows (built once, reused by every layer)."""
        if batch not in self._block_masks:
            query_position, key_lower, visible_end = (
                t.expand(batch, -1).contiguous() for t in (self.query_position, self.key_lower, self.visible_end()))
            build = _block_mask_from_bounds if BLOCK_MASK_BUILDER == "bounds" else _block_mask_from_mask_mod
            self._block_masks[batch] = build(query_position, key_lower, visible_end)
        return self._block_masks[batch]


def _mask_mod(query_position: torch.Tensor, key_lower: torch.Tensor, visible_end: torch.Tensor
              ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    def visible(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        position = query_position[b, q]
        return (key_lower[b, kv] <= position) & (position < visible_end[b, kv])

    return visible


def _block_mask_from_mask_mod(query_position: torch.Tensor, key_lower: torch.Tensor, visible_end: torch.Tensor
                              ) -> Any:
    """The reference: `create_block_mask` evaluates the mask function on every (query, key) pair."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(_mask_mod(query_position, key_lower, visible_end), query_position.size(0), None,
                             query_position.size(1), key_lower.size(1), device=query_position.device,
                             BLOCK_SIZE=BLOCK_SIZE)


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query block, the number of marked key blocks and all key block indices, marked ones first in ascending
    order (then the rest ascending): `create_block_mask`'s order."""
    blocks = blocks.to(torch.int32)
    return (blocks.sum(-1, dtype=torch.int32),
            torch.argsort(blocks, dim=-1, descending=True, stable=True).to(torch.int32))


def _block_mask_from_bounds(query_position: torch.Tensor, key_lower: torch.Tensor, visible_end: torch.Tensor) -> Any:
    """The BlockMask from per-key bounds with tensor ops (see the module docstring); equal to
    `_block_mask_from_mask_mod`'s."""
    from torch.nn.attention.flex_attention import BlockMask

    batch, sq = query_position.shape
    sk = key_lower.size(1)
    q_blocks, kv_blocks = -(-sq // BLOCK_SIZE), -(-sk // BLOCK_SIZE)
    # the query indices that see key k: [first, stop)
    first = torch.searchsorted(query_position, key_lower)
    stop = torch.searchsorted(query_position, visible_end)
    block_start = torch.arange(q_blocks, device=query_position.device)[None, :, None] * BLOCK_SIZE
    first, stop = first[:, None, :], stop[:, None, :]
    meets = (first < stop) & (first < block_start + BLOCK_SIZE) & (stop > block_start)  # [b, q blocks, sk]
    covers = (first <= block_start) & (stop >= block_start + BLOCK_SIZE)  # a last, short query block never is
    pad = kv_blocks * BLOCK_SIZE - sk  # keys past the row: never visible, as create_block_mask pads
    if pad:
        meets, covers = (torch.nn.functional.pad(t, (0, pad)) for t in (meets, covers))
    meets = meets.view(batch, q_blocks, kv_blocks, BLOCK_SIZE).any(-1)
    full = covers.view(batch, q_blocks, kv_blocks, BLOCK_SIZE).all(-1)
    kv_num_blocks, kv_indices = _ordered(meets & ~full)
    full_kv_num_blocks, full_kv_indices = _ordered(full)
    return BlockMask.from_kv_blocks(kv_num_blocks[:, None], kv_indices[:, None], full_kv_num_blocks[:, None],
                                    full_kv_indices[:, None], BLOCK_SIZE=BLOCK_SIZE,
                                    mask_mod=_mask_mod(query_position, key_lower, visible_end), seq_lengths=(sq, sk))


class _LayoutCache:
    """The last microbatch's layout, keyed by the tensors it was built from (kept alive here, so that an equal
    data pointer means the same tensor) and by what else shapes it."""

    def __init__(self) -> None:
        self._entry: tuple[tuple, tuple, Layout] | None = None

    def get(self, keys: tuple, signature: tuple) -> Layout | None:
        if self._entry is None:
            return None
        cached_keys, cached_signature, layout = self._entry
        if cached_signature != signature or len(cached_keys) != len(keys):
            return None
        return layout if all(same_tensor(a, b) for a, b in zip(cached_keys, keys)) else None

    def put(self, keys: tuple, signature: tuple, layout: Layout) -> None:
        self._entry = (keys, signature, layout)

    def clear(self) -> None:
        self._entry = None


def same_tensor(cached: Any, given: Any) -> bool:
    """Whether `given` is `cached` (kept alive by the caller), unchanged since: the same storage, shape and dtype,
    and no in-place write in between."""
    if cached is given:
        return True
    if not isinstance(cached, torch.Tensor) or not isinstance(given, torch.Tensor):
        return False
    return (cached.data_ptr() == given.data_ptr() and cached.shape == given.shape and cached.dtype == given.dtype
            and cached.device == given.device and cached._version == given._version)


_LAYOUT_CACHE = _LayoutCache()


def forget_cached_layout() -> None:
    """Forget the last microbatch's layout (a CUDA graph capture builds its own, in the graph's memory pool)."""
    _LAYOUT_CACHE.clear()


def build_layout(keys: tuple, local_length: int, device: torch.device,
                 bounds: Callable[[int], tuple[torch.Tensor, ...]], *, causal: bool, window: tuple[int, int] | None,
                 cp_rank: int = 0, cp_size: int = 1) -> Layout:
    """The layout of a microbatch on CP rank `cp_rank` of `cp_size`, from `bounds(whole row length)` (each
    [b or 1, length]: sequence start, exclusive end, membership); cached on the tensors in `keys` (`cu_seqlens`
    and `cu_seqlens_padded` of a packed row, `subtree_end` of a tree row, none for a plain row)."""
    signature = (local_length, cp_rank, cp_size, causal, window, device)
    cached = _LAYOUT_CACHE.get(keys, signature)
    if cached is not None:
        return cached
    length = local_length * cp_size
    lower, end, member = (t.to(device) for t in bounds(length))
    if cp_size > 1:
        slots = _cp_slots(keys, device)
        rank_positions = [context_parallel_positions_on_device(slots, length, rank, cp_size)
                          for rank in range(cp_size)]
        query_position, key_position = rank_positions[cp_rank], torch.cat(rank_positions)
    else:
        query_position = key_position = torch.arange(length, device=device)
    rows = end.size(0)
    key_end = end[:, key_position]
    layout = Layout(
        query_position=query_position.expand(rows, -1), key_position=key_position.expand(rows, -1),
        key_lower=key_position.expand_as(key_end) if causal else lower[:, key_position], key_end=key_end,
        query_member=member[:, query_position], key_member=member[:, key_position], window=window)
    _LAYOUT_CACHE.put(keys, signature, layout)
    return layout


def _cp_slots(keys: tuple, device: torch.device) -> torch.Tensor:
    """The starts of the segments Megatron's CP layout cuts: the packed slots, or the whole row."""
    if not keys:
        return torch.zeros(1, dtype=torch.long, device=device)
    cu_seqlens, padded = keys
    return (cu_seqlens if padded is None else padded).to(device).long()


def context_parallel_positions_on_device(slots: torch.Tensor, length: int, cp_rank: int, cp_size: int
                                         ) -> torch.Tensor:
    """`lightning_megatron.microbatch.context_parallel_positions` without host reads: the whole-row positions that
    rank `cp_rank` holds, for segments starting at `slots` (whose last entry, or `length`, ends the last one). Each
    segment must be a multiple of `2 * cp_size` long (`check_microbatch` refuses others before the first step)."""
    bounds = torch.cat([slots, slots.new_full((1,), length)])  # a last, empty segment when slots end at length
    local_lengths = (bounds[1:] - bounds[:-1]) // cp_size
    local_ends = local_lengths.cumsum(0)
    token = torch.arange(length // cp_size, device=slots.device)
    segment = torch.searchsorted(local_ends, token, right=True)
    in_segment = token - (local_ends[segment] - local_lengths[segment])
    chunk = local_lengths[segment] // 2
    offset = torch.where(in_segment < chunk, cp_rank * chunk + in_segment,
                         (2 * cp_size - 2 - cp_rank) * chunk + in_segment)
    return bounds[segment] + offset
