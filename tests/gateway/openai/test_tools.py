"""Tools on /v1/chat/completions over the fake backend: the Hermes rendering of tools, calls
and results into the prompt (and a template's own tool section when it has one), the reply
parsed into ``tool_calls`` streamed and whole, and every bad input an OpenAI-shaped 400 with
``param`` and a rejected record. (The real model: tests/gateway/openai/test_tool_calls.py.)"""

from __future__ import annotations

import json
from typing import Sequence

import pytest

from gateway.crud import records as crud_records
from gateway.openai.tools import TOOLS_PROMPT
from runtime.engine.detokenizer import GatewayTokenization, template_renders_tools
from runtime.interface import BackendInfo
from tests.gateway.openai.test_validation import assert_openai_error
from tests.support.fakes import FakeBackend
from tests.support.gateway_fixtures import MODEL, chat, parse_sse

URL = "/v1/chat/completions"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PING = {"type": "function", "function": {"name": "ping"}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        CALL, {**CALL, "id": "call_2", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "25 C"}]},
]
# the fake backend emits these words, " "-joined, one a delta: text, then one call
SCRIPT = ("I", "will", "check.", "<tool_call>", '{"name":', '"get_weather",', '"arguments":', '{"city":',
          '"Paris"}}', "</tool_call>")


@pytest.fixture
def roomy(backend):
    backend.max_context = 4096  # the tool listing is ~100 words of the fake's tokenizer
    return backend


def listing(*tools) -> str:
    return TOOLS_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))


async def test_tools_calls_and_results_are_rendered_hermes_style(client, auth, roomy):
    r = await client.post(URL, json={"model": MODEL, "messages": HISTORY, "tools": [WEATHER, PING]}, headers=auth)
    assert r.status_code == 200, r.text
    assert roomy.templated[-1] == [
        {"role": "system", "content": "Be brief.\n\n" + listing(WEATHER, PING)},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content":
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'},
        {"role": "user", "content": "<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n25 C\n"
                                    "</tool_response>"},
    ]
    assert "# Tools" in listing() and "<tools>\n\n</tools>" in listing()
    # no system message: the listing is one; tool_choice "none": tools not listed, history still rendered
    r = await client.post(URL, json=chat("Hi", tools=[PING]), headers=auth)
    assert r.status_code == 200 and roomy.templated[-1][0] == {"role": "system", "content": listing(PING)}
    r = await client.post(URL, json={"model": MODEL, "messages": HISTORY, "tools": [WEATHER], "tool_choice": "none"},
                          headers=auth)
    assert r.status_code == 200 and roomy.templated[-1][0] == {"role": "system", "content": "Be brief."}
    assert roomy.templated[-1][2]["content"].startswith("<tool_call>\n")
    assert all(req.response_format is None for req in roomy.requests)  # the fake backend has no grammars


class NativeToolsBackend(FakeBackend):
    """A backend whose chat template has its own tool section."""

    @property
    def info(self) -> BackendInfo:
        return BackendInfo(self.model_name, self.max_context, 0, chat_template_tools=True)

    def apply_chat_template(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        self.tools_given = tools
        return super().apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages])


@pytest.mark.parametrize("backend", [NativeToolsBackend(max_context=4096)])
async def test_a_template_with_a_tool_section_gets_tools_and_hugging_face_messages(client, auth, backend):
    r = await client.post(URL, json={"model": MODEL, "messages": HISTORY, "tools": [WEATHER]}, headers=auth)
    assert r.status_code == 200, r.text
    assert backend.tools_given == [WEATHER]
    assert backend.templated[-1][0] == {"role": "system", "content": "Be brief."}  # no listing of ours
    r = await client.post(URL, json={"model": MODEL, "messages": HISTORY}, headers=auth)
    assert r.status_code == 200 and backend.tools_given is None


class StubTokenizer:
    def __init__(self, template):
        self.chat_template = template
        self.calls = []

    def apply_chat_template(self, messages, **kwargs):
        self.calls.append(kwargs)
        return "text"

    def encode(self, text, add_special_tokens=False):
        return [1, 2]


