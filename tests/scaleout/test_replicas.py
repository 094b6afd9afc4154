"""Two gateway PROCESSES behind a real HAProxy (Debian's ``haproxy``, started here) on one
Postgres database (new per module) and one Redis (127.0.0.1:6379, a key prefix per module),
both streaming from one SGLang stand-in (``tests/support/sglang_standin.py``, no model).

Checked through HTTP, the database and the processes' signals:

* a tier's ``max_concurrent`` of 2 holds over both replicas (the stand-in never runs more than
  2), an rpm limit holds in total (not per replica);
* every request leaves exactly one record (rows = requests, ids = the responses' ids), each
  naming the replica that served it, and both replicas served some;
* ``GET /admin/v1/live`` through the balancer shows both replicas' running requests;
* SIGTERM drains one replica (its streams end normally, new requests go to the other, it
  exits 0); SIGKILL leaves its in-flight records ``incomplete`` (swept by the live replica);
* a replica whose Redis is unreachable still answers 200 (per-replica limits, a warning).

Without ``haproxy`` on the PATH these tests skip, and fail under ``CI=true`` (``.ci/run``
installs it).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import threading
import time
import uuid

import httpx
import pytest
import redis

from gateway.db.migrate import upgrade
from tests.conftest import require_or_skip
from tests.runtime.sglang.test_gateway import write_tokenizer
from tests.support.gateway_fixtures import MODEL
from tests.support.polling import wait_until
from tests.support.servers import refuses_connections
from tests.support.scaleout import Balancer, Replica, fetch_records, replica_env
from tests.support.sglang_standin import StandinServer
from tests.support.tenancy_fixtures import new_pg_database

pytestmark = [pytest.mark.scaleout, pytest.mark.slow, pytest.mark.postgres]

ADMIN = "sk-admin-replicas-test"
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}
STEP_S = 0.04  # stand-in seconds per token
SCRIPT = tuple(f" w{i}" for i in range(30))  # 30 tokens: a stream lasts ~1.2 s


class Cluster:
    def __init__(self, lb: str, replicas: dict[str, Replica], standin: StandinServer, pg_url: str, key: str,
                 prefix: str, no_redis: Replica):
        self.no_redis = no_redis
        self.lb, self.replicas, self.standin, self.pg_url, self.key, self.prefix = lb, replicas, standin, pg_url, key, prefix

    @property
    def auth(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"}

    def records(self) -> list[dict]:
        return asyncio.run(fetch_records(self.pg_url))


class Peak:
    """Polls the stand-in's running requests (both replicas stream from it) every 5 ms."""

    def __init__(self, standin):
        self.standin, self.peak, self._stop = standin, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, len(self.standin.active))
            time.sleep(0.005)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def chat(stream: bool = True) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hello"}], "stream": stream,
            "max_tokens": 64}


def stream_ids(r: httpx.Response) -> tuple[str, bool]:
    """(the completion id, whether the stream ended with ``[DONE]``)."""
    events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
    return json.loads(events[0])["id"], events[-1] == "[DONE]"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, migrated_template):  # noqa: ARG001
    require_or_skip(shutil.which("haproxy") is not None, "haproxy (apt-get install haproxy)")
    r = redis.Redis.from_url("redis://127.0.0.1:6379/0", socket_connect_timeout=1)
    try:
        r.ping()
    except redis.RedisError as exc:
        require_or_skip(False, f"Redis at 127.0.0.1:6379 ({exc!r})")
    tmp = tmp_path_factory.mktemp("replicas")
    standin = StandinServer().start()
    standin.standin.script, standin.standin.step_delay_s = SCRIPT, STEP_S
    prefix = f"test:{uuid.uuid4().hex}:"
    with new_pg_database("sparkgate_replicas") as pg_url:
        upgrade(pg_url)
        env = replica_env(pg_url, ADMIN, MODEL, write_tokenizer(tmp / "tokenizer"), [standin.url], prefix,
                          sglang_health_interval_s=3600)
        replicas = {n: Replica(n, env, tmp) for n in ("ra", "rb")}
        no_redis = Replica("rc", {**env, "SPARKGATE_REDIS_URL": "redis://127.0.0.1:1/0"}, tmp)  # not balanced
        lb = Balancer(list(replicas.values()), tmp)
        try:
            for rep in (*replicas.values(), no_redis):
                rep.launch()
            for rep in (*replicas.values(), no_redis):
                rep.wait_ready()
            base = lb.start().url
            with httpx.Client(base_url=base, headers=ADMIN_H, timeout=30) as c:
                for tier in ({"name": "two", "max_concurrent": 2, "max_queue_wait_s": 30},
                             {"name": "open"}):
                    assert c.post("/admin/v1/tiers", json=tier).status_code == 201
                for tenant, tier in (("capped", "two"), ("free", "open")):
                    assert c.post("/admin/v1/tenants", json={"name": tenant, "tier": tier}).status_code == 201
                k = c.post("/admin/v1/keys", json={"tenant": "capped", "user": "alice"})
                assert k.status_code == 201, k.text
            yield Cluster(base, replicas, standin, pg_url, k.json()["key"], prefix, no_redis)
        finally:
            lb.stop(10)
            for rep in (*replicas.values(), no_redis):
                rep.stop()
            standin.stop()
            r.delete(*r.keys(prefix + "*") or [prefix])


