"""Request records: one row per request whatever its end, a bounded buffer while the
database is down (overflow counted, drained on recovery, flushed at shutdown),
per-minute rollups, retention. SQLite and Postgres."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from gateway.crud import records as crud_records
from gateway.db.session import make_engine, make_sessionmaker
from gateway.observability.observe import RequestContext
from gateway.observability.records import RecordWriter, record_row
from runtime.interface import SpecStats
from tests.support.gateway_fixtures import chat
from tests.support.polling import async_wait_until
from tests.support.tenancy_fixtures import CountingBackend, bearer, new_key, outcome, running_app


def broken_sessionmaker(tmp_path):
    """Sessions on a database that cannot be opened (a directory that does not exist)."""
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path}/missing/dir/x.db")
    return make_sessionmaker(engine)


async def test_every_request_outcome_becomes_exactly_one_row(tenancy_db):
    backend = CountingBackend()
    async with running_app(tenancy_db, backend) as (app, client):
        key = await new_key(client, "acme", "label-user")
        h = bearer(key)
        statuses = []
        for i in range(6):  # finished, with and without the OpenAI user field, streaming and not
            r = await client.post("/v1/chat/completions", json=chat(stream=i % 2 == 1, return_spec_stats=True,
                                                                     **({"user": "end-user-7"} if i < 2 else {})),
                                  headers=h)
            statuses.append(r.status_code)
        backend.fail_after_deltas = 2
        await client.post("/v1/chat/completions", json=chat(stream=True), headers=h)  # failed mid-stream
        backend.fail_after_deltas = None
        backend.queue_full = True
        r = await client.post("/v1/chat/completions", json=chat(), headers=h)  # rejected by the engine
        backend.queue_full = False
        assert statuses == [200] * 6 and r.status_code == 503
        # cancelled: the consumer closes the stream early (what a client disconnect does;
        # httpx's ASGI transport buffers whole responses, so drive the observed stream directly)
        from gateway.observability.observe import observed
        from runtime.interface import GenerationRequest

        ctx = RequestContext("chatcmpl-cancel", "chat", "m", True, prompt_tokens=4, max_tokens=7, tenant="acme",
                             user="label-user")
        events = observed(backend.generate(GenerationRequest("chatcmpl-cancel", [1, 2, 3, 4])), ctx,
                          app.state.observers)
        await events.__anext__()
        await events.aclose()
        assert backend.aborted == ["chatcmpl-cancel"]
        await app.state.records.flush()
        async with app.state.sessionmaker() as s:
            rows, _ = await crud_records.query_records(s, limit=100)
    assert len(rows) == 9 == len({r.id for r in rows})
    assert sorted(r.status for r in rows) == ["cancelled", "failed"] + ["finished"] * 6 + ["rejected"]
    fin = [r for r in rows if r.status == "finished"]
    assert sorted(r.user for r in fin) == ["end-user-7"] * 2 + ["label-user"] * 4
    f = fin[0]
    assert (f.tenant, f.tier, f.model, f.completion_tokens, f.finish_reason) == ("acme", "default", "SmolLM2-135M-Instruct", 7, "stop")
    assert f.prompt_tokens > 0 and f.ttft_s is not None and f.decode_tokens_per_s > 0 and f.key_id is not None
    assert f.queued_at <= f.started_at <= f.first_token_at <= f.finished_at
    assert (f.spec_rounds, f.spec_drafted, f.spec_accepted, f.spec_emitted) == (3, 12, 4, 7)
    assert f.accepted_per_position == [3, 1] and f.spec_tau == pytest.approx(7 / 3)
    assert f.predicted_tokens_per_s > 0 and f.sla_target_tokens_per_s is None and f.sla_met is None
    failed = next(r for r in rows if r.status == "failed")
    assert failed.error_code == "engine_error" and failed.completion_tokens == 2
    rejected = next(r for r in rows if r.status == "rejected")
    assert rejected.error_code == "queue_full" and rejected.started_at is None
    cancelled = next(r for r in rows if r.status == "cancelled")
    assert 1 <= cancelled.completion_tokens < 7


async def test_database_down_buffers_to_a_bound_counts_overflow_and_drains(tenancy_db, tmp_path, caplog):
    good = make_sessionmaker(make_engine(tenancy_db))
    w = RecordWriter(broken_sessionmaker(tmp_path), max_buffer=5, batch_size=2, flush_interval_s=0.02)
    w.start()
    caplog.set_level(logging.WARNING, "gateway.observability.records")
    for i in range(8):
        w.request_ended(outcome(i))  # returns at once although the database is down
    await async_wait_until(lambda: w.write_errors >= 1, "a failed record write")
    assert (w.buffered, w.dropped, w.written) == (5, 3, 0) and w.last_error
    full = [r.getMessage() for r in caplog.records if "buffer full" in r.getMessage()]
    assert len(full) == 1 and "(5 rows" in full[0] and "1 records dropped so far" in full[0]  # logged once
    assert any("request-record write failed" in r.getMessage() for r in caplog.records)
    w.sessionmaker = good  # the database is back
    await async_wait_until(lambda: w.buffered == 0, "the buffer drained")
    await w.stop()
    assert (w.buffered, w.written, w.dropped) == (0, 5, 3)
    async with good() as s:
        assert await crud_records.count_records(s) == 5
        rows, _ = await crud_records.query_records(s)
    assert sorted(r.id for r in rows) == [f"req-{i}" for i in range(5)]  # the first five, in order
    await good.kw["bind"].dispose()


async def test_shutdown_flushes_the_buffer(tenancy_db):
    async with running_app(tenancy_db, record_flush_interval_s=3600, record_batch_size=10_000) as (app, client):
        key = await new_key(client, "acme")
        for _ in range(3):
            assert (await client.post("/v1/chat/completions", json=chat(), headers=bearer(key))).status_code == 200
        assert app.state.records.buffered == 3  # nothing written yet
    sm = make_sessionmaker(make_engine(tenancy_db))
    async with sm() as s:
        assert await crud_records.count_records(s, "acme") == 3
    await sm.kw["bind"].dispose()


async def test_rollups_per_minute_user_median_sla_and_acceptance(tenancy_db):
    sm = make_sessionmaker(make_engine(tenancy_db))
    w = RecordWriter(sm)
    m0 = datetime(2026, 11, 30, 10, 0, tzinfo=timezone.utc)
    spec = SpecStats(rounds=4, drafted=12, verified=12, accepted=6, emitted=10, accepted_per_position=[4, 2])
    data = [  # (minute offset, seconds, user, tok/s)
        (0, 5, "ann", 10.0), (0, 15, "ann", 30.0), (0, 50, "ann", 20.0), (0, 59, "bob", 40.0),
        (1, 1, "ann", 50.0), (1, 30, "ann", None),
    ]
    for i, (m, sec, user, tps) in enumerate(data):
        w.request_ended(outcome(i, user=user, tps=tps, target=25.0, spec=spec,
                                finished_at=m0 + timedelta(minutes=m, seconds=sec)))
    w.request_ended(outcome(99, tenant="other", finished_at=m0 + timedelta(seconds=3)))
    await w.flush()
    async with sm() as s:
        rows = await crud_records.rollups(s, since=m0, until=m0 + timedelta(minutes=5), tenant="acme")
        series = crud_records.user_series(rows)
        assert [(r.minute, r.user, r.requests) for r in rows] == [(m0, "ann", 3), (m0, "bob", 1),
                                                                  (m0 + timedelta(minutes=1), "ann", 2)]
        ann = next(x for x in series if x["user"] == "ann")["points"]
        # the one definition: median of per-request decode tok/s (tok/s = 10 tokens / interval)
        assert [p["tokens_per_s"] for p in ann] == [pytest.approx(20.0), pytest.approx(50.0)]
        assert rows[0].completion_tokens == 33 and rows[0].decode_tps_samples == 3
        assert (rows[0].sla_requests, rows[0].sla_met) == (3, 1)  # only 30 ≥ 25
        sla = crud_records.sla_attainment(rows)[0]
        assert (sla["graded_requests"], sla["met_requests"], sla["user_minutes"], sla["user_minutes_met"]) == (5, 3, 3, 2)
        acc = crud_records.acceptance(rows, "tenant")[0]
        assert acc["rounds"] == 24 and acc["acceptance_rate"] == 0.5 and acc["tau"] == 2.5
        assert acc["per_position"] == [1.0, 0.5]
        # idempotent: recomputing gives the same rows; records arriving late update the minute
        await crud_records.recompute_rollups(s, [(m0, "acme")])
        w.request_ended(outcome(7, user="bob", tps=60.0, finished_at=m0 + timedelta(seconds=40)))
        await w.flush()
        s.expire_all()
        rows = await crud_records.rollups(s, since=m0, until=m0 + timedelta(minutes=1), tenant="acme")
        bob = next(r for r in rows if r.user == "bob")
        assert len(rows) == 2 and bob.requests == 2 and bob.decode_tps_median == pytest.approx(50.0)
        # retention: records of the first minute pruned, rollups kept
        n, m = await crud_records.prune(s, m0 + timedelta(minutes=1))
        assert n == 6 and m == 0 and await crud_records.count_records(s) == 2
    await sm.kw["bind"].dispose()


async def test_serving_continues_on_cached_keys_while_the_database_is_down(sqlite_db, tmp_path):
    async with running_app(sqlite_db, auth_cache_ttl_s=0.05, record_flush_interval_s=0.02) as (app, client):
        key = await new_key(client, "acme", "alice", rpm_limit=100)
        h = bearer(key)
        assert (await client.post("/v1/chat/completions", json=chat(), headers=h)).status_code == 200
        await app.state.records.flush()
        good = app.state.sessionmaker
        broken = broken_sessionmaker(tmp_path)
        app.state.sessionmaker = app.state.admission.policies.sessionmaker = app.state.records.sessionmaker = broken
        await asyncio.sleep(0.1)  # every cache entry is past its TTL
        for stream in (False, True):
            r = await client.post("/v1/chat/completions", json=chat(stream=stream), headers=h)
            assert r.status_code == 200 and r.headers["x-ratelimit-limit-requests"] == "100"
        unknown = await client.post("/v1/chat/completions", json=chat(), headers=bearer("sk-sg-never-seen"))
        assert unknown.status_code == 503 and unknown.json()["error"]["code"] == "auth_unavailable"
        await async_wait_until(lambda: app.state.records.write_errors >= 1, "a failed record write")
        # two requests wait: a write attempt during the stream may have taken its running row, whose
        # final row then queues behind it (3 rows, 2 ids); the retry writes each request once
        ended = [r for r in app.state.records._buffer if r["status"] != crud_records.RUNNING]
        assert len(ended) == 2 and app.state.records.buffered in (2, 3)
        app.state.sessionmaker = app.state.admission.policies.sessionmaker = app.state.records.sessionmaker = good
        await async_wait_until(lambda: app.state.records.buffered == 0, "the buffer drained")
        async with good() as s:
            assert await crud_records.count_records(s, "acme") == 3


def test_record_row_fields():
    o = outcome(1, finished_at=datetime(2026, 1, 1, 12, 0, 30, tzinfo=timezone.utc), tps=20.0, target=25.0)
    row = record_row(o)
    assert row["finished_at"] == datetime(2026, 1, 1, 12, 0, 30, tzinfo=timezone.utc)
    assert row["queued_at"] == datetime(2026, 1, 1, 12, 0, 28, tzinfo=timezone.utc)
    assert row["first_token_at"] == datetime(2026, 1, 1, 12, 0, 28, 500000, tzinfo=timezone.utc)
    assert row["ttft_s"] == pytest.approx(0.5) and row["decode_tokens_per_s"] == pytest.approx(20.0)
    assert row["sla_met"] is False and row["sla_target_tokens_per_s"] == 25.0
    assert row["constraint"] is None and row["mask_ms_per_token"] is None  # free text
    o.ctx.constraint, o.grammar_mask_s = "json_schema", 0.0055  # 11 tokens: 0.5 ms each
    row = record_row(o)
    assert row["constraint"] == "json_schema" and row["mask_ms_per_token"] == pytest.approx(0.5)
    o.completion_tokens = 0  # failed before its first token: no per-token time
    assert record_row(o)["mask_ms_per_token"] is None


async def test_constraint_and_mask_time_are_stored_and_rollups_split_acceptance(tenancy_db):
    """The two new columns round-trip through the database (also the admin API's record shape),
    and the rollups sum the speculation of constrained requests apart, so acceptance splits
    grammar from plain."""
    from gateway.tenancy.schemas import RecordOut

    sm = make_sessionmaker(make_engine(tenancy_db))
    w = RecordWriter(sm)
    m0 = datetime(2026, 11, 30, 10, 0, tzinfo=timezone.utc)
    plain = SpecStats(rounds=5, drafted=20, verified=20, accepted=10, emitted=15, accepted_per_position=[6, 4])
    grammar = SpecStats(rounds=4, drafted=16, verified=16, accepted=4, emitted=8, accepted_per_position=[3, 1])
    runs = [(None, None, plain), ("json_schema", 0.0033, grammar), ("tools", 0.0011, grammar),
            ("json_object", None, None)]  # the last: constrained, no speculation, mask time not measured
    for i, (kind, mask, spec) in enumerate(runs):
        o = outcome(i, spec=spec, finished_at=m0 + timedelta(seconds=10 + i))
        o.ctx.constraint, o.grammar_mask_s = kind, mask
        w.request_ended(o)
    await w.flush()
    async with sm() as s:
        recs = {r.id: r for r in (await crud_records.query_records(s, limit=10))[0]}
        assert {k: (r.constraint, r.mask_ms_per_token) for k, r in recs.items()} == {
            "req-0": (None, None), "req-1": ("json_schema", pytest.approx(0.3)),
            "req-2": ("tools", pytest.approx(0.1)), "req-3": ("json_object", None)}
        out = RecordOut.model_validate(recs["req-1"]).model_dump()
        assert out["constraint"] == "json_schema" and out["mask_ms_per_token"] == pytest.approx(0.3)
        (row,) = await crud_records.rollups(s, since=m0, until=m0 + timedelta(minutes=1), tenant="acme")
        assert (row.spec_rounds, row.spec_drafted, row.spec_accepted, row.spec_emitted) == (13, 52, 18, 31)
        assert (row.constrained_spec_rounds, row.constrained_spec_drafted, row.constrained_spec_accepted,
                row.constrained_spec_emitted) == (8, 32, 8, 16)
        (acc,) = crud_records.acceptance([row], "model")
        assert acc["constrained"] == {"rounds": 8, "drafted": 32, "accepted": 8, "emitted": 16,
                                      "acceptance_rate": 0.25, "tau": 2.0}
        assert acc["plain"] == {"rounds": 5, "drafted": 20, "accepted": 10, "emitted": 15,
                                "acceptance_rate": 0.5, "tau": 3.0}
        assert acc["acceptance_rate"] == pytest.approx(18 / 52)  # the total is unchanged
    await sm.kw["bind"].dispose()


async def test_the_running_writer_prunes_old_records_at_start(sqlite_db):
    sm = make_sessionmaker(make_engine(sqlite_db))
    old = datetime.now(timezone.utc) - timedelta(days=8)
    async with sm() as s:
        await crud_records.insert_records(s, [record_row(outcome(1, finished_at=old)),
                                              record_row(outcome(2, finished_at=old + timedelta(days=2)))])
    w = RecordWriter(sm, retention_days=7, flush_interval_s=0.01)
    w.start()
    for _ in range(100):
        async with sm() as s:
            if await crud_records.count_records(s) == 1:
                break
        await asyncio.sleep(0.02)
    await w.stop()
    async with sm() as s:
        rows, _ = await crud_records.query_records(s)
    assert [r.id for r in rows] == ["req-2"]  # 8 days old: pruned; 6 days old: kept
    await sm.kw["bind"].dispose()


async def test_tool_and_plain_requests_are_marked_through_the_gateway(tenancy_db):
    """Over HTTP (FakeBackend: it parses tool calls but has no grammars, so no mask time): a
    tools request is recorded with constraint "tools" and its speculation lands in the
    constrained sums and the tools-labelled counters; a plain one is recorded with no
    constraint and its speculation is plain; a refused tools request leaves a rejected
    "tools" record."""
    from tests.gateway.observability.test_metrics import Delta
    from tests.support.tenancy_fixtures import ADMIN_HEADERS
    from tests.support.tools import WEATHER

    d = Delta()
    async with running_app(tenancy_db, CountingBackend(max_context=512)) as (app, client):
        h = bearer(await new_key(client, "acme", "alice"))
        r = await client.post("/v1/chat/completions", json=chat(tools=[WEATHER], return_spec_stats=True), headers=h)
        assert r.status_code == 200, r.text
        tools_id = r.json()["id"]
        r = await client.post("/v1/chat/completions", json=chat(return_spec_stats=True, max_tokens=5), headers=h)
        plain_id = r.json()["id"]
        bad = {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}
        assert (await client.post("/v1/chat/completions", json=chat(**bad), headers=h)).status_code == 400
        assert (await client.post("/admin/v1/rollups/refresh", headers=ADMIN_HEADERS)).status_code == 204
        recs = {x["id"]: x for x in (await client.get("/admin/v1/requests", headers=ADMIN_HEADERS)).json()["data"]}
        acc = (await client.get("/admin/v1/stats/acceptance", params={"group_by": "tenant"},
                                headers=ADMIN_HEADERS)).json()["data"]
    tools, plain = recs[tools_id], recs[plain_id]
    (refused,) = [x for x in recs.values() if x["status"] == "rejected"]
    assert (tools["constraint"], tools["mask_ms_per_token"], tools["spec_drafted"]) == ("tools", None, 12)
    assert (plain["constraint"], plain["mask_ms_per_token"], plain["spec_drafted"]) == (None, None, 8)
    assert (refused["constraint"], refused["error_code"]) == ("tools", "invalid_value")
    (a,) = acc
    for split, rec in (("constrained", tools), ("plain", plain)):
        assert (a[split]["rounds"], a[split]["drafted"], a[split]["accepted"]) == (
            rec["spec_rounds"], rec["spec_drafted"], rec["spec_accepted"]), split
    by = "sparkgate:spec_decode_num_{}_by_constraint_total"
    for label, rec in (("tools", tools), ("none", plain)):
        assert d(by.format("draft_tokens"), constraint=label) == rec["spec_drafted"], label
        assert d(by.format("accepted_tokens"), constraint=label) == rec["spec_accepted"], label
    assert d("sparkgate:constrained_requests_total", constraint="tools", tenant="acme") == 2  # the refused one too
    assert d("sparkgate:grammar_mask_time_per_output_token_seconds_count") == 0  # nothing measured it
