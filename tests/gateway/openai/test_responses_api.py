"""``/v1/responses`` over the fake backend: the 400s (each naming its field in the Responses
request's shape, nothing reaching the engine), the parameter table's neutral values accepted
and echoed, the conversation the template gets (instructions, roles, parts, calls and their
outputs, a continued response), tool calls parsed into items the same streamed and whole,
the SSE framing and a failure after the stream began, and a client that leaves."""

from __future__ import annotations

import json
import time

import pytest

from gateway.crud import records as crud_records
from tests.gateway.openai.test_chat import call_asgi
from tests.gateway.openai.test_validation import assert_openai_error
from tests.support.gateway_fixtures import MODEL, parse_response_sse

URL = "/v1/responses"
ADD = {"type": "function", "name": "add", "description": "Add two integers.",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}
CALL = {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 1, "b": 2}'}


def req(input="Say hello", **extra) -> dict:
    return {"model": MODEL, "input": input, **extra}


@pytest.fixture
def roomy(backend):
    """The fake backend with room for the tools' instructions in its context."""
    backend.max_context = 4096
    return backend


BAD = [  # (body, status, param, code)
    (req(tools=[{"type": "function"}]), 400, "tools[0].name", "missing_required_parameter"),
    (req(tools=[{"type": "function", "name": "has space"}]), 400, "tools[0].name", "invalid_value"),
    (req(tools=[{"type": "function", "name": "add", "parameters": 3}]), 400, "tools[0].parameters", "invalid_value"),
    (req(tools=[{"type": "web_search"}]), 400, "tools[0].type", "unsupported_parameter"),
    (req(tools={"type": "function", "name": "add"}), 400, "tools", "invalid_value"),
    (req(tools=[ADD, ADD]), 400, "tools[1].name", "invalid_value"),
    (req(tools=[ADD], tool_choice={"type": "function", "name": "mul"}), 400, "tool_choice", "invalid_value"),
    (req(tools=[ADD], tool_choice={"type": "function"}), 400, "tool_choice.name", "invalid_value"),
    (req(tools=[ADD], tool_choice={"type": "allowed_tools", "mode": "auto", "tools": []}), 400, "tool_choice.type",
     "unsupported_parameter"),
    (req(tools=[ADD], tool_choice="sometimes"), 400, "tool_choice", "invalid_value"),
    (req(tool_choice="required"), 400, "tool_choice", "invalid_value"),
    (req([{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "call_9", "output": "3"}]),
     400, "input[1].call_id", "invalid_value"),
    (req([CALL, {"type": "function_call_output", "call_id": "call_2", "output": "3"}]), 400, "input[1].call_id",
     "invalid_value"),
    (req([{"type": "function_call_output", "call_id": "call_1", "output": "3"}, CALL]), 400, "input[0].call_id",
     "invalid_value"),
    (req([{"type": "function_call_output", "call_id": "", "output": "3"}]), 400, "input[0].call_id", "invalid_value"),
    (req([{"role": "tool", "content": "x"}]), 400, "input[0].role", "invalid_value"),
    (req([{"role": "user", "content": [{"type": "input_image", "image_url": "https://x"}]}]), 400,
     "input[0].content[0].type", "unsupported_parameter"),
    (req([{"role": "user"}]), 400, "input[0].content", "missing_required_parameter"),
    (req([{"type": "reasoning", "summary": []}]), 400, "input[0].type", "unsupported_parameter"),
    (req([{"type": "item_reference", "id": "msg_1"}]), 400, "input[0].type", "unsupported_parameter"),
    (req([{"type": 3}]), 400, "input[0]", "invalid_value"),
    (req([]), 400, "input", "invalid_value"),
    (req(text={"format": {"type": "json_schema", "schema": {}}}), 400, "text.format.name", "missing_required_parameter"),
    (req(text={"format": {"type": "xml"}}), 400, "text.format", "invalid_value"),
    (req(text={"format": {"type": "json_object"}}), 400, "text.format", "unsupported_parameter"),  # fake: no grammar
    (req(text={"verbosity": "low"}), 400, "text.verbosity", "unsupported_parameter"),
    (req(background=True), 400, "background", "unsupported_parameter"),
    (req(truncation="auto"), 400, "truncation", "unsupported_parameter"),
    (req(reasoning={"effort": "high"}), 400, "reasoning.effort", "unsupported_parameter"),
    (req(reasoning={"summary": "auto"}), 400, "reasoning.summary", "unsupported_parameter"),
    (req(include=["message.output_text.logprobs"]), 400, "include[0]", "unsupported_parameter"),
    (req(include=["reasoning.encrypted_content", "everything"]), 400, "include[1]", "invalid_value"),
    (req(top_logprobs=2), 400, "top_logprobs", "unsupported_parameter"),
    (req(service_tier="priority"), 400, "service_tier", "unsupported_parameter"),
    (req(prompt={"id": "pmpt_1"}), 400, "prompt", "unsupported_parameter"),
    (req(conversation="conv_1"), 400, "conversation", "unsupported_parameter"),
    (req(temperature=3), 400, "temperature", "invalid_value"),
    (req(max_output_tokens=0), 400, "max_output_tokens", "invalid_value"),
    (req(metadata={"k": "v" * 513}), 400, "metadata.k", "invalid_value"),
    (req(metadata={str(i): "v" for i in range(17)}), 400, "metadata", "invalid_value"),
    (req(user="a\x00b"), 400, "user", "invalid_value"),
    (req(previous_response_id="resp_\x00"), 400, "previous_response_id", "invalid_value"),
    (req(input="x " * 5000), 400, "input", "context_length_exceeded"),
    ({"input": "hi"}, 400, "model", "missing_required_parameter"),
    (req(model="gpt-9"), 404, "model", "model_not_found"),
]


