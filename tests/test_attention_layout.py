"""The layouts' block masks built from bounds equal `create_block_mask`'s, the device CP positions equal the host
ones, and on CUDA the flex path (packed, tree, CP chunks) equals the exact dense path and reads nothing back from the
device during a training step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_megatron import attention_layout
from lightning_megatron.attention_layout import (
    _block_mask_from_bounds,
    _block_mask_from_mask_mod,
    build_layout,
    context_parallel_positions_on_device,
)
from lightning_megatron.microbatch import context_parallel_positions, packed_row_bounds


def _packed(cu_seqlens: list[int], padded: list[int] | None = None) -> tuple[tuple, callable]:
    cu, pad = torch.tensor(cu_seqlens, dtype=torch.int32), None if padded is None else torch.tensor(padded)
    return (cu, pad), lambda length: tuple(t[None] for t in packed_row_bounds(cu, length, pad))


def _tree(subtree_end: torch.Tensor) -> tuple[tuple, callable]:
    def bounds(length: int) -> tuple[torch.Tensor, ...]:
        position = torch.arange(length).expand_as(subtree_end)
        return position, subtree_end.long(), torch.ones_like(subtree_end, dtype=torch.bool)

    return (subtree_end,), bounds


def _row(length: int) -> tuple[torch.Tensor, ...]:
    return torch.zeros(1, length, dtype=torch.long), torch.full((1, length), length), torch.ones(1, length, dtype=bool)


def _branched_tree(length: int) -> torch.Tensor:
    """Two branches of a shared prompt, and 8 pads that see only themselves at the end."""
    subtree_end = torch.arange(1, length + 1)
    tree = length - 8
    subtree_end[: length // 4] = tree
    subtree_end[length // 4: length // 2] = length // 2
    subtree_end[length // 2: tree] = tree
    return subtree_end[None]


# (name, local length, keys and bounds, causal, window, cp size)
CASES = [
    ("packed", 512, _packed([0, 100, 130, 300, 512]), True, None, 1),
    ("packed, slot padding, short last block", 300, _packed([0, 100, 130, 200], [0, 128, 160, 300]), True, None, 1),
    ("packed, ends before the row", 384, _packed([0, 17, 96, 250]), True, None, 1),
    ("packed, window", 512, _packed([0, 300, 512]), True, (100, 0), 1),
    ("tree", 448, _tree(_branched_tree(448)), True, None, 1),
    ("plain row, CP 2", 256, ((), _row), True, None, 2),
    ("packed, CP 2", 256, _packed([0, 100, 260, 512]), True, None, 2),
    ("packed with slot padding, CP 4", 200, _packed([0, 40, 100, 600], [0, 48, 104, 800]), True, None, 4),
    ("packed, not causal, CP 2", 256, _packed([0, 100, 260, 512]), False, None, 2),
]


# one local length per GPU case (each shape compiles flex_attention once): whole rows of 256, 512 and 1024 keys
GPU_CASES = [
    ("packed, slot padding", 256, _packed([0, 100, 130, 200], [0, 128, 160, 256]), True, None, 1),
    ("tree", 256, _tree(_branched_tree(256)), True, None, 1),
    ("packed, window", 256, _packed([0, 200, 256]), True, (50, 0), 1),
    ("packed, CP 2", 256, _packed([0, 100, 260, 512]), True, None, 2),
    ("packed with slot padding, CP 4", 256, _packed([0, 40, 100, 600], [0, 48, 104, 1024]), True, None, 4),
]


def _layouts():
    for name, local_length, (keys, bounds), causal, window, cp_size in CASES:
        for cp_rank in range(cp_size):
            yield f"{name}, rank {cp_rank}", build_layout(keys, local_length, torch.device("cpu"), bounds,
                                                          causal=causal, window=window, cp_rank=cp_rank,
                                                          cp_size=cp_size)


@pytest.mark.parametrize("batch", [1, 2])
def test_block_mask_from_bounds_equals_create_block_mask(batch):
    for name, layout in _layouts():
        inputs = [t.expand(batch, -1).contiguous() for t in (layout.query_position, layout.key_lower,
                                                              layout.visible_end())]
        ours, reference = _block_mask_from_bounds(*inputs), _block_mask_from_mask_mod(*inputs)
        assert torch.equal(ours.to_dense(), reference.to_dense()), name
        for field in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                      "q_indices", "full_q_num_blocks", "full_q_indices"):
            assert torch.equal(getattr(ours, field), getattr(reference, field)), (name, field)
        assert ours.seq_lengths == reference.seq_lengths and ours.BLOCK_SIZE == reference.BLOCK_SIZE, name
        # inside partial blocks the mask function decides: the dense mask, less the tokens of no sequence
        dense = layout.dense_mask()[:, 0]
        flex = dense & layout.key_member[:, None, :] & layout.query_member[:, :, None]
        assert torch.equal(_evaluate(ours.mask_mod, batch, *flex.shape[1:]), flex.expand(batch, -1, -1)), name


def _evaluate(mask_mod, rows: int, sq: int, sk: int) -> torch.Tensor:
    b, q, kv = torch.meshgrid(torch.arange(rows), torch.arange(sq), torch.arange(sk), indexing="ij")
    return mask_mod(b, torch.zeros_like(b), q, kv)


def test_the_builder_switch_picks_create_block_mask(monkeypatch):
    (_, layout), *_ = _layouts()
    monkeypatch.setattr(attention_layout, "BLOCK_MASK_BUILDER", "create_block_mask")
    reference = layout.block_mask(1)
    assert torch.equal(reference.kv_indices, _block_mask_from_bounds(
        layout.query_position, layout.key_lower, layout.visible_end()).kv_indices)


@pytest.mark.parametrize("slots,length", [([0], 64), ([0, 8, 24, 64], 64), ([0, 16, 48], 64), ([0, 24, 24, 120], 120)])
@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_device_cp_positions_equal_the_host_ones(slots, length, cp_size):
    boundaries = slots if slots[-1] == length else [*slots, length]
    if any((end - start) % (2 * cp_size) for start, end in zip(boundaries[:-1], boundaries[1:])):
        pytest.skip("segments not divisible by 2 x CP")
    for rank in range(cp_size):
        expected = context_parallel_positions(boundaries, rank, cp_size)
        assert torch.equal(context_parallel_positions_on_device(torch.tensor(slots), length, rank, cp_size),
                           expected)


# --- CUDA -----------------------------------------------------------------------------------------------------------


def _flex_and_dense(layout, heads: int, groups: int, head_dim: int, dtype: torch.dtype, seed: int):
    """Output and q/k/v gradients of flex_attention with the layout's block mask, and of SDPA with its dense mask
    (zeros for tokens of no sequence), on random inputs."""
    from lightning_megatron.attention import _compiled_flex_attention

    generator = torch.Generator(device="cuda").manual_seed(seed)
    sq, sk = layout.query_position.size(1), layout.key_position.size(1)
    tensors = [torch.randn(1, n, s, head_dim, generator=generator, device="cuda", dtype=dtype)
               for n, s in ((heads, sq), (groups, sk), (groups, sk))]
    weights = torch.randn(1, heads, sq, head_dim, generator=generator, device="cuda", dtype=torch.float32)
    results = []
    for flex in (True, False):
        qkv = [t.detach().clone().requires_grad_() for t in tensors]
        if flex:
            out = _compiled_flex_attention()(*qkv, block_mask=layout.block_mask(1), enable_gqa=True)
        else:
            dense = F.scaled_dot_product_attention(*(t.float() for t in qkv), attn_mask=layout.dense_mask(),
                                                   enable_gqa=True)
            scale = layout.dense_output_scale()
            out = dense if scale is None else dense * scale[:, None, :, None]
        grads = torch.autograd.grad((out.float() * weights).sum(), qkv)
        results.append([out.float(), *(g.float() for g in grads)])
    return results


@pytest.mark.gpu
def test_flex_path_equals_the_dense_path_in_bf16_with_and_without_cp_chunks():
    """bf16 flex_attention with the bounds-built block mask against fp32 SDPA with the dense mask: packed rows
    (with slot padding), a tree and CP ranks' chunks (one GPU: the rank's queries against the whole row's keys, what
    the all-gather hands each rank)."""
    for index, (name, local_length, (keys, bounds), causal, window, cp_size) in enumerate(GPU_CASES):
        keys = tuple(k.cuda() if isinstance(k, torch.Tensor) else k for k in keys)
        for cp_rank in range(cp_size):
            layout = build_layout(keys, local_length, torch.device("cuda"), bounds, causal=causal, window=window,
                                  cp_rank=cp_rank, cp_size=cp_size)
            flex, dense = _flex_and_dense(layout, 4, 2, 64, torch.bfloat16, index)
            for actual, expected in zip(flex, dense):
                error = (actual - expected).norm() / expected.norm()
                assert error < 1e-2, (name, cp_rank, float(error))


@pytest.mark.gpu
def test_a_packed_training_step_reads_nothing_back_from_the_device(model_parallel):
    """Forward and backward of a GPT (RoPE, GQA) over packed rows with slot padding, under CUDA's sync check:
    the layout, its block mask, the THD RoPE and the masked loss make no host-device sync. The packed parameters
    are made before the step, as the data pipeline's `max_seqlen` is (the rotary length is a host integer); the
    loss is taken from the logits (Megatron's vocab-parallel cross entropy all-reduces over the TP group, which is
    gloo in this test process and NCCL in training)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig

    from lightning_megatron.attention import with_core_attention

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config, with_core_attention(get_gpt_layer_local_spec(), "sdpa"), vocab_size=64,
                     max_sequence_length=128, position_embedding_type="rope").cuda()
    length = 128
    cu_seqlens = torch.tensor([0, 30, 70, 100], dtype=torch.int32, device="cuda")
    padded = torch.tensor([0, 32, 72, length], dtype=torch.int32, device="cuda")
    tokens = torch.randint(0, 64, (1, length + 1), device="cuda")
    position_ids = torch.cat([torch.arange(n) for n in (32, 40, 56)])[None].cuda()
    loss_mask = torch.ones(1, length, device="cuda")
    for check in ("default", "error"):  # the first step compiles; the second runs under the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(check)
        try:  # new boundary tensors: the layout, its block mask and the RoPE gather are built again
            params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens.clone(), cu_seqlens_kv=cu_seqlens,
                                     cu_seqlens_q_padded=padded.clone(), cu_seqlens_kv_padded=padded,
                                     max_seqlen_q=56, max_seqlen_kv=56)
            logits = model(tokens[:, :-1], position_ids, None, packed_seq_params=params)
            per_token = F.cross_entropy(logits[0].float(), tokens[0, 1:], reduction="none")
            ((per_token * loss_mask[0]).sum() / loss_mask.sum()).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert all(p.grad is not None and bool(p.grad.isfinite().all()) for p in model.parameters())
