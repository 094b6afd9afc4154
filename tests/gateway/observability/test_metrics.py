"""Prometheus metrics: the observer's counters/histograms on a FakeBackend app, label
cardinality caps, /metrics protection, the engine's verification-budget counters, and
values on the live server that agree with the responses' ``usage``.

Metrics live in prometheus-client's process-wide registry, so every assertion here is
on a difference (after − before)."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from gateway.observability import metrics
from gateway.crud import records as crud_records
from gateway.crud.keys import issue_key
from gateway.main import create_app
from gateway.observability.observe import CANCELLED, FAILED, FINISHED, REJECTED, RequestContext, RequestOutcome
from runtime.speculation.sps import SpsTable
from runtime.interface import Finished, FinishReason, LoadSnapshot, RequestTimings, SpecInfo, SpecStats, TextDelta
from tests.support.fakes import FakeBackend
from tests.support.gateway_fixtures import chat, make_settings
from tests.support.servers import free_port
from tests.support.tenancy_fixtures import admin_setup, new_key
from tests.support.tenancy_fixtures import running_app as tenancy_app
from tests.support import TEST_DATA

ADMIN = "admin-test-token"


def total(name: str, **labels) -> float:
    """Sum of the samples ``name`` whose labels include ``labels`` (others: any value)."""
    return sum(s.value for f in REGISTRY.collect() for s in f.samples
               if s.name == name and labels.items() <= s.labels.items())


class Delta:
    """:func:`total` relative to when this object was created."""

    def __init__(self):
        self.before = [(s.name, s.labels, s.value) for f in REGISTRY.collect() for s in f.samples]

    def __call__(self, name: str, **labels) -> float:
        old = sum(v for n, lab, v in self.before if n == name and labels.items() <= lab.items())
        return total(name, **labels) - old


@asynccontextmanager
async def running_app(db_url, backend, **overrides):
    application = create_app(make_settings(db_url, admin_token=ADMIN, **overrides), backend)
    async with application.router.lifespan_context(application):
        await application.state.backend_start
        transport = httpx.ASGITransport(app=application, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway.test") as c:
            yield application, c


# -- the observer on a FakeBackend app -----------------------------------------------------

async def test_outcomes_update_counters_and_histograms(app, client, auth, backend):
    d = Delta()
    labels = {"tenant": "acme"}  # any tier (tiers are the tenancy code's business)
    r1 = await client.post("/v1/chat/completions", json=chat(), headers=auth)
    r2 = await client.post("/v1/chat/completions", json=chat(stream=True, max_tokens=3), headers=auth)
    backend.fail_after_deltas = 2
    await client.post("/v1/chat/completions", json=chat(stream=True), headers=auth)
    backend.fail_after_deltas, backend.queue_full = None, True
    r4 = await client.post("/v1/chat/completions", json=chat(), headers=auth)
    backend.queue_full = False
    r5 = await client.post("/v1/chat/completions", json=chat(model="nope"), headers=auth)
    r6 = await client.post("/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer wrong"})
    assert (r1.status_code, r2.status_code, r4.status_code, r5.status_code, r6.status_code) == (200, 200, 503, 404, 401)
    prompt = r1.json()["usage"]["prompt_tokens"]

    assert d("sparkgate:request_success_total", finished_reason="stop", **labels) == 1
    assert d("sparkgate:request_success_total", finished_reason="length", **labels) == 1
    assert d("sparkgate:request_errors_total", code="engine_error", **labels) == 1
    assert d("sparkgate:request_errors_total", code="queue_full", **labels) == 1
    assert d("sparkgate:request_errors_total", code="model_not_found", tenant="unknown", tier="unknown") == 1
    assert d("sparkgate:request_errors_total", code="invalid_api_key", tenant="unknown", tier="unknown") == 1
    # tokens: finished 7 + 3, failed 2 emitted before failing; the rejected one never ran
    assert d("sparkgate:generation_tokens_total", **labels) == 7 + 3 + 2
    assert d("sparkgate:prompt_tokens_total", **labels) == 3 * prompt
    # TTFT/ITL/queue for the three that ran; e2e and TPOT for the two finished
    assert d("sparkgate:time_to_first_token_seconds_count", **labels) == 3
    assert d("sparkgate:inter_token_latency_seconds_count", **labels) == 6 + 2 + 1
    assert d("sparkgate:request_queue_time_seconds_count", **labels) == 2  # the fake's Failed has no timings
    assert d("sparkgate:e2e_request_latency_seconds_count", **labels) == 2
    assert d("sparkgate:request_time_per_output_token_seconds_count", **labels) == 2
    assert d("sparkgate:spec_decode_num_drafts_total") == 0  # no speculation asked for


async def test_inter_token_latency_is_measured_per_delta(app, client, auth, backend):
    backend.token_delay_s, backend.tokens_per_delta = 0.05, 2  # 7 tokens → deltas of 2, 2, 2, 1
    d = Delta()
    labels = {"tenant": "acme"}
    r = await client.post("/v1/chat/completions", json=chat(), headers=auth)
    assert r.json()["usage"]["completion_tokens"] == 7
    assert d("sparkgate:inter_token_latency_seconds_count", **labels) == 3  # one per delta after the first
    itl_sum = d("sparkgate:inter_token_latency_seconds_sum", **labels)
    assert 3 * 0.05 <= itl_sum < 3 * 0.05 + 0.5
    # per output token: the same span over 6 token gaps
    assert d("sparkgate:request_time_per_output_token_seconds_sum", **labels) == pytest.approx(itl_sum / 6, rel=1e-6)
    assert d("sparkgate:inter_token_latency_seconds_bucket", le="0.04", **labels) == 0
    assert d("sparkgate:inter_token_latency_seconds_bucket", le="0.5", **labels) == 3
    e2e = d("sparkgate:e2e_request_latency_seconds_sum", **labels)
    assert e2e >= itl_sum + d("sparkgate:time_to_first_token_seconds_sum", **labels)


def test_gated_rounds_are_not_counted_as_drafts():
    """Rounds the speculation gate ran as plain decode drafted nothing: not in num_drafts."""
    d = Delta()
    stats = SpecStats(rounds=10, drafted=12, verified=5, accepted=3, emitted=13, accepted_per_position=[2, 1],
                      gated_rounds=7)
    o = SimpleNamespace(spec=stats, ctx=SimpleNamespace(constraint=None))
    metrics.MetricsObserver._spec(o, "default")  # verified/rounds 0.5: exact in binary
    assert d("sparkgate:spec_decode_num_drafts_total") == 3
    assert d("sparkgate:spec_decode_num_draft_tokens_total") == 12
    assert d("sparkgate:spec_decode_num_drafts_by_constraint_total", constraint="none") == 3


async def test_spec_stats_feed_the_spec_decode_counters(app, client, auth):
    d = Delta()
    r = await client.post("/v1/chat/completions", json=chat(return_spec_stats=True), headers=auth)
    spec = r.json()["spec_stats"]
    # FakeBackend: 7 tokens → 3 rounds of 4 drafted/verified, 4 accepted, per position [3, 1]
    assert (spec["rounds"], spec["drafted"], spec["verified"], spec["accepted"]) == (3, 12, 12, 4)
    assert d("sparkgate:spec_decode_num_drafts_total") == 3
    assert d("sparkgate:spec_decode_num_draft_tokens_total") == 12
    assert d("sparkgate:spec_decode_num_verified_tokens_total") == 12
    assert d("sparkgate:spec_decode_num_accepted_tokens_total") == 4
    assert d("sparkgate:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 3
    assert d("sparkgate:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 1
    assert d("sparkgate:spec_decode_verified_tokens_per_round_sum") == pytest.approx(4.0)  # a float sum of deltas
    assert d("sparkgate:spec_decode_verified_tokens_per_round_count") == 1
    # a free-text request: all of it under constraint="none"
    assert d("sparkgate:spec_decode_num_drafts_by_constraint_total", constraint="none") == 3
    assert d("sparkgate:spec_decode_num_draft_tokens_by_constraint_total", constraint="none") == 12
    assert d("sparkgate:spec_decode_num_accepted_tokens_by_constraint_total", constraint="none") == 4
    assert d("sparkgate:spec_decode_num_draft_tokens_by_constraint_total") == 12  # and under no other
    assert d("sparkgate:constrained_requests_total") == 0


def outcome(status, tenant="t", tier=None, target=None, tokens=11, span_s=1.0, **kw) -> RequestOutcome:
    ctx = RequestContext("r", "chat", "m", False, prompt_tokens=5, max_tokens=50, tenant=tenant, tier=tier,
                         sla_target_tokens_per_s=target)
    kw.setdefault("timings", RequestTimings(queued=100.0, started=100.5, first_token=101.0, last_token=101.0 + span_s))
    return RequestOutcome(ctx, status, prompt_tokens=5, completion_tokens=tokens, **kw)


def test_constrained_outcomes_feed_the_grammar_metrics():
    """The constraint of each outcome: counted whatever the end, its mask time per completion
    token observed (when measured and ≥ 1 token), its speculation counted under its label."""
    obs, d = metrics.MetricsObserver(), Delta()
    metrics.TENANTS.configure(20)
    metrics.TIERS.configure(10)
    spec = lambda drafted, accepted: SpecStats(rounds=4, drafted=drafted, verified=drafted, accepted=accepted,  # noqa: E731
                                               emitted=4 + accepted, accepted_per_position=[accepted])
    runs = [("json_schema", FINISHED, 0.004, 10, spec(12, 3)),  # 0.4 ms per token
            ("json_schema", FINISHED, 0.003, 2, spec(8, 1)),  # 1.5 ms per token
            ("tools", CANCELLED, 0.0005, 5, spec(4, 4)),  # 0.1 ms per token
            ("json_object", REJECTED, None, 0, None),  # refused: counted, nothing observed
            ("json_object", FAILED, 0.001, 0, None),  # no token: no per-token time
            (None, FINISHED, None, 7, spec(16, 9))]  # free text
    for kind, status, mask, tokens, stats in runs:
        o = outcome(status, tier="gold", tokens=tokens, spec=stats, grammar_mask_s=mask,
                    finish_reason="stop" if status == FINISHED else None)
        o.ctx.constraint = kind
        obs.request_ended(o)
    for kind, n in (("json_schema", 2), ("tools", 1), ("json_object", 2)):
        assert d("sparkgate:constrained_requests_total", constraint=kind, tenant="t", tier="gold") == n, kind
    assert d("sparkgate:constrained_requests_total") == 5  # the free-text one is not counted
    h = "sparkgate:grammar_mask_time_per_output_token_seconds"
    assert d(h + "_count", constraint="json_schema") == 2
    assert d(h + "_sum", constraint="json_schema") == pytest.approx(0.0004 + 0.0015)
    assert d(h + "_bucket", constraint="json_schema", le="0.0005") == 1
    assert d(h + "_bucket", constraint="json_schema", le="0.0025") == 2
    assert d(h + "_sum", constraint="tools") == pytest.approx(0.0001)
    assert d(h + "_count", constraint="json_object") == 0 and d(h + "_count") == 3
    by = "sparkgate:spec_decode_num_{}_by_constraint_total"
    assert d(by.format("draft_tokens"), constraint="json_schema") == 20
    assert d(by.format("accepted_tokens"), constraint="json_schema") == 4
    assert d(by.format("drafts"), constraint="json_schema") == 8
    assert d(by.format("draft_tokens"), constraint="tools") == 4 and d(by.format("accepted_tokens"), constraint="tools") == 4
    assert d(by.format("draft_tokens"), constraint="none") == 16 and d(by.format("accepted_tokens"), constraint="none") == 9
    assert d("sparkgate:spec_decode_num_draft_tokens_total") == 20 + 4 + 16  # the unlabelled totals: all of them


def test_sla_attainment_per_tier_and_cancelled_is_abort():
    obs, d = metrics.MetricsObserver(), Delta()
    metrics.TENANTS.configure(20)
    metrics.TIERS.configure(10)
    obs.request_ended(outcome(FINISHED, tier="gold", target=10.0, finish_reason="stop"))  # 10 tok/s: met
    obs.request_ended(outcome(FINISHED, tier="gold", target=10.0, span_s=2.0, finish_reason="stop"))  # 5: missed
    obs.request_ended(outcome(FINISHED, tier="free", finish_reason="length"))  # no target: not counted
    obs.request_ended(outcome(FAILED, tier="gold", target=10.0, error_code="timeout"))  # failed: not counted
    obs.request_ended(outcome(CANCELLED, tier="gold", tokens=3))
    assert d("sparkgate:sla_requests_total", result="met", tenant="t", tier="gold") == 1
    assert d("sparkgate:sla_requests_total", result="missed", tenant="t", tier="gold") == 1
    assert d("sparkgate:sla_requests_total", result="met", tenant="t", tier="free") == 0
    assert d("sparkgate:request_errors_total", code="timeout", tenant="t", tier="gold") == 1
    assert d("sparkgate:request_success_total", finished_reason="abort", tenant="t", tier="gold") == 1
    assert d("sparkgate:request_queue_time_seconds_sum", tenant="t", tier="gold") == pytest.approx(4 * 0.5)
    assert d("sparkgate:generation_tokens_total", tenant="t", tier="gold") == 11 * 3 + 3


def test_admission_rejections_and_wait_come_from_outcomes():
    obs, d = metrics.MetricsObserver(), Delta()
    metrics.TENANTS.configure(1)
    metrics.TIERS.configure(10)
    for tenant, code in (("a", "rate_limit_exceeded"), ("b", "sla_capacity_exceeded"), ("a", "queue_full")):
        o = outcome(REJECTED, tenant=tenant, tier="gold", error_code=code, timings=None, tokens=0)
        o.ctx.admission_wait_s = 0.25
        obs.request_ended(o)
    assert d("sparkgate:rate_limited_requests_total", code="rate_limit_exceeded", tenant="a", tier="gold") == 1
    assert d("sparkgate:rate_limited_requests_total", code="sla_capacity_exceeded", tenant="other", tier="gold") == 1
    assert d("sparkgate:rate_limited_requests_total", code="queue_full") == 0  # the engine's queue, not admission
    assert d("sparkgate:request_errors_total", code="queue_full", tenant="a", tier="gold") == 1
    assert d("sparkgate:admission_queue_time_seconds_count", tier="gold") == 3
    assert d("sparkgate:admission_queue_time_seconds_sum", tier="gold") == pytest.approx(0.75)
    assert d("sparkgate:generation_tokens_total", tier="gold") == 0  # rejected: never ran


async def test_admission_429_is_counted_once_with_its_tenant(db_url):
    key = await issue_key(db_url, "acme", "alice", rpm_limit=1)
    d = Delta()
    async with running_app(db_url, FakeBackend()) as (_, c):
        codes = [(await c.post("/v1/chat/completions", json=chat(), headers={"Authorization": f"Bearer {key}"})).status_code
                 for _ in range(2)]
    assert codes == [200, 429]
    assert d("sparkgate:request_errors_total", code="rate_limit_exceeded", tenant="acme") == 1
    assert d("sparkgate:request_errors_total", code="rate_limit_exceeded") == 1  # not again as tenant "unknown"
    assert d("sparkgate:rate_limited_requests_total", code="rate_limit_exceeded", tenant="acme") == 1
    assert d("sparkgate:admission_queue_time_seconds_count") == 2
    assert d("sparkgate:request_success_total", tenant="acme") == 1


class EndingFake(FakeBackend):
    """FakeBackend that, while ``end_with`` is set, emits two one-token deltas and then
    ``Finished(end_with)`` (``abort``: the engine cancelled it; ``error``: it failed),
    with speculative stats when asked for them."""

    end_with: FinishReason | None = None

    async def _run(self, req):
        if self.end_with is None:
            inner = super()._run(req)
            try:
                async for event in inner:
                    yield event
            finally:
                await inner.aclose()
            return
        t = RequestTimings(wall_queued=time.time(), queued=time.monotonic(), started=time.monotonic())
        for i in range(2):
            t.first_token = t.first_token or time.monotonic()
            t.last_token = time.monotonic()
            yield TextDelta(text=(" " if i else "") + self.word(i), num_tokens=1)
        spec = SpecStats(rounds=2, drafted=6, verified=5, accepted=1, emitted=2, accepted_per_position=[1]) \
            if req.return_spec_stats else None
        yield Finished(self.end_with, len(req.prompt_token_ids), 2, t, spec)


async def test_metric_values_agree_with_the_request_records(tenancy_db):
    """Two tenants, every kind of outcome; after the writer flushed, each request-level
    counter (per tenant) equals the same quantity summed over the tenant's rows in
    request_records, and the spec_decode_* counters equal the rows' speculative sums."""
    backend = EndingFake()
    d = Delta()
    async with tenancy_app(tenancy_db, backend) as (app, c):
        await admin_setup(c, {"gold": {"rpm": 100, "min_tokens_per_s": 1, "priority": 10},
                              "bronze": {"rpm": 3}},
                          {"acme": "gold", "initech": "bronze"})
        keys = {"acme": await new_key(c, "acme", "alice"), "initech": await new_key(c, "initech", "dave")}

        async def post(tenant, **body):
            return (await c.post("/v1/chat/completions", json=chat(**body),
                                 headers={"Authorization": f"Bearer {keys[tenant]}"})).status_code

        codes = [await post("acme"),  # stop, 7 tokens
                 await post("acme", stream=True, max_tokens=3),  # length, 3
                 await post("acme", return_spec_stats=True),  # stop, 7, spec
                 await post("acme", stream=True, max_tokens=5, return_spec_stats=True),  # length, 5, spec
                 await post("initech", return_spec_stats=True, max_tokens=4)]  # length, 4, spec
        backend.fail_after_deltas = 2
        codes += [await post("acme", stream=True), await post("initech")]  # Failed engine_error after 2 tokens
        backend.fail_after_deltas, backend.queue_full = None, True
        codes += [await post("acme")]  # rejected: queue_full
        backend.queue_full, backend.end_with = False, FinishReason.ABORT
        codes += [await post("acme", stream=True, return_spec_stats=True)]  # cancelled by the engine, 2 tokens
        backend.end_with = FinishReason.ERROR
        codes += [await post("initech")]  # failed (abnormal finish), 2 tokens: rpm 3 used up
        backend.end_with = None
        codes += [await post("initech"), await post("initech", stream=True)]  # 429 rate_limit_exceeded
        r = await c.post("/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer sk-nobody"})
        assert codes == [200, 200, 200, 200, 200, 200, 500, 503, 200, 500, 429, 429] and r.status_code == 401
        await app.state.records.flush()
        async with app.state.sessionmaker() as s:
            recs, _ = await crud_records.query_records(s, limit=1000)
    by = {t: [r for r in recs if r.tenant == t] for t in ("acme", "initech")}
    assert len(recs) == 12 and {t: len(v) for t, v in by.items()} == {"acme": 7, "initech": 5}
    assert sum(r.completion_tokens for r in recs) == 7 + 3 + 7 + 5 + 4 + 2 + 2 + 2 + 2  # not vacuous

    for tenant, rows in by.items():
        m = lambda name, **labels: d(f"sparkgate:{name}", tenant=tenant, **labels)  # noqa: E731
        assert m("generation_tokens_total") == sum(r.completion_tokens for r in rows), tenant
        # prompt tokens of requests that reached the engine; a rejected row keeps its
        # request's prompt size (the reason it was refused) but nothing was prefilled
        ran = [r for r in rows if r.status != "rejected"]
        assert m("prompt_tokens_total") == sum(r.prompt_tokens for r in ran) > 0, tenant
        assert all(r.prompt_tokens > 0 for r in rows if r.status == "rejected")
        for reason in ("stop", "length"):
            assert m("request_success_total", finished_reason=reason) == sum(
                r.status == "finished" and r.finish_reason == reason for r in rows), (tenant, reason)
        assert m("request_success_total", finished_reason="abort") == sum(r.status == "cancelled" for r in rows)
        assert m("request_success_total") == sum(r.status in ("finished", "cancelled") for r in rows)
        errors = [r for r in rows if r.status in ("failed", "rejected")]
        for code in {r.error_code for r in errors} | {"engine_error"}:
            assert m("request_errors_total", code=code) == sum(r.error_code == code for r in errors), (tenant, code)
        assert m("request_errors_total") == len(errors)
        # admission 429s only (queue_full is the engine's refusal: an error, not a rate limit)
        assert m("rate_limited_requests_total") == sum(
            r.status == "rejected" and r.error_code in metrics.ADMISSION_CODES for r in rows)
        assert m("rate_limited_requests_total", code="rate_limit_exceeded") == sum(
            r.error_code == "rate_limit_exceeded" for r in rows)
        for result, met in (("met", True), ("missed", False)):
            assert m("sla_requests_total", result=result) == sum(r.sla_met is met for r in rows), (tenant, result)
        assert m("e2e_request_latency_seconds_count") == sum(r.status == "finished" for r in rows)
    assert sorted((r.status, r.finish_reason or r.error_code) for r in by["acme"]) == [
        ("cancelled", None), ("failed", "engine_error"), ("finished", "length"), ("finished", "length"),
        ("finished", "stop"), ("finished", "stop"), ("rejected", "queue_full")]
    assert sorted((r.status, r.finish_reason or r.error_code) for r in by["initech"]) == [
        ("failed", "engine_error"), ("failed", "engine_error"), ("finished", "length"),
        ("rejected", "rate_limit_exceeded"), ("rejected", "rate_limit_exceeded")]
    assert sum(r.sla_met is not None for r in by["acme"]) == 4  # gold's finished requests were graded
    assert d("sparkgate:request_errors_total", code="invalid_api_key", tenant="unknown") == 1  # no key: no row

    spec = [r for r in recs if r.spec_rounds is not None]
    assert len(spec) == 4  # three finished, one cancelled
    for name, col in (("num_drafts", "spec_rounds"), ("num_draft_tokens", "spec_drafted"),
                      ("num_verified_tokens", "spec_verified"), ("num_accepted_tokens", "spec_accepted")):
        assert d(f"sparkgate:spec_decode_{name}_total") == sum(getattr(r, col) for r in spec) > 0, name
    width = max(len(r.accepted_per_position) for r in spec)
    assert width == 2
    for pos in range(width):
        assert d("sparkgate:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == sum(
            (r.accepted_per_position + [0] * width)[pos] for r in spec), pos
    assert d("sparkgate:spec_decode_num_accepted_tokens_per_pos_total", position=str(width)) == 0


