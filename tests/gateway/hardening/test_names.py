"""Hardening round 2, item 3: one validator for tenant and tier names
(:func:`gateway.core.text.name_problem`), used by the admin API (bodies, path and
query parameters) and the CLI. A name that would create a tenant or tier must be 1–64
of ``[A-Za-z0-9._@-]`` starting with a letter or digit (it is a URL path segment of the
admin API); names of rows created before the check stay readable and manageable.
SQLite and Postgres."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.crud import tenants as crud_tenants
from gateway.crud import tiers as crud_tiers
from gateway.db.session import make_engine, make_sessionmaker
from tests.support.tenancy_fixtures import ADMIN_HEADERS, bearer, new_key, running_app
from tests.support.gateway_fixtures import run

H = {**ADMIN_HEADERS, "content-type": "application/json"}
BAD_NAMES = ["<b>x</b>", "a/b", "a b", "-lead", ".hidden", "x" * 65, "\ud800", "a\x00b", "é", ""]
GOOD_NAMES = ["e2e-tenant", "default", "team@corp.example", "A.b_c-9", "x" * 64]


def body(**fields) -> bytes:
    return json.dumps(fields).encode()  # ASCII with JSON escapes: "\ud800" arrives as a lone surrogate


def assert_400(r, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, "invalid_value"), err


async def add_legacy_rows(db_url: str) -> None:
    """A tenant and a tier whose names predate the check (written straight to the database)."""
    engine = make_engine(db_url)
    try:
        async with make_sessionmaker(engine)() as s:
            await crud_tiers.create_tier(s, "Gold Tier", rpm=5)
            await crud_tenants.create_tenant(s, "acme corp", "Gold Tier")
    finally:
        await engine.dispose()


@pytest.mark.parametrize("name", BAD_NAMES)
async def test_admin_api_refuses_names_it_could_not_manage(tenancy_db, name):
    async with running_app(tenancy_db) as (app, client):
        assert_400(await client.post("/admin/v1/keys", content=body(tenant=name), headers=H), "tenant")
        assert_400(await client.post("/admin/v1/tenants", content=body(name=name), headers=H), "name")
        assert_400(await client.post("/admin/v1/tiers", content=body(name=name), headers=H), "name")
        tenants = (await client.get("/admin/v1/tenants", headers=H)).json()["data"]
        tiers = (await client.get("/admin/v1/tiers", headers=H)).json()["data"]
    assert tenants == [] and [t["name"] for t in tiers] == ["default"]


async def test_good_names_can_be_created_and_then_managed_by_path(tenancy_db):
    async with running_app(tenancy_db) as (app, client):
        for name in GOOD_NAMES:
            if name != "default":  # seeded
                assert (await client.post("/admin/v1/tiers", content=body(name=name), headers=H)).status_code == 201
            assert (await client.post("/admin/v1/keys", content=body(tenant=name), headers=H)).status_code == 201
            r = await client.patch(f"/admin/v1/tenants/{name}", content=body(tier=name), headers=H)
            assert r.status_code == 200 and r.json()["tier"] == name, r.text
            assert (await client.get(f"/admin/v1/tiers/{name}", headers=H)).status_code == 200


async def test_tier_references_that_cannot_be_stored_are_400_not_500(tenancy_db):
    """``POST /admin/v1/tenants`` with tier ``"\\ud800"`` answered 500."""
    async with running_app(tenancy_db) as (app, client):
        assert_400(await client.post("/admin/v1/tenants", content=body(name="acme", tier="\ud800"), headers=H), "tier")
        assert (await client.post("/admin/v1/tenants", content=body(name="acme"), headers=H)).status_code == 201
        assert_400(await client.patch("/admin/v1/tenants/acme", content=body(tier="a\x00"), headers=H), "tier")
        r = await client.post("/admin/v1/tenants", content=body(name="initech", tier="nope"), headers=H)
        assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_tier"  # unchanged


async def test_user_labels_and_lookups_that_cannot_be_stored_are_400(tenancy_db):
    """Key labels are stored (no surrogates, no NUL, ≤ 256 characters); NUL in a path or
    query value compared with a stored column is a 400 (Postgres cannot even compare it)."""
    async with running_app(tenancy_db) as (app, client):
        assert_400(await client.post("/admin/v1/keys", content=body(tenant="acme", user="\ud800"), headers=H), "user")
        assert_400(await client.post("/admin/v1/keys", content=body(tenant="acme", user="a\x00"), headers=H), "user")
        key = await new_key(client, "acme", "alice")
        key_id = (await client.get("/admin/v1/keys", headers=H)).json()["data"][0]["id"]
        assert_400(await client.patch(f"/admin/v1/keys/{key_id}", content=body(user="\udfff"), headers=H), "user")
        assert_400(await client.get("/admin/v1/tenants/a%00b", headers=H), "path.name")
        assert_400(await client.get("/admin/v1/requests", params={"user": "a\x00b"}, headers=H), "query.user")
        assert_400(await client.get("/admin/v1/requests", params={"tenant": "a\x00b"}, headers=H), "query.tenant")
        assert_400(await client.get("/v1/requests", params={"user": "a\x00b"}, headers=bearer(key)), "query.user")
        assert_400(await client.get("/v1/requests/a%00b", headers=bearer(key)), "path.record_id")
        assert (await client.get("/v1/requests", params={"user": "alice"}, headers=bearer(key))).status_code == 200


async def test_rows_with_names_from_before_the_check_stay_manageable(tenancy_db):
    """Decision: looking up an existing tenant or tier accepts any storable name, so rows
    created before the check can still be read, re-tiered and deleted; only creating a new
    name (a tier, a tenant, or a key of a tenant that does not exist yet) is strict."""
    await add_legacy_rows(tenancy_db)
    async with running_app(tenancy_db) as (app, client):
        r = await client.get("/admin/v1/tenants/acme corp", headers=H)
        assert r.status_code == 200 and r.json()["tier"] == "Gold Tier"
        assert (await client.get("/admin/v1/tiers/Gold Tier", headers=H)).json()["rpm"] == 5
        assert (await client.get("/admin/v1/requests", params={"tenant": "acme corp"}, headers=H)).status_code == 200
        r = await client.patch("/admin/v1/tenants/acme corp", content=body(tier="default"), headers=H)
        assert r.status_code == 200 and r.json()["tier"] == "default"
        assert (await client.delete("/admin/v1/tiers/Gold Tier", headers=H)).status_code == 200
        assert_400(await client.post("/admin/v1/keys", content=body(tenant="acme corp"), headers=H), "tenant")
        assert (await client.delete("/admin/v1/tenants/acme corp", headers=H)).status_code == 200
        assert (await client.get("/admin/v1/tenants", headers=H)).json()["data"] == []


# ---------------------------------------------------------------- CLI (SQLite)
@pytest.mark.parametrize("argv,what", [
    (("keys", "create", "--tenant", "<b>x</b>"), "tenant"),
    (("keys", "create", "--tenant", "a/b"), "tenant"),
    (("keys", "create", "--tenant", "\udcff"), "tenant"),  # a non-UTF-8 argv byte arrives as a lone surrogate
    (("keys", "create", "--tenant", "acme", "--user", "a\x00b"), "user"),
    (("tenants", "create", "a b"), "name"),
    (("tenants", "create", "acme", "--tier", "\ud800"), "tier"),
    (("tenants", "set-tier", "acme", "\ud800"), "tier"),
    (("tiers", "create", "<i>gold</i>"), "name"),
    (("tiers", "update", "\ud800", "--rpm", "1"), "name"),
    (("keys", "revoke", "a\x00"), "prefix"),
])
def test_cli_refuses_names_with_exit_code_2(cli_env, capsys, argv, what):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == "" and err.startswith(f"error: invalid {what} "), (rc, out, err)
    err.encode("utf-8")  # the message itself is printable (the bad value is shown escaped)
    assert run(capsys, "tenants", "list")[1].strip().split("\n")[1:] == []  # nothing was created


def test_cli_accepts_good_names_and_manages_legacy_ones(cli_env, capsys):
    asyncio.run(add_legacy_rows(cli_env))
    assert run(capsys, "tiers", "create", "gold-1")[0] == 0
    assert run(capsys, "tenants", "create", "e2e-tenant", "--tier", "gold-1")[0] == 0
    rc, out, _ = run(capsys, "keys", "create", "--tenant", "team@corp.example", "--user", "Zoë")
    assert rc == 0 and out.startswith("sk-")
    assert run(capsys, "tenants", "set-tier", "acme corp", "gold-1")[0] == 0  # a legacy tenant
    assert run(capsys, "tiers", "update", "Gold Tier", "--rpm", "9")[0] == 0  # a legacy tier
    rc, out, _ = run(capsys, "tenants", "list")
    rows = {tuple(line.rsplit(None, 2)[0].rsplit(None, 1)) for line in out.strip().split("\n")[1:]}
    assert rows == {("acme corp", "gold-1"), ("e2e-tenant", "gold-1"), ("team@corp.example", "(default)")}
