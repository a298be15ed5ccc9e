"""The training step's metrics reach the loggers, the callbacks and the progress bar exactly as `self.log` puts them
there, while most steps skip `self.log`'s host work (`MegatronLightningModule.log_step_metrics`, issue 41); the
optimizer's `zero_grad` walks the parameters once between two steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers.logger import Logger
from torch.utils.data import DataLoader

from lightning_megatron.module import SFTModule
from lightning_megatron.strategy import MegatronStrategy
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from lightning_megatron.testing.datasets import RandomTokenDataset
from tests._distributed import init_one_gpu_process, run_in_fresh_process

SEQ, VOCAB, MICRO_BATCH, GLOBAL_BATCH = 16, 384, 1, 2
TRAINING_STEP_METRICS = ("lm_loss", "mtp_loss", "mtp_accuracy")  # SFTModule's, with an MTP head
OPTIMIZER_STEP_METRICS = ("grad_norm", "lr")  # the strategy's


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("step_metrics") / "qwen3_mtp", "qwen3", mtp=True)


class RecordingLogger(Logger):
    """Every `log_metrics` call a logger gets: its step and metrics."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class RecordMetrics(pl.Callback):
    """What callbacks and the progress bar read after each training step and at each epoch's end."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.epoch_ends: list[dict[str, float]] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))
        metrics = trainer.callback_metrics
        self.steps.append({"callback": {name: float(value) for name, value in metrics.items()},
                           "devices": {name: value.device.type for name, value in metrics.items()},
                           "progress_bar": dict(trainer.progress_bar_metrics)})

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.epoch_ends.append({name: float(value) for name, value in trainer.callback_metrics.items()})


class SelfLoggingSFTModule(SFTModule):
    """`SFTModule` whose class overrides `log` (unchanged): every metric goes through `self.log`, as before."""

    def log(self, *args: Any, **kwargs: Any) -> None:
        super().log(*args, **kwargs)


def _fit(checkpoint: Path, root: Path, module: SFTModule, *, callbacks: tuple[pl.Callback, ...] = (),
         **trainer_options: Any) -> tuple[pl.Trainer, RecordMetrics]:
    recorder = RecordMetrics()
    strategy = MegatronStrategy(hf_checkpoint=str(checkpoint), bridge_type="megatron-bridge",
                                micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH, precision="fp32")
    options = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                   num_sanity_val_steps=0) | trainer_options
    trainer = pl.Trainer(strategy=strategy, devices=1, default_root_dir=root, callbacks=[recorder, *callbacks],
                         **{"accelerator": "cpu", **options})
    train = DataLoader(RandomTokenDataset(3 * GLOBAL_BATCH, SEQ, VOCAB, seed=0), batch_size=MICRO_BATCH,
                       drop_last=True)
    validation = DataLoader(RandomTokenDataset(GLOBAL_BATCH, SEQ, VOCAB, seed=1), batch_size=MICRO_BATCH)
    trainer.fit(module, train, validation if options.get("val_check_interval") else None)
    return trainer, recorder


def _count_self_log(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names `self.log` is called with from now on (Lightning's own `log`, still the one every module runs)."""
    logged: list[str] = []
    self_log = pl.LightningModule.log

    def counting_log(module: pl.LightningModule, name: str, *args: Any, **kwargs: Any) -> None:
        logged.append(name)
        self_log(module, name, *args, **kwargs)

    monkeypatch.setattr(pl.LightningModule, "log", counting_log)
    return logged


def test_every_logger_callback_and_progress_bar_sees_what_self_log_gives_them(mtp_checkpoint, tmp_path, monkeypatch,
                                                                             process_group):
    """Two epochs of three steps, validation after the second step of each, the logger every second step, a progress
    bar: the logger's records, the callback and progress-bar metrics after every step and at each epoch's end, and
    the trainer's metrics after the fit equal those of the same fit with every metric through `self.log`; and
    `self.log` ran only where Lightning resets the step's metrics (each epoch's first step: once per metric)."""
    logged = _count_self_log(monkeypatch)
    options = dict(max_epochs=2, log_every_n_steps=2, enable_progress_bar=True, val_check_interval=2,
                   limit_val_batches=1)
    fits, step_logs = {}, {}
    for name, module_class in (("step_metrics", SFTModule), ("self_log", SelfLoggingSFTModule)):
        logger = RecordingLogger()
        trainer, recorder = _fit(mtp_checkpoint, tmp_path / name, module_class(enable_mtp=True, lr=1e-3),
                                 logger=logger, **options)
        fits[name] = {"records": logger.records, "steps": recorder.steps, "epoch_ends": recorder.epoch_ends,
                      "callback_metrics": {key: float(value) for key, value in trainer.callback_metrics.items()},
                      "logged_metrics": {key: float(value) for key, value in trainer.logged_metrics.items()},
                      "progress_bar_metrics": dict(trainer.progress_bar_metrics), "losses": recorder.losses}
        step_logs[name] = [metric for metric in logged if not metric.startswith("val_")]
        logged.clear()
    ours, theirs = fits["step_metrics"], fits["self_log"]
    assert ours == theirs
    every_step = [*TRAINING_STEP_METRICS, *OPTIMIZER_STEP_METRICS]
    assert step_logs == {"step_metrics": 2 * every_step, "self_log": 6 * every_step}  # each epoch's first step
    assert all(set(every_step) <= set(step["callback"]) for step in ours["steps"])
    assert [step["callback"]["lm_loss"] for step in ours["steps"]] == ours["losses"]  # this step's, never stale
    assert all(set(step["progress_bar"]) >= {"lm_loss", "mtp_loss"} for step in ours["steps"])


