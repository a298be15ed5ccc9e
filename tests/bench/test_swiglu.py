"""`bench/swiglu.py`'s figures, in-process: on the CPU a tiny width, upstream's unfused ops and the eager math
against the float32 reference, the compiled arms skipped with the reason; on a GPU every arm at Qwen3-0.6B's width,
within bf16's rounding; and the script's own tiny run writes the JSON it promises."""

import pytest
import torch

from bench.swiglu import SHAPES, measure_swiglu, per_microbatch
from tests.bench.test_bench import _run_bench


def test_the_tiny_swiglu_is_measured_against_the_float32_reference(process_group):
    measured = measure_swiglu(32, 1, 16, torch.float32, torch.device("cpu"), warmup=1, repeats=2)
    arms = measured["arms"]
    assert measured["shape"] == [32, 1, 32] and measured["width"] == 16
    assert arms["compiled"]["skipped"].startswith("needs CUDA") and arms["megatron_fused"]["skipped"]
    assert arms["upstream"]["max_abs_diff"] == {"output": 0.0, "input_grad": 0.0}  # it is the reference
    eager = arms["eager"]
    assert eager["forward_backward_wall_us"] > 0 and eager["forward_backward_gpu_us"] is None
    assert eager["max_abs_diff"]["output"] == 0.0  # float32: the same two roundings as upstream's ops
    # the gradient's other association and SiLU code: a few float32 roundings of the largest value
    assert eager["max_abs_diff"]["input_grad"] <= 2**-20 * eager["reference_max_abs"]["input_grad"]
    assert per_microbatch(measured, 3) == {"calls": 3, "gpu_ms": {}}


@pytest.mark.gpu
def test_every_arm_runs_on_the_gpu_within_bf16_rounding(process_group):
    """Qwen3-0.6B's width over 256 tokens: each arm's GPU times, its differences to the float32 reference a few bf16
    steps (2^-8) of the largest value at most, fewer kernels compiled than upstream, and a microbatch's
    compiled-over-upstream ratio."""
    measured = measure_swiglu(256, 1, SHAPES["qwen3_0.6b"]["intermediate_size"], torch.bfloat16,
                              torch.device("cuda"), warmup=2, repeats=3)
    for name, arm in measured["arms"].items():
        assert arm["forward_backward_gpu_us"] > 0 and arm["forward_gpu_us"] > 0 and arm["kernels"], name
        for key, difference in arm["max_abs_diff"].items():
            assert difference <= 4 * 2**-8 * arm["reference_max_abs"][key], (name, key)
    kernels = {name: sum(arm["kernels"].values()) for name, arm in measured["arms"].items()}
    assert kernels["compiled"] < kernels["upstream"], kernels
    assert per_microbatch(measured, 29)["compiled_over_upstream"] > 0


def test_the_script_runs_tiny(tmp_path):
    result = _run_bench(tmp_path, "bench.swiglu", "--tiny")
    assert result["benchmark"] == "swiglu" and result["shapes"]["tiny"]["mlps"] == 2
