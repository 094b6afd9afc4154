"""Live state of every replica, for the admin API (``GET /admin/v1/live``) and UI.

Each replica keeps its live state in memory: admitted requests and waiters per tenant
(:class:`gateway.tenancy.admission.AdmissionController`) and the requests that finished in
the last :data:`WINDOW_S` seconds (:class:`gateway.observability.stats.RollingStats`). With
``SPARKGATE_REDIS_URL`` a :class:`LiveState` publishes that replica's :func:`snapshot` every
``every_s`` seconds to the Redis key ``<prefix>replica:<replica id>`` (a JSON string that
expires after ``ttl_s`` seconds, so a dead replica drops out within ``ttl_s``; a drained one
deletes its key when it stops). :meth:`LiveState.gather` reads every live replica's key and
:func:`merge` adds them up: running and waiting requests per tenant are summed, per-user
tok/s is the median over all replicas' per-request decode speeds (the definition in
:mod:`gateway.observability.stats`), per-user aggregate tok/s is the summed completion tokens
over the window, SLA attainment is met / graded over all replicas (weighted by requests).
Without Redis, or while Redis fails, it is this replica's snapshot alone (``degraded`` says
which).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections import Counter

from gateway.observability.stats import user_tokens_per_s

log = logging.getLogger(__name__)

WINDOW_S = 60.0  # seconds of finished requests behind the live per-user tok/s and SLA attainment


def default_replica_id() -> str:
    """``<hostname>-<pid>-<4 hex>``: unique per process, readable in logs."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


def snapshot(replica_id: str, admission, stats, window_s: float = WINDOW_S) -> dict:
    """This replica's live state (JSON-able): ``running``/``waiting`` {tenant: requests},
    ``users`` (:meth:`RollingStats.per_user` over ``window_s`` seconds), ``at`` (Unix s)."""
    waiting = Counter(w.tenant for w in admission._waiters if not w.future.done())
    waiting.update(admission.lease_waiting)
    return {
        "replica": replica_id, "pid": os.getpid(), "at": time.time(), "window_s": window_s,
        "running": {t: n for t, n in admission.tenant_active.items() if n},
        "waiting": {t: n for t, n in waiting.items() if n},
        "users": stats.per_user(window_s),
    }


def merge(snapshots: list[dict], window_s: float = WINDOW_S) -> dict:
    """Sum of several replicas' snapshots (module docstring)."""
    running: Counter = Counter()
    waiting: Counter = Counter()
    users: dict[tuple, dict] = {}
    for snap in snapshots:
        running.update(snap.get("running", {}))
        waiting.update(snap.get("waiting", {}))
        for u in snap.get("users", []):
            m = users.setdefault((u["tenant"], u["user"]), {
                "tenant": u["tenant"], "user": u["user"], "requests": 0, "completion_tokens": 0, "rates": [],
                "sla_graded": 0, "sla_met": 0})
            m["requests"] += u["requests"]
            m["completion_tokens"] += u["completion_tokens"]
            m["rates"] += u["decode_rates"]
            m["sla_graded"] += u["sla_graded"]
            m["sla_met"] += u["sla_met"]
    out_users = []
    for (_, _), m in sorted(users.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        rates = m.pop("rates")
        out_users.append({**m, "tokens_per_s": user_tokens_per_s(rates),
                          "aggregate_tokens_per_s": m["completion_tokens"] / window_s,
                          "sla_attainment": m["sla_met"] / m["sla_graded"] if m["sla_graded"] else None})
    graded, met = sum(u["sla_graded"] for u in out_users), sum(u["sla_met"] for u in out_users)
    return {
        "window_s": window_s,
        "replicas": [{"replica": s["replica"], "pid": s.get("pid"), "at": s.get("at"),
                      "running": sum(s.get("running", {}).values()), "waiting": sum(s.get("waiting", {}).values())}
                     for s in sorted(snapshots, key=lambda s: s["replica"])],
        "running": dict(running), "waiting": dict(waiting),
        "running_total": sum(running.values()), "waiting_total": sum(waiting.values()),
        "users": out_users,
        "sla": {"graded": graded, "met": met, "attainment": met / graded if graded else None},
    }


class LiveState:
    """Publishes this replica's snapshot to Redis and gathers all replicas' (module
    docstring). ``client``: a ``redis.asyncio`` client or None (single process)."""

    def __init__(self, admission, stats, replica_id: str, client=None, prefix: str = "sparkgate:",
                 every_s: float = 1.0, ttl_s: float = 5.0):
        self.admission, self.stats = admission, stats
        self.replica_id = replica_id
        self.client = client
        self.prefix = prefix
        self.every_s, self.ttl_s = every_s, ttl_s
        self.errors = 0
        self._task: asyncio.Task | None = None

    @property
    def key(self) -> str:
        return f"{self.prefix}replica:{self.replica_id}"

    def local(self) -> dict:
        return snapshot(self.replica_id, self.admission, self.stats)

    async def publish(self) -> None:
        await self.client.set(self.key, json.dumps(self.local()), px=int(self.ttl_s * 1000))

    def _failed(self, exc: BaseException) -> None:
        self.errors += 1
        if self.errors == 1 or self.errors % 100 == 0:
            log.warning("live-state store failed (%d times); the admin API shows this replica only: %r",
                        self.errors, exc)

    async def gather(self) -> tuple[list[dict], bool]:
        """``(snapshots of all live replicas, degraded)``; this replica's is always fresh."""
        mine = self.local()
        if self.client is None:
            return [mine], False
        try:
            keys = [k async for k in self.client.scan_iter(f"{self.prefix}replica:*", count=100)]
            values = await self.client.mget(keys) if keys else []
        except Exception as exc:  # noqa: BLE001 — Redis down: this replica alone
            self._failed(exc)
            return [mine], True
        snaps = [mine]
        for v in values:
            if v is None:
                continue
            snap = json.loads(v)
            if snap.get("replica") != self.replica_id:
                snaps.append(snap)
        return snaps, False

    async def alive(self, replica_id: str) -> bool:
        """Whether ``replica_id`` published its snapshot within ``ttl_s`` (raises if Redis fails)."""
        return replica_id == self.replica_id or bool(await self.client.exists(f"{self.prefix}replica:{replica_id}"))

    async def _run(self) -> None:
        while True:
            try:
                await self.publish()
            except Exception as exc:  # noqa: BLE001
                self._failed(exc)
            await asyncio.sleep(self.every_s)

    def start(self) -> None:
        if self.client is not None and self._task is None:
            self._task = asyncio.create_task(self._run(), name="live-state")

    async def stop(self) -> None:
        """Stop publishing and remove this replica's key (it is no longer live)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            self._task = None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.client.delete(self.key), 1.0)
