"""LightningModules whose model is Megatron-Core chunks built, wrapped and stepped by `MegatronStrategy`.

The strategy owns the model's life (built from the HF checkpoint before any `setup` hook, wrapped in Megatron DDP,
stepped by Megatron's schedules); the module says what one microbatch computes and what is logged. A training step
receives the microbatches of one global batch and hands them to `strategy.forward_backward`, which runs the
forward and backward passes of all of them (pipelined when PP > 1) and returns token-weighted metrics.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, override

import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_megatron.contract import MegatronLightningModule, logs_this_step
from lightning_megatron.generate import continuations, eos_token_ids, row_seed
from lightning_megatron.microbatch import LossOutput, Microbatch, model_inputs
from lightning_megatron.mtp.acceptance import MTPSampledAcceptance, PooledAcceptance
from lightning_megatron.mtp.draft_capture import DraftCapture, reduce_draft_totals
from lightning_megatron.mtp.parameters import (
    UntrainedDepths,
    check_mtp_loss_scaling_factor,
    clear_mtp_tracker,
    is_finite_number,
    mtp_parameter_flags,
    normalized_depth_weights,
    read_and_reset_mtp_tracker,
)
from lightning_megatron.mtp.probe import DraftAcceptance
from lightning_megatron.mtp.self_distill import (
    DISTILL_WEIGHTINGS,
    MTP_LOSS_TYPES,
    DistillWeighting,
    MTPLossType,
    use_mtp_depth_loss,
    use_mtp_depth_scales,
)
from lightning_megatron.mtp.skip_main_head import main_loss_skipped
from lightning_megatron.mtp.tv_loss import DEFAULT_TV_KL_DECAY, check_mtp_loss_options, depth_divergence
from lightning_megatron.options import ModelOptions

PROGRESS_BAR_METRICS = frozenset({"lm_loss", "mtp_loss"})  # the training metrics a progress bar shows


def masked_token_loss(microbatch: Microbatch, per_token_loss: torch.Tensor) -> LossOutput:
    """Response-only token loss: Megatron returns an unmasked per-token loss, the mask is the data's.

    An MTP-only step that skipped the main head (`main_loss_skipped`) reports no `lm_loss`; its token count stays,
    so Megatron scales the MTP gradients as always."""
    loss_mask = microbatch["loss_mask"].to(per_token_loss.device).float()
    loss_sum = (per_token_loss.float() * loss_mask).sum()
    num_tokens = loss_mask.sum().to(torch.int)
    if main_loss_skipped(per_token_loss):
        return loss_sum, num_tokens, {}
    return loss_sum, num_tokens, {"lm_loss": torch.stack([loss_sum.detach(), num_tokens.detach().float()])}


def _spans(numbers: list[int]) -> str:
    """Ascending integers as runs: [1, 3, 4, 5] -> "1, 3-5"."""
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][1] + 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    return ", ".join(str(first) if first == last else f"{first}-{last}" for first, last in runs)


def warmup_cosine(warmup_steps: int, total_steps: int | None, min_lr_ratio: float) -> Callable[[int], float]:
    """LR multiplier: linear warm-up to 1, then cosine decay to `min_lr_ratio` at `total_steps` (constant if None)."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if total_steps is None or total_steps <= warmup_steps:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier


