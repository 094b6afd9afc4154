"""Shared fixtures. The real model is loaded once per session (fp32 for exactness)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Fixture modules shared by many test files (registered once instead of imported per file).
pytest_plugins = ["tests.support.gateway_fixtures", "tests.support.tenancy_fixtures", "tests.support.hygiene", "pytester"]

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_or_skip(ok: bool, what: str) -> None:
    """Skip locally when a system dependency is missing; fail under CI=true."""
    if ok:
        return
    if IN_CI:
        pytest.fail(f"{what} is required under CI=true but is missing")
    pytest.skip(f"{what} is missing (install it, or run .ci/run)")


@pytest.fixture(scope="session", autouse=True)
def isolated_cache_dir(tmp_path_factory):
    """``$SPARKGATE_CACHE_DIR`` → a fresh folder for the session, so nothing in the user's
    cache (a cached SPS profile, the SQLite database) leaks into a test. Only the content-keyed
    build products are shared with the real cache, by symlink: the converted model
    (``models/``, ~14 s to convert) and the compiled C++ kernels (``torch_extensions/``)."""
    from runtime.config import cache_dir

    real, tmp = cache_dir(), tmp_path_factory.mktemp("sparkgate-cache")
    for name in ("models", "torch_extensions"):
        (real / name).mkdir(parents=True, exist_ok=True)
        (tmp / name).symlink_to(real / name, target_is_directory=True)
    old = os.environ.get("SPARKGATE_CACHE_DIR")
    os.environ["SPARKGATE_CACHE_DIR"] = str(tmp)
    yield real
    if old is None:
        os.environ.pop("SPARKGATE_CACHE_DIR")
    else:
        os.environ["SPARKGATE_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from runtime.models.loader import ensure_converted

    return ensure_converted()


@pytest.fixture(scope="session")
def target_fp32(model_dir):
    import torch

    from runtime.models.llama import load_llama

    return load_llama(model_dir, torch.float32)


@pytest.fixture(scope="session")
def target_gguf(model_dir):
    """The served ``gguf`` target, loaded once per session (6–12 s a load). Callers that need
    its kernels request ``gguf_kernel`` too; never mutate it (engines only set its kernel threads)."""
    from runtime.models.llama import load_llama

    return load_llama(model_dir, "gguf")


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


# -- one live server per pytest session (real model, uvicorn, SQLite) ------------------

class LiveServer:
    def __init__(self, base_url: str, key: str, admin_token: str, database_url: str, proc):
        self.base_url = base_url
        self.key = key
        self.admin_token = admin_token
        self.database_url = database_url
        self.proc = proc

    def headers(self, key: str | None = None) -> dict:
        return {"Authorization": f"Bearer {key or self.key}"}


@contextlib.contextmanager
def serve_gateway(tmp: Path, env: dict[str, str], ready_timeout_s: float = 180) -> Iterator[LiveServer]:
    """The real gateway (``gateway.main:create_app``) under uvicorn in a subprocess, on a fresh
    migrated SQLite database in ``tmp`` with one tenant key (``e2e-tenant``/``e2e-user``) and a
    random admin token; ``env`` adds to (and overrides) the process environment, e.g. the
    backend's ``SPARKGATE_*`` settings. Yields once ``/readyz`` answers 200; its log is
    ``tmp/server.log``.

    Raises:
        RuntimeError: the server exited, or was not ready within ``ready_timeout_s`` seconds.
    """
    import asyncio
    import subprocess


    from gateway.crud.keys import issue_key
    from gateway.db.migrate import upgrade
    from tests.support.servers import free_port, wait_for_http

    db_url = f"sqlite+aiosqlite:///{tmp}/live.db"
    upgrade(db_url)
    key = asyncio.run(issue_key(db_url, "e2e-tenant", user_label="e2e-user"))
    admin = "admin-" + os.urandom(16).hex()
    port = free_port()
    env = {**os.environ, "SPARKGATE_DATABASE_URL": db_url, "SPARKGATE_ADMIN_TOKEN": admin,
           "PYTHONPATH": str(ROOT), **env}
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "gateway.main:create_app", "--factory", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning"],
        env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(base + "/readyz", proc, tmp / "server.log", "the gateway", ready_timeout_s, interval_s=0.3)
        yield LiveServer(base, key, admin, db_url, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="session")
def live_server(tmp_path_factory, model_dir):
    """The real gateway + embedded engine (fp32, AR) under uvicorn in a subprocess.

    Shared by every end-to-end test module (start-up costs a few seconds)."""
    env = {"SPARKGATE_DTYPE": "float32", "SPARKGATE_MAX_BATCH_SIZE": "16", "SPARKGATE_MAX_CONTEXT": "2048",
           "SPARKGATE_SPEC_METHOD": "none"}
    with serve_gateway(tmp_path_factory.mktemp("live"), env) as server:
        yield server