def test_label_cap_keeps_first_n_then_other():
    cap = metrics.LabelCap(2)
    assert [cap(v) for v in ("a", "b", "c", "a", None, "", "d", "b")] == ["a", "b", "other", "a", "none", "none", "other", "b"]
    cap.configure(1)
    assert [cap("c"), cap("a")] == ["c", "other"]


async def test_tenant_labels_are_capped_and_users_never_exported(db_url):
    keys = [await issue_key(db_url, f"tenant-{i}", f"user-{i}") for i in range(4)]
    d = Delta()
    async with running_app(db_url, FakeBackend(), metrics_max_tenants=2) as (_, c):
        for key in keys:
            r = await c.post("/v1/chat/completions", json=chat(), headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200
        text = (await c.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})).text
    assert d("sparkgate:generation_tokens_total", tenant="tenant-0") == 7
    assert d("sparkgate:generation_tokens_total", tenant="tenant-1") == 7
    assert d("sparkgate:generation_tokens_total", tenant="other") == 14
    exposed = {s.labels.get("tenant") for f in text_string_to_metric_families(text) for s in f.samples}
    assert not {"tenant-2", "tenant-3"} & exposed
    assert not any("user-" in line for line in text.splitlines())  # user labels are never exported


# -- /metrics endpoint and engine collector ---------------------------------------------------

