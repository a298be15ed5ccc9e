"""What the MTP training tests share: a fit through the strategy (MTP-only unless told otherwise) and the
callbacks and checks that read parameters, gradients, logged metrics and the output layer's calls."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader

from lightning_megatron.callbacks import MTPOnlyCallback
from lightning_megatron.module import SFTModule
from lightning_megatron.mtp.parameters import is_mtp_parameter
from lightning_megatron.strategy import MegatronStrategy
from lightning_megatron.testing.datasets import RandomTokenDataset
from tests._adam import comparable_adam_eps

SEQ, VOCAB, SAMPLES, LR = 16, 384, 32, 1e-2
# the fits whose weights are compared with another computation's after their steps (chunked and whole logits):
# Adam's steps Lipschitz in the gradients, so the rounding differences stay below 1e-6 (tests/_adam.py)
COMPARABLE = {"adam_eps": comparable_adam_eps(LR)}


class Snapshot(pl.Callback):
    """Every parameter when fit starts (after freezing) and at its end; what the optimizer holds; MTP grads."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.before = named_parameters(pl_module)
        self.trainable = {name for name, p in named_parameters(pl_module, keep=True).items() if p.requires_grad}
        from megatron.core.distributed import DistributedDataParallel

        optimizer = trainer.optimizers[0].megatron_optimizer
        self.optimizer_numel = sum(p.numel() for p in optimizer.get_parameters())
        # Megatron DDP's grad buffers: only what trains gets one (no fp32 grads of frozen weights)
        self.grad_buffer_numel = sum(p.numel() for chunk in pl_module.model
                                     if isinstance(chunk, DistributedDataParallel)
                                     for buffer in chunk.buffers for p in buffer.params)
        self.mtp_grads: list[dict[str, torch.Tensor]] = []
        self.metrics: list[dict[str, float]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.mtp_grads.append({name: p.main_grad.detach().clone()
                               for name, p in named_parameters(pl_module, keep=True).items()
                               if is_mtp_parameter(name) and p.requires_grad})

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.metrics.append({key: float(value) for key, value in trainer.callback_metrics.items()})

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.after = named_parameters(pl_module)


class RecordedLogs(Logger):
    """The training metrics that reach a logger, one dict per logged step (what a real logger would write)."""

    name, version = "recorded", 0

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[dict[str, float]] = []

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if "mtp_loss" in metrics:
            self.steps.append(dict(metrics))


def named_parameters(pl_module: pl.LightningModule, keep: bool = False) -> dict[str, torch.Tensor]:
    from megatron.core.utils import unwrap_model

    return {f"{index}.{name}": (param if keep else param.detach().clone())
            for index, chunk in enumerate(pl_module.model)
            for name, param in unwrap_model(chunk).named_parameters()}


def fit(tmp_path: Path, hf_checkpoint: Path, steps: int, *, mtp_only: bool = True, devices: int = 1,
        dataset: Any = None, lr: float = LR, module_kwargs: dict | None = None, callbacks: tuple = (),
        skip_main_head_backward: bool = True, loss_chunk_tokens: int | None = 8, validate_every: int | None = None,
        log_lm_loss_every_n_steps: int | None = 1, logger: Logger | None = None, log_every_n_steps: int = 1,
        trainer_kwargs: dict | None = None, **strategy_kwargs: Any) -> tuple[Snapshot, pl.Trainer]:
    """`steps` optimizer steps of the tiny model through `MegatronStrategy` on CPU fp32, MTP-only unless `mtp_only` is
    false; the run's `Snapshot` and trainer (`trainer_kwargs`: more `Trainer` arguments)."""
    options = dict(bridge_type="megatron-bridge", micro_batch_size=2, global_batch_size=4, precision="fp32",
                   use_distributed_optimizer=False) | strategy_kwargs
    snapshot = Snapshot()
    mtp_only_callback = MTPOnlyCallback(skip_main_head_backward=skip_main_head_backward,
                                        loss_chunk_tokens=loss_chunk_tokens,
                                        log_lm_loss_every_n_steps=log_lm_loss_every_n_steps)
    callbacks = [snapshot, *callbacks] + ([mtp_only_callback] if mtp_only else [])
    validation = dict(val_check_interval=validate_every, limit_val_batches=2, num_sanity_val_steps=0)
    trainer = pl.Trainer(strategy=MegatronStrategy(hf_checkpoint=str(hf_checkpoint), **options), accelerator="cpu",
                         devices=devices, max_steps=steps, logger=logger or False, enable_checkpointing=False,
                         log_every_n_steps=log_every_n_steps,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=callbacks, **(validation if validate_every else {}) | (trainer_kwargs or {}))
    # MTP-only detaches the head, as the MTP-only configs do (it then logs grad_norm_mtp)
    module = SFTModule(**({"enable_mtp": True, "lr": lr, "mtp_detach_heads": mtp_only} | (module_kwargs or {})))
    dataset = dataset or RandomTokenDataset(SAMPLES, SEQ, VOCAB)
    loader = DataLoader(dataset, batch_size=options["micro_batch_size"], drop_last=True)
    val_loader = DataLoader(dataset, batch_size=options["micro_batch_size"], drop_last=True) if validate_every else None
    trainer.fit(module, loader, val_loader)
    return snapshot, trainer


def assert_only_mtp_moved(snapshot: Snapshot) -> None:
    mtp = {name for name in snapshot.before if is_mtp_parameter(name)}
    assert snapshot.trainable == mtp
    frozen_moved = [name for name in snapshot.before if name not in mtp
                    and not torch.equal(snapshot.before[name], snapshot.after[name])]
    assert frozen_moved == []
    assert all(not torch.equal(snapshot.before[name], snapshot.after[name]) for name in mtp)
    assert snapshot.optimizer_numel == snapshot.grad_buffer_numel == sum(snapshot.before[name].numel() for name in mtp)


class HeadGradients(pl.Callback):
    """How many gradients reach the output layer's logits, per kind of call: in each forward of a last-stage chunk
    Megatron-Core calls it for the MTP depth first, then for the main logits."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from megatron.core.utils import unwrap_model

        self.gradients = {"mtp": 0, "main": 0}
        self.training_calls = 0  # output-layer calls in training forwards, main-head chunks under no_grad too
        self.main_logits_require_grad: list[bool] = []
        self.chunked_mtp_loss = False
        for chunk in pl_module.model:
            model = unwrap_model(chunk)
            if model.post_process:
                self.chunked_mtp_loss |= "compute_language_model_loss" in vars(model)  # MTPOnlyCallback's, for the fit
                calls = []
                model.register_forward_pre_hook(lambda *_: calls.clear())
                model.output_layer.register_forward_hook(partial(self._count, calls))

    def _count(self, calls: list[str], module: torch.nn.Module, args: tuple, output: tuple) -> None:
        self.training_calls += module.training
        if not torch.is_grad_enabled():
            return
        kind = "mtp" if not calls else "main"
        calls.append(kind)
        if kind == "main":
            self.main_logits_require_grad.append(output[0].requires_grad)
        if output[0].requires_grad:
            output[0].register_hook(lambda gradient: self.gradients.update({kind: self.gradients[kind] + 1}))


def assert_same_gradients_and_weights(first: Snapshot, second: Snapshot) -> None:
    """The MTP gradients of every step and the weights at the end, to 1e-6."""
    for ours, theirs in zip(first.mtp_grads, second.mtp_grads, strict=True):
        assert ours.keys() == theirs.keys()
        for name in ours:
            torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=1e-6)
    for name in first.after:
        torch.testing.assert_close(first.after[name], second.after[name], rtol=0, atol=1e-6)


def assert_main_head_on_demand_changes_only_lm_loss(on_demand: tuple, every_step: tuple, on_demand_logs: list,
                                                    every_step_logs: list) -> None:
    """The main head on demand (`MTPOnlyCallback`'s default: in the steps the logger records, every second one
    here) against the main head in every step: the same MTP losses, accuracies, grad norms, validation, MTP
    gradients, weights and audit; the same `lm_loss` in every logged step; none logged in the first step, which
    skipped the head (the only step before any value could be stale)."""
    (ours, ours_heads, ours_audit), (theirs, theirs_heads, theirs_audit) = on_demand, every_step
    assert ours_heads.gradients == theirs_heads.gradients and ours_audit == theirs_audit
    assert ours_audit["frozen_bit_identical"]
    assert "lm_loss" not in ours.metrics[0] and "lm_loss" in theirs.metrics[0]
    for mine, other in zip(ours.metrics, theirs.metrics, strict=True):  # callback_metrics keep a stale lm_loss
        mine, other = ({k: v for k, v in metrics.items() if k != "lm_loss"} for metrics in (mine, other))
        assert mine.keys() == other.keys() and mine == pytest.approx(other, rel=0, abs=1e-6)
    assert_same_gradients_and_weights(ours, theirs)
    assert on_demand_logs and len(on_demand_logs) == len(every_step_logs)
    for mine, other in zip(on_demand_logs, every_step_logs):
        assert "lm_loss" in mine and mine.keys() == other.keys() and mine == pytest.approx(other, rel=0, abs=1e-6)


def block_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Whole-vocabulary fp32 logits `[b, s, V]` of the main head and then of each MTP depth, from the MTP block's
    output in the model's own forward on `batch` (an unwrapped last-stage GPTModel of one process), under no grad."""
    from lightning_megatron.microbatch import model_inputs

    captured = {}
    hook = model.mtp.register_forward_hook(lambda module, args, output: captured.update(hidden=output))
    with torch.no_grad():
        model(**model_inputs(batch))
        hook.remove()
        tied = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
        return [model.output_layer(hidden, weight=tied)[0].transpose(0, 1).float()
                for hidden in captured["hidden"].chunk(1 + model.config.mtp_num_layers, dim=0)]
