"""`bench/moe.py` runs three models in one process (grouped experts, upstream's expert loop, the dense model): each
run releases its model, gradients and optimizer before the next is built (`bench.common.release_model`). Before, the
MoE layers' token dispatcher kept its last routing probabilities, whose autograd graph reaches DDP's hook on the
router weight, a closure over the model: the first model stayed allocated, the second run's peak memory counted it,
and on an 80 GB H100 the second run ran out of memory (`bench/results/h100_2026-12-05b/moe_oom.log`)."""

import gc
import sys
import weakref

import pytest

from bench import moe as moe_bench


@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_a_run_leaves_nothing_of_its_model_behind(model_parallel, monkeypatch, moe) -> None:
    built: list[weakref.ref] = []
    build = moe_bench._build

    def recorded_build(args, moe):
        model, optimizer = build(args, moe)
        built.append(weakref.ref(model))
        return model, optimizer

    monkeypatch.setattr(moe_bench, "_build", recorded_build)
    monkeypatch.setattr(sys, "argv", ["bench.moe", "--tiny", "--steps", "1", "--warmup", "0"])
    result = moe_bench._run(moe_bench._parse_args(), moe=moe)
    gc.collect()
    assert result["step_s"] > 0 and len(built) == 1
    assert built[0]() is None, "the run's model is still referenced after it returned"
