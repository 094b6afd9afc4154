"""Hardening, soak (CI version of ``bench/soak.py``): 16 concurrent streaming clients for
15 s against the shared live server (real model), 10 % cut mid-stream. 0 server errors,
engine back to idle, one request record per request (cut ones cancelled), RSS growth
bounded. The 64-client × 60 s run is ``python bench/soak.py`` (docs/reliability.md)."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.hardening_util import load_bench

pytestmark = pytest.mark.model


def test_soak_16_clients_15s(live_server):
    soak = load_bench("soak")
    res = asyncio.run(soak.run_soak(live_server.base_url, live_server.admin_token, clients=16, duration_s=15,
                                    disconnect_p=0.10, pid=live_server.proc.pid, seed=1))
    print({k: v for k, v in vars(res).items() if k != "error_samples"}, res.error_samples[:3])
    assert res.failures == [], (res.failures, res.error_samples[:5])
    assert res.server_errors == res.sse_errors == res.transport_errors == 0
    assert res.sent >= 16 and res.completed >= 8 and res.statuses == {200: res.sent}
    assert res.engine_after["running"] == 0 and res.engine_after["waiting"] == 0
    assert res.records == res.sent + 1 and res.records_missing == 0 and res.records_wrong_status == 0
    assert res.records_by_status.get("cancelled", 0) >= 1 if res.disconnected else True
    assert res.rss_growth_mib is not None and res.rss_growth_mib < 200, res.rss_growth_mib