@pytest.mark.parametrize("body,status,param,code", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
async def test_bad_input_is_an_openai_error_naming_the_field(client, auth, roomy, body, status, param, code):
    r = await client.post(URL, json=body, headers=auth)
    assert_openai_error(r, status, "invalid_request_error", param, code)
    if code == "unsupported_parameter":
        assert f"'{param}'" in r.json()["error"]["message"]
    assert roomy.requests == []


async def test_refused_tools_and_call_outputs_leave_rejected_records(app, client, auth, roomy):
    """As on chat: a refused tool, tool_choice or call output is a ``rejected`` record of
    endpoint ``responses`` (what a tenant can find in its records); other 400s leave none."""
    for body in (req(tools=[{"type": "function"}]), req(tools=[ADD], tool_choice={"type": "function", "name": "x"}),
                 req([{"type": "function_call_output", "call_id": "call_9", "output": "3"}]), req(background=True)):
        assert (await client.post(URL, json=body, headers=auth)).status_code == 400
    await app.state.records.flush()
    async with app.state.sessionmaker() as s:
        rows = (await crud_records.query_records(s, limit=100))[0]
    assert sorted((r.endpoint, r.status, r.error_code) for r in rows) == [
        ("responses", "rejected", "invalid_value")] * 2 + [("responses", "rejected", "missing_required_parameter")]
    assert all(r.id.startswith("resp_") and r.prompt_tokens == 0 for r in rows)


async def test_neutral_values_of_the_parameter_table_are_accepted_and_echoed(app, client, auth, backend):
    """What SDKs and agents send by default passes (README's table) and is echoed; ``user``
    falls back to ``safety_identifier`` in the record."""
    body = req(background=False, truncation="disabled", include=["reasoning.encrypted_content"],
               reasoning={"effort": None, "summary": None}, service_tier="auto", store=False,
               metadata={"trace": "t-1"}, prompt_cache_key="conv-7", safety_identifier="end-user-3",
               stream_options={"include_obfuscation": False}, text={"format": {"type": "text"}, "verbosity": "medium"},
               max_tool_calls=3, parallel_tool_calls=False, top_logprobs=0, temperature=0.5, top_p=0.9,
               prompt=None, conversation=None, instructions="Be brief.", max_output_tokens=20)
    r = await client.post(URL, json=body, headers=auth)
    assert r.status_code == 200, r.text
    obj = r.json()
    assert {k: obj[k] for k in ("metadata", "prompt_cache_key", "safety_identifier", "store", "max_tool_calls",
                                "parallel_tool_calls", "temperature", "top_p", "instructions", "max_output_tokens",
                                "truncation", "service_tier", "background", "tool_choice", "tools", "text")} == {
        "metadata": {"trace": "t-1"}, "prompt_cache_key": "conv-7", "safety_identifier": "end-user-3",
        "store": False, "max_tool_calls": 3, "parallel_tool_calls": False, "temperature": 0.5, "top_p": 0.9,
        "instructions": "Be brief.", "max_output_tokens": 20, "truncation": "disabled", "service_tier": "default",
        "background": False, "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"},
                                                                           "verbosity": "medium"}}
    sampling = backend.requests[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.max_tokens) == (0.5, 0.9, 20)
    assert obj["output"][0]["content"][0]["text"] == backend.expected_text(7)
    assert obj["usage"] == {"input_tokens": backend.requests[-1].prompt_token_ids.__len__(),
                            "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 7,
                            "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": len(backend.requests[-1].prompt_token_ids) + 7}
    await app.state.records.flush()
    async with app.state.sessionmaker() as s:
        record = await crud_records.get_record(s, obj["id"])
    assert (record.endpoint, record.user, record.stream) == ("responses", "end-user-3", False)
    r = await client.post(URL, json=req(user="u-1", safety_identifier="end-user-3", return_spec_stats=True),
                          headers=auth)
    assert "spec_stats" not in obj and r.json()["spec_stats"]["emitted"] == 7  # the extension, as on chat
    await app.state.records.flush()
    async with app.state.sessionmaker() as s:
        record = await crud_records.get_record(s, r.json()["id"])
    assert (record.user, record.spec_emitted, record.spec_rounds) == ("u-1", 7, r.json()["spec_stats"]["rounds"])


