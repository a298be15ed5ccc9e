"""The tests' preloaded server (`lightning_megatron.recipes.preloaded`, where its design is): one per test process,
started on first use and stopped at exit, that imported what the command line and the benchmarks import, so that a
command forked from it does not spend ~15 s of one core importing them.

Commands reach it through `run_to_files` (`tests/_background.py`'s `preloaded` commands, the benchmarks' runs) and
`run_forked` (a command a test waits for, its output captured). Only commands whose test checks what they do, not
what a fresh process prints while importing: the tests of that (the default fit "as a user", the quiet imports)
start fresh processes.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from lightning_megatron.recipes.preloaded import Preloaded

# imported before megatron-bridge (which the server imports last), as the commands do: `lightning-megatron`'s
# module, then what the benchmarks import before `bench.common.import_megatron_bridge_first`. Not the modules the
# commands run as `__main__`: runpy would run a second copy of one imported here.
PRELOAD = ("lightning_megatron.cli.megatron_cli", "lightning.pytorch", "transformers", "lightning_megatron.strategy",
           "lightning_megatron.module", "lightning_megatron.callbacks", "bench.common", "bench.flops")
_NOT_PASSED_ON = ("MASTER_ADDR", "MASTER_PORT",  # this process's rendezvous: an earlier test's group listens there
                  "PYTEST_CURRENT_TEST")  # pytest's name of the test running, different for each

_server: tuple[Preloaded, Path] | None = None
_starting = threading.Lock()  # background commands ask from their threads


def command_env() -> dict[str, str]:
    """This process's environment less what belongs to this process alone: what the server starts with, and the
    environment a command needs to be forked from it."""
    return {key: value for key, value in os.environ.items() if key not in _NOT_PASSED_ON}


def _shared_server(env: dict[str, str], cwd: Path) -> Preloaded | None:
    """This process's server (started now if it is not yet, with `env`); None where `env` is not the server's (the
    libraries read some variables at import)."""
    global _server
    with _starting:
        if _server is None:
            folder = Path(tempfile.mkdtemp(prefix="lm-tests-"))  # short: a socket path has ~100 characters
            _server = Preloaded(folder, env, cwd, modules=PRELOAD, quiet=True), folder
            atexit.register(_close_server)
        return _server[0] if _server[0].env == env else None


def run_to_files(args: Sequence[str], cwd: Path, env: dict[str, str], stdout: Path, stderr: Path,
                 timeout: float) -> int:
    """`python -m args...` (`args` without the `-m`) in `cwd`, its output in the two files (files, not pipes: a
    child process left behind could hold a pipe open); its exit status. Forked from the server where `env` is the
    server's, else a fresh process."""
    server = _shared_server(env, cwd)
    if server is not None:
        return server.run(["-m", *args], cwd, env, stdout, stderr, timeout)
    with open(stdout, "w") as out, open(stderr, "w") as err:
        return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, stdout=out, stderr=err,
                              timeout=timeout).returncode


def run_forked(args: Sequence[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`run_to_files` with `command_env()`, as `subprocess.run(..., capture_output=True, text=True,
    timeout=timeout)` would give it."""
    output = Path(tempfile.mkdtemp(prefix="lm-forked-"))
    try:
        returncode = run_to_files(args, cwd, command_env(), output / "stdout", output / "stderr", timeout)
        return subprocess.CompletedProcess([sys.executable, "-m", *args], returncode,
                                           (output / "stdout").read_text(), (output / "stderr").read_text())
    finally:
        shutil.rmtree(output, ignore_errors=True)


def _close_server() -> None:
    global _server
    if _server is not None:
        server, folder = _server
        server.close()
        shutil.rmtree(folder, ignore_errors=True)
        _server = None
