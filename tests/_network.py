"""A socket guard: any connection (or name lookup) to a non-loopback address is recorded and refused.

Installed in a test process or a spawned rank before anything runs, it shows what would reach out to a hub.
Lightning and gloo rendezvous on loopback, which stays allowed. Attempts are recorded as well as refused, because
some libraries catch the error and fall back quietly.
"""

from __future__ import annotations

import ipaddress
import socket
import traceback
from typing import Any

ATTEMPTS: list[str] = []


def _is_loopback(host: Any) -> bool:
    if host is None or host in ("localhost", ""):
        return True
    if isinstance(host, bytes):
        host = host.decode()
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:
        return False


def _refuse(what: str) -> None:
    ATTEMPTS.append(f"{what}\n{''.join(traceback.format_stack(limit=25))}")
    raise OSError(f"network access refused by the test's socket guard: {what}")


def block_network() -> None:
    """Refuse every non-loopback connection and name lookup in this process from now on."""
    connect, connect_ex, getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo

    def guarded_connect(sock: socket.socket, address: Any) -> Any:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address[0]):
            _refuse(f"connect to {address}")
        return connect(sock, address)

    def guarded_connect_ex(sock: socket.socket, address: Any) -> Any:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address[0]):
            _refuse(f"connect_ex to {address}")
        return connect_ex(sock, address)

    def guarded_getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if not _is_loopback(host) and host != socket.gethostname():
            _refuse(f"name lookup of {host!r}")
        return getaddrinfo(host, *args, **kwargs)

    socket.socket.connect = guarded_connect  # type: ignore[method-assign]
    socket.socket.connect_ex = guarded_connect_ex  # type: ignore[method-assign]
    socket.getaddrinfo = guarded_getaddrinfo
