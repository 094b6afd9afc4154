"""/v1/chat/completions against the FakeBackend: the OpenAI stream/non-stream contract,
sampling pass-through, max_tokens clamping, engine errors, queue full, disconnects."""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest

from tests.support.fakes import FakeBackend
from tests.support.gateway_fixtures import MODEL, chat, parse_sse

URL = "/v1/chat/completions"


def chunks_of(events: list) -> list[dict]:
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


async def test_stream_chunk_contract(client, auth, backend):
    r = await client.post(URL, json=chat(stream=True), headers=auth)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = chunks_of(parse_sse(r.text))
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert {c["created"] for c in chunks} == {chunks[0]["created"]}
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert all(c["usage"] is None and "spec_stats" not in c for c in chunks)
    assert all(len(c["choices"]) == 1 and c["choices"][0]["index"] == 0 for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "stop" and last["delta"] == {}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "Hello there, I am a fake model."
    assert len(chunks) == 2 + len(backend.script)  # role + one per delta + finish


async def test_stream_include_usage_adds_exactly_one_usage_chunk(client, auth, backend):
    r = await client.post(URL, json=chat("Say hello", stream=True, stream_options={"include_usage": True}),
                          headers=auth)
    chunks = chunks_of(parse_sse(r.text))
    with_usage = [c for c in chunks if c["usage"] is not None]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1]
    assert chunks[-1]["choices"] == []
    # fake template: "<|im_start|> user Say hello <|im_end|>" + "<|im_start|> assistant" = 7 tokens
    assert chunks[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 7, "total_tokens": 14}
    assert all(c["choices"] for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


async def test_multi_token_deltas_stream_text_and_usage(client, auth, backend):
    backend.tokens_per_delta = 3  # speculative rounds emit several tokens per delta
    r = await client.post(URL, json=chat(stream=True, stream_options={"include_usage": True}), headers=auth)
    chunks = chunks_of(parse_sse(r.text))
    contents = [c["choices"][0]["delta"]["content"] for c in chunks[1:-2]]
    assert contents == ["Hello there, I", " am a fake", " model."]
    assert chunks[-1]["usage"]["completion_tokens"] == 7


async def test_non_stream_shape_and_usage(client, auth, backend):
    body = chat("one two three four five")
    r = await client.post(URL, json=body, headers=auth)
    assert r.status_code == 200
    data = r.json()
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    assert data["model"] == MODEL and isinstance(data["created"], int)
    assert data["system_fingerprint"] is None
    assert data["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello there, I am a fake model.",
                                                        "refusal": None},
                                "logprobs": None, "finish_reason": "stop"}]
    prompt_tokens = len(backend.apply_chat_template([{"role": "user", "content": "one two three four five"}]))
    assert prompt_tokens == 10
    assert data["usage"] == {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17}
    assert "spec_stats" not in data
    assert backend.requests[-1].request_id == data["id"]


async def test_spec_stats_extension(client, auth, backend):
    r = await client.post(URL, json=chat(return_spec_stats=True, max_tokens=5), headers=auth)
    spec = r.json()["spec_stats"]
    # fake: emitted 5, rounds (5+2)//3 = 2
    assert spec == {"rounds": 2, "drafted": 8, "verified": 8, "accepted": 3, "emitted": 5, "tau": 2.5,
                    "accepted_per_position": [2, 1], "gated_rounds": 0}
    r = await client.post(URL, json=chat(return_spec_stats=True, max_tokens=5, stream=True,
                                         stream_options={"include_usage": True}), headers=auth)
    chunks = chunks_of(parse_sse(r.text))
    carrying = [c for c in chunks if "spec_stats" in c]
    assert len(carrying) == 1 and carrying[0]["choices"][0]["finish_reason"] == "length"
    assert carrying[0]["spec_stats"] == spec


async def test_sampling_parameters_are_passed_through(client, auth, backend):
    body = chat(temperature=0.3, top_p=0.9, top_k=40, seed=1234, stop=["\n\n", "END", ""], user="u-7",
                ignore_eos=True, max_tokens=4, return_spec_stats=True)
    r = await client.post(URL, json=body, headers=auth)
    assert r.status_code == 200
    req = backend.requests[-1]
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.ignore_eos, s.max_tokens) == (0.3, 0.9, 40, 1234, True, 4)
    assert s.stop == ("\n\n", "END")
    assert req.tenant == "acme" and req.user == "u-7" and req.return_spec_stats is True
    assert req.timeout_s == 600.0
    assert req.prompt_token_ids == backend.apply_chat_template([{"role": "user", "content": "Say hello"}])
    assert r.json()["choices"][0]["finish_reason"] == "length"


