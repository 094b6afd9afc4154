"""Request records and per-minute rollups: batch insert, queries, stats, retention.

Rollups are recomputed from the records of each touched (minute, tenant), so they are
idempotent (any replica may recompute a minute and gets the same rows). User tok/s is
the one definition, :func:`gateway.observability.stats.user_tokens_per_s` (median of per-request
decode tok/s), per minute in ``usage_rollups.decode_tps_median``.

Billing has one definition too, :func:`gateway.observability.observe.is_served`: ``api_keys.tokens_used``
and the rollups' ``prompt_tokens``/``completion_tokens`` count served requests only; refused
ones appear only in the per-status request counts (``finished``/``failed``/``cancelled``/
``rejected``). A record keeps its request's prompt size either way.
"""

from __future__ import annotations

import base64
import statistics
from collections import defaultdict
from datetime import datetime, timedelta
from typing import Iterable

from sqlalchemy import and_, delete, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.db.models import ApiKey, RequestRecord, UsageRollup
from gateway.observability.observe import STATUSES, is_served
from gateway.observability.stats import user_tokens_per_s

MINUTE = timedelta(minutes=1)
SPEC_SUMS = ("rounds", "drafted", "accepted", "emitted")  # the rollups' spec_* (and constrained_spec_*) sums


RUNNING, INCOMPLETE = "running", "incomplete"
OPEN_STATUSES = (RUNNING, INCOMPLETE)  # records a later final row of the same id replaces


async def mark_incomplete(session: AsyncSession, replicas: list[str], now: datetime) -> int:
    """Mark the ``running`` records of ``replicas`` (dead ones) ``incomplete`` (error code
    ``replica_lost``, ``finished_at`` = ``now``); commit. Returns how many."""
    if not replicas:
        return 0
    res = await session.execute(update(RequestRecord).where(
        RequestRecord.status == RUNNING, RequestRecord.replica.in_(replicas)).values(
        status=INCOMPLETE, error_code="replica_lost", finished_at=now,
        error_message="The gateway replica serving this request stopped before it ended (killed or crashed)."))
    await session.commit()
    return res.rowcount or 0


async def running_replicas(session: AsyncSession) -> list[str]:
    """Replica ids that have ``running`` records."""
    rows = await session.scalars(select(RequestRecord.replica).where(
        RequestRecord.status == RUNNING, RequestRecord.replica.is_not(None)).distinct())
    return list(rows)


def minute_of(ts: datetime) -> datetime:
    return ts.replace(second=0, microsecond=0)


# ------------------------------------------------------------------ writing
async def insert_records(session: AsyncSession, rows: list[dict]) -> int:
    """Insert ``rows`` (dicts of :class:`RequestRecord` columns) and add the tokens of the
    served ones (:func:`is_served`; refusals cost nothing) to ``api_keys.tokens_used``;
    commit. A final row whose id exists as ``running``/``incomplete`` (:data:`OPEN_STATUSES`)
    updates it; other rows whose id already exists are skipped (a batch retried after a lost
    commit acknowledgement is not double counted). Returns the number inserted or ended."""
    if not rows:
        return 0
    ids = [r["id"] for r in rows]
    existing = dict((await session.execute(select(RequestRecord.id, RequestRecord.status)
                                           .where(RequestRecord.id.in_(ids)))).all())
    new = [r for r in rows if r["id"] not in existing]
    ending = [r for r in rows if existing.get(r["id"]) in OPEN_STATUSES and r["status"] not in OPEN_STATUSES]
    if ending:  # a ``running`` (or swept ``incomplete``) row gets its final values
        await session.execute(update(RequestRecord), ending)
    if new or ending:
        if new:
            await session.execute(insert(RequestRecord), new)
        used: dict[int, int] = defaultdict(int)
        for r in new + ending:
            if r.get("key_id") is not None and is_served(r["status"], r["completion_tokens"]):
                used[r["key_id"]] += r["prompt_tokens"] + r["completion_tokens"]
        for key_id, tokens in used.items():
            await session.execute(update(ApiKey).where(ApiKey.id == key_id)
                                  .values(tokens_used=ApiKey.tokens_used + tokens))
    await session.commit()
    return len(new) + len(ending)


