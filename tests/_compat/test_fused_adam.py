"""`megatron_core.fused_adam`: the torch Adam Megatron-Core builds without TE or Apex, stepped by torch's fused kernel.

On the CPU: upstream still builds torch's AdamW with neither flag (torch's foreach on CUDA) for every kind of Megatron
optimizer; the adjustment is not applied there, and applied (with the CPU's parameters among those it switches, as a
GPU machine switches CUDA ones) every torch Adam inside is fused, checkpoints keep the flags upstream built with and
pass `safe_load`, and what cannot run fused (a GPU machine's CPU fits, SGD, the CPU offload's hybrid optimizer) stays
upstream's; torch's fused step differs from its foreach and for-loop steps by rounding alone (the derived bound,
`tests/_adam.py`), through Megatron-Core's optimizer too; a resume across implementations (saved upstream, resumed
fused, and back) steps on as the uninterrupted run that switched at the same step, bit for bit. On a GPU (the real
condition, `test_fused_adam_gpu.py`): the same, with the foreach step's temporaries gone.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron._compat import fused_adam
from lightning_megatron.module import SFTModule
from lightning_megatron.optimizer import megatron_optimizer
from lightning_megatron.strategy import MegatronStrategy
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from lightning_megatron.testing.datasets import RandomTokenDataset
from tests._adam import fp32_adam_step_bound
from tests._compat._compiled import applied
from tests.test_optimizer import _offloaded_optimizer, _saved_and_loaded

ADJUSTMENT = fused_adam.ADJUSTMENTS[0]
LR = 1e-3
CONFIGURATIONS = [("fp32", False), ("bf16", False), ("bf16", True), ("fp32", True)]
CONFIGURATION_IDS = ["fp32", "bf16", "bf16_distributed", "fp32_distributed"]


@contextlib.contextmanager
def fused_on_cpu() -> Iterator[None]:
    """The adjustment applied as a GPU machine applies it, the CPU's parameters among those it switches."""
    with mock.patch.object(fused_adam, "FUSED_DEVICE_TYPES", ("cpu",)), applied(ADJUSTMENT):
        yield


def adams(megatron: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizer inside each part of a Megatron-Core optimizer."""
    return [part.optimizer for part in megatron.chained_optimizers]


def build(precision: str, distributed: bool, device: str = "cpu", **config: Any) -> tuple[torch.nn.Module, Any]:
    """A tiny GPT on `device` wrapped in Megatron DDP and Megatron-Core's optimizer for it, as the strategy builds
    it; seeded, so two builds are the same model."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from tests._megatron import tiny_gpt

    tensor_parallel.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
    torch.manual_seed(1234)
    bf16 = precision == "bf16"
    model = tiny_gpt(mtp_layers=0, bf16=bf16)
    model = (model.bfloat16() if bf16 else model).to(device)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=distributed),
                                  model)
    adapter = megatron_optimizer(OptimizerConfig(**{"optimizer": "adam", "lr": LR, **config}), [ddp], bf16=bf16,
                                 use_distributed_optimizer=distributed, clip_grad=1.0)
    return ddp, adapter.megatron_optimizer


def set_gradients(ddp: torch.nn.Module, seed: int = 0) -> None:
    """The same gradients for the same model, in Megatron DDP's buffer (where the optimizer reads them)."""
    generator = torch.Generator().manual_seed(seed)
    for param in ddp.parameters():
        param.main_grad.copy_(torch.randn(param.shape, generator=generator))


def flags(optimizer: torch.optim.Optimizer) -> set[tuple[Any, Any]]:
    return {(group["fused"], group["foreach"]) for group in (optimizer.defaults, *optimizer.param_groups)}


def test_the_cpu_keeps_upstreams_adam(model_parallel) -> None:
    if torch.cuda.is_available():
        pytest.skip("the CPU's condition; test_fused_adam_gpu.py covers CUDA")
    assert not ADJUSTMENT.needed() and not ADJUSTMENT.active
    _, megatron = build("bf16", True)
    assert fused_adam.implementations(megatron) == ["for-loop"]


