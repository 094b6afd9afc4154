"""Requests-per-minute and tokens-per-minute limits as token buckets.

A limit of ``L`` per minute is a bucket of capacity ``L`` refilled continuously at
``L / 60`` per second, so a full burst of ``L`` is allowed and then ``L`` per minute.
Tokens-per-minute buckets are charged ``prompt_tokens + max_tokens`` at admission and
refunded the unused part when the request ends (:meth:`Grant.settle`). Only served
requests count: one refused after its buckets were charged (by the concurrency/SLA
queue or the engine's queue) gets its request and its tokens back, each refund one
atomic bucket operation (one Lua script in Redis), so concurrent replicas never lose
an update; while queued it holds what it took.

Buckets live in a :class:`LocalBucketStore` (per replica: N replicas allow N× the
limit) or, with ``SPARKGATE_REDIS_URL``, in a :class:`RedisBucketStore` shared by all
replicas (one atomic Lua script per operation, Redis ``TIME`` as the clock). If Redis
fails, :class:`RateLimiter` falls back to its local store and logs it; serving never
stops because of the limiter.

Response headers follow OpenAI's rate-limit headers
(https://platform.openai.com/docs/guides/rate-limits, "Rate limits in headers"):
``x-ratelimit-limit-requests``/``-tokens`` (the per-minute limit),
``x-ratelimit-remaining-requests``/``-tokens`` and ``x-ratelimit-reset-requests``/
``-tokens`` (time until the bucket is full again, e.g. ``"1s"``, ``"6m0s"``, ``"17ms"``).
With a key limit and a tenant limit on the same quantity, the headers describe the
one with fewer remaining.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Protocol

from gateway.core.errors import APIError

log = logging.getLogger(__name__)

REQUESTS, TOKENS = "requests", "tokens"


@dataclass(frozen=True)
class BucketState:
    """Result of one bucket operation.

    Attributes:
        allowed: the amount was taken (always True for give/peek).
        remaining: tokens left in the bucket after the operation.
        capacity: the per-minute limit.
        rate_per_s: refill rate, ``capacity / 60`` per second.
    """

    allowed: bool
    remaining: float
    capacity: float
    rate_per_s: float

    @property
    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        return max(0.0, self.capacity - self.remaining) / self.rate_per_s

    def retry_after_s(self, amount: float) -> float:
        """Seconds until ``amount`` would fit (``inf`` if it exceeds the capacity)."""
        if amount > self.capacity:
            return math.inf
        return max(0.0, amount - self.remaining) / self.rate_per_s


class BucketStore(Protocol):
    async def apply(self, key: str, per_minute: float, amount: float, mode: str) -> BucketState:
        """``mode``: ``take`` (only if ``amount`` fits), ``give`` (refund, capped at the
        capacity) or ``peek``."""
        ...


class LocalBucketStore:
    """In-process buckets (one replica). ``clock`` in seconds (monotonic)."""

    def __init__(self, clock=time.monotonic, max_buckets: int = 100_000):
        self._clock = clock
        self._max = max_buckets
        self._buckets: dict[str, tuple[float, float]] = {}  # key → (tokens, last refill time)

    async def apply(self, key: str, per_minute: float, amount: float, mode: str) -> BucketState:
        return self.apply_now(key, per_minute, amount, mode)

    def apply_now(self, key: str, per_minute: float, amount: float, mode: str) -> BucketState:
        cap, rate, now = float(per_minute), per_minute / 60.0, self._clock()
        tokens, ts = self._buckets.get(key, (cap, now))
        tokens = min(cap, tokens + max(0.0, now - ts) * rate)
        allowed = True
        if mode == "take":
            allowed = tokens >= amount
            if allowed:
                tokens -= amount
        elif mode == "give":
            tokens = min(cap, tokens + amount)
        if len(self._buckets) >= self._max and key not in self._buckets:
            self._buckets = {k: v for k, v in self._buckets.items() if v[0] + (now - v[1]) * rate < cap}
        self._buckets[key] = (tokens, now)
        return BucketState(allowed, tokens, cap, rate)


_LUA = """
local cap = tonumber(ARGV[1]); local rate = cap / 60.0
local amt = tonumber(ARGV[2]); local mode = ARGV[3]
local t = redis.call('TIME'); local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local v = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(v[1]); local ts = tonumber(v[2])
if tokens == nil or ts == nil then tokens = cap; ts = now end
tokens = math.min(cap, tokens + math.max(0, now - ts) * rate)
local allowed = 1
if mode == 'take' then
  if tokens >= amt then tokens = tokens - amt else allowed = 0 end