def _rollup_rows(minute: datetime, records: Iterable[RequestRecord]) -> list[dict]:
    groups: dict[tuple, list[RequestRecord]] = defaultdict(list)
    for r in records:
        groups[(r.tenant, r.user or "", r.tier or "", r.model)].append(r)
    out = []
    for (tenant, user, tier, model), recs in groups.items():
        rates = [r.decode_tokens_per_s for r in recs]
        ttfts = [r.ttft_s for r in recs if r.ttft_s is not None]
        graded = [r for r in recs if r.sla_met is not None]
        targets = [r.sla_target_tokens_per_s for r in recs if r.sla_target_tokens_per_s is not None]
        positions: list[int] = []
        for r in recs:
            for j, n in enumerate(r.accepted_per_position or []):
                positions += [0] * (j + 1 - len(positions))
                positions[j] += n
        count = {s: sum(r.status == s for r in recs) for s in STATUSES}
        served = [r for r in recs if is_served(r.status, r.completion_tokens)]
        constrained = [r for r in recs if r.constraint is not None]
        out.append(dict(
            minute=minute, tenant=tenant, user=user, tier=tier, model=model, requests=len(recs), **count,
            prompt_tokens=sum(r.prompt_tokens for r in served),
            completion_tokens=sum(r.completion_tokens for r in served),
            decode_tps_median=user_tokens_per_s(rates), decode_tps_samples=sum(x is not None for x in rates),
            ttft_median_s=statistics.median(ttfts) if ttfts else None,
            sla_target_tokens_per_s=max(targets) if targets else None,
            sla_requests=len(graded), sla_met=sum(bool(r.sla_met) for r in graded),
            spec_rounds=sum(r.spec_rounds or 0 for r in recs), spec_drafted=sum(r.spec_drafted or 0 for r in recs),
            spec_accepted=sum(r.spec_accepted or 0 for r in recs), spec_emitted=sum(r.spec_emitted or 0 for r in recs),
            accepted_per_position=positions or None,
            **{f"constrained_spec_{k}": sum(getattr(r, f"spec_{k}") or 0 for r in constrained) for k in SPEC_SUMS},
        ))
    return out


async def recompute_rollups(session: AsyncSession, buckets: Iterable[tuple[datetime, str]]) -> int:
    """Recompute the rollup rows of each ``(minute, tenant)`` from the records; commit.
    Returns the number of rollup rows written. Retries once if another replica wrote
    the same minute concurrently."""
    buckets = sorted(set(buckets))
    for attempt in range(2):
        written = 0
        try:
            for minute, tenant in buckets:
                recs = await session.scalars(select(RequestRecord).where(
                    RequestRecord.tenant == tenant, RequestRecord.status.in_(STATUSES), RequestRecord.finished_at >= minute,
                    RequestRecord.finished_at < minute + MINUTE))
                rows = _rollup_rows(minute, recs)
                await session.execute(delete(UsageRollup).where(UsageRollup.tenant == tenant,
                                                                UsageRollup.minute == minute))
                if rows:
                    await session.execute(insert(UsageRollup), rows)
                written += len(rows)
            await session.commit()
            return written
        except IntegrityError:
            await session.rollback()
            if attempt:
                raise
    return 0


async def prune(session: AsyncSession, records_before: datetime, rollups_before: datetime | None = None) -> tuple[int, int]:
    """Delete records that ended before ``records_before`` (and rollups of minutes
    before ``rollups_before``); commit. Returns ``(records, rollups)`` deleted."""
    n_rec = (await session.execute(delete(RequestRecord).where(RequestRecord.finished_at < records_before))).rowcount
    n_roll = 0
    if rollups_before is not None:
        n_roll = (await session.execute(delete(UsageRollup).where(UsageRollup.minute < rollups_before))).rowcount
    await session.commit()
    return n_rec or 0, n_roll or 0


