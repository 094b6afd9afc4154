"""Several SGLang upstreams: :class:`runtime.upstream.router.UpstreamRouter` (health checks,
ejection and rejoin, least-outstanding routing) plus SGLang's own load report.

After each healthy probe :class:`SGLangRouter` reads ``GET /v1/loads?include=core``
(SGLang 0.5.23 ``srt/entrypoints/v1_loads.py``) and sums over DP ranks
``num_running_reqs``, ``num_waiting_reqs`` and ``max_running_requests`` into the
upstream's ``server_*`` fields, so ties on our in-flight count go to the less loaded
server. A server that answers 404 (older SGLang) is not asked again.

Health: in 0.5.23 both ``/health`` and ``/health_generate`` (``srt/entrypoints/http_server.py``)
return 503 while the server starts or shuts down and, by default
(``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=1``), run a 1-token generation that takes ≥ 1 s
(it polls once per second, up to 20 s), hence the default probe timeout of 25 s.
"""

from __future__ import annotations

import logging
from typing import Sequence

import httpx

from runtime.upstream.router import Upstream, UpstreamRouter

log = logging.getLogger(__name__)


class SGLangRouter(UpstreamRouter):
    """:class:`UpstreamRouter` over SGLang servers (module docstring).

    Args:
        urls: SGLang base URLs.
        health_path: ``/health`` (default) or ``/health_generate``.
        health_timeout_s: per-probe timeout (seconds); SGLang's own limit is 20 s.
        poll_loads: read ``/v1/loads?include=core`` after a healthy probe.
    """

    def __init__(self, urls: Sequence[str], *, health_path: str = "/health",
                 health_timeout_s: float = 25.0, poll_loads: bool = True) -> None:
        super().__init__(urls, health_path=health_path, health_timeout_s=health_timeout_s, label="SGLang")
        self.poll_loads = poll_loads
        self._no_loads: set[str] = set()  # URLs that answered /v1/loads with 404

    async def after_healthy_probe(self, client: httpx.AsyncClient, upstream: Upstream) -> None:
        if self.poll_loads and upstream.url not in self._no_loads:
            await self._read_loads(client, upstream)

    async def _read_loads(self, client: httpx.AsyncClient, upstream: Upstream) -> None:
        try:
            resp = await client.get(upstream.url + "/v1/loads", params={"include": "core"},
                                    timeout=self.health_timeout_s)
        except (httpx.HTTPError, OSError):
            return
        if resp.status_code == 404:
            self._no_loads.add(upstream.url)  # older server: stop asking
            return
        if resp.status_code != 200:
            return
        try:
            loads = resp.json()["loads"]
            upstream.server_running = sum(int(x.get("num_running_reqs", 0)) for x in loads)
            upstream.server_waiting = sum(int(x.get("num_waiting_reqs", 0)) for x in loads)
            upstream.server_max_running = sum(int(x.get("max_running_requests", 0)) for x in loads) or None
        except (ValueError, KeyError, TypeError, AttributeError):
            log.debug("unexpected /v1/loads body from %s", upstream.url)
