"""Hardening: the whole public surface of the live app fuzzed from its own OpenAPI schema
(``bench/fuzz.py``, CI profile: :data:`EXAMPLES` cases per operation and generation mode):
the real model under uvicorn with its own database — the admin fuzz revokes keys, edits
tiers and deletes tenants, which would break the session's shared ``live_server``.

Beyond schemathesis' own generation, the fuzzer sends lone surrogates and NUL as JSON
escapes in every string of a body and every declared string property, and percent-escaped
hostile bytes in path/query strings; afterwards a normal request with a fresh key must show
up in ``/v1/requests`` (the record writer still writes) and the server log must hold no
traceback. The long profile and its last result: docs/reliability.md.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.conftest import require_or_skip
from tests.support.hardening_util import load_bench

pytestmark = pytest.mark.model

EXAMPLES = 8
# Issue 25 item 1 (lone surrogates reach the record writer, the DB driver and error
# messages) is fixed on another branch; until it merges these fail — drop the marker then.
@pytest.fixture(scope="module")
def fuzzed():
    """``(FuzzResult, server log text)`` of one CI-sized run against a fresh real-model server."""
    require_or_skip(importlib.util.find_spec("schemathesis") is not None, "schemathesis (pip install schemathesis)")
    fuzz = load_bench("fuzz")
    proc, base, admin, log = fuzz.start_server("float32", 4, {"SPARKGATE_MAX_CONTEXT": "512"})
    try:
        res = fuzz.run_fuzz(base, admin, examples=EXAMPLES, seed=0, max_tokens=4)
    finally:
        proc.terminate()
        proc.wait(30)
    text = log.read_text(errors="replace")
    print(json.dumps({k: v for k, v in vars(res).items() if k != "by_operation"}, indent=1, default=str))
    return res, text


def test_the_schema_declares_the_bodies_the_openai_routes_read():
    """Without a requestBody the fuzzer posts empty bodies to chat/completions (as before)."""
    fuzz = load_bench("fuzz")
    raw = fuzz.openapi_schema()
    body = raw["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["required"] and {"messages", "model", "max_tokens"} <= set(
        body["content"]["application/json"]["schema"]["properties"])
    assert {"model", "user", "stop", "cache_salt"} <= set(fuzz.string_properties(raw, "/v1/chat/completions", "post"))
    assert {"model", "prompt", "user"} <= set(fuzz.string_properties(raw, "/v1/completions", "post"))
    assert {"model", "input", "instructions", "previous_response_id", "user"} <= set(
        fuzz.string_properties(raw, "/v1/responses", "post"))
    assert {"name", "tier"} <= set(fuzz.string_properties(raw, "/admin/v1/tenants", "post"))


def test_the_fuzz_covers_every_operation_the_engine_and_hostile_strings(fuzzed):
    res, _ = fuzzed
    assert res.operations >= 34 and len(res.by_operation) >= res.operations, sorted(res.by_operation)
    assert res.requests >= res.operations * EXAMPLES and res.by_phase["sweep"] >= 100, res.by_phase
    assert res.hostile_requests >= 150
    for op in ("POST /v1/chat/completions", "POST /v1/completions"):  # real generations, not only 4xx
        assert res.by_operation[op].get("200", 0) >= 3, res.by_operation[op]  # 4–8 seen across runs
    assert res.by_operation["POST /admin/v1/tenants"].get("201", 0) >= 1


def test_every_4xx_is_openai_shaped(fuzzed):
    res, _ = fuzzed
    assert res.bad_error_shapes == 0, res.bad_error_shape_samples
    assert sum(n for s, n in res.statuses.items() if s.startswith("4")) >= 200, res.statuses


def test_no_answer_500_or_above(fuzzed):
    res, _ = fuzzed
    assert res.server_errors == res.sse_server_errors == res.transport_errors == 0, (
        res.server_error_samples, res.transport_error_samples)


def test_records_are_still_written_after_the_fuzz(fuzzed):
    res, _ = fuzzed
    assert res.health["status"] == 200 and res.health["recorded_after_s"] is not None, res.health


def test_no_traceback_in_the_server_log(fuzzed):
    _, log = fuzzed
    assert "Traceback" not in log, log[-3000:]
