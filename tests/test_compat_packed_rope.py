"""Megatron-Core's unfused THD RoPE reads `cu_seqlens` on the host and loops over the packed sequences; the
vectorized replacement gives bit-identical results with neither, for every CP rank, both `freqs` forms and every
rotary option, and leaves a packed GPT's losses and gradients exactly as they were."""

from __future__ import annotations

import collections
import importlib.util
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from lightning_megatron._compat import packed_rope
from lightning_megatron.layout import model_inputs
from tests._megatron import VOCAB
from tests.test_attention import _tiny_mtp_gpt

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                                reason="the adjustment applies only without Transformer Engine's fused THD RoPE")

(ADJUSTMENT,) = packed_rope.ADJUSTMENTS
HEADS, HEAD_DIM = 3, 16
HOST_READS = ("item", "tolist", "__int__", "__index__", "__bool__", "__float__")


class _CpGroup:
    """What the THD RoPE asks of a CP group: its size and this rank (nothing is communicated)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class _HostReads(TorchFunctionMode):
    """Counts reads of tensor values into Python (each a device sync on a GPU) and all torch calls."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: collections.Counter[str] = collections.Counter()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.calls += 1
        if getattr(func, "__name__", None) in HOST_READS:
            self.reads[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def _upstream_thd() -> Any:
    with ADJUSTMENT.suspended():
        from megatron.core.models.common.embeddings import rope_utils

        return rope_utils._apply_rotary_pos_emb_thd


def _case(lengths: list[int], cp_size: int, cp_rank: int, packed_freqs: bool, rotary_dim: int,
          dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's [t, heads, d] tokens of a row of `lengths`, the whole row's cu_seqlens, and the freqs
    [max length or row, 1, 1, rotary_dim] (Megatron's table: the angles twice, as RotaryEmbedding makes them)."""
    generator = torch.Generator().manual_seed(seed)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    t = torch.randn(sum(lengths) // cp_size, HEADS, HEAD_DIM, generator=generator).to(dtype)
    positions = sum(lengths) if packed_freqs else max(lengths)
    angles = torch.rand(positions, rotary_dim // 2, generator=generator) * positions
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]
    return t, cu_seqlens, freqs


def _output_and_grad(apply: Any, t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor,
                     **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    t = t.clone().requires_grad_()
    output = apply(t, cu_seqlens, freqs, **kwargs)
    weights = torch.randn(output.shape, generator=torch.Generator().manual_seed(1)).to(output.dtype)
    (output * weights).sum().backward()
    return output.detach(), t.grad


# CP=1 takes any lengths; CP > 1 needs multiples of 2 x CP (one sequence of exactly 2 x CP in each)
LENGTHS = {1: [5, 1, 12, 2, 7, 1], 2: [8, 4, 12, 20, 4], 4: [16, 8, 24, 8, 40]}
CASES = [(cp_size, cp_rank) for cp_size in LENGTHS for cp_rank in range(cp_size)]
OPTIONS = [
    dict(),
    dict(rotary_interleaved=True),
    dict(mla_rotary_interleaved=True, mscale=0.7),
    dict(rotary_interleaved=True, mla_rotary_interleaved=True, mscale=1.3),
]


@pytest.mark.parametrize(("cp_size", "cp_rank"), CASES, ids=[f"cp{size}_rank{rank}" for size, rank in CASES])
@pytest.mark.parametrize("packed_freqs", [False, True], ids=["max_length_freqs", "packed_freqs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bit_identical_to_upstream(process_group, cp_size, cp_rank, packed_freqs, dtype):
    upstream = _upstream_thd()
    group = _CpGroup(cp_size, cp_rank)
    for seed, options in enumerate(OPTIONS):
        for rotary_dim in (HEAD_DIM, HEAD_DIM // 2):  # all of each head, or a part (the rest passes through)
            t, cu_seqlens, freqs = _case(LENGTHS[cp_size], cp_size, cp_rank, packed_freqs, rotary_dim, dtype, seed)
            expected = _output_and_grad(upstream, t, cu_seqlens, freqs, cp_group=group, **options)
            actual = _output_and_grad(packed_rope.apply_rotary_pos_emb_thd, t, cu_seqlens, freqs, cp_group=group,
                                      **options)
            for name, a, e in zip(("output", "grad"), actual, expected):
                assert a.dtype == e.dtype and torch.equal(a, e), (name, options, rotary_dim)


def test_upstream_reads_the_host_and_loops_per_sequence_ours_does_neither(process_group):
    """The reason for the adjustment, shown on upstream: host reads (device syncs) and torch calls that grow with
    the number of packed sequences; ours reads nothing and makes the same calls for 2 or 32 sequences."""
    upstream = _upstream_thd()
    group = _CpGroup(2, 1)

    def count(apply: Any, sequences: int) -> _HostReads:
        t, cu_seqlens, freqs = _case([4] * sequences, 2, 1, False, HEAD_DIM, torch.float32, 0)
        with _HostReads() as reads:
            apply(t, cu_seqlens, freqs, cp_group=group)
        return reads

    few, many = count(upstream, 2), count(upstream, 32)
    assert few.reads["tolist"] == 1 and few.reads["item"] >= 1
    assert many.calls > few.calls + 30 * 3
    few, many = count(packed_rope.apply_rotary_pos_emb_thd, 2), count(packed_rope.apply_rotary_pos_emb_thd, 32)
    assert not few.reads and not many.reads
    assert many.calls == few.calls


def test_refuses_a_missing_cp_group_and_keeps_the_deprecated_argument(process_group):
    t, cu_seqlens, freqs = _case([4, 6], 1, 0, False, HEAD_DIM, torch.float32, 0)
    with pytest.raises(ValueError, match="cp_group must be provided"):
        packed_rope.apply_rotary_pos_emb_thd(t, cu_seqlens, freqs)
    with pytest.warns(DeprecationWarning, match="multi_latent_attention"):
        actual = packed_rope.apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=_CpGroup(1, 0),
                                                      multi_latent_attention=True)
    upstream = _upstream_thd()(t, cu_seqlens, freqs, cp_group=_CpGroup(1, 0), mla_rotary_interleaved=True)
    assert torch.equal(actual, upstream)


def test_applied_only_without_the_fused_thd_kernel(process_group, monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils

    assert ADJUSTMENT.active and rope_utils._apply_rotary_pos_emb_thd is packed_rope.apply_rotary_pos_emb_thd
    upstream = _upstream_thd()
    with ADJUSTMENT.suspended():
        monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", lambda *args, **kwargs: None)
        assert not ADJUSTMENT.apply()  # Transformer Engine's fused kernel serves THD rows itself
        assert rope_utils._apply_rotary_pos_emb_thd is upstream
        monkeypatch.undo()
    assert ADJUSTMENT.active and rope_utils._apply_rotary_pos_emb_thd is packed_rope.apply_rotary_pos_emb_thd


def test_packed_gpt_with_mtp_gives_upstreams_losses_and_gradients(model_parallel):
    """A packed row through a local-spec GPT and its MTP layer (RoPE in every layer, MTP included): per-token
    losses and every gradient bit-identical with and without the adjustment."""
    lengths = [7, 1, 12, 5, 3, 4]
    row = sum(lengths)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (1, row + 1), generator=generator)
    microbatch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(1, row),
                  "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
                  "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)}
    model = _tiny_mtp_gpt()

    def losses_and_grads() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        per_token = model(**model_inputs(microbatch))
        per_token.sum().backward()
        return per_token.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    with ADJUSTMENT.suspended():
        expected_loss, expected_grads = losses_and_grads()
    loss, grads = losses_and_grads()
    assert torch.equal(loss, expected_loss)
    assert any(name.startswith("mtp.") for name in grads)
    for name, grad in expected_grads.items():
        assert torch.equal(grads[name], grad), name