# ------------------------------------------------------------------ reading
def encode_cursor(row: RequestRecord) -> str:
    return base64.urlsafe_b64encode(f"{row.finished_at.isoformat()}|{row.id}".encode()).decode()


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """Raises ValueError on a malformed cursor (also one whose id holds NUL, which
    Postgres cannot compare)."""
    try:
        ts, _, rid = base64.urlsafe_b64decode(cursor.encode()).decode().partition("|")
        if "\x00" in rid:
            raise ValueError("NUL in the cursor's id")
        return datetime.fromisoformat(ts), rid
    except Exception as exc:  # noqa: BLE001 — any garbage is a client error
        raise ValueError("invalid cursor") from exc


async def query_records(
    session: AsyncSession,
    *,
    tenant: str | None = None,
    user: str | None = None,
    tier: str | None = None,
    status: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int = 100,
    cursor: str | None = None,
) -> tuple[list[RequestRecord], str | None]:
    """Records matching every given filter, newest first (by ``finished_at``, then id),
    ``since <= finished_at < until``. Returns ``(rows, next_cursor)``; pass
    ``next_cursor`` back to get the following page (None on the last page)."""
    q = select(RequestRecord)
    for col, value in ((RequestRecord.tenant, tenant), (RequestRecord.user, user),
                       (RequestRecord.tier, tier), (RequestRecord.status, status)):
        if value is not None:
            q = q.where(col == value)
    if since is not None:
        q = q.where(RequestRecord.finished_at >= since)
    if until is not None:
        q = q.where(RequestRecord.finished_at < until)
    if cursor:
        ts, rid = decode_cursor(cursor)
        q = q.where(or_(RequestRecord.finished_at < ts, and_(RequestRecord.finished_at == ts, RequestRecord.id < rid)))
    q = q.order_by(RequestRecord.finished_at.desc(), RequestRecord.id.desc()).limit(limit + 1)
    rows = list(await session.scalars(q))
    more = len(rows) > limit
    rows = rows[:limit]
    return rows, (encode_cursor(rows[-1]) if more and rows else None)


async def get_record(session: AsyncSession, record_id: str, tenant: str | None = None) -> RequestRecord | None:
    """One record; with ``tenant``, only if it belongs to that tenant."""
    q = select(RequestRecord).where(RequestRecord.id == record_id)
    if tenant is not None:
        q = q.where(RequestRecord.tenant == tenant)
    return await session.scalar(q)


async def rollups(
    session: AsyncSession, *, since: datetime, until: datetime, tenant: str | None = None,
    user: str | None = None, tier: str | None = None,
) -> list[UsageRollup]:
    """Rollup rows with ``since <= minute < until``, oldest first."""
    q = select(UsageRollup).where(UsageRollup.minute >= minute_of(since), UsageRollup.minute < until)
    for col, value in ((UsageRollup.tenant, tenant), (UsageRollup.user, user), (UsageRollup.tier, tier)):
        if value is not None:
            q = q.where(col == value)
    return list(await session.scalars(q.order_by(UsageRollup.minute, UsageRollup.tenant, UsageRollup.user)))


