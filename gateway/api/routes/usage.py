"""Tenant-scoped reads: ``GET /v1/requests``, ``/v1/requests/{id}`` and ``/v1/usage``.

A tenant key sees only its own tenant's records: the tenant filter is always the
caller's and cannot be overridden; another tenant's record id answers 404."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.api.deps import CurrentPrincipal, get_session
from gateway.api.routes.admin import not_found, record_page, utc, window
from gateway.crud import records as crud_records
from gateway.tenancy.schemas import RecordOut, RecordPage
from gateway.core.text import Label

router = APIRouter(prefix="/v1")
Session = Annotated[AsyncSession, Depends(get_session)]


@router.get("/requests")
async def own_requests(
    principal: CurrentPrincipal, session: Session, user: Label | None = None,
    status: Literal["finished", "failed", "cancelled", "rejected"] | None = None,
    since: datetime | None = None, until: datetime | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100, cursor: str | None = None,
) -> RecordPage:
    """The caller's tenant's request records, newest first (filters as the admin route)."""
    return await record_page(session, tenant=principal.tenant, user=user, status=status, since=utc(since),
                             until=utc(until), limit=limit, cursor=cursor)


@router.get("/requests/{record_id}")
async def own_request(record_id: Label, principal: CurrentPrincipal, session: Session) -> RecordOut:
    row = await crud_records.get_record(session, record_id, tenant=principal.tenant)
    if row is None:
        raise not_found("request record")
    return RecordOut.model_validate(row)


@router.get("/usage")
async def own_usage(principal: CurrentPrincipal, session: Session, user: Label | None = None,
                    since: datetime | None = None, until: datetime | None = None) -> dict:
    """Per-user tok/s per minute and totals of the caller's tenant (default: last hour):
    ``requests``, ``requests_by_status`` and the billed tokens (served requests only,
    :func:`gateway.observability.observe.is_served`; refused requests are counted, never billed)."""
    since, until = window(since, until)
    rows = await crud_records.rollups(session, since=since, until=until, tenant=principal.tenant, user=user)
    return {"object": "list", "tenant": principal.tenant, "since": since, "until": until, "bucket_s": 60,
            **crud_records.usage_totals(rows), "data": crud_records.user_series(rows)}
