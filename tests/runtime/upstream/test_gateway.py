"""The whole gateway on the OpenAI-compatible upstream backend, over HTTP, against a FAKE
OpenAI-compatible server (``tests/support/openai_upstream.py``; no model runs anywhere).

The gateway is the real app: ``create_app(settings)`` with ``SPARKGATE_BACKEND=openai`` builds
:class:`runtime.upstream.client.OpenAIUpstreamBackend` through ``runtime.factory``, which loads
the real SmolLM2 tokenizer (``upstream_tokenizer_path`` = the converted model dir) and templates
chats with it. Both servers run under uvicorn on 127.0.0.1 in daemon threads, so a client
disconnect is a real TCP close. Checked through HTTP only (OpenAI API, admin API):

* streamed and non-streamed chat and text completions return exactly the fake's text and the
  usage it reported; the fake received the gateway's token ids as ``prompt``, the sampling
  fields, ``stream_options.include_usage``, the tier's priority and the upstream key (never
  the client's);
* a client that disconnects mid-stream closes the upstream connection (the abort);
* an upstream 500 → 502, silence → 504, every upstream down → 503 with ``retry-after``, each
  with an OpenAI error body and a request record.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import dataclass

import httpx
import pytest

from gateway.main import create_app
from tests.support.gateway_fixtures import MODEL, make_settings, parse_sse, sqlite_url
from tests.support.openai_upstream import SCRIPT, UpstreamServer
from tests.support.hardening_util import serve_in_thread
from tests.support.polling import DEADLINE_S, wait_until

ADMIN = "admin-token-upstream-gateway"
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}
TENANT, TIER, TIER_PRIORITY = "acme", "gold", 3
UPSTREAM_KEY = "sk-upstream-secret"
MESSAGES = [{"role": "user", "content": "Say hello"}]
TEXT = "".join(SCRIPT)
READ_TIMEOUT_S = 1.0


@dataclass
class Stack:
    base: str
    app: object
    key: str
    upstreams: tuple[UpstreamServer, UpstreamServer]
    tokenizer_dir: str

    @property
    def auth(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"}

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=30)

    def fakes(self):
        return [u.fake for u in self.upstreams]

    def sent(self) -> list[dict]:
        """Every request body the fakes received, in order per fake."""
        return [b for f in self.fakes() for b in f.requests]

    def on_gateway_loop(self, coro):
        loop = self.app.state.backend_start.get_loop()
        return asyncio.run_coroutine_threadsafe(coro, loop).result(15)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, migrated_template, model_dir):
    tmp = tmp_path_factory.mktemp("upstream-gateway")
    shutil.copy(migrated_template, tmp / "gateway.db")
    ups = (UpstreamServer().start(), UpstreamServer().start())
    settings = make_settings(
        sqlite_url(tmp / "gateway.db"), admin_token=ADMIN, model_name=MODEL, max_context=512, backend="openai",
        upstream_urls=[u.url for u in ups], upstream_keys=[UPSTREAM_KEY], upstream_tokenizer_path=str(model_dir),
        upstream_send_priority=True, upstream_model="served-model", upstream_health_interval_s=3600,
        upstream_read_timeout_s=READ_TIMEOUT_S, record_flush_interval_s=0.05,
    )
    app = create_app(settings)
    try:
        with serve_in_thread(app, ready_timeout_s=DEADLINE_S, timeout_graceful_shutdown=2) as base:
            with httpx.Client(base_url=base, headers=ADMIN_H, timeout=30) as c:
                assert c.post("/admin/v1/tiers", json={"name": TIER, "priority": TIER_PRIORITY}).status_code == 201
                assert c.post("/admin/v1/tenants", json={"name": TENANT, "tier": TIER}).status_code == 201
                r = c.post("/admin/v1/keys", json={"tenant": TENANT, "user": "alice"})
                assert r.status_code == 201, r.text
            yield Stack(base, app, r.json()["key"], ups, str(model_dir))
    finally:
        for u in ups:
            u.stop()
    assert app.state.backend._client is None  # the lifespan stopped the backend


@pytest.fixture(autouse=True)
def _fresh(stack):
    for f in stack.fakes():
        f.reset()


def record(client: httpx.Client, rid: str) -> dict:
    """The final request record ``rid`` via the admin API, once the writer stored it (a
    ``running`` row is written at admission and replaced when the request ends)."""
    def stored():
        r = client.get(f"/admin/v1/requests/{rid}", headers=ADMIN_H)
        assert r.status_code in (200, 404), r.text
        return r.json() if r.status_code == 200 and r.json()["status"] != "running" else None
    return wait_until(stored, f"the request record {rid}", interval_s=0.05)


def records(client: httpx.Client, status: str) -> list[dict]:
    r = client.get("/admin/v1/requests", params={"tenant": TENANT, "status": status}, headers=ADMIN_H)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def new_record(client: httpx.Client, status: str, before: int) -> dict:
    """The newest record of ``status`` once there are more than ``before`` (an error response
    carries no id to look a record up by)."""
    return wait_until(lambda: (rs := records(client, status)) and len(rs) > before and rs[0],
                      f"a new {status} record", interval_s=0.05)


def error_of(payload: dict, code: str) -> str:
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"} and (err["type"], err["code"]) == ("server_error", code)
    return err["message"]


def template_ids(stack: Stack) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(stack.tokenizer_dir)
    return tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)


def test_streamed_chat_sends_token_ids_and_relays_text_and_usage(stack):
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": 20, "temperature": 0.5, "top_p": 0.9, "seed": 11, "stop": ["\n\n"],
            "presence_penalty": 0.5}
    with stack.client() as c:
        r = c.post("/v1/chat/completions", json=body, headers=stack.auth)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(r.text)
        rec = record(c, events[0]["id"])
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-3]) == TEXT
    assert [e["choices"][0]["finish_reason"] for e in events[1:-2]] == [None] * len(SCRIPT) + ["stop"]
    ids = template_ids(stack)
    assert events[-2]["choices"] == [] and events[-2]["usage"] == {
        "prompt_tokens": len(ids), "completion_tokens": len(SCRIPT), "total_tokens": len(ids) + len(SCRIPT)}
    (sent,) = stack.sent()
    assert sent == {"model": "served-model", "prompt": ids, "stream": True, "stream_options": {"include_usage": True},
                    "max_tokens": 20, "temperature": 0.5, "top_p": 0.9, "presence_penalty": 0.5, "seed": 11,
                    "stop": ["\n\n"], "priority": -TIER_PRIORITY}
    (headers,) = [h for f in stack.fakes() for h in f.headers]
    assert headers["authorization"] == f"Bearer {UPSTREAM_KEY}"  # the tenant's key never leaves the gateway
    assert (rec["status"], rec["tenant"], rec["finish_reason"]) == ("finished", TENANT, "stop")
    assert (rec["prompt_tokens"], rec["completion_tokens"]) == (len(ids), len(SCRIPT))


def test_non_streamed_chat_and_text_completion(stack):
    with stack.client() as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4},
                   headers=stack.auth)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["message"]["content"] == "".join(SCRIPT[:4])
        assert out["choices"][0]["finish_reason"] == "length"
        assert out["usage"]["completion_tokens"] == 4 and out["usage"]["prompt_tokens"] == len(template_ids(stack))
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon", "max_tokens": 16},
                   headers=stack.auth)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == TEXT
    from transformers import AutoTokenizer

    sent = {b["max_tokens"]: b["prompt"] for b in stack.sent()}  # the two went to either upstream
    assert sent == {4: template_ids(stack),
                    16: AutoTokenizer.from_pretrained(stack.tokenizer_dir).encode("Once upon", add_special_tokens=False)}


def test_requests_spread_over_both_upstreams(stack):
    for f in stack.fakes():
        f.chunk_delay_s = 0.05
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 16}

    async def go():
        async with httpx.AsyncClient(base_url=stack.base, timeout=30) as c:
            return await asyncio.gather(*(c.post("/v1/chat/completions", json=body, headers=stack.auth)
                                          for _ in range(4)))

    replies = asyncio.run(go())
    assert [r.status_code for r in replies] == [200] * 4
    assert [len(f.requests) for f in stack.fakes()] == [2, 2]


def test_client_disconnect_closes_the_upstream_stream(stack):
    for f in stack.fakes():
        f.script, f.chunk_delay_s = tuple(f" w{i}" for i in range(200)), 0.02  # 4 s unless aborted
    seen, rid = [], None
    with httpx.stream("POST", f"{stack.base}/v1/chat/completions", headers=stack.auth, timeout=30,
                      json={"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                rid = chunk["id"]
                if chunk["choices"][0]["delta"].get("content"):
                    seen.append(chunk["choices"][0]["delta"]["content"])
            if len(seen) == 3:
                break  # leaving the block closes the TCP connection mid-stream
    assert seen == [" w0", " w1", " w2"]
    wait_until(lambda: sum(len(f.disconnects) for f in stack.fakes()) == 1, "the upstream saw the stream close")
    assert sum(len(f.completed) for f in stack.fakes()) == 0
    with stack.client() as c:
        rec = record(c, rid)
    assert (rec["status"], rec["tenant"]) == ("cancelled", TENANT) and 3 <= rec["completion_tokens"] < 100


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("upstream,status,etype,code", [
    (500, 502, "server_error", "upstream_error"),
    # the server refuses the request itself (vLLM does so for a prompt past its --max-model-len):
    # the client's error, with the server's message
    (400, 400, "invalid_request_error", "upstream_bad_request"),
])
def test_upstream_error_status_maps_to_an_openai_error_with_a_record(stack, stream, upstream, status, etype, code):
    for f in stack.fakes():
        f.fail_status = upstream
    with stack.client() as c:
        before = len(records(c, "failed"))
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "stream": stream},
                   headers=stack.auth)
        # the first event is awaited before any byte is sent, so even a stream gets a real status
        assert r.status_code == status and r.headers["content-type"] == "application/json"
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and (err["type"], err["code"]) == (etype, code)
        assert f"answered HTTP {upstream}: fake upstream refuses with {upstream}" in err["message"]
        rec = new_record(c, "failed", before)
    assert len(stack.sent()) == 1  # not retried on the other upstream: it answered
    assert (rec["error_code"], rec["stream"]) == (code, stream)


def test_silence_is_504_before_streaming_and_an_sse_error_after(stack):
    for f in stack.fakes():
        f.stall_before_headers_s = READ_TIMEOUT_S + 1
    with stack.client() as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES}, headers=stack.auth)
        assert r.status_code == 504
        assert "no response headers within 1 s" in error_of(r.json(), "upstream_timeout")
        for f in stack.fakes():
            f.stall_before_headers_s, f.stall_after, f.stall_s = 0, 2, READ_TIMEOUT_S + 1
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "stream": True},
                   headers=stack.auth)
        assert r.status_code == 200  # the headers were sent before the upstream fell silent
        events = parse_sse(r.text)
        rec = record(c, events[0]["id"])
    assert events[-1] == "[DONE]" and "sent nothing for 1 s" in error_of(events[-2], "upstream_timeout")
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2]) == "Hello world"
    assert (rec["status"], rec["error_code"], rec["completion_tokens"]) == ("failed", "upstream_timeout", 2)


def test_every_upstream_down_is_503_with_a_record(stack):
    backend = stack.app.state.backend
    for f in stack.fakes():
        f.healthy = False
    try:
        assert stack.on_gateway_loop(backend.router.check_all(backend._client)) == 0
        with stack.client() as c:
            assert c.get("/readyz").status_code == 200  # the gateway itself serves
            before = len(records(c, "failed"))
            r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "stream": True},
                       headers=stack.auth)
            assert r.status_code == 503 and r.headers["retry-after"] == "5"
            message = error_of(r.json(), "upstream_unavailable")
            rec = new_record(c, "failed", before)
        assert "no healthy OpenAI-compatible upstream" in message and "HTTP 503" in message
        assert (rec["error_code"], rec["tenant"]) == ("upstream_unavailable", TENANT)
        assert stack.sent() == []
    finally:
        for f in stack.fakes():
            f.healthy = True
        assert stack.on_gateway_loop(backend.router.check_all(backend._client)) == 2
