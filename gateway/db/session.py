"""Async engine and session factory (SQLAlchemy 2, ``sqlite+aiosqlite`` or ``postgresql+asyncpg``)."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine


def ensure_sqlite_dir(url: str) -> None:
    """Create the parent directory of a file-based SQLite database."""
    u = make_url(url)
    if u.get_backend_name() == "sqlite" and u.database and u.database != ":memory:":
        Path(u.database).expanduser().parent.mkdir(parents=True, exist_ok=True)


def make_engine(url: str) -> AsyncEngine:
    """Async engine for ``url``. SQLite gets WAL mode, foreign keys on and a 30 s busy
    timeout, so the CLI can write while a server is running."""
    ensure_sqlite_dir(url)
    if make_url(url).get_backend_name() != "sqlite":
        return create_async_engine(url, pool_pre_ping=True)
    engine = create_async_engine(url, connect_args={"timeout": 30})

    @event.listens_for(engine.sync_engine, "connect")
    def _sqlite_pragmas(dbapi_conn, _record):  # noqa: ANN001
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA journal_mode=WAL")
        cur.close()

    return engine


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)
