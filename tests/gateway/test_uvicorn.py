"""The app under a real uvicorn server (background thread) with the official OpenAI
SDK as client, and a real TCP disconnect. Uses the FakeBackend; the lead's e2e tests
do the same with the real engine."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from gateway.main import create_app
from tests.support.fakes import FakeBackend
from tests.support.gateway_fixtures import MODEL, make_settings
from tests.support.polling import wait_until
from gateway.crud.keys import issue_key


@pytest.fixture
def server(db_url):
    """(base_url, key, backend) of a live server; stopped afterwards."""
    import asyncio

    backend = FakeBackend(max_context=256)
    key = asyncio.run(issue_key(db_url, "sdk-tenant"))
    app = create_app(make_settings(db_url), backend)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 10
    while True:
        try:
            if httpx.get(f"{base}/readyz").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not become ready"
        time.sleep(0.05)
    yield base, key, backend
    srv.should_exit = True
    thread.join(timeout=10)
    sock.close()
    assert backend.stopped


def sdk(server) -> openai.OpenAI:
    base, key, _ = server
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


def test_openai_sdk_stream_and_non_stream(server):
    client = sdk(server)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi there"}],
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello there, I am a fake model."
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens == 7 and len({c.id for c in chunks}) == 1

    done = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert done.choices[0].message.content == "Hello there," and done.choices[0].finish_reason == "length"
    assert done.usage.total_tokens == done.usage.prompt_tokens + 2

    text = client.completions.create(model=MODEL, prompt="Once", max_tokens=3)
    assert text.choices[0].text == "Hello there, I"
    assert [m.id for m in client.models.list()] == [MODEL]


def test_openai_sdk_errors(server):
    client = sdk(server)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
                                       tool_choice={"type": "function", "function": {"name": "g"}})
    assert exc.value.param == "tool_choice" and exc.value.code == "invalid_value"
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert exc.value.code == "model_not_found"
    bad = openai.OpenAI(base_url=client.base_url, api_key="sk-sg-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    _, _, backend = server
    backend.fail_after_deltas = 2
    with pytest.raises(openai.APIError, match="fake engine exploded"):
        list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True))
    backend.fail_after_deltas, backend.queue_full = None, True
    with pytest.raises(openai.APIStatusError) as exc:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert exc.value.status_code == 503 and exc.value.response.headers["retry-after"] == "3"


def test_tcp_disconnect_aborts_engine_request(server):
    base, key, backend = server
    backend.script = tuple(f"w{i}" for i in range(200))
    backend.token_delay_s = 0.05  # 10 s for the full answer
    body = {"model": MODEL, "messages": [{"role": "user", "content": "long please"}], "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {key}"}, timeout=10) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if ' w3"' in line:
                break
    wait_until(lambda: backend.aborted, "the engine request aborted")
    assert backend.aborted == [backend.requests[-1].request_id] and backend.completed == []
