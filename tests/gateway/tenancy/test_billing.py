"""Billing counts only served requests (:func:`gateway.observability.observe.is_served`), on SQLite and
Postgres: ``/v1/usage``, ``/admin/v1/usage/users``, ``api_keys.tokens_used`` and the
admission token budget agree; refused requests show up only as counts by status.
Migration ``0003_billed_usage`` recomputes the token sums of rollups written before."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy import insert, select

from gateway.crud import keys as crud_keys
from gateway.crud import records as crud_records
from gateway.db import migrate
from gateway.db.models import ApiKey, UTCDateTime
from gateway.db.session import make_engine, make_sessionmaker
from gateway.observability.observe import CANCELLED, FAILED, FINISHED, REJECTED
from gateway.observability.records import record_row
from tests.support.gateway_fixtures import chat, sqlite_url
from tests.support.tenancy_fixtures import ADMIN_HEADERS, bearer, new_key, running_app
from tests.support.tenancy_fixtures import outcome

PROMPT, COMPLETION = 6, 7  # chat("hi") templated by the FakeBackend; its script is 7 tokens long


async def test_refused_requests_are_counted_but_never_billed(tenancy_db):
    async with running_app(tenancy_db) as (app, client):
        backend = app.state.backend
        alice = bearer(await new_key(client, "acme", "alice", token_budget=PROMPT))
        bob = bearer(await new_key(client, "acme", "bob", rpm_limit=1))
        post = lambda h, **extra: client.post("/v1/chat/completions", json=chat("hi", **extra), headers=h)  # noqa: E731

        backend.fail_after_deltas = 0  # the engine fails before the first token: a 500, nothing served
        assert (await post(alice)).status_code == 500
        assert (await post(bob)).status_code == 500
        backend.fail_after_deltas = None
        backend.queue_full = True  # the engine queue refuses: 503
        assert (await post(alice)).status_code == 503
        backend.queue_full = False
        r = await post(alice, temperature=5)  # validation after auth: 400, never reaches admission
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
        served = await post(alice)  # the refusals above did not use alice's budget of PROMPT tokens
        assert served.status_code == 200, served.text
        assert served.json()["usage"] == {"prompt_tokens": PROMPT, "completion_tokens": COMPLETION,
                                          "total_tokens": PROMPT + COMPLETION}
        over = await post(alice)  # now the budget is used up
        assert over.status_code == 429 and over.json()["error"]["code"] == "insufficient_quota"
        limited = await post(bob)  # bob's one request per minute went to the engine failure
        assert limited.status_code == 429 and limited.json()["error"]["code"] == "rate_limit_exceeded"
        await client.post("/admin/v1/rollups/refresh", headers=ADMIN_HEADERS)

        usage = (await client.get("/v1/usage", headers=alice)).json()
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
            PROMPT, COMPLETION, PROMPT + COMPLETION)
        assert usage["requests"] == 6
        assert usage["requests_by_status"] == {"finished": 1, "failed": 2, "cancelled": 0, "rejected": 3}
        assert sum(p["completion_tokens"] for u in usage["data"] for p in u["points"]) == COMPLETION
        bob_usage = (await client.get("/v1/usage", params={"user": "bob"}, headers=alice)).json()
        assert (bob_usage["total_tokens"], bob_usage["requests_by_status"]["failed"],
                bob_usage["requests_by_status"]["rejected"]) == (0, 1, 1)

        users = (await client.get("/admin/v1/usage/users", params={"tenant": "acme"}, headers=ADMIN_HEADERS)).json()
        by_user = {u["user"]: u for u in users["data"]}
        a, b = by_user["alice"], by_user["bob"]
        assert (a["prompt_tokens"], a["completion_tokens"], a["total_tokens"]) == (PROMPT, COMPLETION, PROMPT + COMPLETION)
        assert a["requests_by_status"] == {"finished": 1, "failed": 1, "cancelled": 0, "rejected": 2}
        assert (a["requests"], a["finished"], a["failed"], a["rejected"]) == (4, 1, 1, 2)  # flat keys kept
        assert (b["prompt_tokens"], b["completion_tokens"], b["failed"], b["rejected"]) == (0, 0, 1, 1)

        keys = (await client.get("/admin/v1/keys", params={"tenant": "acme"}, headers=ADMIN_HEADERS)).json()["data"]
        assert {k["user"]: k["tokens_used"] for k in keys} == {"alice": PROMPT + COMPLETION, "bob": 0}
        # the refused requests' records keep their prompt size (what was asked), unbilled
        refused = (await client.get("/v1/requests", params={"status": "rejected"}, headers=alice)).json()["data"]
        assert sorted(r["error_code"] for r in refused) == ["insufficient_quota", "queue_full", "rate_limit_exceeded"]
        assert {r["prompt_tokens"] for r in refused} == {PROMPT}


async def test_served_is_what_the_engine_produced(tenancy_db):
    """Rollups and ``tokens_used`` from records of every kind of end (5 prompt tokens each)."""
    sm = make_sessionmaker(make_engine(tenancy_db))
    async with sm() as s:
        await crud_keys.create_key(s, "acme", "u")
        key_id = await s.scalar(select(ApiKey.id))
        rows = []
        for i, (status, completion) in enumerate([(FINISHED, 11), (CANCELLED, 3), (FAILED, 2),  # served
                                                  (CANCELLED, 0), (FAILED, 0), (REJECTED, 0)]):  # not served
            o = outcome(i, status=status)
            o.completion_tokens = completion
            rows.append({**record_row(o), "key_id": key_id})
        assert await crud_records.insert_records(s, rows) == 6
        await crud_records.recompute_rollups(s, {(crud_records.minute_of(rows[0]["finished_at"]), "acme")})
        minute = crud_records.minute_of(rows[0]["finished_at"])
        rollups = await crud_records.rollups(s, since=minute, until=minute + crud_records.MINUTE, tenant="acme")
        assert sum(r.prompt_tokens for r in rollups) == 3 * 5 and sum(r.completion_tokens for r in rollups) == 16
        assert crud_records.usage_totals(rollups) == {
            "requests": 6, "requests_by_status": {"finished": 1, "failed": 2, "cancelled": 2, "rejected": 1},
            "prompt_tokens": 15, "completion_tokens": 16, "total_tokens": 31}
        s.expire_all()
        assert (await crud_keys.get_key(s, key_id)).tokens_used == 15 + 16
    await sm.kw["bind"].dispose()


# The tables as 0002/0003 knew them (later revisions add columns today's ORM models map).
ZEROS = {c: 0 for c in ("requests", "finished", "failed", "cancelled", "rejected", "decode_tps_samples",
                         "sla_requests", "sla_met", "spec_rounds", "spec_drafted", "spec_accepted", "spec_emitted")}
OLD_ROLLUPS = sa.table("usage_rollups", sa.column("minute", UTCDateTime()),
                       *[sa.column(c) for c in ("tenant", "user", "tier", "model", "prompt_tokens",
                                                "completion_tokens", *ZEROS)])
ADDED_LATER = {"constraint", "mask_ms_per_token"}  # request_records columns of 0005_record_constraint


async def rollup_sums_across_0003(url: str) -> None:
    """Rollups as 0002's code wrote them (every record summed) → served sums → back."""
    await migrate.upgrade_async(url, "0002_tenancy")
    m0 = datetime(2026, 11, 30, 10, 0, tzinfo=timezone.utc)
    minutes = [m0 + timedelta(minutes=k) for k in (-60, 0, 1, 2)]  # -60: its records were pruned
    records = [(0, "u", 5, FINISHED, 11), (0, "u", 9, REJECTED, 0), (0, "u", 20, CANCELLED, 0),
               (0, "u", 30, FAILED, 2), (1, "v", 5, REJECTED, 0), (2, "u", 5, FINISHED, 11)]
    old_sums = {(-60, "u"): (99, 7), (0, "u"): (20, 13), (1, "v"): (5, 0), (2, "u"): (5, 11)}
    sm = make_sessionmaker(make_engine(url))
    async with sm() as s:
        rows = []
        for i, (m, user, sec, status, completion) in enumerate(records):
            o = outcome(i, user=user, status=status, finished_at=m0 + timedelta(minutes=m, seconds=sec))
            o.completion_tokens = completion
            rows.append({k: v for k, v in record_row(o).items() if k not in ADDED_LATER})
        await crud_records.insert_records(s, rows)
        await s.execute(insert(OLD_ROLLUPS), [dict(minute=m0 + timedelta(minutes=m), tenant="acme", user=user,
                                                   tier="gold", model="m", prompt_tokens=p, completion_tokens=c, **ZEROS)
                                              for (m, user), (p, c) in old_sums.items()])
        await s.commit()

    async def sums() -> dict:
        async with sm() as s:
            got = (await s.execute(select(OLD_ROLLUPS).where(OLD_ROLLUPS.c.minute >= minutes[0]))).all()
        return {(round((r.minute - m0).total_seconds() / 60), r.user): (r.prompt_tokens, r.completion_tokens)
                for r in got}

    billed = {**old_sums, (0, "u"): (10, 13), (1, "v"): (0, 0)}  # rejected/cancelled/failed before a token: 0
    await migrate.upgrade_async(url, "0003_billed_usage")
    assert await migrate.current_revision_async(url) == "0003_billed_usage"
    assert await sums() == billed
    await migrate.downgrade_async(url, "0002_tenancy")
    assert await sums() == old_sums
    await migrate.upgrade_async(url, "0003_billed_usage")
    assert await sums() == billed
    await migrate.upgrade_async(url)  # the later revisions keep the sums
    assert await migrate.current_revision_async(url) == migrate.head_revision()
    assert await sums() == billed
    await sm.kw["bind"].dispose()


