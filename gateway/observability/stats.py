"""Throughput definitions shared by the gateway, metrics and benchmarks.

* Per-request decode speed: :func:`runtime.interface.decode_tokens_per_s`
  = (completion_tokens − 1) / (t_last_token − t_first_token), tok/s (the one definition).
* User tok/s over a window: the **median** of the per-request decode speeds of the
  requests that finished in the window (:func:`user_tokens_per_s`); this is what an
  SLA tier's ``min tok/s per user`` is compared with.
* Aggregate tok/s: completion tokens produced / wall-clock seconds
  (:func:`aggregate_tokens_per_s`).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable

from runtime.interface import Finished, decode_tokens_per_s

__all__ = ["decode_tokens_per_s", "user_tokens_per_s", "aggregate_tokens_per_s", "RollingStats", "WindowStats"]


def user_tokens_per_s(per_request: Iterable[float | None]) -> float | None:
    """Median of per-request decode tok/s; ``None`` entries (requests with < 2 tokens)
    are skipped. Returns None if nothing is left."""
    rates = [r for r in per_request if r is not None]
    return statistics.median(rates) if rates else None


def aggregate_tokens_per_s(total_tokens: int, wall_s: float) -> float | None:
    """``total_tokens / wall_s`` (tok/s); None when ``wall_s`` is not positive."""
    return total_tokens / wall_s if wall_s > 0 else None


@dataclass(frozen=True)
class WindowStats:
    """Throughput of the requests that finished in the last ``window_s`` seconds."""

    window_s: float
    requests: int
    completion_tokens: int
    user_tokens_per_s: float | None
    aggregate_tokens_per_s: float | None


@dataclass(frozen=True)
class _Record:
    t_end: float
    completion_tokens: int
    decode_tokens_per_s: float | None
    tenant: str | None
    user: str | None = None
    sla_met: bool | None = None  # None: no SLA target or no decode speed


class RollingStats:
    """Finished requests of the last ``horizon_s`` seconds (monotonic clock), queryable
    over any shorter window. Not thread-safe; use from the event loop."""

    def __init__(self, horizon_s: float = 600.0, clock=time.monotonic):
        self.horizon_s = horizon_s
        self._clock = clock
        self._t0 = clock()
        self._records: deque[_Record] = deque()

    def request_ended(self, outcome) -> None:
        """:class:`gateway.observability.observe.RequestObserver` hook: record finished requests."""
        if outcome.status == "finished":
            tps, target = outcome.decode_tokens_per_s, getattr(outcome.ctx, "sla_target_tokens_per_s", None)
            met = None if tps is None or target is None else tps >= target
            self._append(outcome.completion_tokens, tps, outcome.ctx.tenant, getattr(outcome.ctx, "user", None), met)

    def record(self, finished: Finished, tenant: str | None = None) -> None:
        self._append(finished.completion_tokens, finished.decode_tokens_per_s, tenant)

    def _append(self, completion_tokens: int, tokens_per_s: float | None, tenant: str | None,
                user: str | None = None, sla_met: bool | None = None) -> None:
        now = self._clock()
        self._records.append(_Record(now, completion_tokens, tokens_per_s, tenant, user, sla_met))
        while self._records and self._records[0].t_end < now - self.horizon_s:
            self._records.popleft()

    def window(self, window_s: float, tenant: str | None = None) -> WindowStats:
        """Stats over the last ``window_s`` seconds (or since start, if shorter),
        optionally for one tenant."""
        now = self._clock()
        recs = [r for r in self._records
                if r.t_end >= now - window_s and (tenant is None or r.tenant == tenant)]
        tokens = sum(r.completion_tokens for r in recs)
        wall = min(window_s, now - self._t0)
        return WindowStats(
            window_s=window_s,
            requests=len(recs),
            completion_tokens=tokens,
            user_tokens_per_s=user_tokens_per_s(r.decode_tokens_per_s for r in recs),
            aggregate_tokens_per_s=aggregate_tokens_per_s(tokens, wall),
        )

    def per_user(self, window_s: float, max_rates: int = 256) -> list[dict]:
        """Per (tenant, user) over the last ``window_s`` seconds: ``requests``,
        ``completion_tokens``, ``decode_rates`` (the latest ``max_rates`` per-request decode
        tok/s, so several replicas' medians can be merged exactly), ``sla_graded`` and
        ``sla_met`` (finished requests with an SLA target and a decode speed / meeting it)."""
        now = self._clock()
        out: dict[tuple, dict] = {}
        for r in self._records:
            if r.t_end < now - window_s:
                continue
            u = out.setdefault((r.tenant or "", r.user or ""), {
                "tenant": r.tenant or "", "user": r.user or None, "requests": 0, "completion_tokens": 0,
                "decode_rates": [], "sla_graded": 0, "sla_met": 0})
            u["requests"] += 1
            u["completion_tokens"] += r.completion_tokens
            if r.decode_tokens_per_s is not None:
                u["decode_rates"].append(round(r.decode_tokens_per_s, 3))
            if r.sla_met is not None:
                u["sla_graded"] += 1
                u["sla_met"] += r.sla_met
        for u in out.values():
            u["decode_rates"] = u["decode_rates"][-max_rates:]
        return list(out.values())
