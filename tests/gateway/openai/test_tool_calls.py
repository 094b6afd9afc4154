"""Tool calling on the real model (SmolLM2-135M, which was never trained on tools): the grammar
makes ``required`` and named choices return calls whose arguments validate, streamed the same
as whole; a tool round trip; refused parameter schemas (400 naming the keyword, a rejected
record); and the OpenAI SDK assembling a streamed call from the live server."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from gateway.crud import records as crud_records
from tests.gateway.openai.test_validation import assert_openai_error
from tests.support.gateway_fixtures import MODEL, parse_sse, served_engine
from tests.support.tools import ADD, SCHEMAS, TOOLS, WEATHER

pytestmark = pytest.mark.model

URL = "/v1/chat/completions"


ANSWER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "warm": {"type": "boolean"}},
          "required": ["city", "warm"], "additionalProperties": False}
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}


def ask(question: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": question}], "temperature": 0,
            "max_tokens": 64, "tools": TOOLS, **extra}


@pytest.fixture(scope="module")
async def engine_app(tmp_path_factory, migrated_template, target_gguf, tokenizer, gguf_kernel):
    """(app, client, headers): the gateway over the served engine (gguf, AR), one per module."""
    async with served_engine(tmp_path_factory, migrated_template, "tools", target_gguf, tokenizer,
                             dtype="gguf", max_batch_size=16, max_context=1024) as app_client_headers:
        yield app_client_headers


async def reply(c, headers, body: dict) -> tuple[str | None, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason), streamed (assembled from the deltas) or not."""
    r = await c.post(URL, json=body, headers=headers)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        choice = r.json()["choices"][0]
        calls = [(t["function"]["name"], t["function"]["arguments"]) for t in choice["message"].get("tool_calls", [])]
        return choice["message"]["content"], calls, choice["finish_reason"]
    chunks = [e for e in parse_sse(r.text) if e != "[DONE]"]
    content, calls = "", {}
    for ch in chunks:
        delta = ch["choices"][0]["delta"] if ch["choices"] else {}
        content += delta.get("content") or ""
        for t in delta.get("tool_calls", []):
            if "id" in t:
                assert t["index"] == len(calls) and t["function"]["arguments"] == "" and t["type"] == "function"
                calls[t["index"]] = [t["function"]["name"], ""]
            else:
                calls[t["index"]][1] += t["function"]["arguments"]
    finish = next(ch["choices"][0]["finish_reason"] for ch in reversed(chunks) if ch["choices"])
    return content or None, [tuple(v) for v in calls.values()], finish


async def test_required_named_and_auto_choices(engine_app):
    """One batch at T = 0: ``required`` (streamed and not: the same calls), a named choice, a
    single call without parallel calls — every one a valid call of a known tool, content
    null, finish_reason tool_calls; ``auto`` and ``none`` never leak a tag into content."""
    _, c, headers = engine_app
    bodies = {
        "required": ask("What is the weather in Paris?", tool_choice="required"),
        "required-stream": ask("What is the weather in Paris?", tool_choice="required", stream=True),
        "named": ask("What is 17 plus 25?", tool_choice={"type": "function", "function": {"name": "add"}}),
        "single": ask("Weather in Rome and in Oslo?", tool_choice="required", parallel_tool_calls=False),
        "auto": ask("What is the weather in Paris?", stream=True),
        "none": ask("What is the weather in Paris?", tool_choice="none", max_tokens=24),
        "auto-json": ask("Is it warm in Paris?", response_format=ANSWER_FORMAT),
        "required-json": ask("What is the weather in Paris?", tool_choice="required", response_format=ANSWER_FORMAT),
    }
    results = dict(zip(bodies, await asyncio.gather(*(reply(c, headers, b) for b in bodies.values()))))
    print(json.dumps(results, indent=1))
    for k in ("required", "required-stream", "named", "single"):
        content, calls, finish = results[k]
        assert finish == "tool_calls" and content is None and calls, (k, results[k])
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert results["required"] == results["required-stream"]
    assert {name for name, _ in results["named"][1]} == {"add"}
    assert len(results["single"][1]) == 1
    content, calls, finish = results["auto"]
    assert finish in (("tool_calls", "length") if calls else ("stop", "length")) and "<tool_call" not in (content or "")
    for name, arguments in calls[:-1] if finish == "length" else calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    content, calls, finish = results["none"]
    assert calls == [] and content and finish in ("stop", "length")
    # tools + response_format (OpenAI: a call, or an answer in the format): never free text
    content, calls, finish = results["auto-json"]
    if calls:
        assert finish == "tool_calls" and content is None
    else:
        assert finish == "stop", results["auto-json"]
        jsonschema.validate(json.loads(content), ANSWER)
    content, calls, finish = results["required-json"]
    assert finish == "tool_calls" and content is None and calls, results["required-json"]