elseif mode == 'give' then
  tokens = math.min(cap, tokens + amt)
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(60000 + 1000))
return {allowed, tostring(tokens)}
"""


class RedisBucketStore:
    """Buckets shared by every replica in Redis (``redis.asyncio``; keys ``<prefix>…``,
    expiring 61 s after their last use, i.e. once they would be full anyway)."""

    def __init__(self, url: str, prefix: str = "sparkgate:rl:", timeout_s: float = 0.25):
        import redis.asyncio as redis

        self.client = redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.prefix = prefix
        self._script = self.client.register_script(_LUA)

    async def apply(self, key: str, per_minute: float, amount: float, mode: str) -> BucketState:
        allowed, tokens = await self._script(keys=[self.prefix + key], args=[per_minute, amount, mode])
        return BucketState(bool(int(allowed)), float(tokens), float(per_minute), per_minute / 60.0)

    async def close(self) -> None:
        await self.client.aclose()


def format_reset(seconds: float) -> str:
    """OpenAI-style duration: ``"17ms"``, ``"1s"``, ``"1.5s"``, ``"6m0s"``."""
    if seconds < 1.0:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    minutes, secs = divmod(seconds, 60.0)
    secs_text = f"{round(secs, 3):g}s"
    return f"{int(minutes)}m{secs_text}" if minutes >= 1 else secs_text


def rate_limited(kind: str, scope: str, limit: float, requested: float, retry_after_s: float) -> APIError:
    """429 like OpenAI: ``type`` is ``"requests"`` or ``"tokens"``, code
    ``rate_limit_exceeded``, integer ``retry-after`` header (seconds, at least 1)."""
    unit = "requests per minute (RPM)" if kind == REQUESTS else "tokens per minute (TPM)"
    if math.isinf(retry_after_s):
        msg = (f"Request too large for {scope}: {unit} limit {int(limit)}, requested {int(requested)}. "
               "Reduce the prompt or max_tokens.")
        retry = 60.0
    else:
        msg = (f"Rate limit reached for {unit} on {scope}: limit {int(limit)}, requested {int(requested)}. "
               f"Please try again in {format_reset(retry_after_s)}.")
        retry = retry_after_s
    return APIError(429, msg, kind, None, "rate_limit_exceeded", {"Retry-After": str(max(1, math.ceil(retry)))})


@dataclass(frozen=True)
class Limit:
    """One per-minute limit on one scope (``"key:12"``, ``"tenant:acme"``)."""

    scope: str
    kind: str  # REQUESTS or TOKENS
    per_minute: float

    @property
    def bucket(self) -> str:
        return f"{self.scope}:{self.kind}"


@dataclass
class Grant:
    """What :meth:`RateLimiter.acquire` took; :meth:`settle` refunds unused tokens once."""

    limiter: RateLimiter
    taken: list[tuple[Limit, float]]
    states: dict[str, BucketState] = field(default_factory=dict)  # kind → tightest state
    reserved_tokens: int = 0
    _settled: bool = False

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for kind, st in self.states.items():
            out[f"x-ratelimit-limit-{kind}"] = str(int(st.capacity))
            out[f"x-ratelimit-remaining-{kind}"] = str(max(0, int(st.remaining)))
            out[f"x-ratelimit-reset-{kind}"] = format_reset(st.reset_s)
        return out

    async def settle(self, used_tokens: int, served: bool = True) -> None:
        """Refund ``reserved_tokens − used_tokens`` to the token buckets and, when the
        request was not ``served`` (refused before the engine ran it), its request to the
        request buckets; :attr:`states` then describe the buckets after the refund.
        Idempotent: only the first call refunds."""
        if self._settled:
            return
        self._settled = True
        unused = self.reserved_tokens - max(0, used_tokens)
        states: dict[str, BucketState] = {}
        for limit, amount in self.taken:
            back = unused if limit.kind == TOKENS else (0 if served else amount)
            if back > 0:
                _keep_tightest(states, limit.kind, await self.limiter._apply(limit, back, "give"))
        if not served:
            self.states.update(states)


def _keep_tightest(states: dict[str, BucketState], kind: str, state: BucketState) -> None:
    """Keep in ``states[kind]`` the state with the fewest tokens remaining."""
    best = states.get(kind)
    if best is None or state.remaining < best.remaining:
        states[kind] = state


class RateLimiter:
    """Checks several :class:`Limit` s at once: all are taken or none (a refused request
    costs nothing). Falls back to a local store when the shared store fails.
    ``clock``: the local store's clock (seconds, monotonic; tests inject a fake one)."""

    def __init__(self, store: BucketStore | None = None, clock=time.monotonic):
        self.local = LocalBucketStore(clock)
        self.store = store or self.local
        self.store_errors = 0  # shared-store failures (served from the local store instead)

    async def _apply(self, limit: Limit, amount: float, mode: str) -> BucketState:
        if self.store is not self.local:
            try:
                return await self.store.apply(limit.bucket, limit.per_minute, amount, mode)
            except Exception as exc:  # noqa: BLE001 — Redis down: keep serving on local buckets
                self.store_errors += 1
                if self.store_errors == 1 or self.store_errors % 1000 == 0:
                    log.warning("rate-limit store failed (%d times), using local buckets: %r", self.store_errors, exc)
        return self.local.apply_now(limit.bucket, limit.per_minute, amount, mode)

    async def acquire(self, limits: list[Limit], tokens: int) -> Grant:
        """Take 1 from every request limit and ``tokens`` from every token limit.

        Raises:
            APIError: 429 ``rate_limit_exceeded`` (``type`` ``requests``/``tokens``) with
                ``retry-after``; nothing is kept from a refused request.
        """
        grant = Grant(self, [], reserved_tokens=tokens)
        for limit in limits:
            amount = 1 if limit.kind == REQUESTS else tokens
            state = await self._apply(limit, amount, "take")
            if not state.allowed:
                await grant.settle(0, served=False)
                err = rate_limited(limit.kind, limit.scope.replace(":", " "), limit.per_minute, amount,
                                   state.retry_after_s(amount))
                grant.states[limit.kind] = state
                err.headers.update(grant.headers())
                raise err
            grant.taken.append((limit, amount))
            _keep_tightest(grant.states, limit.kind, state)
        return grant
