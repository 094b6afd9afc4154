"""The request-record writer: a :class:`gateway.observability.observe.RequestObserver` that never
blocks the request path.

``request_ended`` turns the outcome into a row dict and appends it to a bounded
in-memory buffer (O(1), no I/O). A background task inserts the buffer in batches
(``record_batch_size`` rows, every ``record_flush_interval_s`` seconds or sooner when a
batch is full), re-aggregates the touched minutes into ``usage_rollups`` every
``rollup_interval_s`` seconds and prunes records older than ``record_retention_days``
(rollups: ``rollup_retention_days``) once an hour.

Database down: rows stay in the buffer (retried with backoff up to 5 s) until it holds
``record_buffer_max`` rows; further records are dropped and counted in
:attr:`RecordWriter.dropped` (and logged) — a whole request at a time: the end row of a
request whose ``running`` row was kept always gets in (so the buffer can exceed the bound by
the number of requests running when it filled), and a finished request is never left
``running``. When the database is back the buffer
drains. On shutdown (:meth:`RecordWriter.stop`, from the app lifespan) the buffer is
flushed, bounded by a timeout.

Exactly once, even when a replica dies: :meth:`RecordWriter.request_started` buffers a
``running`` row as soon as a request is admitted (written with the next flush); the final row
replaces it when the request ends (in the buffer, in place, if the ``running`` row is not
written yet; else in the database, :func:`gateway.crud.records.insert_records`). Each row carries the writer's ``replica`` id. Every
``sweep_interval_s`` :meth:`RecordWriter.sweep` asks ``replica_alive`` (the live-state key in
Redis, :mod:`gateway.observability.live`) about every other replica with ``running`` rows
and marks those of dead ones ``incomplete`` (``replica_lost``); at start it also marks its own
replica id's leftovers (a restarted process with a fixed ``SPARKGATE_REPLICA_ID``). A row
swept by mistake (its replica only lost Redis for a while) still gets its final values.
A request that a SIGKILL ends within one flush interval of its admission leaves no row.

A row the database refuses for its data (:func:`is_row_error`: e.g. a lone surrogate or
NUL that got past the edge checks, an over-long value) must not block the others: the
failed batch is bisected until each bad row is alone, every good row is written, and each
bad row is dropped once, counted in :attr:`RecordWriter.rejected`
(``sparkgate:db_records_rejected_total``) and logged with its request id. Any other
error (database unreachable, locked, out of disk) keeps the rows buffered and retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from datetime import datetime, timedelta, timezone

from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, StatementError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.crud import records as crud_records
from gateway.observability.observe import FINISHED, RequestOutcome

log = logging.getLogger(__name__)

PRUNE_EVERY_S = 3600.0


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, timezone.utc)


def is_row_error(exc: BaseException) -> bool:
    """Whether ``exc`` from inserting rows is about their data (retrying cannot help)
    rather than about the database (unreachable, locked, full: retry later).

    Row errors: a value the driver cannot encode (``ValueError``/``TypeError``/
    ``OverflowError``, raised as is by aiosqlite or wrapped in a ``StatementError``);
    ``DataError``/``IntegrityError``; and any driver error whose SQLSTATE is class 22
    (data exception, e.g. Postgres' 22021 for NUL) or 23 (integrity constraint)."""
    if isinstance(exc, (ValueError, TypeError, OverflowError, DataError, IntegrityError)):
        return True
    if isinstance(exc, DBAPIError):
        return str(getattr(exc.orig, "sqlstate", None) or "")[:2] in ("22", "23")
    return isinstance(exc, StatementError) and isinstance(exc.orig, (ValueError, TypeError, OverflowError))


def record_row(o: RequestOutcome) -> dict:
    """The ``request_records`` row of one outcome (times UTC, durations seconds)."""
    ctx, t, spec = o.ctx, o.timings, o.spec

    def wall(mono: float | None) -> datetime | None:
        return None if t is None or mono is None or not t.wall_queued else _utc(t.wall_queued + (mono - t.queued))

    tps = o.decode_tokens_per_s
    target = ctx.sla_target_tokens_per_s
    return {
        "id": ctx.request_id,
        "tenant": ctx.tenant or "",
        "key_id": ctx.key_id,
        "user": ctx.user,
        "tier": ctx.tier,
        "model": ctx.model,
        "endpoint": ctx.endpoint,
        "stream": ctx.stream,
        "status": o.status,
        "finish_reason": o.finish_reason,
        "error_code": o.error_code,
        "error_message": (o.error_message or None) and o.error_message[:512],
        "queued_at": _utc(ctx.received_wall),
        "started_at": wall(t and t.started),
        "first_token_at": wall(t and t.first_token),
        "finished_at": _utc(ctx.received_wall + (o.ended_mono - ctx.received_mono)),
        "prompt_tokens": o.prompt_tokens,
        "completion_tokens": o.completion_tokens,
        "max_tokens": ctx.max_tokens,
        "ttft_s": o.ttft_s,
        "admission_wait_s": getattr(ctx, "admission_wait_s", None),
        "decode_tokens_per_s": tps,
        "predicted_tokens_per_s": getattr(ctx, "predicted_tokens_per_s", None),
        "spec_rounds": spec and spec.rounds,
        "spec_drafted": spec and spec.drafted,
        "spec_verified": spec and spec.verified,
        "spec_accepted": spec and spec.accepted,
        "spec_emitted": spec and spec.emitted,
        "spec_tau": spec and spec.tau,
        "accepted_per_position": list(spec.accepted_per_position) if spec else None,
        "sla_target_tokens_per_s": target,
        "sla_met": None if target is None or tps is None or o.status != FINISHED else tps >= target,
        "constraint": ctx.constraint,
        "mask_ms_per_token": o.mask_ms_per_token,
    }


def _one_per_id(rows: list[dict]) -> list[dict]:
    """Copies of ``rows``, one per id: a request's end row wins over its ``running`` row (both
    can meet in one batch after a failed write)."""
    out: dict[str, dict] = {}
    for r in rows:
        if r["id"] not in out or r["status"] != crud_records.RUNNING:
            out[r["id"]] = dict(r)
    return list(out.values())


class RecordWriter:
    """Batched, bounded, non-blocking writer of request records (module docstring).

    Counters other code can read: ``buffered`` (rows waiting), ``written`` (rows
    inserted), ``dropped`` (rows lost to a full buffer), ``rejected`` (rows the database
    refused for their data, dropped), ``write_errors`` (failed batch attempts);
    ``last_error`` is the latest database error (or None).
    """

    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        *,
        max_buffer: int = 10_000,
        batch_size: int = 500,
        flush_interval_s: float = 0.5,
        rollup_interval_s: float = 10.0,
        retention_days: float | None = 7.0,
        rollup_retention_days: float | None = 90.0,
        replica_id: str | None = None,
        sweep_interval_s: float = 5.0,
    ):
        self.sessionmaker = sessionmaker
        self.max_buffer = max_buffer
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.rollup_interval_s = rollup_interval_s
        self.retention_days = retention_days
        self.rollup_retention_days = rollup_retention_days
        self._buffer: deque[dict] = deque()
        self._dirty: set[tuple[datetime, str]] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._last_rollup = self._last_prune = -math.inf  # both run on the first step, then periodically
        self.written = self.dropped = self.rejected = self.write_errors = 0
        self.replica_id = replica_id
        self.sweep_interval_s = sweep_interval_s
        self.replica_alive = None  # async (replica id) → bool; None: only this replica's leftovers are swept
        self.swept = 0  # running rows of dead replicas marked incomplete by this replica
        self._last_sweep = -math.inf
        self._starts: dict[str, dict] = {}  # request id → its running row, still buffered
        self._open: set[str] = set()  # ids whose running row was kept (buffered or written), not ended yet
        self.last_error: str | None = None

    @classmethod
    def from_settings(cls, sessionmaker, settings) -> RecordWriter:
        return cls(sessionmaker, max_buffer=settings.record_buffer_max, batch_size=settings.record_batch_size,
                   flush_interval_s=settings.record_flush_interval_s, rollup_interval_s=settings.rollup_interval_s,
                   retention_days=settings.record_retention_days,
                   rollup_retention_days=settings.rollup_retention_days)

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    # ------------------------------------------------------------ observer side
    def request_started(self, ctx) -> None:  # noqa: ANN001 — observe.RequestContext
        """Enqueue a ``running`` row for an admitted request (never blocks, never raises)."""
        if len(self._buffer) >= self.max_buffer:
            return
        row = record_row(RequestOutcome(ctx, crud_records.RUNNING, prompt_tokens=ctx.prompt_tokens,
                                        ended_mono=ctx.received_mono))
        row["replica"] = self.replica_id
        self._starts[row["id"]] = row
        self._open.add(row["id"])
        self._buffer.append(row)

    def request_ended(self, outcome: RequestOutcome) -> None:
        """Enqueue the outcome's row and return (never blocks, never raises). Dropped at a
        full buffer only if the request's ``running`` row was not kept either."""
        opened = outcome.ctx.request_id in self._open
        self._open.discard(outcome.ctx.request_id)
        start = self._starts.pop(outcome.ctx.request_id, None)
        if start is not None:  # its running row is still buffered (not being written): replace it in place
            start.clear()
            start.update(record_row(outcome), replica=self.replica_id)
            return
        if len(self._buffer) >= self.max_buffer and not opened:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.error("request-record buffer full (%d rows, database: %s); %d records dropped so far",
                          self.max_buffer, self.last_error or "slow", self.dropped)
            return
        row = record_row(outcome)
        row["replica"] = self.replica_id
        self._buffer.append(row)
        if len(self._buffer) >= self.batch_size:
            self._wake.set()

    # ------------------------------------------------------------ writer side
    async def _write_batch(self) -> None:
        await self._write_isolating([self._buffer[i] for i in range(min(self.batch_size, len(self._buffer)))])

    async def _write_isolating(self, rows: list[dict]) -> None:
        """Insert ``rows`` — the front of the buffer, in order — and remove them from it.
        On a row error (:func:`is_row_error`) bisect: write the good rows, reject the bad
        ones. Any other error propagates; the rows not yet written stay buffered (a row
        written twice is skipped by id, so a retry never double counts)."""
        for r in rows:  # being written: an end row can no longer replace these in place
            if r["status"] == crud_records.RUNNING:
                self._starts.pop(r["id"], None)
        live = _one_per_id(rows)
        try:
            async with self.sessionmaker() as session:
                await crud_records.insert_records(session, live)
        except Exception as exc:
            if not is_row_error(exc):
                raise
            if len(rows) == 1:
                self._buffer.popleft()  # rows[0]
                self._reject(rows[0], exc)
                return
            await self._write_isolating(rows[:len(rows) // 2])
            await self._write_isolating(rows[len(rows) // 2:])
            return
        for _ in rows:  # only this task removes rows, so the first len(rows) are these
            self._buffer.popleft()
        ended = [r for r in live if r["status"] != crud_records.RUNNING]
        self.written += len(ended)
        self._dirty.update((crud_records.minute_of(r["finished_at"]), r["tenant"]) for r in ended)

    def _reject(self, row: dict, exc: Exception) -> None:
        self.rejected += 1
        reason = f"{type(exc).__name__}: {getattr(exc, 'orig', None) or exc}"[:300]
        log.error("request record %s (tenant %s) rejected by the database and dropped (%d so far): %s",
                  row["id"], ascii(row["tenant"]), self.rejected, reason.encode("utf-8", "backslashreplace").decode())

    async def _rollup(self) -> None:
        dirty, self._dirty = self._dirty, set()
        try:
            async with self.sessionmaker() as session:
                await crud_records.recompute_rollups(session, dirty)
        except BaseException:
            self._dirty |= dirty
            raise
        self._last_rollup = time.monotonic()

    async def _prune(self) -> None:
        if self.retention_days is None:
            return
        now = datetime.now(timezone.utc)
        roll = None if self.rollup_retention_days is None else now - timedelta(days=self.rollup_retention_days)
        async with self.sessionmaker() as session:
            n, m = await crud_records.prune(session, now - timedelta(days=self.retention_days), roll)
        self._last_prune = time.monotonic()
        if n or m:
            log.info("retention: pruned %d request records and %d rollup rows", n, m)

    async def flush(self, rollups: bool = True) -> None:
        """Write everything buffered now (and, with ``rollups``, the touched minutes).
        Raises the database error if a write fails (rows stay buffered)."""
        async with self._lock:
            while self._buffer:
                await self._write_batch()
            if rollups and self._dirty:
                await self._rollup()

    async def sweep(self) -> int:
        """Mark the ``running`` rows of dead replicas ``incomplete`` (module docstring);
        returns how many. Without ``replica_alive``, or when it fails, only this replica's
        own leftovers from before :meth:`start` are swept (at start)."""
        self._last_sweep = time.monotonic()
        async with self.sessionmaker() as session:
            replicas = await crud_records.running_replicas(session)
        dead = []
        for r in replicas:
            if r == self.replica_id:
                continue
            if self.replica_alive is not None:
                try:
                    if not await self.replica_alive(r):
                        dead.append(r)
                except Exception as exc:  # noqa: BLE001 — cannot tell: sweep nothing now
                    log.warning("record sweep: cannot tell whether replica %s is alive: %r", r, exc)
                    return 0
        if not dead:
            return 0
        async with self.sessionmaker() as session:
            n = await crud_records.mark_incomplete(session, dead, datetime.now(timezone.utc))
        if n:
            self.swept += n
            log.warning("marked %d running request records of dead replica(s) %s incomplete", n, ", ".join(dead))
        return n

    async def _sweep_own_leftovers(self) -> None:
        if self.replica_id is None:
            return
        async with self.sessionmaker() as session:
            n = await crud_records.mark_incomplete(session, [self.replica_id], datetime.now(timezone.utc))
        if n:
            log.warning("marked %d running request records of this replica's previous run incomplete", n)

    async def _step(self) -> None:
        async with self._lock:
            if self._last_sweep == -math.inf:
                await self._sweep_own_leftovers()
                self._last_sweep = 0.0
            while self._buffer:
                await self._write_batch()
            now = time.monotonic()
            if now - self._last_sweep >= self.sweep_interval_s:
                await self.sweep()
            if self._dirty and now - self._last_rollup >= self.rollup_interval_s:
                await self._rollup()
            if now - self._last_prune >= PRUNE_EVERY_S:
                await self._prune()

    async def _run(self) -> None:
        failures = 0
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.flush_interval_s)
            self._wake.clear()
            try:
                await self._step()
                if failures:
                    log.warning("request-record database is back; %d rows buffered", len(self._buffer))
                failures, self.last_error = 0, None
            except Exception as exc:  # noqa: BLE001 — keep buffering; the database may come back
                failures += 1
                self.write_errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"[:300]
                if failures == 1 or failures % 50 == 0:
                    log.warning("request-record write failed (%d in a row, %d rows buffered): %s",
                                failures, len(self._buffer), self.last_error)
                await asyncio.sleep(min(5.0, 0.1 * 2 ** min(failures, 6)))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="record-writer")

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the background task and flush what is buffered (at most ``timeout_s``)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            self._task = None
        try:
            await asyncio.wait_for(self.flush(), timeout_s)
        except Exception as exc:  # noqa: BLE001
            log.error("could not flush %d request records at shutdown: %r", len(self._buffer), exc)
