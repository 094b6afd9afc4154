"""Alembic migrations: upgrade → downgrade → upgrade on SQLite and on a real Postgres.

Postgres: a fresh, uniquely named database on 127.0.0.1:5432 (user ``postgres``, trust
auth) is created for the test session and dropped at the end. When the server is
unreachable the Postgres tests are skipped locally and FAIL under ``CI=true``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import inspect
from sqlalchemy.exc import IntegrityError

from gateway.core.security import key_digest
from gateway.crud import keys as crud_keys
from gateway.crud import responses as crud_responses
from gateway.db import migrate
from gateway.db.models import Tenant
from gateway.db.session import make_engine, make_sessionmaker
from tests.support.gateway_fixtures import sqlite_url

REPO = Path(__file__).resolve().parents[3]

RESPONSE_COLUMNS = {"id": False, "tenant": False, "created_at": False, "model": False, "status": False,
                    "previous_response_id": True, "input_items": False, "output_items": False, "body": False}
API_KEY_COLUMNS = {"id", "digest", "prefix", "tenant_id", "user_label", "created_at", "last_used_at",
                   "expires_at", "revoked_at", "token_budget", "tokens_used", "rpm_limit", "tpm_limit"}


async def schema(url: str) -> dict:
    engine = make_engine(url)
    try:
        async with engine.connect() as conn:
            def read(sync_conn):
                insp = inspect(sync_conn)
                tables = set(insp.get_table_names())
                out = {"tables": tables}
                if "api_keys" in tables:
                    out["api_keys"] = {c["name"]: c["nullable"] for c in insp.get_columns("api_keys")}
                    out["indexes"] = {i["name"]: bool(i["unique"]) for i in insp.get_indexes("api_keys")}
                    out["fks"] = [(f["referred_table"], f["constrained_columns"]) for f in insp.get_foreign_keys("api_keys")]
                    out["tenants"] = {c["name"] for c in insp.get_columns("tenants")}
                    out["tenant_uniques"] = [u["column_names"] for u in insp.get_unique_constraints("tenants")]
                if "responses" in tables:
                    out["responses"] = {c["name"]: c["nullable"] for c in insp.get_columns("responses")}
                    out["response_indexes"] = {i["name"]: i["column_names"] for i in insp.get_indexes("responses")}
                    out["response_pk"] = insp.get_pk_constraint("responses")["constrained_columns"]
                return out
            return await conn.run_sync(read)
    finally:
        await engine.dispose()


async def exercise_schema(url: str) -> None:
    """Keys can be created, authenticated and revoked; uniqueness is enforced."""
    engine = make_engine(url)
    try:
        async with make_sessionmaker(engine)() as session:
            row, key = await crud_keys.create_key(session, "acme", "u1", token_budget=5_000_000_000)
            principal = await crud_keys.authenticate(session, key_digest(key))
            assert principal is not None and principal.tenant == "acme" and principal.token_budget == 5_000_000_000
            assert row.created_at.tzinfo is not None
            await crud_keys.revoke_key(session, key[:12])
            assert await crud_keys.authenticate(session, key_digest(key)) is None
            session.add(Tenant(name="acme"))
            with pytest.raises(IntegrityError):
                await session.commit()
        async with make_sessionmaker(engine)() as session:  # a stored response, readable by its tenant only
            obj = {"id": "resp_1", "model": "m", "status": "completed", "output": [{"type": "message"}], "x": "\x00é"}
            await crud_responses.save_response(session, "acme", obj, [{"type": "message", "content": "hi"}])
            row = await crud_responses.get_response(session, "resp_1", "acme")
            assert crud_responses.response_object(row) == obj and row.created_at.tzinfo is not None
            assert await crud_responses.get_response(session, "resp_1", "other") is None
            assert await crud_responses.delete_response(session, "resp_1", "other") is False
            assert await crud_responses.delete_response(session, "resp_1", "acme") is True
    finally:
        await engine.dispose()


async def round_trip(url: str) -> None:
    await migrate.upgrade_async(url)
    assert await migrate.current_revision_async(url) == migrate.head_revision()
    s = await schema(url)
    assert {"tenants", "api_keys", "alembic_version"} <= s["tables"]
    assert set(s["api_keys"]) == API_KEY_COLUMNS
    assert {k for k, nullable in s["api_keys"].items() if nullable} == {
        "user_label", "last_used_at", "expires_at", "revoked_at", "token_budget", "rpm_limit", "tpm_limit"}
    assert s["indexes"]["ix_api_keys_digest"] is True and s["indexes"]["ix_api_keys_prefix"] is False
    assert s["fks"] == [("tenants", ["tenant_id"])]
    assert s["tenants"] == {"id", "name", "created_at", "tier_id"} and ["name"] in s["tenant_uniques"]
    assert s["responses"] == RESPONSE_COLUMNS and s["response_pk"] == ["id"]
    assert s["response_indexes"] == {"ix_responses_tenant_created": ["tenant", "created_at"]}
    await exercise_schema(url)

    await migrate.downgrade_async(url, "0003_billed_usage")  # 0004 drops only its own table
    s = await schema(url)
    assert "responses" not in s["tables"] and {"tenants", "api_keys", "request_records"} <= s["tables"]
    await migrate.upgrade_async(url)
    assert "responses" in (await schema(url))["tables"]

    await migrate.downgrade_async(url, "base")
    assert await migrate.current_revision_async(url) is None
    assert not {"tenants", "api_keys", "responses"} & (await schema(url))["tables"]

    await migrate.upgrade_async(url)
    assert {"tenants", "api_keys"} <= (await schema(url))["tables"]
    await exercise_schema(url)  # fresh, empty tables again


async def test_sqlite_round_trip(tmp_path):
    await round_trip(sqlite_url(tmp_path / "rt.db"))


def test_sync_helpers_and_alembic_cli_use_settings_url(tmp_path):
    url = sqlite_url(tmp_path / "cli.db")
    migrate.upgrade(url)
    migrate.downgrade(url, "base")
    env = {**os.environ, "SPARKGATE_DATABASE_URL": url, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "alembic", "-c", str(REPO / "alembic.ini"), "upgrade", "head"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    import asyncio

    assert asyncio.run(migrate.current_revision_async(url)) == migrate.head_revision()


# ------------------------------------------------------------------------- Postgres


@pytest.mark.postgres
async def test_postgres_round_trip(pg_empty_url):
    await round_trip(pg_empty_url)
