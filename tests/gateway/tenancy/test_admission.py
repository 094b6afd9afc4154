"""Admission: per-tenant concurrency under real concurrency, queue timeouts, token
budgets, the SLA-aware priority queue and the speed model behind it."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.tenancy.admission import SpeedModel, TierPolicy
from gateway.crud import records as crud_records
from gateway.db.models import RequestRecord
from gateway.openai.generation import ClientDisconnected
from gateway.observability.observe import RequestContext
from runtime.speculation.sps import SpsTable
from runtime.interface import LoadSnapshot, SpecInfo, SpecStats
from tests.support.fakes import FakeBackend
from tests.support.gateway_fixtures import chat
from tests.support.polling import async_wait_until
from tests.support.tenancy_fixtures import (ADMIN_HEADERS, CountingBackend, LeavingClient, admin_setup, bearer,
                                    controller_with_a_full_tenant, new_key, running_app)


async def rows(app, **filters) -> list[RequestRecord]:
    await app.state.records.flush()
    async with app.state.sessionmaker() as s:
        return (await crud_records.query_records(s, limit=1000, **filters))[0]


async def test_fifty_simultaneous_requests_never_more_than_five_in_the_engine(tenancy_db):
    backend = CountingBackend(token_delay_s=0.02)
    async with running_app(tenancy_db, backend) as (app, client):
        await admin_setup(client, {"five": {"max_concurrent": 5, "max_queue_wait_s": 60}}, {"acme": "five"})
        key = await new_key(client, "acme", "alice")
        # one request first: the key and its policy are cached, so an admission that finds a
        # free slot does no I/O at all (its wait cannot grow with the machine's load)
        assert (await client.post("/v1/chat/completions", json=chat(), headers=bearer(key))).status_code == 200
        t0 = time.monotonic()
        rs = await asyncio.gather(*(client.post("/v1/chat/completions", json=chat(stream=i % 2 == 0),
                                                headers=bearer(key)) for i in range(50)))
        elapsed = time.monotonic() - t0
        assert [r.status_code for r in rs] == [200] * 50
        assert backend.peak == 5  # the limit was reached and never exceeded
        assert len(backend.completed) == 51
        # 7 tokens × 20 ms per request, 10 waves of 5 → at least 1.4 s: requests really queued
        assert elapsed > 1.0
        recs = await rows(app, tenant="acme")
        assert len(recs) == 51 and {r.status for r in recs} == {"finished"}
        waits = sorted(r.admission_wait_s for r in recs)
        assert waits[4] < 0.2 and waits[-1] > 0.8  # the first wave went straight in, the last waited
        assert app.state.admission.tenant_active["acme"] == 0


async def test_queue_timeout_is_a_429_with_retry_after_and_a_rejected_record(sqlite_db):
    backend = FakeBackend(gate=asyncio.Event())  # the first request holds the slot until the gate opens
    async with running_app(sqlite_db, backend) as (app, client):
        await admin_setup(client, {"one": {"max_concurrent": 1, "max_queue_wait_s": 0.2}}, {"solo": "one"})
        key = await new_key(client, "solo")
        slow = asyncio.create_task(client.post("/v1/chat/completions", json=chat(), headers=bearer(key)))
        await async_wait_until(lambda: app.state.admission.tenant_active["solo"] == 1, "the first request admitted")
        t0 = time.monotonic()
        r = await client.post("/v1/chat/completions", json=chat(stream=True), headers=bearer(key))
        waited = time.monotonic() - t0
        assert r.status_code == 429 and waited >= 0.2 and not slow.done()  # gave up while the slot was held
        backend.gate.set()
        err = r.json()["error"]
        assert err["type"] == "requests" and err["code"] == "concurrency_limit_exceeded"
        assert "max_concurrent" in err["message"] and "'solo'" in err["message"]
        assert r.headers["retry-after"] == "1"
        assert (await slow).status_code == 200
        recs = await rows(app, tenant="solo")
        assert sorted(r.status for r in recs) == ["finished", "rejected"]
        rejected = next(r for r in recs if r.status == "rejected")
        assert rejected.error_code == "concurrency_limit_exceeded" and rejected.admission_wait_s >= 0.2
        assert rejected.completion_tokens == 0 and rejected.tier == "one"


async def test_token_budget_is_enforced_and_counted_in_the_db(sqlite_db):
    async with running_app(sqlite_db) as (app, client):
        key = await new_key(client, "acme", "bob", token_budget=30)
        first = await client.post("/v1/chat/completions", json=chat("hi"), headers=bearer(key))
        used = first.json()["usage"]["total_tokens"]
        assert first.status_code == 200 and used == 7 + 6  # prompt "hi" templated = 6 tokens, 7 completion
        second = await client.post("/v1/chat/completions", json=chat("hi"), headers=bearer(key))
        assert second.status_code == 200  # 13 < 30
        third = await client.post("/v1/chat/completions", json=chat("hi"), headers=bearer(key))
        assert third.status_code == 200  # 26 < 30: the last request may overshoot
        r = await client.post("/v1/chat/completions", json=chat("hi"), headers=bearer(key))
        assert r.status_code == 429
        assert r.json()["error"]["type"] == "insufficient_quota" and r.json()["error"]["code"] == "insufficient_quota"
        await app.state.records.flush()
        listing = (await client.get("/admin/v1/keys", headers=ADMIN_HEADERS)).json()["data"]
        assert listing[0]["tokens_used"] == 39 and listing[0]["token_budget"] == 30


# ------------------------------------------------------------------ SLA admission
def sla_app_setup(app, per_request_tps):
    """Replace the speed model's prediction by a known curve (tok/s at batch size n)."""
    app.state.admission.model.predict = per_request_tps


