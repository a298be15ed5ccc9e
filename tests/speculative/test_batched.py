"""Batched decoding: several prompts at once give each prompt exactly what decoding it alone gives (greedy and
seeded sampling, K = 1 and 3, prompts of different lengths, rows that stop early at an end-of-sequence token), and
the KV caches are cut back only by removing tokens (negative `crop`), the form transformers keeps. Qwen3.5's
(gated DeltaNet layers: one prompt at a time, the recurrent states put back after a rejection) included."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from lightning_megatron.speculative import greedy_decode, load_mtp_head, load_target
from lightning_megatron.speculative.decode import _has_linear_attention, decode_batch
from lightning_megatron.speculative.sampling import GREEDY, Sampling
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from tests.speculative.test_speculative import one_thread

__all__ = ["one_thread"]  # the fixture (autouse), shared with test_speculative

PROMPTS = [[5, 17, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [100, 3], [3, 4, 5, 6, 7], [250, 11, 9, 8, 1, 2]]
NEW_TOKENS = 24


def _repeat_drafter(path: Path, target):
    """The stored head turned into one that mostly drafts the target's own next token again: its input projection
    passes the target's hidden state through and its layer's outputs are scaled down (still read, cache included),
    so the greedy loops a tiny random model falls into are accepted, and the rest mostly rejected."""
    head = load_mtp_head(path, target)
    hidden = head.config.hidden_size
    with torch.no_grad():
        head.hnorm.weight.fill_(1.0)
        head.final_norm.weight.fill_(1.0)
        head.eh_proj.weight.zero_()
        head.eh_proj.weight[:, hidden:] = torch.eye(hidden)
        head.layer.self_attn.o_proj.weight.mul_(0.3)
        head.layer.mlp.down_proj.weight.mul_(0.3)
    return head


@pytest.fixture(scope="module", params=["qwen3", "mimo", "qwen3_5_text"])
def model(request, tmp_path_factory: pytest.TempPathFactory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("batched") / request.param, request.param, mtp=True)
    target = load_target(path)
    return target, _repeat_drafter(path, target)


def _generators() -> list[torch.Generator]:
    return [torch.Generator().manual_seed(100 + index) for index in range(len(PROMPTS))]


@pytest.mark.parametrize("sampling", [GREEDY, Sampling(1.0), Sampling(0.8, 0.9)], ids=["greedy", "T1", "T0.8p0.9"])
@pytest.mark.parametrize("draft_tokens", [0, 1, 3])
def test_a_batch_decodes_each_prompt_as_it_decodes_alone(model, sampling, draft_tokens):
    target, head = model
    if _has_linear_attention(target) and draft_tokens != 3:
        pytest.skip("a target with linear attention decodes its batch one prompt at a time: K = 3 (greedy and "
                    "sampled) covers that loop and the recurrent states put back after a rejection")
    options = {"head": head if draft_tokens else None, "num_draft_tokens": max(draft_tokens, 1), "sampling": sampling}

    def alone(eos: set[int]) -> list:
        return [decode_batch(target, [prompt], NEW_TOKENS, eos, generators=[generator], **options)[0]
                for prompt, generator in zip(PROMPTS, _generators())]

    eos = {alone(set())[1].tokens[5]}  # the second prompt reaches it early: that row stops while others run on
    batched = decode_batch(target, PROMPTS, NEW_TOKENS, eos, generators=_generators(), **options)
    for together, by_itself in zip(batched, alone(eos), strict=True):
        assert together.tokens == by_itself.tokens
        assert together.accepted == by_itself.accepted
        assert together.accepted_per_step == by_itself.accepted_per_step
        assert together.target_forwards == by_itself.target_forwards
    assert len(batched[1].tokens) <= 6 and len({len(decoded.tokens) for decoded in batched}) >= 2
    if sampling.greedy:
        for prompt, decoded in zip(PROMPTS, batched):
            assert decoded.tokens == greedy_decode(target, prompt, NEW_TOKENS, eos).tokens
    if draft_tokens:
        flags = [flag for decoded in batched for flag in decoded.accepted]
        assert any(flags) and not all(flags)  # both branches of the rule ran, rows at different offsets after it


def test_the_caches_are_cut_back_only_by_removing_tokens(model, monkeypatch):
    """transformers deprecates `crop` with a length to keep (5.18); every cut here removes a positive number of
    tokens (`crop(-n)`; `crop(0)` changed meaning between versions), and none warns."""
    target, head = model
    asked: list[int] = []
    original = DynamicLayer.crop

    def recorded(layer: DynamicLayer, length: int) -> None:
        asked.append(length)
        original(layer, length)

    monkeypatch.setattr(DynamicLayer, "crop", recorded)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for sampling in (GREEDY, Sampling(1.0)):
            decode_batch(target, PROMPTS, NEW_TOKENS, set(), head=head, num_draft_tokens=3, sampling=sampling,
                         generators=_generators())
    assert asked and all(length < 0 for length in asked)
    assert not [warning for warning in caught if "crop" in str(warning.message).lower()]


def test_inputs_are_checked_with_the_fix(model):
    target, head = model
    with pytest.raises(ValueError, match="generators: 1 given for 2 prompts"):
        decode_batch(target, PROMPTS[:2], 4, set(), generators=[None])
    with pytest.raises(ValueError, match="prompts is empty"):
        decode_batch(target, [], 4, set())
    with pytest.raises(ValueError, match="num_draft_tokens: 0 must be at least 1"):
        decode_batch(target, PROMPTS[:2], 4, set(), head=head, num_draft_tokens=0)


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_families_whose_config_has_no_layer_types_decode_in_batches(tmp_path, family):
    """GLM-4.5's and DeepSeek-V3's configs declare no `layer_types` (no sliding window to refuse): a batch of their
    prompts decodes, each as it decodes alone."""
    path = make_tiny_checkpoint(tmp_path / family, family, mtp=True)
    target = load_target(path)
    head = load_mtp_head(path, target)
    batched = decode_batch(target, PROMPTS[:3], 8, set(), head=head, num_draft_tokens=2)
    alone = [decode_batch(target, [prompt], 8, set(), head=head, num_draft_tokens=2)[0] for prompt in PROMPTS[:3]]
    assert [decoded.tokens for decoded in batched] == [decoded.tokens for decoded in alone]
    assert [decoded.tokens for decoded in batched] == [greedy_decode(target, prompt, 8, set()).tokens
                                                       for prompt in PROMPTS[:3]]
