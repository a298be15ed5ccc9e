"""`megatron_core.fused_adam` on a GPU, where its condition applies it (nothing forced): Megatron-Core's bf16
distributed optimizer steps with torch's fused Adam instead of its foreach one, its first step within the derived
rounding bound of foreach's, with no temporary (the foreach step holds at least one fp32 copy of the shard more:
`torch._foreach_sqrt(exp_avg_sqs)`, torch/optim/adam.py:790); a bf16 fit trains as the foreach one and allocates
less in its optimizer steps, and resumes across implementations with every step count where its Adam reads it (a
float32 CUDA tensor under fused, a CPU one under foreach)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_megatron.testing.checkpoints import make_tiny_checkpoint
from tests._compat._compiled import BF16_RTOL
from tests._compat.test_fused_adam import (
    ADJUSTMENT,
    LR,
    SAVED_AT,
    STEPS,
    AdamRecord,
    adams,
    assert_one_step_apart_by_rounding,
    build,
    first_step_apart,
    saved_and_resumed,
    set_gradients,
)
from tests._distributed import run_in_fresh_process

IMPLEMENTATION_ON_CUDA = {"fused": ["fused"], "upstream": ["foreach"]}
STEP_DEVICE = {"fused": "cuda", "upstream": "cpu"}  # torch keeps foreach's step counts on the CPU (adam.py:168-176)
PAIRS = [("upstream", "upstream"), ("fused", "fused"), ("upstream", "fused"), ("fused", "upstream")]


class StepMemory:
    """The peak CUDA memory each step of a torch optimizer allocates beyond what was allocated as it started."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.figures: dict[str, Any] = {"extra": [], "largest_group_numel": max(
            sum(param.numel() for param in group["params"]) for group in optimizer.param_groups)}
        optimizer.register_step_pre_hook(self._start)
        optimizer.register_step_post_hook(self._end)

    def _start(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.start = torch.cuda.memory_allocated()

    def _end(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        torch.cuda.synchronize()
        self.figures["extra"].append(torch.cuda.max_memory_allocated() - self.start)


def assert_fused_needs_no_temporary(fused: dict[str, Any], foreach: dict[str, Any]) -> None:
    """From the second step on (the first allocates both moments in either): foreach's step holds an fp32
    temporary per parameter of the group it steps (4 bytes each, rounded up per tensor; torch steps the groups one
    after the other, freeing each group's before the next: Megatron-Core's groups with and without weight decay),
    so its peak is at least the largest group's; fused's at least that much less."""
    numel = foreach["largest_group_numel"]
    assert fused["largest_group_numel"] == numel > 0 and len(fused["extra"]) == len(foreach["extra"]) >= 2
    for step, (fused_extra, foreach_extra) in enumerate(zip(fused["extra"], foreach["extra"])):
        if step > 0:
            assert foreach_extra >= 4 * numel, (step, foreach_extra, numel)
            assert fused_extra <= foreach_extra - 4 * numel, (step, fused_extra, foreach_extra, numel)


def _start_one_gpu() -> None:
    """NCCL, Megatron parallel state TP=PP=1, and the adjustments a run applies (`prepare_megatron_core`)."""
    from lightning_megatron.distributed import free_port, init_single_process

    os.environ["MASTER_PORT"] = str(free_port())
    init_single_process()


def _one_step_and_memory(out: str) -> None:
    """In a fresh process (one GPU, as a real run): the first step of both optimizers (`first_step_apart`), then two
    steps of each with their torch step's memory measured."""
    _start_one_gpu()
    results: dict[str, Any] = {"active": ADJUSTMENT.active, "first_step": first_step_apart("bf16", True, "cuda")}
    for name in ("fused", "upstream"):
        with ADJUSTMENT.suspended() if name == "upstream" else contextlib.nullcontext():
            ddp, megatron = build("bf16", True, "cuda")
        (inner,) = adams(megatron)
        memory = StepMemory(inner)
        for step in range(2):
            set_gradients(ddp, seed=step)
            megatron.step()
        results[name] = memory.figures
    torch.save(results, out)


@pytest.mark.gpu
def test_one_fused_step_is_foreachs_within_rounding_with_no_temporary(tmp_path):
    results = run_in_fresh_process(_one_step_and_memory, tmp_path)
    assert results["active"]  # its own condition: CUDA, no TE/Apex, switched on by default
    first = results["first_step"]
    assert first["fused"]["implementation"] == ["fused"] and first["upstream"]["implementation"] == ["foreach"]
    assert_one_step_apart_by_rounding(first, "bf16")
    assert_fused_needs_no_temporary(results["fused"], results["upstream"])


class MemoryRecord(AdamRecord):
    """`AdamRecord`, and each torch step's memory (`StepMemory`) of the fit's Adam."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        (inner,) = adams(trainer.optimizers[0].megatron_optimizer)
        self.memory = StepMemory(inner)


def _figures(record: AdamRecord) -> dict[str, Any]:
    return {"losses": record.losses, "first": record.first, "last": record.last,
            "weights": {name: weight.float().cpu() for name, weight in record.weights.items()},
            "memory": record.memory.figures if isinstance(record, MemoryRecord) else None}


def _fits(root: str, checkpoint: str, out: str) -> None:
    """In a fresh process: for each pair of Adams, the uninterrupted fit that saves at `SAVED_AT` (and switches
    there) and the fit resumed from its checkpoint (`saved_and_resumed`)."""
    _start_one_gpu()
    results = {}
    for saved, resumed in PAIRS:
        runs = saved_and_resumed(Path(root) / f"{saved}_{resumed}", checkpoint, saved, resumed, accelerator="gpu",
                                 record=MemoryRecord)
        results[saved, resumed] = [_figures(record) for record in runs]
    torch.save(results, out)


def assert_weights_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], steps: int) -> None:
    """Two bf16 fits of `steps` Adam steps from the same weights: each step moves a weight by about lr at most
    (|m| <= sqrt(v) in the first steps), so they are 2 steps lr apart, and one bf16 rounding (2^-7 relative)."""
    for name, weight in expected.items():
        torch.testing.assert_close(got[name], weight, rtol=2.0 ** -7, atol=2 * steps * LR, msg=name)


@pytest.mark.gpu
def test_a_fused_fit_trains_as_the_foreach_one_and_resumes_across_them(tmp_path):
    """bf16, distributed optimizer, Adam's weight decay on: the fused fit's first loss is the foreach fit's (the same
    weights), its losses and weights within bf16 training's tolerance of it, and its optimizer steps allocate at
    least an fp32 copy of the shard less. Every resume starts with the live process's Adam and the saved step count
    where that Adam reads it, and steps on as the uninterrupted fit that switched to it at the same step (to the
    GPU kernels' run-to-run differences)."""
    checkpoint = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3")
    results = run_in_fresh_process(_fits, tmp_path, str(tmp_path), str(checkpoint))
    fused, foreach = results["fused", "fused"][0], results["upstream", "upstream"][0]
    assert fused["first"] == (["fused"], set()) and foreach["first"] == (["foreach"], set())
    assert fused["losses"][0] == pytest.approx(foreach["losses"][0], rel=1e-6)
    assert fused["losses"] == pytest.approx(foreach["losses"], rel=BF16_RTOL)
    assert_weights_close(fused["weights"], foreach["weights"], STEPS)
    assert_fused_needs_no_temporary(fused["memory"], foreach["memory"])
    for (saved, resumed), (uninterrupted, resumed_fit) in results.items():
        case = f"{saved} -> {resumed}"
        assert resumed_fit["first"] == (IMPLEMENTATION_ON_CUDA[resumed],
                                        {(float(SAVED_AT), torch.float32, STEP_DEVICE[resumed])}), case
        assert resumed_fit["last"] == uninterrupted["last"] == (
            IMPLEMENTATION_ON_CUDA[resumed], {(float(STEPS), torch.float32, STEP_DEVICE[resumed])}), case
        assert resumed_fit["losses"] == pytest.approx(uninterrupted["losses"][SAVED_AT:], rel=1e-3), case
        assert_weights_close(resumed_fit["weights"], uninterrupted["weights"], STEPS - SAVED_AT)