def usage_totals(rows: Iterable[UsageRollup]) -> dict:
    """Totals of rollup rows: ``requests``, ``requests_by_status`` (``{"finished": n,
    "failed": n, "cancelled": n, "rejected": n}``, every request recorded) and the billed
    ``prompt_tokens``, ``completion_tokens``, ``total_tokens`` (served requests only)."""
    rows = list(rows)
    prompt, completion = sum(r.prompt_tokens for r in rows), sum(r.completion_tokens for r in rows)
    return {"requests": sum(r.requests for r in rows),
            "requests_by_status": {s: sum(getattr(r, s) for r in rows) for s in STATUSES},
            "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def user_series(rows: list[UsageRollup]) -> list[dict]:
    """Per (tenant, user): per-minute points ``{minute, tokens_per_s, requests,
    completion_tokens}``; ``tokens_per_s`` is the user's median decode tok/s that
    minute (models merged: the median over all of the user's requests)."""
    per: dict[tuple, dict[datetime, list[UsageRollup]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        per[(r.tenant, r.user)][r.minute].append(r)
    out = []
    for (tenant, user), minutes in sorted(per.items()):
        points = []
        for minute, parts in sorted(minutes.items()):
            if len(parts) == 1:
                tps = parts[0].decode_tps_median
            else:  # several models in one minute: weight each model's median by its samples
                tps = user_tokens_per_s(x for p in parts if p.decode_tps_median is not None
                                        for x in [p.decode_tps_median] * p.decode_tps_samples)
            points.append({"minute": minute, "tokens_per_s": tps, "requests": sum(p.requests for p in parts),
                           "completion_tokens": sum(p.completion_tokens for p in parts)})
        out.append({"tenant": tenant, "user": user or None, "points": points})
    return out


def _spec_split(rounds: int, drafted: int, accepted: int, emitted: int) -> dict:
    return {"rounds": rounds, "drafted": drafted, "accepted": accepted, "emitted": emitted,
            "acceptance_rate": accepted / drafted if drafted else None, "tau": emitted / rounds if rounds else None}


def acceptance(rows: list[UsageRollup], group_by: str) -> list[dict]:
    """Speculative acceptance grouped by ``tenant``, ``model`` or ``tier``:
    ``acceptance_rate`` = accepted/drafted, ``tau`` = emitted tokens per round, and
    ``per_position[j]`` = fraction of rounds whose draft token j+1 was accepted.
    ``constrained`` and ``plain`` split the sums (``rounds``, ``drafted``, ``accepted``,
    ``emitted``, ``acceptance_rate``, ``tau``) between requests whose output a grammar
    constrained (JSON or tools: drafts verified against the masked target) and the others."""
    groups: dict[str, list[UsageRollup]] = defaultdict(list)
    for r in rows:
        groups[getattr(r, group_by)].append(r)
    out = []
    for name, rs in sorted(groups.items()):
        rounds, drafted = sum(r.spec_rounds for r in rs), sum(r.spec_drafted for r in rs)
        accepted, emitted = sum(r.spec_accepted for r in rs), sum(r.spec_emitted for r in rs)
        pos: list[int] = []
        for r in rs:
            for j, n in enumerate(r.accepted_per_position or []):
                pos += [0] * (j + 1 - len(pos))
                pos[j] += n
        grammar = [sum(getattr(r, f"constrained_spec_{k}") or 0 for r in rs) for k in SPEC_SUMS]
        out.append({group_by: name or None, "rounds": rounds, "drafted": drafted, "accepted": accepted,
                    "emitted": emitted, "acceptance_rate": accepted / drafted if drafted else None,
                    "tau": emitted / rounds if rounds else None,
                    "per_position": [n / rounds for n in pos] if rounds else [],
                    "constrained": _spec_split(*grammar),
                    "plain": _spec_split(*(total - g for total, g in zip((rounds, drafted, accepted, emitted), grammar)))})
    return out


def sla_attainment(rows: list[UsageRollup]) -> list[dict]:
    """Per tier: requests graded against a target and the fraction that met it
    (decode tok/s ≥ target), plus user-minutes whose median tok/s met the target."""
    groups: dict[str, list[UsageRollup]] = defaultdict(list)
    for r in rows:
        groups[r.tier].append(r)
    out = []
    for tier, rs in sorted(groups.items()):
        graded, met = sum(r.sla_requests for r in rs), sum(r.sla_met for r in rs)
        um = [r for r in rs if r.sla_target_tokens_per_s is not None and r.decode_tps_median is not None]
        um_met = sum(r.decode_tps_median >= r.sla_target_tokens_per_s for r in um)
        out.append({"tier": tier or None, "requests": sum(r.requests for r in rs), "graded_requests": graded,
                    "met_requests": met, "attainment": met / graded if graded else None,
                    "user_minutes": len(um), "user_minutes_met": um_met,
                    "user_minute_attainment": um_met / len(um) if um else None,
                    "rejected": sum(r.rejected for r in rs)})
    return out


async def count_records(session: AsyncSession, tenant: str | None = None) -> int:
    q = select(func.count()).select_from(RequestRecord)
    if tenant is not None:
        q = q.where(RequestRecord.tenant == tenant)
    return await session.scalar(q) or 0
