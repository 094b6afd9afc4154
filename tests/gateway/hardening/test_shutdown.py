"""Hardening, graceful shutdown: ``sparkgate serve`` (FakeBackend, separate process) gets
SIGTERM while streams are in flight: it stops accepting new connections at once, lets
the in-flight streams finish (uvicorn ``timeout_graceful_shutdown`` =
``SPARKGATE_SHUTDOWN_TIMEOUT_S``), flushes every request record to the database, and
exits 0. A stream longer than the timeout is cut and still recorded (cancelled)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import httpx
import pytest

from gateway.crud.keys import issue_key
from tests.conftest import ROOT
from tests.support.gateway_fixtures import sqlite_url
from tests.support.polling import wait_until
from tests.support.servers import free_port, refuses_connections

SERVE = """
import sys
from tests.support.fakes import FakeBackend
import gateway.main
gateway.main.build_backend = lambda settings: FakeBackend(max_context=4096, token_delay_s=float(sys.argv[2]),
                                                      script=tuple(f"w{i}" for i in range(1000)))
from gateway import cli
sys.exit(cli.main(["serve", "--port", sys.argv[1]]))
"""


def start(tmp_path, db, port, grace_s, token_delay_s):
    env = {**os.environ, "SPARKGATE_DATABASE_URL": sqlite_url(db), "SPARKGATE_SHUTDOWN_TIMEOUT_S": str(grace_s),
           "SPARKGATE_ADMIN_TOKEN": "adm-shutdown", "PYTHONPATH": str(ROOT)}
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", SERVE, str(port), str(token_delay_s)], env=env, cwd=tmp_path,
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
        try:
            if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.2)


def stream(base, key, max_tokens, out: dict, name: str):
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": max_tokens, "stream_options": {"include_usage": True}}
    lines = out[name] = []  # filled as the stream arrives
    try:
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {key}"}) as r:
            out[name + ":status"] = r.status_code
            for line in r.iter_lines():
                if line:
                    lines.append(line)
    except httpx.HTTPError as exc:
        out[name + ":error"] = repr(exc)


def rows(db) -> list[tuple]:
    with sqlite3.connect(db) as c:
        return c.execute("SELECT status, completion_tokens, finish_reason FROM request_records ORDER BY status").fetchall()


@pytest.mark.parametrize("case", ["drain", "cut"])
@pytest.mark.slow
def test_sigterm_drains_streams_flushes_records_exits_0(tmp_path, migrated_template, case):  # noqa: F811
    db = tmp_path / "db.sqlite"
    shutil.copy(migrated_template, db)
    key = asyncio.run(issue_key(sqlite_url(db), "sd-tenant", "u"))
    grace = 8.0 if case == "drain" else 1.5
    proc, base = start(tmp_path, db, free_port(), grace, token_delay_s=0.05)
    try:
        out: dict = {}
        # 4 streams of 40 tokens × 50 ms ≈ 2 s each, and (cut) one of 400 tokens ≈ 20 s
        n_tokens = {"s0": 40, "s1": 40, "s2": 40, "s3": 40} if case == "drain" else {"long": 400}
        threads = [threading.Thread(target=stream, args=(base, key, n, out, name)) for name, n in n_tokens.items()]
        for t in threads:
            t.start()
        wait_until(lambda: all(out.get(n) for n in n_tokens), "a first event on every stream")  # all running
        assert all(out.get(f"{n}:status") == 200 for n in n_tokens), out
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: refuses_connections(base), "new connections refused")
        assert proc.poll() is None and any(t.is_alive() for t in threads)  # ...while it still serves the streams
        rc = proc.wait(timeout=grace + 20)
        took = time.monotonic() - t_term
        for t in threads:
            t.join(timeout=10)
        log = (tmp_path / "serve.log").read_text()
        assert rc == 0, log[-2000:]
        records = rows(db)
        if case == "drain":
            for name in n_tokens:
                assert out[name] and out[name][-1] == "data: [DONE]", (name, out, log[-1500:])
                assert '"finish_reason":"length"' in "".join(out[name])
            assert took < grace, took  # it did not wait for the full timeout
            assert records == [("finished", 40, "length")] * 4, records
        else:
            assert grace - 0.5 <= took <= grace + 10, took
            assert not out["long"] or out["long"][-1] != "data: [DONE]"  # cut mid-stream
            assert len(records) == 1 and records[0][0] == "cancelled" and 0 < records[0][1] < 400, records
        if case == "drain":
            assert "Traceback" not in log, log[-3000:]
        else:  # uvicorn logs the task it cancelled when the grace period ran out
            assert "timeout graceful shutdown exceeded" in log
    finally:
        if proc.poll() is None:
            proc.kill()
