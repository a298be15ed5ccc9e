"""`bench/norms.py`'s figures, in-process: on the CPU the tiny shape's norms laid out as Megatron-Core hands them
over, torch's norm and the eager math against the float32 reference, the compiled arms skipped with the reason; on a
GPU every arm at Qwen3-0.6B's widths, within bf16's rounding. The script's own tiny run is in test_bench.py."""

import pytest
import torch

from bench.norms import SHAPES, TINY_SHAPE, layer_inputs, measure_norm, per_microbatch


def test_the_tiny_norms_are_measured_against_the_float32_reference():
    norms = {name: measure_norm(x, warmup=1, repeats=2)
             for name, x in layer_inputs(TINY_SHAPE, 32, 1, torch.float32, torch.device("cpu")).items()}
    assert norms["query"]["rows"] == 32 * 4 and norms["key"]["width"] == 16
    assert norms["hidden"]["contiguous"] and not norms["key"]["contiguous"]  # the fused QKV output's strided slice
    for norm in norms.values():
        arms = norm["arms"]
        assert arms["compiled"]["skipped"].startswith("needs CUDA") and arms["aten_compiled_weight_grad"]["skipped"]
        for name in ("torch", "eager"):
            assert arms[name]["forward_backward_wall_us"] > 0 and arms[name]["forward_backward_gpu_us"] is None
            # float32: torch's norm computes the reference itself; the eager math is a few float32 roundings away
            for key, difference in arms[name]["max_abs_diff"].items():
                assert difference <= (0 if name == "torch" else 1e-6) * arms[name]["reference_max_abs"][key], key
    assert per_microbatch(norms, layers=2) == {"calls": {"hidden": 5, "query": 2, "key": 2}, "gpu_ms": {}}


@pytest.mark.gpu
def test_every_arm_runs_on_the_gpu_within_bf16_rounding():
    """Qwen3-0.6B's norms over 256 tokens: each arm's GPU times, its differences to the float32 reference a few bf16
    steps (2^-8) of the largest value at most, and a microbatch's compiled-over-torch ratio."""
    norms = {name: measure_norm(x, warmup=2, repeats=3) for name, x in layer_inputs(
        SHAPES["qwen3_0.6b"], 256, 1, torch.bfloat16, torch.device("cuda")).items()}
    for norm in norms.values():
        for name, arm in norm["arms"].items():
            assert arm["forward_backward_gpu_us"] > 0 and arm["forward_gpu_us"] > 0 and arm["kernels"], name
            for key, difference in arm["max_abs_diff"].items():
                assert difference <= 4 * 2**-8 * arm["reference_max_abs"][key], (name, key)
    assert per_microbatch(norms, layers=28)["compiled_over_torch"] > 0