async def test_sla_admission_holds_lower_priority_until_the_gold_request_ends(sqlite_db):
    backend = FakeBackend(gate=asyncio.Event())  # gold holds its slot until the test opens the gate
    async with running_app(sqlite_db, backend) as (app, client):
        await admin_setup(client, {"gold": {"min_tokens_per_s": 20, "priority": 10},
                                   "bronze": {"priority": 0, "max_queue_wait_s": 30}},
                          {"acme": "gold", "initech": "bronze"})
        gold, bronze = await new_key(client, "acme", "g"), await new_key(client, "initech", "b")
        sla_app_setup(app, lambda n: 30.0 / n)  # 1 request: 30 tok/s; 2 requests: 15 < 20
        ctl, orig, finished_before = app.state.admission, backend.generate, []

        def spy(req):  # how many generations had finished when this one started
            finished_before.append(len(backend.completed))
            return orig(req)

        backend.generate = spy
        g = asyncio.create_task(client.post("/v1/chat/completions", json=chat(), headers=bearer(gold)))
        await async_wait_until(lambda: ctl.active, "gold admitted")
        assert not ctl._waiters  # gold went straight in
        b = asyncio.create_task(client.post("/v1/chat/completions", json=chat(), headers=bearer(bronze)))
        await async_wait_until(lambda: ctl._waiters, "bronze queued")
        t_queued = time.monotonic()
        assert (ctl._waiters[0].tenant, ctl._waiters[0].blocked, ctl._waiters[0].predicted) == ("initech", "sla", 15.0)
        assert not b.done() and finished_before == [0]
        held = time.monotonic() - t_queued
        backend.gate.set()  # gold runs to its end; its release admits bronze
        assert (await b).status_code == 200 and (await g).status_code == 200
        assert finished_before == [0, 1]  # bronze started only after gold had finished
        assert backend.requests[0].sla_target_tokens_per_s == 20 and backend.requests[0].priority == 10
        assert backend.requests[1].sla_target_tokens_per_s is None and backend.requests[1].priority == 0
        recs = {r.tier: r for r in await rows(app)}
        assert recs["bronze"].admission_wait_s >= held  # its record counts the time it was held
        assert recs["gold"].predicted_tokens_per_s == 30.0 and recs["bronze"].predicted_tokens_per_s == 30.0