def test_the_engine_side_reads_the_template_and_passes_tools_on():
    """runtime/engine/detokenizer.py: whether a template has a tool section, and tools handed
    to it only when given."""
    assert template_renders_tools(StubTokenizer("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages }}"))
    assert template_renders_tools(StubTokenizer({"default": "{{ messages }}", "tool_use": "{{ tools }}"}))
    assert not template_renders_tools(StubTokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}"))
    assert not template_renders_tools(StubTokenizer(None))
    side = GatewayTokenization()
    assert side.chat_template_tools is False  # no tokenizer yet
    side._tokenizer = tok = StubTokenizer("{{ tools }}")
    assert side.chat_template_tools is True
    side.apply_chat_template([{"role": "user", "content": "hi"}])
    side.apply_chat_template([{"role": "user", "content": "hi"}], tools=[WEATHER])
    assert tok.calls == [{"add_generation_prompt": True, "tokenize": False},
                         {"add_generation_prompt": True, "tokenize": False, "tools": [WEATHER]}]


# -- the reply parsed (the fake backend cannot constrain: auto is parsed only) --------------------------


async def test_auto_reply_with_a_call_whole_and_streamed(client, auth, roomy):
    roomy.script = SCRIPT
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]}
    r = await client.post(URL, json=body, headers=auth)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] == "I will check." and msg["role"] == "assistant"
    (call,) = msg["tool_calls"]
    assert call["id"].startswith("call_") and len(call["id"]) == 29 and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    r = await client.post(URL, json={**body, "stream": True}, headers=auth)
    chunks = [e for e in parse_sse(r.text) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[-1] == {}
    assert "".join(d.get("content", "") for d in deltas) == "I will check."
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["index"] == 0 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls[1:]) == '{"city": "Paris"}' and len(calls) >= 3
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all("<tool" not in json.dumps(d.get("content", "")) for d in deltas)


async def test_no_call_is_plain_content_and_length_keeps_its_reason(client, auth, roomy):
    body = chat("Hi", tools=[WEATHER])
    r = await client.post(URL, json=body, headers=auth)
    msg = r.json()["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "Hello there, I am a fake model.", "refusal": None}
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    roomy.script = SCRIPT
    r = await client.post(URL, json={**body, "max_tokens": 8}, headers=auth)  # cut inside the arguments
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"city":'}


# -- bad input: 400 with param, never a 500, and a rejected record ------------------------------------

USER = {"role": "user", "content": "hi"}
ASKED = {"role": "assistant", "content": None, "tool_calls": [CALL]}
BAD = [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, {"type": "code_interpreter"}]}, "tools[1].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools"}}, "tool_choice.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "ping"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),  # the fake backend has no grammars
    ({"messages": [USER, {"role": "tool", "content": "18 C"}]}, "messages[1].tool_call_id"),
    ({"messages": [USER, {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}, ASKED]},
     "messages[1].tool_call_id"),  # answers a call made later
    ({"messages": [USER, ASKED, {"role": "tool", "content": "18 C", "tool_call_id": "call_9"}]},
     "messages[2].tool_call_id"),
    ({"messages": [{**USER, "tool_calls": [CALL]}]}, "messages[0].tool_calls"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
async def test_bad_tool_input_400_names_param_and_leaves_a_record(app, client, auth, roomy, extra, param):
    r = await client.post(URL, json={**chat(stream=True), **extra}, headers=auth)
    err = assert_openai_error(r, 400, "invalid_request_error", param)
    assert roomy.requests == []
    await app.state.records.flush()
    async with app.state.sessionmaker() as s:
        rows = (await crud_records.query_records(s, limit=10, status="rejected"))[0]
    assert [(row.error_code, row.tenant, row.stream) for row in rows] == [(err["code"], "acme", True)]


MALFORMED = [  # the message schema itself: 400 before the route (no record, as any malformed message)
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}]},
     "messages[1].tool_calls[0].function.name"),
    ({"messages": [USER, ASKED, {"role": "tool", "tool_call_id": "call_1"}]}, "messages[2].content"),
    ({"messages": [USER, {"role": "function", "name": "f", "content": "1"}]}, "messages[1].role"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
]


@pytest.mark.parametrize("extra,param", MALFORMED, ids=[p for _, p in MALFORMED])
async def test_malformed_tool_messages_400(client, auth, roomy, extra, param):
    r = await client.post(URL, json={**chat(), **extra}, headers=auth)
    assert_openai_error(r, 400, "invalid_request_error", param)
    assert roomy.requests == []
