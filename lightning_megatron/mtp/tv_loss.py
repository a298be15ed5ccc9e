"""The TV draft loss (`mtp_loss_type: tv`) and a KL/TV hybrid (`tv_kl`): the MTP head trained on the acceptance
rate of speculative sampling itself.

Why: speculative sampling accepts a token drafted from `q` with probability `min(1, p/q)`, so a draft is accepted
with probability `alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q)` (Leviathan et al. 2023), `p` the target's and `q`
the draft's distribution at the sampling temperature. Self-distillation's `KL(p || q)` is a proxy for it (zero
where TV is, but weighing the vocabulary otherwise); `tv` trains `1 - alpha` per token, toward the detached main
head at the head's depth. Teacher, roll, packed rows, CP chunks, serving weights and token chunks are
`self_distill.MTPDepthLoss`'s; only the per-chunk loss (a `ChunkDivergence`) is new.

Temperature: both sides at `T = mtp_sampling_temperature`, `p_T = softmax(z_main / T)`, `q_T = softmax(z_mtp / T)`:
a server sampling at T divides both models' logits by T, and `val_mtp_sampled_acceptance` measures at that same
option, so the loss is one minus that metric on the same positions. (`mtp_distill_temperature`, self_distill's
teacher-only temperature, has no part here.)

Gradient, vocabulary-parallel: with `m_x = 1[q_x < p_x]` and `S = sum_x m_x q_x`,
`d(1 - sum_x min(p_x, q_x)) / dz_j = -(1/T) q_j (m_j - S)`. Ties (`q_x == p_x`) count on the teacher's side
(`m_x = 0`: the min is the detached `p_x`, no gradient), which is how autograd differentiates
`torch.where(q < p, q, p)`. Per row only two sums cross the TP group (TV and S, one all-reduce), never the
vocabulary. The loss is `sum_x (p_x - q_x)^+`, equal to `1 - sum_x min(p_x, q_x)` without its cancellation when the
heads nearly agree. A chunk holds two fp32 `[tokens, vocab / TP]` tensors and a bool mask (the hybrid four, as
self-distillation's KL does), within the budget `DISTILL_CHUNK_TOKENS` keeps.

Hybrid (`tv_kl`), per token: `w KL(p_T || q_T) + (1 - w) TV(p_T, q_T)` with `w = exp(-mtp_tv_kl_decay * alpha)`,
`alpha = 1 - TV` the token's current acceptance (detached). Why: TV's gradient is proportional to the draft's own
probabilities, `q_j (S - m_j)`: where the draft puts almost no mass on the target's likely tokens (a fresh or reset
head, a position where the two disagree) S is near 0 and so is the gradient on exactly the tokens that need it,
while KL's, `(q_T - p_T) / T`, pulls toward `p_T` at full strength; where they overlap, TV is the measured quantity
and KL only its proxy. The weight moves per token with the overlap already reached, so no schedule over steps has
to be tuned (one would not know whether the head starts reset or from a joint head, nor where a resumed run is).
Both terms compare the same `p_T` and `q_T`, so they share their minimum `q_T = p_T`. The default decay, 3 (the
blend and constant of vLLM speculators' `lk_hybrid`), trains a reset head (alpha ~0.1) 74% by KL and a head at the
0.75 self-distillation reaches 11% by KL, 89% by TV; 0 is `KL(p_T || q_T)` alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from lightning_megatron.mtp.parameters import is_finite_number
from lightning_megatron.mtp.self_distill import (
    ChunkDivergence,
    KLDivergence,
    MTPLossType,
    vocab_parallel_log_softmax,
    vocab_parallel_softmax,
)

DEFAULT_TV_KL_DECAY = 3.0


def _check_temperature(temperature: float) -> None:
    if not (is_finite_number(temperature) and temperature > 0):
        raise ValueError(f"mtp_sampling_temperature: {temperature!r} must be finite and > 0 (the TV losses compare "
                         "the target and the draft at the temperature a server samples at; 1.0 by default)")


def _overlap_sums(p: torch.Tensor, q: torch.Tensor, scratch: torch.Tensor, tp_group: Any,
                  *more: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row `TV = sum_x (p_x - q_x)^+` and `S = sum_x m_x q_x` (then `more`, e.g. the KL), summed over the TP
    group in one all-reduce, `[2 + len(more), n]`; and the mask `m = q < p`. `scratch` (may be `p`) is overwritten."""
    mask = q < p
    tv = torch.sub(p, q, out=scratch).clamp_(min=0).sum(dim=-1)
    draft_mass = torch.mul(q, mask, out=scratch).sum(dim=-1)
    sums = torch.stack([tv, draft_mass, *more])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
    return sums, mask


def _tv_gradient(out: torch.Tensor, q: torch.Tensor, mask: torch.Tensor, draft_mass: torch.Tensor) -> torch.Tensor:
    """`T` times TV's gradient with respect to the draft's logits, `q_j (S - m_j)`, written into `out` (one pass
    for `S - m_j`, one for the product: the chunk's elementwise passes are most of the loss's cost)."""
    draft_mass = draft_mass.unsqueeze(-1)
    return torch.where(mask, draft_mass - 1, draft_mass, out=out).mul_(q)


