"""Several upstream servers behind one backend: health checks, ejection and rejoin, and
least-outstanding-requests routing.

Used by every backend that streams from remote servers (the SGLang client,
:mod:`runtime.sglang.router` adds SGLang's load report; the OpenAI-compatible client,
:mod:`runtime.upstream.client`).

Routing: among *healthy* upstreams pick the one with the fewest of *our* in-flight
requests; ties go to the smaller server-reported load (:attr:`Upstream.server_load`, when
a subclass reads one), then to the upstream picked longest ago (round-robin among equals).

Health: ``GET <url><health_path>`` (with the upstream's ``Authorization: Bearer`` key when it
has one) → 200 healthy, anything else (or no answer within ``health_timeout_s``) unhealthy.
A client also ejects an upstream at once when a request cannot connect to it
(:meth:`UpstreamRouter.mark_down`); the next successful probe brings it back
(:meth:`UpstreamRouter.run` probes every upstream periodically, ejected ones included).

The router is not tied to a particular client: every probe takes an ``httpx.AsyncClient``.
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
    """One upstream server.

    Attributes:
        url: base URL without trailing slash, e.g. ``http://10.0.0.5:30000``.
        api_key: sent as ``Authorization: Bearer`` to this server (``None``: no header).
        healthy: last known health (requests go only to healthy upstreams).
        in_flight: our requests currently streaming from it.
        served: requests routed to it since start.
        failures: consecutive failed probes/connections.
        last_error: text of the last failure.
        last_check: ``time.monotonic()`` of the last probe; ``None`` before the first.
        server_running, server_waiting, server_max_running: the server's own report of its
            running and waiting requests and of its batch limit, when a router subclass
            reads one (SGLang's ``/v1/loads``); ``None`` when unknown.
    """

    url: str
    api_key: str | None = None
    healthy: bool = True
    in_flight: int = 0
    served: int = 0
    failures: int = 0
    last_error: str | None = None
    last_check: float | None = None
    server_running: int | None = None
    server_waiting: int | None = None
    server_max_running: int | None = None
    _last_pick: int = field(default=-1, repr=False)

    @property
    def server_load(self) -> int | None:
        if self.server_running is None:
            return None
        return self.server_running + (self.server_waiting or 0)

    @property
    def headers(self) -> dict[str, str]:
        """``{"Authorization": "Bearer <api_key>"}``, or ``{}`` without a key."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


class UpstreamRouter:
    """Least-outstanding routing with health checks over a fixed list of URLs.

    Args:
        urls: base URLs (at least one; duplicates rejected).
        api_keys: ``()`` (no key), one key for every URL, or one per URL (in order).
        health_path: the servers' health endpoint (``/health``; ``/v1/models`` for servers
            without one).
        health_timeout_s: per-probe timeout (seconds).
        label: what the servers are called in log lines and errors (``"SGLang"``).

    Raises:
        ValueError: empty or duplicate URLs; a number of keys that is neither 0, 1 nor
            ``len(urls)``.
    """

    def __init__(self, urls: Sequence[str], *, api_keys: Sequence[str | None] = (), health_path: str = "/health",
                 health_timeout_s: float = 25.0, label: str = "upstream") -> None:
        cleaned = [u.rstrip("/") for u in urls]
        if not cleaned:
            raise ValueError(f"at least one {label} URL is required")
        if len(set(cleaned)) != len(cleaned):
            raise ValueError(f"duplicate {label} URLs in {list(urls)}")
        keys = list(api_keys)
        if len(keys) == 1:
            keys *= len(cleaned)
        elif not keys:
            keys = [None] * len(cleaned)
        elif len(keys) != len(cleaned):
            raise ValueError(f"{len(keys)} API keys for {len(cleaned)} {label} URLs: give one key, or one per URL")
        self.upstreams = [Upstream(u, api_key=k or None) for u, k in zip(cleaned, keys)]
        self.health_path = health_path if health_path.startswith("/") else "/" + health_path
        self.health_timeout_s = health_timeout_s
        self.label = label
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
            raise NoHealthyUpstream(f"no healthy {self.label} upstream: " + ", ".join(reasons))
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
        """Eject ``upstream`` from rotation until a health probe succeeds."""
        if upstream.healthy:
            log.warning("%s upstream %s marked unhealthy: %s", self.label, upstream.url, reason)
        upstream.healthy = False
        upstream.failures += 1
        upstream.last_error = reason

    def mark_up(self, upstream: Upstream) -> None:
        if not upstream.healthy:
            log.info("%s upstream %s is healthy again", self.label, upstream.url)
        upstream.healthy = True
        upstream.failures = 0
        upstream.last_error = None

    # -- probes -------------------------------------------------------------------
    async def check(self, client: httpx.AsyncClient, upstream: Upstream) -> bool:
        """Probe one upstream (then :meth:`after_healthy_probe`); updates and returns its health."""
        upstream.last_check = time.monotonic()
        try:
            resp = await client.get(upstream.url + self.health_path, timeout=self.health_timeout_s,
                                    headers=upstream.headers)
        except (httpx.HTTPError, OSError) as exc:
            self.mark_down(upstream, f"{self.health_path}: {type(exc).__name__}: {exc}")
            return False
        if resp.status_code != 200:
            self.mark_down(upstream, f"{self.health_path}: HTTP {resp.status_code}")
            return False
        self.mark_up(upstream)
        await self.after_healthy_probe(client, upstream)
        return True

    async def after_healthy_probe(self, client: httpx.AsyncClient, upstream: Upstream) -> None:
        """Hook for subclasses: read more from a server that just answered its probe
        (SGLang: its load report). Must not raise for a server that does not answer."""

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
                log.exception("%s health check round failed", self.label)
