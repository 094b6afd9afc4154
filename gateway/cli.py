"""``sparkgate`` command line: serve, manage API keys, migrate the database.

    sparkgate serve [--host H] [--port P]   migrate, create a first key if none exists, run uvicorn
    sparkgate keys create --tenant NAME [--user LABEL]   print a new key (once)
    sparkgate keys list
    sparkgate keys revoke PREFIX            prefix as shown by `keys list` (or the full key)
    sparkgate db upgrade [REV]              default: head
    sparkgate db downgrade REV              e.g. base

Configuration comes from ``SPARKGATE_*`` environment variables / ``.env``
(:class:`gateway.core.config.Settings`). New keys go to stdout alone, so
``KEY=$(sparkgate keys create --tenant acme)`` works; notes go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Callable

from gateway.core.config import Settings
from gateway.crud import keys as crud_keys
from gateway.db import migrate
from gateway.db.session import make_engine, make_sessionmaker


def _note(msg: str) -> None:
    print(msg, file=sys.stderr)


async def _with_session(fn: Callable) -> object:
    engine = make_engine(Settings().database_url)
    try:
        async with make_sessionmaker(engine)() as session:
            return await fn(session)
    finally:
        await engine.dispose()


def quickstart(key: str, settings: Settings) -> str:
    """Ready-to-paste curl and OpenAI-SDK snippets for ``key``."""
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    base = f"http://{host}:{settings.port}/v1"
    body = json.dumps({"model": settings.model_name, "stream": True,
                       "messages": [{"role": "user", "content": "Hello!"}]})
    return f"""
curl {base}/chat/completions \\
  -H "Authorization: Bearer {key}" \\
  -H "Content-Type: application/json" \\
  -d '{body}'

from openai import OpenAI
client = OpenAI(base_url="{base}", api_key="{key}")
stream = client.chat.completions.create(
    model="{settings.model_name}", messages=[{{"role": "user", "content": "Hello!"}}], stream=True)
for chunk in stream:
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
"""


def bootstrap_key(settings: Settings) -> str | None:
    """Create a key for tenant ``default`` when the database has no key at all; returns it."""

    async def run(session):
        if await crud_keys.count_keys(session):
            return None
        _, plaintext = await crud_keys.create_key(session, "default", "bootstrap")
        return plaintext

    return asyncio.run(_with_session(run))


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.main import create_app

    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    settings = Settings(**overrides)
    migrate.upgrade(settings.database_url)
    key = bootstrap_key(settings)
    if key is not None:
        print("Created the first API key (tenant 'default'). It is shown only this once:\n")
        print(f"    {key}")
        print(quickstart(key, settings), flush=True)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port)
    return 0


def cmd_keys_create(args: argparse.Namespace) -> int:
    async def run(session):
        row, plaintext = await crud_keys.create_key(session, args.tenant, args.user)
        return row.prefix, plaintext

    prefix, plaintext = asyncio.run(_with_session(run))
    print(plaintext, flush=True)
    _note(f"Created key {prefix}… for tenant {args.tenant!r}. Store it now; it cannot be shown again.")
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    rows = asyncio.run(_with_session(crud_keys.list_keys))
    fmt = "{:<14} {:<20} {:<16} {:<8} {:<20} {:<20}"
    print(fmt.format("PREFIX", "TENANT", "USER", "STATUS", "CREATED", "LAST USED"))

    def ts(value):
        return value.strftime("%Y-%m-%d %H:%M:%S") if value else "-"

    for row in rows:
        print(fmt.format(row.prefix, row.tenant.name, row.user_label or "-", row.status(),
                         ts(row.created_at), ts(row.last_used_at)))
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    try:
        row = asyncio.run(_with_session(lambda s: crud_keys.revoke_key(s, args.prefix)))
    except crud_keys.AmbiguousPrefixError as exc:
        _note(f"error: {exc}")
        return 2
    if row is None:
        _note(f"error: no key with prefix {args.prefix!r}")
        return 1
    print(f"revoked {row.prefix} (tenant {row.tenant.name!r})")
    _note("A running server stops accepting it within its auth cache TTL (default 5 s).")
    return 0


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    migrate.upgrade(Settings().database_url, args.revision)
    _note(f"database upgraded to {args.revision}")
    return 0


def cmd_db_downgrade(args: argparse.Namespace) -> int:
    migrate.downgrade(Settings().database_url, args.revision)
    _note(f"database downgraded to {args.revision}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparkgate", description="Sparkgate OpenAI-compatible gateway")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="migrate the database and run the HTTP server")
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=None)
    serve.set_defaults(func=cmd_serve)

    keys = sub.add_parser("keys", help="manage API keys").add_subparsers(dest="keys_command", required=True)
    create = keys.add_parser("create", help="create a key and print it once")
    create.add_argument("--tenant", required=True)
    create.add_argument("--user", default=None, help="user label stored with the key")
    create.set_defaults(func=cmd_keys_create)
    keys.add_parser("list", help="list keys (prefixes only)").set_defaults(func=cmd_keys_list)
    revoke = keys.add_parser("revoke", help="revoke a key by its prefix")
    revoke.add_argument("prefix")
    revoke.set_defaults(func=cmd_keys_revoke)

    db = sub.add_parser("db", help="database migrations").add_subparsers(dest="db_command", required=True)
    up = db.add_parser("upgrade", help="migrate up (default: head)")
    up.add_argument("revision", nargs="?", default="head")
    up.set_defaults(func=cmd_db_upgrade)
    down = db.add_parser("downgrade", help="migrate down to REV")
    down.add_argument("revision")
    down.set_defaults(func=cmd_db_downgrade)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
