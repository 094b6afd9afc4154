"""Hardening, bad input: property-based fuzzing of every route in the gateway's own
OpenAPI schema (schemathesis) with the admin token, a tenant key and no key, plus
hand-written hostile bodies. Invariants: no response >= 500, every error OpenAI-shaped,
nothing reaches the engine for a refused request. FakeBackend under real uvicorn."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import httpx
import pytest

from gateway.crud.keys import issue_key
from gateway.main import create_app
from tests.conftest import require_or_skip
from tests.support.fakes import FakeBackend
from tests.support.gateway_fixtures import MODEL, chat, make_settings, sqlite_url
from tests.support.hardening_util import assert_openai_error_shape, serve_in_thread
from tests.support.polling import wait_until

try:
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings as hsettings
    from hypothesis.errors import Unsatisfiable
except ImportError:  # pragma: no cover
    schemathesis = None

ADMIN = "admin-token-hardening-" + "x" * 16
URL = "/v1/chat/completions"
FUZZ_EXAMPLES = 12  # per operation and auth mode; ~25 operations × 3 modes


@pytest.fixture(scope="module")
def server(tmp_path_factory, migrated_template):  # noqa: F811
    import shutil

    path = tmp_path_factory.mktemp("hardening-input") / "db.sqlite"
    shutil.copy(migrated_template, path)
    url = sqlite_url(path)
    key = asyncio.run(issue_key(url, "fuzz-tenant", "fuzzer"))
    backend = FakeBackend(max_context=256)
    app = create_app(make_settings(url, admin_token=ADMIN, max_body_bytes=2_000_000), backend)
    with serve_in_thread(app) as base:
        yield base, key, backend, app


def test_openapi_schema_builds_although_the_route_is_disabled(server):
    _, _, _, app = server
    assert app.openapi_url is None  # not served: every non-probe route needs a key
    schema = app.openapi()
    assert "/v1/chat/completions" in schema["paths"] and "/admin/v1/keys" in schema["paths"]
    assert httpx.get(server[0] + "/openapi.json").status_code in (401, 404)


def _fuzz_operations(app) -> list:
    raw = app.openapi()
    schema = schemathesis.openapi.from_dict(raw)
    ops = [r.ok() for r in schema.get_all_operations()]
    return ops


@pytest.mark.parametrize("gen", ["positive", "negative"])
@pytest.mark.parametrize("mode", ["admin", "tenant", "none"])
@pytest.mark.slow
def test_schemathesis_fuzz_every_route_no_5xx_openai_errors(server, mode, gen):
    require_or_skip(schemathesis is not None, "schemathesis (pip install schemathesis)")
    base, _, _, app = server
    url = app.state.settings.database_url
    key = asyncio.run(issue_key(url, f"fuzz-{mode}-{gen}", "fuzzer"))  # the admin run may revoke earlier keys
    strategy_mode = schemathesis.GenerationMode(gen)
    headers = {"admin": {"Authorization": f"Bearer {ADMIN}"}, "tenant": {"Authorization": f"Bearer {key}"},
               "none": {}}[mode]
    ops = _fuzz_operations(app)
    assert len(ops) >= 25, [o.label for o in ops]
    seen: dict[int, int] = {}
    failures: list[str] = []
    with httpx.Client(base_url=base, timeout=30) as http:
        for op in ops:
            @given(case=op.as_strategy(strategy_mode))
            @hsettings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
                       phases=[Phase.explicit, Phase.generate],
                       suppress_health_check=list(HealthCheck))
            def run(case):
                kwargs = case.as_transport_kwargs(base_url=base)
                hdrs = {k: v for k, v in (kwargs.get("headers") or {}).items() if k.lower() != "authorization"}
                hdrs.update(headers)
                r = http.request(kwargs["method"], kwargs["url"], headers=hdrs, params=kwargs.get("params"),
                                 content=_body(kwargs))
                seen[r.status_code] = seen.get(r.status_code, 0) + 1
                if r.status_code >= 500:
                    failures.append(f"{op.label} → {r.status_code}: {r.text[:200]} ({kwargs})")
                elif r.status_code >= 400:
                    assert_openai_error_shape(r)
                    if mode == "none" and not op.path.startswith(("/healthz", "/readyz")):
                        assert r.status_code == 401, (op.label, r.text)
                    if mode == "tenant" and (op.path.startswith("/admin/") or op.path == "/metrics"):
                        assert r.status_code == 403, (op.label, r.status_code, r.text)

            try:
                run()
            except Unsatisfiable:  # nothing in this operation can be made invalid (negative mode)
                assert gen == "negative", op.label
    assert not failures, failures[:5]
    print(f"fuzz[{mode},{gen}]: {sum(seen.values())} requests, statuses {dict(sorted(seen.items()))}")
    assert sum(seen.values()) >= len(ops) * 2


def _body(kwargs: dict) -> bytes | None:
    if "json" in kwargs:
        return json.dumps(kwargs["json"]).encode()
    data = kwargs.get("data") or kwargs.get("content")
    if isinstance(data, str):
        return data.encode()
    return data


# ---------------------------------------------------------------- hand-written cases

def fresh_key(server) -> str:
    """A new tenant key (the admin fuzz run revokes keys it finds)."""
    return asyncio.run(issue_key(server[3].state.settings.database_url, "hand-tenant", "hand"))


def post(base, key, content=None, headers=None, **kw):
    hdrs = {"Authorization": f"Bearer {key}", **(headers or {})}
    return httpx.post(base + URL, content=content, headers=hdrs, timeout=30, **kw)


@pytest.mark.parametrize("raw", [b"[]", b"true", b"null", b"", b'{"model": "x", "messages": [{"role": "user", "content": "\xff\xfe"}]}'])
def test_non_object_and_invalid_utf8_bodies_400(server, raw):
    base, _, backend, _ = server
    key = fresh_key(server)
    n = len(backend.requests)
    r = post(base, key, raw, {"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert assert_openai_error_shape(r)["code"] == "invalid_json"
    assert len(backend.requests) == n


def test_no_content_type_is_accepted(server):
    base, _, _, _ = server
    key = fresh_key(server)
    r = post(base, key, json.dumps(chat()).encode())  # httpx sends no content-type for raw bytes
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_admin_bodies_are_json_whatever_the_content_type(server, content_type):
    """Like the chat route: ``curl -d '{...}'`` (form-urlencoded) works on the admin API
    (docs/tenancy.md); a bad body is still 400 ``invalid_json`` and a tenant key still 403."""
    base, _, _, _ = server
    name = f"ct-{(content_type or 'none').split('/')[-1]}"
    hdrs = {"Authorization": f"Bearer {ADMIN}", **({"content-type": content_type} if content_type else {})}
    r = httpx.post(base + "/admin/v1/tiers", content=json.dumps({"name": name, "rpm": 7}).encode(), headers=hdrs)
    assert r.status_code == 201, r.text
    assert r.json()["name"] == name and r.json()["rpm"] == 7
    r = httpx.post(base + "/admin/v1/tenants", content=b"name=x&tier=y", headers=hdrs)
    assert r.status_code == 400 and assert_openai_error_shape(r)["code"] == "invalid_json", r.text
    r = httpx.post(base + "/admin/v1/tenants", content=b'{"name": "x"}',
                   headers={**hdrs, "Authorization": f"Bearer {fresh_key(server)}"})
    assert r.status_code == 403, r.text


def test_10mb_body_413_before_reading(server):
    base, _, backend, _ = server
    key = fresh_key(server)
    n = len(backend.requests)
    big = json.dumps(chat("word " * 2_000_000)).encode()
    assert len(big) > 10_000_000
    r = post(base, key, big, {"content-type": "application/json"})
    assert r.status_code == 413
    err = assert_openai_error_shape(r)
    assert err["code"] == "request_too_large" and "2000000" in err["message"]
    assert len(backend.requests) == n


def test_chunked_body_over_limit_413(server):
    base, _, _, _ = server
    key = fresh_key(server)

    def gen():
        for _ in range(30):
            yield b" " * 100_000  # 3 MB of whitespace without a Content-Length

    r = httpx.post(base + URL, content=gen(), headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 413
    assert assert_openai_error_shape(r)["code"] == "request_too_large"


def test_a_client_that_leaves_mid_body_is_not_a_server_error(server):
    """The connection closes after half the declared body: the gateway logs the disconnect at
    INFO and nothing at ERROR (before: a ClientDisconnect traceback as an unhandled 500), no
    request reaches the engine, and the server keeps serving."""
    base, _, backend, _ = server
    key = fresh_key(server)
    n = len(backend.requests)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep, loggers = Keep(level=logging.INFO), [logging.getLogger("gateway"), logging.getLogger("uvicorn.error")]
    before = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(keep)
        lg.setLevel(logging.INFO)
    try:
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(f"POST {URL} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
                      "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n".encode()
                      + b'{"model": "' + MODEL.encode() + b'", "messages": [')
            time.sleep(0.2)
        wait_until(lambda: any("client disconnected" in r.getMessage() or r.levelno >= logging.ERROR for r in records),
                   "the disconnect's log line")
    finally:
        for lg, level in zip(loggers, before):
            lg.removeHandler(keep)
            lg.setLevel(level)
    assert [r.getMessage() for r in records if r.levelno >= logging.ERROR] == []
    assert len(backend.requests) == n
    assert httpx.post(base + URL, json=chat("hi"), headers={"Authorization": f"Bearer {key}"}).status_code == 200


def test_admin_route_body_limit_413(server):
    base, _, _, _ = server
    r = httpx.post(base + "/admin/v1/tenants", content=b'{"name": "' + b"a" * 3_000_000 + b'"}',
                   headers={"Authorization": f"Bearer {ADMIN}", "content-type": "application/json"}, timeout=30)
    assert r.status_code == 413
    assert_openai_error_shape(r)


def test_deeply_nested_json_400_not_500(server):
    base, _, backend, _ = server
    key = fresh_key(server)
    n = len(backend.requests)
    for depth in (1_000, 100_000):
        r = post(base, key, b'{"model": "m", "messages": ' + b"[" * depth + b"]" * depth + b"}",
                 {"content-type": "application/json"})
        assert r.status_code == 400, (depth, r.text[:200])
        assert_openai_error_shape(r)
    assert len(backend.requests) == n


@pytest.mark.parametrize("extra,param", [
    ({"temperature": -0.5}, "temperature"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"n": 9}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x " * 300}]}, "messages"),
])
def test_invalid_values_400_naming_the_param(server, extra, param):
    base, _, backend, _ = server
    key = fresh_key(server)
    n = len(backend.requests)
    r = httpx.post(base + URL, json={**chat(stream=True), **extra}, headers={"Authorization": f"Bearer {key}"},
                   timeout=30)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")  # before any SSE
    err = assert_openai_error_shape(r)
    assert err["param"] == param or (err["param"] or "").startswith(param), err
    if param == "stop":  # a union field: the message is the list member's, not "should be a string"
        assert "at most 4" in err["message"], err
    assert len(backend.requests) == n


def test_nan_temperature_400(server):
    base, _, _, _ = server
    key = fresh_key(server)
    raw = json.dumps(chat()).replace("}", ', "temperature": NaN}', 1)
    raw = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], "temperature": NaN}}'
    r = post(base, key, raw.encode(), {"content-type": "application/json"})
    assert r.status_code == 400 and assert_openai_error_shape(r)["param"] == "temperature"


def test_huge_max_tokens_is_clamped_to_the_context(server):
    base, _, backend, _ = server
    key = fresh_key(server)
    r = httpx.post(base + URL, json=chat(max_tokens=10**12), headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert assert_openai_error_shape(r)["param"] == "max_tokens"
    else:
        assert backend.requests[-1].sampling.max_tokens <= 256


def test_four_stop_strings_ok_and_unknown_fields_ignored(server):
    base, _, _, _ = server
    key = fresh_key(server)
    r = httpx.post(base + URL, json=chat(stop=["a", "b", "c", "d"], some_future_field={"x": 1}, foo=3),
                   headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- against the real model

@pytest.mark.model
def test_live_server_bad_input(live_server):
    base, hdrs = live_server.base_url, live_server.headers()
    url = base + URL

    def check(r, status, param=None):
        assert r.status_code == status, r.text[:300]
        assert r.headers["content-type"].startswith("application/json")  # never SSE
        err = assert_openai_error_shape(r)
        if param is not None:
            assert err["param"] == param, err
        return err

    long = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 3000}], "stream": True}
    check(httpx.post(url, json=long, headers=hdrs, timeout=60), 400, "messages")
    check(httpx.post(url, content=b"x" * 10_000_000, headers=hdrs, timeout=60), 413)
    check(httpx.post(url, content=b"[]", headers=hdrs, timeout=30), 400)
    check(httpx.post(url, json={**chat(stream=True), "n": 9}, headers=hdrs, timeout=30), 400, "n")
    check(httpx.post(url, json={**chat(), "temperature": -1}, headers=hdrs, timeout=30), 400, "temperature")
    r = httpx.post(url, json={**chat("Say hi"), "max_tokens": 10**9, "unknown_field": 1, "temperature": 0,
                              "stop": ["a", "b", "c", "d"]}, headers=hdrs, timeout=120)
    assert r.status_code == 200, r.text


@pytest.mark.model
def test_live_server_prompt_of_zero_tokens_400(live_server):
    """The tokenizer drops ``"\x14"``: the engine refused the empty prompt and the client
    got a 500 ``server_error`` (found by bench/fuzz.py's long profile)."""
    r = httpx.post(live_server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "\x14", "max_tokens": 4},
                   headers=live_server.headers(), timeout=60)
    assert r.status_code == 400, r.text
    err = assert_openai_error_shape(r)
    assert err["param"] == "prompt" and "0 tokens" in err["message"], err


@pytest.mark.model
def test_live_server_top_k_beyond_int64_is_served(live_server):
    """``top_k`` is bounded only below; 2**70 failed the engine step (500 ``engine_error``
    for every request in the batch) until the sampler clamped it (found by bench/fuzz.py)."""
    r = httpx.post(live_server.base_url + "/v1/completions",
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, "top_k": 2**70},
                   headers=live_server.headers(), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
