"""`_compat/quiet.py`: commands start without the import-time warnings about what `_compat` handles (no CUDA runtime,
no Transformer Engine or Apex), the warnings show without it, and every other warning still shows; each of those
cases runs in a fresh interpreter, since the messages come once, at import. A fit that saves checkpoints logs no
deprecation notice from Megatron-Core's checkpointing, which its own synchronous save logs without the adjustment
(once per process: the tests reset its flag)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_megatron import checkpoint as megatron_checkpoint
from lightning_megatron._compat import quiet
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint

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
    assert "active: ['torch.quiet_no_cuda_runtime', 'megatron_core.quiet_no_te_or_apex', " in output
    assert NO_CUDA_RUNTIME not in output
    assert "a different UserWarning" in output
    assert "a different cpp_extension record" in output
    assert f"{NO_TE_OR_APEX} (after revert)" in output
    assert output.count(NO_TE_OR_APEX) == 1


def _checkpointing_deprecations(records: list[logging.LogRecord], caught: list[warnings.WarningMessage]) -> list[str]:
    """The deprecation notices Megatron-Core's checkpointing logged or warned."""
    logged = [record.getMessage() for record in records if record.name.startswith("megatron.core.dist_checkpointing")]
    warned = [str(warning.message) for warning in caught if "dist_checkpointing" in warning.filename]
    return [message for message in logged + warned if "deprecat" in message.lower()]


@pytest.fixture
def fresh_save_notice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron-Core logs its async-save notice at the first save of a process only: as if none had saved yet."""
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    monkeypatch.setattr(torch_strategy, "_logged_mcore_async_deprecation", False)


def test_megatron_cores_own_synchronous_save_logs_the_notice_without_the_adjustment(process_group, fresh_save_notice,
                                                                                    tmp_path, caplog) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    sharded = {"weight": ShardedTensor.from_rank_offsets("weight", torch.ones(4))}
    with quiet.SAVE_ADJUSTMENTS[0].suspended(), caplog.at_level(logging.WARNING):
        dist_checkpointing.save(sharded, str(tmp_path))  # synchronous, no async option passed
    notices = _checkpointing_deprecations(caplog.records, [])
    assert len(notices) == 1 and notices[0].startswith(quiet.MCORE_ASYNC_SAVE_DEPRECATED)


def test_a_fit_saving_checkpoints_without_async_save_logs_no_checkpointing_deprecation(process_group,
                                                                                     fresh_save_notice, tmp_path,
                                                                                     caplog) -> None:
    from tests.test_strategy import _fit

    hf_checkpoint = make_tiny_checkpoint(tmp_path / "qwen3", "qwen3")
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=1, save_top_k=-1)
    with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(tmp_path / "fit", hf_checkpoint, 2, callbacks=(saver,), trainer_kwargs=dict(enable_checkpointing=True))
    assert megatron_checkpoint.is_complete(tmp_path / "ckpts" / "epoch=0-step=2.ckpt")
    assert _checkpointing_deprecations(caplog.records, caught) == []


# modelopt warns at import when the installed transformers is outside the range it tested (the GPU machine's 5.17);
# the snippet makes modelopt compare the lock's transformers version as 5.17.0 (its message still names the
# installed version) before anything imports modelopt
MODELOPT_SNIPPET = """
import importlib.metadata, sys, warnings
import packaging.version

installed = importlib.metadata.version("transformers")

class Version(packaging.version.Version):
    def __init__(self, version):
        super().__init__("5.17.0" if version == installed else version)

packaging.version.Version = Version
warnings.simplefilter("always")
from lightning_megatron._compat import quiet
if sys.argv[1] == "quiet":
    print("active:", [a.name for a in quiet.BRIDGE_IMPORT_ADJUSTMENTS if a.apply()], flush=True)
import modelopt.torch.quantization
warnings.warn_explicit(f"transformers {installed} is not tested with current version of modelopt (after)",
                       UserWarning, "x.py", 1, module="modelopt.torch")
"""


@pytest.mark.skipif(importlib.util.find_spec("modelopt") is None, reason="modelopt is not installed")
def test_modelopt_imports_without_its_notices_and_only_during_that_import() -> None:
    installed = importlib.metadata.version("transformers")
    untested = f"transformers {installed} is not tested with current version of modelopt"
    loud, quiet_output = _run("-c", MODELOPT_SNIPPET, "loud"), _run("-c", MODELOPT_SNIPPET, "quiet")
    assert f"{untested} and may cause issues" in loud
    assert "`torch.jit.script` is deprecated" in loud
    assert "active: ['modelopt.quiet_import_notices']" in quiet_output
    assert f"{untested} and may cause issues" not in quiet_output
    assert "`torch.jit.script` is deprecated" not in quiet_output
    assert f"{untested} (after)" in quiet_output  # the filter lived for the import only