async def test_the_conversation_the_template_gets(client, auth, roomy):
    """Instructions first (as a system message), developer → system, text parts joined (an
    output message given back as the SDK dumps it), a call after an assistant message joins
    it, call outputs become the Hermes tool-response turn; a continued response's
    instructions are not carried over, its conversation and output are."""
    first = req([
        {"role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is "},
                                                        {"type": "input_text", "text": "1 + 2?"}]},
        {"type": "message", "role": "assistant", "id": "msg_x", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me add.", "annotations": []}]},
        {**CALL, "id": "fc_x", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "3"}]},
    ], instructions="Be brief.", tools=[ADD], tool_choice="none")
    r = await client.post(URL, json=first, headers=auth)
    assert r.status_code == 200, r.text
    assert roomy.templated[-1] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
                                         '</tool_call>'},
        {"role": "user", "content": "<tool_response>\n3\n</tool_response>"},
    ]
    r2 = await client.post(URL, json=req("And 2 + 2?", previous_response_id=r.json()["id"]), headers=auth)
    assert r2.status_code == 200, r2.text
    assert roomy.templated[-1] == roomy.templated[-2][1:] + [
        {"role": "assistant", "content": roomy.expected_text(7)}, {"role": "user", "content": "And 2 + 2?"}]


TOOL_SCRIPT = ("Sure.", "<tool_call>", '{"name":', '"add",', '"arguments":', '{"a":', "1,", '"b":', "2}}",
               "</tool_call>", "<tool_call>", '{"name":', '"add",', '"arguments":', '{"a":', "3,", '"b":', "4}}",
               "</tool_call>", "Done.")


