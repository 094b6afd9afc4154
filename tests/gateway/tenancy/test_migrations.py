"""Migration 0002_tenancy on SQLite and a real Postgres: existing tenants and keys survive
0001 → 0002 → 0001, the default tier is seeded, and base → head → base → head works."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import inspect, select, text

from gateway.core.security import key_digest
from gateway.crud import keys as crud_keys
from gateway.crud import records as crud_records
from gateway.crud import tenants as crud_tenants
from gateway.crud import tiers as crud_tiers
from gateway.db import migrate
from gateway.db.models import ApiKey
from gateway.db.session import make_engine, make_sessionmaker
from gateway.observability.records import record_row
from tests.support.gateway_fixtures import sqlite_url
from tests.support.tenancy_fixtures import outcome

TENANCY_TABLES = {"sla_tiers", "request_records", "usage_rollups"}


async def inspect_db(url: str) -> dict:
    engine = make_engine(url)
    try:
        async with engine.connect() as conn:
            def read(c):
                insp = inspect(c)
                tables = set(insp.get_table_names())
                out = {"tables": tables}
                if "request_records" in tables:
                    out["record_indexes"] = {i["name"] for i in insp.get_indexes("request_records")}
                    out["rollup_uniques"] = [u["column_names"] for u in insp.get_unique_constraints("usage_rollups")]
                    out["tenant_fks"] = [f["referred_table"] for f in insp.get_foreign_keys("tenants")]
                return out
            return await conn.run_sync(read)
    finally:
        await engine.dispose()


async def scenario(url: str) -> None:
    await migrate.upgrade_async(url, "0001_initial")
    key = "sk-sg-" + uuid.uuid4().hex
    engine = make_engine(url)
    async with engine.begin() as conn:  # data as 0001 wrote it (today's ORM models need 0002)
        await conn.execute(text("INSERT INTO tenants (id, name) VALUES (1, 'acme')"))
        await conn.execute(text("INSERT INTO api_keys (id, digest, prefix, tenant_id, user_label, token_budget) "
                                "VALUES (1, :d, :p, 1, 'alice', 100)"), {"d": key_digest(key), "p": key[:12]})
    await engine.dispose()
    await migrate.upgrade_async(url)
    sm = make_sessionmaker(make_engine(url))
    assert await migrate.current_revision_async(url) == migrate.head_revision()
    info = await inspect_db(url)
    assert TENANCY_TABLES <= info["tables"]
    # SQLite: no FK (adding one would rebuild tenants and cascade-delete every key)
    assert info["tenant_fks"] == ([] if url.startswith("sqlite") else ["sla_tiers"])
    assert {"ix_request_records_tenant_finished", "ix_request_records_tenant_user_finished",
            "ix_request_records_finished_at"} <= info["record_indexes"]
    assert ["minute", "tenant", "user", "tier", "model"] in info["rollup_uniques"]
    async with sm() as s:
        row = await s.scalar(select(ApiKey))
        assert (row.tokens_used, row.token_budget, row.rpm_limit) == (0, 100, None)  # the old key survived
        assert (await crud_keys.authenticate(s, key_digest(key))).tenant == "acme"
        default = await crud_tiers.get_tier(s, "default")
        assert default.id == 1 and default.rpm is None and default.max_queue_wait_s == 10.0
        assert (await crud_tenants.get_tenant(s, "acme")).tier is None
        gold = await crud_tiers.create_tier(s, "gold", rpm=120, priority=10)
        assert gold.id == 2  # the sequence continues after the seeded row (Postgres)
        await crud_tenants.set_tier(s, "acme", "gold")
        r = record_row(outcome(1))
        r["key_id"] = row.id
        await crud_records.insert_records(s, [r])
        s.expire_all()
        assert (await s.scalar(select(ApiKey))).tokens_used == 16
    await sm.kw["bind"].dispose()

    await migrate.downgrade_async(url, "0001_initial")
    info = await inspect_db(url)
    assert not TENANCY_TABLES & info["tables"] and {"tenants", "api_keys"} <= info["tables"]
    engine = make_engine(url)
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM api_keys"))).scalar() == 1
    await engine.dispose()
    await migrate.downgrade_async(url, "base")
    assert not ({"tenants", "api_keys"} | TENANCY_TABLES) & (await inspect_db(url))["tables"]
    await migrate.upgrade_async(url)
    assert TENANCY_TABLES <= (await inspect_db(url))["tables"]


async def test_sqlite_0002_round_trip_keeps_keys(tmp_path):
    await scenario(sqlite_url(tmp_path / "mig.db"))


@pytest.mark.postgres
async def test_postgres_0002_round_trip_keeps_keys(pg_empty_url):
    await scenario(pg_empty_url)


RECORD_COLUMNS_0005 = {"constraint", "mask_ms_per_token"}
ROLLUP_COLUMNS_0005 = {"constrained_spec_rounds", "constrained_spec_drafted", "constrained_spec_accepted",
                       "constrained_spec_emitted"}


async def columns(url: str, table: str) -> set[str]:
    engine = make_engine(url)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(lambda c: {col["name"] for col in inspect(c).get_columns(table)})
    finally:
        await engine.dispose()


async def constraint_scenario(url: str) -> None:
    """0003 → 0005: a record and a rollup written before get the new columns (NULL: free
    text; constrained sums 0) and keep everything else; a constrained record written after is
    stored whole; 0005 → 0003 drops exactly those columns and keeps the rows."""
    await migrate.upgrade_async(url, "0003_billed_usage")
    old = record_row(outcome(1))
    engine = make_engine(url)
    async with engine.begin() as conn:  # as 0003's code wrote them (no new columns)
        cols = [c for c in old if c not in RECORD_COLUMNS_0005]
        await conn.execute(text(f"INSERT INTO request_records ({', '.join(repr_col(c) for c in cols)}) "
                                f"VALUES ({', '.join(':' + c for c in cols)})"),
                           {c: old[c] for c in cols} | {"accepted_per_position": None,
                                                         "queued_at": old["queued_at"].replace(tzinfo=None),
                                                         "finished_at": old["finished_at"].replace(tzinfo=None)})
    await engine.dispose()
    assert not RECORD_COLUMNS_0005 & await columns(url, "request_records")
    await migrate.upgrade_async(url)
    assert RECORD_COLUMNS_0005 <= await columns(url, "request_records")
    assert ROLLUP_COLUMNS_0005 <= await columns(url, "usage_rollups")
    sm = make_sessionmaker(make_engine(url))
    async with sm() as s:
        (rec,), _ = await crud_records.query_records(s, limit=10)
        assert (rec.id, rec.completion_tokens, rec.constraint, rec.mask_ms_per_token) == ("req-1", 11, None, None)
        new = outcome(2)
        new.ctx.constraint, new.grammar_mask_s = "tools", 0.0022
        await crud_records.insert_records(s, [record_row(new)])
        minute = crud_records.minute_of(record_row(new)["finished_at"])
        await crud_records.recompute_rollups(s, {(minute, "acme")})
        (rec2,) = [r for r in (await crud_records.query_records(s, limit=10))[0] if r.id == "req-2"]
        assert (rec2.constraint, rec2.mask_ms_per_token) == ("tools", pytest.approx(0.2))
    await sm.kw["bind"].dispose()
    await migrate.downgrade_async(url, "0003_billed_usage")
    assert not RECORD_COLUMNS_0005 & await columns(url, "request_records")
    assert not ROLLUP_COLUMNS_0005 & await columns(url, "usage_rollups")
    engine = make_engine(url)
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM request_records"))).scalar() == 2
        assert (await conn.execute(text("SELECT count(*) FROM usage_rollups"))).scalar() >= 1
    await engine.dispose()
    await migrate.upgrade_async(url)
    assert await migrate.current_revision_async(url) == migrate.head_revision()


def repr_col(name: str) -> str:
    return '"user"' if name == "user" else name  # a reserved word in Postgres


async def test_sqlite_0005_adds_and_drops_the_constraint_columns(tmp_path):
    await constraint_scenario(sqlite_url(tmp_path / "mig.db"))


@pytest.mark.postgres
async def test_postgres_0005_adds_and_drops_the_constraint_columns(pg_empty_url):
    await constraint_scenario(pg_empty_url)
