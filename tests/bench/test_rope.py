"""`bench/rope.py`'s figures, in-process: on the CPU the tiny shape's query and key heads laid out as Megatron-Core
hands them over, upstream's RoPE and the eager math against the float32 reference, the compiled arm skipped with the
reason; on a GPU every arm at Qwen3-0.6B's shapes, within bf16's rounding; and the script's own tiny run writes the
JSON it promises (as test_bench.py checks the other scripts', which is at its 500 lines)."""

import pytest
import torch

from bench.norms import TINY_SHAPE, layer_inputs
from bench.rope import SHAPES, measure_rope, per_microbatch
from tests.bench.test_bench import _run_bench


def test_the_tiny_rope_is_measured_against_the_float32_reference():
    inputs = layer_inputs(TINY_SHAPE, 32, 1, torch.float32, torch.device("cpu"))
    heads = {name: measure_rope(inputs[name], warmup=1, repeats=2) for name in ("query", "key")}
    assert heads["query"]["shape"] == [32, 1, 4, 16] and heads["query"]["contiguous"]
    assert not heads["key"]["contiguous"]  # the fused QKV output's strided slice
    for head in heads.values():
        arms = head["arms"]
        assert arms["compiled"]["skipped"].startswith("needs CUDA")
        for name in ("upstream", "eager"):
            assert arms[name]["forward_backward_wall_us"] > 0 and arms[name]["forward_backward_gpu_us"] is None
            # float32: upstream computes the reference itself, and the eager math is upstream's bit for bit
            assert arms[name]["max_abs_diff"] == {"output": 0.0, "grad": 0.0}
    assert per_microbatch(heads, layers=2) == {"calls": {"query": 2, "key": 2}, "gpu_ms": {}}


@pytest.mark.gpu
def test_every_arm_runs_on_the_gpu_within_bf16_rounding():
    """Qwen3-0.6B's query and key heads over 256 tokens: each arm's GPU times, its differences to the float32
    reference a few bf16 steps (2^-8) of the largest value at most, and a microbatch's compiled-over-upstream
    ratio."""
    inputs = layer_inputs(SHAPES["qwen3_0.6b"], 256, 1, torch.bfloat16, torch.device("cuda"))
    heads = {name: measure_rope(inputs[name], warmup=2, repeats=3) for name in ("query", "key")}
    for head in heads.values():
        for name, arm in head["arms"].items():
            assert arm["forward_backward_gpu_us"] > 0 and arm["forward_gpu_us"] > 0 and arm["kernels"], name
            for key, difference in arm["max_abs_diff"].items():
                assert difference <= 4 * 2**-8 * arm["reference_max_abs"][key], (name, key)
    assert per_microbatch(heads, layers=28)["compiled_over_upstream"] > 0


def test_the_script_runs_tiny(tmp_path):
    result = _run_bench(tmp_path, "bench.rope", "--tiny")
    assert result["benchmark"] == "rope" and set(result["shapes"]["tiny"]["heads"]) == {"query", "key"}
