"""End-to-end: the real gateway + engine + model under uvicorn, driven over HTTP
(the OpenAI Python SDK and raw httpx). One shared live server (tests/conftest.py)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.support.polling import wait_until

pytestmark = pytest.mark.model

MODEL = "SmolLM2-135M-Instruct"
FRANCE = "What is the capital of France?"


def msgs(text):
    return [{"role": "user", "content": text}]


def sse_events(body: str) -> list:
    out = []
    for block in body.strip().split("\n\n"):
        assert block.startswith("data: ")
        payload = block[6:]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def post(live, body, key=None, **kw):
    return httpx.post(live.base_url + "/v1/chat/completions", json=body, headers=live.headers(key), timeout=300, **kw)


def engine_load(live) -> dict:
    return httpx.get(live.base_url + "/admin/v1/engine", headers=live.headers(live.admin_token), timeout=10).json()


def own_record(live, rid: str) -> dict | None:
    """The final request record of ``rid`` (``None`` until the record writer has flushed it;
    while the request runs its record is the ``running`` row written at admission)."""
    r = httpx.get(f"{live.base_url}/v1/requests/{rid}", headers=live.headers(), timeout=10)
    return r.json() if r.status_code == 200 and r.json()["status"] != "running" else None


@pytest.fixture(scope="module")
def client(live_server):
    from openai import OpenAI

    return OpenAI(base_url=live_server.base_url + "/v1", api_key=live_server.key)


def test_openai_sdk_streams_paris_and_matches_non_stream(client, tokenizer):
    stream = client.chat.completions.create(model=MODEL, messages=msgs(FRANCE), stream=True, temperature=0)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    streamed = "".join(pieces)
    assert "Paris" in streamed
    full = client.chat.completions.create(model=MODEL, messages=msgs(FRANCE), temperature=0)
    assert full.choices[0].message.content == streamed
    assert full.choices[0].finish_reason == "stop"
    templated = tokenizer.apply_chat_template(msgs(FRANCE), add_generation_prompt=True, tokenize=False)
    assert full.usage.prompt_tokens == len(tokenizer.encode(templated, add_special_tokens=False))
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens


def test_include_usage_chunk_rules(live_server):
    r = post(live_server, {"model": MODEL, "messages": msgs(FRANCE), "stream": True, "temperature": 0,
                           "max_tokens": 12, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = sse_events(r.text)
    assert ev[-1] == "[DONE]"
    chunks = ev[:-1]
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    with_usage = [c for c in chunks if c.get("usage")]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and chunks[-1]["choices"] == []
    assert all(c["usage"] is None for c in chunks[:-1])
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finishes in (["stop"], ["length"])
    u = with_usage[0]["usage"]
    text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    assert u["completion_tokens"] >= 1 and text


def test_stop_string_spanning_two_tokens(live_server, tokenizer):
    base = post(live_server, {"model": MODEL, "messages": msgs(FRANCE), "temperature": 0}).json()
    reply = base["choices"][0]["message"]["content"]
    ids = tokenizer.encode(reply, add_special_tokens=False)
    pieces = [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    # the boundary between token 3 and 4: last 2 chars of the prefix + first 2 chars of the next token
    cut = len(pieces[3])
    stop = reply[cut - 2 : cut + 2]
    assert len(stop) == 4 and reply.index(stop) == cut - 2
    for stream in (False, True):
        r = post(live_server, {"model": MODEL, "messages": msgs(FRANCE), "temperature": 0, "stop": [stop], "stream": stream})
        if stream:
            ev = sse_events(r.text)[:-1]
            text = "".join(ch["delta"].get("content") or "" for c in ev for ch in c["choices"])
            finish = [ch["finish_reason"] for c in ev for ch in c["choices"] if ch["finish_reason"]][0]
        else:
            text, finish = r.json()["choices"][0]["message"]["content"], r.json()["choices"][0]["finish_reason"]
        assert text == reply[: cut - 2] and finish == "stop"


@pytest.mark.parametrize("n", [1, 7])
def test_max_tokens_exact(live_server, n):
    r = post(live_server, {"model": MODEL, "messages": msgs("Write a long essay about rivers."), "temperature": 0, "max_tokens": n}).json()
    assert r["usage"]["completion_tokens"] == n
    assert r["choices"][0]["finish_reason"] == "length"


def test_multibyte_output_has_no_replacement_chars(live_server):
    prompt = "Repeat exactly, nothing else: café naïve 日本語 中文 😀🎉"
    r = post(live_server, {"model": MODEL, "messages": msgs(prompt), "temperature": 0, "max_tokens": 40, "stream": True})
    ev = sse_events(r.text)[:-1]
    deltas = [ch["delta"].get("content") or "" for c in ev for ch in c["choices"]]
    text = "".join(deltas)
    assert any(ord(ch) > 0x2FFF for ch in text), text  # CJK or emoji actually produced
    assert "\ufffd" not in text and all("\ufffd" not in d for d in deltas)
    full = post(live_server, {"model": MODEL, "messages": msgs(prompt), "temperature": 0, "max_tokens": 40}).json()
    assert full["choices"][0]["message"]["content"] == text


def test_client_disconnect_frees_the_slot(live_server):
    body = {"model": MODEL, "messages": msgs("Count from 1 to 1000."), "stream": True, "max_tokens": 1000, "ignore_eos": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", live_server.base_url + "/v1/chat/completions", json=body, headers=live_server.headers()) as r:
            got = 0
            # Keep a reference to the line iterator: a dropped (garbage-collected)
            # iterator closes httpx's stream, i.e. disconnects before we look.
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: ") and '"content"' in line:
                    rid = json.loads(line[6:])["id"]
                    got += 1
                if got >= 5:
                    break
            assert engine_load(live_server)["running"] == 1
    # A step can take seconds on a loaded machine: poll, then tell an abort from the end of
    # the request: the disconnect freed the slot with far fewer than its 1000 tokens.
    wait_until(lambda: engine_load(live_server)["running"] == 0, "the slot freed after the disconnect")
    record = wait_until(lambda: own_record(live_server, rid), f"the record of {rid}")
    assert record["status"] == "cancelled" and 0 < record["completion_tokens"] < 1000, record


def test_auth_and_bad_requests(live_server):
    r = httpx.post(live_server.base_url + "/v1/chat/completions", json={"model": MODEL, "messages": msgs("hi")})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert post(live_server, {"model": MODEL}, key="sk-sg-wrong").status_code == 401
    cases = [
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, None),
        ({"model": MODEL, "messages": msgs("x"), "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "messages": msgs("x"), "tools": [{"type": "function", "function": {"description": "f"}}]},
         "tools[0].function.name"),
        ({"model": MODEL, "messages": msgs("x"), "n": 9}, "n"),
        ({"model": MODEL, "messages": msgs("word " * 3000)}, "messages"),
        ({"model": MODEL}, "messages"),  # missing messages
        ({"model": MODEL, "messages": msgs("x"), "max_tokens": "ten"}, "max_tokens"),  # wrong type
        ({"model": MODEL, "messages": "hello"}, "messages"),
    ]
    for body, param in cases:
        r = post(live_server, {**body, "stream": True})
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        if param:
            assert err["param"] == param
    for raw in (b"[]", b"{not json", b""):
        r = httpx.post(live_server.base_url + "/v1/chat/completions", content=raw,
                       headers={**live_server.headers(), "content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (raw, r.text)
    assert httpx.get(live_server.base_url + "/admin/v1/engine", headers=live_server.headers()).status_code == 403


STREAM_TOKENS = 32  # per stream: 1 from its prefill, the rest decoded one row per step


async def _stream_text(client: httpx.AsyncClient, prompt: str) -> str:
    body = {"model": MODEL, "messages": msgs(prompt), "stream": True, "temperature": 0, "max_tokens": STREAM_TOKENS,
            "ignore_eos": True}
    text = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    text.append(ch["delta"].get("content") or "")
    return "".join(text)


def test_eight_concurrent_streams_batch_for_real(live_server):
    prompts = [f"Tell me a fact about the number {i}." for i in range(8)]

    async def go():
        async with httpx.AsyncClient(base_url=live_server.base_url, headers=live_server.headers(), timeout=300) as c:
            alone = [await _stream_text(c, p) for p in prompts]
            before = engine_load(live_server)
            together = await asyncio.gather(*(_stream_text(c, p) for p in prompts))
            after = engine_load(live_server)
            return alone, together, {k: after[k] - before[k] for k in ("decode_steps", "verify_tokens")}

    alone, together, steps = asyncio.run(go())
    assert all(len(t) > 0 for t in together)
    assert together == alone  # fp32: batching does not change the text, for each of the 8
    assert steps["verify_tokens"] == 8 * (STREAM_TOKENS - 1)  # each stream: 1 token from its prefill, the rest decoded
    # Batched: on average at least 4 of the 8 streams shared each decode step (one by one: 1). A
    # loaded machine may admit the 8 over several steps, so the bound does not assume they arrive at once.
    assert steps["decode_steps"] <= 8 * (STREAM_TOKENS - 1) // 4, steps