def new_key(cluster: Cluster, tenant: str, **fields) -> dict:
    r = httpx.post(cluster.lb + "/admin/v1/keys", json={"tenant": tenant, **fields}, headers=ADMIN_H, timeout=10)
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['key']}"}


def test_concurrency_cap_and_records_hold_over_both_replicas(cluster):
    before = {r["id"] for r in cluster.records()}

    def one(i: int) -> httpx.Response:
        return httpx.post(cluster.lb + "/v1/chat/completions", json=chat(stream=i % 2 == 0), headers=cluster.auth,
                          timeout=60)

    with Peak(cluster.standin.standin) as peak:
        threads_out: list[httpx.Response] = []
        ts = [threading.Thread(target=lambda i=i: threads_out.append(one(i))) for i in range(6)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert [r.status_code for r in threads_out] == [200] * 6, [r.text[:200] for r in threads_out]
    assert peak.peak == 2  # reached, never exceeded, though each replica alone would allow 2
    ids = {stream_ids(r)[0] if r.headers["content-type"].startswith("text/event-stream") else r.json()["id"]
           for r in threads_out}

    def all_ended() -> bool:
        rows = [r for r in cluster.records() if r["id"] not in before]
        return len(rows) == 6 and all(r["status"] == "finished" for r in rows)

    wait_until(all_ended, "6 finished records")
    rows = [r for r in cluster.records() if r["id"] not in before]
    assert {r["id"] for r in rows} == ids and len(rows) == 6  # exactly once each
    assert {r["replica"] for r in rows} == {"ra", "rb"}  # both replicas served
    assert len({r["completion_tokens"] for r in rows}) == 1 and rows[0]["completion_tokens"] >= len(SCRIPT)


def test_rpm_holds_in_total(cluster):
    h = new_key(cluster, "free", rpm_limit=4)
    codes = [httpx.post(cluster.lb + "/v1/chat/completions", json=chat(stream=False), headers=h,
                        timeout=30).status_code for _ in range(6)]
    assert codes == [200] * 4 + [429] * 2  # round-robin spread them over both replicas


def test_admin_live_shows_both_replicas_running(cluster):
    h = new_key(cluster, "free", user="live")
    with httpx.Client(timeout=30) as c:
        out: list[httpx.Response] = []
        ts = [threading.Thread(target=lambda u=u: out.append(c.post(u + "/v1/chat/completions", json=chat(),
                                                                     headers=h)))
              for u in (cluster.replicas["ra"].url, cluster.replicas["rb"].url, cluster.replicas["rb"].url)]
        for t in ts:
            t.start()

        def both_running() -> bool:
            body = httpx.get(cluster.lb + "/admin/v1/live", headers=ADMIN_H, timeout=5).json()
            return [(x["replica"], x["running"]) for x in body["replicas"]] == [("ra", 1), ("rb", 2)]

        wait_until(both_running, "live state showing ra 1, rb 2 running", timeout_s=5)
        for t in ts:
            t.join()
    assert [r.status_code for r in out] == [200] * 3
    time.sleep(1.2)  # the next publication
    body = httpx.get(cluster.lb + "/admin/v1/live", headers=ADMIN_H, timeout=5).json()
    assert body["running_total"] == 0 and not body["degraded"]
    (live_user,) = [u for u in body["users"] if u["user"] == "live"]
    assert live_user["requests"] == 3 and live_user["tokens_per_s"] > 0


def test_a_replica_without_redis_still_serves(cluster):
    rep = cluster.no_redis
    try:
        h = new_key(cluster, "capped")
        codes = [httpx.post(rep.url + "/v1/chat/completions", json=chat(stream=i % 2 == 0), headers=h,
                            timeout=30).status_code for i in range(3)]
        assert codes == [200] * 3
        st = httpx.get(rep.url + "/admin/v1/tenancy/status", headers=ADMIN_H, timeout=5).json()["admission"]
        assert st["rate_limit_store_errors"] == 0 and st["concurrency_lease_errors"] >= 1
        assert httpx.get(rep.url + "/admin/v1/live", headers=ADMIN_H, timeout=5).json()["degraded"]
    finally:
        rep.stop()
    assert "max_concurrent holds per replica only" in rep.log.read_text()


def test_sigterm_drains_one_replica_while_the_other_serves(cluster):
    ra = cluster.replicas["ra"]
    h = new_key(cluster, "free", user="drain")
    held: list[httpx.Response] = []
    ts = [threading.Thread(target=lambda: held.append(httpx.post(ra.url + "/v1/chat/completions", json=chat(),
                                                                 headers=h, timeout=60))) for _ in range(2)]
    for t in ts:
        t.start()
    wait_until(lambda: len(cluster.standin.standin.active) == 2, "two streams on ra")
    try:
        ra.proc.send_signal(signal.SIGTERM)
        # uvicorn notices the signal within its 0.1 s tick and then stops listening: until then ra
        # still takes new requests (and would drain them too), so the new ones are sent after that
        wait_until(lambda: refuses_connections(ra.url), "ra to stop listening", timeout_s=10)
        new = [httpx.post(cluster.lb + "/v1/chat/completions", json=chat(stream=False), headers=h, timeout=30)
               for _ in range(4)]
        assert [r.status_code for r in new] == [200] * 4  # the balancer sends them to rb
        for t in ts:
            t.join()
        assert [r.status_code for r in held] == [200, 200] and all(stream_ids(r)[1] for r in held)  # drained
        assert ra.proc.wait(20) == -signal.SIGTERM  # uvicorn re-raises the signal after its graceful shutdown
        assert "Traceback" not in ra.log.read_text()
        rows = {r["id"]: r for r in cluster.records()}
        for r in held:
            assert rows[stream_ids(r)[0]]["status"] == "finished" and rows[stream_ids(r)[0]]["replica"] == "ra"
        assert {rows[r.json()["id"]]["replica"] for r in new} == {"rb"}
    finally:
        ra.stop()
        ra.launch()  # back for the next test (which needs it to sweep), also after a failure here



def test_sigkill_leaves_incomplete_records_not_lost(cluster):
    rb = cluster.replicas["rb"]
    cluster.replicas["ra"].wait_ready()
    h = new_key(cluster, "free", user="killed")
    ids: list[str] = []
    cut: list[bool] = []

    def stream() -> None:
        with httpx.stream("POST", rb.url + "/v1/chat/completions", json=chat(), headers=h, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    ids.append(json.loads(line[6:])["id"])
                    break
            try:
                rest = list(lines)
                cut.append("data: [DONE]" not in rest)
            except httpx.HTTPError:  # the replica died mid-stream
                cut.append(True)

    ts = [threading.Thread(target=stream) for _ in range(2)]
    for t in ts:
        t.start()
    wait_until(lambda: len(ids) == 2, "two streams started on rb")
    wait_until(lambda: sum(r["status"] == "running" and r["id"] in ids for r in cluster.records()) == 2,
               "their running records written")
    rb.proc.send_signal(signal.SIGKILL)
    rb.proc.wait(10)
    for t in ts:
        t.join()
    assert cut == [True, True]  # neither stream ended normally
    t0 = time.monotonic()
    # rb's live key expires (5 s), then ra's next sweep (every 5 s) marks its running rows
    wait_until(lambda: sum(r["status"] == "incomplete" and r["id"] in ids for r in cluster.records()) == 2,
               "rb's records marked incomplete", timeout_s=20)
    rows = [r for r in cluster.records() if r["id"] in ids]
    assert {(r["replica"], r["error_code"]) for r in rows} == {("rb", "replica_lost")}
    print(f"incomplete after {time.monotonic() - t0:.1f} s")
    assert httpx.post(cluster.lb + "/v1/chat/completions", json=chat(stream=False), headers=h,
                      timeout=30).status_code == 200  # ra serves alone
