"""Run the Alembic migrations in ``migrations/`` from Python (CLI, tests, e2e setup).

``upgrade(url)`` / ``downgrade(url, rev)`` are synchronous (they run their own event
loop); from async code use :func:`upgrade_async` / :func:`downgrade_async`. The
connection is handed to ``migrations/env.py`` via ``config.attributes``, so the same
code path serves SQLite and Postgres.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Callable

from alembic import command
from alembic.config import Config

from gateway.db.session import make_engine

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(url: str, connection=None) -> Config:  # noqa: ANN001
    """An Alembic config for ``url`` without reading ``alembic.ini`` (no logging setup)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["database_url"] = url
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


async def _run(url: str, action: Callable[[Config], None]) -> None:
    engine = make_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(lambda sync_conn: action(alembic_config(url, sync_conn)))
    finally:
        await engine.dispose()


async def upgrade_async(url: str, revision: str = "head") -> None:
    await _run(url, lambda cfg: command.upgrade(cfg, revision))


async def downgrade_async(url: str, revision: str) -> None:
    await _run(url, lambda cfg: command.downgrade(cfg, revision))


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at ``url`` up to ``revision`` (default: latest)."""
    asyncio.run(upgrade_async(url, revision))


def downgrade(url: str, revision: str) -> None:
    """Migrate down to ``revision`` (``"base"`` drops every table)."""
    asyncio.run(downgrade_async(url, revision))


async def current_revision_async(url: str) -> str | None:
    """The revision the database is at (None when never migrated)."""
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(lambda c: MigrationContext.configure(c).get_current_revision())
    finally:
        await engine.dispose()


def head_revision() -> str:
    """The newest revision in ``migrations/versions`` (what ``upgrade`` goes to)."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config("")).get_current_head()
