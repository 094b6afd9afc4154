"""Admission control in front of the engine, in this order:

1. **Policy** — the tenant's SLA tier (``Settings.default_tier`` when it has none) and
   the key's budget/limits, from :class:`PolicyCache` (TTL ``auth_cache_ttl_s``; while
   the database is down the last known policy keeps serving).
2. **Token budget** — a key whose ``tokens_used`` reached ``token_budget`` gets 429
   ``insufficient_quota`` (like OpenAI). In-flight requests may overshoot by their size.
   Only served requests use tokens (:func:`gateway.observability.observe.is_served`, the same rule as
   ``api_keys.tokens_used`` and the usage rollups): refusals cost nothing.
3. **Rate limits** — rpm/tpm token buckets per key and per tenant
   (:mod:`gateway.tenancy.ratelimit`); tpm reserves ``prompt + n · max_tokens`` and refunds the unused
   part when the request ends. 429 ``rate_limit_exceeded`` with ``retry-after``. rpm and
   tpm count only requests the engine ran: one refused at step 4 or by the engine's queue
   (503 ``queue_full``), or whose client left while queued, gets its request and tokens back.
4. **Concurrency and SLA** — the request waits in one priority queue (higher tier
   priority first, FIFO within a priority) until (a) its tenant has fewer than
   ``max_concurrent`` requests admitted and (b) the :class:`SpeedModel` predicts that one
   more request keeps every admitted request of a *higher-priority* tier at or above its
   ``min_tokens_per_s``. After ``max_queue_wait_s`` it gets 429
   (``concurrency_limit_exceeded`` / ``sla_capacity_exceeded``).

With ``SPARKGATE_REDIS_URL`` the rpm/tpm buckets and ``max_concurrent`` hold over all
replicas: the buckets live in Redis, and before its local queue a request of a capped tier
takes a lease in Redis (:mod:`gateway.tenancy.concurrency`; it waits for one up to
``max_queue_wait_s``, re-trying every ``sample_s``, not in priority order across replicas).
If Redis fails both fall back to per-replica state with a logged warning, never an error.
The priority queue and the SLA check stay per replica. Budgets (``api_keys.tokens_used``)
are in the database, shared by all replicas. Requests refused here still reach every observer once
(status ``rejected``, or ``cancelled`` if the client left while queued).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import statistics
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from starlette.requests import Request

from gateway.core.security import Principal
from gateway.crud import keys as crud_keys
from gateway.crud import tenants as crud_tenants
from gateway.crud import tiers as crud_tiers
from gateway.core.errors import APIError, overloaded
from gateway.openai.generation import ClientDisconnected, unless_disconnected
from gateway.observability.observe import CANCELLED, REJECTED, RequestContext, RequestOutcome, notify
from gateway.tenancy.concurrency import LeaseStore
from gateway.tenancy.ratelimit import REQUESTS, TOKENS, Grant, Limit, RateLimiter, RedisBucketStore
from runtime.speculation.sps import SpsTable
from runtime.interface import Backend

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------- policies
@dataclass(frozen=True)
class TierPolicy:
    """A tier as admission sees it (``None`` = unlimited); units as in :class:`SlaTier`."""

    name: str | None = None
    min_tokens_per_s: float | None = None
    max_concurrent: int | None = None
    rpm: int | None = None
    tpm: int | None = None
    priority: int = 0
    max_queue_wait_s: float = 10.0


@dataclass(frozen=True)
class KeyPolicy:
    key_id: int
    token_budget: int | None = None
    tokens_used: int = 0
    rpm_limit: int | None = None
    tpm_limit: int | None = None


@dataclass
class Policy:
    tier: TierPolicy
    key: KeyPolicy | None
    fetched: float = 0.0


def _tier_policy(row) -> TierPolicy:
    return TierPolicy(row.name, row.min_tokens_per_s, row.max_concurrent, row.rpm, row.tpm, row.priority,
                      row.max_queue_wait_s)


class PolicyCache:
    """(tenant, key id) → :class:`Policy`, fresh for ``ttl_s`` seconds; stale entries are
    served while the database fails. Also counts tokens used on this replica since each
    policy was read, so budgets bite before the record writer has updated the DB."""

    def __init__(self, sessionmaker, default_tier: str = "default", ttl_s: float = 5.0, clock=time.monotonic):
        self.sessionmaker = sessionmaker
        self.default_tier = default_tier
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[tuple[str, int | None], Policy] = {}
        self._local_used: Counter = Counter()
        self.db_errors = 0

    async def _load(self, tenant: str, key_id: int | None) -> Policy:
        async with self.sessionmaker() as session:
            row = await crud_tenants.get_tenant(session, tenant)
            tier = row.tier if row is not None else None
            if tier is None:
                tier = await crud_tiers.get_tier(session, self.default_tier)
            key = await crud_keys.get_key(session, key_id) if key_id is not None else None
        kp = None if key is None else KeyPolicy(key.id, key.token_budget, key.tokens_used, key.rpm_limit, key.tpm_limit)
        return Policy(_tier_policy(tier) if tier is not None else TierPolicy(self.default_tier), kp, self._clock())

    async def get(self, tenant: str, key_id: int | None) -> Policy:
        """Raises 503 when the database is down and this (tenant, key) was never seen."""
        cached = self._entries.get((tenant, key_id))
        if cached is not None and self._clock() - cached.fetched < self.ttl_s:
            return cached
        try:
            policy = await self._load(tenant, key_id)
        except Exception as exc:  # noqa: BLE001 — database down: serve what we know
            self.db_errors += 1
            if cached is not None:
                if self.db_errors == 1 or self.db_errors % 100 == 0:
                    log.warning("policy lookup failed (%r); serving cached policy of %s", exc, tenant)
                return cached
            raise overloaded("The tenant database is unavailable; try again shortly.", 2.0,
                             code="policy_unavailable") from None
        self._entries[(tenant, key_id)] = policy
        if key_id is not None:
            self._local_used[key_id] = 0
        return policy

    def note_usage(self, key_id: int | None, tokens: int) -> None:
        """Add a request's billed tokens (:attr:`gateway.observability.observe.RequestOutcome.billed_tokens`)."""
        if key_id is not None:
            self._local_used[key_id] += tokens

    def tokens_used(self, policy: Policy) -> int:
        return 0 if policy.key is None else policy.key.tokens_used + self._local_used[policy.key.key_id]

    def invalidate(self) -> None:
        self._entries.clear()


