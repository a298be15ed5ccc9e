"""Speculative sampling and multi-token drafts: sampled output is distributed as the target's own sampling (a seeded
statistical test that a 5% bias fails), K-token greedy drafting is greedy decoding, top-p is the serving engines'
nucleus, the teacher-forced expected acceptance `alpha = sum_x min(p, q)` is what it says, and on the decoded texts
themselves its mean over the drafted positions is what the measured rate estimates."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from lightning_megatron.mtp.acceptance import MTPSampledAcceptance, sampled_acceptance_overlap
from lightning_megatron.speculative import decode_batch, greedy_decode, load_target, speculative_decode
from lightning_megatron.speculative.sampling import GREEDY, Sampling, probabilities
from lightning_megatron.speculative.teacher_forced import (
    drafted_indices,
    position_acceptance,
    teacher_forced_acceptance,
)
from tests.speculative.test_speculative import NEW_TOKENS, _train_on_own_continuations, checkpoints, loaded, one_thread

__all__ = ["checkpoints", "loaded", "one_thread"]  # the fixtures, shared with test_speculative

SAMPLING = Sampling(temperature=0.8, top_p=0.9)
DRAWS = 2100  # a 0.05 shift of any token's probability is > 4.5 standard errors (max sqrt(0.25 / DRAWS))


def test_top_p_keeps_the_smallest_nucleus_that_reaches_it():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert probabilities(logits, Sampling(1.0, 0.75)).tolist() == pytest.approx([0.625, 0.375, 0, 0])
    assert probabilities(logits, Sampling(1.0, 0.8)).tolist() == pytest.approx([0.625, 0.375, 0, 0])
    assert probabilities(logits, Sampling(1.0, 0.81)).tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95,
                                                                                 0])
    assert probabilities(logits, Sampling(1.0, 0.1)).tolist() == [1, 0, 0, 0]  # the most likely token always stays
    tempered = torch.softmax(logits / 0.5, dim=-1)
    assert probabilities(logits, Sampling(0.5)).tolist() == pytest.approx(tempered.tolist())
    assert probabilities(logits, Sampling(0.0)).tolist() == [1, 0, 0, 0]
    with pytest.raises(ValueError, match="top_p: 0 must be in"):
        Sampling(1.0, 0)


@pytest.mark.parametrize("name", ["qwen3", "mimo", "qwen3_5"])
def test_k_token_greedy_drafting_is_greedy_decoding(checkpoints, loaded, name):
    """K = 1..3 drafts per step, the head reapplied to its own output: token for token the greedy output, and with
    a head fitted to the target's continuations the later drafts are accepted too."""
    target, _, prompts, eos = loaded[name]
    head, *_ = _train_on_own_continuations(checkpoints[name], target, prompts)
    longest_step = {}
    for drafts in (1, 2, 3):
        per_step = []
        for prompt in prompts:
            greedy = greedy_decode(target, prompt, NEW_TOKENS, eos)
            speculative = speculative_decode(target, head, prompt, NEW_TOKENS, eos, num_draft_tokens=drafts)
            assert speculative.tokens == greedy.tokens
            assert len(speculative.accepted) == sum(min(drafts, NEW_TOKENS - 1 - decided) for decided in
                                                    _decided_before_each_step(speculative))
            per_step += speculative.accepted_per_step
        longest_step[drafts] = max(per_step)
    assert longest_step == {1: 1, 2: 2, 3: 3}


def _decided_before_each_step(decoded) -> list[int]:
    """Tokens decided before each verification step that drafted: 1 after the prefill, then kept + 1 per step."""
    decided, counts = 1, []
    for kept in decoded.accepted_per_step:
        counts.append(decided)
        decided += kept + 1
    return counts


def _exact_marginals(target, prompt: list[int], positions: int) -> list[dict[int, float]]:
    """The target's own sampling distribution of each of the first `positions` new tokens, by enumerating every
    prefix its nucleus allows."""
    prefixes, marginals = {(): 1.0}, []
    with torch.no_grad():
        for _ in range(positions):
            marginal: Counter = Counter()
            grown = {}
            for prefix, weight in prefixes.items():
                probs = probabilities(target(torch.tensor([prompt + list(prefix)])).logits[0, -1], SAMPLING)
                for token in probs.nonzero().flatten().tolist():
                    marginal[token] += weight * float(probs[token])
                    grown[(*prefix, token)] = weight * float(probs[token])
            prefixes = grown
            marginals.append(dict(marginal))
    return marginals