async def test_a_tool_round_trip_ends_in_an_answer(engine_app):
    """The model's own call and the tool's result go back in (rendered Hermes-style) and the
    reply (``auto``) is a text answer that carries the result (this 135M model mostly repeats
    the tool's response)."""
    _, c, headers = engine_app
    first = ask("What is the weather in Paris?", tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = await c.post(URL, json=first, headers=headers)
    message = r.json()["choices"][0]["message"]
    (call,) = message["tool_calls"]
    result = {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"temperature_c": 18, "sky": "sunny"})}
    second = {**first, "messages": [*first["messages"], message, result], "tool_choice": "auto"}
    content, calls, finish = await reply(c, headers, second)
    print(message, content)
    assert calls == [] and finish == "stop" and "18" in content and "<tool_call" not in content


async def test_refused_parameter_schemas_400_name_the_tool_and_leave_records(engine_app):
    app, c, headers = engine_app
    tags = {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}
    r = await c.post(URL, json=ask("Hi", tools=[WEATHER, tags], stream=True), headers=headers)
    err = assert_openai_error(r, 400, "invalid_request_error", "tools[1].function.parameters.properties.tags.uniqueItems",
                              "unsupported_schema_keyword")
    assert "'uniqueItems'" in err["message"]
    typo = {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}
    r = await c.post(URL, json=ask("Hi", tools=[typo, ADD]), headers=headers)
    err = assert_openai_error(r, 400, "invalid_request_error", "tools[0].function.parameters", "invalid_schema")
    assert "strin" in err["message"]
    bad = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"t": {"type": "string"}}, "dependentRequired": {}}}}
    r = await c.post(URL, json=ask("Hi", response_format=bad), headers=headers)  # the reply format's own fault
    assert_openai_error(r, 400, "invalid_request_error", "response_format.json_schema.schema.dependentRequired",
                        "unsupported_schema_keyword")
    await app.state.records.flush()
    async with app.state.sessionmaker() as s:
        rows = (await crud_records.query_records(s, limit=100, status="rejected"))[0]
    assert sorted(row.error_code for row in rows) == ["invalid_schema", "unsupported_schema_keyword",
                                                      "unsupported_schema_keyword"]


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(max_length=30)
    unit: Literal["celsius", "fahrenheit"]


def test_openai_sdk_assembles_a_streamed_tool_call(live_server):
    """``client.chat.completions.stream`` against the live server: the SDK assembles the
    streamed call (its argument-delta and done events) into the same call as a plain create,
    and parses the arguments into the pydantic model."""
    import openai
    from openai import OpenAI

    client = OpenAI(base_url=live_server.base_url + "/v1", api_key=live_server.key)
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                  tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required", temperature=0,
                  max_tokens=64)
    with client.chat.completions.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    choice = final.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.function.name == "GetWeather" and call.id.startswith("call_")
    assert isinstance(call.function.parsed_arguments, GetWeather)
    deltas = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    (done,) = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert "".join(e.arguments_delta for e in deltas) == done.arguments == call.function.arguments and len(deltas) >= 2
    whole = client.chat.completions.create(**kwargs)
    assert [(t.function.name, t.function.arguments) for t in whole.choices[0].message.tool_calls] == [
        (call.function.name, call.function.arguments)]
