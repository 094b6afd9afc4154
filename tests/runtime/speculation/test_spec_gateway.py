"""Speculative decoding served through the gateway (issue: DSpark in the engine, "serves
through the gateway"): the real fp32 model under uvicorn with ``spec_method`` dspark
(random-init drafter, ``dspark-sla``) and prompt lookup. At T = 0 the HTTP replies equal the
autoregressive engine's, streamed and not; ``return_spec_stats`` gives consistent stats on
the completion and on the final stream chunk; the request records carry the same stats."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest

from runtime.engine.async_engine import AsyncEngine
from runtime.config import EngineConfig
from tests.support import TEST_DATA

pytestmark = pytest.mark.model

ADMIN = "adm-spec-gateway"
SPS_TABLE = TEST_DATA / "sps_table.json"  # committed: no profiling in tests
PROMPTS = [
    # repetitive: prompt lookup gets drafts accepted
    "Repeat this line three times: the quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
]


def make_app(target_fp32, tokenizer, db_url: str, spec_method: str, spec_gate: bool = False):
    from gateway.main import create_app
    from runtime.engine.llm_engine import LLMEngine
    from tests.support.gateway_fixtures import make_settings

    # spec_gate off: the gate decides by measured time, so the streamed and the plain run of a
    # prompt could speculate on different steps and report different (equally valid) stats
    cfg = EngineConfig(dtype="float32", max_batch_size=2, max_context=512, spec_method=spec_method,
                       spec_policy="dspark-sla" if spec_method == "dspark" else "fixed", num_speculative_tokens=4,
                       sps_table_path=str(SPS_TABLE) if spec_method == "dspark" else None, spec_gate=spec_gate)
    engine = AsyncEngine(cfg, engine_factory=lambda c, emit: LLMEngine(c, emit, model=target_fp32, tokenizer=tokenizer))
    return create_app(make_settings(db_url, admin_token=ADMIN), engine)


def body(prompt: str, **extra) -> dict:
    return {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": prompt}],
            "temperature": 0, "max_tokens": 40, "return_spec_stats": True, **extra}


def stream_events(base: str, key: str, payload: dict) -> list:
    with httpx.stream("POST", base + "/v1/chat/completions", json=payload,
                      headers={"Authorization": f"Bearer {key}"}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]) for line in r.iter_lines() if line]


def serve(target_fp32, tokenizer, tmp_path, template, spec_method: str, spec_gate: bool = False):
    from gateway.crud.keys import issue_key
    from tests.support.gateway_fixtures import sqlite_url

    db = tmp_path / f"{spec_method}.sqlite"
    shutil.copy(template, db)
    url = sqlite_url(db)
    key = asyncio.run(issue_key(url, "spec-tenant", "sam"))
    return make_app(target_fp32, tokenizer, url, spec_method, spec_gate), key


@pytest.fixture(scope="module")
def ar_replies(target_fp32, tokenizer, tmp_path_factory, migrated_template):
    from tests.support.hardening_util import serve_in_thread

    app, key = serve(target_fp32, tokenizer, tmp_path_factory.mktemp("ar"), migrated_template, "none")
    with serve_in_thread(app) as base:
        out = []
        for p in PROMPTS:
            r = httpx.post(base + "/v1/chat/completions", json=body(p), headers={"Authorization": f"Bearer {key}"},
                           timeout=300)
            assert r.status_code == 200, r.text
            out.append(r.json())
    return out


@pytest.mark.parametrize("method", ["dspark", "prompt_lookup"])
def test_speculative_gateway_replies_equal_autoregressive_with_consistent_stats(
        target_fp32, tokenizer, tmp_path, migrated_template, ar_replies, method):
    from tests.support.hardening_util import serve_in_thread

    assert ar_replies[0].get("spec_stats") is None  # no speculation: nothing to report
    app, key = serve(target_fp32, tokenizer, tmp_path, migrated_template, method)
    auth = {"Authorization": f"Bearer {key}"}
    with serve_in_thread(app) as base:
        accepted = 0
        stats = {}
        for prompt, ar in zip(PROMPTS, ar_replies):
            r = httpx.post(base + "/v1/chat/completions", json=body(prompt), headers=auth, timeout=300)
            assert r.status_code == 200, r.text
            got = r.json()
            stats[got["id"]] = got["spec_stats"]
            text = got["choices"][0]["message"]["content"]
            assert text == ar["choices"][0]["message"]["content"]  # lossless at T = 0 (fp32)
            assert got["choices"][0]["finish_reason"] == ar["choices"][0]["finish_reason"]
            assert got["usage"] == ar["usage"]
            st = got["spec_stats"]
            n = got["usage"]["completion_tokens"]
            # every token but the first (sampled after prefill) comes from a verification round
            assert st["rounds"] >= 1 and st["emitted"] == n - 1
            assert st["tau"] == pytest.approx(st["emitted"] / st["rounds"], abs=1e-4)
            assert 0 <= st["accepted"] <= st["verified"] <= st["drafted"] <= 4 * st["rounds"]
            assert st["emitted"] == st["rounds"] + st["accepted"] or got["choices"][0]["finish_reason"] == "stop"
            assert sum(st["accepted_per_position"]) == st["accepted"] and len(st["accepted_per_position"]) == 4
            accepted += st["accepted"]

            events = stream_events(base, key, body(prompt, stream=True, stream_options={"include_usage": True}))
            assert events[-1] == "[DONE]"
            chunks = [e for e in events[:-1] if e["choices"]]
            assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == text
            assert chunks[-1]["choices"][0]["finish_reason"] == got["choices"][0]["finish_reason"]
            assert chunks[-1]["spec_stats"] == st  # same T = 0 run, same stats
            assert all("spec_stats" not in c or c is chunks[-1] for c in events[:-1])
            assert events[-2]["choices"] == []
            # the repeated prompt now hits the prefix cache: only cached_tokens may grow
            streamed, whole = dict(events[-2]["usage"]), dict(got["usage"])
            cached = [u.pop("prompt_tokens_details")["cached_tokens"] for u in (streamed, whole)]
            assert cached[0] >= cached[1]
            assert streamed == whole
        if method == "prompt_lookup":
            assert accepted > 0  # the repetitive prompt gets n-gram drafts accepted

        # the request records carry the same speculative stats
        admin = {"Authorization": f"Bearer {ADMIN}"}
        assert httpx.post(base + "/admin/v1/rollups/refresh", headers=admin).status_code == 204
        for rid, st in stats.items():
            rec = httpx.get(f"{base}/admin/v1/requests/{rid}", headers=admin).json()
            assert (rec["spec_rounds"], rec["spec_accepted"], rec["spec_emitted"]) == \
                (st["rounds"], st["accepted"], st["emitted"])
            assert rec["spec_tau"] == pytest.approx(st["tau"], abs=1e-3)


def test_gated_speculation_through_the_gateway(target_fp32, tokenizer, tmp_path, migrated_template, ar_replies):
    """With ``spec_gate`` on (the serving default; for ``dspark`` the budget decides before
    drafting whether a request's draft pays, ``Speculator._worth_drafting``), replies still
    equal AR at T = 0, rounds that drafted nothing show up in ``spec_stats`` as gated rounds,
    and the engine's speculative + gated step counters in /metrics add up to its decode rounds."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.support.hardening_util import serve_in_thread

    def engine_counters(base):
        text = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).text
        names = ("sparkgate:engine_decode_steps_total", "sparkgate:spec_decode_steps_total",
                 "sparkgate:spec_decode_gated_steps_total", "sparkgate:engine_decode_rows_total",
                 "sparkgate:spec_decode_zero_budget_rows_total", "sparkgate:engine_decode_tokens_total")
        got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in names}
        return [got[n] for n in names]

    app, key = serve(target_fp32, tokenizer, tmp_path, migrated_template, "dspark", spec_gate=True)
    with serve_in_thread(app) as base:
        rounds = emitted = gated_rounds = 0
        for prompt, ar in zip(PROMPTS, ar_replies):
            r = httpx.post(base + "/v1/chat/completions", json=body(prompt), headers={"Authorization": f"Bearer {key}"},
                           timeout=300)
            assert r.status_code == 200, r.text
            got = r.json()
            assert got["choices"][0]["message"]["content"] == ar["choices"][0]["message"]["content"]
            assert got["usage"] == ar["usage"]
            st = got["spec_stats"]
            assert st["emitted"] == got["usage"]["completion_tokens"] - 1
            assert 0 <= st["gated_rounds"] <= st["rounds"]
            assert st["verified"] <= st["drafted"] <= 4 * (st["rounds"] - st["gated_rounds"])
            rounds += st["rounds"]
            emitted += st["emitted"]
            gated_rounds += st["gated_rounds"]
        decode, spec, gated, rows, zero, tokens = engine_counters(base)
        text = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10).text
        ratios = {tuple(s.labels[k] for k in ("proposer", "n", "position", "sampling")): s.value
                  for f in text_string_to_metric_families(text) for s in f.samples
                  if s.name == "sparkgate:spec_acceptance_ratio"}
    # the live survival correction of the verified DSpark drafts (greedy), and the prior of new requests
    assert ("dspark", "0", "first", "greedy") in ratios and ("dspark-prior", "0", "first", "greedy") in ratios, ratios
    assert all(0.0 < v < 10.0 for v in ratios.values()), ratios
    assert spec + gated == decode == rounds == rows  # one request at a time: each decode round is one of its rounds
    assert gated <= zero < rows  # gated rounds verify no draft; some drafting rounds may get ℓ = 0 too
    # every emitted token came from a decode round; only a request's last round may produce tokens
    # that max_tokens/EOS cut (at most γ of them)
    assert emitted <= tokens <= emitted + 4 * len(PROMPTS)
    assert gated == gated_rounds  # each plain round is one of its request's gated rounds
    # the first round drafts (no drafting time measured yet); how many more do depends on the
    # drafting time this machine measures (one draft in a loaded CI run, most rounds when quiet)
    assert spec >= 1