class SpecFake(FakeBackend):
    def load(self) -> LoadSnapshot:
        return LoadSnapshot(running=0, waiting=0, max_batch=16, forward_steps=14, decode_steps=12,
                            spec_steps=5, spec_gated_steps=7)

    def spec_info(self) -> SpecInfo:
        table = SpsTable([1, 8], [512, 2048], [[30.0, 27.0], [20.0, 18.0]], note="test")
        return SpecInfo("dspark", "dspark-sla", 7, table.to_dict())


async def test_metrics_needs_admin_token_and_exports_engine_and_writer_state(db_url):
    key = await issue_key(db_url, "acme", "alice")
    async with running_app(db_url, SpecFake()) as (application, c):
        writer = application.state.records
        writer.dropped = 2
        assert (await c.get("/metrics")).status_code == 401
        assert (await c.get("/metrics", headers={"Authorization": f"Bearer {key}"})).status_code == 403
        r = await c.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert fams["sparkgate:num_requests_running"].samples[0].value == 0
    info = fams["sparkgate:spec_decode_config_info"].samples[0]
    assert info.labels == {"method": "dspark", "policy": "dspark-sla", "num_speculative_tokens": "7"}
    sps = {(s.labels["budget_tokens"], s.labels["context_len"]): s.value for s in fams["sparkgate:sps"].samples}
    assert sps[("8", "512")] == 27.0 and sps[("1", "2048")] == 20.0 and len(sps) == 4
    assert "sparkgate:engine_verify_tokens" in fams and "sparkgate:time_to_first_token_seconds" in fams
    assert fams["sparkgate:spec_decode_steps"].samples[0].value == 5
    assert fams["sparkgate:spec_decode_gated_steps"].samples[0].value == 7
    assert fams["sparkgate:db_writer_queue_depth"].samples[0].value == writer.buffered
    assert fams["sparkgate:db_records_dropped"].samples[0].value == 2