@dataclass(frozen=True)
class TotalVariation:
    """`mtp_loss_type: tv`: per token `1 - sum_x min(p_T(x), q_T(x))` (module docstring)."""

    temperature: float = 1.0
    # p and q made by the same function (`vocab_parallel_softmax`), so equal logits give equal probabilities: an
    # exact tie, no gradient, where the heads agree
    teacher_probabilities: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_temperature(self.temperature)

    @property
    def teacher_temperature(self) -> float:
        return self.temperature

    def __call__(self, student: torch.Tensor, p: torch.Tensor, tp_group: Any,
                 with_gradient: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        q = vocab_parallel_softmax(student, tp_group, self.temperature)
        (tv, draft_mass), mask = _overlap_sums(p, q, p, tp_group)
        if not with_gradient:
            return tv, None
        gradient = _tv_gradient(p, q, mask, draft_mass)
        return tv, gradient if self.temperature == 1.0 else gradient.div_(self.temperature)


@dataclass(frozen=True)
class TVKLHybrid:
    """`mtp_loss_type: tv_kl`: per token `w KL(p_T || q_T) + (1 - w) TV(p_T, q_T)`, `w = exp(-decay * (1 - TV))`
    detached (module docstring: why, and why decay 3)."""

    temperature: float = 1.0
    decay: float = DEFAULT_TV_KL_DECAY
    teacher_probabilities: ClassVar[bool] = False  # the KL reads log p

    def __post_init__(self) -> None:
        _check_temperature(self.temperature)
        if not (is_finite_number(self.decay) and self.decay >= 0):
            raise ValueError(f"mtp_tv_kl_decay: {self.decay!r} must be finite and >= 0 (the KL share is "
                             f"exp(-decay * acceptance); {DEFAULT_TV_KL_DECAY} by default)")

    @property
    def teacher_temperature(self) -> float:
        return self.temperature

    def __call__(self, student: torch.Tensor, log_p: torch.Tensor, tp_group: Any,
                 with_gradient: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        log_q = vocab_parallel_log_softmax(student, tp_group, self.temperature)
        q, p = log_q.exp(), log_p.exp()
        kl = log_q.neg_().add_(log_p).mul_(p).sum(dim=-1)  # log_q's memory is scratch from here on
        (tv, draft_mass, kl), mask = _overlap_sums(p, q, log_q, tp_group, kl)
        kl_share = torch.exp(-self.decay * (1 - tv))
        loss = kl_share * kl + (1 - kl_share) * tv
        if not with_gradient:
            return loss, None
        gradient = _tv_gradient(log_q, q, mask, draft_mass).mul_((1 - kl_share).unsqueeze(-1))
        gradient.add_(torch.sub(q, p, out=log_p).mul_(kl_share.unsqueeze(-1)))
        return loss, gradient if self.temperature == 1.0 else gradient.div_(self.temperature)


def check_mtp_loss_options(loss_type: MTPLossType, *, training: bool, distill_temperature: float = 1.0,
                           distill_weighting: str = "uniform", tv_kl_decay: float = DEFAULT_TV_KL_DECAY,
                           depth_weights: Sequence[float] | None = None) -> None:
    """Refuse an option, set away from its default, that the chosen MTP training would ignore: a run that silently
    trains something else than the config says is worse than one that does not start."""
    set_away = {name: value for name, value, default in (
        ("mtp_loss_type", loss_type, "labels"), ("mtp_distill_temperature", distill_temperature, 1.0),
        ("mtp_distill_weighting", distill_weighting, "uniform"), ("mtp_tv_kl_decay", tv_kl_decay, DEFAULT_TV_KL_DECAY),
        ("mtp_depth_weights", depth_weights, None)) if value != default}
    if set_away and not training:
        name, value = next(iter(set_away.items()))
        raise ValueError(f"{name}: {value} sets how the MTP head trains, and this module does not train it; set "
                         f"enable_mtp: true (enable_mtp_training unset or true), or leave {name} unset")
    if "mtp_distill_temperature" in set_away and loss_type != "self_distill":
        compared = ("compares both heads at mtp_sampling_temperature: set that one instead" if loss_type != "labels"
                    else "has no teacher: set mtp_loss_type: self_distill, or leave it at 1.0")
        raise ValueError(f"mtp_distill_temperature: {distill_temperature} is self_distill's teacher temperature; "
                         f"mtp_loss_type: {loss_type} {compared}")
    if "mtp_distill_weighting" in set_away and loss_type == "labels":
        raise ValueError(f"mtp_distill_weighting: {distill_weighting} weighs the positions of the self_distill, tv "
                         "and tv_kl losses; mtp_loss_type: labels takes none: set one of those, or leave it uniform")
    if "mtp_tv_kl_decay" in set_away and loss_type != "tv_kl":
        raise ValueError(f"mtp_tv_kl_decay: {tv_kl_decay} sets the KL share of mtp_loss_type: tv_kl; "
                         f"mtp_loss_type: {loss_type} has none: set mtp_loss_type: tv_kl, or leave it at "
                         f"{DEFAULT_TV_KL_DECAY}")


def depth_divergence(loss_type: MTPLossType, distill_temperature: float = 1.0, sampling_temperature: float = 1.0,
                     tv_kl_decay: float = DEFAULT_TV_KL_DECAY) -> ChunkDivergence:
    """The per-chunk loss of an `mtp_loss_type` other than "labels", from `SFTModule`'s options."""
    if loss_type == "self_distill":
        return KLDivergence(distill_temperature)
    if loss_type == "tv":
        return TotalVariation(sampling_temperature)
    if loss_type == "tv_kl":
        return TVKLHybrid(sampling_temperature, tv_kl_decay)
    raise ValueError(f"mtp_loss_type: {loss_type!r} has no divergence (one of 'self_distill', 'tv', 'tv_kl')")