async def test_openai_defaults(client, auth, backend):
    await client.post(URL, json=chat(stop="###"), headers=auth)
    req = backend.requests[-1]
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.top_k) == (1.0, 1.0, 0)
    assert req.sampling.seed is None and req.sampling.ignore_eos is False
    assert req.sampling.stop == ("###",)
    assert req.user == "alice"  # the key's user label when the body has no `user`
    assert req.return_spec_stats is False


async def test_max_tokens_clamped_to_context(client, auth, backend):
    backend.script = tuple(f"w{i}" for i in range(500))
    prompt_len = 7  # "Say hello"; the fake's max_context is 64
    for extra in ({"max_tokens": 1000}, {}, {"max_completion_tokens": 60, "max_tokens": 2}):
        r = await client.post(URL, json=chat(**extra), headers=auth)
        assert r.status_code == 200, r.text
        assert backend.requests[-1].sampling.max_tokens == 64 - prompt_len
        data = r.json()
        assert data["choices"][0]["finish_reason"] == "length"
        assert data["usage"]["completion_tokens"] == 64 - prompt_len
        assert data["usage"]["total_tokens"] == 64


async def test_max_completion_tokens_wins_over_max_tokens(client, auth, backend):
    r = await client.post(URL, json=chat(max_tokens=5, max_completion_tokens=3), headers=auth)
    assert backend.requests[-1].sampling.max_tokens == 3
    assert r.json()["choices"][0]["message"]["content"] == "Hello there, I"


async def test_prompt_filling_context_but_one_token(client, auth, backend):
    words = " ".join(["x"] * (64 - 6))  # 58 words + 5 template tokens = 63 tokens
    r = await client.post(URL, json=chat(words), headers=auth)
    assert r.status_code == 200
    assert r.json()["usage"] == {"prompt_tokens": 63, "completion_tokens": 1, "total_tokens": 64}
    assert r.json()["choices"][0]["finish_reason"] == "length"


async def test_content_parts_developer_role_and_extra_fields(client, auth, backend):
    body = {
        "model": MODEL,
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}],
             "name": "bob"},
            {"role": "assistant", "content": None},
            {"role": "user", "content": "again"},
        ],
        "parallel_tool_calls": False, "metadata": {"trace": "x"}, "store": False, "some_future_field": [1, 2],
        "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "logprobs": False, "n": 1,
        "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
    }
    r = await client.post(URL, json=body, headers=auth)
    assert r.status_code == 200, r.text
    assert backend.templated[-1] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello world"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "again"},
    ]


@pytest.mark.parametrize("name", ["HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-instruct", MODEL])
async def test_model_aliases(client, auth, name):
    r = await client.post(URL, json={**chat(), "model": name}, headers=auth)
    assert r.status_code == 200 and r.json()["model"] == MODEL