class SFTModule(MegatronLightningModule):
    """Supervised fine-tuning: masked (response-only) token loss plus Megatron-Core's native MTP loss.

    In joint training the MTP loss also trains the shared trunk (backbone, embeddings, LM head), as Megatron-Core,
    DeepSeek-V3 and AReaL's joint mode do, unless `MTPOnlyCallback` freezes the rest or `mtp_detach_heads` keeps
    MTP gradients out of it.
    Logged every step: `lm_loss` (token-weighted over the global batch; with `MTPOnlyCallback` only on the steps
    it computes it, `log_lm_loss_every_n_steps`), `mtp_loss` (the hard-label cross-entropy,
    or the distillation loss: KL, TV or the blend; with several depths their mean by `mtp_depth_weights`, and
    `mtp_loss_depth_<k>` / `mtp_accuracy_depth_<k>` each), `mtp_accuracy` (argmax = data token), and on MoE
    models `moe_aux_loss` (the load-balancing loss, averaged like Megatron-LM reports it); each
    validation epoch: `val_lm_loss` and, with an MTP head, `val_mtp_acceptance` (the MTP draft at `t` equals the
    model's own greedy token at `t+2`: the speculative-decoding acceptance on the model's own continuations) and
    `val_mtp_sampled_acceptance` (the expected acceptance of speculative sampling at `mtp_sampling_temperature`,
    `sum_x min(p, q)` per position, `MTPSampledAcceptance`), both of the first depth's draft, counted where the
    drafted token is trained and in the same sequence (`mtp.draft_capture`). `draft_acceptance` measures both at
    every depth on given batches (`DraftProbe`, per weight version in an RL loop).
    `predict` returns greedy continuations (`ContinuationWriter` writes them).
    The optimizer is Megatron-Core's Adam (distributed, fp32 main weights), configured by the options below.

    Args:
        enable_mtp: keep the checkpoint's MTP head. With no MTP training (`enable_mtp_training: false`) the head is
            kept unchanged (frozen).
        enable_mtp_training: (default: `enable_mtp`) train the MTP head as an auxiliary loss weighted by
            `mtp_loss_scaling_factor`, jointly with the model unless `MTPOnlyCallback` freezes the rest; needs
            `enable_mtp`.
        mtp_loss_scaling_factor: the MTP loss's weight in the training loss (the overall weight with several depths).
        mtp_detach_heads: keep MTP gradients out of the shared trunk (backbone, embeddings, LM head) in joint
            training: a draft head that must not change the main model.
        mtp_loss_type: what the MTP head learns. "labels" (Megatron-Core's): the data's token `t+2`, so a draft for
            greedy decoding is best trained on the model's own greedy continuations (a generation step first).
            "self_distill": the detached main head's distribution for the same token, `softmax(z_main / T)` with
            `T = mtp_distill_temperature`, by KL divergence (`mtp.self_distill`): the target's own distribution on
            any text, no generation step, and what speculative sampling accepts. "tv": the acceptance rate itself,
            per token `1 - sum_x min(p_T, q_T)` with both distributions at `T = mtp_sampling_temperature`
            (`mtp.tv_loss`); "tv_kl": a per-token blend of KL and TV whose KL share
            `exp(-mtp_tv_kl_decay * acceptance)` carries the head while TV's gradient vanishes (little overlap).
        mtp_distill_temperature: T of "self_distill" (finite, > 0): T = 1 matches the target's distribution;
            T -> 0 is hard labels on the model's own greedy text.
        mtp_distill_weighting: ("self_distill", "tv", "tv_kl") weighs each position by how a server would feed it
            (the MTP layer reads token t + 1, which a server takes from the main head): "uniform" (all alike),
            "greedy" (only where token t + 1 is the main head's argmax), "sampled" (by its probability).
        mtp_sampling_temperature: the sampling temperature (finite, > 0) of "tv" and "tv_kl" and of the logged
            `val_mtp_sampled_acceptance`.
        mtp_tv_kl_decay: "tv_kl"'s decay: the KL share of the blend is `exp(-mtp_tv_kl_decay * acceptance)`.
        mtp_depths: (K, default 1) train the head at every drafting depth it serves, the checkpoint's one MTP layer
            applied K times, each depth reading the previous depth's output (Megatron-Core's repeated MTP layer:
            one set of weights, an export still writes one MTP layer, and the speculative decoder's K-token drafts
            apply it the same way). Depth k learns token t + k + 1 by the `mtp_loss_type` (its self-distillation or
            TV teacher the main head at t + k). Joint and MTP-only (`MTPOnlyCallback` still trains exactly one
            physical MTP layer).
        mtp_depth_weights: each depth's share of the MTP loss (one non-negative number per depth, ratios only;
            default equal, Megatron-Core's mean), `mtp_loss_scaling_factor` staying the overall weight.
        lr: the peak learning rate, reached after `warmup_steps`.
        min_lr_ratio: the learning rate decays by a cosine to `lr * min_lr_ratio` at the trainer's `max_steps` (no
            `max_steps`: it stays at `lr` after the warm-up).
        warmup_steps: optimizer steps of linear warm-up from `lr / warmup_steps` to `lr` (0: none).
        weight_decay: Adam's decoupled weight decay (AdamW's; Megatron-Core's `OptimizerConfig.weight_decay`).
        adam_beta1: Adam's beta1.
        adam_beta2: Adam's beta2.
        adam_eps: Adam's epsilon.
        max_new_tokens: `predict`'s continuations have up to this many tokens (at least 1).
        generation_temperature: `predict`'s decoding: 0 greedy (for a server that decodes greedily); above 0 each
            token sampled from softmax(logits / T), the on-policy contexts of rollouts sampled at T.
        generation_seed: with `generation_temperature` above 0, prompt i (its index in the predict data) is sampled
            from a generator seeded with `generate.row_seed(generation_seed, i)`: the same continuation at any batch
            size, data-parallel or tensor-parallel layout.
    """

    # its forward_step and loss_func are tensor work only (the MTP loss tracker is read after the step)
    replayable_training_step = True

    def __init__(
        self,
        enable_mtp: bool = False,
        enable_mtp_training: bool | None = None,
        mtp_loss_scaling_factor: float = 0.1,
        mtp_detach_heads: bool = False,
        mtp_loss_type: MTPLossType = "labels",
        mtp_distill_temperature: float = 1.0,
        mtp_distill_weighting: DistillWeighting = "uniform",
        mtp_sampling_temperature: float = 1.0,
        mtp_tv_kl_decay: float = DEFAULT_TV_KL_DECAY,
        mtp_depths: int = 1,
        mtp_depth_weights: list[float] | None = None,
        lr: float = 1e-5,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 0,
        weight_decay: float = 0.0,
        adam_beta1: float = 0.9,
        adam_beta2: float = 0.95,
        adam_eps: float = 1e-8,
        max_new_tokens: int = 128,
        generation_temperature: float = 0.0,
        generation_seed: int = 0,
    ) -> None:
        super().__init__()
        self.enable_mtp = enable_mtp
        self.enable_mtp_training = enable_mtp if enable_mtp_training is None else enable_mtp_training
        if self.enable_mtp_training and not enable_mtp:
            raise ValueError("enable_mtp_training: true needs enable_mtp: true (the MTP head must be kept to train it)")
        if self.enable_mtp_training:
            check_mtp_loss_scaling_factor(mtp_loss_scaling_factor)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: {max_new_tokens} must be at least 1")
        if not (is_finite_number(generation_temperature) and generation_temperature >= 0):
            raise ValueError(f"generation_temperature: {generation_temperature!r} must be finite and >= 0 (0: greedy "
                             "continuations; 1.0: samples of the model's own distribution)")
        if not 0 <= generation_seed < 2**31:
            raise ValueError(f"generation_seed: {generation_seed} must be in [0, 2**31)")
        if mtp_loss_type not in MTP_LOSS_TYPES:
            raise ValueError(f"mtp_loss_type: {mtp_loss_type!r} must be one of {list(MTP_LOSS_TYPES)}")
        if mtp_distill_weighting not in DISTILL_WEIGHTINGS:
            raise ValueError(f"mtp_distill_weighting: {mtp_distill_weighting!r} must be one of "
                             f"{list(DISTILL_WEIGHTINGS)}")
        for name, value in (("mtp_distill_temperature", mtp_distill_temperature),
                            ("mtp_sampling_temperature", mtp_sampling_temperature)):
            if not (is_finite_number(value) and value > 0):
                raise ValueError(f"{name}: {value!r} must be finite and > 0 (1.0: the target's own distribution)")
        if not enable_mtp and mtp_sampling_temperature != 1.0:
            raise ValueError(f"mtp_sampling_temperature: {mtp_sampling_temperature} is the temperature the MTP head's "
                             "val_mtp_sampled_acceptance and the tv losses compare at, and this module has no MTP "
                             "head; set enable_mtp: true, or leave mtp_sampling_temperature unset")
        self._depth_weights = normalized_depth_weights(mtp_depths, mtp_depth_weights)
        if mtp_depths > 1 and not self.enable_mtp_training:
            raise ValueError(f"mtp_depths: {mtp_depths} trains the MTP head at {mtp_depths} depths; it needs "
                             "enable_mtp: true with MTP training (enable_mtp_training unset or true)")
        check_mtp_loss_options(mtp_loss_type, training=self.enable_mtp_training,
                               distill_temperature=mtp_distill_temperature, distill_weighting=mtp_distill_weighting,
                               tv_kl_decay=mtp_tv_kl_decay, depth_weights=mtp_depth_weights)
        self._divergence = (None if mtp_loss_type == "labels" else depth_divergence(
            mtp_loss_type, mtp_distill_temperature, mtp_sampling_temperature, mtp_tv_kl_decay))
        self.save_hyperparameters()
        self.val_mtp_acceptance = PooledAcceptance()
        self.val_mtp_sampled_acceptance = MTPSampledAcceptance()
        self._depth_loss_handles: list[Any] = []
        self._warned_untrained_depths = False
        self._untrained_depths = UntrainedDepths()
        self._depth_weights_on_device: torch.Tensor | None = None
        self.generation_eos_token_ids: set[int] = set()  # where predict stops; read in setup("predict")

    def model_options(self) -> ModelOptions:
        return ModelOptions(
            mtp=self.enable_mtp,
            mtp_loss_scaling_factor=self.hparams.mtp_loss_scaling_factor if self.enable_mtp_training else 0.0,
            mtp_detach_heads=self.hparams.mtp_detach_heads,
            mtp_depths=self.hparams.mtp_depths,
        )

    def setup(self, stage: str) -> None:
        if stage == "predict":
            from transformers import AutoTokenizer

            if self.megatron_strategy.pipeline_model_parallel_size > 1:
                raise ValueError("predict generates with pipeline_model_parallel_size: 1 only; use tensor "
                                 "parallelism (tensor_model_parallel_size) to split a model that does not fit")
            if self.megatron_strategy.context_parallel_size > 1:
                raise ValueError("predict generates with context_parallel_size: 1 only (each new token needs the "
                                 "whole sequence); use tensor_model_parallel_size to split a model that does not fit")
            hf_checkpoint = self.megatron_strategy.hf_checkpoint
            self.generation_eos_token_ids = eos_token_ids(hf_checkpoint, AutoTokenizer.from_pretrained(hf_checkpoint))
        if self.enable_mtp and not self.enable_mtp_training:
            for _, parameter, is_mtp in mtp_parameter_flags(list(self.model)).values():
                if is_mtp:
                    parameter.requires_grad_(False)
        if self.enable_mtp_training and stage in ("fit", "validate"):
            clear_mtp_tracker()
            self._warned_untrained_depths = False
            self._untrained_depths = UntrainedDepths()
            if self._divergence is not None:
                self._depth_loss_handles = use_mtp_depth_loss(list(self.model), divergence=self._divergence,
                                                              distill_weighting=self.hparams.mtp_distill_weighting)
            # Megatron-Core weighs each of the K depths 1 / K
            scales = tuple(len(self._depth_weights) * weight for weight in self._depth_weights)
            if any(scale != 1.0 for scale in scales):
                self._depth_loss_handles += use_mtp_depth_scales(list(self.model), scales)

    def teardown(self, stage: str) -> None:
        for handle in self._depth_loss_handles:
            handle.remove()
        self._depth_loss_handles = []

    def forward_step(self, model: torch.nn.Module, microbatch: Microbatch) -> torch.Tensor:
        return model(**model_inputs(microbatch))

    def loss_func(self, microbatch: Microbatch, output: torch.Tensor) -> LossOutput:
        return masked_token_loss(microbatch, output)

    def training_step(self, microbatches: list[Microbatch]) -> torch.Tensor:
        """Returns `lm_loss`, or on an MTP-only step that skips the main head (no `lm_loss` logged) `mtp_loss`."""
        strategy = self.megatron_strategy
        metrics = strategy.forward_backward(microbatches, self.forward_step, self.loss_func)
        loss = metrics.get("lm_loss")
        logged = {} if loss is None else {"lm_loss": loss}
        logged.update(self._moe_aux_loss(len(microbatches)))
        if self.enable_mtp:
            mtp_metrics, untrained = read_and_reset_mtp_tracker(len(microbatches), strategy.root_device,
                                                                self._depth_weight_tensor(strategy.root_device))
            logged.update(mtp_metrics)
            loss = mtp_metrics["mtp_loss"] if loss is None else loss
            if self.enable_mtp_training and not self._warned_untrained_depths:
                self._untrained_depths.record(untrained, self.global_step)
                if logs_this_step(self.trainer):  # read on the host with the step's logged metrics, not every step
                    self._warn_untrained_depths()
        self.log_step_metrics(logged, prog_bar=PROGRESS_BAR_METRICS if self._progress_bar_shown() else ())
        return loss

    def _progress_bar_shown(self) -> bool:
        """Whether the training losses go to the progress bar: Lightning makes every progress-bar metric a Python
        number at the end of every batch (a host read that waits for the device), so only where a bar shows them."""
        return self.trainer.progress_bar_callback is not None

    def _depth_weight_tensor(self, device: torch.device) -> torch.Tensor:
        """`mtp_depth_weights` on `device`, made once: a tensor from host numbers is a copy that synchronises a GPU."""
        if self._depth_weights_on_device is None or self._depth_weights_on_device.device != device:
            self._depth_weights_on_device = torch.tensor(self._depth_weights, dtype=torch.float64, device=device)
        return self._depth_weights_on_device

    @override
    def on_train_end(self) -> None:
        if self.enable_mtp_training:
            self._warn_untrained_depths()  # a step since the last logged one may have had some

    def _warn_untrained_depths(self) -> None:
        """Once per fit: the depths the first such step's rows held no trained token for (their logged losses read
        0); recorded on the device every step, read here."""
        first = None if self._warned_untrained_depths else self._untrained_depths.first()
        if first is None:
            return
        self._warned_untrained_depths = True
        step, untrained = first
        rank_zero_warn(f"mtp_depths: {self.hparams.mtp_depths}: depth(s) {_spans(untrained)} had no trained token in "
                       f"step {step}'s rows (depth k trains token t + k + 1 of the same sequence); their "
                       "logged losses read 0. Lower mtp_depths, or train on longer sequences (said once per fit)")

    def _moe_aux_loss(self, num_microbatches: int) -> dict[str, torch.Tensor]:
        """`moe_aux_loss`: the routers' load-balancing loss (before its coefficient), apart from `lm_loss`; none
        without MoE layers."""
        from megatron.core.utils import get_model_config

        from lightning_megatron.moe import read_and_reset_moe_aux_loss

        aux_loss = read_and_reset_moe_aux_loss(get_model_config(self.model[0]), num_microbatches)
        return {} if aux_loss is None else {"moe_aux_loss": aux_loss}

    def validation_step(self, microbatches: list[Microbatch]) -> torch.Tensor:
        forward_step, loss_func = self.forward_step, self.loss_func
        if self.enable_mtp:
            capture = DraftCapture(self.forward_step, depths=1, temperature=self.hparams.mtp_sampling_temperature)
            forward_step, loss_func = capture.forward_step, partial(self._loss_func_counting_acceptance, capture)
        metrics = self.megatron_strategy.forward_backward(microbatches, forward_step, loss_func, forward_only=True)
        # already reduced over the ranks by the strategy: sync_dist averages equal values (one scalar per epoch)
        self.log("val_lm_loss", metrics["lm_loss"], prog_bar=True, sync_dist=True)
        if self.enable_mtp:
            self._count_nothing_off_the_last_stage()
            self.log("val_mtp_acceptance", self.val_mtp_acceptance, on_step=False, on_epoch=True, prog_bar=True)
            self.log("val_mtp_sampled_acceptance", self.val_mtp_sampled_acceptance, on_step=False, on_epoch=True)
        return metrics["lm_loss"]

    def _count_nothing_off_the_last_stage(self) -> None:
        """A pipeline stage without the MTP head adds an empty update to the pooled acceptance sums: the sums are
        unchanged, and torchmetrics, which warns on global rank 0 (a first stage) when `compute` follows no update,
        has nothing to say that a user could act on."""
        from megatron.core import parallel_state

        if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            nothing = torch.zeros(0, device=self.megatron_strategy.root_device)
            self.val_mtp_acceptance.update(nothing, nothing)
            self.val_mtp_sampled_acceptance.update(nothing, nothing)

    def _loss_func_counting_acceptance(self, capture: DraftCapture, microbatch: Microbatch,
                                       output: torch.Tensor) -> LossOutput:
        (first_depth,) = capture.positions()
        self.val_mtp_acceptance.update(first_depth.greedy, first_depth.counted)
        self.val_mtp_sampled_acceptance.update(first_depth.sampled, first_depth.counted)
        return self.loss_func(microbatch, output)

    def draft_acceptance(self, batches: Iterable[list[Microbatch]], temperature: float) -> DraftAcceptance:
        """The MTP head's teacher-forced acceptance at every depth (`mtp_depths`) on `batches` (`DraftProbe`, which
        sets eval mode and no grad): greedy, and sampled at `temperature`; pooled over tokens and data-parallel
        ranks, the same on every rank. Depth 1 is what validation logs on the same batches."""
        if not self.enable_mtp:
            raise ValueError("draft acceptance measures the MTP head: SFTModule(enable_mtp=True) on a checkpoint "
                             "with one; this module has enable_mtp: false")
        start, strategy = time.perf_counter(), self.megatron_strategy
        capture = DraftCapture(self.forward_step, depths=self.hparams.mtp_depths, temperature=temperature)
        totals = torch.zeros(self.hparams.mtp_depths, 3, dtype=torch.float64, device=strategy.root_device)

        def count(microbatch: Microbatch, output: torch.Tensor) -> LossOutput:
            totals.add_(torch.stack([depth.totals() for depth in capture.positions()]).to(totals.device))
            return self.loss_func(microbatch, output)

        read = 0
        for microbatches in batches:
            strategy.forward_backward(microbatches, capture.forward_step, count, forward_only=True)
            read += 1
        return DraftAcceptance.from_totals(reduce_draft_totals(totals), temperature, read,
                                           time.perf_counter() - start)

    def predict_step(self, microbatches: list[Microbatch]) -> list[dict[str, Any]]:
        """Continuations (greedy, or sampled at `generation_temperature`), one `{"index", "token_ids"}` per prompt (the
        index is the prompt's dataset index, which also seeds its sampling)."""
        strategy = self.megatron_strategy
        width_multiple = strategy.tensor_model_parallel_size if strategy.sequence_parallel else 1
        answers = []
        for microbatch in microbatches:
            indices = microbatch["indices"].tolist()
            generated = continuations(self.model[0], microbatch["input_ids"], microbatch["prompt_lengths"],
                                      self.hparams.max_new_tokens, self.generation_eos_token_ids,
                                      temperature=self.hparams.generation_temperature,
                                      row_seeds=[row_seed(self.hparams.generation_seed, index) for index in indices],
                                      width_multiple=width_multiple)
            answers.extend({"index": index, "token_ids": token_ids} for index, token_ids in zip(indices, generated))
        return answers

    def test_step(self, microbatches: list[Microbatch]) -> torch.Tensor:
        metrics = self.megatron_strategy.forward_backward(microbatches, self.forward_step, self.loss_func,
                                                          forward_only=True)
        self.log("test_lm_loss", metrics["lm_loss"], sync_dist=True)
        return metrics["lm_loss"]

    def configure_optimizers(self) -> dict[str, Any]:
        from megatron.core.optimizer import OptimizerConfig

        hp = self.hparams
        optimizer = self.megatron_strategy.megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=hp.lr, min_lr=hp.lr * hp.min_lr_ratio, weight_decay=hp.weight_decay,
            adam_beta1=hp.adam_beta1, adam_beta2=hp.adam_beta2, adam_eps=hp.adam_eps,
        ))
        total_steps = self.trainer.max_steps if self.trainer.max_steps > 0 else None
        schedule = warmup_cosine(hp.warmup_steps, total_steps, hp.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
