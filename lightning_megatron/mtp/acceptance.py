"""Teacher-forced MTP acceptance: how often the MTP head's draft equals the token the target itself would pick
(greedy decoding), and the probability that a sampled draft is accepted (speculative sampling).

Speculative decoding accepts a draft when it equals the target's greedy token, not the dataset's next token, so
this compares the MTP head with the target's own predictions on the same batch. It is the acceptance rate
:func:`lightning_megatron.speculative.decode.speculative_decode` would see at every position, if the sequence
were the model's own greedy continuation (on other text it measures agreement on that text's prefixes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torchmetrics import Metric


class MTPAcceptanceAccuracy(Metric):
    """Fraction of counted positions where the MTP argmax at ``t`` equals the target's greedy token at ``t+2``.

    ``update(mtp, main, loss_mask)``, all batch-first:

    * ``main``: the target's logits ``[b, s, V]`` (or their argmax ``[b, s]``); position ``t`` predicts token
      ``t+1``, so the target's greedy token at ``t+2`` is ``argmax(main[:, t+1])``.
    * ``mtp``: the MTP head's logits ``[b, s, V]`` or ``[b, s-1, V]`` (or argmax ids); position ``t`` predicts
      token ``t+2`` (Megatron's layout: it reads ``h_t`` and token ``t+1``). Positions ``0..s-2`` are used; a last
      position ``s-1``, which Megatron computes from a rolled-in pad token, is ignored.
    * ``loss_mask``: ``[b, s]``, aligned with the labels as in Megatron (``loss_mask[:, t]`` says whether token
      ``t+1`` is trained on). MTP position ``t`` counts iff ``loss_mask[:, t+1]`` is set: the token it drafts,
      ``t+2``, is a trained (e.g. response) token. This is the mask Megatron rolls onto its MTP loss.

    Counts are summed over batches (and over processes when synced), so the epoch value is pooled over tokens,
    not an average of per-batch rates. ``compute`` is NaN when no position was counted. Under tensor parallelism
    pass gathered logits or vocab-parallel argmax ids: an argmax over one vocabulary shard is not the greedy token.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("accepted", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("counted", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, mtp: torch.Tensor, main: torch.Tensor, loss_mask: torch.Tensor) -> None:
        main_ids = _token_ids(main, "main")
        mtp_ids = _token_ids(mtp, "mtp")
        batch, seq = main_ids.shape
        if loss_mask.shape != (batch, seq):
            raise ValueError(f"loss_mask must be [b, s] = {[batch, seq]} like main, got {list(loss_mask.shape)}")
        if mtp_ids.shape[0] != batch or mtp_ids.shape[1] not in (seq, seq - 1):
            raise ValueError(
                f"mtp must have batch {batch} and {seq} or {seq - 1} positions like main, got {list(mtp_ids.shape)}"
            )
        drafts = mtp_ids[:, : seq - 1]
        target_greedy = main_ids[:, 1:]
        counted = loss_mask[:, 1:].bool()
        self.accepted += ((drafts == target_greedy) & counted).sum()
        self.counted += counted.sum()

    def compute(self) -> torch.Tensor:
        if self.counted == 0:
            return torch.tensor(float("nan"))
        return self.accepted.float() / self.counted


def _token_ids(values: torch.Tensor, name: str) -> torch.Tensor:
    if values.ndim == 3:
        return values.argmax(dim=-1)
    if values.ndim == 2 and not values.is_floating_point():
        return values
    raise ValueError(f"{name} must be logits [b, s, vocab] or token ids [b, s], got "
                     f"{values.dtype} {list(values.shape)}")


class PooledAcceptance(Metric):
    """An acceptance rate pooled over tokens: ``update(accepted, counted)`` adds ``sum(accepted * counted)`` and
    ``sum(counted)`` (per-position values and weights of one shape, ``[b, s]``), ``compute`` divides; NaN when
    nothing counted. Sums run over batches and, when synced, over processes (a position repeated on every
    tensor-parallel rank is repeated in both sums, so the ratio is unchanged). The greedy acceptance of
    validation (``accepted``: 1 where the draft's argmax is the target's greedy token) and the base of
    :class:`MTPSampledAcceptance`."""

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("accepted", default=torch.tensor(0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("counted", default=torch.tensor(0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, accepted: torch.Tensor, counted: torch.Tensor) -> None:
        if accepted.shape != counted.shape:
            raise ValueError(f"counted must be shaped like accepted {list(accepted.shape)}, got "
                             f"{list(counted.shape)}")
        weights = counted.to(torch.float64)
        self.accepted += (accepted.to(torch.float64) * weights).sum()
        self.counted += weights.sum()

    def compute(self) -> torch.Tensor:
        if self.counted == 0:
            return torch.tensor(float("nan"))
        return (self.accepted / self.counted).float()


class MTPSampledAcceptance(PooledAcceptance):
    """Teacher-forced expected acceptance of speculative *sampling*: the mean over counted positions of
    ``alpha = sum_x min(p(x), q(x))``, the probability that the draft sampled from the MTP head's ``q`` is accepted
    by the target's ``p`` (Leviathan et al., 2023), both at the same sampling temperature.

    ``update(overlap, counted)``: ``overlap [b, s]`` from :func:`sampled_acceptance_overlap` (position ``t``: the
    MTP head at ``t`` against the target at ``t + 1``, both predicting token ``t + 2``) and the positions to count,
    pooled as :class:`PooledAcceptance` pools them.
    """


def sampled_acceptance_overlap(mtp_logits: torch.Tensor, main_logits: torch.Tensor, temperature: float,
                               roll: Callable[[torch.Tensor], torch.Tensor], tp_group: Any = None,
                               vocab_chunk: int = 16384) -> torch.Tensor:
    """``[b, s]``: at ``t``, ``sum_x min(softmax(main[t + 1] / T), softmax(mtp[t] / T))`` over the vocabulary.

    ``mtp_logits`` and ``main_logits``: Megatron's ``[s, b, vocab / TP]`` (this rank's vocabulary shard; the sums run
    over the ``tp_group``). ``roll`` shifts a ``[..., s]`` tensor one position left the way Megatron-Core rolls the
    MTP labels (within packed sequences, across context-parallel chunks), so ``t + 1`` is the next token of the
    whole sequence; where it rolls in nothing the value is meaningless and must not be counted (roll the loss
    mask with it). The vocabulary is walked ``vocab_chunk`` entries at a time, so no fp32 copy of the logits is made.
    """
    if not temperature > 0:
        raise ValueError(f"temperature: {temperature} must be > 0 (use MTPAcceptanceAccuracy for greedy decoding)")

    def log_normalizer(logits: torch.Tensor) -> torch.Tensor:
        maximum = logits.float().amax(dim=-1) / temperature
        _all_reduce(maximum, torch.distributed.ReduceOp.MAX, tp_group)
        total = torch.zeros_like(maximum)
        for start in range(0, logits.size(-1), vocab_chunk):
            total += (logits[..., start:start + vocab_chunk].float() / temperature - maximum.unsqueeze(-1)).exp().sum(-1)
        _all_reduce(total, torch.distributed.ReduceOp.SUM, tp_group)
        return (maximum + total.log()).transpose(0, 1)  # [b, s]

    mtp_normalizer, main_normalizer = log_normalizer(mtp_logits), roll(log_normalizer(main_logits))
    overlap = torch.zeros_like(mtp_normalizer)
    for start in range(0, mtp_logits.size(-1), vocab_chunk):
        q = (mtp_logits[..., start:start + vocab_chunk].permute(1, 2, 0).float() / temperature
             - mtp_normalizer.unsqueeze(1)).exp()
        rolled_main = roll(main_logits[..., start:start + vocab_chunk].permute(1, 2, 0).contiguous())
        p = (rolled_main.float() / temperature - main_normalizer.unsqueeze(1)).exp()
        overlap += torch.minimum(p, q).sum(dim=1)
    _all_reduce(overlap, torch.distributed.ReduceOp.SUM, tp_group)
    return overlap


def _all_reduce(tensor: torch.Tensor, op: Any, group: Any) -> None:
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(tensor, op=op, group=group)
