"""``response_format`` on /v1/chat/completions: ``json_object`` and ``json_schema`` (strict or
not) on the real engine — 55 schemas in one batch, every reply that stops validates — the
400s for schemas the server refuses (naming the keyword), and the OpenAI SDK's
``chat.completions.parse`` against the live server."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Annotated

import jsonschema
import pytest
from pydantic import BaseModel, Field

from gateway.crud import records as crud_records
from tests.gateway.openai.test_validation import assert_openai_error
from tests.support.gateway_fixtures import MODEL, chat, parse_sse, served_engine
from tests.support.json_schemas import SCHEMAS, UNSUPPORTED

URL = "/v1/chat/completions"


def json_schema(schema: dict, strict: bool | None = None, name: str = "answer") -> dict:
    spec = {"name": name, "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


# -- refused before the engine (fake backend) ------------------------------------------------


async def test_a_backend_without_grammars_refuses_json_formats(client, auth, backend):
    for fmt in ({"type": "json_object"}, json_schema({"type": "object"})):
        r = await client.post(URL, json=chat(response_format=fmt), headers=auth)
        assert_openai_error(r, 400, "invalid_request_error", "response_format", "unsupported_parameter")
    r = await client.post(URL, json=chat(response_format={"type": "text"}), headers=auth)
    assert r.status_code == 200 and backend.requests[-1].response_format is None


@pytest.mark.parametrize("fmt,param", [
    ({"type": "xml"}, "response_format"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}, "response_format.json_schema.strict"),
    ("json", "response_format"),
])
async def test_malformed_response_format_400_names_the_field(client, auth, backend, fmt, param):
    r = await client.post(URL, json=chat(response_format=fmt), headers=auth)
    assert_openai_error(r, 400, "invalid_request_error", param)
    assert backend.requests == []


@pytest.mark.parametrize("extra,param,code", [
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs.regex", "unsupported_parameter"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs.choice", "unsupported_parameter"),
    ({"guided_regex": "a+"}, "guided_regex", "unsupported_parameter"),
    ({"guided_json": "{not json"}, "guided_json", "invalid_value"),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "guided_json", "invalid_value"),
    ({"structured_outputs": {"json": {}}, "guided_json": {}}, "guided_json", "invalid_value"),
])
async def test_vllm_constraints_other_than_json_400_by_name(grammar_client, auth, extra, param, code):
    client, backend = grammar_client
    r = await client.post(URL, json=chat(**extra), headers=auth)
    assert_openai_error(r, 400, "invalid_request_error", param, code)
    assert backend.requests == []


@pytest.mark.parametrize("extra,expected", [
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}},
     ("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}})),
    ({"structured_outputs": {"json": '{"type": "array"}'}}, ("json_schema", {"type": "array"})),
    ({"guided_json": {"type": "string"}}, ("json_schema", {"type": "string"})),
    ({"structured_outputs": {"json_object": True}}, ("json_object", None)),
])
async def test_vllm_json_constraints_are_response_formats(grammar_client, auth, extra, expected):
    client, backend = grammar_client
    r = await client.post(URL, json=chat(**extra), headers=auth)
    assert r.status_code == 200, r.text
    fmt = backend.requests[-1].response_format
    assert (fmt.type, fmt.schema) == expected


@pytest.fixture
def grammar_client(client, backend):
    """The fake backend, claiming grammar support (it records the format it is given)."""
    backend.supports_response_format = True
    return client, backend


# -- the real engine, in process --------------------------------------------------------------


@pytest.fixture(scope="module")
async def engine_app(tmp_path_factory, migrated_template, target_gguf, tokenizer, gguf_kernel):
    """(app, client, headers): the gateway over the served engine (gguf, 64 slots, AR), one per module."""
    async with served_engine(tmp_path_factory, migrated_template, "structured", target_gguf, tokenizer,
                             dtype="gguf", max_batch_size=64, max_context=1024) as app_client_headers:
        yield app_client_headers


async def reply(c, headers, body: dict) -> tuple[str, str]:
    """(content, finish_reason) of a chat request, streamed or not."""
    r = await c.post(URL, json=body, headers=headers)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        choice = r.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
    chunks = [e for e in parse_sse(r.text) if e != "[DONE]"]
    content = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"])
    return content, next(ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]
                         and ch["choices"][0]["finish_reason"])


@pytest.mark.model
async def test_every_stopped_reply_validates_against_its_schema(engine_app):
    """The 55 schemas of tests/support/json_schemas.py at once (one engine batch), T = 0,
    max_tokens 512, strict true / false / absent and streamed or not in turn: every reply
    with finish_reason "stop" parses and validates; at most 10 % end by length (recursive
    schemas and unbounded numbers, where this 135M model repeats itself)."""
    app, c, headers = engine_app
    t0 = time.perf_counter()
    bodies = [chat(prompt, temperature=0, max_tokens=512, stream=i % 5 == 4,
                   response_format=json_schema(schema, (True, False, None)[i % 3], name))
              for i, (name, prompt, schema) in enumerate(SCHEMAS)]
    results = await asyncio.gather(*(reply(c, headers, b) for b in bodies))
    seconds = time.perf_counter() - t0
    lengths = []
    for (name, _, schema), (content, finish) in zip(SCHEMAS, results):
        if finish == "stop":
            jsonschema.validate(json.loads(content), schema)  # raises with the schema's name in the trace
        else:
            assert finish == "length", (name, finish)
            lengths.append(name)
    print(f"\n{len(SCHEMAS)} schemas in {seconds:.1f} s; length finishes: {lengths}")
    assert len(lengths) <= 0.10 * len(SCHEMAS), lengths


@pytest.mark.model
async def test_json_object_mode_streams_one_json_object(engine_app):
    _, c, headers = engine_app
    body = chat("Describe a cat as JSON with its name and age.", temperature=0, max_tokens=128,
                response_format={"type": "json_object"})
    text, finish = await reply(c, headers, body)
    streamed, finish2 = await reply(c, headers, {**body, "stream": True})
    assert finish == finish2 == "stop" and streamed == text
    assert isinstance(json.loads(text), dict) and text.startswith("{")


@pytest.mark.model
@pytest.mark.parametrize("schema,keyword,path", UNSUPPORTED, ids=[k for _, k, _ in UNSUPPORTED])
async def test_unsupported_keyword_400_names_it(engine_app, schema, keyword, path):
    app, c, headers = engine_app
    r = await c.post(URL, json=chat(response_format=json_schema(schema), stream=True), headers=headers)
    err = assert_openai_error(r, 400, "invalid_request_error", f"response_format.json_schema.schema.{path}",
                              "unsupported_schema_keyword")
    assert f"'{keyword}'" in err["message"]


@pytest.mark.model
async def test_invalid_schema_400_and_a_rejected_record(engine_app):
    app, c, headers = engine_app
    r = await c.post(URL, json=chat(response_format=json_schema({"type": "strin"})), headers=headers)
    err = assert_openai_error(r, 400, "invalid_request_error", "response_format", "invalid_schema")
    assert "strin" in err["message"]
    r = await c.post(URL, json=chat(response_format=json_schema({"type": "integer", "minimum": 1.5})), headers=headers)
    assert_openai_error(r, 400, "invalid_request_error", "response_format", "invalid_schema")
    await app.state.records.flush()
    async with app.state.sessionmaker() as s:
        rows = (await crud_records.query_records(s, limit=1000, status="rejected"))[0]
    assert sum(row.error_code == "invalid_schema" for row in rows) == 2


# -- the OpenAI SDK against the live server ----------------------------------------------------


class CityFacts(BaseModel):
    city: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population_millions: float = Field(ge=0, le=100)
    landmarks: list[Annotated[str, Field(max_length=30)]] = Field(max_length=3)


@pytest.mark.model
def test_openai_sdk_parse_returns_the_pydantic_model(live_server):
    from openai import OpenAI

    client = OpenAI(base_url=live_server.base_url + "/v1", api_key=live_server.key)
    done = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about Paris as JSON."}],
        response_format=CityFacts, temperature=0, max_tokens=200)
    msg = done.choices[0].message
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(msg.parsed, CityFacts) and msg.parsed == CityFacts.model_validate_json(msg.content)
    assert len(msg.parsed.landmarks) <= 3 and 0 <= msg.parsed.population_millions <= 100
