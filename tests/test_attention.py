"""SDPAttention computes what Megatron-Core's local DotProductAttention computes, and the bridges build it.

References are independent: the local attention (explicit scores and softmax) for the same inputs, the local
attention run sequence by sequence for packed inputs, TP=1 for TP=2, and HF transformers for the bridges.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch.utils.data import default_collate

from lightning_megatron.attention import SDPAttention, core_attention_class, with_core_attention
from lightning_megatron.bridges import BridgeError, create_bridge
from lightning_megatron.data.packing import collate_packed, pack_examples, pad_example
from lightning_megatron.data.tokenize import TokenizedExample
from lightning_megatron.microbatch import model_inputs
from lightning_megatron.options import ModelOptions
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from lightning_megatron.testing.references import hf_mtp_reference_logits
from tests._distributed import run_distributed
from tests._megatron import SEQ, VOCAB, token_batch

HEADS, HEAD_DIM, BATCH, LENGTH = 4, 8, 2, 16


def _config(**overrides) -> TransformerConfig:
    settings = dict(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, use_cpu_initialization=True,
                    attention_dropout=0.0, hidden_dropout=0.0)
    return TransformerConfig(**{**settings, **overrides})


def _attention(cls: type, config: TransformerConfig, mask_type: AttnMaskType, layer_number: int = 1, **kwargs):
    return cls(config=config, layer_number=layer_number, attn_mask_type=mask_type, attention_type="self", **kwargs)


def _qkv(groups: int, shape: tuple[int, ...] = (LENGTH, BATCH), seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    heads = (HEADS, groups, groups)
    return [torch.randn(*shape, n, HEAD_DIM, generator=generator).requires_grad_() for n in heads]


def _output_and_grads(attention, qkv, mask, **kwargs) -> list[torch.Tensor]:
    """The output and d(sum(output * fixed weights))/d(q, k, v)."""
    output = attention(*qkv, mask, **kwargs)
    weights = torch.randn(output.shape, generator=torch.Generator().manual_seed(1)).to(output.device)
    grads = torch.autograd.grad((output * weights).sum(), qkv)
    return [output.detach(), *grads]


def _assert_close(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-5)


def _right_padding(lengths: list[int]) -> torch.Tensor:
    """[b, 1, 1, s] key-padding mask, True = masked."""
    return (torch.arange(LENGTH)[None, :] >= torch.tensor(lengths)[:, None])[:, None, None, :]


_CAUSAL = torch.ones(LENGTH, LENGTH, dtype=torch.bool).triu(1)
_PADDED_CAUSAL = _CAUSAL | _right_padding([LENGTH, 11])  # [b, 1, s, s]: no query row masks every key

# name: (config overrides, constructor kwargs, SDPA mask type and mask, local mask type and mask, layer number)
CASES = {
    "causal": ({}, {}, (AttnMaskType.causal, None), (AttnMaskType.causal, None), 1),
    "padded": ({}, {}, (AttnMaskType.padding, _PADDED_CAUSAL), (AttnMaskType.padding, _PADDED_CAUSAL), 1),
    "causal_explicit_mask": ({}, {}, (AttnMaskType.causal, _PADDED_CAUSAL), (AttnMaskType.causal, _PADDED_CAUSAL), 1),
    # Transformer Engine's meaning: the causal mask is added to the padding mask given
    "padding_causal": ({}, {}, (AttnMaskType.padding_causal, _right_padding([LENGTH, 11])),
                       (AttnMaskType.padding, _PADDED_CAUSAL), 1),
    "no_mask": ({}, {}, (AttnMaskType.no_mask, None), (AttnMaskType.no_mask, None), 1),
    "gqa": ({"num_query_groups": 2}, {}, (AttnMaskType.causal, None), (AttnMaskType.causal, None), 1),
    "gqa_padded": ({"num_query_groups": 2}, {}, (AttnMaskType.padding, _PADDED_CAUSAL),
                   (AttnMaskType.padding, _PADDED_CAUSAL), 1),
    "softmax_scale": ({}, {"softmax_scale": 0.7}, (AttnMaskType.causal, None), (AttnMaskType.causal, None), 1),
    "query_key_layer_scaling": ({"apply_query_key_layer_scaling": True}, {}, (AttnMaskType.causal, None),
                                (AttnMaskType.causal, None), 3),
    "sliding_window": ({"window_size": (3, 0)}, {}, (AttnMaskType.causal, None), (AttnMaskType.causal, None), 1),
}


@pytest.mark.parametrize("case", CASES)
def test_equals_local_attention(model_parallel, case):
    overrides, kwargs, (sdpa_type, sdpa_mask), (local_type, local_mask), layer_number = CASES[case]
    config = _config(**overrides)
    qkv = _qkv(config.num_query_groups)
    sdpa = _attention(SDPAttention, config, sdpa_type, layer_number, **kwargs)
    local = _attention(DotProductAttention, config, local_type, layer_number, **kwargs)
    expected = _output_and_grads(local, qkv, local_mask)
    assert expected[0].shape == (LENGTH, BATCH, HEADS * HEAD_DIM)
    _assert_close(_output_and_grads(sdpa, qkv, sdpa_mask), expected)


def test_mask_type_given_to_forward_wins(model_parallel):
    """Attention passes its (possibly inference-adjusted) mask type to forward, as Transformer Engine takes it."""
    config, qkv = _config(), _qkv(HEADS)
    sdpa = _attention(SDPAttention, config, AttnMaskType.causal)
    expected = _output_and_grads(_attention(DotProductAttention, config, AttnMaskType.no_mask), qkv, None)
    _assert_close(_output_and_grads(sdpa, qkv, None, attn_mask_type=AttnMaskType.no_mask), expected)


def test_dropout_applies_in_training_only_and_keeps_the_expectation(model_parallel):
    config = _config(attention_dropout=0.5)
    sdpa = _attention(SDPAttention, config, AttnMaskType.causal)
    q, k, _ = _qkv(HEADS, shape=(LENGTH, 64))
    ones = torch.ones_like(q).requires_grad_()  # then each output is the sum of its row's probabilities: 1 untouched

    sdpa.eval()
    torch.testing.assert_close(sdpa(q, k, ones, None), torch.ones(LENGTH, 64, HEADS * HEAD_DIM), rtol=0, atol=1e-6)
    expected = _output_and_grads(_attention(DotProductAttention, _config(), AttnMaskType.causal), [q, k, ones], None)
    _assert_close(_output_and_grads(sdpa, [q, k, ones], None), expected)

    sdpa.train()
    dropped = sdpa(q, k, ones, None)
    assert (dropped != 1).float().mean() > 0.5  # most rows lost some probability or were scaled up by 1 / (1 - p)
    assert abs(dropped.mean().item() - 1.0) < 0.03  # inverted dropout keeps the expectation


def test_dropout_draws_from_megatrons_model_parallel_rng_stream(model_parallel):
    sdpa = _attention(SDPAttention, _config(attention_dropout=0.5), AttnMaskType.causal).train()
    qkv = _qkv(HEADS)

    def forward_from_seed() -> tuple[torch.Tensor, bool]:
        tensor_parallel.model_parallel_cuda_manual_seed(7, force_reset_rng=True)
        default_state = torch.get_rng_state()
        output = sdpa(*qkv, None)
        return output, torch.equal(torch.get_rng_state(), default_state)

    first, default_untouched = forward_from_seed()
    second, _ = forward_from_seed()
    assert default_untouched  # the draw came from the tracker's forked stream, not the default generator
    assert torch.equal(first, second)

    config = _config(attention_dropout=0.5)
    config.sequence_parallel = True  # (TransformerConfig refuses it at TP=1, where SDPAttention only reads it)
    sequence_parallel = _attention(SDPAttention, config, AttnMaskType.causal).train()
    default_state = torch.get_rng_state()
    sequence_parallel(*qkv, None)
    assert not torch.equal(torch.get_rng_state(), default_state)  # as upstream: the default generator under SP


def _packed_params(cu_seqlens: list[int], padded: list[int] | None = None) -> PackedSeqParams:
    cu = torch.tensor(cu_seqlens, dtype=torch.int32)
    cu_padded = None if padded is None else torch.tensor(padded, dtype=torch.int32)
    max_length = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                           cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max_length, max_seqlen_kv=max_length)


def _sequence_by_sequence(local, qkv: list[torch.Tensor], spans: list[tuple[int, int]]) -> torch.Tensor:
    """Local attention on each sequence alone ([len, b=1, heads, d]); zeros where no sequence is."""
    output = torch.zeros(qkv[0].size(0), HEADS * HEAD_DIM)
    for start, length in spans:
        output[start:start + length] = local(*(t[start:start + length].unsqueeze(1) for t in qkv), None)[:, 0]
    return output


@pytest.mark.parametrize(("sdpa_type", "local_type"), [(AttnMaskType.causal, AttnMaskType.causal),
                                                       (AttnMaskType.padding_causal, AttnMaskType.causal),
                                                       (AttnMaskType.padding, AttnMaskType.no_mask)])
@pytest.mark.parametrize(("cu_seqlens", "padded"), [([0, 5, 12, 16], None), ([0, 5, 12], [0, 8, 16])],
                         ids=["packed", "packed_with_padding"])
def test_packed_thd_equals_attention_sequence_by_sequence(model_parallel, sdpa_type, local_type, cu_seqlens, padded):
    config = _config(num_query_groups=2)
    qkv = _qkv(2, shape=(LENGTH,))  # [t, heads, d], as Attention hands THD tensors to core attention
    starts = padded or cu_seqlens
    spans = [(start, end - begin) for start, begin, end in zip(starts, cu_seqlens[:-1], cu_seqlens[1:])]
    sdpa = _attention(SDPAttention, config, sdpa_type)
    local = _attention(DotProductAttention, config, local_type)

    expected = _output_and_grads(lambda *args: _sequence_by_sequence(local, args[:3], spans), qkv, None)
    actual = _output_and_grads(sdpa, qkv, None, packed_seq_params=_packed_params(cu_seqlens, padded))
    _assert_close(actual, expected)
    if padded:  # lengths 5 and 7 in slots of 8
        assert torch.count_nonzero(actual[0][5:8]) == 0 and torch.count_nonzero(actual[0][15:]) == 0


def _explicit_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention written out ([s, b, heads, d] in, [s, b, heads * d_v] out): scores, mask, softmax, sum."""
    scores = torch.einsum("qbhd,kbhd->bhqk", query, key) * scale
    probabilities = scores.masked_fill(_CAUSAL, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhqk,kbhd->qbhd", probabilities, value).flatten(2)


def test_key_and_value_heads_of_different_sizes(model_parallel):
    """Multi-latent attention passes its key (qk_nope + qk_rope) and value head sizes: the keys set the default scale
    (as in Transformer Engine's attention), the output has value-sized heads; causal rows and packed THD rows."""
    key_size, value_size = 12, 6
    generator = torch.Generator().manual_seed(0)
    query, key = (torch.randn(LENGTH, BATCH, HEADS, key_size, generator=generator).requires_grad_() for _ in "qk")
    value = torch.randn(LENGTH, BATCH, HEADS, value_size, generator=generator).requires_grad_()
    sdpa = _attention(SDPAttention, _config(), AttnMaskType.causal, k_channels=key_size, v_channels=value_size)
    assert sdpa.softmax_scale == pytest.approx(key_size ** -0.5)
    expected = _output_and_grads(lambda *qkv: _explicit_attention(*qkv[:3], key_size ** -0.5), [query, key, value], None)
    _assert_close(_output_and_grads(sdpa, [query, key, value], None), expected)

    thd = [t[:, 0].detach().requires_grad_() for t in (query, key, value)]  # row 0 as a pack of one sequence
    expected = _output_and_grads(lambda *qkv: _explicit_attention(*(t.unsqueeze(1) for t in qkv[:3]),
                                                                  key_size ** -0.5)[:, 0], thd, None)
    _assert_close(_output_and_grads(sdpa, thd, None, packed_seq_params=_packed_params([0, LENGTH])), expected)


def test_refuses_what_it_cannot_compute(model_parallel):
    with pytest.raises(ValueError, match="softmax_type='off-by-one'.*attention_backend: local"):
        _attention(SDPAttention, _config(softmax_type="off-by-one"), AttnMaskType.causal)
    with pytest.raises(ValueError, match="attention_backend: 'flash' is not one of 'auto', 'sdpa', 'local'"):
        core_attention_class("flash")


def _core_attentions(module: torch.nn.Module) -> dict[str, type]:
    return {name: type(m) for name, m in module.named_modules() if name.endswith("core_attention")}


def test_spec_swap_reaches_every_layer_and_the_mtp_layer_and_copies(model_parallel):
    config = _config(num_layers=2, mtp_num_layers=1)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    swapped = with_core_attention(block, "sdpa")
    swapped_mtp = get_gpt_mtp_block_spec(config, swapped, use_transformer_engine=False)
    model = GPTModel(config, swapped, vocab_size=VOCAB, max_sequence_length=SEQ, mtp_block_spec=swapped_mtp)

    attentions = _core_attentions(model)
    assert set(attentions) == {"decoder.layers.0.self_attention.core_attention",
                               "decoder.layers.1.self_attention.core_attention",
                               "mtp.layers.0.mtp_model_layer.self_attention.core_attention"}
    assert set(attentions.values()) == {SDPAttention}
    assert {s.submodules.self_attention.submodules.core_attention for s in block.layer_specs} == {DotProductAttention}
    assert with_core_attention(swapped, "local").layer_specs[0].submodules.self_attention.submodules.core_attention \
        is DotProductAttention


# A forest in DFS pre-order: a prompt 0-2 branching into 3-4 (which branches into 5 and 6-7) and 8-10; a second
# tree 11-12; pads 13-15 that see only themselves.
_TREE_PARENTS = [None, 0, 1, 2, 3, 4, 4, 6, 2, 8, 9, None, 11, None, None, None]
_TREE_SUBTREE_END = [11, 11, 11, 8, 8, 6, 8, 8, 11, 11, 11, 13, 13, 14, 15, 16]
_TREE_PATHS = [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 6, 7], [0, 1, 2, 8, 9, 10], [11, 12]]


