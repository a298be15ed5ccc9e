"""MTP-only training without the main LM head's backward: chunked losses, whole logits with that backward skipped
and plain Megatron-Core train the same steps, and a trainable main head is refused."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest

from lightning_megatron.callbacks import TrainingCurves
from tests.mtp._helpers import (
    COMPARABLE,
    HeadGradients,
    RecordedLogs,
    Snapshot,
    assert_main_head_on_demand_changes_only_lm_loss,
    assert_only_mtp_moved,
    assert_same_gradients_and_weights,
    fit,
)


def _assert_same_training(first: Snapshot, second: Snapshot, *, exact: bool) -> None:
    """The same logged values (lm_loss, mtp_loss, mtp_accuracy, grad norms, validation) step by step, MTP gradients
    and weights; `exact` for the logged values too, else to 1e-6."""
    assert {"lm_loss", "mtp_loss", "mtp_accuracy", "grad_norm_mtp", "val_lm_loss"} <= set(first.metrics[-1])
    if exact:
        assert first.metrics == second.metrics
    for ours, theirs in zip(first.metrics, second.metrics, strict=True):
        assert ours.keys() == theirs.keys()
        assert ours == pytest.approx(theirs, rel=0, abs=1e-6)
    assert_same_gradients_and_weights(first, second)


def _assert_same_first_step_in_bf16(first: Snapshot, second: Snapshot) -> None:
    """bf16, chunked against whole logits: the chunked loss rounds the logits' gradient to bf16 twice (made in the
    forward, scaled in the backward) where Megatron-Core rounds once, and Adam carries that difference in the first
    step's gradients into the weights, far above 1e-6 (tests/_adam.py); so the first step: the same losses,
    each MTP gradient within bf16 precision of the other (2^-6 of its norm: that one rounding, carried through the
    MTP layer's bf16 backward)."""
    ours, theirs = first.metrics[0], second.metrics[0]
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-4 if key.startswith("grad_norm") else 0, abs=1e-6), key
    for name, gradient in first.mtp_grads[0].items():
        reference = second.mtp_grads[0][name]
        assert (gradient - reference).norm() <= 2**-6 * reference.norm(), name  # measured: up to 0.8%


@pytest.mark.parametrize("model, precision", [("qwen3_mtp", "fp32"), ("qwen3_mtp_tied", "fp32"),
                                              ("qwen3_mtp_tied", "bf16")], ids=["untied", "tied", "tied_bf16"])
def test_skipping_the_main_head_backward_changes_nothing_but_the_work(process_group, checkpoints, tmp_path, model,
                                                                     precision):
    """Three implementations of the same MTP-only step: chunked losses (default), whole logits with the main
    head's backward skipped (`loss_chunk_tokens=None`), and plain Megatron-Core (`skip_main_head_backward=False`).
    bf16 also checks the audit's reference point: the norm weights are built in fp32 and cast by the wrap."""
    runs, logs = {}, {}
    for name, options in {"chunked": {}, "whole_logits": {"loss_chunk_tokens": None},
                          "plain": {"skip_main_head_backward": False},
                          "on_demand": {"log_lm_loss_every_n_steps": None}}.items():
        heads, logs[name] = HeadGradients(), RecordedLogs()
        curves = (TrainingCurves(dirpath=str(tmp_path / "curves")),) if name == "on_demand" else ()
        snapshot, _ = fit(tmp_path / name, checkpoints[model], 3, precision=precision, callbacks=(heads, *curves),
                          validate_every=2, logger=logs[name], log_every_n_steps=2,
                          module_kwargs=COMPARABLE if precision == "fp32" else None, **options)  # bf16: step 1 only
        assert_only_mtp_moved(snapshot)
        audit = json.loads((tmp_path / name / "mtp_only_audit.json").read_text())
        runs[name] = snapshot, heads, audit
    (chunked, chunked_heads, chunked_audit), (whole, whole_heads, whole_audit), (plain, plain_heads, plain_audit) = (
        list(runs.values())[:3])
    assert_main_head_on_demand_changes_only_lm_loss(runs["on_demand"], runs["chunked"], logs["on_demand"].steps,
                                                    logs["chunked"].steps)
    curves = json.loads((tmp_path / "curves" / "curves.json").read_text())  # no stale lm_loss in between
    assert [step for step, _ in curves["lm_loss"]] == [2] and len(curves["mtp_loss"]) == 3
    # per microbatch, the MTP depth's call and (chunked) 32 tokens / 8 main-head chunks; on demand only in the
    # logged step 2 (log_every_n_steps=2)
    assert chunked_heads.training_calls == 3 * 2 * (1 + 4) and runs["on_demand"][1].training_calls == 6 + 1 * 2 * 4
    assert whole_heads.training_calls == plain_heads.training_calls == 3 * 2 * 2
    # 3 steps x 2 microbatches: the MTP head's backward runs in all; the main head's only in the plain one, and with
    # chunked losses the main logits are made chunk by chunk without grad
    assert chunked_heads.chunked_mtp_loss and not whole_heads.chunked_mtp_loss and not plain_heads.chunked_mtp_loss
    assert chunked_heads.gradients == {"mtp": 6, "main": 0} and chunked_heads.main_logits_require_grad == []
    assert whole_heads.gradients == {"mtp": 6, "main": 0} and whole_heads.main_logits_require_grad == [False] * 6
    assert plain_heads.gradients == {"mtp": 6, "main": 6} and plain_heads.main_logits_require_grad == [True] * 6
    _assert_same_training(whole, plain, exact=True)
    if precision == "fp32":
        _assert_same_training(chunked, whole, exact=False)
    else:
        _assert_same_first_step_in_bf16(chunked, whole)
    assert chunked_audit == whole_audit == plain_audit and chunked_audit["frozen_bit_identical"]


class UnfreezeOutputLayer(pl.Callback):
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from megatron.core.utils import unwrap_model

        self.chunks = [unwrap_model(chunk) for chunk in pl_module.model]
        self.chunks[0].output_layer.weight.requires_grad_(True)


def test_skipping_the_main_head_backward_refuses_a_trainable_head(process_group, checkpoints, tmp_path):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from lightning_megatron.mtp.skip_main_head import skip_main_lm_head_backward

    unfreeze = UnfreezeOutputLayer()
    with pytest.raises(RuntimeError, match="main output layer's weight requires grad"):
        fit(tmp_path, checkpoints["qwen3_mtp"], 1, callbacks=(unfreeze,))
    MTPLossLoggingHelper.clean_metrics_in_tracker()  # the failed forward's MTP loss must not reach later tests
    with pytest.raises(ValueError, match="every non-MTP parameter frozen; trainable: .*output_layer.weight"):
        skip_main_lm_head_backward(unfreeze.chunks)
