"""/v1/completions (legacy text completions) and /v1/models."""

from __future__ import annotations

import pytest

from tests.support.gateway_fixtures import MODEL, parse_sse

URL = "/v1/completions"


def completion(prompt="Once upon a time", **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, **extra}


async def test_non_stream_text_completion(client, auth, backend):
    r = await client.post(URL, json=completion(max_tokens=3), headers=auth)
    assert r.status_code == 200
    data = r.json()
    assert data["object"] == "text_completion" and data["id"].startswith("cmpl-") and data["model"] == MODEL
    assert data["choices"] == [{"index": 0, "text": "Hello there, I", "logprobs": None, "finish_reason": "length"}]
    assert data["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    assert backend.requests[-1].prompt_token_ids == backend.encode("Once upon a time")


async def test_default_max_tokens_is_16_like_openai(client, auth, backend):
    backend.script = tuple(f"w{i}" for i in range(100))
    r = await client.post(URL, json=completion(), headers=auth)
    assert backend.requests[-1].sampling.max_tokens == 16
    assert r.json()["usage"]["completion_tokens"] == 16


async def test_stream_text_completion_with_usage(client, auth, backend):
    r = await client.post(URL, json=completion(["Once upon a time"], stream=True,
                                               stream_options={"include_usage": True}), headers=auth)
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "Hello there, I am a fake model."
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11}
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_stream_failure_mid_completion(client, auth, backend):
    backend.fail_after_deltas = 1
    events = parse_sse((await client.post(URL, json=completion(stream=True), headers=auth)).text)
    assert events[0]["choices"][0]["text"] == "Hello"
    assert events[1]["error"]["type"] == "server_error" and events[2] == "[DONE]" and len(events) == 3


BAD = [
    ({"prompt": ["a", "b"]}, "prompt", None),
    ({"prompt": []}, "prompt", None),
    ({"prompt": ""}, "prompt", None),
    ({"prompt": [1, 2, 3]}, "prompt", None),
    ({"prompt": None}, "prompt", None),
    ({"echo": True}, "echo", "unsupported_parameter"),
    ({"logprobs": 6}, "logprobs", "invalid_value"),  # OpenAI's legacy maximum is 5
    ({"suffix": "end"}, "suffix", "unsupported_parameter"),
    ({"best_of": 3}, "best_of", "unsupported_parameter"),
    ({"n": 9}, "n", None),
    ({"max_tokens": 0}, "max_tokens", None),
    ({"prompt": " ".join(["x"] * 64)}, "prompt", "context_length_exceeded"),
]


@pytest.mark.parametrize("extra,param,code", BAD, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD)])
async def test_completion_400s(client, auth, backend, extra, param, code):
    r = await client.post(URL, json={**completion(), **extra}, headers=auth)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    if code:
        assert err["code"] == code
    assert backend.requests == []


async def test_completion_max_tokens_clamped(client, auth, backend):
    backend.script = tuple(f"w{i}" for i in range(100))
    r = await client.post(URL, json=completion(" ".join(["x"] * 60), max_tokens=50), headers=auth)
    assert backend.requests[-1].sampling.max_tokens == 4
    assert r.json()["choices"][0]["finish_reason"] == "length"


async def test_unknown_model(client, auth):
    r = await client.post(URL, json=completion(model="text-davinci-003"), headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_models_list_and_retrieve(client, auth, app):
    r = await client.get("/v1/models", headers=auth)
    assert r.status_code == 200
    assert r.json() == {"object": "list", "data": [
        {"id": MODEL, "object": "model", "created": app.state.started_at, "owned_by": "sparkgate"}]}
    r = await client.get(f"/v1/models/HuggingFaceTB/{MODEL}", headers=auth)
    assert r.status_code == 200 and r.json()["id"] == MODEL
    r = await client.get("/v1/models/gpt-4", headers=auth)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
