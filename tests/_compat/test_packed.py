"""Megatron-Core's unfused THD RoPE and its MTP roll of packed rows read `cu_seqlens` on the host and loop over the
packed sequences; the vectorized replacements give bit-identical results with neither, for every CP rank (the roll
exchanging every sequence's chunk boundaries at once), and leave a packed GPT's losses and gradients exactly as
they were."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_megatron._compat import packed_mtp_roll, packed_rope
from tests._distributed import run_distributed
from tests._megatron import VOCAB

PACKED_LENGTHS = (7, 1, 12, 5, 3, 4)


def packed_row(lengths: tuple[int, ...] = PACKED_LENGTHS) -> dict[str, torch.Tensor]:
    """One packed row of random tokens (seeded): sequences of `lengths`, a random loss mask, `cu_seqlens`."""
    row = sum(lengths)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (1, row + 1), generator=generator)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:],
            "loss_mask": (torch.rand(1, row, generator=generator) < 0.8).float(),
            "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
            "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)}


without_te = pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                                reason="the RoPE adjustment applies only without Transformer Engine's fused THD RoPE")

(ROPE_ADJUSTMENT,) = packed_rope.ADJUSTMENTS
(ROLL_ADJUSTMENT,) = packed_mtp_roll.ADJUSTMENTS
HEADS, HEAD_DIM = 3, 16


class _CpGroup:
    """What the THD RoPE asks of a CP group: its size and this rank (nothing is communicated)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class _ToList(TorchFunctionMode):
    """Counts `tolist()` calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.calls += func is torch.Tensor.tolist
        return func(*args, **(kwargs or {}))


class _HostReads(TorchDispatchMode):
    """Counts aten ops (kernels, on a GPU) and reads of tensor values into Python, each a device sync on a GPU:
    `item()` and slicing with a tensor dispatch `_local_scalar_dense`; `tolist()` bypasses the dispatcher."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops += 1
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> _HostReads:
        self._tolist = _ToList().__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._tolist.__exit__(*exc)
        self.reads += self._tolist.calls


def _upstream_thd() -> Any:
    with ROPE_ADJUSTMENT.suspended():
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


@without_te
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


@without_te
def test_upstream_reads_the_host_and_loops_per_sequence_ours_does_neither(process_group):
    """The reason for the adjustment, shown on upstream: host reads (device syncs) and torch calls that grow with
    the number of packed sequences; ours reads nothing and makes the same calls for 2 or 32 sequences."""
    upstream = _upstream_thd()
    group = _CpGroup(2, 1)

    def count(apply: Any, sequences: int, packed_freqs: bool = False) -> _HostReads:
        t, cu_seqlens, freqs = _case([4] * sequences, 2, 1, packed_freqs, HEAD_DIM, torch.float32, 0)
        with _HostReads() as reads:
            apply(t, cu_seqlens, freqs, cp_group=group)
        return reads

    few, many = count(upstream, 2), count(upstream, 32)
    assert few.reads == many.reads == 2  # cu_seqlens.tolist() and cu_seqlens[-1].item()
    assert count(upstream, 32, packed_freqs=True).reads == 2 + 32  # and each sequence's offset
    assert many.ops > few.ops + 30 * 5
    for packed_freqs in (False, True):
        few, many = (count(packed_rope.apply_rotary_pos_emb_thd, n, packed_freqs) for n in (2, 32))
        assert few.reads == many.reads == 0 and many.ops == few.ops


@without_te
def test_refuses_a_missing_cp_group_and_keeps_the_deprecated_argument(process_group):
    t, cu_seqlens, freqs = _case([4, 6], 1, 0, False, HEAD_DIM, torch.float32, 0)
    with pytest.raises(ValueError, match="cp_group must be provided"):
        packed_rope.apply_rotary_pos_emb_thd(t, cu_seqlens, freqs)
    with pytest.warns(DeprecationWarning, match="multi_latent_attention"):
        actual = packed_rope.apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=_CpGroup(1, 0),
                                                      multi_latent_attention=True)
    upstream = _upstream_thd()(t, cu_seqlens, freqs, cp_group=_CpGroup(1, 0), mla_rotary_interleaved=True)
    assert torch.equal(actual, upstream)


@without_te
def test_applied_only_without_the_fused_thd_kernel(process_group, monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils

    assert ROPE_ADJUSTMENT.active and rope_utils._apply_rotary_pos_emb_thd is packed_rope.apply_rotary_pos_emb_thd
    upstream = _upstream_thd()
    with ROPE_ADJUSTMENT.suspended():
        monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", lambda *args, **kwargs: None)
        assert not ROPE_ADJUSTMENT.apply()  # Transformer Engine's fused kernel serves THD rows itself
        assert rope_utils._apply_rotary_pos_emb_thd is upstream
        monkeypatch.undo()
    assert ROPE_ADJUSTMENT.active and rope_utils._apply_rotary_pos_emb_thd is packed_rope.apply_rotary_pos_emb_thd


@pytest.mark.parametrize("adjustment", [pytest.param(ROPE_ADJUSTMENT, marks=without_te), ROLL_ADJUSTMENT],
                         ids=["rope", "mtp_roll"])
def test_packed_gpt_with_mtp_gives_upstreams_losses_and_gradients(model_parallel, adjustment):
    """A packed row through a local-spec GPT and its MTP layer (RoPE in every layer, MTP included; the MTP rolls
    of input ids, position ids, labels and loss mask): per-token losses and every gradient bit-identical with and
    without the adjustment."""
    from lightning_megatron.microbatch import model_inputs
    from tests.test_attention import _tiny_mtp_gpt  # imported here: the spawned ranks of the CP test need neither

    microbatch = packed_row()
    model = _tiny_mtp_gpt()

    def losses_and_grads() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        per_token = model(**model_inputs(microbatch))
        (per_token * microbatch["loss_mask"]).sum().backward()
        return per_token.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    with adjustment.suspended():
        expected_loss, expected_grads = losses_and_grads()
    loss, grads = losses_and_grads()
    assert torch.equal(loss, expected_loss)
    assert any(name.startswith("mtp.") for name in grads)
    for name, grad in expected_grads.items():
        assert torch.equal(grads[name], grad), name


# MTP roll ----------------------------------------------------------------------------------------------------------


def _upstream_roll() -> Any:
    with ROLL_ADJUSTMENT.suspended():
        from megatron.core.transformer import multi_token_prediction

        return multi_token_prediction._roll_tensor_packed_seq


def _packed_params(lengths: list[int]) -> Any:
    from megatron.core.packed_seq_params import PackedSeqParams

    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens)


