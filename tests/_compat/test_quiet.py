"""`_compat/quiet.py`: commands start without the import-time warnings about what `_compat` handles (no CUDA runtime,
no Transformer Engine or Apex), the warnings show without it, and every other warning still shows. Each case runs in
a fresh interpreter, since the messages come once, at import."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
NO_CUDA_RUNTIME = "No CUDA runtime is found"
NO_TE_OR_APEX = "Transformer Engine and Apex are not installed"
NEITHER_TE_NOR_APEX = all(importlib.util.find_spec(name) is None for name in ("transformer_engine", "apex"))

# imports megatron-core's optimizer (both messages), then emits other warnings that must still show; reverting the
# adjustments lets the megatron-core message through again
SNIPPET = """
import logging, sys, warnings
from lightning_megatron import _compat
from lightning_megatron._compat import quiet
if sys.argv[1] == "quiet":
    print("active:", _compat.quiet_handled_warnings(), flush=True)
import megatron.core.optimizer
warnings.warn("a different UserWarning")
logging.getLogger("torch.utils.cpp_extension").warning("a different cpp_extension record")
for adjustment in quiet.ADJUSTMENTS:
    adjustment.revert()
warnings.warn_explicit("Transformer Engine and Apex are not installed (after revert)", UserWarning, "x.py", 1,
                       module="megatron.core.optimizer")
"""


def _run(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("PYTHONWARNINGS", None)
    completed = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout + completed.stderr


def test_help_starts_quietly() -> None:
    output = _run("-m", "lightning_megatron.cli", "--help")
    assert "usage:" in output
    assert NO_CUDA_RUNTIME not in output
    assert NO_TE_OR_APEX not in output


@pytest.mark.skipif(torch.cuda.is_available() or not NEITHER_TE_NOR_APEX,
                    reason="the messages come only without a CUDA runtime and without TE and Apex")
def test_the_messages_show_without_the_adjustments() -> None:
    output = _run("-c", SNIPPET, "loud")
    assert NO_CUDA_RUNTIME in output
    assert output.count(NO_TE_OR_APEX) >= 4  # optimizer, optimizer.optimizer, clip_grads, megatron_fsdp; + revert


@pytest.mark.skipif(torch.cuda.is_available() or not NEITHER_TE_NOR_APEX,
                    reason="the adjustments apply only without a CUDA runtime and without TE and Apex")
def test_only_those_messages_are_dropped_and_reverting_brings_them_back() -> None:
    output = _run("-c", SNIPPET, "quiet")
    assert "active: ['torch.quiet_no_cuda_runtime', 'megatron_core.quiet_no_te_or_apex']" in output
    assert NO_CUDA_RUNTIME not in output
    assert "a different UserWarning" in output
    assert "a different cpp_extension record" in output
    assert f"{NO_TE_OR_APEX} (after revert)" in output
    assert output.count(NO_TE_OR_APEX) == 1
