"""Packed rows through torch's variable-length FlashAttention: which rows take it and why the others do not (CPU);
on a GPU its output and every gradient against flex_attention and against per-sequence attention in float64, a
training step that reads nothing back from the device, and a captured forward-backward replayed like eager.

The GPU bounds come from the kernels' arithmetic (bf16 or fp16 inputs given to every path alike, products summed in
float32): each value carries the rounding errors of the half-precision steps it passes, each at most `u` (2^-8 for
bf16, 2^-11 for fp16) of the magnitude the same sums give with absolute values (`_reference`). The output: the
probabilities rounded before P V, the output rounded: 2u |P| |V|. dV = P^T dO: P rounded, each query head's dV
rounded and, with GQA, their sum: 3u. dS = P (dP - D): dS rounded (u), and D = rowsum(dO O) read from the rounded
output (2u of the output's magnitude); dQ = scale dS K rounded once more: 4u; dK per query head the same, then their
sum rounded: 5u. Float32 sums add at most (n + d) 2^-24 of the same magnitudes (n keys, d features). flex_attention
rounds at the same steps, and its D may be stored in bf16 before the backward kernel reads it (Inductor's lowering
sums `out * grad_out` in the tensors' dtype): one rounding more for each, and the two paths differ by at most the
sum of their bounds. fp16 has a narrow exponent range: a probability (or dS) below 2^-14 is rounded to a subnormal,
off by up to 2^-25 whatever its size, so each value also carries 2^-25 times the sum of the other factor's
magnitudes over the products that make it (`floors`; flex: twice, as its dS may come from the rounded P), and
2^-25 for each of its own roundings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

import pytest
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from lightning_megatron import attention_varlen
from lightning_megatron.attention import SDPAttention, with_core_attention
from lightning_megatron.attention_varlen import (
    OPT_IN,
    REFUSALS,
    PackedCall,
    takes_scale_and_window,
    varlen_attention,
    varlen_keywords,
    varlen_refusal,
    with_row_end,
)

needs_varlen = pytest.mark.skipif(attention_varlen.varlen_kernel() is None, reason="no usable varlen_attn in torch")

# Qwen3-0.6B's attention on an H100: 16 query heads over 8 groups of 128, bf16
QWEN3 = PackedCall(device=torch.device("cuda", 0), capability=(9, 0), dtype=torch.bfloat16, query_heads=16,
                   key_heads=8, head_dim=128, value_head_dim=128, causal=True, window=None, dropout_p=0.0,
                   cp_size=1, slot_padding=False)

TAKEN = {
    "qwen3_0.6b": {},
    "multi_head": {"key_heads": 16},
    "multi_query": {"key_heads": 1},
    "fp16": {"dtype": torch.float16},
    "sliding_window": {"window": (4096, 0)},
    "head_dim_64_on_an_a100": {"head_dim": 64, "value_head_dim": 64, "capability": (8, 0)},
    "head_dim_256": {"head_dim": 256, "value_head_dim": 256},
}

@pytest.fixture(autouse=True)
def switched_on(monkeypatch):
    """varlen_attn is opt-in (`OPT_IN`): this file's tests run with it on, unless one says otherwise."""
    monkeypatch.setenv(OPT_IN, "1")


# (changes, the reason's words, the row of REFUSALS that refuses it): every row has a case
REFUSED = {
    "switched_off": ({}, f"{OPT_IN} is not 1 (opt-in)", 0),
    "torch_without_varlen_attn": ({}, "has no torch.nn.attention.varlen.varlen_attn taking scale and window_size", 1),
    "cpu": ({"device": torch.device("cpu"), "capability": None}, "the row is on cpu, not a CUDA device", 2),
    "turing": ({"capability": (7, 5)}, "compute capability (7, 5): FlashAttention 2 needs 8.0 or newer", 3),
    "fp32": ({"dtype": torch.float32}, "dtype torch.float32: FlashAttention takes bf16 or fp16", 4),
    "multi_latent_heads": ({"head_dim": 192}, "head sizes 192 (queries, keys) and 128 (values)", 5),
    "head_dim_not_a_multiple_of_8": ({"head_dim": 100, "value_head_dim": 100}, "a multiple of 8, at most 256", 5),
    "head_dim_over_256": ({"head_dim": 512, "value_head_dim": 512}, "head sizes 512", 5),
    "bidirectional": ({"causal": False}, "bidirectional (not causal) packed rows", 6),
    "negative_window": ({"window": (-1, 0)}, "window_size (-1, 0): a sliding window needs a left size of 0 or more",
                        7),
    "attention_dropout": ({"dropout_p": 0.1}, "attention dropout 0.1 while training: varlen_attn has none", 8),
    "context_parallel": ({"cp_size": 2}, "context_parallel_size 2: each rank's queries see the whole row's keys", 9),
    "slot_padding": ({"slot_padding": True}, "cu_seqlens_padded (slot padding)", 10),
}


