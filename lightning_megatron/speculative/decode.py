"""Plain and self-speculative decoding with ``K`` MTP draft tokens per step, greedy or sampled, both KV-cached.

One speculative step, with ``m`` the position of the last token already decided (``x_m``) and ``d_1..d_K`` the MTP
head's drafts for ``x_{m+1}..x_{m+K}``:

1. The target reads ``[x_m, d_1, .., d_K]`` at positions ``m..m+K`` in one forward (its cache holds ``0..m-1``).
2. ``sampling.verify`` keeps the first ``n`` drafts (greedy: those equal to the target's greedy token; sampled: the
   accept/reject rule) and decides one more token: ``n + 1`` tokens for one forward. The target's cache is cropped
   to the decided tokens.
3. The MTP head reads one position per decided token, ``(h_j, x_{j+1})``, and drafts ``d_1`` after the last. For
   ``d_2..d_K`` it is applied recursively (one layer reused, as SGLang's NEXTN steps do): at the next position it
   reads its own final-normed output in place of the target's hidden state, and its previous draft. Those
   positions are dropped from its cache afterwards, so its cache only ever holds decided tokens.

The output is the target's own: token for token its greedy output at temperature 0 (up to floating-point ties
between the top two logits, which a multi-token forward may break differently from a 1-token one), and distributed
as its own sampling otherwise. Both decoders stop after an end-of-sequence token (kept) or ``max_new_tokens``
tokens. Only drafts that could be emitted are made: at most the tokens left in the budget minus one.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from lightning_megatron.speculative.mtp_head import MTPDraftHead
from lightning_megatron.speculative.sampling import GREEDY, Sampling, draw, probabilities, verify


@dataclass(frozen=True)
class Decoded:
    """What one decoder produced for one prompt.

    ``tokens``: the new tokens (prompt excluded; an end-of-sequence token is included). ``accepted``: one flag per
    draft, in the order drafted (empty for plain decoding; drafts after a rejection count as not accepted).
    ``accepted_per_step``: drafts accepted at each verification step that had drafts. ``target_forwards``:
    forward passes of the target, prefill included. ``seconds``: wall time of the whole decode.
    """

    tokens: list[int]
    accepted: list[bool]
    target_forwards: int
    seconds: float
    accepted_per_step: list[int] = field(default_factory=list)


def greedy_decode(
    target: PreTrainedModel, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_ids: Collection[int]
) -> Decoded:
    """The target's greedy continuation of ``prompt_ids``, one KV-cached forward per token."""
    return sample_decode(target, prompt_ids, max_new_tokens, eos_token_ids, GREEDY)


def sample_decode(
    target: PreTrainedModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_ids: Collection[int],
    sampling: Sampling,
    generator: torch.Generator | None = None,
) -> Decoded:
    """The target's own continuation of ``prompt_ids`` under ``sampling``, one KV-cached forward per token."""
    _check(prompt_ids, max_new_tokens)
    with torch.inference_mode():
        start = time.perf_counter()
        cache = DynamicCache()
        logits, _ = _target_forward(target, list(prompt_ids), cache, start=0)
        tokens = [draw(probabilities(logits[-1], sampling), sampling, generator)]
        while not _finished(tokens, max_new_tokens, eos_token_ids):
            logits, _ = _target_forward(target, tokens[-1:], cache, start=len(prompt_ids) + len(tokens) - 1)
            tokens.append(draw(probabilities(logits[-1], sampling), sampling, generator))
        return Decoded(tokens, [], len(tokens), time.perf_counter() - start)


def speculative_decode(
    target: PreTrainedModel,
    head: MTPDraftHead,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_ids: Collection[int],
    *,
    num_draft_tokens: int = 1,
    sampling: Sampling = GREEDY,
    generator: torch.Generator | None = None,
) -> Decoded:
    """The target's continuation of ``prompt_ids`` under ``sampling`` (default greedy), drafting up to
    ``num_draft_tokens`` tokens per step with ``head``; ``generator`` seeds the sampling."""
    _check(prompt_ids, max_new_tokens)
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens: {num_draft_tokens} must be at least 1")
    prompt = list(prompt_ids)
    with torch.inference_mode():
        start = time.perf_counter()
        target_cache, mtp_cache = DynamicCache(), DynamicCache()
        logits, hidden = _target_forward(target, prompt, target_cache, start=0)
        tokens = [draw(probabilities(logits[-1], sampling), sampling, generator)]
        forwards, accepted, per_step = 1, [], []
        drafts, draft_probs = _drafts(head, hidden, prompt[1:] + tokens, mtp_cache, 0,
                                      _budget(tokens, max_new_tokens, eos_token_ids, num_draft_tokens), sampling,
                                      generator)
        while not _finished(tokens, max_new_tokens, eos_token_ids):
            position = len(prompt) + len(tokens) - 1  # of tokens[-1], the last decided token
            logits, hidden = _target_forward(target, [tokens[-1], *drafts], target_cache, start=position)
            forwards += 1
            kept, next_token = verify(drafts, draft_probs, probabilities(logits, sampling), sampling, generator)
            if drafts:
                accepted += [index < kept for index in range(len(drafts))]
                per_step.append(kept)
            target_cache.crop(position + kept + 1)
            decided = [*drafts[:kept], next_token]
            for token in decided:
                if not _finished(tokens, max_new_tokens, eos_token_ids):
                    tokens.append(token)
            drafts, draft_probs = _drafts(head, hidden[: len(decided)], decided, mtp_cache, position,
                                          _budget(tokens, max_new_tokens, eos_token_ids, num_draft_tokens), sampling,
                                          generator)
        return Decoded(tokens, accepted, forwards, time.perf_counter() - start, per_step)