@pytest.mark.parametrize(("precision", "distributed"), CONFIGURATIONS, ids=CONFIGURATION_IDS)
def test_upstream_builds_torch_adamw_with_neither_flag(model_parallel, precision, distributed) -> None:
    """Why it is needed: without TE/Apex every kind of Megatron-Core optimizer wraps a torch AdamW whose groups set
    neither `fused` nor `foreach`, so torch's step takes foreach wherever every parameter is on CUDA
    (torch/optim/adam.py:937-941). An upgrade that builds it fused fails here first."""
    assert fused_adam.upstream_builds_torch_adam_unfused()
    with ADJUSTMENT.suspended():
        _, megatron = build(precision, distributed)
    (inner,) = adams(megatron)
    assert type(inner) is torch.optim.AdamW and flags(inner) == {(None, None)}


def test_the_switch(monkeypatch) -> None:
    monkeypatch.setenv(fused_adam.OPT_IN, "0")
    assert not ADJUSTMENT.needed()
    monkeypatch.setenv(fused_adam.OPT_IN, "1")
    assert ADJUSTMENT.needed() == torch.cuda.is_available()
    monkeypatch.setenv(fused_adam.OPT_IN, "true")
    with pytest.raises(ValueError, match=r"LIGHTNING_MEGATRON_FUSED_ADAM='true' is not 0 or 1: set it to 0 \(torch's "
                                         r"foreach Adam, as Megatron-Core builds it\) or 1"):
        ADJUSTMENT.needed()


@pytest.mark.parametrize(("precision", "distributed"), CONFIGURATIONS, ids=CONFIGURATION_IDS)
def test_applied_every_torch_adam_inside_steps_fused_and_saves_as_upstream(model_parallel, precision, distributed):
    """Applied: the torch Adam of every kind of Megatron-Core optimizer is fused (defaults and groups), its first
    step makes float32 step counts on the parameters' device; its state dict holds the flags upstream built it with
    (so does a checkpoint), which `safe_load` admits, and loaded back it is fused again with the same step counts. A
    revert builds upstream's again; an optimizer built before it stays fused."""
    with fused_on_cpu():
        ddp, megatron = build(precision, distributed)
    (inner,) = adams(megatron)
    assert fused_adam.implementations(megatron) == ["fused"] and flags(inner) == {(True, False)}
    set_gradients(ddp)
    megatron.step()
    assert {(float(state["step"]), state["step"].dtype, state["step"].device.type)
            for state in inner.state.values()} == {(1.0, torch.float32, "cpu")}
    saved = _saved_and_loaded(copy.deepcopy(megatron.state_dict()))  # through `safe_load`, as checkpoints load
    common = saved["optimizer"] if "optimizer" in saved else saved  # the fp32 optimizer's is the torch state dict
    assert {(group["fused"], group["foreach"]) for group in common["param_groups"]} == {(None, None)}
    megatron.load_state_dict(saved)
    assert flags(inner) == {(True, False)}
    steps = [state["step"] for state in inner.state.values()]
    assert {(float(step), step.dtype) for step in steps} == {(1.0, torch.float32)}
    assert len({id(step) for step in steps}) == len(steps)  # each its own: the kernel adds one to each
    _, rebuilt = build(precision, distributed)
    assert fused_adam.implementations(rebuilt) == ["for-loop"] and fused_adam.implementations(megatron) == ["fused"]


