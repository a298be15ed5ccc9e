"""`bench/cross_entropy.py`'s figures, in-process: on the CPU a tiny vocabulary's logits, upstream's fused
cross-entropy and the eager math against the float32 reference, the compiled arm skipped with the reason; on a GPU
every arm at Qwen3-0.6B's vocabulary, within bf16's rounding; and the script's own tiny run writes the JSON it
promises."""

import pytest
import torch

from bench.cross_entropy import SHAPES, TINY_VOCAB, measure_cross_entropy, per_microbatch
from tests.bench.test_bench import _run_bench


def test_the_tiny_cross_entropy_is_measured_against_the_float32_reference(model_parallel):
    measured = measure_cross_entropy(32, 1, TINY_VOCAB, torch.float32, torch.device("cpu"), warmup=1, repeats=2)
    arms = measured["arms"]
    assert measured["shape"] == [32, 1, TINY_VOCAB] and arms["compiled"]["skipped"].startswith("needs CUDA")
    for name in ("upstream", "eager"):
        assert arms[name]["forward_backward_wall_us"] > 0 and arms[name]["forward_backward_gpu_us"] is None
    # float32: the eager math is Megatron-Core's unfused cross-entropy (the reference) bit for bit; the fused one
    # rounds its gradient to bf16 (2^-8 of the value at most) and sums in its own order
    assert arms["eager"]["max_abs_diff"] == {"loss": 0.0, "grad": 0.0}
    assert arms["upstream"]["max_abs_diff"]["grad"] <= 2**-8 * arms["upstream"]["reference_max_abs"]["grad"]
    assert arms["upstream"]["max_abs_diff"]["loss"] <= 1e-5 * arms["upstream"]["reference_max_abs"]["loss"]
    assert per_microbatch(measured) == {"calls": 2, "gpu_ms": {}}


@pytest.mark.gpu
def test_every_arm_runs_on_the_gpu_within_bf16_rounding(model_parallel):
    """Qwen3-0.6B's vocabulary over 256 tokens: each arm's GPU times, its gradient's differences to the float32
    reference two bf16 steps (2^-8) of the largest value at most, and the compiled-over-upstream ratio."""
    measured = measure_cross_entropy(256, 1, SHAPES["qwen3_0.6b"]["vocab_size"], torch.bfloat16,
                                     torch.device("cuda"), warmup=2, repeats=3)
    for name, arm in measured["arms"].items():
        assert arm["forward_backward_gpu_us"] > 0 and arm["forward_gpu_us"] > 0 and arm["kernels"], name
        assert arm["max_abs_diff"]["grad"] <= 2 * 2**-8 * arm["reference_max_abs"]["grad"], name
        assert arm["max_abs_diff"]["loss"] <= 1e-3 * arm["reference_max_abs"]["loss"], name
    assert per_microbatch(measured)["compiled_over_upstream"] > 0


def test_the_script_runs_tiny(tmp_path):
    result = _run_bench(tmp_path, "bench.cross_entropy", "--tiny")
    assert result["benchmark"] == "cross_entropy" and result["shapes"]["tiny"]["vocab_size"] == TINY_VOCAB