def test_malformed_sps_table_is_skipped_not_fatal():
    assert list(metrics._sps_family({"buckets": [1, 2], "context_lens": [8], "sps": [[3.0]]})) == []
    assert list(metrics._sps_family({"format": "sglang"})) == []


async def test_running_gauge_is_read_at_scrape_time(db_url):
    key = await issue_key(db_url, "acme", "alice")
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with running_app(db_url, FakeBackend(token_delay_s=0.1)) as (_, c):
        task = asyncio.create_task(c.post("/v1/chat/completions", json=chat(), headers={"Authorization": f"Bearer {key}"}))
        seen = []
        while not task.done():
            seen.append(total("sparkgate:num_requests_running"))
            await asyncio.sleep(0.05)
        assert (await task).status_code == 200
        assert 1.0 in seen and set(seen) <= {0.0, 1.0}
        r = await c.get("/metrics", headers=admin)
        assert "sparkgate:num_requests_running 0.0" in r.text.splitlines()


async def test_separate_metrics_port_serves_without_auth_and_stops_with_the_app(db_url):
    port = free_port()
    async with running_app(db_url, FakeBackend(), metrics_port=port) as (_, c):
        assert (await c.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})).status_code == 404
        async with httpx.AsyncClient() as direct:
            r = await direct.get(f"http://127.0.0.1:{port}/metrics")
        assert r.status_code == 200 and "sparkgate:num_requests_waiting 0.0" in r.text.splitlines()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)


