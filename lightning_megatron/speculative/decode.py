"""Plain greedy and greedy self-speculative decoding with one MTP draft token per step, both KV-cached.

One speculative step, with ``m`` the position of the last token already decided (``x_m``) and ``d`` the MTP
head's draft for ``x_{m+1}``:

1. The target reads ``[x_m, d]`` at positions ``m, m+1`` in one forward (its cache holds ``0..m-1``).
2. Its greedy token after ``x_m`` is ``x_{m+1}``. If it equals ``d`` the draft is accepted, and the greedy token
   after ``d`` is ``x_{m+2}``: two tokens for one forward. Otherwise ``d``'s cache entry is cropped: one token.
3. The MTP head reads one position per decided token, ``(h_j, x_{j+1})``, and drafts the token after the last.

The MTP head only ever reads decided tokens and the hidden states computed from them, so its cache never needs a
rollback; only the target's does. The output is the target's own greedy output, token for token (up to
floating-point ties between the top two logits, which a 2-token forward may break differently from a 1-token one).
Both decoders stop after an end-of-sequence token (kept) or ``max_new_tokens`` tokens. A draft is made only when
it could be emitted, i.e. when at least two tokens remain in the budget.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from lightning_megatron.speculative.mtp_head import MTPDraftHead


@dataclass(frozen=True)
class Decoded:
    """What one decoder produced for one prompt.

    ``tokens``: the new tokens (prompt excluded; an end-of-sequence token is included). ``accepted``: one flag per
    draft, in the order the drafts were verified (empty for plain greedy). ``target_forwards``: forward passes of
    the target, prefill included. ``seconds``: wall time of the whole decode.
    """

    tokens: list[int]
    accepted: list[bool]
    target_forwards: int
    seconds: float


def greedy_decode(
    target: PreTrainedModel, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_ids: Collection[int]
) -> Decoded:
    """The target's greedy continuation of ``prompt_ids``, one KV-cached forward per token."""
    _check(prompt_ids, max_new_tokens)
    with torch.inference_mode():
        start = time.perf_counter()
        cache = DynamicCache()
        logits, _ = _target_forward(target, list(prompt_ids), cache, start=0)
        tokens = [int(logits[-1].argmax())]
        while not _finished(tokens, max_new_tokens, eos_token_ids):
            logits, _ = _target_forward(target, tokens[-1:], cache, start=len(prompt_ids) + len(tokens) - 1)
            tokens.append(int(logits[-1].argmax()))
        return Decoded(tokens, [], len(tokens), time.perf_counter() - start)


def speculative_decode(
    target: PreTrainedModel,
    head: MTPDraftHead,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_ids: Collection[int],
) -> Decoded:
    """The target's greedy continuation of ``prompt_ids``, drafting one token per step with ``head``."""
    _check(prompt_ids, max_new_tokens)
    prompt = list(prompt_ids)
    with torch.inference_mode():
        start = time.perf_counter()
        target_cache, mtp_cache = DynamicCache(), DynamicCache()
        logits, hidden = _target_forward(target, prompt, target_cache, start=0)
        tokens = [int(logits[-1].argmax())]
        forwards, accepted = 1, []
        draft = None
        if max_new_tokens - len(tokens) >= 2:
            draft = _draft(head, hidden, prompt[1:] + tokens, mtp_cache, start=0)
        while not _finished(tokens, max_new_tokens, eos_token_ids):
            position = len(prompt) + len(tokens) - 1  # of tokens[-1], the last decided token
            pending = tokens[-1:] if draft is None else [tokens[-1], draft]
            logits, hidden = _target_forward(target, pending, target_cache, start=position)
            forwards += 1
            greedy = logits.argmax(dim=-1).tolist()
            if draft is not None and greedy[0] == draft:
                accepted.append(True)
                decided = [draft, greedy[1]]
            else:
                if draft is not None:
                    accepted.append(False)
                    target_cache.crop(position + 1)
                decided = greedy[:1]
            for token in decided:
                if not _finished(tokens, max_new_tokens, eos_token_ids):
                    tokens.append(token)
            draft = None
            if not _finished(tokens, max_new_tokens, eos_token_ids) and max_new_tokens - len(tokens) >= 2:
                draft = _draft(head, hidden[: len(decided)], decided, mtp_cache, start=position)
        return Decoded(tokens, accepted, forwards, time.perf_counter() - start)


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


def _draft(head: MTPDraftHead, hidden: torch.Tensor, next_ids: list[int], cache: DynamicCache, start: int) -> int:
    """Feed the MTP head positions ``start..`` (hidden state there, token after it); its draft for the last one."""
    device = hidden.device
    positions = torch.arange(start, start + len(next_ids), device=device).unsqueeze(0)
    logits = head(hidden.unsqueeze(0), torch.tensor([next_ids], device=device), positions, cache)
    return int(logits[0, -1].argmax())


def _finished(tokens: list[int], max_new_tokens: int, eos_token_ids: Collection[int]) -> bool:
    return len(tokens) >= max_new_tokens or tokens[-1] in eos_token_ids


def _check(prompt_ids: Sequence[int], max_new_tokens: int) -> None:
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty: a prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
