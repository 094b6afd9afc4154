"""Tenants and API keys: create, authenticate, list, revoke (async SQLAlchemy sessions)."""

from __future__ import annotations

import logging
from datetime import datetime

from sqlalchemy import func, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.core.security import KEY_PREFIX, PREFIX_LEN, Principal, generate_api_key, key_digest, visible_prefix
from gateway.db.models import ApiKey, Tenant, utcnow
from gateway.db.session import make_engine, make_sessionmaker

log = logging.getLogger(__name__)


class AmbiguousPrefixError(ValueError):
    """More than one key shares the prefix given to :func:`revoke_key`."""


async def get_or_create_tenant(session: AsyncSession, name: str) -> Tenant:
    tenant = await session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        tenant = Tenant(name=name)
        session.add(tenant)
        await session.flush()
    return tenant


async def create_key(
    session: AsyncSession,
    tenant: str,
    user_label: str | None = None,
    expires_at: datetime | None = None,
    token_budget: int | None = None,
    rpm_limit: int | None = None,
    tpm_limit: int | None = None,
) -> tuple[ApiKey, str]:
    """Create a key for ``tenant`` (created if missing) and commit.

    Returns:
        ``(row, plaintext)``: the plaintext is not stored anywhere; show it once.
    """
    tenant_row = await get_or_create_tenant(session, tenant)
    plaintext = generate_api_key()
    row = ApiKey(
        digest=key_digest(plaintext),
        prefix=visible_prefix(plaintext),
        tenant_id=tenant_row.id,
        user_label=user_label,
        expires_at=expires_at,
        token_budget=token_budget,
        rpm_limit=rpm_limit,
        tpm_limit=tpm_limit,
    )
    session.add(row)
    await session.commit()
    row.tenant = tenant_row
    return row, plaintext


async def authenticate(session: AsyncSession, digest: str, now: datetime | None = None) -> Principal | None:
    """The principal of an active key with this digest, or None (unknown, revoked, expired).

    Also stamps ``last_used_at`` (best effort: a busy database never fails the request).
    """
    now = now or utcnow()
    row = await session.scalar(select(ApiKey).where(ApiKey.digest == digest))
    if row is None or row.status(now) != "active":
        return None
    principal = Principal(tenant=row.tenant.name, user_label=row.user_label, key_id=row.id,
                          expires_at=row.expires_at, token_budget=row.token_budget)
    try:
        await session.execute(update(ApiKey).where(ApiKey.id == row.id).values(last_used_at=now))
        await session.commit()
    except SQLAlchemyError as exc:  # e.g. SQLite busy under load
        await session.rollback()
        log.warning("could not update last_used_at of key %s: %s", row.prefix, exc)
    return principal


async def list_keys(session: AsyncSession) -> list[ApiKey]:
    """All keys (any status), oldest first, with their tenant loaded."""
    return list(await session.scalars(select(ApiKey).order_by(ApiKey.id)))


async def count_keys(session: AsyncSession) -> int:
    return await session.scalar(select(func.count()).select_from(ApiKey)) or 0


async def revoke_key(session: AsyncSession, prefix_or_key: str, now: datetime | None = None) -> ApiKey | None:
    """Revoke the key whose visible prefix is ``prefix_or_key`` (or the full key itself).

    Returns the revoked row, or None when nothing matches. Raises
    :class:`AmbiguousPrefixError` when several keys share the prefix. Revoking twice
    keeps the first ``revoked_at``.
    """
    if prefix_or_key.startswith(KEY_PREFIX) and len(prefix_or_key) > PREFIX_LEN:
        rows = list(await session.scalars(select(ApiKey).where(ApiKey.digest == key_digest(prefix_or_key))))
    else:
        rows = list(await session.scalars(select(ApiKey).where(ApiKey.prefix == prefix_or_key)))
    if not rows:
        return None
    if len(rows) > 1:
        raise AmbiguousPrefixError(f"{len(rows)} keys start with {prefix_or_key!r}; pass the full key")
    row = rows[0]
    if row.revoked_at is None:
        row.revoked_at = now or utcnow()
        await session.commit()
    return row


async def get_key(session: AsyncSession, key_id: int) -> ApiKey | None:
    return await session.scalar(select(ApiKey).where(ApiKey.id == key_id))


KEY_FIELDS = ("user_label", "expires_at", "token_budget", "rpm_limit", "tpm_limit")


async def update_key(session: AsyncSession, key_id: int, **fields) -> ApiKey | None:
    """Set ``user_label``, ``expires_at``, ``token_budget`` (tokens), ``rpm_limit``
    (requests/min) or ``tpm_limit`` (tokens/min) of one key (``None`` clears); None if unknown."""
    unknown = set(fields) - set(KEY_FIELDS)
    if unknown:
        raise ValueError(f"unknown key fields: {sorted(unknown)}")
    row = await get_key(session, key_id)
    if row is not None:
        for name, value in fields.items():
            setattr(row, name, value)
        await session.commit()
    return row


async def revoke_key_id(session: AsyncSession, key_id: int, now: datetime | None = None) -> ApiKey | None:
    """Revoke by id (keeps the first ``revoked_at``); None when unknown."""
    row = await get_key(session, key_id)
    if row is not None and row.revoked_at is None:
        row.revoked_at = now or utcnow()
        await session.commit()
    return row


async def issue_key(database_url: str, tenant: str, user_label: str | None = None, **kwargs) -> str:
    """Create a key in the (already migrated) database at ``database_url``; return the
    plaintext. Convenience for the CLI and end-to-end tests."""
    engine = make_engine(database_url)
    try:
        async with make_sessionmaker(engine)() as session:
            _, plaintext = await create_key(session, tenant, user_label, **kwargs)
        return plaintext
    finally:
        await engine.dispose()
