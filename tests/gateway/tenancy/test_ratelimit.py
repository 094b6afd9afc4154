"""Token buckets (local and Redis), OpenAI rate-limit headers and 429 bodies."""

from __future__ import annotations

import math
import uuid

import pytest

from gateway.core.errors import APIError
from gateway.tenancy.ratelimit import (
    REQUESTS, TOKENS, Limit, LocalBucketStore, RateLimiter, RedisBucketStore, format_reset,
)


def clocked():
    now = [0.0]
    return now, LocalBucketStore(clock=lambda: now[0])


async def test_bucket_burst_then_refill_per_minute():
    now, store = clocked()
    for i in range(120):  # 120 requests/min: a full burst of 120
        st = await store.apply("k", 120, 1, "take")
        assert st.allowed and st.remaining == 119 - i
    st = await store.apply("k", 120, 1, "take")
    assert not st.allowed and st.retry_after_s(1) == pytest.approx(0.5)  # refill 2/s
    assert st.reset_s == pytest.approx(60.0)
    now[0] = 0.5
    assert (await store.apply("k", 120, 1, "take")).allowed
    now[0] = 100.0
    st = await store.apply("k", 120, 0, "peek")
    assert st.remaining == 120 and st.reset_s == 0  # capped at the capacity
    st = await store.apply("k", 120, 50, "give")
    assert st.remaining == 120  # refunds never exceed the capacity


def test_format_reset_like_openai():
    assert [format_reset(s) for s in (0.0, 0.017, 1.0, 1.5, 59.25, 360.0, 61.0)] == [
        "0ms", "17ms", "1s", "1.5s", "59.25s", "6m0s", "1m1s"]


async def test_limiter_is_all_or_nothing_and_reports_the_tightest_limit():
    lim = RateLimiter()
    limits = [Limit("key:1", REQUESTS, 10), Limit("tenant:acme", REQUESTS, 100),
              Limit("key:1", TOKENS, 1000), Limit("tenant:acme", TOKENS, 600)]
    g = await lim.acquire(limits, 400)
    assert g.headers()["x-ratelimit-limit-requests"] == "10" and g.headers()["x-ratelimit-remaining-requests"] == "9"
    assert g.headers()["x-ratelimit-limit-tokens"] == "600" and g.headers()["x-ratelimit-remaining-tokens"] == "200"
    assert g.headers()["x-ratelimit-reset-tokens"] == "40s"  # 400 tokens at 10/s
    with pytest.raises(APIError) as e:
        await lim.acquire(limits, 400)  # the tenant has 200 tokens left
    err = e.value
    assert err.status == 429 and err.type == "tokens" and err.code == "rate_limit_exceeded"
    assert err.headers["Retry-After"] == "20" and "tenant acme" in err.message and "TPM" in err.message
    assert err.headers["x-ratelimit-remaining-tokens"] == "200"
    # nothing was kept from the refused request: the key still has 9 requests
    assert lim.local.apply_now("key:1:requests", 10, 0, "peek").remaining == pytest.approx(9, abs=0.01)
    await g.settle(150)  # used 150 of 400: 250 back to both token buckets
    await g.settle(0)  # settling twice refunds once
    assert lim.local.apply_now("tenant:acme:tokens", 600, 0, "peek").remaining == pytest.approx(450, abs=1)
    with pytest.raises(APIError) as e:
        await lim.acquire(limits, 5000)  # larger than the per-minute limit: retrying cannot help
    assert "Request too large" in e.value.message and e.value.type == "tokens"


async def test_redis_buckets_are_shared_between_replicas(redis_url):
    prefix = f"test:{uuid.uuid4().hex}:"
    a, b = RedisBucketStore(redis_url, prefix), RedisBucketStore(redis_url, prefix)
    try:
        replica_a, replica_b = RateLimiter(a), RateLimiter(b)
        limits = [Limit("tenant:acme", REQUESTS, 3)]
        await replica_a.acquire(limits, 0)
        await replica_b.acquire(limits, 0)
        g = await replica_a.acquire(limits, 0)
        assert g.headers()["x-ratelimit-remaining-requests"] == "0"
        with pytest.raises(APIError) as e:
            await replica_b.acquire(limits, 0)
        assert e.value.type == "requests" and e.value.headers["Retry-After"] == "20"
        tok = [Limit("tenant:acme", TOKENS, 600)]
        g = await replica_a.acquire(tok, 500)
        await g.settle(100)  # refund 400 through Redis
        st = await b.apply("tenant:acme:tokens", 600, 0, "peek")
        assert st.remaining == pytest.approx(500, abs=2) and replica_a.store_errors == 0
        ttl = await a.client.pttl(prefix + "tenant:acme:tokens")
        assert 0 < ttl <= 61_000
    finally:
        await a.client.delete(*[k async for k in a.client.scan_iter(prefix + "*")])
        await a.close()
        await b.close()


async def test_redis_down_falls_back_to_local_buckets():
    lim = RateLimiter(RedisBucketStore("redis://127.0.0.1:1/0", timeout_s=0.2))
    g = await lim.acquire([Limit("tenant:x", REQUESTS, 2)], 0)
    assert g.headers()["x-ratelimit-remaining-requests"] == "1" and lim.store_errors == 1
    await lim.acquire([Limit("tenant:x", REQUESTS, 2)], 0)
    with pytest.raises(APIError):
        await lim.acquire([Limit("tenant:x", REQUESTS, 2)], 0)
    assert math.isinf(lim.local.apply_now("tenant:x:requests", 2, 0, "peek").retry_after_s(5))