def test_constrained_and_plain_requests_are_marked_and_split(target_fp32, tokenizer, tmp_path, migrated_template):
    """The real engine, prompt-lookup speculation: a ``json_schema`` request whose JSON repeats
    its prompt (drafts accepted under the grammar), a ``tools`` request and a plain one. Their
    records carry the constraint and the engine's measured mask time per token (none for the
    plain one); each request's drafted/accepted tokens land in the by-constraint counters of its
    own kind and in the rollups' grammar / plain split."""
    from gateway.observability import metrics
    from tests.gateway.observability.test_metrics import Delta
    from tests.support.hardening_util import serve_in_thread

    metrics.TENANTS.configure(20)
    app, key = serve(target_fp32, tokenizer, tmp_path, migrated_template, "prompt_lookup")
    auth, admin = {"Authorization": f"Bearer {key}"}, {"Authorization": f"Bearer {ADMIN}"}
    # the grammar holds the reply to the prompt's sentence, which prompt lookup drafts from the prompt
    line = {"enum": ["the quick brown fox jumps over the lazy dog.", "the lazy dog sleeps."]}
    schema = {"type": "object", "properties": {"line": line}, "required": ["line"]}
    tool = {"type": "function", "function": {"name": "say", "parameters": schema}}
    asks = {"json_schema": body(PROMPTS[0] + " Answer as JSON with the key line.", response_format={
                "type": "json_schema", "json_schema": {"name": "lines", "schema": schema}}),
            "tools": body(PROMPTS[0], tools=[tool], tool_choice="required"),
            None: body(PROMPTS[0])}
    d = Delta()
    with serve_in_thread(app) as base:
        recs = {}
        for kind, payload in asks.items():
            r = httpx.post(base + "/v1/chat/completions", json=payload, headers=auth, timeout=300)
            assert r.status_code == 200, r.text
            if kind == "json_schema":
                assert "line" in json.loads(r.json()["choices"][0]["message"]["content"])
            if kind == "tools":
                assert r.json()["choices"][0]["finish_reason"] in ("tool_calls", "length")
            assert httpx.post(base + "/admin/v1/rollups/refresh", headers=admin).status_code == 204
            recs[kind] = httpx.get(f"{base}/admin/v1/requests/{r.json()['id']}", headers=admin).json()
        (acc,) = httpx.get(base + "/admin/v1/stats/acceptance", params={"group_by": "tenant"}, headers=admin).json()["data"]
    for kind, rec in recs.items():
        assert rec["constraint"] == kind
        if kind is None:
            assert rec["mask_ms_per_token"] is None
        else:  # measured by the engine: a positive time, a part of its decode time per token
            assert 0 < rec["mask_ms_per_token"] < 1000 / rec["decode_tokens_per_s"], rec
        assert rec["spec_rounds"] > 0
        label = kind or "none"
        assert d("sparkgate:spec_decode_num_draft_tokens_by_constraint_total", constraint=label) == rec["spec_drafted"]
        assert d("sparkgate:spec_decode_num_accepted_tokens_by_constraint_total", constraint=label) == rec["spec_accepted"]
    assert recs["json_schema"]["spec_accepted"] > 0 and recs[None]["spec_accepted"] > 0  # drafts accepted both ways
    for split, kinds in (("constrained", ("json_schema", "tools")), ("plain", (None,))):
        for col in ("rounds", "drafted", "accepted", "emitted"):
            assert acc[split][col] == sum(recs[k][f"spec_{col}"] for k in kinds), (split, col)
    assert d("sparkgate:grammar_mask_time_per_output_token_seconds_count", constraint="json_schema") == 1
    assert d("sparkgate:grammar_mask_time_per_output_token_seconds_sum", constraint="tools") == pytest.approx(
        recs["tools"]["mask_ms_per_token"] / 1000)
    print({k: (r["mask_ms_per_token"], r["spec_drafted"], r["spec_accepted"]) for k, r in recs.items()})