def _ancestor_mask(parents: list[int | None]) -> torch.Tensor:
    """[s, s] bool, True = masked: a token sees itself and its ancestors, found by walking parent pointers."""
    visible = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for query in range(len(parents)):
        node = query
        while node is not None:
            visible[query, node] = True
            node = parents[node]
    return ~visible


def test_tree_structure_equals_ancestor_mask_and_each_path_alone(model_parallel):
    """subtree_end (integer attention_mask) in row 0, a plain causal row (subtree_end = s) in row 1, GQA."""
    config = _config(num_query_groups=2)
    qkv = _qkv(2)
    subtree_end = torch.tensor([_TREE_SUBTREE_END, [LENGTH] * LENGTH])
    sdpa = _attention(SDPAttention, config, AttnMaskType.causal)
    local = _attention(DotProductAttention, config, AttnMaskType.padding)
    reference_mask = torch.stack([_ancestor_mask(_TREE_PARENTS), _CAUSAL])[:, None]
    actual = _output_and_grads(sdpa, qkv, subtree_end)
    _assert_close(actual, _output_and_grads(local, qkv, reference_mask))

    causal = _attention(DotProductAttention, config, AttnMaskType.causal)
    with torch.no_grad():
        for path in _TREE_PATHS:
            alone = causal(*(t[path, :1] for t in qkv), None)[:, 0]
            torch.testing.assert_close(actual[0][path, 0], alone, rtol=0, atol=1e-5)
        pads = actual[0][13:, 0]
        torch.testing.assert_close(pads.view(3, HEADS, HEAD_DIM),
                                   qkv[2][13:, 0].repeat_interleave(HEADS // 2, dim=1), rtol=0, atol=1e-6)


def _tiny_mtp_gpt() -> GPTModel:
    config = _config(num_layers=2, num_query_groups=2, mtp_num_layers=1, mtp_loss_scaling_factor=0.3)
    spec = with_core_attention(get_gpt_layer_local_spec(), "sdpa")
    torch.manual_seed(0)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=4 * SEQ, position_embedding_type="rope",
                    mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False))


