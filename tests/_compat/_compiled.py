"""What the tests of the adjustments that compute with compiled kernels (`fast_rms_norm`, `fast_rope`,
`fast_cross_entropy`, `fast_swiglu`) share: the adjustment applied on the CPU as a GPU machine applies it, compiled
kernels of their own on the CPU, and tiny bf16 fits on one GPU (joint SFT + MTP through the whole-iteration CUDA
graph, or eager) whose every step's losses and grad norms are compared with a run on upstream's kernels."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_megatron._compat import Adjustment, compiled


@contextlib.contextmanager
def applied(adjustment: Adjustment) -> Iterator[None]:
    """`adjustment` applied here as a GPU machine applies it (its condition set aside on the CPU), undone after."""
    if adjustment.active:
        yield
        return
    with mock.patch.object(adjustment, "needed", lambda: True):
        adjustment.apply()
    try:
        yield
    finally:
        adjustment.revert()


def on_the_cpu(what: str) -> type[compiled.CompiledKernel]:
    """A `CompiledKernel` class for compiling on the CPU, with a state of its own: a failure there refuses nothing
    on the GPU."""
    state = compiled.State(f"{what} on the CPU: torch.compile failed (%s)", logging.getLogger(__name__), active=True)
    return type("CpuKernel", (compiled.CompiledKernel,), {"state": state})


def kernels_run(action: Callable[[], Any]) -> int:
    """How many CUDA kernels `action` runs (under torch.profiler, between two synchronisations)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        action()
        torch.cuda.synchronize()
    return sum(event.device_type == DeviceType.CUDA and not event.is_user_annotation for event in prof.events())


STEPS, SEQ, VOCAB = 4, 64, 384
# bf16's unit roundoff is u = 2^-8 ~ 3.9e-3: the two runs round their replaced kernels' outputs and gradients
# independently (other kernels, other summation orders), a few u apart per value over the tiny model's two layers;
# 2e-2 (about 5u) bounds losses and grad norms relatively (tests/cuda_graphs/test_auto_graph.py's BF16_RTOL). A lost
# scale, sign or gradient term moves the loss or the grad norm by far more.
BF16_RTOL = 2e-2
GRAPHED = {"warmups": 1, "captures": 1, "replays": STEPS - 2, "eager": 0}
"""The whole-iteration graph's counts over `STEPS` steps: the eager warm-up (which compiles), capture, replays."""


class _Metrics(pl.Callback):
    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.metrics.append({key: float(value) for key, value in trainer.callback_metrics.items()})

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from megatron.core.transformer.mlp import MLP

        self.norms = sorted({type(module).__name__ for module in pl_module.modules()
                             if isinstance(module, torch.nn.RMSNorm)})
        self.mlp_fusion = sorted({bool(module.config.bias_activation_fusion) for module in pl_module.modules()
                                  if isinstance(module, MLP)})


def joint_fit(root: Path, checkpoint: str, cuda_graph: str = "full_iteration") -> dict[str, Any]:
    """Joint SFT + MTP, bf16, through the whole-iteration CUDA graph (`cuda_graph`; "none": eager): its eager
    warm-up step compiles the kernels, its capture records them. Every step's metrics, the model's norm classes,
    whether its MLPs fuse their activation, the graph's counts (None: eager)."""
    from lightning_megatron.module import SFTModule
    from lightning_megatron.strategy import MegatronStrategy
    from lightning_megatron.testing.datasets import RandomTokenDataset

    metrics = _Metrics()
    strategy = MegatronStrategy(hf_checkpoint=checkpoint, bridge_type="megatron-bridge", micro_batch_size=2,
                                global_batch_size=4, precision="bf16", cuda_graph=cuda_graph)
    trainer = pl.Trainer(strategy=strategy, accelerator="gpu", devices=1, max_steps=STEPS, log_every_n_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root, callbacks=[metrics])
    trainer.fit(SFTModule(enable_mtp=True, lr=1e-4), DataLoader(RandomTokenDataset(4 * STEPS, SEQ, VOCAB),
                                                                batch_size=2))
    graph = strategy.cuda_graphs.graph
    return {"metrics": metrics.metrics, "norms": metrics.norms, "mlp_fusion": metrics.mlp_fusion,
            "graph": None if graph is None else graph.counts()}


def fits_with_and_without(adjustment_module: str, root: str, checkpoint: str, out: str, *,
                          cuda_graph: str = "full_iteration") -> None:
    """In a fresh process (NCCL, as a real single-GPU run): `joint_fit` with the adjustment of
    `lightning_megatron._compat.<adjustment_module>` applied, then suspended; saved to `out` with whether it was
    active, its refusal and how many signatures each of its compiled kernels ran."""
    from lightning_megatron.distributed import free_port, init_single_process

    module = importlib.import_module(f"lightning_megatron._compat.{adjustment_module}")
    adjustment = module.ADJUSTMENTS[0]
    os.environ["MASTER_PORT"] = str(free_port())
    init_single_process()
    results: dict[str, Any] = {"active": adjustment.active}
    for kind in ("compiled", "upstream"):
        with contextlib.nullcontext() if kind == "compiled" else adjustment.suspended():
            results[kind] = joint_fit(Path(root) / kind, checkpoint, cuda_graph)
    results["refused"] = module.STATE.refused
    results["compiled_signatures"] = [len(kernel.ran) for kernel in vars(module.COMPILED).values()]
    torch.save(results, out)


def assert_trains_alike(got: list[dict[str, float]], expected: list[dict[str, float]], run: str) -> None:
    """Every step logged the same metrics, its losses and grad norms within bf16's rounding (`BF16_RTOL`)."""
    assert len(got) == len(expected) > 0, run
    for step, (metrics, reference) in enumerate(zip(got, expected, strict=True)):
        assert metrics.keys() == reference.keys(), run
        for key in ("lm_loss", "mtp_loss", "grad_norm", "grad_norm_mtp"):
            if key in reference:
                assert metrics[key] == pytest.approx(reference[key], rel=BF16_RTOL), (run, step, key)
