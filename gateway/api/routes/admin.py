"""Admin API ``/admin/v1/...`` (admin token only; tenant keys get 403): tiers, tenants,
keys (a new key is shown once), request records, per-user tok/s series, acceptance
and SLA attainment. Changes apply at once on this replica and within
``auth_cache_ttl_s`` seconds on the others."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta, timezone
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.api.deps import AdminPrincipal, JSONBodyRoute, get_session, require_admin
from gateway.crud import keys as crud_keys
from gateway.crud import records as crud_records
from gateway.crud import tenants as crud_tenants
from gateway.crud import tiers as crud_tiers
from gateway.db.models import ApiKey, Tenant
from gateway.core.errors import APIError, invalid_request
from gateway.tenancy.schemas import (
    KeyCreate, KeyCreated, KeyOut, KeyPatch, RecordOut, RecordPage, TenantCreate, TenantOut, TenantPatch,
    TierCreate, TierLimits, TierOut,
)
from gateway.core.text import Label, NameRef
from gateway.observability.live import merge as live_merge
from gateway.observability.stats import user_tokens_per_s

# bodies are JSON whatever their Content-Type, as on /v1/chat/completions (docs/tenancy.md)
router = APIRouter(prefix="/admin/v1", dependencies=[Depends(require_admin)], route_class=JSONBodyRoute)
Session = Annotated[AsyncSession, Depends(get_session)]
# a 64-bit row id: larger integers are a 400, not an OverflowError (500) in the driver
KeyId = Annotated[int, Path(ge=-(2**63), le=2**63 - 1)]


def not_found(what: str) -> APIError:
    return APIError(404, f"No such {what}.", "invalid_request_error", None, "not_found")


def conflict(message: str) -> APIError:
    return APIError(409, message, "invalid_request_error", None, "already_exists")


def _changed(request: Request, digest: str | None = None) -> None:
    """Forget cached policies (and a revoked key) on this replica right away."""
    request.app.state.admission.policies.invalidate()
    if digest is not None:
        request.app.state.auth_cache.invalidate(digest)


def utc(ts: datetime | None) -> datetime | None:
    return ts.replace(tzinfo=timezone.utc) if ts is not None and ts.tzinfo is None else ts


def window(since: datetime | None, until: datetime | None, default: timedelta = timedelta(hours=1)):
    """``[since, until)`` in UTC; defaults: the last hour (naive datetimes are UTC)."""
    until = utc(until) or datetime.now(timezone.utc) + timedelta(minutes=1)
    since = utc(since) or until - default
    if since >= until:
        raise invalid_request("'since' must be before 'until'.", "since", "invalid_value")
    return since, until


def tenant_out(t: Tenant, default_tier: str) -> TenantOut:
    name = t.tier.name if t.tier is not None else None
    return TenantOut(name=t.name, tier=name, effective_tier=name or default_tier, created_at=t.created_at)


def key_out(k: ApiKey, cls=KeyOut, **extra) -> KeyOut:
    return cls(id=k.id, prefix=k.prefix, tenant=k.tenant.name, user=k.user_label, status=k.status(),
               created_at=k.created_at, last_used_at=k.last_used_at, expires_at=k.expires_at,
               revoked_at=k.revoked_at, token_budget=k.token_budget, tokens_used=k.tokens_used or 0,
               rpm_limit=k.rpm_limit, tpm_limit=k.tpm_limit, **extra)


# ---------------------------------------------------------------------- tiers
@router.get("/tiers")
async def list_tiers(session: Session) -> dict:
    return {"object": "list", "data": [TierOut.model_validate(t) for t in await crud_tiers.list_tiers(session)]}


@router.post("/tiers", status_code=201)
async def create_tier(body: TierCreate, request: Request, session: Session) -> TierOut:
    try:
        row = await crud_tiers.create_tier(session, body.name, **body.model_dump(exclude={"name"}))
    except crud_tiers.TierExistsError as exc:
        raise conflict(str(exc)) from None
    _changed(request)
    return TierOut.model_validate(row)


@router.get("/tiers/{name}")
async def get_tier(name: NameRef, session: Session) -> TierOut:
    row = await crud_tiers.get_tier(session, name)
    if row is None:
        raise not_found("tier")
    return TierOut.model_validate(row)


@router.patch("/tiers/{name}")
async def update_tier(name: NameRef, body: TierLimits, request: Request, session: Session) -> TierOut:
    """Only the fields present change; ``null`` clears a limit (unlimited)."""
    row = await crud_tiers.update_tier(session, name, **body.model_dump(exclude_unset=True))
    if row is None:
        raise not_found("tier")
    _changed(request)
    return TierOut.model_validate(row)


@router.delete("/tiers/{name}")
async def delete_tier(name: NameRef, request: Request, session: Session) -> dict:
    if not await crud_tiers.delete_tier(session, name):
        raise not_found("tier")
    _changed(request)
    return {"name": name, "deleted": True}


# ---------------------------------------------------------------------- tenants
@router.get("/tenants")
async def list_tenants(request: Request, session: Session) -> dict:
    default = request.app.state.settings.default_tier
    return {"object": "list", "data": [tenant_out(t, default) for t in await crud_tenants.list_tenants(session)]}


@router.post("/tenants", status_code=201)
async def create_tenant(body: TenantCreate, request: Request, session: Session) -> TenantOut:
    try:
        row = await crud_tenants.create_tenant(session, body.name, body.tier)
    except crud_tenants.TenantExistsError as exc:
        raise conflict(str(exc)) from None
    except crud_tenants.UnknownTierError as exc:
        raise invalid_request(str(exc), "tier", "unknown_tier") from None
    _changed(request)
    return tenant_out(row, request.app.state.settings.default_tier)


@router.get("/tenants/{name}")
async def get_tenant(name: NameRef, request: Request, session: Session) -> TenantOut:
    row = await crud_tenants.get_tenant(session, name)
    if row is None:
        raise not_found("tenant")
    return tenant_out(row, request.app.state.settings.default_tier)


@router.patch("/tenants/{name}")
async def set_tenant_tier(name: NameRef, body: TenantPatch, request: Request, session: Session) -> TenantOut:
    try:
        row = await crud_tenants.set_tier(session, name, body.tier)
    except crud_tenants.UnknownTierError as exc:
        raise invalid_request(str(exc), "tier", "unknown_tier") from None
    if row is None:
        raise not_found("tenant")
    _changed(request)
    return tenant_out(row, request.app.state.settings.default_tier)


@router.delete("/tenants/{name}")
async def delete_tenant(name: NameRef, request: Request, session: Session) -> dict:
    """Deletes the tenant and its keys (records are kept)."""
    if not await crud_tenants.delete_tenant(session, name):
        raise not_found("tenant")
    request.app.state.auth_cache.invalidate()
    _changed(request)
    return {"name": name, "deleted": True}


# ---------------------------------------------------------------------- keys
@router.get("/keys")
async def list_keys(session: Session, tenant: NameRef | None = None) -> dict:
    rows = await crud_keys.list_keys(session)
    return {"object": "list", "data": [key_out(k) for k in rows if tenant is None or k.tenant.name == tenant]}


@router.post("/keys", status_code=201)
async def create_key(body: KeyCreate, request: Request, session: Session) -> KeyCreated:
    """Creates the tenant if needed. The plaintext ``key`` is in this response only."""
    row, plaintext = await crud_keys.create_key(session, body.tenant, body.user, utc(body.expires_at),
                                                body.token_budget, body.rpm_limit, body.tpm_limit)
    return key_out(row, KeyCreated, key=plaintext)


async def _key(session: AsyncSession, key_id: int) -> ApiKey:
    row = await crud_keys.get_key(session, key_id)
    if row is None:
        raise not_found("key")
    return row


@router.get("/keys/{key_id}")
async def get_key(key_id: KeyId, session: Session) -> KeyOut:
    return key_out(await _key(session, key_id))


@router.patch("/keys/{key_id}")
async def update_key(key_id: KeyId, body: KeyPatch, request: Request, session: Session) -> KeyOut:
    fields = body.model_dump(exclude_unset=True)
    if "user" in fields:
        fields["user_label"] = fields.pop("user")
    if "expires_at" in fields:
        fields["expires_at"] = utc(fields["expires_at"])
    row = await crud_keys.update_key(session, key_id, **fields)
    if row is None:
        raise not_found("key")
    _changed(request, row.digest)
    return key_out(await _key(session, key_id))


@router.post("/keys/{key_id}/revoke")
async def revoke_key(key_id: KeyId, request: Request, session: Session) -> KeyOut:
    """Revoked at once on this replica, within ``auth_cache_ttl_s`` on the others."""
    row = await crud_keys.revoke_key_id(session, key_id)
    if row is None:
        raise not_found("key")
    _changed(request, row.digest)
    return key_out(row)


# ---------------------------------------------------------------------- records and stats
Status = Literal["finished", "failed", "cancelled", "rejected", "running", "incomplete"]


async def record_page(session: AsyncSession, *, limit: int, cursor: str | None, **filters) -> RecordPage:
    try:
        rows, nxt = await crud_records.query_records(session, limit=limit, cursor=cursor, **filters)
    except ValueError:
        raise invalid_request("Invalid cursor.", "cursor", "invalid_value") from None
    return RecordPage(data=[RecordOut.model_validate(r) for r in rows], has_more=nxt is not None, next_cursor=nxt)


@router.get("/requests")
async def list_requests(
    session: Session, tenant: NameRef | None = None, user: Label | None = None, tier: NameRef | None = None,
    status: Status | None = None, since: datetime | None = None, until: datetime | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100, cursor: str | None = None,
) -> RecordPage:
    """Request records, newest first; ``since <= finished_at < until`` (ISO 8601, UTC
    when naive). Page with ``cursor=next_cursor``."""
    return await record_page(session, tenant=tenant, user=user, tier=tier, status=status, since=utc(since),
                             until=utc(until), limit=limit, cursor=cursor)


@router.get("/requests/{record_id}")
async def get_request(record_id: Label, session: Session) -> RecordOut:
    row = await crud_records.get_record(session, record_id)
    if row is None:
        raise not_found("request record")
    return RecordOut.model_validate(row)


@router.get("/usage/tokens_per_s")
async def tokens_per_s_series(
    session: Session, tenant: NameRef | None = None, user: Label | None = None, tier: NameRef | None = None,
    since: datetime | None = None, until: datetime | None = None,
) -> dict:
    """Per-user tok/s per minute (median of the user's per-request decode tok/s in
    that minute) from the rollups; default window: the last hour."""
    since, until = window(since, until)
    rows = await crud_records.rollups(session, since=since, until=until, tenant=tenant, user=user, tier=tier)
    return {"object": "list", "since": since, "until": until, "bucket_s": 60, "data": crud_records.user_series(rows)}


@router.get("/usage/users")
async def users_summary(
    session: Session, tenant: NameRef | None = None, tier: NameRef | None = None,
    since: datetime | None = None, until: datetime | None = None,
) -> dict:
    """Per (tenant, user) totals over the window (default: the last hour) from the
    rollups: requests, ``requests_by_status`` (also flat: ``finished``, ``failed``,
    ``cancelled``, ``rejected``), billed tokens (served requests only,
    :func:`gateway.observability.observe.is_served`), ``tokens_per_s_p50`` (median of the per-minute
    medians, each weighted by its measured requests), SLA requests met, latest tier."""
    since, until = window(since, until)
    rows = await crud_records.rollups(session, since=since, until=until, tenant=tenant, tier=tier)
    per: dict[tuple, list] = defaultdict(list)
    for r in rows:
        per[(r.tenant, r.user)].append(r)
    out = []
    for (name, user), rs in sorted(per.items()):
        graded, met = sum(r.sla_requests for r in rs), sum(r.sla_met for r in rs)
        totals = crud_records.usage_totals(rs)
        out.append({
            "tenant": name, "user": user or None, "tier": rs[-1].tier or None, **totals["requests_by_status"], **totals,
            "tokens_per_s_p50": user_tokens_per_s(x for r in rs if r.decode_tps_median is not None
                                                  for x in [r.decode_tps_median] * r.decode_tps_samples),
            "sla_requests": graded, "sla_met": met, "sla_attainment": met / graded if graded else None,
            "last_minute": rs[-1].minute,
        })
    return {"object": "list", "since": since, "until": until, "data": out}


@router.get("/stats/acceptance")
async def acceptance(
    session: Session, group_by: Literal["tenant", "model", "tier"] = "tenant", tenant: NameRef | None = None,
    since: datetime | None = None, until: datetime | None = None,
) -> dict:
    """Speculative acceptance per tenant/model/tier, with per-position acceptance."""
    since, until = window(since, until, timedelta(days=1))
    rows = await crud_records.rollups(session, since=since, until=until, tenant=tenant)
    return {"object": "list", "since": since, "until": until, "data": crud_records.acceptance(rows, group_by)}


@router.get("/stats/sla")
async def sla(session: Session, since: datetime | None = None, until: datetime | None = None) -> dict:
    """SLA attainment per tier (requests and user-minutes meeting the tok/s target)."""
    since, until = window(since, until, timedelta(days=1))
    rows = await crud_records.rollups(session, since=since, until=until)
    return {"object": "list", "since": since, "until": until, "data": crud_records.sla_attainment(rows)}


@router.post("/rollups/refresh")
async def refresh_rollups(request: Request) -> Response:
    """Write buffered records and recompute touched rollups now (normally periodic)."""
    await request.app.state.records.flush()
    return Response(status_code=204)


@router.get("/live")
async def live(_: AdminPrincipal, request: Request) -> dict:
    """Live state over all replicas (:mod:`gateway.observability.live`): running and waiting
    requests per tenant, per-user tok/s and SLA attainment of the last minute, one row per
    live replica; ``degraded`` is true when Redis failed and only this replica is shown."""
    state = request.app.state
    snaps, degraded = await state.live.gather()
    return {"object": "live", "replica": state.replica_id, "shared": state.live.client is not None,
            "degraded": degraded, **live_merge(snaps)}


@router.get("/tenancy/status")
async def tenancy_status(_: AdminPrincipal, request: Request) -> dict:
    """Record-writer counters and live admission state of this replica."""
    state = request.app.state
    w, a = state.records, state.admission
    return {
        "replica": state.replica_id,
        "records": {"buffered": w.buffered, "written": w.written, "dropped": w.dropped, "rejected": w.rejected,
                    "swept_incomplete": w.swept,
                    "write_errors": w.write_errors, "last_error": w.last_error},
        "admission": {"active": {t: n for t, n in a.tenant_active.items() if n},
                      "waiting": len(a._waiters), "rejections": dict(a.rejections),
                      "predicted_tokens_per_s_at_1": a.model.predict(1),
                      "rate_limit_store_errors": a.limiter.store_errors,
                      "concurrency_lease_errors": a.lease_errors},
    }
