"""Speculative sampling: the accept/reject rule that makes drafted output distributed exactly as the target's own
sampling (Leviathan et al., 2023; Chen et al., 2023), with temperature and top-p applied as serving engines do.

A draft ``x`` sampled from the drafter's ``q`` is accepted with probability ``min(1, p(x) / q(x))``; at the first
rejection the token is drawn from ``max(0, p - q)`` normalised, and the drafts after it are dropped; when every
draft is accepted one more token is drawn from the target's distribution after the last. ``p`` and ``q`` are both
the *warped* distributions (logits / temperature, then top-p), so the output is distributed as sampling the target
with the same settings. Temperature 0 is greedy decoding: ``p`` and ``q`` are one-hot at their argmax, a draft is
accepted iff it is the target's greedy token, and no random number is drawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How the target samples: ``temperature`` 0 is greedy; ``top_p`` keeps the smallest set of most likely tokens
    whose probability reaches it (1.0: all), applied after the temperature as vLLM and SGLang do."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature: {self.temperature} must be >= 0 (0 is greedy decoding)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: {self.top_p} must be in (0, 1] (1.0 keeps every token)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()


def probabilities(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """fp32 ``[..., vocab]`` distribution the sampler draws from: one-hot argmax when greedy, else
    ``softmax(logits / temperature)`` restricted to its top-p nucleus and renormalised."""
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.size(-1)).float()
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the more likely tokens
        sorted_probs = sorted_probs.masked_fill(before >= sampling.top_p, 0.0)  # the most likely always stays
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs /= probs.sum(dim=-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """One token from a ``[vocab]`` distribution (its argmax when greedy: no random number is used). Drawn on the
    CPU, where ``generator`` lives, so a seed gives the same tokens on any device."""
    if sampling.greedy:
        return int(probs.argmax())
    return int(torch.multinomial(probs.float().cpu(), 1, generator=generator))


def accepted_count(target_of_drafts: Sequence[float], draft_of_drafts: Sequence[float], sampling: Sampling,
                   generator: torch.Generator | None) -> int:
    """How many drafts stand, given ``p(d_i)`` and ``q(d_i)`` of each draft ``d_i`` under the target's and the
    drafter's distributions: each is accepted with probability ``min(1, p / q)`` (greedy: iff ``p >= q``, which
    one-hot distributions make "the draft is the target's argmax"), up to the first rejection. One random number
    per draft that is not accepted outright, none when greedy."""
    for index, (p, q) in enumerate(zip(target_of_drafts, draft_of_drafts, strict=True)):
        ratio = p / q if q > 0 else 0.0
        if ratio >= 1 or (not sampling.greedy and ratio > 0
                          and float(torch.rand((), generator=generator)) < ratio):
            continue
        return index
    return len(target_of_drafts)


def correction(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """The distribution of the token that replaces a rejected draft, ``max(0, p - q)`` normalised, over the last
    dimension; ``p`` itself where ``p == q`` up to rounding (a rejection then has probability ~0)."""
    residual = (target_probs - draft_probs).clamp_(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), target_probs)
