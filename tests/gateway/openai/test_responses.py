"""The Responses API on the real model (SmolLM2-135M, gguf, in process) through the OpenAI
Python SDK (``AsyncOpenAI`` over the app's ASGI client): text with the same tokens, text and
usage as the chat request it translates to (cached tokens included) and the same request
record; ``responses.stream``'s event sequence and text; Structured Outputs through
``text.format``; a tool call with ``tool_choice: "required"`` answered by a
``function_call_output`` into a text answer, by full input items and by
``previous_response_id`` alike (and as chat answers it); ``max_output_tokens`` cuts; and the
400s for schemas the grammar refuses, naming them in the Responses request's shape."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
from pydantic import BaseModel, Field

from gateway.crud import records as crud_records
from tests.gateway.openai.test_validation import assert_openai_error
from tests.support.gateway_fixtures import MODEL, served_engine
from tests.support.tools import SCHEMAS, TOOLS

pytestmark = pytest.mark.model

FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses' flat tool shape
QUESTION = "What is the capital of France? Answer in one short sentence."
WEATHER_Q = "What is the weather in Paris?"


@pytest.fixture(scope="module")
async def engine_app(tmp_path_factory, migrated_template, target_gguf, tokenizer, gguf_kernel):
    """(app, client, headers, AsyncOpenAI): the gateway over the served engine (gguf, AR)."""
    from openai import AsyncOpenAI

    async with served_engine(tmp_path_factory, migrated_template, "responses", target_gguf, tokenizer,
                             dtype="gguf", max_batch_size=16, max_context=1024) as (app, c, headers):
        key = headers["Authorization"].removeprefix("Bearer ")
        sdk = AsyncOpenAI(base_url="http://t/v1", api_key=key, http_client=c, max_retries=0)
        yield app, c, headers, sdk


async def test_text_matches_chat_in_text_usage_cache_and_record(engine_app):
    """At T = 0 the response's text, input/output tokens and cached tokens are chat's on the
    same prompt (a chat request first warms the prefix cache; the response and a second chat
    request then reuse the same cached tokens); the record says ``responses``; GET gives the
    object back."""
    app, c, headers, sdk = engine_app
    chat_body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
                 "max_tokens": 24}
    cold = (await c.post("/v1/chat/completions", json=chat_body, headers=headers)).json()
    resp = await sdk.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=24)
    warm = (await c.post("/v1/chat/completions", json=chat_body, headers=headers)).json()
    text = warm["choices"][0]["message"]["content"]
    assert cold["choices"][0]["message"]["content"] == text and text
    assert re.fullmatch(r"resp_[0-9a-f]{48}", resp.id) and resp.object == "response"
    assert resp.status == "completed" and resp.incomplete_details is None and resp.error is None
    (msg,) = resp.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "completed"
    assert re.fullmatch(r"msg_[0-9a-f]{48}", msg.id)
    assert [(p.type, p.annotations) for p in msg.content] == [("output_text", [])]
    assert resp.output_text == msg.content[0].text == text
    u, cu = resp.usage, warm["usage"]
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (
        cu["prompt_tokens"], cu["completion_tokens"], cu["total_tokens"])
    assert u.input_tokens_details.cached_tokens == cu["prompt_tokens_details"]["cached_tokens"] > 0
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert u.output_tokens_details.reasoning_tokens == 0
    assert (resp.temperature, resp.top_p, resp.max_output_tokens, resp.store, resp.tools, resp.tool_choice) == (
        0.0, 1.0, 24, True, [], "auto")
    await app.state.records.flush()
    async with app.state.sessionmaker() as s:
        record = await crud_records.get_record(s, resp.id)
    assert (record.endpoint, record.status, record.tenant, record.finish_reason) == (
        "responses", "finished", "acme", "stop")
    assert (record.prompt_tokens, record.completion_tokens) == (u.input_tokens, u.output_tokens)
    again = await sdk.responses.retrieve(resp.id)
    assert again.model_dump() == resp.model_dump()


async def test_stream_events_assemble_the_whole_text(engine_app):
    """``responses.stream`` (text, a required tool call, and one cut by ``max_output_tokens``,
    in one batch): the documented event sequence with sequence numbers 0, 1, …; the deltas
    join into the non-streamed T = 0 text and arguments; the final object is the stored one."""
    app, c, headers, sdk = engine_app

    async def streamed(**kw):
        """(events, final response): the SDK assembles completed ones; an incomplete one is its
        last event's object (the SDK's get_final_response waits for response.completed only)."""
        async with sdk.responses.stream(model=MODEL, temperature=0, **kw) as stream:
            events = [e async for e in stream]
            final = await stream.get_final_response() if events[-1].type == "response.completed" else None
            return events, final or events[-1].response

    text_kw = dict(input=QUESTION, max_output_tokens=24)
    tool_kw = dict(input=WEATHER_Q, tools=FLAT_TOOLS, tool_choice="required", max_output_tokens=64)
    cut_kw = dict(input=QUESTION, max_output_tokens=3)
    (text_events, text_final), (tool_events, tool_final), (cut_events, cut_final), whole, whole_tool = \
        await asyncio.gather(streamed(**text_kw), streamed(**tool_kw), streamed(**cut_kw),
                             sdk.responses.create(model=MODEL, temperature=0, **text_kw),
                             sdk.responses.create(model=MODEL, temperature=0, **tool_kw))
    for events in (text_events, tool_events, cut_events):
        assert [e.sequence_number for e in events] == list(range(len(events)))
    names = " ".join(e.type.removeprefix("response.") for e in text_events)
    assert re.fullmatch(r"created in_progress output_item\.added content_part\.added (output_text\.delta )+"
                        r"output_text\.done content_part\.done output_item\.done completed", names), names
    deltas = "".join(e.delta for e in text_events if e.type == "response.output_text.delta")
    done = next(e for e in text_events if e.type == "response.output_text.done")
    assert deltas == done.text == text_final.output_text == whole.output_text and deltas
    assert text_final.id == text_events[0].response.id and text_final.status == "completed"
    assert text_final.usage.output_tokens == whole.usage.output_tokens

    names = " ".join(e.type.removeprefix("response.") for e in tool_events)
    call = r"output_item\.added (function_call_arguments\.delta )+function_call_arguments\.done output_item\.done "
    assert re.fullmatch(rf"created in_progress ({call})+completed", names), names
    calls = [o for o in tool_final.output if o.type == "function_call"]
    assert calls and len(calls) == len(tool_final.output)
    assert [(o.name, o.arguments) for o in calls] == [(o.name, o.arguments) for o in whole_tool.output]
    for o in calls:
        assert o.status == "completed" and o.call_id.startswith("call_") and o.id.startswith("fc_")
        jsonschema.validate(json.loads(o.arguments), SCHEMAS[o.name])
    args = "".join(e.delta for e in tool_events if e.type == "response.function_call_arguments.delta")
    assert args == "".join(o.arguments for o in calls)

    assert cut_events[-1].type == "response.incomplete" and cut_final.status == "incomplete"
    assert cut_final.incomplete_details.reason == "max_output_tokens" and cut_final.usage.output_tokens == 3
    assert cut_final.output[0].status == "incomplete" and whole.output_text.startswith(cut_final.output_text)
    stored = (await c.get(f"/v1/responses/{cut_final.id}", headers=headers)).json()
    assert stored["status"] == "incomplete" and stored["output"][0]["content"][0]["text"] == cut_final.output_text


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=50)


async def test_text_format_json_schema_and_sdk_parse(engine_app):
    """``text.format`` json_schema (and ``responses.parse`` with a pydantic model): the text is
    an instance of the schema."""
    _, _, _, sdk = engine_app
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    kw = dict(model=MODEL, temperature=0, max_output_tokens=64)
    plain, parsed = await asyncio.gather(
        sdk.responses.create(input="Describe Paris weather as JSON.", text={"format": {
            "type": "json_schema", "name": "weather", "schema": schema, "strict": True}}, **kw),
        sdk.responses.parse(input="Describe Paris as JSON.", text_format=City, **kw))
    assert plain.status == "completed" and plain.text.format.type == "json_schema"
    jsonschema.validate(json.loads(plain.output_text), schema)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, City)


async def test_tool_call_then_output_gives_the_same_answer_by_items_and_by_previous_id(engine_app):
    """Turn 1 (``tool_choice`` required): one call of a tool, valid arguments. Turn 2 (``auto``)
    answers its ``function_call_output`` in text: the same text, usage and prompt whether the
    conversation is sent as items (the SDK's output items given back) or continued by
    ``previous_response_id``, and the same as chat on the equivalent messages."""
    _, c, headers, sdk = engine_app
    first = await sdk.responses.create(model=MODEL, input=WEATHER_Q, tools=FLAT_TOOLS, temperature=0,
                                       tool_choice={"type": "function", "name": "get_weather"},
                                       parallel_tool_calls=False, max_output_tokens=64)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": json.dumps({"temperature_c": 18, "sky": "sunny"})}
    kw = dict(model=MODEL, tools=FLAT_TOOLS, temperature=0, max_output_tokens=48)
    by_items, by_id = await asyncio.gather(
        sdk.responses.create(input=[{"role": "user", "content": WEATHER_Q},
                                    *[o.model_dump(exclude_none=True) for o in first.output], result], **kw),
        sdk.responses.create(previous_response_id=first.id, input=[result], **kw))
    for second in (by_items, by_id):
        assert [o.type for o in second.output] == ["message"] and second.status == "completed"
    assert by_items.output_text == by_id.output_text and "18" in by_id.output_text
    assert by_items.usage.input_tokens == by_id.usage.input_tokens
    assert by_id.previous_response_id == first.id and by_items.previous_response_id is None
    chat = (await c.post("/v1/chat/completions", headers=headers, json={
        "model": MODEL, "temperature": 0, "max_tokens": 48, "tools": TOOLS, "messages": [
            {"role": "user", "content": WEATHER_Q},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": result["output"]}]})).json()
    assert chat["choices"][0]["message"]["content"] == by_id.output_text
    assert chat["usage"]["prompt_tokens"] == by_id.usage.input_tokens


async def test_schemas_the_grammar_refuses_are_400s_naming_them(engine_app):
    """The chat validators' refusals, with ``param`` in the Responses shape; each leaves a
    rejected record of endpoint ``responses``."""
    app, c, headers, _ = engine_app
    tags = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 8}
    r = await c.post("/v1/responses", headers=headers, json={
        **body, "text": {"format": {"type": "json_schema", "name": "t", "schema": tags}}})
    err = assert_openai_error(r, 400, "invalid_request_error", "text.format.schema.properties.tags.uniqueItems",
                              "unsupported_schema_keyword")
    assert "'uniqueItems'" in err["message"]
    r = await c.post("/v1/responses", headers=headers, json={
        **body, "stream": True, "tools": [FLAT_TOOLS[0], {"type": "function", "name": "tag", "parameters": tags}]})
    assert_openai_error(r, 400, "invalid_request_error", "tools[1].parameters.properties.tags.uniqueItems",
                        "unsupported_schema_keyword")
    r = await c.post("/v1/responses", headers=headers, json={
        **body, "text": {"format": {"type": "json_schema", "name": "t", "schema": {"type": "strin"}}}})
    assert_openai_error(r, 400, "invalid_request_error", "text.format", "invalid_schema")
    await app.state.records.flush()
    async with app.state.sessionmaker() as s:
        rows = (await crud_records.query_records(s, limit=100, status="rejected"))[0]
    assert sorted((row.endpoint, row.error_code) for row in rows) == [
        ("responses", "invalid_schema"), ("responses", "unsupported_schema_keyword"),
        ("responses", "unsupported_schema_keyword")]
