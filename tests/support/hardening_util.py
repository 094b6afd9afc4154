"""Helpers shared by ``tests/gateway/hardening/``: a FakeBackend (or any app) under a
real uvicorn server in a background thread on loopback, the OpenAI error-shape check, and
``load_bench`` for the bench scripts the tests run at CI size."""

from __future__ import annotations

import contextlib
import importlib.util
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import uvicorn

ROOT = Path(__file__).resolve().parents[2]


def assert_openai_error_shape(r) -> dict:
    """``{"error": {"message": str, "type": str, "param", "code"}}`` and nothing else."""
    body = r.json()
    assert set(body) == {"error"}, (r.status_code, body)
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert "Traceback" not in err["message"]
    return err


@contextlib.contextmanager
def serve_in_thread(app, ready_timeout_s: float = 20, **config):
    """Yield the base URL of ``app`` under uvicorn (lifespan on) once its ``/readyz`` answers
    200 (within ``ready_timeout_s``); stop it afterwards. ``config``: more ``uvicorn.Config``."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", **config))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout_s
    while True:
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not become ready"
        time.sleep(0.05)
    try:
        yield base
    finally:
        srv.should_exit = True
        thread.join(timeout=15)
        sock.close()


def load_bench(name: str):
    """``bench/<name>.py`` as the module ``bench_<name>`` (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod
