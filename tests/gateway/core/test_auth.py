"""API-key auth (digest storage, revocation, expiry, admin token, cache TTL), probes and CORS."""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta, timezone

import httpx
import pytest
from sqlalchemy import select

from gateway.core.security import AuthCache, Principal, generate_api_key, key_digest
from gateway.crud import keys as crud_keys
from gateway.db.models import ApiKey
from gateway.db.session import make_engine, make_sessionmaker
from gateway.main import create_app
from tests.support.fakes import FakeBackend
from tests.support.gateway_fixtures import chat, make_settings


async def db_session(url: str):
    engine = make_engine(url)
    return engine, make_sessionmaker(engine)()


def assert_401(r):
    assert r.status_code == 401, r.text
    assert r.json()["error"]["type"] == "authentication_error"
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Basic dXNlcjpwYXNz", "sk-sg-abc",
                                    "Bearer sk-sg-not-a-real-key"])
async def test_missing_or_bad_key_401(client, header, api_key):
    headers = {} if header is None else {"Authorization": header}
    for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
                         ("GET", "/v1/models/SmolLM2-135M-Instruct")):
        assert_401(await client.request(method, path, json=chat(), headers=headers))


async def test_valid_key_and_case_insensitive_scheme(client, api_key):
    r = await client.get("/v1/models", headers={"Authorization": f"bearer {api_key}"})
    assert r.status_code == 200


async def test_key_is_stored_only_as_digest_with_prefix(settings):
    engine, session = await db_session(settings.database_url)
    try:
        async with session:
            row, key = await crud_keys.create_key(session, "acme", "bob", token_budget=1000)
            stored = await session.scalar(select(ApiKey).where(ApiKey.id == row.id))
            assert key.startswith("sk-sg-") and len(key) >= 6 + 43  # token_urlsafe(32): 43 chars, 256 bits
            assert stored.digest == hashlib.sha256(key.encode()).hexdigest() == key_digest(key)
            assert stored.prefix == key[:12]
            columns = [getattr(stored, c.key) for c in ApiKey.__table__.columns]
            assert key not in [str(v) for v in columns]
            assert stored.tenant.name == "acme" and stored.user_label == "bob" and stored.token_budget == 1000
    finally:
        await engine.dispose()


def test_generated_keys_are_unique_and_long():
    keys = {generate_api_key() for _ in range(1000)}
    assert len(keys) == 1000 and all(len(k) == 6 + 43 for k in keys)


async def test_revoked_key_401(client, settings, api_key):
    engine, session = await db_session(settings.database_url)
    async with session:
        assert (await crud_keys.revoke_key(session, api_key[:12])).revoked_at is not None
    await engine.dispose()
    assert_401(await client.get("/v1/models", headers={"Authorization": f"Bearer {api_key}"}))


async def test_expired_key_401(client, settings):
    engine, session = await db_session(settings.database_url)
    async with session:
        past = datetime.now(timezone.utc) - timedelta(seconds=1)
        _, expired = await crud_keys.create_key(session, "acme", expires_at=past)
        _, valid = await crud_keys.create_key(session, "acme", expires_at=past + timedelta(hours=1))
    await engine.dispose()
    assert_401(await client.get("/v1/models", headers={"Authorization": f"Bearer {expired}"}))
    assert (await client.get("/v1/models", headers={"Authorization": f"Bearer {valid}"})).status_code == 200


async def test_last_used_at_is_stamped(client, settings, api_key):
    before = datetime.now(timezone.utc) - timedelta(seconds=1)
    assert (await client.get("/v1/models", headers={"Authorization": f"Bearer {api_key}"})).status_code == 200
    engine, session = await db_session(settings.database_url)
    async with session:
        row = await session.scalar(select(ApiKey).where(ApiKey.digest == key_digest(api_key)))
        assert row.last_used_at is not None and row.last_used_at >= before
    await engine.dispose()