def test_what_cannot_run_fused_stays_upstreams(model_parallel) -> None:
    """Applied as on a GPU machine: a fit on its CPU keeps the for-loop Adam, the suite's reference; SGD is no Adam;
    the CPU offload's hybrid optimizer (no torch Adam) is left as it is, its torch AdamWs fused by upstream."""
    with applied(ADJUSTMENT):
        _, megatron = build("bf16", True)
        assert fused_adam.implementations(megatron) == ["for-loop"]
    with fused_on_cpu():
        _, sgd = build("bf16", False, optimizer="sgd")  # the distributed optimizer takes Adam only
        hybrid = _offloaded_optimizer()
    assert fused_adam.implementations(sgd) == ["SGD"]
    assert fused_adam.implementations(hybrid) == ["HybridDeviceOptimizer"]
    (inner,) = adams(hybrid)
    assert {group["fused"] for sub in inner.sub_optimizers for group in sub.param_groups} == {True}


@pytest.mark.parametrize("step", [1, 7])
def test_torchs_fused_step_differs_from_its_other_implementations_by_rounding_alone(step) -> None:
    """One AdamW step from the same state (zero moments at step 1, moments of any size later), weights and gradients
    over twelve orders of magnitude: fused, foreach and for-loop results within `fp32_adam_step_bound`; the moments
    within their own rounding (|m'| 12u M, v' 8u v': twice one implementation's, see the bound)."""
    generator = torch.Generator().manual_seed(step)
    count, lr, betas, eps, weight_decay = 4096, 1e-3, (0.9, 0.95), 1e-8, 0.01
    params = torch.randn(count, generator=generator) * torch.logspace(-3, 1, count)
    grads = torch.randn(count, generator=generator) * torch.logspace(-6, 0, count)[torch.randperm(count,
                                                                                                generator=generator)]
    exp_avgs = torch.zeros(count) if step == 1 else torch.randn(count, generator=generator) * 1e-2
    exp_avg_sqs = torch.zeros(count) if step == 1 else torch.rand(count, generator=generator) * 1e-4
    results = {}
    for name, implementation in {"fused": dict(fused=True), "foreach": dict(foreach=True),
                                 "for-loop": dict(foreach=False)}.items():
        param = torch.nn.Parameter(params.clone())
        optimizer = torch.optim.AdamW([param], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      **implementation)
        optimizer.state[param].update(step=torch.tensor(step - 1.0), exp_avg=exp_avgs.clone(),
                                      exp_avg_sq=exp_avg_sqs.clone())
        param.grad = grads.clone()
        optimizer.step()
        state = optimizer.state[param]
        results[name] = (param.detach(), state["exp_avg"], state["exp_avg_sq"])
    reference, reference_m, reference_v = results["for-loop"]
    bound = fp32_adam_step_bound(params, reference, grads, step=step, lr=lr, betas=betas, eps=eps,
                                 exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs)
    u = 2.0 ** -24
    m_bound = 12 * u * (betas[0] * exp_avgs.double().abs() + (1 - betas[0]) * grads.double().abs())
    v_bound = 8 * u * reference_v.double()
    for name in ("fused", "foreach"):
        param, m, v = results[name]
        assert ((param.double() - reference.double()).abs() <= bound).all(), name
        assert ((m.double() - reference_m.double()).abs() <= m_bound).all(), name
        assert ((v.double() - reference_v.double()).abs() <= v_bound).all(), name


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def first_step_apart(precision: str, distributed: bool, device: str = "cpu") -> dict[str, Any]:
    """One step of a fused and an upstream Megatron-Core optimizer on the same model and gradients: the torch
    Adams' weights before and after, the gradients they stepped with, and their group's hyperparameters. On the
    CPU the adjustment is forced, on CUDA it is what its condition applies."""
    fused_context = fused_on_cpu if device == "cpu" else contextlib.nullcontext
    results = {}
    for name, context in (("fused", fused_context), ("upstream", ADJUSTMENT.suspended)):
        with context():
            ddp, megatron = build(precision, distributed, device)
        (inner,) = adams(megatron)
        params = [param for group in inner.param_groups for param in group["params"]]
        before = [_host_copy(param) for param in params]
        set_gradients(ddp)
        megatron.step()
        results[name] = {
            "implementation": fused_adam.implementations(megatron), "before": before,
            "after": [_host_copy(param) for param in params], "grads": [_host_copy(param.grad) for param in params],
            "model": [_host_copy(param) for param in ddp.parameters()],
            "groups": [(group["lr"], group["betas"], group["eps"]) for group in inner.param_groups
                       for _ in group["params"]]}
    return results


