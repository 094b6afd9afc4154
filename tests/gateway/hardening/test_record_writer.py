"""Hardening round 2, item 1 (writer side): a request record the database refuses for its
data (a lone surrogate or NUL that got past the edge checks) must not stop the
request-record writer. The bad row is dropped alone (counted in ``RecordWriter.rejected``
and ``sparkgate:db_records_rejected_total``, logged with its request id); every other row
of its batch is written, also at shutdown; a database that cannot be reached keeps its
rows buffered. SQLite and Postgres."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.exc import DataError, DBAPIError, OperationalError

from gateway.crud import records as crud_records
from gateway.db.session import make_engine, make_sessionmaker
from gateway.observability.records import RecordWriter
from tests.support.tenancy_fixtures import ADMIN_HEADERS, running_app
from tests.support.tenancy_fixtures import outcome


async def stored_ids(sessionmaker) -> set[str]:
    async with sessionmaker() as s:
        rows, _ = await crud_records.query_records(s, limit=1000)
    return {r.id for r in rows}


def is_postgres(url: str) -> bool:
    return url.startswith("postgresql")


async def test_a_row_that_cannot_be_inserted_is_dropped_alone(tenancy_db, caplog):
    """7 rows in one batch, two with a lone surrogate in ``user`` (they bypassed the edge
    checks): the other 5 are written in that flush, the 2 are rejected once, counted and
    logged by request id, and the buffer is empty (nothing is retried forever). NUL in
    ``user``: SQLite stores it, Postgres refuses it (then it is rejected the same way)."""
    engine = make_engine(tenancy_db)
    sm = make_sessionmaker(engine)
    writer = RecordWriter(sm, batch_size=100)
    users = ["a", "\ud800", "b", "c", "d\udfffe", "f", "nul\x00here"]
    for i, user in enumerate(users):
        writer.request_ended(outcome(i, user=user))
    caplog.set_level(logging.ERROR, "gateway.observability.records")
    try:
        await writer.flush()
        ids = await stored_ids(sm)
    finally:
        await engine.dispose()
    bad = {"req-1", "req-4"} | ({"req-6"} if is_postgres(tenancy_db) else set())
    assert ids == {f"req-{i}" for i in range(7)} - bad
    assert (writer.written, writer.rejected, writer.buffered) == (7 - len(bad), len(bad), 0)
    logged = [r.getMessage() for r in caplog.records if "rejected by the database" in r.getMessage()]
    assert sorted(m.split()[2] for m in logged) == sorted(bad)


async def test_background_writer_keeps_writing_after_a_bad_row(tenancy_db):
    """The issue: one bad row made every later batch fail. With the background task
    running, rows queued after the bad one are written without a manual flush."""
    engine = make_engine(tenancy_db)
    sm = make_sessionmaker(engine)
    writer = RecordWriter(sm, batch_size=2, flush_interval_s=0.02)
    writer.start()
    try:
        writer.request_ended(outcome(0, user="\ud800"))
        for i in range(1, 6):
            writer.request_ended(outcome(i))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30.0
        while writer.written < 5 and loop.time() < deadline:
            await asyncio.sleep(0.02)  # poll (bounded by the deadline), not a fixed wait
        assert (writer.written, writer.rejected, writer.write_errors) == (5, 1, 0)
        assert await stored_ids(sm) == {f"req-{i}" for i in range(1, 6)}
    finally:
        await writer.stop()
        await engine.dispose()


async def test_stop_writes_the_good_rows_of_a_batch_with_a_bad_one(tenancy_db):
    """Shutdown flush: never lose the good rows because one row is bad."""
    engine = make_engine(tenancy_db)
    sm = make_sessionmaker(engine)
    writer = RecordWriter(sm, batch_size=500)
    for i in range(40):
        writer.request_ended(outcome(i, user="\ud800" if i in (3, 17, 39) else f"u{i}"))
    try:
        await writer.stop(timeout_s=60)
        ids = await stored_ids(sm)
    finally:
        await engine.dispose()
    assert ids == {f"req-{i}" for i in range(40)} - {"req-3", "req-17", "req-39"}
    assert (writer.written, writer.rejected, writer.buffered) == (37, 3, 0)


async def test_unreachable_database_keeps_rows_buffered_not_rejected():
    """Connection refused is not a row error: nothing is dropped, the batch stays for a retry."""
    engine = make_engine("postgresql+asyncpg://postgres@127.0.0.1:1/none")
    writer = RecordWriter(make_sessionmaker(engine))
    writer.request_ended(outcome(0))
    writer.request_ended(outcome(1, user="\ud800"))
    try:
        with pytest.raises(OSError):
            await writer.flush()
    finally:
        await engine.dispose()
    assert (writer.buffered, writer.rejected, writer.written) == (2, 0, 0)


async def test_a_full_buffer_drops_whole_requests_never_an_end_row_whose_start_was_kept(tenancy_db):
    """Database down, buffer bound 2: two requests' ``running`` rows fill it and a write attempt
    takes them (they can no longer be replaced in place); a third request is refused. When all
    three end, the two kept requests' end rows get in past the bound and the third is dropped
    whole — so after the database returns no finished request is left ``running``."""
    down = make_engine("postgresql+asyncpg://postgres@127.0.0.1:1/none")
    writer = RecordWriter(make_sessionmaker(down), max_buffer=2)
    outs = [outcome(i) for i in range(3)]
    writer.request_started(outs[0].ctx)
    writer.request_started(outs[1].ctx)
    try:
        with pytest.raises(OSError):
            await writer.flush()  # the attempt that takes both running rows
    finally:
        await down.dispose()
    writer.request_started(outs[2].ctx)  # full: refused
    for o in outs:
        writer.request_ended(o)
    assert (writer.buffered, writer.dropped) == (4, 1)
    engine = make_engine(tenancy_db)
    writer.sessionmaker = make_sessionmaker(engine)  # the database is back
    try:
        await writer.flush()
        async with writer.sessionmaker() as s:
            rows, _ = await crud_records.query_records(s, limit=10)
    finally:
        await engine.dispose()
    assert sorted((r.id, r.status) for r in rows) == [("req-0", "finished"), ("req-1", "finished")]
    assert (writer.written, writer.dropped, writer.buffered) == (2, 1, 0)


def test_row_errors_are_told_from_database_errors():
    from gateway.observability.records import is_row_error

    class Orig(Exception):
        def __init__(self, sqlstate):
            self.sqlstate = sqlstate

    assert is_row_error(UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"))
    assert is_row_error(DataError("INSERT", {}, Orig("22001")))
    assert is_row_error(DBAPIError("INSERT", {}, Orig("22021")))  # asyncpg: NUL in text
    assert not is_row_error(DBAPIError("INSERT", {}, Orig("53100")))  # disk full: retry, never drop
    assert not is_row_error(OperationalError("INSERT", {}, Orig(None)))  # SQLite: database is locked
    assert not is_row_error(ConnectionRefusedError(111, "refused"))
    assert not is_row_error(TimeoutError())


async def test_rejected_rows_are_exported_as_a_metric(sqlite_db):
    async with running_app(sqlite_db) as (app, client):
        writer = app.state.records
        writer.request_ended(outcome(0, user="\ud800"))  # as if it had bypassed the edge
        writer.request_ended(outcome(1))
        await client.post("/admin/v1/rollups/refresh", headers=ADMIN_HEADERS)
        status = (await client.get("/admin/v1/tenancy/status", headers=ADMIN_HEADERS)).json()["records"]
        metrics = await client.get("/metrics", headers=ADMIN_HEADERS)
    fams = {f.name: f for f in text_string_to_metric_families(metrics.text)}
    assert fams["sparkgate:db_records_rejected"].samples[0].value == 1
    assert (status["written"], status["rejected"]) == (1, 1)
