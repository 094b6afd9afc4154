"""Hardening, security: every route (enumerated from ``app.routes``, so new routes are
covered automatically) needs a key except the probes and the public admin-UI static
shell; HEAD/OPTIONS/trailing-slash variants never leak; admin routes refuse tenant keys;
keys are compared in constant time; no secret ever reaches the logs.

Tenant isolation of records through filters, id guesses and cursors is covered by
``tests/gateway/api/test_admin_api.py::test_a_tenant_key_never_sees_another_tenants_records`` (not
duplicated); here every /admin route is additionally shown to refuse tenant keys."""

from __future__ import annotations

import inspect
import logging
import re

import httpx
import pytest
from starlette.routing import Mount, Route

from gateway.crud.keys import issue_key
from gateway.main import create_app
from tests.support.fakes import FakeBackend
from tests.support.gateway_fixtures import chat, make_settings
from tests.support.hardening_util import assert_openai_error_shape

ADMIN = "adm-SECRET-" + "q" * 24
PROBES = {"/healthz", "/readyz"}
# the admin UI's static pages hold no data (every number comes from /admin/v1 with the token)
PUBLIC_STATIC = {"/admin", "/admin/", "/admin/assets"}


def flat_routes(routes):
    for r in routes:
        if hasattr(r, "original_router"):  # FastAPI's included router
            yield from flat_routes(r.original_router.routes)
        else:
            yield r


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "1", path)


def endpoints(app) -> list[tuple[str, str]]:
    out = []
    for r in flat_routes(app.routes):
        if isinstance(r, Mount):
            out.append(("GET", r.path + "/x"))
        elif isinstance(r, Route) or hasattr(r, "methods"):
            for m in sorted(r.methods or {"GET"}):
                out.append((m, concrete(r.path)))
    return out


@pytest.fixture
async def env(db_url):  # noqa: F811
    backend = FakeBackend(max_context=256)
    app = create_app(make_settings(db_url, admin_token=ADMIN), backend)
    async with app.router.lifespan_context(app):
        await app.state.backend_start
        key = await issue_key(db_url, "acme", "alice")
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw.test") as client:
            yield app, client, key, backend


def _is_public(path: str) -> bool:
    return path in PROBES or path in ("/admin", "/admin/") or path.startswith("/admin/assets/")


async def test_every_route_needs_a_key_including_head_options_and_trailing_slash(env):
    app, client, key, _ = env
    eps = endpoints(app)
    assert len(eps) >= 30 and ("GET", "/metrics") in eps and ("POST", "/v1/chat/completions") in eps
    checked = 0
    for method, path in eps:
        if _is_public(path):
            continue
        for hdrs in ({}, {"Authorization": "Bearer sk-sg-not-a-real-key"}, {"Authorization": "Basic abc"}):
            r = await client.request(method, path, json={}, headers=hdrs)
            assert r.status_code == 401, (method, path, hdrs, r.status_code, r.text[:200])
            assert assert_openai_error_shape(r)["type"] == "authentication_error"
            checked += 1
        for variant in ("HEAD", "OPTIONS"):
            r = await client.request(variant, path)
            assert r.status_code in (401, 405), (variant, path, r.status_code)
            assert not r.content or "error" in r.json()
        r = await client.request(method, path + "/", json={})
        assert r.status_code in (401, 404, 405, 307), (method, path + "/", r.status_code)
        if r.status_code == 307:  # redirect_slashes: must point at the protected route, no data
            assert r.headers["location"].endswith(path) and not r.content
        elif r.status_code != 401:
            assert_openai_error_shape(r)
    for probe in PROBES:
        assert (await client.get(probe)).status_code == 200
    assert checked >= 90


async def test_admin_routes_and_metrics_refuse_tenant_keys(env):
    app, client, key, _ = env
    admin_eps = [(m, p) for m, p in endpoints(app) if (p.startswith("/admin/v1") or p == "/metrics")]
    assert len(admin_eps) >= 20
    for method, path in admin_eps:
        r = await client.request(method, path, json={}, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 403, (method, path, r.status_code, r.text[:200])
        assert assert_openai_error_shape(r)["type"] == "permission_error"
        # even with a body FastAPI cannot parse, the 403 comes first
        r = await client.request(method, path, content=b"{bad", headers={"Authorization": f"Bearer {key}",
                                                                         "content-type": "application/json"})
        assert r.status_code == 403, (method, path, r.status_code)
    r = await client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and "sparkgate" in r.text


def test_keys_are_compared_in_constant_time_by_design():
    """Tenant keys: SHA-256 digest → indexed DB lookup (the plaintext is never compared);
    admin token: ``hmac.compare_digest``. No ``==`` on a token anywhere in the auth path."""
    from gateway.api import deps
    from gateway.core import security
    from gateway.crud import keys

    src = inspect.getsource(deps.require_principal)
    assert "hmac.compare_digest(token.encode(), admin.encode())" in src
    assert "key_digest(token)" in src
    assert not re.search(r"token\s*==|==\s*token|admin\s*==|==\s*admin", src)
    assert "ApiKey.digest == digest" in inspect.getsource(keys.authenticate)  # SQL equality on the digest
    assert len(security.key_digest("x")) == 64


async def test_no_secret_in_logs(env, caplog):
    app, client, key, backend = env
    wrong = "sk-sg-WRONGSECRET-" + "z" * 20
    caplog.set_level(logging.DEBUG)
    auth = {"Authorization": f"Bearer {key}"}
    await client.post("/v1/chat/completions", content=b"{bad json", headers=auth)  # failing request
    await client.post("/v1/chat/completions", json=chat(n=5), headers=auth)
    await client.get("/admin/v1/keys", headers=auth)  # 403
    await client.get("/v1/models", headers={"Authorization": f"Bearer {wrong}"})  # 401
    await client.get("/admin/v1/keys", headers={"Authorization": f"Bearer {ADMIN}"})
    r = await client.post("/admin/v1/keys", json={"tenant": "acme"}, headers={"Authorization": f"Bearer {ADMIN}"})
    new_key = r.json().get("key") if r.status_code == 201 else None
    backend.fail_after_deltas = 1  # an engine failure mid-stream is logged
    await client.post("/v1/chat/completions", json=chat(stream=True), headers=auth)
    backend.fail_after_deltas = None

    async def boom(*a, **k):
        raise RuntimeError("unexpected")

    app.state.backend.apply_chat_template = lambda m: (_ for _ in ()).throw(RuntimeError("boom"))
    await client.post("/v1/chat/completions", json=chat(), headers=auth)  # unhandled → logged 500
    await app.state.records.flush()
    text = caplog.text
    assert len(caplog.records) >= 2  # something was logged (the 500, the records …)
    for secret in filter(None, (key, wrong, ADMIN, new_key)):
        assert secret not in text, f"secret {secret[:8]}… found in logs"
        assert secret[8:] not in text
