"""SLA tiers: create, list, get, update, delete (async SQLAlchemy sessions).

Fields (``None`` = unlimited): ``min_tokens_per_s`` (tokens/s per user),
``max_concurrent`` (requests in the engine per tenant), ``rpm`` (requests/min per
tenant), ``tpm`` (tokens/min per tenant), ``priority`` (larger wins),
``max_queue_wait_s`` (seconds a request may wait for admission before 429).
"""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.db.models import SlaTier, Tenant

TIER_FIELDS = ("min_tokens_per_s", "max_concurrent", "rpm", "tpm", "priority", "max_queue_wait_s")


class TierExistsError(ValueError):
    """A tier with this name already exists."""


def _check(fields: dict) -> None:
    unknown = set(fields) - set(TIER_FIELDS)
    if unknown:
        raise ValueError(f"unknown tier fields: {sorted(unknown)}")
    for name in ("min_tokens_per_s", "max_concurrent", "rpm", "tpm"):
        value = fields.get(name)
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive (or null for unlimited), got {value}")
    if fields.get("max_queue_wait_s") is not None and fields["max_queue_wait_s"] < 0:
        raise ValueError("max_queue_wait_s must be >= 0")


async def get_tier(session: AsyncSession, name: str) -> SlaTier | None:
    return await session.scalar(select(SlaTier).where(SlaTier.name == name))


async def list_tiers(session: AsyncSession) -> list[SlaTier]:
    """All tiers, highest priority first, then by name."""
    return list(await session.scalars(select(SlaTier).order_by(SlaTier.priority.desc(), SlaTier.name)))


async def create_tier(session: AsyncSession, name: str, **fields) -> SlaTier:
    """Create and commit a tier. Raises :class:`TierExistsError`, ValueError for bad values."""
    _check(fields)
    if await get_tier(session, name) is not None:
        raise TierExistsError(f"tier {name!r} already exists")
    fields = {k: v for k, v in fields.items() if v is not None or k not in ("priority", "max_queue_wait_s")}
    row = SlaTier(name=name, **fields)
    session.add(row)
    await session.commit()
    return row


async def update_tier(session: AsyncSession, name: str, **fields) -> SlaTier | None:
    """Set the given fields (a ``None`` value clears a limit); None when the tier is unknown."""
    _check(fields)
    row = await get_tier(session, name)
    if row is None:
        return None
    for key, value in fields.items():
        if value is None and key in ("priority", "max_queue_wait_s"):
            continue
        setattr(row, key, value)
    await session.commit()
    return row


async def delete_tier(session: AsyncSession, name: str) -> bool:
    """Delete a tier; its tenants fall back to the default tier. False when unknown."""
    row = await get_tier(session, name)
    if row is None:
        return False
    # explicit, because SQLite databases have no FK from tenants.tier_id (see migration 0002)
    await session.execute(update(Tenant).where(Tenant.tier_id == row.id).values(tier_id=None))
    await session.delete(row)
    await session.commit()
    return True
