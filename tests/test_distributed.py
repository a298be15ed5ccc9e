"""`exit_before_finalization`: a process that ends through it exits with its status even where a gloo collective
finishes as it exits; ended by Python's finalization instead, the same process dies of SIGABRT (pytorch#190489)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_megatron.distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _exit_as_a_collective_finishes(workdir: Path, ending: str) -> tuple[int | None, str]:
    """The leaving process's status and log (`tests/_exit_race.py`)."""
    os.mkfifo(workdir / "release")
    port, log = str(free_port()), workdir / "leaving.log"
    runs = [subprocess.Popen([sys.executable, "-m", "tests._exit_race", role, str(workdir), port, ending], cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=(workdir / f"{role}.log").open("w"),
                             stderr=subprocess.STDOUT, start_new_session=True) for role in ("leaving", "peer")]
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):
            runs[0].wait(timeout=180)
    finally:
        for run in runs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.pid, signal.SIGKILL)
    return runs[0].returncode, log.read_text()[-3000:]


@pytest.mark.parametrize(("ending", "status"), [("before_finalization", 143), ("finalize", -signal.SIGABRT)],
                         ids=["exit_before_finalization", "python_finalizes"])
def test_a_collective_finishing_as_the_process_exits(tmp_path: Path, ending: str, status: int) -> None:
    """The second case is torch's bug that the first one avoids; once it no longer aborts, the workaround can go."""
    returncode, log = _exit_as_a_collective_finishes(tmp_path, ending)
    assert returncode == status, log


@pytest.mark.parametrize(("ending", "status"), [("raise SystemExit(143)", 143), ("raise RuntimeError('failed')", 1)],
                         ids=["exits", "fails"])
def test_exit_before_finalization_runs_every_exit_handler_once(ending: str, status: int) -> None:
    """Handlers registered before and after it run once each, what was printed is flushed, and an uncaught exception
    still ends the process with Python's status 1."""
    script = ("import atexit, sys\nfrom lightning_megatron.distributed import exit_before_finalization\n"
              "atexit.register(print, 'registered before')\nexit_before_finalization(143)\n"
              "atexit.register(print, 'registered after')\nsys.stdout.write('unflushed')\n" + ending)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert result.returncode == status, result.stderr
    assert result.stdout == "unflushedregistered after\nregistered before\n"
    assert ("RuntimeError: failed" in result.stderr) == (status == 1)


def test_the_group_init_single_process_made_is_destroyed_at_exit_and_one_it_found_is_left_alone() -> None:
    """Exit handlers run last-registered first: one registered before `init_single_process` runs after its own and
    sees no group left (NCCL would otherwise warn of a leak as the process ends); a group the script made itself
    stays the script's."""
    probe = "atexit.register(lambda: print('at exit, initialized:', dist.is_initialized()))\n"
    made_here = ("import atexit, torch.distributed as dist\n" + probe +
                 "from lightning_megatron.distributed import init_single_process\ninit_single_process()\n"
                 "print('after init, initialized:', dist.is_initialized())\n")
    found = ("import atexit, os, torch.distributed as dist\nfrom lightning_megatron.distributed import free_port, "
             "init_single_process\nos.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(free_port()))\n"
             "dist.init_process_group('gloo', rank=0, world_size=1)\n" + probe + "init_single_process()\n")
    printed = {}
    # a rendezvous address this test process set (other tests' groups) would be taken already
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}
    for name, script in (("made_here", made_here), ("found", found)):
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                                env={**env, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        printed[name] = result.stdout.splitlines()
    assert printed["made_here"] == ["after init, initialized: True", "at exit, initialized: False"]
    assert printed["found"] == ["at exit, initialized: True"]
