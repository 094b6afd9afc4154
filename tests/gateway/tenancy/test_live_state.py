"""``GET /admin/v1/live`` over two replicas sharing one Redis (:mod:`gateway.observability.live`):
running/waiting per tenant, per-user tok/s and SLA attainment summed over both; a stopped
replica drops out; one replica alone (no Redis) shows itself."""

from __future__ import annotations

import asyncio
import statistics
import uuid

import redis.asyncio as aioredis

from tests.support.fakes import FakeBackend
from tests.support.gateway_fixtures import chat
from tests.support.polling import async_wait_until
from tests.support.tenancy_fixtures import ADMIN_HEADERS, admin_setup, bearer, new_key, running_app


async def live(client) -> dict:
    r = await client.get("/admin/v1/live", headers=ADMIN_HEADERS)
    assert r.status_code == 200, r.text
    return r.json()


async def test_live_state_sums_both_replicas(sqlite_db, redis_url):
    prefix = f"test:{uuid.uuid4().hex}:"
    kw = {"redis_url": redis_url, "redis_prefix": prefix}
    gate_a, gate_b = asyncio.Event(), asyncio.Event()
    async with running_app(sqlite_db, FakeBackend(gate=gate_a, token_delay_s=0.01), replica_id="ra", **kw) as (a, ca):
        async with running_app(sqlite_db, FakeBackend(gate=gate_b, token_delay_s=0.01), replica_id="rb", **kw) as (b, cb):
            await admin_setup(ca, {"gold": {"min_tokens_per_s": 5, "max_concurrent": 10}}, {"acme": "gold"})
            key = await new_key(ca, "acme", "alice")
            held = [asyncio.create_task(c.post("/v1/chat/completions", json=chat(), headers=bearer(key)))
                    for c in (ca, cb, cb)]
            await async_wait_until(lambda: a.state.admission.tenant_active["acme"] == 1
                                   and b.state.admission.tenant_active["acme"] == 2, "three requests admitted")
            await b.state.live.publish()  # (published every second anyway)
            body = await live(ca)
            assert body["replica"] == "ra" and body["shared"] and not body["degraded"]
            assert [(r["replica"], r["running"]) for r in body["replicas"]] == [("ra", 1), ("rb", 2)]
            assert body["running"] == {"acme": 3} and body["running_total"] == 3
            gate_a.set()
            gate_b.set()
            assert [r.status_code for r in await asyncio.gather(*held)] == [200] * 3
            await b.state.live.publish()
            body = await live(ca)
            assert body["running_total"] == 0 and body["waiting_total"] == 0
            (alice,) = body["users"]
            rates = [o["decode_rates"] for app in (a, b) for o in app.state.stats.per_user(60)]
            assert sorted(x for r in rates for x in r) and len(rates) == 2
            assert alice["tenant"] == "acme" and alice["user"] == "alice" and alice["requests"] == 3
            assert alice["completion_tokens"] == 21 and alice["aggregate_tokens_per_s"] == 21 / 60
            assert alice["tokens_per_s"] == statistics.median(x for r in rates for x in r) > 5
            assert alice["sla_graded"] == 3 and alice["sla_met"] == 3 and body["sla"]["attainment"] == 1.0
        # replica b stopped: its key is gone, a alone remains
        assert [r["replica"] for r in (await live(ca))["replicas"]] == ["ra"]
    client = aioredis.from_url(redis_url)
    assert [k async for k in client.scan_iter(prefix + "replica:*")] == []
    await client.delete(*[k async for k in client.scan_iter(prefix + "*")] or [prefix])
    await client.aclose()


async def test_live_state_without_redis_is_this_replica(sqlite_db):
    async with running_app(sqlite_db) as (app, client):
        key = await new_key(client, "solo", "bob")
        assert (await client.post("/v1/chat/completions", json=chat(), headers=bearer(key))).status_code == 200
        body = await live(client)
        assert not body["shared"] and not body["degraded"] and len(body["replicas"]) == 1
        assert body["replicas"][0]["replica"] == app.state.replica_id
        assert [(u["tenant"], u["user"], u["requests"]) for u in body["users"]] == [("solo", "bob", 1)]
        assert body["sla"] == {"graded": 0, "met": 0, "attainment": None}


async def test_live_state_with_redis_down_is_this_replica_degraded(sqlite_db):
    async with running_app(sqlite_db, redis_url="redis://127.0.0.1:1/0") as (app, client):
        key = await new_key(client, "solo")
        assert (await client.post("/v1/chat/completions", json=chat(), headers=bearer(key))).status_code == 200
        body = await live(client)
        assert body["shared"] and body["degraded"] and len(body["replicas"]) == 1
        assert body["users"][0]["requests"] == 1
