"""The benchmarks' temporary folders: removed when their step fails, refused before anything is written when the
file system cannot hold what the step needs, and sized from the checkpoint's real bytes."""

import shutil
import tempfile

import pytest

from bench.common import SCRATCH_PREFIX, hf_checkpoint_bytes, scratch_dir, weights_bytes
from lightning_megatron.testing.checkpoints import make_tiny_checkpoint


def test_a_scratch_folder_is_removed_when_its_step_fails_and_refused_when_it_cannot_fit(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    with pytest.raises(RuntimeError, match="the step failed"), scratch_dir("hf_io_", 1024) as folder:
        assert folder.parent == tmp_path and folder.name.startswith(SCRATCH_PREFIX + "hf_io_")
        (folder / "nested").mkdir()
        (folder / "nested" / "model.safetensors").write_bytes(bytes(4096))
        raise RuntimeError("the step failed")
    assert list(tmp_path.iterdir()) == []

    too_much = 2 * shutil.disk_usage(tmp_path).free
    with pytest.raises(SystemExit) as refused, scratch_dir("weight_sync_", too_much):
        pytest.fail("a step that cannot fit must not start")
    message = str(refused.value)
    assert message.startswith(f"weight_sync: {tmp_path} has ")
    assert f"needs {too_much} bytes" in message and f"TMPDIR={tmp_path}" in message
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tied", [False, True])
def test_the_checkpoint_size_estimate_covers_the_written_files(tmp_path, tied):
    checkpoint = make_tiny_checkpoint(tmp_path / "tiny", "qwen3", mtp=True, tied=tied)
    shape = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=384)  # make_tiny_checkpoint's defaults, fp32
    written = weights_bytes(checkpoint)
    assert written <= hf_checkpoint_bytes(shape, tied=tied, bytes_per_weight=4) <= 1.1 * written