def test_speculative_sampling_is_distributed_as_the_target_samples(checkpoints):
    """2 drafts per step at temperature 0.8, top-p 0.9, on a target whose LM head is sharpened (x5, so that a few
    tokens carry the mass): the empirical distribution of each of the first three tokens (the second and third
    pass through the accept/reject rule) is the exact one within 4.5 standard errors, while the drafter's own
    distribution is not: a rule that trusted the drafts would fail."""
    target = load_target(checkpoints["qwen3"])
    head, *_ = _train_on_own_continuations(checkpoints["qwen3"], target, [[5, 17, 42, 7, 99, 3, 250, 11]])
    target.lm_head.weight.data *= 5
    prompt = [5, 17, 42]
    exact = _exact_marginals(target, prompt, 3)
    drawn = [Counter() for _ in range(3)]
    accepted = rejected = 0
    # the draws decoded together, each row from a generator of its own (independent of the batch it is in)
    for decoded in decode_batch(target, [prompt] * DRAWS, 4, set(), head=head, num_draft_tokens=2, sampling=SAMPLING,
                                generators=[torch.Generator().manual_seed(seed) for seed in range(DRAWS)]):
        for position, counter in enumerate(drawn):
            counter[decoded.tokens[position]] += 1
        accepted, rejected = accepted + sum(decoded.accepted), rejected + decoded.accepted.count(False)
    assert accepted > 50 and rejected > 50  # both branches of the rule ran many times
    for position in range(3):
        for token in exact[position].keys() | drawn[position].keys():
            p = exact[position].get(token, 0.0)
            assert drawn[position][token] / DRAWS == pytest.approx(p, abs=4.5 * math.sqrt(max(p * (1 - p), 1e-4)
                                                                                         / DRAWS)), (position, token)
    with torch.no_grad():  # the drafter's distribution of the second token after the most likely first one
        first = max(exact[0], key=exact[0].get)
        ids = torch.tensor([prompt + [first]])
        hidden = target.model(input_ids=ids).last_hidden_state
        q = probabilities(head(hidden[:, -2:-1], ids[:, -1:], torch.tensor([[len(prompt) - 1]]))[0, -1], SAMPLING)
        p = probabilities(target(ids).logits[0, -1], SAMPLING)
    assert float((p - q).abs().sum()) / 2 > 0.1


def test_sampled_acceptance_equals_the_direct_computation(process_group):
    """`alpha` per position and pooled by the metric, against a loop over positions with full softmaxes; the
    roll drops what crosses a sequence boundary as the MTP roll does (packed rows)."""
    generator = torch.Generator().manual_seed(0)
    seq, batch, vocab, temperature = 12, 2, 50, 0.7
    mtp, main = (torch.randn(seq, batch, vocab, generator=generator) for _ in range(2))
    mask = (torch.rand(batch, seq, generator=generator) < 0.7).float()
    boundary = 5  # positions 0..4 and 5..11 are two sequences in each row

    def roll(tensor: torch.Tensor) -> torch.Tensor:
        rolled = torch.roll(tensor, -1, dims=-1)
        rolled[..., boundary - 1] = 0
        rolled[..., -1] = 0
        return rolled

    overlap = sampled_acceptance_overlap(mtp, main, temperature, roll, vocab_chunk=7)
    metric = MTPSampledAcceptance()
    metric.update(overlap, roll(mask))
    total = count = 0.0
    for b in range(batch):
        for t in range(seq - 1):
            if t == boundary - 1 or not mask[b, t + 1]:
                continue
            p = torch.softmax(main[t + 1, b] / temperature, -1)
            q = torch.softmax(mtp[t, b] / temperature, -1)
            alpha = float(torch.minimum(p, q).sum())
            assert float(overlap[b, t]) == pytest.approx(alpha, abs=1e-6)
            total, count = total + alpha, count + 1
    assert 0.05 < total / count < 0.95
    assert float(metric.compute()) == pytest.approx(total / count, abs=1e-6)


