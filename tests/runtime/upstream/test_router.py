"""The generic :class:`runtime.upstream.router.UpstreamRouter`: API keys per upstream, probes
that send them, ejection and rejoin, and the label its errors carry (the SGLang flavour is
tested in tests/runtime/sglang/test_router.py)."""

from __future__ import annotations

import httpx
import pytest

from runtime.upstream.router import NoHealthyUpstream, UpstreamRouter
from tests.support.openai_upstream import UpstreamServer
from tests.support.sglang_standin import closed_port_url


def test_api_keys_none_one_or_one_per_url():
    assert [u.headers for u in UpstreamRouter(["http://a", "http://b"]).upstreams] == [{}, {}]
    assert [u.api_key for u in UpstreamRouter(["http://a", "http://b"], api_keys=["k"]).upstreams] == ["k", "k"]
    r = UpstreamRouter(["http://a", "http://b"], api_keys=["ka", "kb"])
    assert [u.headers for u in r.upstreams] == [{"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}]
    with pytest.raises(ValueError, match="3 API keys for 2 vLLM URLs"):
        UpstreamRouter(["http://a", "http://b"], api_keys=["1", "2", "3"], label="vLLM")


def test_no_healthy_upstream_names_the_label_and_the_reasons():
    r = UpstreamRouter(["http://a"], label="OpenAI-compatible")
    r.mark_down(r.upstreams[0], "/health: HTTP 503")
    with pytest.raises(NoHealthyUpstream, match=r"no healthy OpenAI-compatible upstream: http://a \(/health: HTTP 503\)"):
        r.pick()


async def test_probes_send_the_key_eject_and_rejoin():
    srv = UpstreamServer().start()
    try:
        r = UpstreamRouter([srv.url, closed_port_url()], api_keys=["sk-1", "sk-2"], health_path="health")
        async with httpx.AsyncClient() as client:
            assert await r.check_all(client) == 1
            up, down = r.upstreams
            assert up.healthy and not down.healthy and "ConnectError" in down.last_error
            assert srv.fake.health_auth == ["Bearer sk-1"]
            srv.fake.healthy = False
            assert await r.check(client, up) is False and up.last_error == "/health: HTTP 503"
            assert up.failures == 1
            srv.fake.healthy = True
            assert await r.check(client, up) is True and up.failures == 0 and up.last_error is None
    finally:
        srv.stop()
