"""The MTP checkpoints the MTP training tests share (tests/mtp/test_mtp.py, test_skip_main_head.py), written once for
the folder; a module with a `checkpoints` fixture of its own uses that one."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_megatron.testing.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="package")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp_checkpoints")
    return {"qwen3_mtp": make_tiny_checkpoint(root / "qwen3_mtp", "qwen3", mtp=True),
            "qwen3_mtp_tied": make_tiny_checkpoint(root / "qwen3_mtp_tied", "qwen3", mtp=True, tied=True),
            "mimo": make_tiny_checkpoint(root / "mimo", "mimo", mtp=True),
            "qwen3": make_tiny_checkpoint(root / "qwen3", "qwen3")}