async def test_sqlite_0003_recomputes_billed_rollups(tmp_path):
    await rollup_sums_across_0003(sqlite_url(tmp_path / "mig.db"))


@pytest.mark.postgres
async def test_postgres_0003_recomputes_billed_rollups(pg_empty_url):  # noqa: F811
    await rollup_sums_across_0003(pg_empty_url)


def test_live_server_bills_what_the_real_engine_served(live_server):
    """The real model: a served request and a stream the client drops after some tokens are
    billed (the drop for the tokens produced); a 400 and an rpm 429 are not."""
    base, admin = live_server.base_url, bearer(live_server.admin_token)
    with httpx.Client(base_url=base, timeout=300) as c:
        key = c.post("/admin/v1/keys", json={"tenant": "live-billing", "user": "bea", "rpm_limit": 2},
                     headers=admin).json()["key"]
        body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Count to fifty."}],
                "temperature": 0, "ignore_eos": True}
        served = c.post("/v1/chat/completions", json={**body, "max_tokens": 8}, headers=bearer(key))
        assert served.status_code == 200, served.text
        with c.stream("POST", "/v1/chat/completions", json={**body, "max_tokens": 1000, "stream": True},
                      headers=bearer(key)) as r:
            lines = r.iter_lines()  # keep the iterator: dropping it would disconnect before we read
            assert r.status_code == 200 and any(ln.startswith("data: ") and '"content"' in ln for ln in lines)
        bad = c.post("/v1/chat/completions", json={**body, "temperature": 5}, headers=bearer(key))
        assert bad.status_code == 400
        limited = c.post("/v1/chat/completions", json=body, headers=bearer(key))
        assert limited.status_code == 429 and limited.json()["error"]["code"] == "rate_limit_exceeded"
        deadline = time.monotonic() + 60  # the dropped stream's record lands once the server sees the disconnect
        while True:
            assert c.post("/admin/v1/rollups/refresh", headers=admin).status_code == 204
            recs = {r["status"]: r for r in c.get("/v1/requests", headers=bearer(key)).json()["data"]}
            if "cancelled" in recs or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert sorted(recs) == ["cancelled", "finished", "rejected"]
        cancelled, rejected = recs["cancelled"], recs["rejected"]
        assert 1 <= cancelled["completion_tokens"] < 1000 and rejected["prompt_tokens"] > 0
        usage = c.get("/v1/usage", headers=bearer(key)).json()
        u = served.json()["usage"]
        assert usage["prompt_tokens"] == u["prompt_tokens"] + cancelled["prompt_tokens"]
        assert usage["completion_tokens"] == 8 + cancelled["completion_tokens"]
        assert usage["requests_by_status"] == {"finished": 1, "failed": 0, "cancelled": 1, "rejected": 1}
        keys = c.get("/admin/v1/keys", params={"tenant": "live-billing"}, headers=admin).json()["data"]
        assert keys[0]["tokens_used"] == usage["total_tokens"]
