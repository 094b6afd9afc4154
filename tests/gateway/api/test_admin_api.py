"""Admin API (/admin/v1) and the tenant-scoped /v1/requests and /v1/usage, on SQLite
and Postgres: CRUD, 403 for tenant keys, key shown once, record filters and
pagination, stats, and tenant isolation."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from tests.support.gateway_fixtures import chat
from tests.support.tenancy_fixtures import ADMIN_HEADERS, admin_setup, bearer, new_key, running_app

A = ADMIN_HEADERS


async def test_tenant_keys_get_403_and_no_key_401(sqlite_db):
    async with running_app(sqlite_db) as (app, client):
        key = await new_key(client, "acme")
        for method, path in (("GET", "/admin/v1/tiers"), ("POST", "/admin/v1/tiers"), ("GET", "/admin/v1/tenants"),
                             ("PATCH", "/admin/v1/tenants/acme"), ("GET", "/admin/v1/keys"),
                             ("POST", "/admin/v1/keys/1/revoke"), ("GET", "/admin/v1/requests"),
                             ("GET", "/admin/v1/usage/tokens_per_s"), ("GET", "/admin/v1/stats/sla"),
                             ("GET", "/admin/v1/stats/acceptance"), ("GET", "/admin/v1/tenancy/status")):
            r = await client.request(method, path, json={}, headers=bearer(key))
            assert r.status_code == 403, (path, r.text)
            assert r.json()["error"]["type"] == "permission_error"
            assert (await client.request(method, path, json={})).status_code == 401


async def test_tiers_tenants_and_keys_crud(tenancy_db):
    async with running_app(tenancy_db) as (app, client):
        gold = {"name": "gold", "min_tokens_per_s": 20, "max_concurrent": 4, "rpm": 120, "tpm": 50000,
                "priority": 10, "max_queue_wait_s": 5}
        r = await client.post("/admin/v1/tiers", json=gold, headers=A)
        assert r.status_code == 201 and {k: r.json()[k] for k in gold} == gold
        assert (await client.post("/admin/v1/tiers", json=gold, headers=A)).status_code == 409
        assert (await client.post("/admin/v1/tiers", json={"name": "x", "rpm": 0}, headers=A)).status_code == 400
        r = await client.patch("/admin/v1/tiers/gold", json={"rpm": None, "priority": 11}, headers=A)
        assert r.json()["rpm"] is None and r.json()["priority"] == 11 and r.json()["tpm"] == 50000
        names = [t["name"] for t in (await client.get("/admin/v1/tiers", headers=A)).json()["data"]]
        assert names == ["gold", "default"]  # by priority
        assert (await client.get("/admin/v1/tiers/nope", headers=A)).status_code == 404

        r = await client.post("/admin/v1/tenants", json={"name": "acme", "tier": "gold"}, headers=A)
        assert r.status_code == 201 and r.json()["tier"] == "gold" and r.json()["effective_tier"] == "gold"
        r = await client.post("/admin/v1/tenants", json={"name": "initech"}, headers=A)
        assert r.json()["tier"] is None and r.json()["effective_tier"] == "default"
        r = await client.post("/admin/v1/tenants", json={"name": "bad", "tier": "nope"}, headers=A)
        assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_tier"
        r = await client.patch("/admin/v1/tenants/initech", json={"tier": "gold"}, headers=A)
        assert r.json()["tier"] == "gold"
        assert (await client.patch("/admin/v1/tenants/nope", json={"tier": None}, headers=A)).status_code == 404

        created = (await client.post("/admin/v1/keys", json={"tenant": "acme", "user": "alice", "token_budget": 1000,
                                                               "rpm_limit": 60}, headers=A)).json()
        key = created["key"]
        assert key.startswith("sk-sg-") and created["prefix"] == key[:12] and created["status"] == "active"
        listed = (await client.get("/admin/v1/keys", params={"tenant": "acme"}, headers=A)).json()["data"]
        assert len(listed) == 1 and "key" not in listed[0] and key not in str(listed)  # shown once
        assert listed[0]["rpm_limit"] == 60 and listed[0]["token_budget"] == 1000
        r = await client.post("/v1/chat/completions", json=chat(), headers=bearer(key))
        assert r.status_code == 200 and r.headers["x-ratelimit-limit-requests"] == "60"
        r = await client.patch(f"/admin/v1/keys/{created['id']}", json={"rpm_limit": 30}, headers=A)
        assert r.json()["rpm_limit"] == 30
        r = await client.post("/v1/chat/completions", json=chat(), headers=bearer(key))
        assert r.headers["x-ratelimit-limit-requests"] == "30"  # applied at once on this replica
        r = await client.post(f"/admin/v1/keys/{created['id']}/revoke", headers=A)
        assert r.json()["status"] == "revoked"
        assert (await client.get("/v1/models", headers=bearer(key))).status_code == 401  # at once here
        assert (await client.delete("/admin/v1/tiers/gold", headers=A)).json()["deleted"] is True
        r = await client.get("/admin/v1/tenants/acme", headers=A)
        assert r.json()["tier"] is None and r.json()["effective_tier"] == "default"
        assert (await client.delete("/admin/v1/tenants/acme", headers=A)).status_code == 200
        assert (await client.get("/admin/v1/tenants/acme", headers=A)).status_code == 404


async def seed(client, app) -> dict:
    """Two tenants, three users, 9 requests (one rejected by a key rpm limit of 2)."""
    await admin_setup(client, {"gold": {"priority": 10, "min_tokens_per_s": 1}}, {"acme": "gold", "globex": None})
    keys = {"alice": await new_key(client, "acme", "alice"), "bob": await new_key(client, "acme", "bob", rpm_limit=2),
            "carol": await new_key(client, "globex", "carol")}
    ids = {}
    for user, n in (("alice", 3), ("bob", 3), ("carol", 3)):
        for _ in range(n):
            r = await client.post("/v1/chat/completions", json=chat(return_spec_stats=True), headers=bearer(keys[user]))
            ids.setdefault(user, []).append(r.json().get("id"))
    await client.post("/admin/v1/rollups/refresh", headers=A)
    return {"keys": keys, "ids": ids}


async def test_records_filters_pagination_and_stats(tenancy_db):
    async with running_app(tenancy_db) as (app, client):
        s = await seed(client, app)
        get = lambda **p: client.get("/admin/v1/requests", params=p, headers=A)  # noqa: E731
        assert len((await get()).json()["data"]) == 9
        assert {r["user"] for r in (await get(tenant="acme")).json()["data"]} == {"alice", "bob"}
        assert len((await get(user="bob")).json()["data"]) == 3
        rejected = (await get(status="rejected")).json()["data"]
        assert len(rejected) == 1 and rejected[0]["user"] == "bob" and rejected[0]["error_code"] == "rate_limit_exceeded"
        assert len((await get(tier="gold")).json()["data"]) == 6 and len((await get(tier="default")).json()["data"]) == 3
        future = (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()
        assert (await get(since=future)).json()["data"] == []
        assert len((await get(until=future)).json()["data"]) == 9
        assert (await client.get("/admin/v1/requests", params={"status": "bogus"}, headers=A)).status_code == 400
        assert (await get(cursor="not-a-cursor")).status_code == 400
        seen, cursor = [], None  # pages of 4: 4 + 4 + 1, newest first, no duplicates
        while True:
            page = (await get(limit=4, **({"cursor": cursor} if cursor else {}))).json()
            seen += page["data"]
            cursor = page["next_cursor"]
            assert page["has_more"] is (cursor is not None)
            if cursor is None:
                break
        assert len(seen) == 9 == len({r["id"] for r in seen})
        assert [r["finished_at"] for r in seen] == sorted((r["finished_at"] for r in seen), reverse=True)
        one = (await client.get(f"/admin/v1/requests/{s['ids']['alice'][0]}", headers=A)).json()
        assert one["user"] == "alice" and one["completion_tokens"] == 7 and one["spec_rounds"] == 3

        series = (await client.get("/admin/v1/usage/tokens_per_s", params={"tenant": "acme"}, headers=A)).json()
        users = {x["user"]: x["points"] for x in series["data"]}
        assert set(users) == {"alice", "bob"} and series["bucket_s"] == 60
        assert sum(p["requests"] for p in users["alice"]) == 3 and all(p["tokens_per_s"] > 0 for p in users["alice"])
        acc = (await client.get("/admin/v1/stats/acceptance", params={"group_by": "tenant"}, headers=A)).json()["data"]
        by = {a["tenant"]: a for a in acc}
        # FakeBackend per request: 3 rounds, 12 drafted, 4 accepted, positions [3, 1]; 5 requests ran
        assert by["acme"]["rounds"] == 15 and by["acme"]["accepted"] == 20 and by["acme"]["drafted"] == 60
        assert by["acme"]["per_position"] == [1.0, pytest.approx(1 / 3)] and by["acme"]["acceptance_rate"] == pytest.approx(1 / 3)
        # every seeded request is free text: all of it is plain acceptance
        assert by["acme"]["plain"] == {"rounds": 15, "drafted": 60, "accepted": 20, "emitted": 35,
                                       "acceptance_rate": pytest.approx(1 / 3), "tau": pytest.approx(35 / 15)}
        assert by["acme"]["constrained"] == {"rounds": 0, "drafted": 0, "accepted": 0, "emitted": 0,
                                             "acceptance_rate": None, "tau": None}
        sla = {t["tier"]: t for t in (await client.get("/admin/v1/stats/sla", headers=A)).json()["data"]}
        assert sla["gold"]["graded_requests"] == 5 and sla["gold"]["rejected"] == 1
        assert sla["default"]["graded_requests"] == 0  # no target
        status = (await client.get("/admin/v1/tenancy/status", headers=A)).json()
        assert status["records"]["written"] == 9 and status["records"]["dropped"] == 0
        assert status["admission"]["rejections"] == {"rate_limit_exceeded": 1}


async def test_a_tenant_key_never_sees_another_tenants_records(tenancy_db):
    async with running_app(tenancy_db) as (app, client):
        s = await seed(client, app)
        carol = bearer(s["keys"]["carol"])
        own = (await client.get("/v1/requests", headers=carol)).json()["data"]
        assert len(own) == 3 and {r["tenant"] for r in own} == {"globex"}
        for params in ({"tenant": "acme"}, {"user": "alice"}, {"user": "bob", "tenant": "acme"},
                       {"status": "rejected"}, {"tier": "gold"}):
            data = (await client.get("/v1/requests", params=params, headers=carol)).json()["data"]
            assert all(r["tenant"] == "globex" for r in data), params
        assert (await client.get("/v1/requests", params={"user": "alice"}, headers=carol)).json()["data"] == []
        for rid in s["ids"]["alice"]:  # guessing ids of another tenant
            r = await client.get(f"/v1/requests/{rid}", headers=carol)
            assert r.status_code == 404 and "alice" not in r.text
        mine = s["ids"]["carol"][0]
        assert (await client.get(f"/v1/requests/{mine}", headers=carol)).json()["user"] == "carol"
        # a cursor from the admin listing cannot widen the tenant scope either
        page = (await client.get("/admin/v1/requests", params={"limit": 1}, headers=A)).json()
        data = (await client.get("/v1/requests", params={"cursor": page["next_cursor"]}, headers=carol)).json()["data"]
        assert all(r["tenant"] == "globex" for r in data)
        usage = (await client.get("/v1/usage", headers=carol)).json()
        assert usage["tenant"] == "globex" and usage["requests"] == 3
        assert [x["user"] for x in usage["data"]] == ["carol"]
        alice_usage = (await client.get("/v1/usage", params={"user": "alice"}, headers=carol)).json()
        assert alice_usage["requests"] == 0 and alice_usage["data"] == []
        bob_view = (await client.get("/v1/requests", headers=bearer(s["keys"]["alice"]))).json()["data"]
        assert {r["user"] for r in bob_view} == {"alice", "bob"}  # same tenant: both users visible


@pytest.mark.parametrize("path", ["/v1/requests", "/v1/usage"])
async def test_tenant_routes_need_a_key(sqlite_db, path):
    async with running_app(sqlite_db) as (app, client):
        assert (await client.get(path)).status_code == 401
