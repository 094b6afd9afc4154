"""SGLangRouter (runtime.upstream.router.UpstreamRouter + /v1/loads): pick order (in-flight, then server load, then round-robin), health
probes marking upstreams out and back in, /v1/loads parsing, the periodic loop."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from runtime.sglang.router import SGLangRouter as UpstreamRouter
from runtime.upstream.router import NoHealthyUpstream
from tests.support.polling import async_wait_until
from tests.support.sglang_standin import StandinServer, closed_port_url


def test_rejects_empty_and_duplicate_urls():
    with pytest.raises(ValueError):
        UpstreamRouter([])
    with pytest.raises(ValueError, match="duplicate"):
        UpstreamRouter(["http://a:1/", "http://a:1"])


def test_pick_prefers_fewest_in_flight_then_server_load_then_round_robin():
    r = UpstreamRouter(["http://a", "http://b", "http://c"])
    a, b, c = r.upstreams
    a.in_flight, b.in_flight, c.in_flight = 2, 1, 1
    b.server_running, b.server_waiting = 5, 3
    c.server_running, c.server_waiting = 5, 0
    assert r.pick() is c  # b and c tie on in-flight; c has less server load
    c.server_waiting = 3
    picks = [r.pick().url for _ in range(4)]  # full tie b/c: alternate
    assert picks == ["http://b", "http://c", "http://b", "http://c"]
    assert r.pick(exclude=[b, c]) is a


def test_unhealthy_upstreams_are_skipped():
    r = UpstreamRouter(["http://a", "http://b"])
    a, b = r.upstreams
    r.mark_down(a, "boom")
    assert [r.pick() for _ in range(3)] == [b, b, b]
    r.mark_down(b, "bang")
    with pytest.raises(NoHealthyUpstream, match="boom"):
        r.pick()
    r.mark_up(a)
    assert r.pick() is a and a.failures == 0 and a.last_error is None


def test_acquire_release_counts():
    r = UpstreamRouter(["http://a"])
    (a,) = r.upstreams
    r.acquire(a)
    r.acquire(a)
    r.release(a)
    assert (a.in_flight, a.served) == (1, 2)
    r.release(a)
    r.release(a)
    assert a.in_flight == 0


async def test_probes_mark_out_and_back_in_and_read_loads():
    srv = StandinServer().start()
    try:
        srv.standin.waiting, srv.standin.max_running = 2, 32
        r = UpstreamRouter([srv.url, closed_port_url()], health_path="/health_generate")
        async with httpx.AsyncClient() as client:
            assert await r.check_all(client) == 1
            up, down = r.upstreams
            assert up.healthy and (up.server_running, up.server_waiting, up.server_max_running) == (0, 2, 32)
            assert not down.healthy and "ConnectError" in down.last_error
            srv.standin.healthy = False
            assert await r.check_all(client) == 0
            assert "HTTP 503" in up.last_error
            srv.standin.healthy = True
            task = asyncio.create_task(r.run(client, 0.02))  # the periodic loop restores it
            await async_wait_until(lambda: up.healthy, "the periodic check restored the upstream")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert up.healthy and srv.standin.health_checks >= 3
    finally:
        srv.stop()