# -- engine counters (real model, no server) ---------------------------------------------------

@pytest.mark.model
@pytest.mark.parametrize("spec_method", ["none", "prompt_lookup", "dspark"])
def test_engine_verify_tokens_is_sum_of_per_round_budgets(target_fp32, tokenizer, spec_method):
    """B per round = Σ_r (1 + ℓ_r), and every round of ALL running requests is ONE target
    forward: the three prompts prefill together in the first forward, after which each
    forward is one decode round (forward_steps = 1 + decode_steps) and the request that
    runs longest took part in every round (max rounds = decode_steps). Under dspark-sla
    the scheduler picks each request's ℓ_r inside those shared forwards."""

    from runtime.config import EngineConfig
    from runtime.engine.llm_engine import LLMEngine
    from runtime.interface import Finished, GenerationRequest, SamplingParams

    finals = {}
    table = TEST_DATA / "sps_table.json"
    engine = LLMEngine(EngineConfig(dtype="float32", max_batch_size=3, max_context=256, spec_method=spec_method,
                                    num_speculative_tokens=4, spec_policy="dspark-sla",
                                    sps_table_path=str(table) if spec_method == "dspark" else None),
                       lambda rid, ev: finals.__setitem__(rid, ev) if isinstance(ev, Finished) else None,
                       model=target_fp32, tokenizer=tokenizer)
    texts = ["Count from one to twenty: one, two, three,", "Repeat: a b c a b c a b c", "Hello"]
    for i, text in enumerate(texts):
        engine.add_request(GenerationRequest(str(i), tokenizer.encode(text), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)))
    while engine.has_work():
        engine.step()
    assert engine.forward_steps == 1 + engine.decode_steps > 1
    if spec_method != "none":
        assert max(f.spec.rounds for f in finals.values()) == engine.decode_steps
    if spec_method == "none":  # every decode round verifies one anchor per running request
        assert engine.verify_tokens == sum(f.completion_tokens - 1 for f in finals.values())
    else:  # B = Σ_r (1 + ℓ_r): per request, one anchor per round plus its verified drafts
        assert engine.verify_tokens == sum(f.spec.rounds + f.spec.verified for f in finals.values())
        assert any(f.spec.verified for f in finals.values())


