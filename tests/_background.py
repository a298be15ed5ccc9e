"""Commands that tests run each in its own process, started before the tests need them.

Such a process spends most of its time importing torch, Megatron-Core and Lightning, or running a tiny model, on
one core, so on the CI's two cores two of them finish in little more than the time of one. A module lists its
commands once (`Command`, keyed by name); each test waits for its own and asserts on it as before. Nothing about a
command changes: the same arguments, working directory and environment, a folder of its own; only when it runs.

- a module's commands (`background_runs` in a module fixture): started when the module's first test runs, those
  whose test was collected (and not skipped), in the order listed;
- `EARLY_RUNS`, a dict a test module may define: its long single-process commands, started one after the other when
  the session starts (tests/conftest.py's `early_runs`), so that they use the core that the one-process tests
  before them leave idle, and are done by the time their test comes.

At most two of these processes run at once, whatever started them (the CI machine's two cores and its memory);
under pytest-xdist (`make test` runs two workers) each worker runs one at a time, and a worker starts its
`EARLY_RUNS` only when their test asks (`OnDemandRuns`): at the session's start it cannot know which worker will
run that test, and every worker starting them would run each twice.
A command marked `preloaded` runs as a fork of one process per module that imported the libraries once
(`tests/_preloaded.py`): the same command, process of its own and exit status, without its ~9 s of imports.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from lightning_megatron.recipes.preloaded import Preloaded
from tests._preloaded import preloaded_server

WORKERS = 2  # the CI machine's cores
XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # pytest processes sharing those cores
# across all pools: at most two such processes (~1.2 GB each) at once on the machine
_RUNNING = threading.BoundedSemaphore(max(1, WORKERS // XDIST_WORKERS))


@dataclass(frozen=True)
class Command:
    """`python -m <args(folder)...>` for the test named `test` (its node name: `test_x` or `test_x[param]`).

    `prepare(folder)` runs first, in the test process, before any command starts (a checkpoint, a config file)."""

    test: str
    args: Callable[[Path], Sequence[str]]
    env: Callable[[], dict[str, str]]
    cwd: Path
    timeout: int = 300
    prepare: Callable[[Path], None] | None = None
    preloaded: bool = False  # a fork of the module's preloaded server (same environment as the server's)


class BackgroundRuns:
    """The module's commands, running; `result(name)` waits for one and gives its `CompletedProcess` and folder."""

    def __init__(self, commands: dict[str, Command], root: Path, collected: Sequence[pytest.Item],
                 workers: int = WORKERS) -> None:
        wanted = {item.name for item in collected if item.get_closest_marker("skip") is None}
        # no brackets in the folder names: libraries glob for files inside them (`default_fit[cpu]` would not match)
        self._folders = {name: root / re.sub(r"\W", "_", name) for name, command in commands.items()
                         if command.test in wanted}
        for name, folder in self._folders.items():
            folder.mkdir(parents=True)
            if commands[name].prepare is not None:
                commands[name].prepare(folder)
        self._executor = ThreadPoolExecutor(workers)
        # each environment taken now, in the test process's thread: a test that sets a variable later (TMPDIR for
        # its own temporary folder) must not hand it to a command that starts meanwhile
        envs = {name: commands[name].env() for name in self._folders}
        preloaded = [name for name in self._folders if commands[name].preloaded]
        self._server = (preloaded_server(root / "preloaded", envs[preloaded[0]], commands[preloaded[0]].cwd)
                        if preloaded else None)
        self._runs: dict[str, Future[subprocess.CompletedProcess]] = {
            name: self._executor.submit(_run, commands[name], folder, envs[name], self._server)
            for name, folder in self._folders.items()}

    def result(self, name: str) -> tuple[subprocess.CompletedProcess, Path]:
        return self._runs[name].result(), self._folders[name]

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._server is not None:
            self._server.close()


class OnDemandRuns:
    """`BackgroundRuns`' `result(name)`, each command started only when its result is asked for."""

    def __init__(self, commands: dict[str, Command], root: Path, collected: Sequence[pytest.Item]) -> None:
        self._commands, self._root, self._collected = commands, root, collected

    def result(self, name: str) -> tuple[subprocess.CompletedProcess, Path]:
        runs = BackgroundRuns({name: self._commands[name]}, self._root / re.sub(r"\W", "_", name), self._collected,
                              workers=1)
        try:
            return runs.result(name)
        finally:
            runs.close()

    def close(self) -> None:
        """Nothing runs between two `result` calls."""


def _run(command: Command, folder: Path, env: dict[str, str],
         server: Preloaded | None) -> subprocess.CompletedProcess:
    # output to files, not pipes: a child process left behind could hold a pipe open
    args = [sys.executable, "-m", *command.args(folder)]
    stdout, stderr = folder / "stdout.txt", folder / "stderr.txt"
    with _RUNNING:
        if command.preloaded:
            assert server is not None
            returncode = server.run(args[1:], command.cwd, env, stdout, stderr, command.timeout)
        else:
            with open(stdout, "w") as out, open(stderr, "w") as err:
                returncode = subprocess.run(args, cwd=command.cwd, stdout=out, stderr=err, timeout=command.timeout,
                                            env=env).returncode
    return subprocess.CompletedProcess(args, returncode, stdout.read_text(), stderr.read_text())


def background_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                    commands: dict[str, Command]):
    """The body of a module-scoped fixture: `yield from background_runs(request, tmp_path_factory, COMMANDS)`."""
    collected = [item for item in request.session.items if getattr(item, "module", None) is request.module]
    runs = BackgroundRuns(commands, tmp_path_factory.mktemp("background"), collected)
    try:
        yield runs
    finally:
        runs.close()