@needs_varlen
@pytest.mark.parametrize("case", TAKEN)
def test_plain_causal_packed_rows_in_half_precision_on_a_gpu_take_varlen(case):
    assert varlen_refusal(dataclasses.replace(QWEN3, **TAKEN[case])) is None


@pytest.mark.parametrize("case", REFUSED)
def test_every_refusal_keeps_the_layout_path_and_says_why(case, monkeypatch):
    changes, reason, row = REFUSED[case]
    if case == "switched_off":
        monkeypatch.delenv(OPT_IN)
    if case == "torch_without_varlen_attn":
        monkeypatch.setattr(attention_varlen, "varlen_kernel", lambda: None)
    call = dataclasses.replace(QWEN3, **changes)
    refusal = varlen_refusal(call)
    assert refusal is not None and reason in refusal, refusal
    assert next(index for index, candidate in enumerate(REFUSALS) if candidate.applies(call)) == row


def test_every_row_of_the_table_has_its_case():
    assert {row for _, _, row in REFUSED.values()} == set(range(len(REFUSALS)))


@needs_varlen
def test_the_switch_is_off_unset_and_at_0_on_at_1_and_refuses_other_values(monkeypatch):
    for value, refused in (("", True), ("0", True), ("1", False)):
        monkeypatch.setenv(OPT_IN, value)
        assert (varlen_refusal(QWEN3) is not None) is refused, value
    monkeypatch.setenv(OPT_IN, "false")
    with pytest.raises(ValueError, match=f"{OPT_IN}='false' is not 0 or 1"):
        varlen_refusal(QWEN3)


def test_the_torch_guard_needs_scale_and_window_size():
    def torch_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        """torch 2.10's `varlen_attn`: causal by a flag, no scale, no window."""

    def torch_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                   window_size=(-1, -1)):
        """torch 2.11's: no `enable_gqa` (FlashAttention 2 takes fewer key/value heads as they are)."""

    assert not takes_scale_and_window(torch_2_10)
    assert takes_scale_and_window(torch_2_11)
    assert varlen_keywords(16, 8, 0.5, None, inspect.signature(torch_2_11).parameters) == {
        "scale": 0.5, "window_size": (-1, 0)}
    installed = pytest.importorskip("torch.nn.attention.varlen").varlen_attn
    assert takes_scale_and_window(installed) == (attention_varlen.varlen_kernel() is not None)


def test_the_keywords_say_causal_the_window_and_gqa_where_the_signature_has_it():
    with_gqa = {"enable_gqa": None}
    assert varlen_keywords(16, 8, 0.1, None, with_gqa) == {"scale": 0.1, "window_size": (-1, 0), "enable_gqa": True}
    assert varlen_keywords(16, 16, 0.1, (100, 0), with_gqa) == {"scale": 0.1, "window_size": (100, 0)}
    assert varlen_keywords(16, 8, 0.1, (100, 7), {}) == {"scale": 0.1, "window_size": (100, 0)}  # causal cuts right


def test_the_row_end_closes_the_last_sequence():
    assert with_row_end(torch.tensor([0, 3, 10], dtype=torch.int32), 10).tolist() == [0, 3, 10, 10]  # empty
    assert with_row_end(torch.tensor([0, 3, 7], dtype=torch.int32), 10).tolist() == [0, 3, 7, 10]  # the tail


