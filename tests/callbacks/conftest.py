"""The MTP checkpoint and the engine the delta-sync tests share (tests/callbacks/test_delta_sync.py,
test_delta_sync_recovery.py), made once for the folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_megatron.serving.receiver import spawn_receiver
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="package")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("delta_sync") / "qwen3_mtp", "qwen3", mtp=True)


@pytest.fixture(scope="package")
def engine(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    """One engine for the fits of the folder: each fit's first sync is full, so what an earlier test left does not
    matter."""
    process, url = spawn_receiver(checkpoint, log=tmp_path_factory.mktemp("engine") / "receiver.log", timeout_s=30)
    yield url
    process.kill()
    process.wait()
