"""Alembic environment: one code path for SQLite (aiosqlite) and Postgres (asyncpg).

URL: ``config.attributes["database_url"]`` (set by :mod:`gateway.db.migrate`), else
the gateway Settings (``SPARKGATE_DATABASE_URL``). When :mod:`gateway.db.migrate`
passes an open connection we migrate on it; otherwise (plain ``alembic`` CLI) we
open an async engine and run the migrations through ``run_sync``.
"""

from __future__ import annotations

import asyncio
from logging.config import fileConfig

from alembic import context

from gateway.db.models import Base

config = context.config
if config.config_file_name is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def database_url() -> str:
    url = config.attributes.get("database_url")
    if url:
        return url
    from gateway.core.config import Settings

    return Settings().database_url


def do_run_migrations(connection) -> None:  # noqa: ANN001
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # ALTER TABLE via copy on SQLite
    )
    with context.begin_transaction():
        context.run_migrations()


async def run_async_migrations(url: str) -> None:
    from gateway.db.session import make_engine

    engine = make_engine(url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(do_run_migrations)
    finally:
        await engine.dispose()


if context.is_offline_mode():
    context.configure(url=database_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
elif (conn := config.attributes.get("connection")) is not None:
    do_run_migrations(conn)
else:
    asyncio.run(run_async_migrations(database_url()))
