"""`_compat/compiled.py`, for each adjustment built on it (`fast_rms_norm`, `fast_rope`, `fast_cross_entropy`,
`fast_swiglu`): its environment switch refuses anything but 0 or 1 before a model is built, and a function that does
not compile is refused once, logged, runs eagerly, and sends that adjustment alone back to upstream's kernels."""

from __future__ import annotations

import logging
from types import ModuleType

import pytest
import torch

from lightning_megatron._compat import fast_cross_entropy, fast_rms_norm, fast_rope, fast_swiglu

ADJUSTED = [fast_rms_norm, fast_rope, fast_cross_entropy, fast_swiglu]
REFUSALS = {
    fast_rms_norm: "RMSNorm: torch.compile failed ({}); the norms run torch's kernels from now on",
    fast_rope: "RoPE: torch.compile failed ({}); RoPE runs Megatron-Core's unfused code from now on",
    fast_cross_entropy: "cross-entropy: torch.compile failed ({}); the loss runs Megatron-Core's fused cross-entropy "
                        "from now on",
    fast_swiglu: "SwiGLU: torch.compile failed ({}); the MLPs run Megatron-Core's unfused SwiGLU from now on",
}


@pytest.mark.parametrize("module", ADJUSTED, ids=lambda module: module.__name__.rsplit(".", 1)[-1])
@pytest.mark.parametrize("value", ["true", "yes", "2", " on"])
def test_an_opt_in_other_than_0_or_1_is_refused_naming_the_variable(monkeypatch, module: ModuleType, value) -> None:
    """Any value but "0" used to apply the compiled kernels without a word; now it fails before a model is built."""
    from lightning_megatron._compat import prepare_megatron_core

    monkeypatch.setenv(module.OPT_IN, value)
    with pytest.raises(ValueError, match=f"{module.OPT_IN}={value.strip()!r} is not 0 or 1: set it to 0 .* or 1 .*, or "
                                         "leave it unset"):
        prepare_megatron_core()
    for accepted, applies in (("1", True), (" 0", False), ("", True)):
        monkeypatch.setenv(module.OPT_IN, accepted)
        assert module.opted_in() is applies


@pytest.mark.parametrize("module", ADJUSTED, ids=lambda module: module.__name__.rsplit(".", 1)[-1])
def test_a_kernel_that_does_not_compile_is_refused_once_and_runs_eagerly(monkeypatch, caplog,
                                                                        module: ModuleType) -> None:
    """A real compile failure (a graph break, which `fullgraph=True` refuses): logged once, computed eagerly, and
    from then on the adjustment's calls are upstream's (`STATE.compiles`); the other adjustment still compiles."""
    for adjusted in ADJUSTED:
        monkeypatch.setattr(adjusted.STATE, "refused", None)
        monkeypatch.setattr(adjusted.STATE, "active", True)

    def breaks_the_graph(x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()  # eagerly nothing
        return x * 2

    kernel = module.CompiledKernel(breaks_the_graph)
    x = torch.arange(4.0).reshape(2, 2)
    with caplog.at_level(logging.WARNING, logger=module.__name__):
        assert torch.equal(kernel(x), x * 2) and torch.equal(kernel(x), x * 2)
    assert module.STATE.refused is not None and not module.STATE.compiles and kernel.ran == set()
    assert [(record.name, record.getMessage()) for record in caplog.records] == [
        (module.__name__, REFUSALS[module].format(module.STATE.refused))]
    assert [adjusted.STATE.compiles for adjusted in ADJUSTED] == [adjusted is not module for adjusted in ADJUSTED]
