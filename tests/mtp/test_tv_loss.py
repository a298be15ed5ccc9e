"""The TV draft loss (`mtp_loss_type: tv`) and the KL/TV hybrid (`tv_kl`): the chunked, vocabulary-parallel loss
equals a direct formula on random logits (ties included); loss and MTP gradients of a fit equal a direct fp32
computation at 1 process (padded and packed, MTP-only and joint, uniform and serving-weighted), at TP=2 with
sequence parallelism, PP=2, CP=2 and packed CP=2, and from the trunk cache; `1 - TV` as the loss computes it is
`val_mtp_sampled_acceptance` on the same row.

The direct computation is `tests.mtp.test_self_distill`'s (the model's own hidden states, whole-vocabulary fp32
logits, the teacher at `t + 1` by indexing within each sequence, Megatron-Core's microbatch weighting, autograd)
with the per-token loss written out: `p = softmax(z_main / T)`, `q = softmax(z_mtp / T)`,
`TV = 1 - sum_x where(q < p, q, p)` (ties on the teacher's side, the rule the loss documents) and the hybrid's
`w KL(p || q) + (1 - w) TV` with `w = exp(-decay * (1 - TV))` detached.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_megatron.data.packing import collate_packed
from lightning_megatron.module import SFTModule
from lightning_megatron.mtp.parameters import is_mtp_parameter
from lightning_megatron.mtp.self_distill import distillation_loss, vocab_parallel_log_softmax, vocab_parallel_softmax
from lightning_megatron.mtp.tv_loss import DEFAULT_TV_KL_DECAY, TotalVariation, TVKLHybrid
from lightning_megatron.strategy import MegatronStrategy
from tests._distributed import run_distributed
from tests.mtp.test_self_distill import (  # noqa: F401  (the checkpoints fixture)
    LAYOUTS,
    SCALE,
    Gradients,
    _assert_equal,
    _batches,
    _fit,
    _serving_weights,
    checkpoints,
    head_logits,
)
from tests.mtp.test_trunk_cache import _assert_equal_runs, checkpoint  # noqa: F401  (the checkpoint fixture)
from tests.mtp.test_trunk_cache import _fit as _fit_epochs
from tests.test_context_parallel import SequencesDataset

TEMPERATURE = 0.7
LOSS_TYPES = ("tv", "tv_kl")


def _log_distributions(mtp_logits: torch.Tensor, main_logits: torch.Tensor,
                       temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`(log q_T, log p_T)` in fp32."""
    return tuple(F.log_softmax(logits.float() / temperature, dim=-1) for logits in (mtp_logits, main_logits))


def _per_token(mtp_logits: torch.Tensor, main_logits: torch.Tensor, loss_type: str,
               temperature: float = TEMPERATURE) -> torch.Tensor:
    """The loss per position, directly, from whole-vocabulary fp32 logits of the head and the (detached) main head
    predicting the same token."""
    log_q, log_p = _log_distributions(mtp_logits, main_logits, temperature)
    q, p = log_q.exp(), log_p.exp()
    tv = 1 - torch.where(q < p, q, p).sum(-1)
    if loss_type == "tv":
        return tv
    kl = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)
    share = torch.exp(-DEFAULT_TV_KL_DECAY * (1 - tv)).detach()
    return share * kl + (1 - share) * tv


