"""`python -m module args` run as a fork of one process that imported the libraries once.

A recipe runs several `lightning-megatron` commands (the quickstart three, the quality benchmark five or more, the
drift benchmark eight or more), and a fresh process spends ~15 s of one core importing torch, Lightning,
transformers, Megatron-Core and megatron-bridge before it does anything: on the CPU, longer than a tiny fit takes.
The server (`python -m lightning_megatron.recipes.preloaded SOCKET [--quiet] MODULE...`) quiets what the commands
quiet (`--quiet`: `_compat.quiet_handled_warnings()`, as each command does first), imports the modules named and
then megatron-bridge (the commands' order), then forks a copy of itself per command: the copy takes the command's
working directory, environment, argv and output files and runs the module as `python -m` would (`runpy`,
`__main__`, its `__spec__`), then exits through the interpreter's own shutdown (atexit, threads), so each command
still runs in a process of its own, with its own exit status. Nothing of a command runs before the fork: no process
group, no seed, no thread; a command that starts processes itself (Lightning's launcher, for more than one device)
starts them as before.

Each connection gets a handler process (a fork of the server) that forks the command, tells the client its pid (to
kill it on a timeout, as `subprocess.run` would), waits for it and sends its exit status. The server ends with the
process that started it.

`run_module` is what the recipes call: through one server per recipe process on a machine without CUDA, and as a
fresh process where CUDA is available (the server's imports may initialize the CUDA driver, which a forked process
cannot use; a GPU command's imports are a small part of its time) or where the environment differs from the one the
server started in (the libraries read some variables at import).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

STARTUP_TIMEOUT_S = 300  # its imports, on a machine as busy as the CI's two cores
_PARENT_CHECK_S = 1.0


class Preloaded:
    """The server process, started at once; `run` waits for its imports the first time."""

    def __init__(self, folder: Path, env: dict[str, str], cwd: Path, modules: Sequence[str] = (),
                 quiet: bool = False) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.env = dict(env)
        self.socket_path = folder / "socket"
        self._log = open(folder / "server.log", "w")  # a file, not a pipe: nothing left behind holds it open
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(self.socket_path), *(["--quiet"] if quiet else []), *modules],
            cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log)

    def run(self, args: Sequence[str], cwd: Path, env: dict[str, str], stdout: Path, stderr: Path | None = None,
            timeout: float | None = None) -> int:
        """`args` (`["-m", module, ...]`: `python`'s, without the interpreter) as a fork, its output in `stdout`
        (and `stderr`, or the same file); its exit status (-9 when killed on `timeout`, after which
        `subprocess.TimeoutExpired` is raised as `subprocess.run` raises it)."""
        with self._connect() as connection:
            request = {"args": list(args), "cwd": str(cwd), "env": env, "stdout": str(stdout),
                       "stderr": None if stderr is None else str(stderr)}
            connection.sendall(json.dumps(request).encode() + b"\n")
            replies = connection.makefile("r")
            pid = json.loads(replies.readline())["pid"]
            connection.settimeout(timeout)
            try:
                return json.loads(replies.readline())["returncode"]
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired([sys.executable, *args], timeout) from None

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                connection.connect(str(self.socket_path))
                return connection
            except (FileNotFoundError, ConnectionRefusedError):
                connection.close()
                if self._process.poll() is not None or time.monotonic() > deadline:
                    self._log.flush()
                    raise RuntimeError(f"the preloaded server did not start (exit status {self._process.poll()}); "
                                       f"the end of its log ({self._log.name}):\n"
                                       f"{Path(self._log.name).read_text()[-3000:]}") from None
                time.sleep(0.1)

    def close(self) -> None:
        self._process.kill()
        self._process.wait()
        self._log.close()


_recipe_server: tuple[Preloaded, Path] | None = None


def run_module(args: Sequence[str], env: dict[str, str], output: Path) -> int:
    """`python -m args...` (`args` without the `-m`) in the working directory, its standard output and error in
    `output`; its exit status. On a machine without CUDA, a fork of this process's server (started on first use,
    stopped at exit), else a fresh process."""
    global _recipe_server
    import torch

    if torch.cuda.is_available() or (_recipe_server is not None and _recipe_server[0].env != env):
        with output.open("w") as stream:
            return subprocess.run([sys.executable, "-m", *args], stdout=stream, stderr=subprocess.STDOUT,
                                  env=env).returncode
    if _recipe_server is None:
        folder = Path(tempfile.mkdtemp(prefix="lightning-megatron-"))  # short: a socket path has ~100 characters
        _recipe_server = Preloaded(folder, env, Path.cwd(), modules=("lightning_megatron.cli.megatron_cli",),
                                   quiet=True), folder
        atexit.register(_close_recipe_server)
    return _recipe_server[0].run(["-m", *args], Path.cwd(), env, output)


def _close_recipe_server() -> None:
    global _recipe_server
    if _recipe_server is not None:
        server, folder = _recipe_server
        server.close()
        shutil.rmtree(folder, ignore_errors=True)
        _recipe_server = None


def serve(socket_path: str, modules: Sequence[str], quiet: bool) -> None:
    """The server process's body: the imports, then a connection at a time until its parent is gone."""
    from lightning_megatron import _compat

    if quiet:
        _compat.quiet_handled_warnings()
    for name in modules:  # first, as in the commands: megatron-bridge's import sets up the root logger, which
        importlib.import_module(name)  # Lightning's import looks at to choose its own handler
    _compat.import_megatron_bridge()
    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path)  # the client connects once this exists and listens: the imports are done
    server.listen()
    server.settimeout(_PARENT_CHECK_S)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the handlers reaped as they end
    while os.getppid() == parent:  # else the process that started it is gone
        try:
            connection, _ = server.accept()
        except TimeoutError:
            continue
        connection.settimeout(None)
        if os.fork() == 0:
            server.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _handle(connection)
        connection.close()


def _handle(connection: socket.socket) -> None:
    """A handler process: fork the command, report its pid, wait, report its exit status."""
    request = json.loads(connection.makefile("r").readline())
    pid = os.fork()
    if pid == 0:
        connection.close()
        _run_command(request)
    try:  # the client may be gone (killed the command on a timeout): this process ends all the same
        connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        _, status = os.waitpid(pid, 0)
        connection.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
    finally:
        os._exit(0)


def _run_command(request: dict) -> None:
    """In the command's process: `python -m args` from here on; ends the process."""
    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # as `python -m` has it; the rest of sys.path (PYTHONPATH too) is the server's
    os.environ.clear()
    os.environ.update(request["env"])
    sys.stdout.flush()
    sys.stderr.flush()
    stdout = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    stderr = stdout if request["stderr"] is None else os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                                                              0o644)
    for stream, descriptor in ((1, stdout), (2, stderr)):
        os.dup2(descriptor, stream)
    for descriptor in {stdout, stderr}:
        os.close(descriptor)
    module, *arguments = request["args"][1:]  # after "-m"
    sys.argv = [module, *arguments]  # runpy puts the module's file first, as `python -m` does
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    sys.exit(0)


if __name__ == "__main__":
    quiet_flag = "--quiet" in sys.argv[2:]
    serve(sys.argv[1], [name for name in sys.argv[2:] if name != "--quiet"], quiet_flag)