def assert_one_step_apart_by_rounding(results: dict[str, Any], precision: str) -> None:
    """The two first steps started equal and ended within `fp32_adam_step_bound` of each other (the fp32 weights
    the torch Adams step); bf16 model weights, rounded from them, within one bf16 ulp (2^-7 relative: a rounding
    that the fp32 difference moved across)."""
    fused, upstream = results["fused"], results["upstream"]
    assert all(map(torch.equal, fused["before"], upstream["before"]))
    assert all(map(torch.equal, fused["grads"], upstream["grads"]))
    for before, after, expected, grads, (lr, betas, eps) in zip(
            fused["before"], fused["after"], upstream["after"], fused["grads"], fused["groups"], strict=True):
        bound = fp32_adam_step_bound(before, expected, grads, step=1, lr=lr, betas=betas, eps=eps)
        assert ((after.double() - expected.double()).abs() <= bound).all()
    if precision == "bf16":
        for got, expected in zip(fused["model"], upstream["model"], strict=True):
            assert ((got.double() - expected.double()).abs() <= 2.0 ** -7 * expected.double().abs()).all()


@pytest.mark.parametrize(("precision", "distributed"), CONFIGURATIONS, ids=CONFIGURATION_IDS)
def test_one_fused_step_is_upstreams_within_rounding(model_parallel, precision, distributed) -> None:
    results = first_step_apart(precision, distributed)
    assert results["fused"]["implementation"] == ["fused"]
    assert results["upstream"]["implementation"] == ["for-loop"]
    assert_one_step_apart_by_rounding(results, precision)


# resuming across implementations ----------------------------------------------------------------------------------