def _per_token_loss_and_grads(model: GPTModel, microbatch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token main loss [b, s] and the gradient of the masked main loss plus the (injected) MTP loss."""
    model.zero_grad(set_to_none=True)
    per_token = model(**model_inputs(microbatch))
    (per_token * microbatch["loss_mask"]).sum().backward()
    return per_token.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(("lengths", "alignment"), [([9, 1, 6, 5], 1), ([9, 1, 6, 5], 4), ([32], 1)],
                         ids=["packed", "per_sequence_padding", "one_sequence"])
def test_packed_thd_model_equals_one_sequence_per_row(model_parallel, lengths, alignment):
    """The whole local-spec GPT with its MTP layer (RoPE, THD attention, MTP rolls) on a pack made by the data
    pipeline, against the same sequences one per padded row: per-token outputs, per-sequence losses, every gradient."""
    generator = torch.Generator().manual_seed(len(lengths) + alignment)
    examples = [TokenizedExample(f"s:{i}", torch.randint(0, VOCAB, (n,), generator=generator),
                                 torch.rand(n, generator=generator) < 0.7) for i, n in enumerate(lengths)]
    row = 32
    packed = collate_packed([pack_examples(examples, row, pad_id=0, alignment=alignment)])
    rows = default_collate([pad_example(example, row, pad_id=0) for example in examples])
    model = _tiny_mtp_gpt()
    packed_loss, packed_grads = _per_token_loss_and_grads(model, packed)
    rows_loss, rows_grads = _per_token_loss_and_grads(model, rows)

    starts = packed["cu_seqlens"][:-1].tolist()
    for index, (start, n) in enumerate(zip(starts, lengths)):
        torch.testing.assert_close(packed_loss[0, start:start + n], rows_loss[index, :n], rtol=0, atol=1e-5)
        sequence_loss = (packed_loss[0, start:start + n] * packed["loss_mask"][0, start:start + n]).sum()
        torch.testing.assert_close(sequence_loss, (rows_loss[index] * rows["loss_mask"][index]).sum(),
                                   rtol=0, atol=1e-5)
    assert any(name.startswith("mtp.") for name in packed_grads)
    for name, grad in rows_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=0, atol=1e-5, msg=name)


def _tiny_gpt_loss(backend: str) -> tuple[float, dict[str, torch.Tensor], set[type]]:
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, use_cpu_initialization=True,
        attention_dropout=0.0, hidden_dropout=0.0,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
    )
    model = GPTModel(config, with_core_attention(get_gpt_layer_local_spec(), backend), vocab_size=VOCAB,
                     max_sequence_length=SEQ)
    batch = token_batch()
    per_token = model(batch["input_ids"], batch["position_ids"], None, labels=batch["labels"])
    loss = (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.item(), grads, set(_core_attentions(model).values())


def _losses_by_parallelism(rank: int, world_size: int) -> dict[tuple[int, str], tuple]:
    from lightning_megatron._compat import prepare_megatron_core

    prepare_megatron_core()
    results = {}
    for tp in (1, 2):
        for backend in ("local", "sdpa"):
            parallel_state.initialize_model_parallel(tp, 1)
            tensor_parallel.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
            torch.manual_seed(1234)
            results[tp, backend] = _tiny_gpt_loss(backend)
            parallel_state.destroy_model_parallel()
    return results


@pytest.mark.slow
def test_tensor_parallel_gqa_gpt_matches_tp1_and_the_local_attention(tmp_path):
    ranks = run_distributed(_losses_by_parallelism, tmp_path)
    for results in ranks:
        assert results[1, "sdpa"][2] == results[2, "sdpa"][2] == {SDPAttention}
        assert results[2, "local"][2] == {DotProductAttention}
        reference = results[1, "local"][0]
        for key in ((1, "sdpa"), (2, "local"), (2, "sdpa")):
            assert results[key][0] == pytest.approx(reference, abs=1e-5)
        # same TP shards on this rank: every gradient agrees with the local attention's
        _assert_close(list(results[2, "sdpa"][1].values()), list(results[2, "local"][1].values()))
    assert ranks[0][2, "sdpa"][0] == ranks[1][2, "sdpa"][0]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {"qwen3": make_tiny_checkpoint(root / "qwen3", "qwen3"),
            "qwen3_mtp": make_tiny_checkpoint(root / "qwen3_mtp", "qwen3", mtp=True)}


def _input_ids() -> torch.Tensor:
    return torch.randint(0, 384, (2, LENGTH), generator=torch.Generator().manual_seed(0))


def _megatron_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids, position_ids=torch.arange(input_ids.shape[1]).expand_as(input_ids),
                     attention_mask=None)


@pytest.mark.parametrize("bridge_type", ["mbridge", "megatron-bridge"])
@pytest.mark.parametrize(("backend", "expected"), [("auto", SDPAttention), ("sdpa", SDPAttention),
                                                   ("local", DotProductAttention)])
def test_bridges_build_the_chosen_attention_and_match_hf(model_parallel, checkpoints, bridge_type, backend, expected):
    chunks = create_bridge(bridge_type, checkpoints["qwen3"]).build(ModelOptions(attention_backend=backend))
    attentions = _core_attentions(chunks[0])
    assert len(attentions) == 2 and set(attentions.values()) == {expected}  # "auto": no Transformer Engine here

    import transformers  # here, not at the top: the 2-process test's workers import this module

    input_ids = _input_ids()
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints["qwen3"], dtype=torch.float32)
    with torch.no_grad():
        reference = hf(input_ids).logits
    assert (_megatron_logits(chunks[0], input_ids) - reference).abs().max() <= 1e-5


def test_megatron_bridge_mtp_layer_uses_sdpa_and_matches_hf(model_parallel, checkpoints):
    path = checkpoints["qwen3_mtp"]
    model = create_bridge("megatron-bridge", path).build(ModelOptions(mtp=True, attention_backend="sdpa"))[0]
    assert _core_attentions(model)["mtp.layers.0.mtp_model_layer.self_attention.core_attention"] is SDPAttention

    captured = {}
    model.mtp.register_forward_hook(lambda module, args, output: captured.update(hidden=output.detach().clone()))
    input_ids = _input_ids()
    _megatron_logits(model, input_ids)
    mtp_logits, _ = model.output_layer(captured["hidden"][LENGTH:])
    reference = hf_mtp_reference_logits(path, input_ids)
    assert (mtp_logits.transpose(0, 1)[:, :-1] - reference).abs().max() <= 1e-5


def test_unknown_attention_backend_is_refused_before_building(checkpoints):
    with pytest.raises(BridgeError, match="attention_backend: 'flash' is not one of 'auto', 'sdpa', 'local'"):
        create_bridge("mbridge", checkpoints["qwen3"]).validate(ModelOptions(attention_backend="flash"))


def _gpu_layouts(length: int) -> list[dict]:
    """Microbatches of one shape with different layouts: packed (with slot padding) and a tree."""
    subtree_end = torch.arange(1, length + 1)  # the last 8 tokens: pads that see only themselves
    tree = length - 8
    subtree_end[: length // 4] = tree  # a prompt shared by two branches
    subtree_end[length // 4: length // 2] = length // 2
    subtree_end[length // 2: tree] = tree
    return [{"packed_seq_params": _packed_params([0, 100, 130, 200], [0, 128, 160, length])},
            {"packed_seq_params": _packed_params([0, 17, 96, length])},
            {"attention_mask": subtree_end[None]},
            {"attention_mask": torch.full((1, length), length)}]


@pytest.mark.gpu
def test_cuda_flex_path_equals_the_exact_cpu_path_and_compiles_once(model_parallel):
    """fp32: flex_attention with the layout's BlockMask (CUDA) against SDPA with its dense mask (the CPU path),
    outputs and gradients; four microbatches of one shape and different layouts compile the kernel once."""
    length, head_dim = 256, 64
    sdpa = _attention(SDPAttention, _config(num_query_groups=2, kv_channels=head_dim), AttnMaskType.causal)
    with torch._dynamo.config.patch(error_on_recompile=False):
        for index, layout_inputs in enumerate(_gpu_layouts(length)):
            packed = layout_inputs.get("packed_seq_params")
            shape = (length,) if packed else (length, 1)
            generator = torch.Generator().manual_seed(index)
            qkv = [torch.randn(*shape, n, head_dim, generator=generator).requires_grad_() for n in (HEADS, 2, 2)]
            mask = layout_inputs.get("attention_mask")
            exact = _output_and_grads(sdpa, qkv, mask, packed_seq_params=packed)
            cuda_qkv = [t.detach().cuda().requires_grad_() for t in qkv]
            cuda_mask = None if mask is None else mask.cuda()
            fused = _output_and_grads(sdpa, cuda_qkv, cuda_mask, packed_seq_params=packed)
            _assert_close([t.cpu() for t in fused], exact)
            if index == 0:  # from here on a recompilation fails the test
                torch._dynamo.config.error_on_recompile = True
