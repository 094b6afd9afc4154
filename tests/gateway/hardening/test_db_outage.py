"""Hardening, database outage on a REAL Postgres: a throwaway cluster (initdb + pg_ctl in
a temp dir, own port, run as the ``postgres`` OS user; the shared 5432 server is never
touched) is stopped while the gateway serves. Requests with known keys keep succeeding
(cached principals), request records are buffered up to ``record_buffer_max`` with the
overflow counted in ``RecordWriter.dropped``, and after a restart the buffer drains
into the database. Skips locally (fails under CI=true) without the Postgres binaries."""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
import socket
import subprocess
import tempfile

import pytest
from sqlalchemy import select

from gateway.crud import records as crud_records
from gateway.db.migrate import upgrade
from gateway.db.models import RequestRecord
from gateway.db.session import make_engine, make_sessionmaker
from tests.conftest import require_or_skip
from tests.support.gateway_fixtures import chat
from tests.support.polling import async_wait_until
from tests.support.tenancy_fixtures import bearer, new_key, running_app

pytestmark = pytest.mark.postgres

BIN = sorted(glob.glob("/usr/lib/postgresql/*/bin"))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="sg-pg-")
        self.data = os.path.join(self.dir, "data")
        self.port = _port()
        shutil.chown(self.dir, "postgres", "postgres")
        self.pg("initdb", "-D", self.data, "-A", "trust", "-U", "postgres", "--no-sync")

    def pg(self, tool: str, *args: str) -> None:
        cmd = [os.path.join(BIN[-1], tool), *args]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)

    def start(self) -> None:
        self.pg("pg_ctl", "-D", self.data, "-l", os.path.join(self.dir, "log"), "-w", "-t", "30", "-o",
                f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off", "start")

    def stop(self) -> None:
        self.pg("pg_ctl", "-D", self.data, "-m", "fast", "-w", "stop")

    def url(self, db: str = "postgres") -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{db}"


@pytest.fixture
def cluster():
    ok = bool(BIN) and shutil.which("runuser") is not None
    try:
        import pwd

        pwd.getpwnam("postgres")
    except (ImportError, KeyError):
        ok = False
    require_or_skip(ok, "Postgres server binaries (/usr/lib/postgresql/*/bin) and a 'postgres' OS user")
    c = Cluster()
    c.start()
    yield c
    try:
        c.stop()
    except subprocess.CalledProcessError:
        pass
    shutil.rmtree(c.dir, ignore_errors=True)


async def test_real_postgres_outage_keeps_serving_buffers_records_and_drains(cluster):
    url = cluster.url()
    await asyncio.to_thread(upgrade, url)
    async with running_app(url, record_buffer_max=20, record_flush_interval_s=0.1, record_batch_size=50,
                           auth_cache_ttl_s=0.5) as (app, client):
        key = await new_key(client, "acme")
        w = app.state.records
        for _ in range(5):
            assert (await client.post("/v1/chat/completions", json=chat(), headers=bearer(key))).status_code == 200
        await async_wait_until(lambda: w.written == 5, "the first 5 records written")

        await asyncio.to_thread(cluster.stop)  # the database goes away mid-run
        await asyncio.sleep(0.6)  # past the auth cache TTL: lookups now fail → stale cache
        codes = [(await client.post("/v1/chat/completions", json=chat(), headers=bearer(key))).status_code
                 for _ in range(30)]
        assert codes == [200] * 30, codes  # serving continues on the cached key
        r = await client.post("/v1/chat/completions", json=chat(), headers=bearer("sk-sg-unknown-key-xyz"))
        assert r.status_code == 503 and r.json()["error"]["code"] == "auth_unavailable"  # unknown: can't tell
        await async_wait_until(lambda: w.write_errors >= 1, "a failed record write")
        # the 30 served requests met a buffer of 20 rows (the 503's unauthenticated request leaves no record): a
        # request is dropped whole or kept whole (a running row being written when its request ends is
        # followed by its end row, even past the bound), so at least 10 were dropped. (Before that rule a CI
        # run counted 11 dropped and 24 written: one end row lost, its request left ``running``.)
        assert w.buffered >= 20 and w.dropped >= 10 and w.last_error
        assert w.written == 5

        await asyncio.to_thread(cluster.start)
        await async_wait_until(lambda: w.buffered == 0, "the buffer drained")  # writer backoff is ≤ 5 s
        assert w.written + w.dropped == 35 and w.dropped >= 10  # every request written once or counted dropped
        assert (await client.post("/v1/chat/completions", json=chat(), headers=bearer(key))).status_code == 200
        await async_wait_until(lambda: w.written + w.dropped == 36, "the last record written")
    engine = make_engine(url)
    try:
        async with make_sessionmaker(engine)() as s:
            statuses = (await s.execute(select(RequestRecord.status))).scalars().all()
        assert len(statuses) == w.written  # 5 before + what the buffer kept + 1 after
        assert crud_records.RUNNING not in statuses  # no finished request left ``running``
    finally:
        await engine.dispose()
