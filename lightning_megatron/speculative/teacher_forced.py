"""Where a measured speculative acceptance rate comes from: the teacher-forced expected acceptance of the very texts
speculative sampling decoded, over every position and over the positions it drafted.

Under speculative sampling a draft made at a context is accepted with probability ``alpha = sum_x min(p(x), q(x))``
(``p``, ``q``: the target's and the head's warped distributions there), so the measured acceptance rate (accepted /
drafted) estimates the mean ``alpha`` over the drafted positions: the sum of (accepted - alpha) over the drafts is a
martingale with variance ``sum alpha (1 - alpha)``. The validation metric `val_mtp_sampled_acceptance` is the mean
``alpha`` over every position of other text. The two differ in two ways, which this separates:

* the text: the target's own samples, not the validation corpus (``every_position`` against the validation metric);
* which positions are drafted (``drafted_positions`` against ``every_position``): with one draft per step, the
  position after an accepted draft holds the verification's extra token and is never drafted, while after a
  rejection the next position is; positions where the head does badly are drafted more often than those where it
  does well, and the rate weighs them so.

One draft per step only (``K = 1``): with ``K`` drafts the later drafts' contexts hold earlier drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from lightning_megatron.speculative.decode import Decoded
from lightning_megatron.speculative.mtp_head import MTPDraftHead
from lightning_megatron.speculative.sampling import Sampling, probabilities


def drafted_indices(accepted: Sequence[bool]) -> list[int]:
    """The new-token indices drafted with one draft per step, from the drafts' accept flags: the first draft is the
    token after the prefill's, and each step moves on by two tokens when its draft stood (the draft and the
    verification's extra token), else by one (the correction)."""
    index, indices = 1, []
    for flag in accepted:
        indices.append(index)
        index += 2 if flag else 1
    return indices


def position_acceptance(target: PreTrainedModel, head: MTPDraftHead, prompt_ids: Sequence[int],
                        tokens: Sequence[int], sampling: Sampling) -> torch.Tensor:
    """``alpha`` of a draft of each new token ``1..len(tokens) - 1`` (``[len(tokens) - 1]``, fp32 on the CPU), the
    target and the head teacher-forced on ``prompt_ids + tokens``: the head at the position of new token ``k - 2``
    reads the target's hidden state there and token ``k - 1``, and the target predicts token ``k`` after ``k - 1``."""
    if len(tokens) < 2:
        return torch.zeros(0)
    start = len(prompt_ids)
    sequence = torch.tensor([list(prompt_ids) + list(tokens)], device=target.device)
    with torch.inference_mode():
        hidden = target.model(input_ids=sequence).last_hidden_state
        positions = torch.arange(sequence.size(1) - 1, device=target.device).unsqueeze(0)
        own = head.hidden(hidden[:, :-1], sequence[:, 1:], positions)  # every position: the head attends to them
        head_logits = head.lm_head(own[:, start - 1:-1])[0]  # logits only where a new token is drafted
        target_logits = target.lm_head(hidden[:, start:-1])[0]
        overlap = torch.minimum(probabilities(target_logits, sampling), probabilities(head_logits, sampling))
    return overlap.sum(dim=-1).float().cpu()


def teacher_forced_acceptance(target: PreTrainedModel, head: MTPDraftHead, prompts: Sequence[Sequence[int]],
                              runs: Sequence[Decoded], sampling: Sampling) -> dict[str, Any]:
    """The mean ``alpha`` over every position of the decoded texts and over the drafted ones (each pooled over
    prompts), their counts, and the measured rate's departure from the drafted mean in its standard errors (the
    martingale's: near 0 unless decoding drafts something other than what the head predicts there)."""
    every, drafted, accepted = [], [], 0
    for prompt_ids, run in zip(prompts, runs, strict=True):
        alpha = position_acceptance(target, head, prompt_ids, run.tokens, sampling)
        every.append(alpha)
        drafted.append(alpha[[index - 1 for index in drafted_indices(run.accepted)]])
        accepted += sum(run.accepted)
    every_alpha, drafted_alpha = torch.cat(every).double(), torch.cat(drafted).double()
    if not drafted_alpha.numel():
        return {"every_position": None, "drafted_positions": None, "positions": every_alpha.numel(), "drafts": 0,
                "rate_minus_drafted_in_standard_errors": None}
    spread = float((drafted_alpha * (1 - drafted_alpha)).sum().sqrt())
    departure = accepted - float(drafted_alpha.sum())
    return {"every_position": float(every_alpha.mean()), "drafted_positions": float(drafted_alpha.mean()),
            "positions": every_alpha.numel(), "drafts": drafted_alpha.numel(),
            "rate_minus_drafted_in_standard_errors": departure / spread if spread > 0 else None}
