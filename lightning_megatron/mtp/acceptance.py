"""Teacher-forced MTP acceptance: how often the MTP head's draft equals the token the target itself would pick.

Speculative decoding accepts a draft when it equals the target's greedy token, not the dataset's next token, so
this compares the MTP head with the target's own predictions on the same batch. It is the acceptance rate
:func:`lightning_megatron.speculative.decode.speculative_decode` would see at every position, if the sequence
were the model's own greedy continuation (on other text it measures agreement on that text's prefixes).
"""

from __future__ import annotations

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
