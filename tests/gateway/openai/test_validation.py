"""Every request the gateway must refuse: OpenAI-shaped 400/404/405/500 bodies, sent
before the engine sees anything."""

from __future__ import annotations

import pytest
from fastapi import FastAPI

from tests.support.fakes import FakeBackend
from tests.support.gateway_fixtures import MODEL, chat

URL = "/v1/chat/completions"


def assert_openai_error(r, status: int, type_: str, param, code=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert err["type"] == type_ and err["param"] == param, err
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[]", b"true", b"null", b'"hello"', b"3", b"\xff\xfe"])
async def test_body_must_be_a_json_object(client, auth, backend, raw):
    r = await client.post(URL, content=raw, headers={**auth, "content-type": "application/json"})
    assert_openai_error(r, 400, "invalid_request_error", None, "invalid_json")
    assert backend.requests == []


async def test_json_body_without_json_content_type_is_accepted(client, auth):
    # curl -d sends application/x-www-form-urlencoded unless told otherwise
    import json

    r = await client.post(URL, content=json.dumps(chat()), headers={**auth, "content-type": "text/plain"})
    assert r.status_code == 200


BAD_BODIES = [
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": "hi"}, "messages"),
    ({"model": MODEL, "messages": ["hi"]}, "messages[0]"),
    ({"model": MODEL, "messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": 1, "content": "hi"}]}, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": MODEL, "messages": [{"role": "user"}]}, "messages[0].content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
    (chat(model=7), "model"),
    (chat(stream="yes"), "stream"),
    (chat(stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(max_tokens=-5), "max_tokens"),
    (chat(max_tokens="10"), "max_tokens"),
    (chat(max_tokens=1.5), "max_tokens"),
    (chat(max_tokens=True), "max_tokens"),
    (chat(max_completion_tokens=0), "max_completion_tokens"),
    (chat(temperature=-0.1), "temperature"),
    (chat(temperature=2.01), "temperature"),
    (chat(temperature="1"), "temperature"),
    (chat(top_p=0), "top_p"),
    (chat(top_p=1.5), "top_p"),
    (chat(top_k=-2), "top_k"),
    (chat(top_k=1.5), "top_k"),
    (chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    (chat(stop=5), "stop"),
    (chat(stop=[1]), "stop"),
    (chat(seed="42"), "seed"),
    (chat(seed=2**64), "seed"),  # a 64-bit generator seed: 2^64 − 1 is the largest
    (chat(seed=-(2**63) - 1), "seed"),
    (chat(user=5), "user"),
    (chat(ignore_eos="true"), "ignore_eos"),
    (chat(logprobs="yes"), "logprobs"),
    (chat(logprobs=1), "logprobs"),
    (chat(top_logprobs=3), "top_logprobs"),  # OpenAI: top_logprobs needs logprobs: true
    (chat(logprobs=False, top_logprobs=0), "top_logprobs"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
    (chat(logprobs=True, top_logprobs=2.0), "top_logprobs"),
]


@pytest.mark.parametrize("body,param", BAD_BODIES, ids=[p for _, p in BAD_BODIES])
async def test_invalid_body_400_names_param(client, auth, backend, body, param):
    r = await client.post(URL, json=body, headers=auth)
    assert_openai_error(r, 400, "invalid_request_error", param)
    assert backend.requests == []


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
async def test_non_finite_temperature_400(client, auth, literal):
    raw = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], "temperature": {literal}}}'
    r = await client.post(URL, content=raw, headers={**auth, "content-type": "application/json"})
    assert_openai_error(r, 400, "invalid_request_error", "temperature")


UNSUPPORTED = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "required"},
     "tool_choice"),  # this backend cannot constrain its output (tests/gateway/openai/test_tools.py: the rest)
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
]


@pytest.mark.parametrize("extra,param", UNSUPPORTED, ids=[f"{p}-{i}" for i, (_, p) in enumerate(UNSUPPORTED)])
async def test_unsupported_openai_parameters_400(client, auth, backend, extra, param):
    r = await client.post(URL, json=chat(stream=True, **extra), headers=auth)
    err = assert_openai_error(r, 400, "invalid_request_error", param, "unsupported_parameter")
    assert param in err["message"]
    assert backend.requests == []


