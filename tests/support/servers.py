"""Servers the tests start as subprocesses: a free loopback port, and waiting for a server's
readiness URL while checking that its process still runs."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_http(url: str, proc: subprocess.Popen, log: Path, what: str, timeout_s: float,
                  ok: Callable[[httpx.Response], bool] = lambda r: r.status_code == 200,
                  interval_s: float = 0.1) -> None:
    """Poll ``GET url`` until ``ok(response)`` while ``proc`` runs.

    Raises:
        RuntimeError: ``proc`` exited, or ``timeout_s`` seconds passed; the message names
            ``what`` and ends with the tail of ``log`` (the process's output).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log.read_text()[-4000:]}")
        try:
            if ok(httpx.get(url, timeout=2)):
                return
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready in {timeout_s:.0f} s: {log.read_text()[-4000:]}")
        time.sleep(interval_s)


def refuses_connections(base: str) -> bool:
    """True once a new connection is refused (a connection cut while the server closes: not yet)."""
    try:
        httpx.get(base + "/healthz", timeout=2)
    except httpx.ConnectError:
        return True
    except httpx.TransportError:
        pass
    return False
