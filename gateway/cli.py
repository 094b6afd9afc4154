"""``sparkgate`` command line: serve, manage API keys, migrate the database.

    sparkgate serve [--host H] [--port P]   migrate, create a first key if none exists, run uvicorn
    sparkgate keys create --tenant NAME [--user LABEL] [--budget TOKENS] [--rpm N] [--tpm N]
                                            print a new key (once)
    sparkgate keys list
    sparkgate keys revoke PREFIX            prefix as shown by `keys list` (or the full key)
    sparkgate tiers create NAME [--min-tps X] [--max-concurrent N] [--rpm N] [--tpm N]
                                [--priority P] [--max-queue-wait S]
    sparkgate tiers update NAME [same options; "none" clears a limit]
    sparkgate tiers list
    sparkgate tenants create NAME [--tier T]
    sparkgate tenants set-tier NAME TIER    TIER "default" → the default tier
    sparkgate tenants list
    sparkgate db upgrade [REV]              default: head
    sparkgate db downgrade REV              e.g. base

A new tenant or tier NAME has 1–64 letters, digits, ``.``, ``_``, ``@`` or ``-`` and starts
with a letter or digit (:func:`gateway.core.text.name_problem`, as the admin API); an
invalid name or user label is refused with exit code 2 before the database is touched.

Configuration comes from ``SPARKGATE_*`` environment variables / ``.env``
(:class:`gateway.core.config.Settings`). New keys go to stdout alone, so
``KEY=$(sparkgate keys create --tenant acme)`` works; notes go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Callable

from gateway.core.config import Settings
from gateway.crud import keys as crud_keys
from gateway.crud import tenants as crud_tenants
from gateway.crud import tiers as crud_tiers
from gateway.db import migrate
from gateway.db.session import make_engine, make_sessionmaker
from gateway.core.text import label_problem, name_problem


def _note(msg: str) -> None:
    print(msg, file=sys.stderr)


def _bad_argument(args: argparse.Namespace, names: tuple = (), refs: tuple = (), labels: tuple = ()) -> int | None:
    """2 (after saying why on stderr) when an argument is not a valid new tenant/tier name
    (``names``), name of an existing one (``refs``; :func:`gateway.core.text.name_problem`,
    the check the admin API uses) or user label (``labels``); None when all are fine."""
    checks = ((names, name_problem), (refs, lambda v: name_problem(v, existing=True)), (labels, label_problem))
    for dests, problem_of in checks:
        for dest in dests:
            value = getattr(args, dest)
            problem = value is not None and problem_of(value)
            if problem:
                _note(f"error: invalid {dest} {ascii(value)}: {problem}")
                return 2
    return None


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
    import signal

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
    # uvicorn re-raises a captured SIGTERM after its graceful shutdown, with the handler
    # that was installed before it ran; by default that kills the process (exit -15) after
    # a clean drain. A no-op handler makes a SIGTERM-requested stop exit 0.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        uvicorn.run(create_app(settings), host=settings.host, port=settings.port,
                    timeout_graceful_shutdown=settings.shutdown_timeout_s)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def cmd_keys_create(args: argparse.Namespace) -> int:
    if (rc := _bad_argument(args, names=("tenant",), labels=("user",))) is not None:
        return rc

    async def run(session):
        row, plaintext = await crud_keys.create_key(session, args.tenant, args.user, token_budget=args.budget,
                                                    rpm_limit=args.rpm, tpm_limit=args.tpm)
        return row.prefix, plaintext

    prefix, plaintext = asyncio.run(_with_session(run))
    print(plaintext, flush=True)
    _note(f"Created key {prefix}… for tenant {args.tenant!r}. Store it now; it cannot be shown again.")
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    rows = asyncio.run(_with_session(crud_keys.list_keys))
    fmt = "{:<5} {:<14} {:<20} {:<16} {:<8} {:<20} {:<20} {:>12} {:>12}"
    print(fmt.format("ID", "PREFIX", "TENANT", "USER", "STATUS", "CREATED", "LAST USED", "TOKENS USED", "BUDGET"))

    def ts(value):
        return value.strftime("%Y-%m-%d %H:%M:%S") if value else "-"

    for row in rows:
        print(fmt.format(row.id, row.prefix, row.tenant.name, row.user_label or "-", row.status(),
                         ts(row.created_at), ts(row.last_used_at), row.tokens_used or 0,
                         "-" if row.token_budget is None else row.token_budget))
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    if (rc := _bad_argument(args, labels=("prefix",))) is not None:
        return rc
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


TIER_OPTIONS = (("--min-tps", "min_tokens_per_s", float, "decode tokens/s promised per user"),
                ("--max-concurrent", "max_concurrent", int, "requests in the engine per tenant"),
                ("--rpm", "rpm", int, "requests per minute per tenant"),
                ("--tpm", "tpm", int, "tokens per minute per tenant (prompt + max_tokens)"),
                ("--priority", "priority", int, "larger = more important"),
                ("--max-queue-wait", "max_queue_wait_s", float, "seconds a request may wait before 429"))


def _optional(kind: type) -> Callable[[str], object]:
    """Parse a number, or ``none`` (clear the limit)."""

    def parse(text: str) -> object:
        return _CLEAR if text.lower() in ("none", "null", "unlimited") else kind(text)

    return parse


_CLEAR = object()


def _tier_fields(args: argparse.Namespace) -> dict:
    out = {}
    for _, dest, _, _ in TIER_OPTIONS:
        value = getattr(args, dest)
        if value is not None:
            out[dest] = None if value is _CLEAR else value
    return out


def _print_tiers(rows) -> None:
    fmt = "{:<16} {:>8} {:>8} {:>10} {:>8} {:>10} {:>10}"
    print(fmt.format("TIER", "PRIORITY", "MIN TPS", "CONCURRENT", "RPM", "TPM", "MAX WAIT"))

    def v(x):
        return "-" if x is None else f"{x:g}"

    for t in rows:
        print(fmt.format(t.name, t.priority, v(t.min_tokens_per_s), v(t.max_concurrent), v(t.rpm), v(t.tpm),
                         f"{t.max_queue_wait_s:g}s"))


def _run_tier_cmd(fn: Callable, args: argparse.Namespace, existing: bool) -> int:
    if (rc := _bad_argument(args, **{"refs" if existing else "names": ("name",)})) is not None:
        return rc
    try:
        row = asyncio.run(_with_session(lambda s: fn(s, args.name, **_tier_fields(args))))
    except ValueError as exc:
        _note(f"error: {exc}")
        return 2
    if row is None:
        _note(f"error: no tier named {args.name!r}")
        return 1
    _print_tiers([row])
    return 0


def cmd_tiers_create(args: argparse.Namespace) -> int:
    return _run_tier_cmd(crud_tiers.create_tier, args, existing=False)


def cmd_tiers_update(args: argparse.Namespace) -> int:
    rc = _run_tier_cmd(crud_tiers.update_tier, args, existing=True)
    if rc == 0:
        _note(f"Running servers apply it within their cache TTL ({Settings().auth_cache_ttl_s:g} s).")
    return rc


def cmd_tiers_list(args: argparse.Namespace) -> int:
    _print_tiers(asyncio.run(_with_session(crud_tiers.list_tiers)))
    return 0


def cmd_tenants_create(args: argparse.Namespace) -> int:
    if (rc := _bad_argument(args, names=("name",), refs=("tier",))) is not None:
        return rc
    try:
        row = asyncio.run(_with_session(lambda s: crud_tenants.create_tenant(s, args.name, args.tier)))
    except (crud_tenants.TenantExistsError, crud_tenants.UnknownTierError) as exc:
        _note(f"error: {exc}")
        return 1
    print(f"created tenant {row.name!r} (tier {row.tier.name if row.tier else 'default'})")
    return 0


def cmd_tenants_set_tier(args: argparse.Namespace) -> int:
    if (rc := _bad_argument(args, refs=("name", "tier"))) is not None:
        return rc
    tier = None if args.tier == Settings().default_tier else args.tier
    try:
        row = asyncio.run(_with_session(lambda s: crud_tenants.set_tier(s, args.name, tier)))
    except crud_tenants.UnknownTierError as exc:
        _note(f"error: {exc}")
        return 1
    if row is None:
        _note(f"error: no tenant named {args.name!r}")
        return 1
    print(f"tenant {row.name!r} is now in tier {row.tier.name if row.tier else args.tier!r}")
    return 0


def cmd_tenants_list(args: argparse.Namespace) -> int:
    default = Settings().default_tier
    fmt = "{:<24} {:<16} {:<20}"
    print(fmt.format("TENANT", "TIER", "CREATED"))
    for t in asyncio.run(_with_session(crud_tenants.list_tenants)):
        tier = t.tier.name if t.tier else f"({default})"
        print(fmt.format(t.name, tier, t.created_at.strftime("%Y-%m-%d %H:%M:%S")))
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
    create.add_argument("--budget", type=int, default=None, help="total tokens this key may use")
    create.add_argument("--rpm", type=int, default=None, help="requests per minute for this key")
    create.add_argument("--tpm", type=int, default=None, help="tokens per minute for this key")
    create.set_defaults(func=cmd_keys_create)
    keys.add_parser("list", help="list keys (prefixes only)").set_defaults(func=cmd_keys_list)
    revoke = keys.add_parser("revoke", help="revoke a key by its prefix")
    revoke.add_argument("prefix")
    revoke.set_defaults(func=cmd_keys_revoke)

    tiers = sub.add_parser("tiers", help="manage SLA tiers").add_subparsers(dest="tiers_command", required=True)
    for name, func, helptext in (("create", cmd_tiers_create, "create a tier"),
                                 ("update", cmd_tiers_update, "change a tier (none clears a limit)")):
        p = tiers.add_parser(name, help=helptext)
        p.add_argument("name")
        for flag, dest, kind, h in TIER_OPTIONS:
            p.add_argument(flag, dest=dest, type=_optional(kind), default=None, help=h)
        p.set_defaults(func=func)
    tiers.add_parser("list", help="list tiers").set_defaults(func=cmd_tiers_list)

    tenants = sub.add_parser("tenants", help="manage tenants").add_subparsers(dest="tenants_command", required=True)
    tc = tenants.add_parser("create", help="create a tenant")
    tc.add_argument("name")
    tc.add_argument("--tier", default=None)
    tc.set_defaults(func=cmd_tenants_create)
    st = tenants.add_parser("set-tier", help="put a tenant in a tier")
    st.add_argument("name")
    st.add_argument("tier")
    st.set_defaults(func=cmd_tenants_set_tier)
    tenants.add_parser("list", help="list tenants and their tiers").set_defaults(func=cmd_tenants_list)

    for name, (_, _, help_text) in PASSTHROUGH.items():  # listed in --help; dispatched in main()
        sub.add_parser(name, add_help=False, help=help_text)
    db = sub.add_parser("db", help="database migrations").add_subparsers(dest="db_command", required=True)
    up = db.add_parser("upgrade", help="migrate up (default: head)")
    up.add_argument("revision", nargs="?", default="head")
    up.set_defaults(func=cmd_db_upgrade)
    down = db.add_parser("downgrade", help="migrate down to REV")
    down.add_argument("revision")
    down.set_defaults(func=cmd_db_downgrade)
    return parser


# Subcommands whose options belong to another tool: their argv is passed through
# untouched (argparse cannot forward unknown flags such as SGLang's --model-path).
PASSTHROUGH = {
    "sglang-launch": ("runtime.sglang.launch", [], "install the SLA plugin into SGLang's env and exec sglang.launch_server with DSpark"),
    "profile": ("runtime.engine.profile", [], "measure the engine's SPS table (rounds/s vs verification tokens) and cache it"),
    "regen-data": ("training.cli", ["regen"], "regenerate drafter training responses with the target (resumable)"),
    "build-features": ("training.cli", ["build-features"], "cache the target's teacher features for drafter training (resumable)"),
    "train-drafter": ("training.cli", ["train"], "train a DSpark drafter (online or cached target features)"),
    "calibrate-drafter": ("training.cli", ["calibrate"], "fit STS temperatures into a drafter checkpoint"),
    "eval": ("training.cli", ["eval"], "accepted length τ on the DeepSpec eval sets"),
    "bench": ("", [], "run a benchmark script of bench/ (JSON out): sparkgate bench NAME [ARGS]; no NAME lists them"),
}

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def _bench(argv: list[str]) -> int:
    """``sparkgate bench NAME ARGS…`` → ``bench/NAME.py ARGS…`` as ``__main__`` (the scripts
    live in the checkout, not in the installed package)."""
    import runpy

    scripts = sorted(p.stem for p in BENCH_DIR.glob("*.py")) if BENCH_DIR.is_dir() else []
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in scripts:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown benchmark {argv[0]!r}", file=sys.stderr)
        print("usage: sparkgate bench NAME [ARGS...]; NAME one of: " + (", ".join(scripts) or f"(none in {BENCH_DIR})"))
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    root = str(BENCH_DIR.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    old = sys.argv
    sys.argv = [str(BENCH_DIR / f"{argv[0]}.py"), *argv[1:]]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    finally:
        sys.argv = old
    return 0


def _passthrough(name: str, argv: list[str]) -> int:
    import importlib

    if name == "bench":
        return _bench(argv)
    module, prefix, _ = PASSTHROUGH[name]
    return int(importlib.import_module(module).main(prefix + argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in PASSTHROUGH:
        return _passthrough(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