async def test_function_messages_unsupported(client, auth):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"},
                                         {"role": "function", "content": "42", "name": "f"}]}
    r = await client.post(URL, json=body, headers=auth)
    assert_openai_error(r, 400, "invalid_request_error", "messages[1].role", "unsupported_parameter")


async def test_assistant_function_call_unsupported(client, auth):
    body = {"model": MODEL, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}]}
    r = await client.post(URL, json=body, headers=auth)
    assert_openai_error(r, 400, "invalid_request_error", "messages[1].function_call", "unsupported_parameter")


async def test_image_content_part_unsupported(client, auth):
    body = {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
    r = await client.post(URL, json=body, headers=auth)
    assert_openai_error(r, 400, "invalid_request_error", "messages[0].content[1]", "unsupported_parameter")


@pytest.mark.parametrize("words", [64 - 5, 200])  # 59 words + 5 template tokens = 64 = max_context
async def test_prompt_longer_than_context_400(client, auth, backend, words):
    r = await client.post(URL, json=chat(" ".join(["x"] * words), stream=True), headers=auth)
    err = assert_openai_error(r, 400, "invalid_request_error", "messages", "context_length_exceeded")
    assert "64" in err["message"] and str(words + 5) in err["message"]
    assert backend.requests == []


@pytest.mark.parametrize("url,body,param", [
    (URL, b'{"model":"%s","messages":[{"role":"user","content":"hi \\ud800 x"}]}', "messages[0].content"),
    ("/v1/completions", b'{"model":"%s","prompt":"a \\udfff"}', "prompt"),
])
async def test_text_that_is_not_valid_unicode_400(client, auth, backend, url, body, param):
    """A lone surrogate (JSON ``\\ud800``) made the tokenizer raise: 500. It is a 400 now."""
    r = await client.post(url, content=body.replace(b"%s", MODEL.encode()), headers={**auth, "content-type": "application/json"})
    assert_openai_error(r, 400, "invalid_request_error", param)
    assert "not valid Unicode" in r.json()["error"]["message"] and backend.requests == []


async def test_backend_template_value_error_400(client, auth, backend, monkeypatch):
    def bad_template(messages):
        raise ValueError("conversation roles must alternate")

    monkeypatch.setattr(backend, "apply_chat_template", bad_template)
    r = await client.post(URL, json=chat(), headers=auth)
    err = assert_openai_error(r, 400, "invalid_request_error", "messages")
    assert "alternate" in err["message"]


async def test_unexpected_exception_is_openai_500_without_trace(client, auth, backend, monkeypatch):
    def broken(messages):
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(backend, "apply_chat_template", broken)
    r = await client.post(URL, json=chat(), headers=auth)
    assert_openai_error(r, 500, "server_error", None)
    assert "secret" not in r.text


async def test_unknown_route_404_and_wrong_method_405(client, auth):
    r = await client.post("/v1/chat/completion", json=chat(), headers=auth)
    err = assert_openai_error(r, 404, "invalid_request_error", None, "unknown_url")
    assert "/v1/chat/completion" in err["message"]
    r = await client.get(URL, headers=auth)
    assert_openai_error(r, 405, "invalid_request_error", None, "method_not_allowed")
    assert r.headers["allow"] == "POST"


async def test_auth_is_checked_before_the_body(client):
    r = await client.post(URL, content=b"{broken")
    assert_openai_error(r, 401, "authentication_error", None, "invalid_api_key")


async def test_fastapi_validation_errors_are_400_openai_shape(settings):
    # Routes declaring typed parameters get FastAPI's validation; it must not answer 422.
    import httpx

    from gateway.api.error_handlers import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/typed")
    async def typed(n: int) -> dict:
        return {"n": n}

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.get("/typed", params={"n": "abc"})
    assert_openai_error(r, 400, "invalid_request_error", "query.n", "invalid_value")


async def test_errors_before_streaming_are_json_not_sse(client, auth):
    r = await client.post(URL, json=chat(stream=True, temperature=5), headers=auth)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")


def test_fake_backend_satisfies_protocol():
    from runtime.interface import Backend

    assert isinstance(FakeBackend(), Backend)