SEQ, VOCAB, SAMPLES, STEPS, SAVED_AT = 16, 384, 32, 4, 2
IMPLEMENTATION_ON_CPU = {"fused": ["fused"], "upstream": ["for-loop"]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fused_adam") / "qwen3", "qwen3")


def back_to_upstream(optimizer: torch.optim.Optimizer) -> None:
    """What upstream's load of a checkpoint gives a torch Adam: neither flag, each step count a CPU tensor
    (megatron/core/optimizer/distrib_optimizer.py:1028, then `no_te`'s distinct copies)."""
    for target in (optimizer.defaults, *optimizer.param_groups):
        target.update(fused=None, foreach=None)
    for state in optimizer.state.values():
        state["step"] = torch.tensor(float(state["step"]))


SWITCHES = {"fused": lambda optimizer: fused_adam.switch_to_fused(optimizer, ("cpu", "cuda")),
            "upstream": back_to_upstream}


class AdamRecord(pl.Callback):
    """Each step's loss; the torch Adams' implementation and step counts as the fit's first step starts and as it
    ends; `switch` applied to them as step `SAVED_AT + 1` starts (after the checkpoint of step `SAVED_AT`)."""

    def __init__(self, switch: Callable[[torch.optim.Optimizer], Any] | None = None) -> None:
        self.switch = switch
        self.losses: list[float] = []
        self.first: tuple | None = None

    @staticmethod
    def described(trainer: pl.Trainer) -> tuple:
        megatron = trainer.optimizers[0].megatron_optimizer
        steps = {(float(state["step"]), state["step"].dtype, state["step"].device.type)
                 for inner in adams(megatron) for state in inner.state.values()}
        return fused_adam.implementations(megatron), steps

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.first is None:
            self.first = self.described(trainer)
        if self.switch is not None and trainer.global_step == SAVED_AT:
            for inner in adams(trainer.optimizers[0].megatron_optimizer):
                self.switch(inner)
            self.switch = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from megatron.core.utils import unwrap_model

        self.last = self.described(trainer)
        self.weights = {f"{index}.{name}": param.detach().clone() for index, chunk in enumerate(pl_module.model)
                        for name, param in unwrap_model(chunk).named_parameters()}


def fit(root: Path, checkpoint: Path | str, adam: str, record: AdamRecord, *, accelerator: str = "cpu",
        callbacks: tuple = (), ckpt_path: str | None = None) -> AdamRecord:
    """A bf16 distributed-optimizer fit of `STEPS` steps (from `ckpt_path`): upstream's Adam (`adam="upstream"`,
    the adjustment suspended) or the adjustment's (on the CPU: forced)."""
    fused = fused_on_cpu if accelerator == "cpu" else contextlib.nullcontext
    with fused() if adam == "fused" else ADJUSTMENT.suspended():
        strategy = MegatronStrategy(hf_checkpoint=str(checkpoint), micro_batch_size=2, global_batch_size=4,
                                    precision="bf16", use_distributed_optimizer=True)
        trainer = pl.Trainer(strategy=strategy, accelerator=accelerator, devices=1, max_steps=STEPS, logger=False,
                             enable_checkpointing=bool(callbacks), enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
                             callbacks=[record, *callbacks])
        trainer.fit(SFTModule(lr=LR, warmup_steps=1, weight_decay=0.01),
                    DataLoader(RandomTokenDataset(SAMPLES, SEQ, VOCAB), batch_size=2, drop_last=True),
                    ckpt_path=ckpt_path)
    return record


def saved_and_resumed(root: Path, checkpoint: Path | str, saved: str, resumed: str, accelerator: str = "cpu",
                      record: type[AdamRecord] = AdamRecord) -> tuple[AdamRecord, AdamRecord]:
    """The uninterrupted fit with `saved`'s Adam that saves at step `SAVED_AT` (and switches to `resumed`'s Adam
    there, where they differ; `record` records it), and the fit resumed from that checkpoint with `resumed`'s."""
    saver = pl.callbacks.ModelCheckpoint(dirpath=root / "ckpts", every_n_train_steps=SAVED_AT, save_top_k=-1)
    switch = SWITCHES[resumed] if resumed != saved else None
    uninterrupted = fit(root / "full", checkpoint, saved, record(switch), accelerator=accelerator,
                        callbacks=(saver,))
    (path,) = (root / "ckpts").glob(f"*step={SAVED_AT}.ckpt")
    return uninterrupted, fit(root / "resumed", checkpoint, resumed, AdamRecord(), accelerator=accelerator,
                              ckpt_path=str(path))


@pytest.mark.parametrize(("saved", "resumed"), [("upstream", "fused"), ("fused", "upstream"), ("fused", "fused")])
def test_a_resume_steps_on_as_the_uninterrupted_run_bit_for_bit(process_group, checkpoint, tmp_path, saved, resumed):
    """A checkpoint saved by either Adam loads into either: the resumed fit starts with the live process's Adam and
    the saved step count (as float32 CPU tensors here), and its steps equal those of the uninterrupted fit that
    switched to that Adam at the same step, bit for bit (same implementation, same state, same gradients).
    Upstream into upstream: tests/test_strategy.py."""
    uninterrupted, resumed_fit = saved_and_resumed(tmp_path, checkpoint, saved, resumed)
    assert uninterrupted.first == (IMPLEMENTATION_ON_CPU[saved], set())
    assert resumed_fit.first == (IMPLEMENTATION_ON_CPU[resumed], {(float(SAVED_AT), torch.float32, "cpu")})
    assert resumed_fit.last == uninterrupted.last == (IMPLEMENTATION_ON_CPU[resumed],
                                                      {(float(STEPS), torch.float32, "cpu")})
    assert resumed_fit.losses == uninterrupted.losses[SAVED_AT:]
    assert [name for name, weight in uninterrupted.weights.items()
            if not torch.equal(weight, resumed_fit.weights[name])] == []