@pytest.mark.parametrize("temperature", [0.5, 1.0])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_chunked_loss_equals_the_direct_formula_on_random_logits(process_group, loss_type, temperature):
    """TP=1, chunks of 5 rows over 12: loss and gradient of `distillation_loss` as the direct formula's. Integer
    teacher logits make exact ties: row 0 is the teacher itself, row 1 the teacher shifted by 3 (the same
    distribution, every token tied)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randint(-1, 2, (12, 8), generator=generator).float()
    weight = torch.randint(-1, 2, (50, 8), generator=generator).float()
    teacher = hidden @ weight.T
    student = teacher + torch.randn(12, 50, generator=generator)  # overlapping: TV's gradient does not vanish
    student[0], student[1] = teacher[0], teacher[1] + 3
    student.requires_grad_(True)
    divergence = TotalVariation(temperature) if loss_type == "tv" else TVKLHybrid(temperature)
    upstream = torch.rand(12, generator=generator)

    ours = distillation_loss(student, hidden, weight, None, divergence, chunk_tokens=5)
    (ours_gradient,) = torch.autograd.grad((ours * upstream).sum(), student)
    direct = _per_token(student, teacher, loss_type, temperature)
    (direct_gradient,) = torch.autograd.grad((direct * upstream).sum(), student)

    log_q, log_p = _log_distributions(student.detach(), teacher, temperature)
    assert bool((log_p[:2].exp() == log_q[:2].exp()).all())  # exact ties
    torch.testing.assert_close(ours, direct.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours_gradient, direct_gradient, rtol=0, atol=1e-6)
    assert float(ours[:2].abs().max()) < 1e-6 and float(ours_gradient[:2].abs().max()) < 1e-6
    assert float(ours[2:].min()) > 0.05 and float(ours_gradient[2:].abs().max()) > 1e-2
    with torch.no_grad():  # no gradient kept: the same loss
        torch.testing.assert_close(distillation_loss(student, hidden, weight, None, divergence, chunk_tokens=5), ours,
                                   rtol=0, atol=0)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_a_tied_token_counts_on_the_teachers_side(process_group, loss_type):
    """The teacher's distribution is the draft's own with two tokens' probabilities exchanged (bitwise: the same
    (log-)softmax the loss makes the draft's with, two entries swapped), so the other 48 tokens tie exactly. The
    divergence's gradient is that of `where(q < p, q, p)` (a tie is the teacher's) and not that of
    `where(q <= p, q, p)`. The direct side uses the loss's own `q` values (the difference is exact, Sterbenz) with
    the softmax's autograd gradient."""
    temperature = 0.7
    generator = torch.Generator().manual_seed(1)
    student = (torch.randn(4, 50, generator=generator) * 2).requires_grad_(True)
    divergence = TotalVariation(temperature) if loss_type == "tv" else TVKLHybrid(temperature)
    probabilities = divergence.teacher_probabilities  # tv: p and q as probabilities, tv_kl: as log-probabilities
    distribution = vocab_parallel_softmax if probabilities else vocab_parallel_log_softmax
    draft_ours = distribution(student.detach(), None, temperature)
    teacher = draft_ours.clone()
    swapped = [draft_ours[0].argmax(), draft_ours[0].argmin()]
    teacher[:, swapped] = draft_ours[:, swapped[::-1]]
    ours, ours_gradient = divergence(student.detach(), teacher.clone(), None, True)

    log_q = F.log_softmax(student / temperature, dim=-1)
    q_ours = draft_ours if probabilities else draft_ours.exp()
    q = log_q.exp() + (q_ours - log_q.exp()).detach()
    p = teacher if probabilities else teacher.exp()
    log_p = teacher.log() if probabilities else teacher
    assert bool((q == p).sum(-1).eq(48).all())
    gradients = {}
    for name, draft_side in {"strict": q < p, "inclusive": q <= p}.items():
        tv = 1 - torch.where(draft_side, q, p).sum(-1)
        loss = tv
        if loss_type == "tv_kl":
            share = torch.exp(-DEFAULT_TV_KL_DECAY * (1 - tv)).detach()
            loss = share * F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1) + (1 - share) * tv
        (gradients[name],) = torch.autograd.grad(loss.sum(), student, retain_graph=True)
        if name == "strict":
            torch.testing.assert_close(ours, loss.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours_gradient, gradients["strict"], rtol=0, atol=1e-6)
    assert float((ours_gradient - gradients["inclusive"]).abs().max()) > 1e-3


def _options(loss_type: str, weighting: str = "uniform") -> dict[str, Any]:
    return {"mtp_loss_type": loss_type, "mtp_distill_temperature": 1.0, "mtp_sampling_temperature": TEMPERATURE,
            "mtp_distill_weighting": weighting}


def _mtp_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """`[b, s - 1]`: position t is trained when token t + 2 is (loss mask at t + 1) in the same sequence."""
    mask = batch["loss_mask"].float()
    seq = mask.size(1)
    ends = batch["cu_seqlens"][1:].tolist() if "cu_seqlens" in batch else [seq]
    same_sequence = torch.ones(seq - 1)
    same_sequence[[end - 1 for end in ends if 0 < end <= seq - 1]] = 0  # t + 1 starts the next sequence
    return mask[:, 1:] * same_sequence


def _direct(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], loss_type: str,
            weighting: str) -> tuple[float, dict[str, torch.Tensor]]:
    """(logged `mtp_loss`, MTP gradients) of the loss computed directly on whole rows."""
    terms, logged, total_tokens = [], [], 0.0
    for batch in batches:
        mtp_logits, main_logits = head_logits(model, batch)
        loss = _per_token(mtp_logits[:, :-1], main_logits[:, 1:], loss_type)
        if weighting != "uniform":
            loss = loss * _serving_weights(main_logits, batch["input_ids"], weighting)
        mtp_mask = _mtp_mask(batch)
        loss_sum, tokens = (loss * mtp_mask).sum(), batch["loss_mask"].sum()
        terms.append((loss_sum, tokens, mtp_mask.sum()))
        logged.append(float(loss_sum / mtp_mask.sum()))
        total_tokens += float(tokens)
    objective = sum(SCALE * tokens / mtp_tokens * loss_sum for loss_sum, tokens, mtp_tokens in terms) / total_tokens
    names, parameters = zip(*[(f"0.{name}", p) for name, p in model.named_parameters() if is_mtp_parameter(name)])
    return sum(logged) / len(logged), dict(zip(names, torch.autograd.grad(objective, parameters)))


