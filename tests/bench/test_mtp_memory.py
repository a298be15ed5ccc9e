"""`bench/mtp_memory.py`'s allocator-trace breakdown of the training peak, on a hand-made trace (the tiny run on the
CPU and the breakdown of a real one on the GPU are in test_bench.py)."""


def test_the_memory_breakdown_groups_what_is_live_at_the_training_peak():
    from bench.mtp_memory import MARKER_BYTES, peak_breakdown

    def frames(path: str, line: int, name: str) -> list[dict]:
        return [{"filename": "/usr/lib/python3/torch/nn/functional.py", "line": 1, "name": "linear"},
                {"filename": f"/site-packages/{path}", "line": line, "name": name}]

    logits = frames("megatron/core/tensor_parallel/layers.py", 420, "forward")
    softmax = frames("megatron/core/tensor_parallel/cross_entropy.py", 27, "calculate_logits_max")
    gib = 1024**3
    trace = [
        {"action": "alloc", "addr": 1, "size": 8 * gib, "frames": frames("bench/x.py", 1, "setup")},  # set-up peak
        {"action": "free_completed", "addr": 1, "size": 8 * gib},
        {"action": "alloc", "addr": 2, "size": MARKER_BYTES, "frames": []},
        {"action": "free_completed", "addr": 2, "size": MARKER_BYTES},
        {"action": "alloc", "addr": 3, "size": 1 * gib, "frames": logits},
        {"action": "alloc", "addr": 4, "size": 2 * gib, "frames": softmax},
        {"action": "alloc", "addr": 5, "size": 2 * gib, "frames": softmax},
        {"action": "free_requested", "addr": 5, "size": 2 * gib},  # still counted until free_completed
        {"action": "free_completed", "addr": 5, "size": 2 * gib},
        {"action": "free_completed", "addr": 4, "size": 2 * gib},
        {"action": "alloc", "addr": 6, "size": gib // 2, "frames": []},
    ]
    breakdown = peak_breakdown(trace, baseline_bytes=gib)
    assert breakdown["peak_gib"] == 5.0  # traced after the marker (not the 8 GiB set-up), the baseline apart
    assert breakdown["allocated_before_recording_gib"] == 1.0
    assert breakdown["rows"] == [
        {"allocated_at": "megatron/core/tensor_parallel/cross_entropy.py:27 calculate_logits_max", "gib": 4.0,
         "blocks": 2},
        {"allocated_at": "megatron/core/tensor_parallel/layers.py:420 forward", "gib": 1.0, "blocks": 1},
    ]
    assert "error" in peak_breakdown(trace[:2])  # no marker: training never started in the trace