async def test_sla_admission_times_out_with_a_clear_429_and_never_blocks_higher_tiers(sqlite_db):
    backend = FakeBackend(gate=asyncio.Event())  # the golds hold their slots until the gate opens
    async with running_app(sqlite_db, backend) as (app, client):
        await admin_setup(client, {"gold": {"min_tokens_per_s": 20, "priority": 10},
                                   "bronze": {"priority": 0, "max_queue_wait_s": 0.2}},
                          {"acme": "gold", "initech": "bronze"})
        gold, bronze = await new_key(client, "acme"), await new_key(client, "initech")
        sla_app_setup(app, lambda n: 30.0 / n)
        ctl = app.state.admission
        g1 = asyncio.create_task(client.post("/v1/chat/completions", json=chat(), headers=bearer(gold)))
        await async_wait_until(lambda: ctl.active, "the first gold request admitted")
        b = await client.post("/v1/chat/completions", json=chat(), headers=bearer(bronze))
        assert b.status_code == 429
        err = b.json()["error"]
        assert err["code"] == "sla_capacity_exceeded" and err["type"] == "requests"
        assert "predicted 15.0 tok/s" in err["message"] and "tier 'bronze'" in err["message"]
        g2 = asyncio.create_task(client.post("/v1/chat/completions", json=chat(), headers=bearer(gold)))
        await async_wait_until(lambda: len(ctl.active) == 2, "the second gold request admitted beside the first")
        backend.gate.set()
        assert (await g2).status_code == 200 and (await g1).status_code == 200
        assert ctl.rejections["sla_capacity_exceeded"] == 1


async def test_waiters_are_served_by_priority_then_arrival(sqlite_db):
    """Any concurrency breaks every target (30 tok/s alone, 15 with company). Queued
    while gold runs: bronze₁, silver, bronze₂. Silver goes first (priority), then bronze
    in arrival order (its tenant runs one at a time); a request admitted in the same pass
    counts for the next check, so bronze never overlaps silver."""
    backend = FakeBackend(gate=asyncio.Event())  # gold holds its slot until all three are queued
    async with running_app(sqlite_db, backend) as (app, client):
        await admin_setup(client, {"gold": {"min_tokens_per_s": 20, "priority": 10},
                                   "silver": {"min_tokens_per_s": 20, "priority": 5, "max_queue_wait_s": 10},
                                   "bronze": {"priority": 0, "max_concurrent": 1, "max_queue_wait_s": 10}},
                          {"g": "gold", "s": "silver", "b": "bronze"})
        keys = {t: await new_key(client, t) for t in "gsb"}
        sla_app_setup(app, lambda n: 30.0 if n == 1 else 15.0)
        ctl = app.state.admission
        order, overlap = [], []
        orig = backend.generate

        def spy(req):
            order.append(req.tenant)
            overlap.append(backend._running)  # generations already running when this one starts
            return orig(req)

        backend.generate = spy
        gold = asyncio.create_task(client.post("/v1/chat/completions", json=chat(), headers=bearer(keys["g"])))
        await async_wait_until(lambda: ctl.active, "gold admitted")
        queued = []
        for i, t in enumerate(("b", "s", "b")):
            queued.append(asyncio.create_task(client.post("/v1/chat/completions", json=chat(), headers=bearer(keys[t]))))
            await async_wait_until(lambda: len(ctl._waiters) == i + 1, f"waiter {i + 1} queued")  # in this order
        assert not gold.done() and [w.tenant for w in ctl._waiters] == ["s", "b", "b"]
        backend.gate.set()
        assert (await gold).status_code == 200
        assert all(r.status_code == 200 for r in await asyncio.gather(*queued))
        assert order == ["g", "s", "b", "b"] and overlap == [0, 0, 0, 0]  # one at a time