class Direct(pl.Callback):
    """The direct computation on the model about to be trained (1 process only), before its first step."""

    def __init__(self, batches: list[dict[str, torch.Tensor]], loss_type: str, weighting: str = "uniform") -> None:
        self.batches, self.loss_type, self.weighting = batches, loss_type, weighting

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
        from megatron.core.utils import unwrap_model

        self.mtp_loss, self.gradients = _direct(unwrap_model(pl_module.model[0]), self.batches, self.loss_type,
                                                self.weighting)
        MTPLossLoggingHelper.clean_metrics_in_tracker()  # that forward is not a training step's


def _direct_fit(workdir: Path, hf_checkpoint: str, loss_type: str, packed: bool, mtp_only: bool = True,
                weighting: str = "uniform") -> tuple[Gradients, Direct]:
    dataset = SequencesDataset(packed, alignment=4, rows=4)
    direct = Direct(_batches(dataset), loss_type, weighting)
    ours = _fit(workdir, hf_checkpoint, dataset, mtp_only=mtp_only, callbacks=(direct,),
                module_kwargs=_options(loss_type, weighting))
    return ours, direct


@pytest.mark.parametrize(("family", "loss_type", "packed", "mtp_only", "weighting"),
                         [("qwen3", "tv", False, True, "uniform"), ("qwen3", "tv_kl", True, False, "uniform"),
                          ("mimo", "tv", True, False, "uniform"), ("mimo", "tv_kl", False, True, "sampled")],
                         ids=["qwen3-tv-padded-mtp_only", "qwen3-tv_kl-packed-joint", "mimo-tv-packed-joint",
                              "mimo-tv_kl-padded-mtp_only-sampled"])
def test_tv_losses_equal_the_direct_computation_at_one_process(process_group, checkpoints, tmp_path, family,
                                                                loss_type, packed, mtp_only, weighting):
    _assert_equal(*_direct_fit(tmp_path, checkpoints[family], loss_type, packed, mtp_only, weighting))


def _parallel_fits(rank: int, world_size: int, tmp: str, hf_checkpoint: str) -> dict:
    results = {}
    for loss_type in LOSS_TYPES:
        for layout, (packed, parallel) in LAYOUTS.items():
            fit = _fit(Path(tmp) / f"rank{rank}" / loss_type / layout, hf_checkpoint,
                       SequencesDataset(packed, alignment=4, rows=4), module_kwargs=_options(loss_type), **parallel)
            results[loss_type, layout] = (getattr(fit, "gradients", {}), fit.metrics)
    return results


@pytest.mark.slow
def test_tv_losses_equal_the_direct_computation_under_tp_pp_cp_and_packing(process_group, checkpoints, tmp_path):
    """One spawned pair of processes runs both losses MTP-only under TP=2 with sequence parallelism (the min and
    the sums across vocabulary shards), PP=2, CP=2 and packed CP=2; each equals the direct computation at one
    process on the same checkpoint and batch."""
    ranks = run_distributed(_parallel_fits, tmp_path, str(tmp_path), checkpoints["qwen3"])
    for loss_type in LOSS_TYPES:
        one_process = {packed: _direct_fit(tmp_path / f"direct_{loss_type}_{packed}", checkpoints["qwen3"], loss_type,
                                           packed) for packed in (False, True)}
        for ours, direct in one_process.values():
            _assert_equal(ours, direct)
        for (layout, (packed, _)), (rank, results) in itertools.product(LAYOUTS.items(), enumerate(ranks)):
            ours, direct = one_process[packed]
            ours.gradients, ours.metrics = results[loss_type, layout]
            if layout == "pp2" and rank == 0:
                assert ours.gradients == {}  # the first stage holds no MTP layer
            else:
                _assert_equal(ours, direct)


@pytest.mark.parametrize(("loss_type", "weighting"), [("tv", "uniform"), ("tv_kl", "sampled")])
def test_tv_losses_from_the_trunk_cache_equal_them_without_the_cache(process_group, checkpoint, tmp_path, loss_type,
                                                                      weighting):
    """Two MTP-only epochs, the second read from the trunk cache: every logged value and the final MTP weights are
    those of the run without the cache."""
    options = _options(loss_type, weighting)
    plain = _fit_epochs(tmp_path / "plain", checkpoint, cache=None, module_kwargs=options)
    cached = _fit_epochs(tmp_path / "cached", checkpoint, cache=tmp_path / "cache", module_kwargs=options)
    _assert_equal_runs(cached, plain)
    assert cached["layer_calls"][1] == 0 and cached["cache"]["read"] > 0


