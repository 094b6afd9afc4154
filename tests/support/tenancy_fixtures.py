"""Fixtures for ``tests/gateway/tenancy/`` and ``tests/gateway/api/test_admin_api.py``.

``tenancy_db`` runs a test on SQLite and on a real Postgres (127.0.0.1:5432, user
``postgres``, trust auth): one fresh database per pytest session, created and migrated
here and dropped at the end, emptied before each test. Without a reachable server the
Postgres cases skip locally and FAIL under ``CI=true``. ``redis_url`` does the same for
Redis at 127.0.0.1:6379.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import uuid
from datetime import datetime, timezone

import httpx
import pytest
from sqlalchemy import text

from gateway.db.migrate import upgrade
from gateway.db.session import make_engine
from gateway.main import create_app
from gateway.observability.observe import FINISHED, RequestContext, RequestOutcome
from runtime.interface import RequestTimings
from tests.support.fakes import FakeBackend
from tests.support.gateway_fixtures import make_settings, sqlite_url

PG = "postgresql+asyncpg://postgres@127.0.0.1:5432/"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
ADMIN = "admin-token-for-tests"


def skip_or_fail(msg: str) -> None:
    if IN_CI:
        pytest.fail(msg + " and CI=true requires it")
    pytest.skip(msg)


async def _pg_admin(sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(host="127.0.0.1", port=5432, user="postgres", database="postgres", timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@contextlib.contextmanager
def new_pg_database(prefix: str):
    """A new, empty Postgres database at 127.0.0.1:5432 (its URL), dropped on exit; skips when
    Postgres is not usable (fails under CI=true)."""
    import asyncpg

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    try:
        asyncio.run(_pg_admin(f'CREATE DATABASE "{name}"'))
    except (OSError, asyncio.TimeoutError, asyncpg.PostgresError) as exc:
        skip_or_fail(f"Postgres at 127.0.0.1:5432 is not usable ({exc!r})")
    try:
        yield PG + name
    finally:
        asyncio.run(_pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(scope="session")
def pg_tenancy_url():
    """A fresh, migrated Postgres database for this session; dropped afterwards."""
    with new_pg_database("sparkgate_tenancy") as url:
        upgrade(url)
        yield url


async def reset_postgres(url: str) -> None:
    engine = make_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.execute(text("TRUNCATE request_records, usage_rollups, responses, api_keys, tenants RESTART IDENTITY CASCADE"))
            await conn.execute(text("DELETE FROM sla_tiers WHERE name <> 'default'"))
    finally:
        await engine.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def tenancy_db(request, tmp_path, migrated_template) -> str:  # noqa: F811
    """A migrated, empty database URL: SQLite, then Postgres."""
    if request.param == "sqlite":
        path = tmp_path / "tenancy.db"
        shutil.copy(migrated_template, path)
        return sqlite_url(path)
    url = request.getfixturevalue("pg_tenancy_url")
    asyncio.run(reset_postgres(url))
    return url


@pytest.fixture
def sqlite_db(tmp_path, migrated_template) -> str:  # noqa: F811
    path = tmp_path / "tenancy.db"
    shutil.copy(migrated_template, path)
    return sqlite_url(path)


@pytest.fixture
def redis_url() -> str:
    import redis

    url = "redis://127.0.0.1:6379/0"
    try:
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    except redis.RedisError as exc:
        skip_or_fail(f"Redis at 127.0.0.1:6379 is not usable ({exc!r})")
    return url


class CountingBackend(FakeBackend):
    """FakeBackend that remembers the most generations it ever ran at once."""

    peak: int = 0

    async def _run(self, req):
        inner = super()._run(req)
        try:
            async for event in inner:
                self.peak = max(self.peak, self._running)
                yield event
        finally:
            await inner.aclose()  # the slot is freed when the gateway closes the stream, not at GC


@contextlib.asynccontextmanager
async def running_app(db_url: str, backend: FakeBackend | None = None, **overrides):
    """The app with its lifespan running and an ``httpx.AsyncClient``: ``(app, client)``."""
    settings = make_settings(db_url, admin_token=ADMIN, **overrides)
    app = create_app(settings, backend or CountingBackend())
    async with app.router.lifespan_context(app):
        await app.state.backend_start
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway.test", timeout=60) as client:
            yield app, client


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


ADMIN_HEADERS = bearer(ADMIN)


async def admin_setup(client: httpx.AsyncClient, tiers: dict, tenants: dict) -> None:
    """Create ``tiers`` ({name: fields}) and ``tenants`` ({name: tier}) over the admin API."""
    for name, fields in tiers.items():
        r = await client.post("/admin/v1/tiers", json={"name": name, **fields}, headers=ADMIN_HEADERS)
        assert r.status_code == 201, r.text
    for name, tier in tenants.items():
        r = await client.post("/admin/v1/tenants", json={"name": name, "tier": tier}, headers=ADMIN_HEADERS)
        assert r.status_code == 201, r.text


async def new_key(client: httpx.AsyncClient, tenant: str, user: str | None = None, **fields) -> str:
    r = await client.post("/admin/v1/keys", json={"tenant": tenant, "user": user, **fields}, headers=ADMIN_HEADERS)
    assert r.status_code == 201, r.text
    return r.json()["key"]


# ------------------------------------------------------------- admission in isolation
class LeavingClient:
    """The ``receive`` side of an ASGI request whose client disconnects once :meth:`leave` is called."""

    def __init__(self):
        self.left = asyncio.Event()

    def leave(self) -> None:
        self.left.set()

    async def receive(self) -> dict:
        await self.left.wait()
        return {"type": "http.disconnect"}


def controller_with_a_full_tenant(tier, limiter=None, tenant: str = "t"):
    """An :class:`~gateway.tenancy.admission.AdmissionController` (FakeBackend, no database) whose
    ``tenant`` already holds its only slot, every policy lookup answering ``tier``: the next
    request of that tenant queues."""
    from gateway.tenancy.admission import AdmissionController, Policy

    ctl = AdmissionController(FakeBackend(), sessionmaker=None, limiter=limiter)
    ctl.tenant_active[tenant] = 1

    async def get_policy(tenant, key_id):
        return Policy(tier, None)

    ctl.policies.get = get_policy
    return ctl


def outcome(i: int, tenant="acme", user="u", finished_at: datetime | None = None, tps: float | None = 10.0,
            status=FINISHED, target=None, spec=None) -> RequestOutcome:
    """A synthetic outcome that ended at ``finished_at`` with decode speed ``tps``."""
    end = (finished_at or datetime.now(timezone.utc)).timestamp()
    ctx = RequestContext(f"req-{i}", "chat", "m", False, prompt_tokens=5, max_tokens=50, tenant=tenant, user=user,
                         tier="gold", sla_target_tokens_per_s=target, received_wall=end - 2.0, received_mono=100.0)
    t = RequestTimings(wall_queued=end - 2.0, queued=100.0, started=100.1, first_token=100.5,
                       last_token=100.5 + (10 / tps if tps else 0.0), finished=102.0)
    return RequestOutcome(ctx, status, finish_reason="stop", prompt_tokens=5, completion_tokens=11 if tps else 1,
                          timings=t, spec=spec, ended_mono=102.0)
