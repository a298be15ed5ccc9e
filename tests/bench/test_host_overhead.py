"""`bench/host_overhead.py`'s bookkeeping: the shared work is timed apart, per step and by kind, and left out of the
profile, whose entries name what the loop itself called."""

from __future__ import annotations

import cProfile

from torch.utils.data import DataLoader

from bench.host_overhead import SharedWork, StepWindows, profile_breakdown

STEPS = 3


def _collate(samples: list[int]) -> list[int]:
    """The DataLoader's work: shared, so never an entry."""
    return [sample * 2 for sample in sorted(samples)]


def _loop_work(batch: list[int]) -> int:
    """What a training loop does beside the shared work: an entry."""
    return sum(_square(value) for value in batch)


def _square(value: int) -> int:
    return value * value


def test_shared_work_is_timed_apart_and_left_out_of_the_profile():
    with SharedWork() as shared:
        shared.profiler = cProfile.Profile(builtins=False)
        windows = StepWindows(shared, warmup=1, total_steps=1 + STEPS)
        batches = iter(DataLoader(range(2 * (1 + STEPS)), batch_size=2, collate_fn=_collate))
        windows.start()
        for step in range(1 + STEPS):
            _loop_work(next(batches))
            windows.step_ended(step)
    steps = windows.result()
    assert len(steps) == STEPS
    assert all(0 < step["data"] == step["shared_s"] <= step["step_s"] for step in steps)
    breakdown = profile_breakdown(shared.profiler, shared.straddlers, STEPS)
    entries = breakdown["entries_ms"]
    assert any(name.endswith("(_loop_work)") for name in entries)
    assert not any("_collate" in name or "_square" in name for name in entries)  # shared; nested in _loop_work
    assert not any("dataloader.py" in name for name in entries)
    assert breakdown["profiled_ms"] > 0 and breakdown["calls"] > 0
