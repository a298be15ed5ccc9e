"""The ranks `tests._distributed.run_distributed` starts: forked from a server that imported the libraries once, yet
what a spawned rank would be, where the tests can see it (their environment, even while their module is imported,
their output, their failures)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from tests._distributed import run_distributed, start_method, variables_changed_since_the_server_started

# what this module saw when a rank imported it (the test process imported it at collection, without the variable)
SEEN_AT_IMPORT = os.environ.get("TOKENIZERS_PARALLELISM")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA every rank is spawned")]


def _what_the_rank_sees(rank: int, world_size: int) -> dict[str, object]:
    print(f"stdout of rank {rank}", flush=True)
    print(f"stderr of rank {rank}", file=sys.stderr, flush=True)
    return {"at_import": SEEN_AT_IMPORT, "now": os.environ.get("TOKENIZERS_PARALLELISM"),
            "rank": os.environ["RANK"], "preloaded": "megatron.core" in sys.modules, "adjusted": _adjustments_applied()}


def _adjustments_applied() -> list[str]:
    """The `_compat` adjustments active in this process (the server imports `_compat`'s quiet modelopt import, and
    applies none)."""
    adjustment = sys.modules.get("lightning_megatron._compat._adjustment")
    return [applied.name for applied in adjustment._APPLIED] if adjustment else []


def _folder(path: Path) -> Path:
    path.mkdir()
    return path


def _fail_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 failed on purpose")


def test_forked_ranks_have_the_callers_environment_from_their_first_import_and_its_output(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> None:
    run_distributed(_what_the_rank_sees, _folder(tmp_path / "first"))  # the server runs, whichever test started it
    capfd.readouterr()
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "set by the caller")  # a variable read at run time: still forked
    assert start_method() == "forkserver", (
        f"{variables_changed_since_the_server_started()} changed since the server started: every later rank is "
        "spawned. A test that sets a variable restores it (monkeypatch.setenv); one that the libraries read only at "
        "run time goes in tests/_distributed.py's READ_AT_RUN_TIME")
    results = run_distributed(_what_the_rank_sees, _folder(tmp_path / "second"))
    assert results == [{"at_import": "set by the caller", "now": "set by the caller", "rank": str(rank),
                        "preloaded": True, "adjusted": []} for rank in range(2)]
    out, err = capfd.readouterr()
    assert "stdout of rank 0" in out and "stdout of rank 1" in out
    assert "stderr of rank 0" in err and "stderr of rank 1" in err


def test_a_variable_the_libraries_may_read_at_import_spawns_the_ranks(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    run_distributed(_what_the_rank_sees, _folder(tmp_path / "first"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0" if os.environ.get("HF_HUB_OFFLINE") == "1" else "1")
    assert start_method() == "spawn" and variables_changed_since_the_server_started() == ["HF_HUB_OFFLINE"]
    results = run_distributed(_what_the_rank_sees, _folder(tmp_path / "second"))
    assert [result["preloaded"] for result in results] == [False, False]


def test_a_failing_rank_fails_the_call_with_its_error(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="rank 1 failed on purpose"):
        run_distributed(_fail_on_rank_1, tmp_path)
