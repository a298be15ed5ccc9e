"""The tests' preloaded servers (`lightning_megatron.recipes.preloaded`, where their design is): the libraries
imported once, so that a command does not spend most of its time importing them (~9-15 s of one core each).

- `preloaded_server`: one per test module of tiny benchmark commands (`tests/_background.py`'s `preloaded`
  commands), with what the benchmarks import;
- `run_forked`: one `lightning-megatron` command a test waits for, forked from this test process's server (started
  on first use, with what the command line imports, and stopped at exit). Only for commands whose test checks what
  they do, not what a fresh process prints while importing: the tests of that (the default fit "as a user", the
  quiet imports) start fresh processes.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from lightning_megatron.recipes.preloaded import Preloaded

# what the benchmarks import before megatron-bridge (`bench.common.import_megatron_bridge_first`, which the server
# imports after these), not the modules they run as `__main__`: runpy would run a second copy of one imported here
PRELOAD = ("lightning.pytorch", "transformers", "lightning_megatron.strategy", "lightning_megatron.module",
           "lightning_megatron.callbacks", "bench.common", "bench.flops")
# what `lightning-megatron` imports before megatron-bridge (the recipes' server imports the same)
CLI_PRELOAD = ("lightning_megatron.cli.megatron_cli",)


def preloaded_server(folder: Path, env: dict[str, str], cwd: Path) -> Preloaded:
    """The server for one module's commands, started at once; `run` waits for its imports the first time."""
    return Preloaded(folder, env, cwd, modules=PRELOAD)


_NOT_PASSED_ON = ("MASTER_ADDR", "MASTER_PORT",  # this process's rendezvous: an earlier test's group listens there
                  "PYTEST_CURRENT_TEST")  # pytest's name of the test running, different for each


def command_env() -> dict[str, str]:
    """This process's environment less what belongs to this process alone: the environment `run_forked`'s server
    starts with, and the default of its commands."""
    return {key: value for key, value in os.environ.items() if key not in _NOT_PASSED_ON}


_server: tuple[Preloaded, Path] | None = None


def run_forked(args: Sequence[str], cwd: Path, timeout: float, env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess:
    """`python -m args...` (`args` without the `-m`) in `cwd`, as `subprocess.run(..., capture_output=True,
    text=True, timeout=timeout)` would give it; a fork of the server when `env` (default `command_env()`) is the
    server's, else a fresh process."""
    global _server
    env = command_env() if env is None else env
    if _server is not None and _server[0].env != env:
        return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    if _server is None:
        folder = Path(tempfile.mkdtemp(prefix="lm-tests-"))  # short: a socket path has ~100 characters
        _server = Preloaded(folder, env, cwd, modules=CLI_PRELOAD, quiet=True), folder
        atexit.register(_close_server)
    output = Path(tempfile.mkdtemp(prefix="lm-forked-"))
    try:
        returncode = _server[0].run(["-m", *args], cwd, env, output / "stdout", output / "stderr", timeout)
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
