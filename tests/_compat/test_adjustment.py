"""Adjustments that patch the same attribute stack: suspending or reverting the earlier one keeps the later one's
patch (the sequence-parallel and the zero-centred torch norms both wrap `WrappedTorchNorm.__new__`)."""

from __future__ import annotations

from types import SimpleNamespace

from lightning_megatron._compat._adjustment import Adjustment, Patches


def _wrapping(name: str, target: SimpleNamespace) -> Adjustment:
    """An adjustment that wraps `target.call`, recording its name in the calls it makes."""

    def install(patches: Patches) -> None:
        previous = target.call
        patches.setattr(target, "call", lambda: [*previous(), name])

    return Adjustment(name, "a test's upstream", lambda: True, install)


def test_suspending_or_reverting_an_earlier_adjustment_keeps_the_later_ones():
    target = SimpleNamespace(call=lambda: ["upstream"])
    first, second = _wrapping("first", target), _wrapping("second", target)
    assert first.apply() and second.apply()
    assert target.call() == ["upstream", "first", "second"]
    with first.suspended():
        assert target.call() == ["upstream", "second"] and second.active and not first.active
    assert target.call() == ["upstream", "first", "second"]  # in the order they were applied
    first.revert()
    assert target.call() == ["upstream", "second"]
    second.revert()
    assert target.call() == ["upstream"] and not first.active and not second.active


def test_a_suspended_adjustment_stays_off_when_the_block_applies_adjustments():
    """A fit inside `suspended()` runs `prepare_megatron_core()` (the strategy's setup), whose `apply()` must not put
    the adjustment back before the block ends; one never applied stays off after the block too."""
    target = SimpleNamespace(call=lambda: ["upstream"])
    first, second = _wrapping("first", target), _wrapping("second", target)
    assert first.apply()
    with first.suspended():
        assert not first.apply() and not first.active and target.call() == ["upstream"]
        with second.suspended():
            assert not second.apply() and target.call() == ["upstream"]
    assert first.active and not second.active and target.call() == ["upstream", "first"]
    first.revert()