# -- the live gateway (real model, one shared server) --------------------------------------------

def live_metrics(live) -> dict:
    """``{(name, frozenset(labels)): value}`` of the live server's /metrics."""
    text = httpx.get(live.base_url + "/metrics", headers=live.headers(live.admin_token), timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def live_sum(snapshot: dict, name: str, **labels) -> float:
    return sum(v for (n, lab), v in snapshot.items() if n == name and labels.items() <= dict(lab).items())


def eventually_equal(fn, want, what: str, timeout_s: float = 20.0):
    """Observers run right after a stream's last byte, so poll briefly."""
    deadline = time.monotonic() + timeout_s
    while (got := fn()) != want:
        assert time.monotonic() < deadline, f"{what}: {got} != {want}"
        time.sleep(0.2)


def wait_idle(live) -> None:
    def busy():
        load = httpx.get(live.base_url + "/admin/v1/engine", headers=live.headers(live.admin_token), timeout=10).json()
        return load["running"] + load["waiting"]
    eventually_equal(busy, 0, "engine busy")


@pytest.mark.model
def test_live_metrics_agree_with_responses(live_server):
    live, tenant = live_server, {"tenant": "e2e-tenant"}
    wait_idle(live)
    before = live_metrics(live)
    usages = []
    for i, stream in enumerate((False, True, False, True)):
        body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 5 + i, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"Write a long poem about rivers, part {i}."}], "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        r = httpx.post(live.base_url + "/v1/chat/completions", json=body, headers=live.headers(), timeout=300)
        assert r.status_code == 200
        final = r.json() if not stream else json.loads(r.text.split("data: ")[-2])
        usages.append(final["usage"])
        if not stream:
            assert final["choices"][0]["finish_reason"] == "length"
    r = httpx.post(live.base_url + "/v1/chat/completions", headers=live.headers(), timeout=30,
                   json={"model": "gpt-nope", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    completion = sum(u["completion_tokens"] for u in usages)
    assert [u["completion_tokens"] for u in usages] == [5, 6, 7, 8]

    def delta(name, **labels):
        return live_sum(live_metrics(live), name, **labels) - live_sum(before, name, **labels)

    eventually_equal(lambda: delta("sparkgate:generation_tokens_total", **tenant), completion, "generation tokens")
    after = live_metrics(live)
    d = lambda name, **labels: live_sum(after, name, **labels) - live_sum(before, name, **labels)  # noqa: E731
    assert d("sparkgate:prompt_tokens_total", **tenant) == sum(u["prompt_tokens"] for u in usages)
    assert d("sparkgate:request_success_total", finished_reason="length", **tenant) == 4
    assert d("sparkgate:request_errors_total", code="model_not_found", tenant="unknown") == 1
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_time_per_output_token_seconds"):
        assert d(f"sparkgate:{hist}_count", **tenant) == 4, hist
    # autoregressive: one token per delta, so n − 1 gaps per request
    assert d("sparkgate:inter_token_latency_seconds_count", **tenant) == completion - 4
    assert 0 < d("sparkgate:inter_token_latency_seconds_sum", **tenant) < d("sparkgate:e2e_request_latency_seconds_sum", **tenant)
    # engine counters: sequential requests → each decode round verifies one anchor; one prefill per request
    decode_steps = d("sparkgate:engine_decode_steps_total")
    assert decode_steps == completion - 4
    assert d("sparkgate:engine_verify_tokens_total") == decode_steps
    assert d("sparkgate:engine_forward_steps_total") == decode_steps + 4
    assert live_sum(after, "sparkgate:num_requests_running") == 0
    info = [dict(lab) for (n, lab) in after if n == "sparkgate:spec_decode_config_info"]
    assert info == [{"method": "none", "policy": "none", "num_speculative_tokens": "0"}]


@pytest.mark.model
def test_live_running_gauge_and_cancelled_stream(live_server):
    live = live_server
    wait_idle(live)
    before = live_metrics(live)
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "Count to one thousand."}]}
    with httpx.stream("POST", live.base_url + "/v1/chat/completions", json=body, headers=live.headers(),
                      timeout=300) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        during = live_metrics(live)
    # leaving the block closed the connection: the engine aborts the request
    assert live_sum(during, "sparkgate:num_requests_running") == 1
    assert live_sum(during, "sparkgate:num_requests_waiting") == 0
    eventually_equal(lambda: live_sum(live_metrics(live), "sparkgate:request_success_total", finished_reason="abort")
                     - live_sum(before, "sparkgate:request_success_total", finished_reason="abort"), 1, "aborts")
    eventually_equal(lambda: live_sum(live_metrics(live), "sparkgate:num_requests_running"), 0, "running")
    after = live_metrics(live)
    emitted = live_sum(after, "sparkgate:generation_tokens_total") - live_sum(before, "sparkgate:generation_tokens_total")
    assert 1 <= emitted < 200
