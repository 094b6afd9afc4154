"""Issue 25, item 7: requests refused after admission charged their buckets (by the
concurrency queue, the engine's queue, or a client leaving while queued) do not spend
rpm/tpm, with local and with Redis buckets; two ``Authorization`` headers are a 400 on
every authenticated route. (The Users-table layout check is in tests/gateway/test_admin_ui.py.)

Bucket clocks are injected (local buckets) or run at 1 request per 30 s (Redis, whose
clock is its own), so nothing here depends on how fast the machine is."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from gateway.tenancy.admission import TierPolicy
from gateway.core.security import Principal
from gateway.crud import records as crud_records
from gateway.openai.generation import ClientDisconnected
from gateway.observability.observe import RequestContext
from gateway.tenancy.ratelimit import REQUESTS, TOKENS, Limit, LocalBucketStore, RateLimiter, RedisBucketStore
from tests.support.fakes import FakeBackend
from tests.support.gateway_fixtures import chat
from tests.support.hardening_util import assert_openai_error_shape
from tests.support.polling import async_wait_until
from tests.support.tenancy_fixtures import (ADMIN, LeavingClient, admin_setup, bearer, controller_with_a_full_tenant, new_key,
                                    running_app)


@pytest.fixture(params=["local", "redis"])
async def limiter(request):
    """A :class:`RateLimiter` on local buckets with a clock frozen at 0 s, or on Redis
    buckets under a fresh key prefix (deleted afterwards)."""
    if request.param == "local":
        yield RateLimiter(LocalBucketStore(clock=lambda: 0.0))
        return
    prefix = f"test:{uuid.uuid4().hex}:"
    store = RedisBucketStore(request.getfixturevalue("redis_url"), prefix)
    lim = RateLimiter(store)
    try:
        yield lim
        assert lim.store_errors == 0  # really served from Redis, not the local fallback
    finally:
        keys = [k async for k in store.client.scan_iter(prefix + "*")]
        if keys:
            await store.client.delete(*keys)
        await store.close()


async def assert_remaining(lim: RateLimiter, limit: Limit, expected: float, t0: float) -> None:
    """The bucket holds ``expected`` plus at most what it refilled since ``t0``
    (``time.monotonic()``; nothing with the frozen local clock, ``per_minute/60`` per
    second on Redis's clock), capped at its capacity."""
    got = (await lim._apply(limit, 0, "peek")).remaining
    refill = limit.per_minute / 60 * (time.monotonic() - t0) if isinstance(lim.store, RedisBucketStore) else 0.0
    assert expected - 1e-6 <= got <= min(limit.per_minute, expected + refill) + 1e-6, (limit, got, expected)


# ---------------------------------------------------------------- rpm and refusals
async def test_a_refund_gives_back_the_request_and_tokens_atomically_across_replicas(limiter):
    """Two limiters on one store (two replicas on Redis) take and refund 3 requests × 100
    tokens each, interleaved: afterwards the buckets are full again, no refund lost or
    doubled, and a refunded grant's headers show the buckets after its refund."""
    t0 = time.monotonic()
    replicas = [limiter, RateLimiter(limiter.store)]
    limits = [Limit("tenant:acme", REQUESTS, 6), Limit("key:7", TOKENS, 600)]

    async def take_and_refuse(lim: RateLimiter) -> dict:
        grant = await lim.acquire(limits, 100)
        await asyncio.sleep(0)  # let the other replica interleave
        await grant.settle(0, served=False)
        await grant.settle(0, served=False)  # idempotent
        return grant.headers()

    heads = await asyncio.gather(*(take_and_refuse(replicas[i % 2]) for i in range(6)))
    await assert_remaining(limiter, limits[0], 6, t0)
    await assert_remaining(limiter, limits[1], 600, t0)
    assert all(int(h["x-ratelimit-remaining-requests"]) >= 1 for h in heads)  # after its own refund
    t0 = time.monotonic()
    served = await limiter.acquire(limits, 100)
    await served.settle(40)  # a served request keeps its request and the tokens it used
    await assert_remaining(limiter, limits[0], 5, t0)
    await assert_remaining(limiter, limits[1], 560, t0)


async def test_requests_refused_by_the_concurrency_queue_do_not_spend_the_rpm(sqlite_db, limiter):
    """Tier rpm 2, max_concurrent 1, no queue wait. While one request runs, three more are
    refused by the concurrency queue (429 concurrency_limit_exceeded, not
    rate_limit_exceeded, with the bucket's state after the refund in the headers); the rpm
    then still admits exactly one more request (2 served in all) and refuses the next."""
    backend = FakeBackend(gate=asyncio.Event())
    async with running_app(sqlite_db, backend) as (app, client):
        app.state.admission.limiter = limiter
        await admin_setup(client, {"one": {"max_concurrent": 1, "rpm": 2, "max_queue_wait_s": 0}}, {"acme": "one"})
        key = await new_key(client, "acme", "alice")
        first = asyncio.create_task(client.post("/v1/chat/completions", json=chat(), headers=bearer(key)))
        await async_wait_until(lambda: len(backend.requests) == 1, "the first request to reach the engine")
        refused = [await client.post("/v1/chat/completions", json=chat(stream=i == 1), headers=bearer(key))
                   for i in range(3)]
        assert [r.status_code for r in refused] == [429] * 3
        assert [r.json()["error"]["code"] for r in refused] == ["concurrency_limit_exceeded"] * 3
        assert [r.headers["x-ratelimit-remaining-requests"] for r in refused] == ["1"] * 3
        backend.gate.set()
        assert (await first).status_code == 200
        second = await client.post("/v1/chat/completions", json=chat(), headers=bearer(key))
        assert second.status_code == 200 and second.headers["x-ratelimit-remaining-requests"] == "0"
        third = await client.post("/v1/chat/completions", json=chat(), headers=bearer(key))
        assert third.status_code == 429 and third.json()["error"]["code"] == "rate_limit_exceeded"
        assert len(backend.requests) == 2 and app.state.admission.tenant_active["acme"] == 0


async def test_requests_refused_by_the_engine_queue_do_not_spend_the_rpm(sqlite_db, limiter):
    """The engine's queue is full: three 503 ``queue_full``, not a 429 after the second;
    once it has room the rpm of 2 admits exactly two requests."""
    backend = FakeBackend(queue_full=True)
    async with running_app(sqlite_db, backend) as (app, client):
        app.state.admission.limiter = limiter
        await admin_setup(client, {"two": {"rpm": 2}}, {"acme": "two"})
        key = await new_key(client, "acme")

        async def post():  # the refund runs in a task when the engine refuses: let it land
            r = await client.post("/v1/chat/completions", json=chat(), headers=bearer(key))
            await async_wait_until(lambda: not app.state.admission._pending, "the bucket refunds")
            return r

        refused = [await post() for _ in range(3)]
        assert [(r.status_code, r.json()["error"]["code"]) for r in refused] == [(503, "queue_full")] * 3
        backend.queue_full = False
        served = [await post() for _ in range(3)]
        assert [r.status_code for r in served] == [200, 200, 429]
        assert served[2].json()["error"]["code"] == "rate_limit_exceeded"
        assert served[2].json()["error"]["type"] == "requests"
        assert len(backend.requests) == 5  # 3 refused by the engine's queue, 2 served


async def test_a_client_leaving_the_queue_gets_its_request_back(limiter):
    tier = TierPolicy("one", max_concurrent=1, rpm=1, max_queue_wait_s=60)
    ctl = controller_with_a_full_tenant(tier, limiter)
    client = LeavingClient()
    ctx = RequestContext("r1", "chat", "m", False, prompt_tokens=3, max_tokens=5, tenant="t")
    t0 = time.monotonic()
    admitting = asyncio.create_task(ctl.admit(client, Principal(tenant="t", key_id=1), ctx, [ctl]))
    await async_wait_until(lambda: len(ctl._waiters) == 1, "the request to queue")
    await assert_remaining(limiter, Limit("tenant:t", REQUESTS, 1), 0, t0)  # held while queued
    client.leave()
    with pytest.raises(ClientDisconnected):
        await admitting
    await assert_remaining(limiter, Limit("tenant:t", REQUESTS, 1), 1, t0)
    assert ctl.active == {} and ctl._waiters == []


# ---------------------------------------------------------------- duplicate Authorization
def authenticated_routes(app) -> list[tuple[str, str]]:
    """(method, path with path parameters filled in) of every /v1, /admin/v1 and /metrics route."""
    out = []
    for path, ops in app.openapi()["paths"].items():
        if path.startswith(("/v1/", "/admin/v1/", "/metrics")):
            filled = "/".join("1" if part.startswith("{") else part for part in path.split("/"))
            out += [(method.upper(), filled) for method in ops]
    return out


async def test_two_authorization_headers_are_a_400_on_every_authenticated_route(sqlite_db):
    """A tenant key and the admin token, in either order (each alone is accepted): 400
    ``invalid_request_error`` everywhere, before any body is read, no engine call, no record."""
    backend = FakeBackend()
    async with running_app(sqlite_db, backend) as (app, client):
        key = await new_key(client, "acme", "alice")
        routes = authenticated_routes(app)
        assert len(routes) >= 25 and ("GET", "/metrics") in routes and ("POST", "/v1/chat/completions") in routes
        pairs = [[("Authorization", f"Bearer {key}"), ("Authorization", f"Bearer {ADMIN}")],
                 [("Authorization", f"Bearer {ADMIN}"), ("Authorization", f"Bearer {key}")],
                 [("Authorization", f"Bearer {key}"), ("Authorization", f"Bearer {key}")]]
        for method, path in routes:
            for headers in pairs:
                body = chat() if path.endswith("/chat/completions") else {"model": "m", "prompt": "hi"}
                r = await client.request(method, path, headers=headers, json=body if method == "POST" else None)
                assert r.status_code == 400, (method, path, r.status_code, r.text)
                err = assert_openai_error_shape(r)
                assert err["type"] == "invalid_request_error" and err["code"] == "duplicate_authorization_header"
                assert "2 Authorization headers" in err["message"]
        bad_json = await client.post("/v1/chat/completions", content=b"{not json", headers=pairs[0])
        assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "duplicate_authorization_header"
        assert backend.requests == []
        ok = await client.post("/v1/chat/completions", json=chat(), headers=bearer(key))
        assert ok.status_code == 200 and len(backend.requests) == 1  # one header: served
        await app.state.records.flush()
        async with app.state.sessionmaker() as s:
            rows = (await crud_records.query_records(s, limit=1000))[0]
        assert [r.id for r in rows] == [ok.json()["id"]]
