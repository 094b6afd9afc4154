"""The gateway behind the REAL sglang-router (pinned in pyproject's ``scaleout`` extra) in front of
two SGLang 0.5.23 STAND-INS (``tests/support/sglang_standin.py``: SGLang's native HTTP API, no
model).

The router is the package's own Rust binary, started as a subprocess with
``python -m sglang_router.launch_router`` (``tests/support/scaleout.py``: ``Router``, its flags
in ``ROUTER_FLAGS``; docs/deploy-gpu.md lists what each was checked for). The gateway is the real app (``create_app``) with the router
as its one SGLang upstream, on uvicorn in a thread, like ``tests/runtime/sglang/test_gateway.py``.

Checked, through HTTP only:

* requests spread over both workers (``round_robin``);
* the tier's ``priority`` arrives at the worker unchanged; the SLA target and cap arrive in
  ``custom_labels`` (the router drops ``sampling_params.custom_params``, measured here too);
* a client disconnect ends the request on the worker that held it (the router does not route
  ``POST /abort_request`` — 404 — but closes its stream to the worker), not on the other one;
* a worker killed mid-stream: its stream ends with one OpenAI-shaped SSE error event and
  ``[DONE]``, and a ``failed`` record; new requests then reach the survivor (the router retries
  a refused connection on the other worker, so none fails even inside the health-check
  interval); the restarted worker gets requests again once its health check passed;
* no worker left: OpenAI-shaped 500s until the router's circuit breaker opens, then 503s with
  ``Retry-After``, and the gateway's ``/readyz`` (probing the router's ``/readiness``) turns 503.

Without the router package (or with another version) these tests skip, and fail under ``CI=true``.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from dataclasses import dataclass

import httpx
import pytest

from gateway.main import create_app
from runtime.sglang.client import SLA_MAX_WEIGHT_KEY, SLA_TARGET_KEY
from tests.conftest import require_or_skip
from tests.runtime.sglang.test_gateway import (ADMIN, ADMIN_H, PROMPT_IDS, SLA_MAX_WEIGHT, TENANT, TIER,
                                               TIER_PRIORITY, TIER_TARGET_TPS, assert_openai_error, chat, record,
                                               write_tokenizer)
from tests.support.gateway_fixtures import MODEL, make_settings, parse_sse, sqlite_url
from tests.support.hardening_util import serve_in_thread
from tests.support.polling import wait_until
from tests.support.scaleout import ROUTER_CB_OPEN_S as CB_OPEN_S
from tests.support.scaleout import ROUTER_FAILURES as FAILURES
from tests.support.scaleout import ROUTER_HEALTH_INTERVAL_S as HEALTH_INTERVAL_S
from tests.support.scaleout import ROUTER_VERSION, Router, router_missing
from tests.support.sglang_standin import SGLangStandin, StandinServer

pytestmark = [pytest.mark.scaleout, pytest.mark.slow]  # the router takes ~1.3 s to register its workers

@dataclass
class Cluster:
    base: str  # the gateway
    router: Router
    key: str
    workers: list[StandinServer]

    @property
    def auth(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"}

    def healthy_workers(self) -> set[str]:
        return self.router.healthy_workers()

    def chat(self, stream: bool = False) -> httpx.Response:
        return httpx.post(f"{self.base}/v1/chat/completions", json=chat(stream), headers=self.auth, timeout=30)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, migrated_template):
    missing = router_missing()
    require_or_skip(missing is None, f"sglang-router=={ROUTER_VERSION} ({missing}; pip install -e '.[scaleout]')")
    tmp = tmp_path_factory.mktemp("sglang-router")
    workers = [StandinServer().start(), StandinServer().start()]
    router = Router([w.url for w in workers], tmp)
    db = tmp / "gateway.db"
    shutil.copy(migrated_template, db)
    settings = make_settings(
        sqlite_url(db), admin_token=ADMIN, model_name=MODEL, max_context=256,
        backend="sglang", sglang_urls=[router.url], sglang_tokenizer_path=str(write_tokenizer(tmp / "tokenizer")),
        sglang_send_priority=True, sglang_sla_max_weight=SLA_MAX_WEIGHT, sglang_sla_in_custom_labels=True,
        # the router's /health is liveness only (always 200); /readiness is 503 without a healthy worker
        sglang_health_path="/readiness", sglang_health_interval_s=HEALTH_INTERVAL_S, record_flush_interval_s=0.05,
    )
    app = create_app(settings)
    try:
        router.start()
        with serve_in_thread(app, ready_timeout_s=60, timeout_graceful_shutdown=2) as base:
            with httpx.Client(base_url=base, headers=ADMIN_H, timeout=30) as c:
                assert c.post("/admin/v1/tiers", json={"name": TIER, "min_tokens_per_s": TIER_TARGET_TPS,
                                                       "priority": TIER_PRIORITY}).status_code == 201
                assert c.post("/admin/v1/tenants", json={"name": TENANT, "tier": TIER}).status_code == 201
                r = c.post("/admin/v1/keys", json={"tenant": TENANT, "user": "alice"})
                assert r.status_code == 201, r.text
            yield Cluster(base, router, r.json()["key"], workers)
    finally:
        router.stop(10)
        for w in workers:
            w.stop()


@pytest.fixture(autouse=True)
def _fresh_standins(cluster):
    for w in cluster.workers:
        w.standin.reset()
    yield


def _received(cluster) -> list[list[str]]:
    return [[b["rid"] for b in w.standin.requests] for w in cluster.workers]


def test_requests_spread_over_both_workers_with_priority_and_sla(cluster):
    for w in cluster.workers:
        w.standin.spec_gamma = 7  # the final chunk carries SGLang's spec_* meta_info
    ids = []
    for i in range(4):
        r = cluster.chat(stream=bool(i % 2))
        assert r.status_code == 200, r.text
        ids.append(parse_sse(r.text)[0]["id"] if i % 2 else r.json()["id"])
        text = ("".join(e["choices"][0]["delta"].get("content") or "" for e in parse_sse(r.text)[:-1]
                        if e.get("choices")) if i % 2 else r.json()["choices"][0]["message"]["content"])
        assert text == "".join(SGLangStandin.script)
    a, b = _received(cluster)
    assert len(a) == len(b) == 2 and sorted(a + b) == sorted(ids)  # round_robin: 2 + 2
    for body in cluster.workers[0].standin.requests + cluster.workers[1].standin.requests:
        assert body["input_ids"] == PROMPT_IDS and body["stream"] is True
        assert body["priority"] == TIER_PRIORITY  # kept by the router
        # the router rebuilds the body: custom_params is gone, custom_labels carries the SLA
        assert "custom_params" not in body["sampling_params"]
        assert body["custom_labels"] == {SLA_TARGET_KEY: repr(TIER_TARGET_TPS), SLA_MAX_WEIGHT_KEY: repr(SLA_MAX_WEIGHT)}
    # the chunks pass through the router unchanged: the records carry the workers' speculative stats
    client = httpx.Client(base_url=cluster.base, timeout=30)
    for w in cluster.workers:
        for body, meta in zip(w.standin.requests, [c["meta_info"] for c in w.standin.chunks_sent
                                                   if c["meta_info"]["finish_reason"]]):
            rec = record(client, body["rid"])
            assert meta["id"] == body["rid"] and rec["status"] == "finished"
            assert (rec["spec_rounds"], rec["spec_accepted"]) == (meta["spec_verify_ct"], meta["spec_num_correct_drafts"])
            assert rec["completion_tokens"] == meta["completion_tokens"] == 8


def test_client_disconnect_ends_the_request_on_the_worker_holding_it(cluster):
    for w in cluster.workers:
        w.standin.step_delay_s = 0.05
        w.standin.script = tuple(f" w{i}" for i in range(400))  # 20 s if nobody stops it
    seen, rid = [], None
    with httpx.stream("POST", f"{cluster.base}/v1/chat/completions", json=chat(True), headers=cluster.auth,
                      timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                rid = chunk["id"]
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    seen.append(chunk["choices"][0]["delta"]["content"])
            if len(seen) == 3:
                break  # closes the TCP connection mid-stream
    holder = next(w for w in cluster.workers if w.standin.requests)
    other = next(w for w in cluster.workers if w is not holder)
    assert [b["rid"] for b in holder.standin.requests] == [rid] and other.standin.requests == []
    # the gateway closed its stream to the router, the router its stream to the worker
    wait_until(lambda: rid in holder.standin.disconnects, "the worker's stream to close")
    assert rid not in holder.standin.active and len(holder.standin.chunks_sent) < 100
    assert holder.standin.aborts == [] and other.standin.disconnects == []  # /abort_request: 404 at the router
    rec = record(httpx.Client(base_url=cluster.base, timeout=30), rid)
    assert (rec["status"], rec["tenant"]) == ("cancelled", TENANT)


def test_worker_killed_mid_stream_then_survivor_then_rejoin(cluster, capsys):
    for w in cluster.workers:
        w.standin.step_delay_s = 0.05
        w.standin.script = tuple(f" w{i}" for i in range(60))  # 3 s
    results: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: results.append(cluster.chat(stream=True))) for _ in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: all(len(w.standin.chunks_sent) >= 3 for w in cluster.workers), "both workers streaming")
    victim, survivor = cluster.workers
    victim_rid, survivor_rid = victim.standin.requests[0]["rid"], survivor.standin.requests[0]["rid"]
    port = int(victim.url.rsplit(":", 1)[1])
    killed_at = time.monotonic()
    victim.stop()  # the server is gone: its open streams end mid-body, new connections are refused
    # inside the health-check window (the router still lists the dead worker as healthy):
    # every new request is answered, by the survivor (the router retries the refused connection)
    for w in cluster.workers:
        w.standin.step_delay_s = 0.0
    listed = []  # whether the router still listed the dead worker as healthy when each was sent
    for _ in range(4):
        listed.append(victim.url in cluster.healthy_workers())
        r = cluster.chat()
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "".join(f" w{i}" for i in range(60))
    assert listed[0], "the first request was not sent inside the health-check window (machine too loaded)"
    inside_s = time.monotonic() - killed_at
    assert [b["rid"] for b in survivor.standin.requests][1:] and len(survivor.standin.requests) == 5
    wait_until(lambda: victim.url not in cluster.healthy_workers(), "the router to mark the killed worker unhealthy",
               timeout_s=HEALTH_INTERVAL_S * (FAILURES + 3))
    out_s = time.monotonic() - killed_at
    for t in threads:
        t.join(30)
    # the victim's stream: one OpenAI error event then [DONE]; a failed record. The survivor's: complete
    by_rid = {parse_sse(r.text)[0]["id"]: parse_sse(r.text) for r in results}
    assert all(r.status_code == 200 for r in results) and set(by_rid) == {victim_rid, survivor_rid}
    events = by_rid[victim_rid]
    assert events[-1] == "[DONE]"
    assert_openai_error(events[-2], "upstream_disconnected")
    assert not any(e["choices"][0].get("finish_reason") for e in events[:-2] if e.get("choices"))
    client = httpx.Client(base_url=cluster.base, timeout=30)
    rec = record(client, victim_rid)
    assert (rec["status"], rec["error_code"], rec["tenant"]) == ("failed", "upstream_disconnected", TENANT)
    assert 3 <= rec["completion_tokens"] < 60
    assert by_rid[survivor_rid][-1] == "[DONE]" and by_rid[survivor_rid][-2]["usage"]["completion_tokens"] == 61
    assert record(client, survivor_rid)["status"] == "finished"
    # the worker comes back on the same port and rejoins after a passing health check
    back = StandinServer(victim.standin, port=port).start()
    cluster.workers[0] = back
    back.standin.reset()
    restarted_at = time.monotonic()
    wait_until(lambda: back.url in cluster.healthy_workers(), "the restarted worker to rejoin",
               timeout_s=HEALTH_INTERVAL_S * 5)
    rejoin_s = time.monotonic() - restarted_at
    survivor.standin.requests.clear()
    for _ in range(4):
        assert cluster.chat().status_code == 200
    assert len(back.standin.requests) == 2 and len(survivor.standin.requests) == 2
    with capsys.disabled():
        print(f"\nsglang-router {ROUTER_VERSION}: 4 requests ({sum(listed)} inside the window) answered by the "
              f"survivor within {inside_s:.2f} s of "
              f"the kill; worker out after {out_s:.2f} s; back in {rejoin_s:.2f} s after its restart")


def test_no_worker_left_is_a_clean_503_and_readyz_follows(cluster, capsys):
    """Both workers down. Before the router knows (health check not failed yet) it forwards to a
    dead worker, retries, and answers HTTP 500 ``call_upstream_request_error`` → the gateway's
    OpenAI-shaped 502 ``upstream_error``; once its circuit breaker opened (failed attempts,
    ``--cb-failure-threshold``) or the health check failed: 503 ``no_available_workers`` → the
    gateway's 503 ``queue_full`` with ``Retry-After``, and when the gateway's own probe of
    ``/readiness`` failed, 503 ``model_not_ready`` and ``/readyz`` 503. No 502 after the first
    503. Both back → ``/readyz`` 200, and requests served once the open circuits half-open
    (503 ``queue_full`` until then)."""
    ports = [int(w.url.rsplit(":", 1)[1]) for w in cluster.workers]
    standins = [w.standin for w in cluster.workers]
    for w in cluster.workers:
        w.stop()
    seen: list[tuple[int, str]] = []
    deadline = time.monotonic() + HEALTH_INTERVAL_S * (FAILURES + 5)
    while httpx.get(cluster.base + "/readyz", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, "the gateway's /readyz stayed 200 without workers"
        r = cluster.chat()
        message = assert_openai_error(r.json(), r.json()["error"]["code"])
        seen.append((r.status_code, r.json()["error"]["code"]))
        if r.status_code == 502:
            assert seen[-1] == (502, "upstream_error") and "error sending request" in message
        else:
            assert r.status_code == 503 and r.headers["retry-after"], r.text
            assert seen[-1][1] in ("queue_full", "model_not_ready")
    statuses = [status for status, _ in seen]
    if 503 in statuses:
        assert 502 not in statuses[statuses.index(503):]
    r = cluster.chat(stream=True)
    assert r.status_code == 503 and r.headers["retry-after"]
    assert_openai_error(r.json(), "model_not_ready")
    cluster.workers[:] = [StandinServer(st, port=p).start() for st, p in zip(standins, ports)]
    back_at = time.monotonic()
    wait_until(lambda: httpx.get(cluster.base + "/readyz", timeout=5).status_code == 200, "the gateway ready again",
               timeout_s=HEALTH_INTERVAL_S * 8)
    # the router's circuits (opened above) let requests through again after CB_OPEN_S; until
    # then its 503 no_available_workers is the gateway's 503 queue_full
    while (r := cluster.chat()).status_code != 200:
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", r.text
        assert time.monotonic() - back_at < HEALTH_INTERVAL_S * 8 + CB_OPEN_S, "no request served after the restart"
        time.sleep(0.1)
    served_s = time.monotonic() - back_at
    assert r.json()["choices"][0]["message"]["content"] == "".join(SGLangStandin.script)
    with capsys.disabled():
        print(f"\nno worker left: {seen}; served again {served_s:.2f} s after the restart")