def test_a_lightning_without_the_internals_logs_every_metric_through_self_log(mtp_checkpoint, tmp_path, monkeypatch,
                                                                               process_group):
    """Where Lightning lacks what the short path writes through (`contract._lightning_keeps_step_metrics`), every
    step's metrics go through `self.log`, each step's own values."""
    from lightning_megatron import contract

    assert contract._lightning_keeps_step_metrics()  # the pinned Lightning has them: the test above takes the path
    monkeypatch.setattr(contract, "_LIGHTNING_KEEPS_STEP_METRICS", False)
    logged = _count_self_log(monkeypatch)
    _, recorder = _fit(mtp_checkpoint, tmp_path, SFTModule(enable_mtp=True, lr=1e-3), max_epochs=1)
    assert logged == 3 * [*TRAINING_STEP_METRICS, *OPTIMIZER_STEP_METRICS]
    assert [step["callback"]["lm_loss"] for step in recorder.steps] == recorder.losses


def _gpu_fit(checkpoint: str, root: str, out: str) -> None:
    """In a fresh process with NCCL: one epoch on the GPU with `self.log`'s calls counted."""
    init_one_gpu_process()
    with pytest.MonkeyPatch.context() as monkeypatch:
        logged = _count_self_log(monkeypatch)
        _, recorder = _fit(Path(checkpoint), Path(root), SFTModule(enable_mtp=True, lr=1e-3), accelerator="gpu",
                           max_epochs=1)
    torch.save({"logged": logged, "steps": recorder.steps, "losses": recorder.losses}, out)


@pytest.mark.gpu
def test_on_a_gpu_the_step_metrics_skip_self_log_after_the_first_step(mtp_checkpoint, tmp_path):
    """The losses' metrics live on the GPU (grad_norm and lr on the host): the check that a metric's state is on
    the value's device still lets them through, and every step's values are that step's."""
    fit = run_in_fresh_process(_gpu_fit, tmp_path, str(mtp_checkpoint), str(tmp_path / "fit"))
    assert fit["logged"] == [*TRAINING_STEP_METRICS, *OPTIMIZER_STEP_METRICS]
    assert [step["callback"]["lm_loss"] for step in fit["steps"]] == fit["losses"]
    assert all(step["devices"]["lm_loss"] == "cuda" and step["devices"]["lr"] == "cpu" for step in fit["steps"])


def test_checkpointing_and_early_stopping_monitor_the_step_metrics(mtp_checkpoint, tmp_path, process_group):
    """`ModelCheckpoint(monitor="lm_loss")` after every step keeps the step with the lowest loss; `EarlyStopping`
    on `mtp_loss` at each epoch's end reads that epoch's last step, and (no patience, an improvement it cannot
    reach) stops the fit after the second epoch with the first epoch's as its best."""
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpts", monitor="lm_loss", mode="min",
                                               every_n_train_steps=1, save_top_k=1)
    stopping = pl.callbacks.EarlyStopping(monitor="mtp_loss", patience=0, min_delta=1e9, check_on_train_epoch_end=True)
    trainer, recorder = _fit(mtp_checkpoint, tmp_path, SFTModule(enable_mtp=True, lr=1e-3),
                             callbacks=(checkpoints, stopping), enable_checkpointing=True, max_epochs=3)
    best = min(range(len(recorder.losses)), key=recorder.losses.__getitem__)
    assert float(checkpoints.best_model_score) == recorder.losses[best]
    assert Path(checkpoints.best_model_path).name == f"epoch={best // 3}-step={best + 1}.ckpt"
    assert trainer.global_step == 6 and stopping.stopped_epoch == 1
    assert float(stopping.best_score) == recorder.steps[2]["callback"]["mtp_loss"] == recorder.epoch_ends[0]["mtp_loss"]


def test_zero_grad_walks_the_parameters_once_between_steps_and_clears_what_a_step_set(model_parallel):
    """The strategy clears the gradients before each forward-backward and Lightning again before the step; the
    second call finds nothing to clear and skips Megatron's walk over the parameters, and a step's gradients are
    still cleared before the next backward; zeroed in place (`set_to_none=False`), they are still freed later."""
    from megatron.core.optimizer import OptimizerConfig

    from lightning_megatron.microbatch import model_inputs
    from lightning_megatron.optimizer import megatron_optimizer
    from lightning_megatron.schedule import wrap_chunks
    from tests._megatron import tiny_gpt, token_batch

    (chunk,) = wrap_chunks([tiny_gpt(mtp_layers=0)], bf16=False, train=True, grad_reduce_in_fp32=True,
                           overlap_grad_reduce=False, use_distributed_optimizer=True)
    optimizer = megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [chunk], bf16=False,
                                   use_distributed_optimizer=True, clip_grad=1.0)
    walks = []
    walk = optimizer.megatron_optimizer.zero_grad
    optimizer.megatron_optimizer.zero_grad = lambda *args: walks.append(args) or walk(*args)

    def stepped_gradients() -> int:
        return sum(param.grad is not None for group in optimizer.param_groups for param in group["params"])

    for step in range(3):
        chunk.zero_grad_buffer()
        optimizer.zero_grad()  # the strategy's, before the forward-backward
        assert stepped_gradients() == 0
        chunk(**model_inputs(token_batch(seed=step))).sum().backward()
        optimizer.zero_grad()  # Lightning's, in its closure after the training step
        optimizer.step()
        assert stepped_gradients() > 0
        assert len(walks) == step + 1
    assert all(torch.isfinite(param).all() for param in chunk.parameters())
    optimizer.zero_grad(set_to_none=False)  # zeroed in place: a later call still frees them
    assert stepped_gradients() > 0 and len(walks) == 4
    optimizer.zero_grad()
    assert stepped_gradients() == 0 and len(walks) == 5
