"""The one stage-then-rename (`lightning_megatron.atomic`): a failed write leaves neither a file nor a temporary,
an earlier file is replaced only on success, and a killed run's staging names are the ones the weight-sync
folder's leftover cleanup (`serving.disk.remove_partials`) removes."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from lightning_megatron.atomic import (
    SPARE_FILE_PREFIX,
    remove_folder_soon,
    wait_for_removals,
    write_atomically,
    write_file_atomically,
    write_text_atomically,
)
from lightning_megatron.serving.disk import remove_partials


class Interrupted(Exception):
    pass


def _fail_after_writing(temporary: Path) -> None:
    temporary.write_text("half")
    raise Interrupted


def test_a_failed_write_leaves_no_file_and_no_temporary(tmp_path: Path) -> None:
    with pytest.raises(Interrupted):
        write_file_atomically(tmp_path / "out" / "report.json", _fail_after_writing)
    assert list((tmp_path / "out").iterdir()) == []


def test_an_earlier_file_is_replaced_only_on_success(tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    write_text_atomically(path, "first\n")
    with pytest.raises(Interrupted):
        write_file_atomically(path, _fail_after_writing)
    assert path.read_text() == "first\n" and list(tmp_path.iterdir()) == [path]
    write_text_atomically(path, "second\n", mode=0o644, fsync=True)
    assert path.read_text() == "second\n" and list(tmp_path.iterdir()) == [path]
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_staging_names_are_hidden_and_the_cleanup_removes_them(tmp_path: Path) -> None:
    """A run killed mid-write leaves its staging folder or file; `remove_partials` must know their names."""
    staged: list[Path] = []

    def leave_behind(staging: Path) -> None:
        staged.append(staging)
        raise Interrupted

    with pytest.raises(Interrupted):
        write_atomically(tmp_path / "v00000010", leave_behind)
    with pytest.raises(Interrupted):
        write_file_atomically(tmp_path / "latest", leave_behind)
    assert all(path.name.startswith(".") for path in staged)
    staged[0].mkdir()  # what a killed run would have left (a failing one cleans up after itself)
    staged[1].write_text("v00000010\n")
    (tmp_path / f"{SPARE_FILE_PREFIX}adapter_model.safetensors-123-0").write_bytes(b"\0" * 64)  # a spare
    (tmp_path / "v00000005").mkdir()
    remove_partials(tmp_path)
    assert [path.name for path in tmp_path.iterdir()] == ["v00000005"]


def test_a_folder_removed_soon_is_gone_from_its_name_at_once_and_its_hidden_name_is_a_leftover_cleanups_know(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pruned version leaves its name before its bytes are freed; a process that died meanwhile leaves a hidden
    folder `remove_partials` removes."""
    import threading

    from lightning_megatron import atomic

    for version in (1, 2):
        (tmp_path / f"v0000000{version}").mkdir()
        (tmp_path / f"v0000000{version}" / "model.safetensors").write_bytes(b"x" * 4096)
    started, release = threading.Event(), threading.Event()
    real_remove = atomic.remove_folder

    def held(folder: Path, **options: bool) -> None:  # the deleting thread waits until the test has looked
        started.set()
        release.wait()
        real_remove(folder, **options)

    monkeypatch.setattr(atomic, "remove_folder", held)
    remove_folder_soon(tmp_path / "v00000001")
    started.wait()
    names = sorted(path.name for path in tmp_path.iterdir())
    assert names[1:] == ["v00000002"] and names[0].startswith(".v00000001.old-")  # out of sight, not yet freed
    remove_partials(tmp_path)  # what a later run finds had this one died now
    release.set()
    wait_for_removals()
    assert [path.name for path in tmp_path.iterdir()] == ["v00000002"]
    remove_folder_soon(tmp_path / "v00000002")
    wait_for_removals()
    assert list(tmp_path.iterdir()) == []