# ----------------------------------------------------------------------- speed model
class SpeedModel:
    """Predicted decode tok/s of each request when ``n`` requests decode together.

    ``tok/s(n) = τ / step_s(n)``: each engine step (one target forward) gives every
    running request τ tokens (τ = 1 without speculation; with it, the measured mean
    tokens per round of recent requests).

    * With an SPS table (``backend.spec_info().sps_table``):
      ``step_s(n) = c · SpsTable.round_seconds(n · (1 + ℓ))`` with ℓ the measured mean
      drafts verified per request per round (γ until measured) and ``c`` the median
      ratio measured/table of recent step times (1 until measured).
    * Without: an affine model ``step_s(n) = a + b·n`` fitted (least squares over the
      median step time per batch size, weighted by sample count) to the live step time,
      sampled from the engine's ``decode_steps`` counter (``forward_steps`` for backends
      without it; windows of ≥ 8 steps, polled every ``sample_s`` seconds,
      while requests run) at the batch sizes seen; with one batch size seen,
      ``step_s ∝ 1 + β(n − 1)`` through it; with none, ``prior_step_s · (1 + β(n − 1))``.
      ``β`` (default 0.05) is the relative cost of one more request per step.
    """

    def __init__(self, backend: Backend, prior_step_s: float = 0.02, beta: float = 0.05,
                 clock=time.monotonic, max_samples: int = 400, min_steps: int = 8):
        self.backend = backend
        self.prior_step_s = prior_step_s
        self.beta = beta
        self._clock = clock
        self.samples: deque[tuple[int, float]] = deque(maxlen=max_samples)  # (batch size, seconds/step)
        self.min_steps = min_steps
        self._window: tuple[float, int, int, int] | None = None  # (t0, steps0, Σ running, polls)
        self._table: SpsTable | None = None
        self._table_checked = False
        self.gamma = 0
        self.tau: float | None = None
        self.draft_len: float | None = None

    def table(self) -> SpsTable | None:
        if not self._table_checked and self.backend.ready():
            self._table_checked = True
            info = self.backend.spec_info()
            self.gamma = info.block_size
            if info.sps_table:
                try:
                    self._table = SpsTable.from_dict(info.sps_table)
                except (ValueError, KeyError, TypeError) as exc:
                    log.warning("ignoring the backend's SPS table: %r", exc)
        return self._table

    def sample(self) -> None:
        """Poll the engine's step counter. A sample ``(mean batch size, seconds per step)``
        is taken over a window of at least ``min_steps`` steps during which requests ran
        the whole time (a poll with nothing running restarts the window): counting whole
        steps over a long window keeps the error of polling between steps below 1/min_steps."""
        load, now = self.backend.load(), self._clock()
        steps = getattr(load, "decode_steps", 0) or load.forward_steps  # decode rounds, else all forwards
        w = self._window
        if load.running <= 0 or w is None or steps < w[1]:
            self._window = (now, steps, 0, 0) if load.running > 0 else None
            return
        t0, steps0, running_sum, polls = w
        running_sum, polls = running_sum + load.running, polls + 1
        if steps - steps0 >= self.min_steps and now > t0:
            self.samples.append((max(1, round(running_sum / polls)), (now - t0) / (steps - steps0)))
            self._window = (now, steps, 0, 0)
        else:
            self._window = (t0, steps0, running_sum, polls)

    def observe(self, spec) -> None:  # noqa: ANN001 — runtime.interface.SpecStats
        """Fold one finished request's speculative stats into τ and ℓ (EMA, α = 0.1)."""
        if spec is None or not spec.rounds:
            return
        tau, ell = spec.emitted / spec.rounds, spec.drafted / spec.rounds
        self.tau = tau if self.tau is None else 0.9 * self.tau + 0.1 * tau
        self.draft_len = ell if self.draft_len is None else 0.9 * self.draft_len + 0.1 * ell

    def _by_n(self) -> dict[int, list[float]]:
        by_n: dict[int, list[float]] = {}
        for n, s in self.samples:
            by_n.setdefault(n, []).append(s)
        return by_n

    def _per_n(self) -> dict[int, float]:
        """Median seconds per step at each batch size seen."""
        return {n: statistics.median(v) for n, v in self._by_n().items()}

    def step_seconds(self, n: int) -> float:
        n = max(1, n)
        table = self.table()
        per_n = self._per_n()
        if table is not None:
            ell = self.draft_len if self.draft_len is not None else self.gamma
            model = table.round_seconds(max(1.0, n * (1 + ell)))
            ratios = [s / table.round_seconds(max(1.0, k * (1 + ell))) for k, s in per_n.items()]
            return model * (statistics.median(ratios) if ratios else 1.0)
        if len(per_n) >= 2:  # least squares over the per-size medians, weighted by their sample counts
            w = {k: len(v) for k, v in self._by_n().items()}
            total = sum(w.values())
            mx = sum(w[x] * x for x in per_n) / total
            my = sum(w[x] * y for x, y in per_n.items()) / total
            b = sum(w[x] * (x - mx) * (y - my) for x, y in per_n.items()) / sum(w[x] * (x - mx) ** 2 for x in per_n)
            b = max(0.0, b)
            a = my - b * mx
            if a > 0:
                return a + b * n
        if per_n:
            n0, s0 = min(per_n.items(), key=lambda kv: abs(kv[0] - n))
            return s0 * (1 + self.beta * (n - 1)) / (1 + self.beta * (n0 - 1))
        return self.prior_step_s * (1 + self.beta * (n - 1))

    def predict(self, n: int) -> float:
        """Predicted per-request decode tok/s with ``n`` requests running."""
        tau = self.tau if (self.tau is not None and self.table() is not None) else 1.0
        return tau / self.step_seconds(n)