async def test_client_leaving_while_queued_is_reported_cancelled_once():
    from tests.gateway.observability.test_observe import Recorder

    ctl = controller_with_a_full_tenant(TierPolicy("one", max_concurrent=1, max_queue_wait_s=30))
    client = LeavingClient()
    from gateway.core.security import Principal

    rec = Recorder()
    ctx = RequestContext("r1", "chat", "m", False, prompt_tokens=3, max_tokens=5, tenant="t")
    admit = asyncio.create_task(ctl.admit(client, Principal(tenant="t", key_id=1), ctx, [rec, ctl]))
    await async_wait_until(lambda: ctl._waiters, "the request queued")
    t0 = time.monotonic()
    client.leave()
    with pytest.raises(ClientDisconnected):
        await admit
    assert time.monotonic() - t0 < 10.0  # at once, not after max_queue_wait_s (30 s)
    assert [o.status for o in rec.outcomes] == ["cancelled"] and ctl._waiters == []
    assert ctl.tenant_active["t"] == 1 and ctl.active == {}


# ------------------------------------------------------------------ speed model
class LoadBackend(FakeBackend):
    snapshot: LoadSnapshot = LoadSnapshot(0, 0, 16, 0)
    spec: SpecInfo = SpecInfo("none")

    def load(self):
        return self.snapshot

    def spec_info(self):
        return self.spec


def test_speed_model_affine_fit_from_live_step_rate():
    b = LoadBackend()
    now = [0.0]
    m = SpeedModel(b, prior_step_s=0.02, clock=lambda: now[0])
    assert m.predict(1) == pytest.approx(50.0) and m.predict(3) == pytest.approx(1 / (0.02 * 1.1))  # prior, β = 0.05
    steps = 0

    def run(n, step_s, k=5):
        nonlocal steps
        for _ in range(k):
            b.snapshot = LoadSnapshot(n, 0, 16, steps)
            m.sample()
            now[0] += 0.1
            steps += round(0.1 / step_s)
        b.snapshot = LoadSnapshot(0, 0, 16, steps)  # idle gap: the next interval is not a sample
        m.sample()
        now[0] += 5.0

    run(2, 0.010)  # one batch size seen: β through it
    assert m.predict(2) == pytest.approx(100.0) and m.predict(4) == pytest.approx(1 / (0.010 * 1.15 / 1.05))
    run(6, 0.020)  # two sizes: step = 0.005 + 0.0025·n
    assert m.predict(2) == pytest.approx(100.0) and m.predict(6) == pytest.approx(50.0)
    assert m.predict(10) == pytest.approx(1 / 0.030)


def test_speed_model_uses_the_sps_table_tau_and_draft_length():
    table = SpsTable([1, 4, 16], [256], [[100.0, 80.0, 40.0]])
    b = LoadBackend()
    b.spec = SpecInfo("dspark", "dspark-sla", 3, table.to_dict())
    b.set_ready(True)  # the table is read once the backend runs
    m = SpeedModel(b)
    # before any request: τ = 1, ℓ = γ = 3 → B = 4n
    assert m.predict(1) == pytest.approx(80.0) and m.predict(4) == pytest.approx(40.0)
    m.observe(SpecStats(rounds=10, drafted=10, verified=10, accepted=15, emitted=25))  # τ 2.5, ℓ 1
    assert m.tau == 2.5 and m.draft_len == 1.0
    assert m.predict(2) == pytest.approx(2.5 * 80.0)  # B = 4
    assert m.predict(8) == pytest.approx(2.5 * 40.0)  # B = 16


def test_speed_model_is_not_biased_by_polling_faster_than_the_engine_steps():
    """Steps of 0.25 s polled every 0.1 s: most polls see no new step; windows of ≥ 8
    steps still measure 0.25 s (a per-poll estimate would say 0.1 s)."""
    b = LoadBackend()
    now = [0.0]
    m = SpeedModel(b, clock=lambda: now[0])
    for i in range(200):
        now[0] = i * 0.1
        b.snapshot = LoadSnapshot(8, 0, 16, int(now[0] / 0.25))
        m.sample()
    assert len(m.samples) >= 8
    assert m.step_seconds(8) == pytest.approx(0.25, rel=0.05) and m.predict(8) == pytest.approx(4.0, rel=0.05)