def _sampled_acceptance(workdir: Path, hf_checkpoint: str, dataset: Dataset) -> float:
    """`val_mtp_sampled_acceptance` at `TEMPERATURE` over `dataset` (one microbatch)."""
    trainer = pl.Trainer(strategy=MegatronStrategy(hf_checkpoint=hf_checkpoint, bridge_type="megatron-bridge",
                                                   micro_batch_size=1, global_batch_size=1, precision="fp32",
                                                   trust_remote_code=True),
                         accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=workdir)
    trainer.validate(SFTModule(enable_mtp=True, **_options("tv")), DataLoader(dataset, collate_fn=collate_packed))
    return float(trainer.callback_metrics["val_mtp_sampled_acceptance"])


@pytest.mark.parametrize("depths", [1, 3])
def test_one_minus_the_tv_loss_is_the_sampled_acceptance_metric(process_group, checkpoints, tmp_path, depths):
    """One packed row, one microbatch, uniform weights: the first step's `mtp_loss` (the mean TV over the trained
    positions, before the step changes anything; with several depths the first depth's) is one minus validation's
    sampled acceptance at the same temperature on the same row."""
    row = SequencesDataset(True, alignment=4, rows=1)
    fit = _fit(tmp_path / "fit", checkpoints["qwen3"], row, module_kwargs=_options("tv") | {"mtp_depths": depths},
               global_batch_size=1)
    acceptance = _sampled_acceptance(tmp_path / "validate", checkpoints["qwen3"], row)
    assert 0.05 < acceptance < 0.95
    first_depth = fit.metrics["mtp_loss" if depths == 1 else "mtp_loss_depth_1"]
    assert 1 - first_depth == pytest.approx(acceptance, rel=0, abs=1e-6)


def test_options_that_do_not_fit_the_tv_losses_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="mtp_distill_temperature: 0.5 is self_distill's.*mtp_sampling_temperature"):
        SFTModule(enable_mtp=True, mtp_loss_type="tv", mtp_distill_temperature=0.5)
    with pytest.raises(ValueError, match="mtp_tv_kl_decay: -1.0 must be finite and >= 0"):
        SFTModule(enable_mtp=True, mtp_loss_type="tv_kl", mtp_tv_kl_decay=-1.0)
    # a number given as a string (Python callers; the CLI converts by the type hints) is named, not float's TypeError
    with pytest.raises(ValueError, match="mtp_tv_kl_decay: '2' must be finite and >= 0"):
        SFTModule(enable_mtp=True, mtp_loss_type="tv_kl", mtp_tv_kl_decay="2")
    with pytest.raises(ValueError, match="mtp_sampling_temperature: '0.7' must be finite and > 0"):
        SFTModule(enable_mtp=True, mtp_loss_type="tv", mtp_sampling_temperature="0.7")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mtp_loss_type": "labels", "mtp_distill_temperature": 0.5},
     "mtp_distill_temperature: 0.5 is self_distill's.*labels has no teacher"),
    ({"mtp_loss_type": "labels", "mtp_distill_weighting": "greedy"},
     "mtp_distill_weighting: greedy weighs .*labels takes none"),
    ({"mtp_loss_type": "tv", "mtp_tv_kl_decay": 5.0}, "mtp_tv_kl_decay: 5.0 sets the KL share .*tv has none"),
    ({"mtp_loss_type": "self_distill", "mtp_tv_kl_decay": 0.0}, "mtp_tv_kl_decay: 0.0 .*self_distill has none"),
    ({"enable_mtp": False, "mtp_loss_type": "tv"}, "mtp_loss_type: tv sets how the MTP head trains, and this module "
                                                   r"does not train it; set enable_mtp: true \(enable_mtp_training"),
    ({"enable_mtp_training": False, "mtp_loss_type": "self_distill"}, "mtp_loss_type: self_distill sets how"),
    ({"enable_mtp": False, "mtp_depth_weights": [2.0]}, r"mtp_depth_weights: \[2.0\] sets how the MTP head trains"),
    ({"enable_mtp": False, "mtp_sampling_temperature": 0.7}, "mtp_sampling_temperature: 0.7 is the temperature "
                                                              "the MTP head's .*no MTP head; set enable_mtp: true"),
])
def test_options_the_chosen_mtp_loss_would_ignore_are_refused_naming_the_field(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SFTModule(**({"enable_mtp": True} | kwargs))
