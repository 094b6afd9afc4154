"""Several SGLang upstreams: health checks and least-loaded routing.

Routing: among *healthy* upstreams pick the one with the fewest of *our* in-flight
requests; ties go to the smaller server-reported load (``num_running_reqs +
num_waiting_reqs`` from ``GET /v1/loads?include=core``, SGLang 0.5.23
``srt/entrypoints/v1_loads.py``; ignored when unknown), then to the upstream picked
longest ago (round-robin among equals).

Health: ``GET <url><health_path>`` → 200 healthy, anything else (or no answer within
``health_timeout_s``) unhealthy. In 0.5.23 both ``/health`` and ``/health_generate``
(``srt/entrypoints/http_server.py``) return 503 while the server starts or shuts down
and, by default (``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=1``), run a 1-token
generation that takes ≥ 1 s (it polls once per second, up to 20 s). The client also
marks an upstream unhealthy at once when a request cannot connect to it; the next
successful health check brings it back.

The router is not tied to a particular client: every probe takes an
``httpx.AsyncClient``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import httpx

log = logging.getLogger(__name__)


class NoHealthyUpstream(RuntimeError):
    """No upstream is healthy (or all were excluded)."""


@dataclass
class Upstream:
    """One SGLang server.

    Attributes:
        url: base URL without trailing slash, e.g. ``http://10.0.0.5:30000``.
        healthy: last known health (requests go only to healthy upstreams).
        in_flight: our requests currently streaming from it.
        served: requests routed to it since start.
        failures: consecutive failed probes/connections.
        last_error: text of the last failure.
        last_check: ``time.monotonic()`` of the last probe; ``None`` before the first.
        server_running, server_waiting, server_max_running: summed over DP ranks from
            ``/v1/loads`` (``num_running_reqs``, ``num_waiting_reqs``,
            ``max_running_requests``); ``None`` when unknown.
    """

    url: str
    healthy: bool = True
    in_flight: int = 0
    served: int = 0
    failures: int = 0
    last_error: str | None = None
    last_check: float | None = None
    server_running: int | None = None
    server_waiting: int | None = None
    server_max_running: int | None = None
    loads_supported: bool = True
    _last_pick: int = field(default=-1, repr=False)

    @property
    def server_load(self) -> int | None:
        if self.server_running is None:
            return None
        return self.server_running + (self.server_waiting or 0)


class UpstreamRouter:
    """Least-loaded routing with health checks over a fixed list of SGLang URLs.

    Args:
        urls: base URLs (at least one; duplicates rejected).
        health_path: ``/health`` (default) or ``/health_generate``.
        health_timeout_s: per-probe timeout (seconds); SGLang's own limit is 20 s.
        poll_loads: also read ``/v1/loads?include=core`` after a healthy probe.

    Raises:
        ValueError: empty or duplicate URLs.
    """

    def __init__(self, urls: Sequence[str], *, health_path: str = "/health",
                 health_timeout_s: float = 25.0, poll_loads: bool = True) -> None:
        cleaned = [u.rstrip("/") for u in urls]
        if not cleaned:
            raise ValueError("at least one SGLang URL is required")
        if len(set(cleaned)) != len(cleaned):
            raise ValueError(f"duplicate SGLang URLs in {list(urls)}")
        self.upstreams = [Upstream(u) for u in cleaned]
        self.health_path = health_path if health_path.startswith("/") else "/" + health_path
        self.health_timeout_s = health_timeout_s
        self.poll_loads = poll_loads
        self._picks = itertools.count()

    # -- routing ------------------------------------------------------------------
    def healthy(self) -> list[Upstream]:
        return [u for u in self.upstreams if u.healthy]

    def pick(self, exclude: Iterable[Upstream] = ()) -> Upstream:
        """The healthy upstream to use next (see module docstring for the order).

        Raises:
            NoHealthyUpstream: none is healthy outside ``exclude``.
        """
        skip = {id(u) for u in exclude}
        candidates = [u for u in self.upstreams if u.healthy and id(u) not in skip]
        if not candidates:
            reasons = [f"{u.url} ({'already tried' if u.healthy else u.last_error or 'unhealthy'})"
                       for u in self.upstreams]
            raise NoHealthyUpstream("no healthy SGLang upstream: " + ", ".join(reasons))
        best = min(candidates, key=lambda u: (
            u.in_flight,
            u.server_load if u.server_load is not None else 0,
            u._last_pick,
        ))
        best._last_pick = next(self._picks)
        return best

    def acquire(self, upstream: Upstream) -> None:
        """Count a request as in flight on ``upstream``."""
        upstream.in_flight += 1
        upstream.served += 1

    def release(self, upstream: Upstream) -> None:
        upstream.in_flight = max(0, upstream.in_flight - 1)

    def mark_down(self, upstream: Upstream, reason: str) -> None:
        """Take ``upstream`` out of rotation until a health probe succeeds."""
        if upstream.healthy:
            log.warning("SGLang upstream %s marked unhealthy: %s", upstream.url, reason)
        upstream.healthy = False
        upstream.failures += 1
        upstream.last_error = reason

    def mark_up(self, upstream: Upstream) -> None:
        if not upstream.healthy:
            log.info("SGLang upstream %s is healthy again", upstream.url)
        upstream.healthy = True
        upstream.failures = 0
        upstream.last_error = None

    # -- probes -------------------------------------------------------------------
    async def check(self, client: httpx.AsyncClient, upstream: Upstream) -> bool:
        """Probe one upstream (health, then loads); updates and returns its health."""
        upstream.last_check = time.monotonic()
        try:
            resp = await client.get(upstream.url + self.health_path, timeout=self.health_timeout_s)
        except (httpx.HTTPError, OSError) as exc:
            self.mark_down(upstream, f"{self.health_path}: {type(exc).__name__}: {exc}")
            return False
        if resp.status_code != 200:
            self.mark_down(upstream, f"{self.health_path}: HTTP {resp.status_code}")
            return False
        self.mark_up(upstream)
        if self.poll_loads and upstream.loads_supported:
            await self._read_loads(client, upstream)
        return True

    async def _read_loads(self, client: httpx.AsyncClient, upstream: Upstream) -> None:
        try:
            resp = await client.get(upstream.url + "/v1/loads", params={"include": "core"},
                                    timeout=self.health_timeout_s)
        except (httpx.HTTPError, OSError):
            return
        if resp.status_code == 404:
            upstream.loads_supported = False  # older server: stop asking
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

    async def check_all(self, client: httpx.AsyncClient) -> int:
        """Probe every upstream concurrently; returns the number of healthy ones."""
        results = await asyncio.gather(*(self.check(client, u) for u in self.upstreams))
        return sum(results)

    async def run(self, client: httpx.AsyncClient, interval_s: float) -> None:
        """Probe all upstreams every ``interval_s`` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.check_all(client)
            except Exception:  # noqa: BLE001 — the loop must survive
                log.exception("SGLang health check round failed")
