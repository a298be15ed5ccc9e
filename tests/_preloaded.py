"""`python -m module args` run as a fork of one process that imported the libraries once.

Importing torch, Megatron-Core, megatron-bridge, Lightning and transformers takes ~9 s of one core, longer than most
tiny benchmarks run after it; a module of a dozen such commands would spend most of its time importing. The server
(`python -m tests._preloaded SOCKET`) imports them, then forks a copy of itself per command: the copy takes the
command's working directory, environment, argv and output files and runs the module as `python -m` would
(`runpy`, `__main__`, its `__spec__`), then exits through the interpreter's own shutdown (atexit, threads), so each
command still runs in a process of its own, with its own exit status. Nothing of a command runs before the fork:
no process group, no seed, no thread; a command that forks or spawns processes itself does so as before.

Each connection gets a handler process (a fork of the server) that forks the command, tells the client its pid
(to kill it on a timeout, as `subprocess.run` would), waits for it and sends its exit status.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

# what the benchmarks import (megatron-bridge first: `bench.common.import_megatron_bridge_first`), not the modules
# they run as `__main__`: runpy would run a second copy of one imported here
PRELOAD = ("lightning.pytorch", "transformers", "lightning_megatron.strategy", "lightning_megatron.module",
           "lightning_megatron.callbacks", "bench.common", "bench.flops")
STARTUP_TIMEOUT_S = 120


class PreloadedServer:
    """The server process, started at once; `run` waits for its imports the first time."""

    def __init__(self, folder: Path, env: dict[str, str], cwd: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.socket_path = folder / "socket"
        self._log = open(folder / "server.log", "w")  # a file, not a pipe: nothing left behind holds it open
        self._process = subprocess.Popen([sys.executable, "-m", "tests._preloaded", str(self.socket_path)], cwd=cwd,
                                         env=env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log)

    def run(self, args: list[str], cwd: Path, env: dict[str, str], stdout: Path, stderr: Path,
            timeout: float) -> int:
        """`args` (`python -m` ...'s, without the interpreter) as a fork; its exit status (-9 when killed on
        `timeout`, after which `subprocess.TimeoutExpired` is raised as `subprocess.run` raises it)."""
        with self._connect() as connection:
            request = {"args": args, "cwd": str(cwd), "env": env, "stdout": str(stdout), "stderr": str(stderr)}
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
                    raise RuntimeError(f"the preloaded server did not start (exit status {self._process.poll()}); "
                                       f"its log: {self._log.name}") from None
                time.sleep(0.1)

    def close(self) -> None:
        self._process.kill()
        self._process.wait()
        self._log.close()


def serve(socket_path: str) -> None:
    from lightning_megatron._compat import import_megatron_bridge

    import_megatron_bridge()
    for name in PRELOAD:
        importlib.import_module(name)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path)  # the client connects once this exists and listens: the imports are done
    server.listen()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the handlers reaped as they end
    while True:
        connection, _ = server.accept()
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
    for stream, path in ((1, request["stdout"]), (2, request["stderr"])):
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(descriptor, stream)
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
    serve(sys.argv[1])