@needs_varlen
@pytest.mark.parametrize("window", [None, (5, 0)])
def test_the_installed_varlen_attn_takes_the_call_on_its_shape_kernel(window):
    """torch's registered shape functions (the meta device: no kernel runs) accept the call, forward and backward,
    with GQA: the arguments are the installed signature's."""
    heads, groups, length = 4, 2, 40
    query = torch.empty(length, heads, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    key, value = (torch.empty(length, groups, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
                  for _ in "kv")
    output = varlen_attention(query, key, value, torch.tensor([0, 9, 30], dtype=torch.int32, device="meta"),
                              scale=0.25, window=window)
    assert output.shape == query.shape and output.dtype == torch.bfloat16
    grads = torch.autograd.grad(output.float().sum(), (query, key, value))
    assert [g.shape for g in grads] == [query.shape, key.shape, value.shape]


def _config(heads: int, groups: int, head_dim: int, **overrides) -> TransformerConfig:
    settings = dict(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads, num_query_groups=groups,
                    kv_channels=head_dim, attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True)
    return TransformerConfig(**{**settings, **overrides})


def _attention(config: TransformerConfig, mask_type: AttnMaskType = AttnMaskType.causal) -> SDPAttention:
    return SDPAttention(config=config, layer_number=1, attn_mask_type=mask_type, attention_type="self")


def _packed(boundaries: list[int], device: str = "cpu", padded: list[int] | None = None) -> PackedSeqParams:
    cu = torch.tensor(boundaries, dtype=torch.int32, device=device)
    slots = None if padded is None else torch.tensor(padded, dtype=torch.int32, device=device)
    longest = max(end - start for start, end in zip(boundaries[:-1], boundaries[1:]))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=slots,
                           cu_seqlens_kv_padded=slots, max_seqlen_q=longest, max_seqlen_kv=longest)


def test_sdpattention_describes_its_packed_rows_from_its_options(model_parallel):
    """The call SDPAttention decides on carries its mask type, window, dropout (in training only), CP size and slot
    padding; on the CPU every row keeps the layout path."""
    qkv = [torch.zeros(24, n, 8) for n in (4, 2, 2)]
    attention = _attention(_config(4, 2, 8, window_size=(6, 0), attention_dropout=0.1))
    call = attention.packed_call(*qkv, _packed([0, 10, 24]), AttnMaskType.padding_causal)
    assert (call.causal, call.window, call.dropout_p, call.cp_size, call.slot_padding) == (True, (6, 0), 0.1, 1, False)
    assert (call.query_heads, call.key_heads, call.head_dim, call.dtype) == (4, 2, 8, torch.float32)
    assert varlen_refusal(call) == "the row is on cpu, not a CUDA device"
    attention.eval()
    call = attention.packed_call(*qkv, _packed([0, 10, 20], padded=[0, 12, 24]), AttnMaskType.padding)
    assert (call.causal, call.dropout_p, call.slot_padding) == (False, 0.0, True)


# --- CUDA -----------------------------------------------------------------------------------------------------------

ROW = 512
# (query heads, groups, head dim, dtype, window, boundaries): one row length, few shapes (each compiles flex once)
GPU_CASES = {
    "gqa_bf16": (4, 2, 64, torch.bfloat16, None, [0, 1, 100, 227, 300, ROW]),
    "qwen3_heads_graph_padding": (16, 8, 128, torch.bfloat16, None, [0, 200, 333, ROW, ROW, ROW, ROW]),
    "sliding_window": (4, 2, 64, torch.bfloat16, (50, 0), [0, 300, 301, ROW]),
    "ends_before_the_row": (4, 2, 64, torch.bfloat16, None, [0, 100, 400]),
    "multi_head_fp16": (4, 4, 64, torch.float16, None, [0, 129, 383, ROW]),
}
ROUNDINGS = (2, 4, 5, 3)  # output, dQ, dK, dV: the module docstring's count


def _inputs(heads: int, groups: int, head_dim: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """q, k, v [ROW, heads or groups, head_dim] and the output weights, all exactly representable in `dtype`."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(ROW, heads, head_dim), (ROW, groups, head_dim), (ROW, groups, head_dim), (ROW, heads * head_dim)]
    return [torch.randn(*shape, generator=generator, device="cuda").to(dtype) for shape in shapes]


def _run(attention: SDPAttention, inputs: list[torch.Tensor], packed: PackedSeqParams) -> list[torch.Tensor]:
    """Output [t, heads, d] and the gradients by q, k, v of sum(output * weights), in float32."""
    qkv = [t.detach().clone().requires_grad_() for t in inputs[:3]]
    output = attention(*qkv, None, packed_seq_params=packed)
    grads = torch.autograd.grad((output.float() * inputs[3].float()).sum(), qkv)
    return [t.float() for t in (output.view(*inputs[0].shape), *grads)]


def _spans(boundaries: list[int]) -> list[tuple[int, int]]:
    """The sequences as varlen runs them: the row's end closes the last one."""
    ends = [*boundaries, ROW] if boundaries[-1] < ROW else boundaries
    return [(start, end) for start, end in zip(ends[:-1], ends[1:]) if end > start]


def _reference(inputs: list[torch.Tensor], spans: list[tuple[int, int]], scale: float,
               window: tuple[int, int] | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sequence in float64: SDPA's output and gradients, the magnitudes they are bounded by (`_bound`), and
    each one's sum of the other factor's magnitudes over its products (the subnormal floors of the module docstring:
    output: P V over |V|, dQ: dS K over scale |K|, dK: dS^T Q over scale |Q|, dV: P^T dO over |dO|)."""
    q, k, v, weights = (t.double() for t in inputs)
    per_group = q.size(1) // k.size(1)  # query heads per key/value head
    values = [torch.zeros_like(q), torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)]
    sizes = [torch.zeros_like(t) for t in values]
    floors = [torch.zeros_like(t) for t in values]
    for start, end in spans:
        # [heads, n, d]; keys and values repeated to the query heads for the magnitudes
        qs, ks, vs = (t[start:end].transpose(0, 1).detach().requires_grad_() for t in (q, k, v))
        d_out = weights[start:end].view(end - start, q.size(1), -1).transpose(0, 1)
        position = torch.arange(end - start, device=q.device)
        visible = position[None, :] <= position[:, None]
        if window is not None:
            visible &= position[:, None] - position[None, :] <= window[0]
        output = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=visible, scale=scale, enable_gqa=per_group > 1)
        grads = torch.autograd.grad((output * d_out).sum(), (qs, ks, vs))
        for total, part in zip(values, (output, *grads)):
            total[start:end] = part.transpose(0, 1)
        kr, vr = (t.repeat_interleave(per_group, dim=0).detach() for t in (ks, vs))
        probabilities = (qs.detach() @ kr.transpose(1, 2) * scale).masked_fill(~visible, float("-inf")).softmax(-1)
        out_size = probabilities @ vr.abs()
        d_size = (d_out.abs() * out_size).sum(-1, keepdim=True)  # bounds |D| and D's error from the output's
        scores_size = probabilities * ((d_out @ vr.transpose(1, 2)).abs() + d_size)
        per_head = [out_size, scale * scores_size @ kr.abs(), scale * scores_size.transpose(1, 2) @ qs.detach().abs(),
                    probabilities.transpose(1, 2) @ d_out.abs()]
        seen = visible.double()
        per_head_floors = [seen @ vr.abs(), scale * seen @ kr.abs(), scale * seen.T @ qs.detach().abs(),
                           seen.T @ d_out.abs()]
        for index, (size, floor) in enumerate(zip(per_head, per_head_floors)):
            if index >= 2:  # dK, dV: summed over each group's query heads
                size, floor = (t.unflatten(0, (k.size(1), per_group)).sum(1) for t in (size, floor))
            sizes[index][start:end] = size.transpose(0, 1)
            floors[index][start:end] = floor.transpose(0, 1)
    return values, sizes, floors


def _bound(size: torch.Tensor, roundings: int, dtype: torch.dtype, longest: int, floor: torch.Tensor,
           underflows: int = 1) -> torch.Tensor:
    """The module docstring's bound: `roundings` half-precision roundings of `size` (each also off by up to half
    the subnormal spacing where the value itself is subnormal: fp16 2^-25; bf16 shares float32's exponent range,
    2^-134), the float32 sums, and `underflows` times the subnormal floor of the products."""
    unit, half_subnormal = (2.0 ** -8, 2.0 ** -134) if dtype == torch.bfloat16 else (2.0 ** -11, 2.0 ** -25)
    return (roundings * unit + (longest + size.size(-1)) * 2.0 ** -24) * size \
        + half_subnormal * (roundings + underflows * floor) + 1e-30


@pytest.mark.gpu
@needs_varlen
@pytest.mark.parametrize("case", GPU_CASES)
def test_varlen_equals_flex_and_per_sequence_attention_within_the_roundings(case, model_parallel, monkeypatch):
    heads, groups, head_dim, dtype, window, boundaries = GPU_CASES[case]
    attention = _attention(_config(heads, groups, head_dim, window_size=window))
    inputs = _inputs(heads, groups, head_dim, dtype, seed=len(case))
    packed = _packed(boundaries, device="cuda")
    assert varlen_refusal(attention.packed_call(*inputs[:3], packed, AttnMaskType.causal)) is None
    varlen = _run(attention, inputs, packed)
    monkeypatch.setenv(OPT_IN, "0")
    flex = _run(attention, inputs, packed)
    spans = _spans(boundaries)
    expected, sizes, floors = _reference(inputs, spans, attention.softmax_scale, window)
    longest = max(end - start for start, end in spans)
    members = boundaries[-1]  # the tokens of the row's sequences: past them flex gives zeros, varlen a sequence
    for name, ours, theirs, reference, size, floor, roundings in zip(("output", "dq", "dk", "dv"), varlen, flex,
                                                                     expected, sizes, floors, ROUNDINGS):
        bound = _bound(size, roundings, dtype, longest, floor)
        flex_bound = _bound(size, roundings + 1, dtype, longest, floor, underflows=2)
        for label, error, allowed in (("varlen", ours.double() - reference, bound),
                                      ("flex", (theirs.double() - reference)[:members], flex_bound[:members]),
                                      ("both", (ours - theirs).double()[:members], (bound + flex_bound)[:members])):
            excess = error.abs() - allowed
            worst = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
            assert bool((excess <= 0).all()), (case, name, label, f"worst excess {excess.max().item():.3g} at {worst}")
    assert all(bool(t.isfinite().all()) for t in varlen)


@pytest.mark.gpu
@needs_varlen
def test_a_packed_bf16_training_step_through_varlen_reads_nothing_back_from_the_device(model_parallel):
    """Forward and backward of a bf16 GPT (RoPE, GQA) over a packed row under CUDA's sync check: varlen_attn (the
    profiler sees its forward and backward ops), the THD RoPE and the loss make no host-device sync."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = _config(4, 2, 16, num_layers=2, bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=False)
    model = GPTModel(config, with_core_attention(get_gpt_layer_local_spec(), "sdpa"), vocab_size=64,
                     max_sequence_length=128, position_embedding_type="rope").cuda().bfloat16()  # as Float16Module
    lengths = (30, 40, 58)
    tokens = torch.randint(0, 64, (1, sum(lengths) + 1), device="cuda")
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    cu_seqlens = torch.tensor([0, 30, 70, 128], dtype=torch.int32, device="cuda")
    for check in ("profile", "error"):
        torch.cuda.synchronize()
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens.clone(), cu_seqlens_kv=cu_seqlens,
                                 max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        with profiler if check == "profile" else contextlib.nullcontext():
            torch.cuda.set_sync_debug_mode("error" if check == "error" else "default")
            try:
                logits = model(tokens[:, :-1], position_ids, None, packed_seq_params=params)
                F.cross_entropy(logits[0].float(), tokens[0, 1:]).backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        if check == "profile":
            names = {event.name for event in profiler.events()}
            assert any(name.endswith("_varlen_attn") for name in names), sorted(names)
            assert any(name.endswith("_varlen_attn_backward") for name in names), sorted(names)
    assert all(p.grad is not None and bool(p.grad.isfinite().all()) for p in model.parameters())


@pytest.mark.gpu
@needs_varlen
def test_a_captured_forward_and_backward_replays_what_eager_computes(model_parallel):
    """Qwen3-0.6B's heads, bf16: SDPAttention's forward and backward over a packed row captured in a CUDA graph
    with `cu_seqlens` padded to a fixed count (as the whole-iteration graph does), then replayed on new values and
    new boundaries written into the same tensors: the output equals eager's bit for bit, every gradient is within
    the bound of the float64 reference (dQ accumulates atomically, in any order)."""
    heads, groups, head_dim = 16, 8, 128
    attention = _attention(_config(heads, groups, head_dim))
    first, second = [0, 200, 333, ROW, ROW, ROW], [0, 17, 18, 400, 450, ROW]
    packed = _packed(first, device="cuda")
    static = _inputs(heads, groups, head_dim, torch.bfloat16, seed=0)
    qkv = [t.requires_grad_() for t in static[:3]]

    def step() -> list[torch.Tensor]:
        output = attention(*qkv, None, packed_seq_params=packed)
        return [output.view_as(qkv[0]), *torch.autograd.grad((output.float() * static[3].float()).sum(), qkv)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    fresh = _inputs(heads, groups, head_dim, torch.bfloat16, seed=1)
    with torch.no_grad():
        for tensor, new in zip(static, fresh):
            tensor.copy_(new)
        packed.cu_seqlens_q.copy_(torch.tensor(second, dtype=torch.int32))
    graph.replay()
    replayed = [t.float().clone() for t in captured]
    eager = [t.float() for t in step()]
    assert torch.equal(replayed[0], eager[0])
    spans = _spans(second)
    expected, sizes, floors = _reference(fresh, spans, attention.softmax_scale, None)
    longest = max(end - start for start, end in spans)
    for name, ours, reference, size, floor, roundings in zip(("output", "dq", "dk", "dv"), replayed, expected, sizes,
                                                             floors, ROUNDINGS):
        bound = _bound(size, roundings, torch.bfloat16, longest, floor)
        assert bool(((ours.double() - reference).abs() <= bound).all()), name