async def test_unknown_model_404(client, auth, backend):
    r = await client.post(URL, json={**chat(stream=True), "model": "gpt-4o"}, headers=auth)
    assert r.status_code == 404
    assert r.json()["error"] == {"message": "The model `gpt-4o` does not exist or you do not have access to it.",
                                 "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    assert backend.requests == []


async def test_engine_failure_mid_stream_is_error_event_then_done(client, auth, backend):
    backend.fail_after_deltas = 2
    r = await client.post(URL, json=chat(stream=True, stream_options={"include_usage": True}), headers=auth)
    assert r.status_code == 200
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    assert [e["choices"][0]["delta"].get("content") for e in events[:3]] == ["", "Hello", " there,"]
    assert events[3] == {"error": {"message": "fake engine exploded", "type": "server_error", "param": None,
                                   "code": "engine_error"}}
    assert len(events) == 5  # no finish chunk, no usage chunk after an error


async def test_engine_failure_non_stream_is_500(client, auth, backend):
    backend.fail_after_deltas = 3
    r = await client.post(URL, json=chat(), headers=auth)
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error" and r.json()["error"]["code"] == "engine_error"
    assert backend.aborted == []  # the request ended by itself


async def test_engine_failure_before_first_token_is_http_500_even_when_streaming(client, auth, backend):
    backend.fail_after_deltas = 0
    r = await client.post(URL, json=chat(stream=True), headers=auth)
    assert r.status_code == 500
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["message"] == "fake engine exploded"


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("stream", [False, True])
async def test_queue_full_503_with_retry_after(client, auth, backend, lazy, stream):
    backend.queue_full, backend.raise_lazily, backend.retry_after_s = True, lazy, 2.5
    r = await client.post(URL, json=chat(stream=stream), headers=auth)
    assert r.status_code == 503
    assert r.headers["retry-after"] == str(math.ceil(2.5))
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "queue_full"


@pytest.mark.parametrize("url,body", [(URL, chat()), ("/v1/completions", {"model": MODEL, "prompt": "hi"})])
async def test_not_ready_503_before_anything_needs_the_tokenizer(client, auth, backend, monkeypatch, url, body):
    """While the model loads the real backend has no tokenizer yet: templating raised
    AttributeError → 500 for the first seconds of every start. Readiness is checked first."""
    backend.set_ready(False)

    def no_tokenizer(*_):
        raise AttributeError("'NoneType' object has no attribute 'apply_chat_template'")

    monkeypatch.setattr(backend, "apply_chat_template", no_tokenizer)
    monkeypatch.setattr(backend, "encode", no_tokenizer)
    r = await client.post(url, json=body, headers=auth)
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
    assert "still loading" in r.json()["error"]["message"]
    assert "retry-after" in r.headers and backend.requests == []


# ----------------------------------------------------------------- client disconnects


async def call_asgi(app, payload: dict, key: str, *, disconnect_after_body_chunks: int | None = None,
                    disconnect_after_s: float | None = None, fail_send_after_chunks: int | None = None,
                    spec_version: str = "2.3", aborted_on_return: list | None = None, path: str = URL) -> list[dict]:
    """Drive the ASGI app like a server would (``POST path``), with a client that goes away.
    ``aborted_on_return`` receives the backend's aborted ids as the app returns."""
    aborted_on_return = [] if aborted_on_return is None else aborted_on_return
    body = json.dumps(payload).encode()
    gone = asyncio.Event()
    sent: list[dict] = []
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        n_body = sum(1 for m in sent if m["type"] == "http.response.body" and m.get("body"))
        if fail_send_after_chunks is not None and n_body > fail_send_after_chunks:
            raise OSError("connection reset by peer")
        if disconnect_after_body_chunks is not None and n_body >= disconnect_after_body_chunks:
            gone.set()

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "client": ("127.0.0.1", 5555), "server": ("gateway.test", 80),
        "headers": [(b"host", b"gateway.test"), (b"authorization", f"Bearer {key}".encode()),
                    (b"content-type", b"application/json")],
    }
    if disconnect_after_s is not None:
        asyncio.get_running_loop().call_later(disconnect_after_s, gone.set)
    try:
        async with asyncio.timeout(5):
            await app(scope, receive, send)
    except OSError:
        pass
    # Snapshot right away: no event-loop turn has passed, so garbage-collector
    # finalization of a leaked generator cannot have run yet.
    aborted_on_return.extend(app.state.backend.aborted)
    return sent


@pytest.fixture
def slow_backend(backend: FakeBackend) -> FakeBackend:
    backend.script = tuple(f"w{i}" for i in range(1000))
    backend.token_delay_s = 0.05  # a full answer would take 50 s: an abort is told from the end at any load
    return backend


async def test_disconnect_mid_stream_aborts_backend_request(app, api_key, slow_backend):
    t0 = time.monotonic()
    aborted: list[str] = []
    sent = await call_asgi(app, chat(stream=True), api_key, disconnect_after_body_chunks=3, aborted_on_return=aborted)
    assert time.monotonic() - t0 < 10.0
    assert sent[0]["status"] == 200
    assert aborted == [slow_backend.requests[0].request_id]
    assert slow_backend.completed == []


async def test_failed_send_closes_backend_iterator(app, api_key, slow_backend):
    # ASGI >= 2.4 servers report a vanished client as OSError on send, without a
    # disconnect message: the response must still close the backend iterator.
    aborted: list[str] = []
    await call_asgi(app, chat(stream=True), api_key, fail_send_after_chunks=2, spec_version="2.4",
                    aborted_on_return=aborted)
    assert aborted == [slow_backend.requests[0].request_id]


async def test_disconnect_during_non_stream_generation_aborts(app, api_key, slow_backend):
    t0 = time.monotonic()
    aborted: list[str] = []
    await call_asgi(app, chat(), api_key, disconnect_after_s=0.2, aborted_on_return=aborted)
    assert time.monotonic() - t0 < 10.0
    assert aborted == [slow_backend.requests[0].request_id]


async def test_disconnect_while_queued_aborts_before_first_token(app, api_key, backend):
    backend.first_event_delay_s = 60.0
    t0 = time.monotonic()
    aborted: list[str] = []
    sent = await call_asgi(app, chat(stream=True), api_key, disconnect_after_s=0.1, aborted_on_return=aborted)
    assert time.monotonic() - t0 < 10.0  # at the disconnect, not after the 60 s before the first token
    assert aborted == [backend.requests[0].request_id]
    assert all(m["type"] != "http.response.body" or b"data:" not in m.get("body", b"") for m in sent)


async def test_finished_requests_feed_rolling_stats(client, auth, app):
    await client.post(URL, json=chat(), headers=auth)
    await client.post(URL, json=chat(stream=True), headers=auth)
    snap = app.state.stats.window(60.0)
    assert snap.requests == 2 and snap.completion_tokens == 14