# ----------------------------------------------------------------------- admission
@dataclass
class Ticket:
    """An admitted request: release it exactly once (``AdmissionController.release``)."""

    request_id: str
    tenant: str
    key_id: int | None
    tier: TierPolicy
    grant: Grant | None
    predicted_tokens_per_s: float | None = None
    batch_size: int = 0
    wait_s: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    lease: bool = False  # holds a concurrency lease in Redis (released with the ticket)


@dataclass
class _Waiter:
    priority: int
    seq: int
    tenant: str
    tier: TierPolicy
    ticket: Ticket
    future: asyncio.Future
    blocked: str = ""  # why the last check failed (for the 429 message)
    predicted: float | None = None
    batch_size: int = 0


class AdmissionController:
    """Admission for every generation request (module docstring); also a request
    observer that frees the slot, refunds unused tokens and logs predicted vs measured
    tok/s when the request ends."""

    def __init__(self, backend: Backend, sessionmaker, *, default_tier: str = "default", ttl_s: float = 5.0,
                 limiter: RateLimiter | None = None, sla_admission: bool = True, prior_step_s: float = 0.02,
                 sample_s: float = 0.1, leases: LeaseStore | None = None, lease_refresh_s: float = 1.0):
        self.backend = backend
        self.policies = PolicyCache(sessionmaker, default_tier, ttl_s)
        self.limiter = limiter or RateLimiter()
        self.model = SpeedModel(backend, prior_step_s)
        self.sla_admission = sla_admission
        self.sample_s = sample_s
        self.active: dict[str, Ticket] = {}
        self.tenant_active: Counter = Counter()
        self.rejections: Counter = Counter()  # error code → count
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()
        self._task: asyncio.Task | None = None
        self._pending: set[asyncio.Task] = set()
        self.leases = leases
        self.lease_refresh_s = lease_refresh_s
        self.lease_errors = 0  # Redis failures of the lease store (per-replica count used instead)
        self.lease_waiting: Counter = Counter()  # tenant → requests waiting for a Redis lease
        self._last_refresh = 0.0

    @classmethod
    def from_settings(cls, backend: Backend, sessionmaker, settings) -> AdmissionController:
        prefix = settings.redis_prefix
        store = RedisBucketStore(settings.redis_url, prefix + "rl:") if settings.redis_url else None
        leases = LeaseStore(store.client, prefix) if store is not None else None
        return cls(backend, sessionmaker, default_tier=settings.default_tier, ttl_s=settings.auth_cache_ttl_s,
                   limiter=RateLimiter(store), sla_admission=settings.sla_admission,
                   prior_step_s=settings.admission_step_s, leases=leases)

    # ---------------------------------------------------------------- lifecycle
    async def _sampler(self) -> None:
        while True:
            await asyncio.sleep(self.sample_s)
            try:
                self.model.sample()
                if self._waiters:
                    self._pump()
                if self.leases is not None and time.monotonic() - self._last_refresh >= self.lease_refresh_s:
                    self._last_refresh = time.monotonic()
                    await self._refresh_leases()
            except Exception:  # noqa: BLE001
                log.exception("admission sampler failed")

    async def _refresh_leases(self) -> None:
        held: dict[str, list[str]] = {}
        for t in list(self.active.values()):
            if t.lease:
                held.setdefault(t.tenant, []).append(t.request_id)
        if held:
            try:
                await self.leases.refresh(held)
            except Exception as exc:  # noqa: BLE001 — Redis down: the leases lapse, local counts still hold
                self._lease_failed(exc)

    def _lease_failed(self, exc: BaseException) -> None:
        self.lease_errors += 1
        if self.lease_errors == 1 or self.lease_errors % 1000 == 0:
            log.warning("concurrency lease store failed (%d times); max_concurrent holds per replica only: %r",
                        self.lease_errors, exc)

    async def _take_lease(self, request: Request, ticket: Ticket, t0: float) -> None:
        """Wait for a tenant slot in Redis (module docstring); on a Redis error go on
        without one (per-replica count only).

        Raises:
            APIError: 429 ``concurrency_limit_exceeded`` after ``max_queue_wait_s``."""
        tier = ticket.tier
        deadline = t0 + tier.max_queue_wait_s

        async def wait() -> bool:
            while True:
                try:
                    if await self.leases.take(ticket.tenant, ticket.request_id, tier.max_concurrent):
                        ticket.lease = True
                        return True
                except Exception as exc:  # noqa: BLE001
                    self._lease_failed(exc)
                    return True  # fall back to the per-replica count in _queue
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                await asyncio.sleep(min(left, self.sample_s))

        self.lease_waiting[ticket.tenant] += 1
        try:
            got = await unless_disconnected(request, wait)
        finally:
            self.lease_waiting[ticket.tenant] -= 1
        if not got:
            w = _Waiter(tier.priority, 0, ticket.tenant, tier, ticket, None, blocked="concurrency")  # type: ignore[arg-type]
            raise self._timeout_error(w, time.monotonic() - t0)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._sampler(), name="admission-sampler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await asyncio.gather(*self._pending, return_exceptions=True)

    # ---------------------------------------------------------------- admit
    def _limits(self, tenant: str, policy: Policy) -> list[Limit]:
        out = []
        key = policy.key
        for kind, key_limit, tier_limit in ((REQUESTS, key and key.rpm_limit, policy.tier.rpm),
                                            (TOKENS, key and key.tpm_limit, policy.tier.tpm)):
            if key_limit:
                out.append(Limit(f"key:{key.key_id}", kind, key_limit))
            if tier_limit:
                out.append(Limit(f"tenant:{tenant}", kind, tier_limit))
        return out

    async def admit(self, request: Request, principal: Principal, ctx: RequestContext, observers) -> Ticket:
        """Admit one request or raise (after reporting it to ``observers``).

        Sets ``ctx.tier``, ``ctx.sla_target_tokens_per_s``, ``ctx.priority``,
        ``ctx.predicted_tokens_per_s`` and ``ctx.admission_wait_s``.

        Raises:
            APIError: 429 (budget, rate limit, queue timeout) or 503 (policy unavailable).
            ClientDisconnected: the client left while queued.
        """
        t0 = time.monotonic()
        grant: Grant | None = None
        ticket: Ticket | None = None
        try:
            if principal.is_admin:
                policy = Policy(TierPolicy(), None)
            else:
                policy = await self.policies.get(principal.tenant, principal.key_id)
            tier = policy.tier
            ctx.tier, ctx.sla_target_tokens_per_s, ctx.priority = tier.name, tier.min_tokens_per_s, tier.priority
            budget = policy.key and policy.key.token_budget
            if budget is not None and self.policies.tokens_used(policy) >= budget:
                raise APIError(429, f"You exceeded your current quota: this key's token budget of {budget} tokens "
                               "is used up. Ask your administrator to raise it.", "insufficient_quota", None,
                               "insufficient_quota")
            reserve = ctx.prompt_tokens + ctx.max_tokens * ctx.choices  # n choices: the prompt once, n completions
            grant = await self.limiter.acquire(self._limits(principal.tenant, policy), reserve)
            ticket = Ticket(ctx.request_id, principal.tenant, principal.key_id, tier, grant, headers=grant.headers())
            if self.leases is not None and tier.max_concurrent is not None and not principal.is_admin:
                await self._take_lease(request, ticket, t0)
            await self._queue(request, ticket, t0)  # registered in self.active when granted
        except BaseException as exc:
            if ticket is not None and ticket.lease and ticket.request_id not in self.active:
                self._drop_lease(ticket)
            if grant is not None:  # never reached the engine: the request and its tokens go back
                await grant.settle(0, served=False)
            if isinstance(exc, (APIError, ClientDisconnected)):
                status = CANCELLED if isinstance(exc, ClientDisconnected) else REJECTED
                self.rejections[exc.code] += status == REJECTED
                if isinstance(exc, APIError) and grant is not None and exc.status == 429:
                    exc.headers = {**grant.headers(), **(exc.headers or {})}
                ctx.admission_wait_s = time.monotonic() - t0
                notify(observers, RequestOutcome(ctx, status, error_code=exc.code, error_message=exc.message,
                                                 prompt_tokens=ctx.prompt_tokens))
            raise
        ticket.wait_s = ctx.admission_wait_s = time.monotonic() - t0
        ctx.predicted_tokens_per_s = ticket.predicted_tokens_per_s
        return ticket

    async def _queue(self, request: Request, ticket: Ticket, t0: float) -> None:
        loop = asyncio.get_running_loop()
        tier = ticket.tier
        w = _Waiter(tier.priority, next(self._seq), ticket.tenant, tier, ticket, loop.create_future())
        self._waiters.append(w)
        self._waiters.sort(key=lambda x: (-x.priority, x.seq))
        self._pump()
        deadline = t0 + tier.max_queue_wait_s

        async def wait() -> None:
            while not w.future.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                await asyncio.wait([w.future], timeout=min(left, self.sample_s))
                if not w.future.done():
                    self._pump()

        try:
            if not w.future.done():
                await unless_disconnected(request, wait)
        except BaseException:
            if w.future.done() and not w.future.cancelled():  # granted, then the client left
                self.release(ticket.request_id)
            raise
        finally:
            if w in self._waiters:
                self._waiters.remove(w)
            if not w.future.done():
                w.future.cancel()
        if w.future.cancelled():
            raise self._timeout_error(w, time.monotonic() - t0)

    def _timeout_error(self, w: _Waiter, waited: float) -> APIError:
        tier = w.tier
        if w.blocked == "sla":
            msg = (f"Server busy: admitting this request would slow a higher-priority tier below its "
                   f"tokens/s target (predicted {w.predicted:.1f} tok/s per request at {w.batch_size} concurrent "
                   f"requests). It waited {waited:.1f} s, the max_queue_wait_s of tier {tier.name!r}. "
                   "Please retry later.")
            code = "sla_capacity_exceeded"
        else:
            msg = (f"Too many concurrent requests: tenant {w.tenant!r} already has {tier.max_concurrent} requests "
                   f"running (max_concurrent of tier {tier.name!r}); this one waited {waited:.1f} s "
                   f"(max_queue_wait_s) for a slot. Please retry later.")
            code = "concurrency_limit_exceeded"
        return APIError(429, msg, REQUESTS, None, code, {"Retry-After": str(max(1, math.ceil(tier.max_queue_wait_s or 1)))})

    def _batch_after(self) -> int:
        load = self.backend.load()
        n = max(load.running + load.waiting, sum(self.tenant_active.values())) + 1
        return max(1, min(n, load.max_batch)) if load.max_batch else n

    def _check(self, w: _Waiter) -> bool:
        limit = w.tier.max_concurrent
        if limit is not None and self.tenant_active[w.tenant] >= limit:
            w.blocked = "concurrency"
            return False
        w.batch_size = self._batch_after()
        w.predicted = self.model.predict(w.batch_size)
        if self.sla_admission:
            for t in self.active.values():
                target = t.tier.min_tokens_per_s
                if t.tier.priority > w.priority and target is not None and w.predicted < target:
                    w.blocked = "sla"
                    return False
        return True

    def _pump(self) -> None:
        """Grant every waiter that may start now, in priority order."""
        for w in list(self._waiters):
            if w.future.done():
                self._waiters.remove(w)
            elif self._check(w):  # admitted: counted at once, so the next checks see it
                self.tenant_active[w.tenant] += 1
                w.ticket.predicted_tokens_per_s, w.ticket.batch_size = w.predicted, w.batch_size
                self.active[w.ticket.request_id] = w.ticket
                self._waiters.remove(w)
                w.future.set_result(True)

    # ---------------------------------------------------------------- release
    def release(self, request_id: str, outcome: RequestOutcome | None = None) -> None:
        """Free the request's slot and refund unused tokens (once; later calls do nothing).

        Without an ``outcome`` (no observer saw one: the engine never got the request) or
        with a ``rejected`` one (the engine's queue refused it), the request is refunded too."""
        ticket = self.active.pop(request_id, None)
        if ticket is None:
            return
        self.tenant_active[ticket.tenant] -= 1
        if ticket.lease:
            self._drop_lease(ticket)
        ran = outcome is not None and outcome.status != REJECTED  # rpm: the engine ran it
        used = 0 if outcome is None else outcome.billed_tokens  # tpm and budget: what was served
        self.policies.note_usage(ticket.key_id, used)
        if ticket.grant is not None:
            task = asyncio.get_running_loop().create_task(ticket.grant.settle(used, ran))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
        if outcome is not None:
            self.model.observe(outcome.spec)
            measured = outcome.decode_tokens_per_s
            log.info("request %s tier=%s batch=%d predicted=%.2f tok/s measured=%s tok/s status=%s", request_id,
                     ticket.tier.name, ticket.batch_size, ticket.predicted_tokens_per_s or float("nan"),
                     "-" if measured is None else f"{measured:.2f}", outcome.status)
        self._pump()

    def _drop_lease(self, ticket: Ticket) -> None:
        """Give the ticket's Redis lease back (in the background; if Redis is down it lapses)."""
        ticket.lease = False

        async def drop() -> None:
            try:
                await self.leases.release(ticket.tenant, ticket.request_id)
            except Exception as exc:  # noqa: BLE001
                self._lease_failed(exc)

        task = asyncio.get_running_loop().create_task(drop())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def request_ended(self, outcome: RequestOutcome) -> None:
        """Observer hook."""
        self.release(outcome.ctx.request_id, outcome)
