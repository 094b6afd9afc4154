"""Shared fixtures/helpers for the gateway tests (``tests/gateway/``).

Registered once as a pytest plugin (``pytest_plugins`` in ``tests/conftest.py``), so the
fixtures are available in every test module; import only the helpers (``chat``,
``make_settings``, ...). Every test gets a fresh SQLite database
copied from one migrated template, a :class:`tests.support.fakes.FakeBackend`, the app with
its lifespan running, an ``httpx.AsyncClient`` over ``ASGITransport`` and a key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from pathlib import Path

import httpx
import pytest

from gateway import cli
from gateway.core.config import Settings
from gateway.crud.keys import issue_key
from gateway.db.migrate import upgrade
from gateway.main import create_app
from tests.support.fakes import FakeBackend

MODEL = "SmolLM2-135M-Instruct"


def sqlite_url(path: Path) -> str:
    return f"sqlite+aiosqlite:///{path}"


def make_settings(database_url: str, **overrides) -> Settings:
    """Settings independent of the developer's environment / .env."""
    return Settings(_env_file=None, database_url=database_url, **overrides)


def parse_sse(body: str) -> list:
    """Split an SSE body into events; each must be exactly ``data: <payload>``.
    Returns JSON-decoded payloads, with the literal string ``"[DONE]"`` kept as is."""
    assert body.endswith("\n\n"), f"SSE body must end with a blank line: {body[-40:]!r}"
    events = []
    for block in body[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, f"bad SSE event {block!r}"
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def parse_response_sse(body: str) -> list[dict]:
    """Split a Responses API SSE body into its events; each must be exactly ``event: <type>``
    and ``data: <json>`` whose ``type`` is that name (no ``[DONE]``)."""
    assert body.endswith("\n\n"), f"SSE body must end with a blank line: {body[-40:]!r}"
    events = []
    for block in body[:-2].split("\n\n"):
        head, data = block.split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), f"bad SSE event {block!r}"
        event = json.loads(data[len("data: "):])
        assert event["type"] == head[len("event: "):], block
        events.append(event)
    return events


def chat(content: str = "Say hello", **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


@pytest.fixture(scope="session")
def migrated_template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gateway-db") / "template.db"
    upgrade(sqlite_url(path))
    return path


@pytest.fixture
def db_url(tmp_path, migrated_template) -> str:
    path = tmp_path / "sparkgate.db"
    shutil.copy(migrated_template, path)
    return sqlite_url(path)


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def settings(db_url) -> Settings:
    return make_settings(db_url)


@pytest.fixture
async def app(settings, backend):
    application = create_app(settings, backend)
    async with application.router.lifespan_context(application):
        await application.state.backend_start
        yield application


@pytest.fixture
async def client(app):
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway.test") as c:
        yield c


@pytest.fixture
async def api_key(settings) -> str:
    return await issue_key(settings.database_url, "acme", "alice")


@pytest.fixture
def auth(api_key) -> dict:
    return {"Authorization": f"Bearer {api_key}"}


def http(url: str, key: str, method: str = "POST", path: str = "/v1/chat/completions", **kw):
    """One request against a fresh app on the database ``url``; returns (response, backend)."""
    backend = FakeBackend()

    async def go():
        app = create_app(make_settings(url), backend)
        async with app.router.lifespan_context(app):
            await app.state.backend_start
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                return await c.request(method, path, headers={"Authorization": f"Bearer {key}"}, **kw)

    return asyncio.run(go()), backend


@contextlib.asynccontextmanager
async def engine_client(settings, model, tokenizer, timeout: float = 120, **cfg):
    """``(app, httpx.AsyncClient)`` on the app over the real engine, in-process, lifespan
    running: ``model`` (its dtype in ``cfg``, fp32 by default), ``EngineConfig`` overrides in ``cfg``."""
    from runtime.config import EngineConfig
    from runtime.engine.async_engine import AsyncEngine
    from runtime.engine.llm_engine import LLMEngine

    engine = AsyncEngine(EngineConfig(**{"dtype": "float32", "max_batch_size": 4, "max_context": 512, **cfg}),
                         engine_factory=lambda c, emit: LLMEngine(c, emit, model=model, tokenizer=tokenizer))
    application = create_app(settings, engine)
    async with application.router.lifespan_context(application):
        await application.state.backend_start
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://t",
                                     timeout=timeout) as c:
            yield application, c


@contextlib.asynccontextmanager
async def real_app(settings, target_fp32, tokenizer, **cfg):
    """An ``httpx.AsyncClient`` on the app over the real engine, in-process (fp32 model,
    ``EngineConfig`` overrides in ``cfg``), lifespan running."""
    async with engine_client(settings, target_fp32, tokenizer, **cfg) as (_, c):
        yield c


@contextlib.asynccontextmanager
async def served_engine(tmp_path_factory, migrated_template, name: str, model, tokenizer, **cfg):
    """``(app, client, headers)`` for a module's real-engine tests: its own copy of the migrated
    database (directory ``name``), :func:`engine_client` with ``cfg`` (600 s client timeout,
    1-hour request timeout: a loaded 2-core CPU must not time a batch out) and a tenant key."""
    path = tmp_path_factory.mktemp(name) / "db.sqlite"
    shutil.copy(migrated_template, path)
    settings = make_settings(sqlite_url(path))
    async with engine_client(settings, model, tokenizer, timeout=600, request_timeout_s=3600.0, **cfg) as (app, c):
        key = await issue_key(settings.database_url, "acme", "alice")
        yield app, c, {"Authorization": f"Bearer {key}"}


def run(capsys, *argv) -> tuple[int, str, str]:
    """``sparkgate ARGV…`` in-process: (exit code, stdout, stderr)."""
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err
