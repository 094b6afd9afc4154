"""Request records with replicas (:mod:`gateway.observability.records`): an admitted request is
a ``running`` row until it ends, then the same row with its final values (exactly one row);
the ``running`` rows of a dead replica are marked ``incomplete`` by a live one; a request that
ends after being swept still gets its final values and is billed once."""

from __future__ import annotations

import asyncio
import uuid

import redis.asyncio as aioredis

from gateway.crud import records as crud_records
from gateway.db.models import ApiKey, RequestRecord
from tests.support.fakes import FakeBackend
from tests.support.gateway_fixtures import chat
from tests.support.polling import async_wait_until
from tests.support.tenancy_fixtures import bearer, new_key, running_app


async def all_rows(app) -> list[RequestRecord]:
    async with app.state.sessionmaker() as s:
        return (await crud_records.query_records(s, limit=1000))[0]


async def test_running_row_then_final_row_then_sweep_of_a_dead_replica(tenancy_db, redis_url):
    prefix = f"test:{uuid.uuid4().hex}:"
    gate = asyncio.Event()
    async with running_app(tenancy_db, FakeBackend(gate=gate), redis_url=redis_url, redis_prefix=prefix,
                           replica_id="ra") as (a, ca):
        key = await new_key(ca, "acme")
        held = asyncio.create_task(ca.post("/v1/chat/completions", json=chat(), headers=bearer(key)))
        await async_wait_until(lambda: a.state.admission.tenant_active["acme"] == 1, "admitted")
        await a.state.records.flush()
        (row,) = await all_rows(a)
        assert (row.status, row.replica, row.completion_tokens, row.finished_at) == ("running", "ra", 0, row.queued_at)
        # a replica "gone" that left a running row and no live key; "alive" has a key
        async with a.state.sessionmaker() as s:
            await crud_records.insert_records(s, [{**_row(row), "id": "gone-1", "replica": "gone"},
                                                  {**_row(row), "id": "alive-1", "replica": "alive"}])
        r = aioredis.from_url(redis_url)
        await r.set(prefix + "replica:alive", "{}", px=5000)
        assert await a.state.records.sweep() == 1 and a.state.records.swept == 1
        by_id = {x.id: x for x in await all_rows(a)}
        assert by_id["gone-1"].status == "incomplete" and by_id["gone-1"].error_code == "replica_lost"
        assert by_id["alive-1"].status == "running" and by_id[row.id].status == "running"
        # this replica's own running row, swept by mistake, still ends with its final values
        async with a.state.sessionmaker() as s:
            assert await crud_records.mark_incomplete(s, ["ra"], row.queued_at) == 1
        gate.set()
        assert (await held).status_code == 200
        await a.state.records.flush()
        by_id = {x.id: x for x in await all_rows(a)}
        assert len(by_id) == 3 and by_id[row.id].status == "finished" and by_id[row.id].completion_tokens == 7
        assert by_id[row.id].error_code is None and by_id[row.id].replica == "ra"
        async with a.state.sessionmaker() as s:
            final = by_id[row.id]
            assert final.prompt_tokens == row.prompt_tokens > 0
            assert (await s.get(ApiKey, final.key_id)).tokens_used == final.prompt_tokens + 7  # billed once
            await crud_records.recompute_rollups(s, [(crud_records.minute_of(row.queued_at), "acme")])
        # a request whose end arrives before its running row was written: one row
        assert (await ca.post("/v1/chat/completions", json=chat(), headers=bearer(key))).status_code == 200
        await a.state.records.flush()
        assert len(await all_rows(a)) == 4 and a.state.records.buffered == 0
        assert sorted(x.status for x in await all_rows(a)) == ["finished", "finished", "incomplete", "running"]
        await r.delete(*[k async for k in r.scan_iter(prefix + "*")] or [prefix])
        await r.aclose()


def _row(rec: RequestRecord) -> dict:
    return {c.name: getattr(rec, c.name) for c in RequestRecord.__table__.columns}


async def test_a_restarted_replica_marks_its_own_leftovers_incomplete(sqlite_db):
    gate = asyncio.Event()
    async with running_app(sqlite_db, FakeBackend(gate=gate), replica_id="fixed") as (a, ca):
        key = await new_key(ca, "acme")
        held = asyncio.create_task(ca.post("/v1/chat/completions", json=chat(), headers=bearer(key)))
        await async_wait_until(lambda: a.state.admission.tenant_active["acme"] == 1, "admitted")
        await a.state.records.flush()
        a.state.records._task.cancel()  # the process "dies": its running row stays running
        a.state.records._buffer.clear()
        a.state.records.request_ended = lambda outcome: None
        gate.set()
        await held
    async with running_app(sqlite_db, replica_id="fixed") as (b, cb):
        await async_wait_until(lambda: b.state.records._last_sweep != float("-inf"), "first writer step")
        (row,) = await all_rows(b)
        assert row.status == "incomplete" and row.error_code == "replica_lost" and row.replica == "fixed"