def reference_accepts(
    target: PreTrainedModel,
    head: MTPDraftHead,
    prompt_ids: Sequence[int],
    tokens: Sequence[int],
    max_new_tokens: int,
    eos_token_ids: Collection[int],
) -> list[bool]:
    """Brute-force acceptance flags for the greedy continuation ``tokens``: no cache anywhere.

    Replays the positions :func:`speculative_decode` visits; at each it re-runs the full target and the full MTP
    head on the whole prefix to get the draft, and compares it with the greedy token that follows.
    """
    sequence = list(prompt_ids) + list(tokens)
    decided, flags = 1, []
    with torch.inference_mode():
        while not _finished(list(tokens[:decided]), max_new_tokens, eos_token_ids):
            if max_new_tokens - decided < 2:
                decided += 1
                continue
            last = len(prompt_ids) + decided - 1  # position of the last decided token
            prefix = torch.tensor([sequence[: last + 1]], device=target.device)
            hidden = target.model(input_ids=prefix).last_hidden_state
            positions = torch.arange(last, device=target.device).unsqueeze(0)
            draft = int(head(hidden[:, :-1], prefix[:, 1:], positions)[0, -1].argmax())
            flags.append(draft == sequence[last + 1])
            decided += 2 if flags[-1] else 1
    return flags


def _target_forward(
    target: PreTrainedModel, ids: list[int], cache: DynamicCache, start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[k, vocab]`` and final-normed hidden states ``[k, hidden]`` for ``ids`` at positions ``start..``."""
    input_ids = torch.tensor([ids], device=target.device)
    positions = torch.arange(start, start + len(ids), device=target.device).unsqueeze(0)
    hidden = target.model(input_ids=input_ids, position_ids=positions, past_key_values=cache, use_cache=True)
    hidden = hidden.last_hidden_state
    return target.lm_head(hidden)[0], hidden[0]


def _budget(tokens: list[int], max_new_tokens: int, eos_token_ids: Collection[int], num_draft_tokens: int) -> int:
    """Drafts worth making: none once finished, and never more than could be emitted after the next token."""
    if _finished(tokens, max_new_tokens, eos_token_ids):
        return 0
    return max(0, min(num_draft_tokens, max_new_tokens - len(tokens) - 1))


def _drafts(head: MTPDraftHead, hidden: torch.Tensor, next_ids: list[int], cache: DynamicCache, start: int,
            count: int, sampling: Sampling, generator: torch.Generator | None) -> tuple[list[int], torch.Tensor]:
    """Feed the MTP head positions ``start..`` (the target's hidden state there, the decided token after it), then
    draft ``count`` tokens, the head reapplied to its own output; ``(drafts, their q [count, vocab])``."""
    if count == 0:
        return [], torch.empty(0)
    device = hidden.device
    positions = torch.arange(start, start + len(next_ids), device=device).unsqueeze(0)
    cache.crop(start)  # positions drafted last step held undecided tokens
    own = head.hidden(hidden.unsqueeze(0), torch.tensor([next_ids], device=device), positions, cache)[:, -1:]
    drafts, draft_probs = [], []
    position = start + len(next_ids)
    while True:
        q = probabilities(head.lm_head(own)[0, -1], sampling)
        drafts.append(draw(q, sampling, generator))
        draft_probs.append(q)
        if len(drafts) == count:
            break
        own = head.hidden(own, torch.tensor([[drafts[-1]]], device=device),
                          torch.tensor([[position]], device=device), cache)
        position += 1
    return drafts, torch.stack(draft_probs)


def _finished(tokens: list[int], max_new_tokens: int, eos_token_ids: Collection[int]) -> bool:
    return len(tokens) >= max_new_tokens or tokens[-1] in eos_token_ids


def _check(prompt_ids: Sequence[int], max_new_tokens: int) -> None:
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty: a prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