async def test_tool_calls_become_items_the_same_streamed_and_whole(client, auth, roomy):
    """Text, two calls and text again (``auto``: the fake backend has no grammar, the reply is
    only parsed): message, function_call, function_call, message — streamed in one-word
    deltas and whole alike, the stream's events in the documented order; the messages' text
    joined (the SDK's ``output_text``) is chat's ``content`` for the same reply."""
    roomy.script = TOOL_SCRIPT
    chat = (await client.post("/v1/chat/completions", headers=auth, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Add."}], "tools": [
            {"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}]})).json()
    whole = (await client.post(URL, json=req("Add.", tools=[ADD]), headers=auth)).json()
    r = await client.post(URL, json=req("Add.", tools=[ADD], stream=True), headers=auth)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = parse_response_sse(r.text)
    final = events[-1]["response"]

    def shape(items):
        return [(o["type"], o.get("name"), o.get("arguments"), o["content"][0]["text"] if o["type"] == "message"
                 else None, o["status"]) for o in items]

    expected = [("message", None, None, "Sure.", "completed"),
                ("function_call", "add", '{"a": 1, "b": 2}', None, "completed"),
                ("function_call", "add", '{"a": 3, "b": 4}', None, "completed"),
                ("message", None, None, " Done.", "completed")]
    assert shape(whole["output"]) == shape(final["output"]) == expected
    message = chat["choices"][0]["message"]
    assert message["content"] == "Sure. Done." and [(c["function"]["name"], c["function"]["arguments"])
                                                    for c in message["tool_calls"]] == [(o[1], o[2]) for o in expected[1:3]]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["output_index"] for e in added] == [e["output_index"] for e in done] == [0, 1, 2, 3]
    assert [e["item"] for e in done] == final["output"]
    assert all(e["item"]["status"] == "in_progress" for e in added)
    assert added[1]["item"]["arguments"] == "" and added[1]["item"]["call_id"].startswith("call_")
    for i in (1, 2):
        fc = final["output"][i]
        deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
                  and e["output_index"] == i]
        (args_done,) = [e for e in events if e["type"] == "response.function_call_arguments.done"
                        and e["output_index"] == i]
        assert "".join(deltas) == args_done["arguments"] == fc["arguments"] and args_done["item_id"] == fc["id"]
    assert final["status"] == "completed" and final["usage"]["output_tokens"] == len(TOOL_SCRIPT)
    assert (await client.get(f"{URL}/{final['id']}", headers=auth)).json() == final


async def test_a_failure_after_the_stream_began_is_response_failed(client, auth, backend):
    backend.fail_after_deltas = 2
    r = await client.post(URL, json=req(stream=True), headers=auth)
    events = parse_response_sse(r.text)
    assert r.status_code == 200 and "[DONE]" not in r.text
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "engine_error",
                                                                "message": "fake engine exploded"}
    assert (await client.get(f"{URL}/{failed['id']}", headers=auth)).status_code == 404  # not stored


async def test_an_engine_failure_before_the_first_token_is_a_500(client, auth, backend):
    backend.fail_after_deltas = 0
    for stream in (False, True):
        r = await client.post(URL, json=req(stream=stream), headers=auth)
        assert_openai_error(r, 500, "server_error", None, "engine_error")


@pytest.fixture
def slow_backend(backend):
    backend.script = tuple(f"w{i}" for i in range(1000))
    backend.token_delay_s = 0.05  # a full answer would take 50 s
    return backend


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_leaves_aborts_the_engine_request(app, api_key, slow_backend, stream):
    t0 = time.monotonic()
    aborted: list[str] = []
    sent = await call_asgi(app, req(stream=stream), api_key, path=URL, aborted_on_return=aborted,
                           **({"disconnect_after_body_chunks": 4} if stream else {"disconnect_after_s": 0.2}))
    assert time.monotonic() - t0 < 10.0
    assert aborted == [slow_backend.requests[0].request_id] and slow_backend.completed == []
    assert aborted[0].startswith("resp_")
    if stream:
        assert sent[0]["status"] == 200 and b"event: response.created" in sent[1]["body"]
    await app.state.records.flush()
    async with app.state.sessionmaker() as s:
        record = await crud_records.get_record(s, aborted[0])
    assert (record.endpoint, record.status) == ("responses", "cancelled")
    assert json.loads(json.dumps(record.id)) == aborted[0]