async def test_positive_lookups_cached_for_ttl(client, app, settings, api_key):
    headers = {"Authorization": f"Bearer {api_key}"}
    assert (await client.get("/v1/models", headers=headers)).status_code == 200
    engine, session = await db_session(settings.database_url)
    async with session:
        await crud_keys.revoke_key(session, api_key)  # e.g. from the CLI, another process
    await engine.dispose()
    # still cached (TTL 5 s): no DB hit, still accepted
    assert (await client.get("/v1/models", headers=headers)).status_code == 200
    app.state.auth_cache.invalidate()  # what TTL expiry does
    assert_401(await client.get("/v1/models", headers=headers))


def test_auth_cache_expires_after_ttl():
    now = [100.0]
    cache = AuthCache(ttl_s=5.0, clock=lambda: now[0])
    p = Principal(tenant="acme")
    cache.put("d1", p)
    now[0] = 104.9
    assert cache.get("d1") is p
    now[0] = 105.0
    assert cache.get("d1") is None
    cache.put("d2", p)
    cache.invalidate("d2")
    assert cache.get("d2") is None


def test_auth_cache_is_bounded():
    cache = AuthCache(ttl_s=5.0, max_entries=3, clock=lambda: 0.0)
    for i in range(10):
        cache.put(f"d{i}", Principal(tenant="t"))
    assert len(cache._entries) <= 3 and cache.get("d9") is not None


async def test_admin_token_accepted(db_url):
    app = create_app(make_settings(db_url, admin_token="admin-secret"), FakeBackend())
    async with app.router.lifespan_context(app):
        await app.state.backend_start
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer admin-secret"})
            assert r.status_code == 200
            assert app.state.backend.requests[-1].tenant == "admin"
            assert_401(await c.get("/v1/models", headers={"Authorization": "Bearer admin-secreT"}))


async def test_probes_need_no_key(client, backend):
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    r = await client.get("/readyz")
    assert r.status_code == 200 and r.json() == {"status": "ready"}
    backend.set_ready(False)
    r = await client.get("/readyz")
    assert r.status_code == 503 and r.json() == {"status": "starting"}
    assert (await client.get("/healthz")).status_code == 200


async def test_readyz_503_until_backend_ready_and_start_stop(db_url):
    backend = FakeBackend(ready_on_start=False)
    app = create_app(make_settings(db_url), backend)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.get("/readyz")).status_code == 503  # before startup
        async with app.router.lifespan_context(app):
            await app.state.backend_start
            assert backend.started and (await c.get("/readyz")).status_code == 503
            backend.set_ready(True)
            assert (await c.get("/readyz")).status_code == 200
        assert backend.stopped


async def test_readyz_reports_failed_start(db_url, api_key):
    backend = FakeBackend(start_error=RuntimeError("weights missing"))
    app = create_app(make_settings(db_url), backend)
    async with app.router.lifespan_context(app):
        with pytest.raises(RuntimeError):
            await app.state.backend_start
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.get("/readyz")
            assert r.status_code == 503 and r.json()["status"] == "failed" and "weights missing" in r.json()["error"]
            assert (await c.get("/healthz")).status_code == 200
            # generation answers 503 saying the start failed (not "still loading", not a 500)
            r = await c.post("/v1/chat/completions", headers={"Authorization": f"Bearer {api_key}"},
                             json={"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
            assert "failed to start" in r.json()["error"]["message"]


ORIGIN = "https://ui.example"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


async def test_cors_preflight_without_key(db_url, api_key):
    app = create_app(make_settings(db_url, cors_origins=[ORIGIN]), FakeBackend())
    async with app.router.lifespan_context(app):
        await app.state.backend_start
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.options("/v1/chat/completions", headers=PREFLIGHT)
            assert r.status_code == 200
            assert r.headers["access-control-allow-origin"] == ORIGIN
            assert "POST" in r.headers["access-control-allow-methods"]
            assert "authorization" in r.headers["access-control-allow-headers"].lower()
            r = await c.options("/v1/chat/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
            assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
            r = await c.post("/v1/chat/completions", json=chat(), headers={"Origin": ORIGIN,
                                                                             "Authorization": f"Bearer {api_key}"})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
            r = await c.post("/v1/chat/completions", json=chat(), headers={"Origin": ORIGIN})
            assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN


async def test_cors_disabled_by_default(client):
    r = await client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert "access-control-allow-origin" not in r.headers
    assert r.status_code == 405
