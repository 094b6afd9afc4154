"""``max_concurrent`` over two replicas sharing one Redis (concurrency leases,
:mod:`gateway.tenancy.concurrency`): the cap holds in total, leases of a dead replica lapse,
and with Redis down each replica falls back to its own count with a warning, never a 5xx."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

import redis.asyncio as aioredis

from gateway.tenancy.concurrency import LeaseStore
from tests.support.gateway_fixtures import chat
from tests.support.polling import async_wait_until
from tests.support.tenancy_fixtures import CountingBackend, admin_setup, bearer, new_key, running_app


class SharedPeak:
    """Generations running at once over several backends."""

    def __init__(self):
        self.now = self.peak = 0


class TrackedBackend(CountingBackend):
    def __init__(self, shared: SharedPeak, **kw):
        super().__init__(**kw)
        self.shared = shared

    async def _run(self, req):
        self.shared.now += 1
        self.shared.peak = max(self.shared.peak, self.shared.now)
        try:
            async for event in super()._run(req):
                yield event
        finally:
            self.shared.now -= 1


@contextlib.asynccontextmanager
async def two_replicas(db_url: str, redis_url: str, prefix: str, shared: SharedPeak):
    kw = {"redis_url": redis_url, "redis_prefix": prefix}
    async with running_app(db_url, TrackedBackend(shared, token_delay_s=0.03), **kw) as (a, ca):
        async with running_app(db_url, TrackedBackend(shared, token_delay_s=0.03), **kw) as (b, cb):
            yield (a, ca), (b, cb)


async def test_lease_store_caps_and_lapses(redis_url):
    prefix = f"test:{uuid.uuid4().hex}:"
    client = aioredis.from_url(redis_url)
    store = LeaseStore(client, prefix, ttl_s=0.5)
    try:
        assert await store.take("acme", "r1", 2) and await store.take("acme", "r2", 2)
        assert not await store.take("acme", "r3", 2)
        assert await store.take("acme", "r2", 2)  # already held: idempotent
        assert await store.count("acme") == 2
        await store.release("acme", "r1")
        assert await store.take("acme", "r3", 2) and await store.count("acme") == 2
        await store.refresh({"acme": ["r3"]})
        await asyncio.sleep(0.3)
        await store.refresh({"acme": ["r3"]})  # r2 not re-armed (its replica died)
        await asyncio.sleep(0.3)
        assert await store.count("acme") == 1  # r2 lapsed, r3 lives
        assert await client.zscore(prefix + "conc:acme", "r1") is None
    finally:
        await client.delete(*[k async for k in client.scan_iter(prefix + "*")] or [prefix])
        await client.aclose()


async def test_max_concurrent_holds_over_two_replicas(sqlite_db, redis_url):
    prefix = f"test:{uuid.uuid4().hex}:"
    shared = SharedPeak()
    async with two_replicas(sqlite_db, redis_url, prefix, shared) as ((a, ca), (b, cb)):
        await admin_setup(ca, {"two": {"max_concurrent": 2, "max_queue_wait_s": 30}}, {"acme": "two"})
        key = await new_key(ca, "acme", "alice")
        rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=chat(stream=i % 3 == 0), headers=bearer(key))
                                    for i in range(12) for c in [(ca, cb)[i % 2]]))
        assert [r.status_code for r in rs] == [200] * 12
        assert shared.peak == 2  # reached, never exceeded, although each replica alone allows 2
        assert len(a.state.backend.completed) + len(b.state.backend.completed) == 12
        assert min(len(a.state.backend.completed), len(b.state.backend.completed)) == 6
        await async_wait_until(lambda: not a.state.admission._pending and not b.state.admission._pending,
                               "leases released")
        assert await a.state.admission.leases.count("acme") == 0
        assert a.state.admission.lease_errors == b.state.admission.lease_errors == 0
        await a.state.admission.leases.client.delete(
            *[k async for k in a.state.admission.leases.client.scan_iter(prefix + "*")] or [prefix])


async def test_redis_down_falls_back_to_per_replica_count_with_a_warning(sqlite_db, caplog):
    dead = "redis://127.0.0.1:1/0"
    shared = SharedPeak()
    with caplog.at_level(logging.WARNING, logger="gateway.tenancy.admission"):
        async with two_replicas(sqlite_db, dead, "test:dead:", shared) as ((a, ca), (b, cb)):
            await admin_setup(ca, {"two": {"max_concurrent": 2, "max_queue_wait_s": 30}}, {"acme": "two"})
            key = await new_key(ca, "acme")
            rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=chat(), headers=bearer(key))
                                        for i in range(8) for c in [(ca, cb)[i % 2]]))
            assert [r.status_code for r in rs] == [200] * 8
            assert shared.peak == 4  # 2 per replica: the documented degraded mode
            assert a.state.admission.lease_errors >= 1 and b.state.admission.lease_errors >= 1
    assert any("max_concurrent holds per replica only" in r.getMessage() for r in caplog.records)