def test_the_report_gives_greedy_and_sampled_acceptance_per_draft_count(loaded):
    from lightning_megatron.speculative import measure

    target, head, prompts, eos = loaded["qwen3"]
    summary = measure(target, head, prompts[:2], 10, eos, sampling=Sampling(1.0), seed=3)["summary"]
    assert summary["sampling"] == {"temperature": 1.0, "top_p": 1.0, "seed": 3}
    assert summary["by_draft_tokens"]["greedy"]["1"]["acceptance_rate"] == summary["acceptance_rate"]
    for mode in ("greedy", "sampled"):
        assert list(summary["by_draft_tokens"][mode]) == ["1", "2", "3"]
        for k, row in summary["by_draft_tokens"][mode].items():
            assert 0 <= row["acceptance_rate"] <= 1 and 1 <= row["mean_accepted_length"] <= int(k) + 1
            assert row["tokens_per_s"] > 0
    assert summary["sampled_tokens_per_s"] > 0
    for mode in ("greedy", "sampled"):
        found = summary["by_draft_tokens"][mode]["1"]["teacher_forced"]
        assert 0 <= found["every_position"] <= 1 and 0 <= found["drafted_positions"] <= 1
        assert found["drafts"] == summary["by_draft_tokens"][mode]["1"]["per_prompt"]["drafts"][0] + \
            summary["by_draft_tokens"][mode]["1"]["per_prompt"]["drafts"][1]
    assert summary["by_draft_tokens"]["greedy"]["1"]["teacher_forced"]["drafted_positions"] == pytest.approx(
        summary["acceptance_rate"], abs=1e-12)


def test_drafted_indices_move_on_two_tokens_after_an_accepted_draft_and_one_after_a_rejection():
    assert drafted_indices([True, False, False, True, True]) == [1, 3, 4, 5, 7]
    assert drafted_indices([]) == []


def test_alpha_of_each_position_equals_the_target_and_head_run_on_that_prefix_alone(checkpoints, loaded):
    """`position_acceptance` of a sampled continuation against the target and the head run anew on each prefix.
    Both are fp32 forwards of other lengths, whose logits agree to 1e-5 (`test_speculative`'s bound). alpha is
    `1 - TV(p, q)`, and logits moved by at most e move their softmax by at most e in total variation: alpha by at
    most 2e, one e for p and one for q."""
    target, _, prompts, _ = loaded["qwen3"]
    head, *_ = _train_on_own_continuations(checkpoints["qwen3"], target, prompts)
    sampling, prompt = Sampling(1.0), prompts[1]
    (decoded,) = decode_batch(target, [prompt], 12, set(), head=head, num_draft_tokens=1, sampling=sampling,
                              generators=[torch.Generator().manual_seed(0)])
    alpha = position_acceptance(target, head, prompt, decoded.tokens, sampling)
    assert alpha.shape == (len(decoded.tokens) - 1,)
    sequence = prompt + decoded.tokens
    with torch.no_grad():
        for k in range(1, len(decoded.tokens)):  # a draft of new token k reads the sequence up to new token k - 1
            prefix = torch.tensor([sequence[: len(prompt) + k]])
            hidden = target.model(input_ids=prefix).last_hidden_state
            q = head(hidden[:, :-1], prefix[:, 1:], torch.arange(prefix.size(1) - 1).unsqueeze(0))[0, -1]
            p = target(prefix).logits[0, -1]
            direct = float(torch.minimum(probabilities(p, sampling), probabilities(q, sampling)).sum())
            assert float(alpha[k - 1]) == pytest.approx(direct, abs=2e-5), k


def test_the_measured_rate_is_the_mean_alpha_of_the_drafted_positions(checkpoints, loaded):
    """Greedy, a draft stands iff alpha is 1 there: the drafted positions' mean is the rate exactly (positions
    misread by one would miss it). Sampled (64 seeded rows), each draft is accepted with probability alpha given
    what came before, so accepted minus the drafted alphas' sum is a martingale with variance `sum alpha (1 -
    alpha)`: within 4.5 of its standard errors."""
    target, _, prompts, eos = loaded["qwen3"]
    head, *_ = _train_on_own_continuations(checkpoints["qwen3"], target, prompts)
    greedy = decode_batch(target, prompts, NEW_TOKENS, eos, head=head, num_draft_tokens=1)
    accepted, drafts = sum(sum(run.accepted) for run in greedy), sum(len(run.accepted) for run in greedy)
    found = teacher_forced_acceptance(target, head, prompts, greedy, GREEDY)
    assert 0 < accepted < drafts and found["drafts"] == drafts
    assert found["positions"] == sum(len(run.tokens) - 1 for run in greedy)
    assert found["drafted_positions"] == pytest.approx(accepted / drafts, abs=1e-12)
    rows = prompts * 16
    sampled = decode_batch(target, rows, NEW_TOKENS, eos, head=head, num_draft_tokens=1, sampling=Sampling(1.0),
                           generators=[torch.Generator().manual_seed(seed) for seed in range(len(rows))])
    found = teacher_forced_acceptance(target, head, rows, sampled, Sampling(1.0))
    assert found["drafts"] == sum(len(run.accepted) for run in sampled) > 300
    assert abs(found["rate_minus_drafted_in_standard_errors"]) < 4.5