def _roll_inputs(shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    """What the MTP layers roll: token ids (long), loss masks (float, bool)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, shape, generator=generator), torch.rand(shape, generator=generator),
            torch.rand(shape, generator=generator) < 0.5]


def _assert_rolls_equal(actual: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor]
                        ) -> None:
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and torch.equal(a, e)


def test_mtp_roll_bit_identical_to_upstream_without_host_reads(process_group):
    """CP = 1: sequences of 1 token and an empty one, tokens past the last boundary (kept), one or two rows."""
    upstream, ours = _upstream_roll(), packed_mtp_roll.roll_packed_sequences
    lengths = [5, 1, 0, 7, 2, 1]
    params = _packed_params(lengths)
    for rows in (1, 2):
        for tensor in _roll_inputs((rows, sum(lengths) + 3), seed=rows):
            _assert_rolls_equal(ours(tensor, -1, -1, params), upstream(tensor, -1, -1, params))

    def count(roll: Any, sequences: int) -> _HostReads:
        tensor, params = _roll_inputs((1, 4 * sequences), seed=0)[0], _packed_params([4] * sequences)
        with _HostReads() as reads:
            roll(tensor, -1, -1, params)
        return reads

    assert count(upstream, 32).reads >= 2 * 32  # each sequence's slice bounds, read on the host
    few, many = count(ours, 2), count(ours, 32)
    assert few.reads == many.reads == 0 and many.ops == few.ops


def _mtp_rolls_over_context_parallel(rank: int, world_size: int) -> list[bool]:
    """Every rank of a 3-process world: upstream's and our roll of this rank's random local rows, for the CP group of
    all three (a first, a middle and a last rank) and for ranks 0 and 1 as a group of two (made by every rank, as
    torch requires)."""
    import torch.distributed as dist

    upstream, ours = _upstream_roll(), packed_mtp_roll.roll_packed_sequences
    pair = dist.new_group([0, 1])
    equal = []
    for cp_group in (dist.group.WORLD, pair) if rank < 2 else (dist.group.WORLD,):
        cp_size = cp_group.size()
        lengths = [2 * cp_size, 6 * cp_size, 2 * cp_size, 10 * cp_size, 4 * cp_size]  # multiples of 2 x CP
        params = _packed_params(lengths)
        local_length = sum(lengths) // cp_size
        for tensor in _roll_inputs((1, local_length), seed=10 * rank + cp_size):
            expected = upstream(tensor, -1, -1, params, cp_group)
            actual = ours(tensor, -1, -1, params, cp_group)
            equal.append(all(a.dtype == e.dtype and torch.equal(a, e) for a, e in zip(actual, expected)))
    return equal


@pytest.mark.slow
def test_mtp_roll_over_context_parallel_2_and_3_equals_upstream(tmp_path):
    results = run_distributed(_mtp_rolls_over_context_parallel, tmp_path, world_size=3)
    assert [len(equal) for equal in results] == [6, 6, 3] and all(all(equal) for equal in results), results


def test_mtp_roll_applied_only_while_upstream_rolls_sequence_by_sequence(process_group, monkeypatch):
    from megatron.core.transformer import multi_token_prediction

    assert ROLL_ADJUSTMENT.active
    with ROLL_ADJUSTMENT.suspended():
        # an upstream that rolls the whole row at once needs nothing
        monkeypatch.setattr(multi_token_prediction, "_roll_tensor_packed_seq", packed_mtp_roll.roll_packed_sequences)
        assert not ROLL_ADJUSTMENT.apply()
        monkeypatch.undo()
    assert multi_token_prediction._roll_tensor_packed_seq is packed_mtp_roll.roll_packed_sequences


@pytest.mark.gpu
@without_te
def test_no_device_sync_on_cuda(process_group):
    """On the GPU, with `cu_seqlens` there too: both replacements run under CUDA's sync check (which upstream's RoPE
    fails) and equal upstream bit for bit."""
    upstream_rope, upstream_roll = _upstream_thd(), _upstream_roll()
    group = _CpGroup(2, 1)
    t, cu_seqlens, freqs = (x.cuda() for x in _case(LENGTHS[2], 2, 1, False, HEAD_DIM, torch.bfloat16, 0))
    params = _packed_params([5, 1, 7, 3])
    params.cu_seqlens_q = params.cu_seqlens_q.cuda()
    tokens = _roll_inputs((1, 16), seed=0)[0].cuda()
    expected = upstream_rope(t, cu_seqlens, freqs, cp_group=group), upstream_roll(tokens, -1, -1, params)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        actual = (packed_rope.apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_group=group),
                  packed_mtp_roll.roll_packed_sequences(tokens, -1, -1, params))
        with pytest.raises(RuntimeError, match="synchroniz"):
            upstream_rope(t, cu_seqlens, freqs, cp_group=group)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(actual[0], expected[0])
    _assert_rolls_equal(actual[1], expected[1])
