"""Tenants and their SLA tier: create, list, get, set tier, delete."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.crud.tiers import get_tier
from gateway.db.models import Tenant


class TenantExistsError(ValueError):
    """A tenant with this name already exists."""


class UnknownTierError(LookupError):
    """The named tier does not exist."""


async def get_tenant(session: AsyncSession, name: str) -> Tenant | None:
    """The tenant (with its tier loaded), or None."""
    return await session.scalar(select(Tenant).where(Tenant.name == name))


async def list_tenants(session: AsyncSession) -> list[Tenant]:
    return list(await session.scalars(select(Tenant).order_by(Tenant.name)))


async def _tier_id(session: AsyncSession, tier: str | None) -> int | None:
    if tier is None:
        return None
    row = await get_tier(session, tier)
    if row is None:
        raise UnknownTierError(f"no tier named {tier!r}")
    return row.id


async def create_tenant(session: AsyncSession, name: str, tier: str | None = None) -> Tenant:
    """Create and commit. Raises :class:`TenantExistsError`, :class:`UnknownTierError`."""
    if await get_tenant(session, name) is not None:
        raise TenantExistsError(f"tenant {name!r} already exists")
    row = Tenant(name=name, tier_id=await _tier_id(session, tier))
    session.add(row)
    await session.commit()
    return await get_tenant(session, name)


async def set_tier(session: AsyncSession, name: str, tier: str | None) -> Tenant | None:
    """Assign ``tier`` (None → the default tier). None when the tenant is unknown;
    raises :class:`UnknownTierError`. Running servers apply it within their cache TTL."""
    row = await get_tenant(session, name)
    if row is None:
        return None
    row.tier_id = await _tier_id(session, tier)
    await session.commit()
    session.expire(row)
    return await get_tenant(session, name)


async def delete_tenant(session: AsyncSession, name: str) -> bool:
    """Delete a tenant and its keys (records stay, with the key id cleared)."""
    row = await get_tenant(session, name)
    if row is None:
        return False
    await session.delete(row)
    await session.commit()
    return True
