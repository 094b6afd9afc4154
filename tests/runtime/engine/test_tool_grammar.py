"""Tool-call grammars (runtime/engine/tool_grammar.py, compiled by runtime/engine/grammar.py):
the structural tag of each choice, what the compiled grammars accept (the gateway's own
rendering of a call among it), refusals that name the tool at fault, and T = 0 losslessness
under speculation — tool requests through a hybrid speculative engine emit exactly the
tokens of plain decoding."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gateway.openai.schemas import FunctionTool
from gateway.openai.tool_parser import parse_tool_calls
from gateway.openai.tools import ToolPlan, call_text, hermes_messages
from runtime.engine.grammar import GrammarCache, RequestGrammar
from runtime.engine.tool_grammar import CALL_CLOSING, call_opening, structural_tag
from runtime.interface import GrammarError, ResponseFormat, SamplingParams, ToolSchema
from tests.runtime.engine.test_grammar import EOS, V, run_engine
from tests.support.tools import ADD, SCHEMAS, TOOLS, WEATHER


def schemas(*tools) -> tuple[ToolSchema, ...]:
    return tuple(ToolSchema(t["function"]["name"], t["function"].get("parameters")) for t in tools)


def tool_format(choice: str = "required", parallel: bool = True, tools=TOOLS) -> ResponseFormat:
    return ResponseFormat("tool_calls", tools=schemas(*tools), tool_choice=choice, parallel_tool_calls=parallel)


def tool_prompt(tokenizer, question: str, tools=TOOLS) -> list[int]:
    """The served prompt of a user question with ``tools`` (the gateway's Hermes rendering)."""
    plan = ToolPlan([FunctionTool.model_validate(t) for t in tools], "auto")
    messages = hermes_messages([{"role": "user", "content": question}], plan)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


# -- the structural tag (no xgrammar) ----------------------------------------------------------


def test_structural_tag_of_each_choice():
    args = ["root ::= \"{}\"", "root ::= \"[]\""]
    req = structural_tag(tool_format("required"), args)["format"]
    assert req["type"] == "tags_with_separator" and req["at_least_one"] and not req["stop_after_first"]
    assert [t["begin"] for t in req["tags"]] == [call_opening("get_weather"), call_opening("add")]
    assert call_opening("add") == '<tool_call>\n{"name": "add", "arguments": ' and CALL_CLOSING == "}\n</tool_call>"
    assert [t["content"]["grammar"] for t in req["tags"]] == args and req["separator"] == ""
    auto = structural_tag(tool_format("auto", parallel=False), args)["format"]
    assert auto["type"] == "triggered_tags" and auto["triggers"] == ["<tool_call>"] and auto["stop_after_first"]
    with pytest.raises(ValueError):
        structural_tag(tool_format("sometimes"), args)
    with pytest.raises(ValueError):
        structural_tag(tool_format(), args[:1])


# -- compiled grammars (tokenizer only) ----------------------------------------------------------


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return GrammarCache(tokenizer, V, [EOS])


def accepts(grammars, tokenizer, fmt: ResponseFormat, text: str) -> bool:
    """Whether the grammar of ``fmt`` takes ``text`` as a whole reply (its tokens, then EOS)."""
    g = RequestGrammar(grammars.compile(fmt))
    return g.advance(tokenizer.encode(text, add_special_tokens=False)) and g.advance([EOS]) and g.terminated


def test_grammars_accept_the_rendered_calls_and_nothing_else(grammars, tokenizer):
    weather = call_text("get_weather", {"city": "Paris", "unit": "celsius"})
    add = call_text("add", {"a": 2, "b": 3})
    req, one, auto = tool_format("required"), tool_format("required", parallel=False), tool_format("auto")
    assert accepts(grammars, tokenizer, req, weather)
    assert accepts(grammars, tokenizer, req, weather + add)  # parallel calls, back to back
    assert not accepts(grammars, tokenizer, req, weather + "\n" + add)
    assert not accepts(grammars, tokenizer, one, weather + add)
    assert accepts(grammars, tokenizer, one, add)
    assert not accepts(grammars, tokenizer, req, "Sure! " + weather)  # required: calls only
    assert not accepts(grammars, tokenizer, req, "")
    assert not accepts(grammars, tokenizer, req, call_text("get_time", {}))  # unknown tool
    assert not accepts(grammars, tokenizer, req, call_text("add", {"a": 2}))  # a required argument missing
    assert not accepts(grammars, tokenizer, req, call_text("add", {"a": 2, "b": 3, "c": 4}))  # undeclared
    assert not accepts(grammars, tokenizer, req, call_text("get_weather", {"city": "Paris", "unit": "kelvin"}))
    assert not accepts(grammars, tokenizer, req, '<tool_call>\n{"name": "add", "arguments": {"a":2,"b":3}}\n'
                                                 "</tool_call>")  # whitespace as the grammar writes it only
    assert accepts(grammars, tokenizer, auto, "It is sunny.")  # auto: text, calls, or both
    assert accepts(grammars, tokenizer, auto, "Let me check.\n" + weather + "\nDone.")
    assert not accepts(grammars, tokenizer, auto, "Let me check.\n" + call_text("get_time", {}))
    named = tool_format("required", tools=[ADD])  # a named choice: required with its one tool
    assert accepts(grammars, tokenizer, named, add) and not accepts(grammars, tokenizer, named, weather)
    none = tool_format("required", tools=[{"type": "function", "function": {"name": "ping"}}])
    assert accepts(grammars, tokenizer, none, call_text("ping", {}))
    assert not accepts(grammars, tokenizer, none, call_text("ping", {"x": 1}))  # no parameters: {}


def test_refusals_name_the_tool(grammars):
    bad = {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}
    with pytest.raises(GrammarError) as e:
        grammars.compile(tool_format(tools=[WEATHER, bad]))
    assert (e.value.tool, e.value.param, e.value.code) == (1, "properties.tags.uniqueItems", "unsupported_schema_keyword")
    typo = {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}
    for _ in range(2):  # the second from the cache
        with pytest.raises(GrammarError) as e:
            grammars.compile(tool_format("auto", tools=[typo, WEATHER]))
        assert (e.value.tool, e.value.code) == (0, "invalid_schema") and "strin" in e.value.message
    with pytest.raises(GrammarError) as e:
        grammars.compile(ResponseFormat("tool_calls"))
    assert e.value.code == "invalid_schema" and e.value.tool is None


def test_auto_with_a_json_reply_format_is_that_json_or_calls(grammars, tokenizer):
    """OpenAI's ``tools`` + ``response_format``: under ``auto`` the reply is an instance of the
    format or calls, never free text; the reply format is part of the cache key; a bad reply
    schema is refused as the reply's (``in_reply``)."""
    answer = {"type": "object", "properties": {"city": {"type": "string"}, "temp_c": {"type": "integer"}},
              "required": ["city", "temp_c"], "additionalProperties": False}
    reply = ResponseFormat("json_schema", schema=answer, strict=True)
    both = ResponseFormat("tool_calls", tools=schemas(*TOOLS), tool_choice="auto", reply=reply)
    weather = call_text("get_weather", {"city": "Paris", "unit": "celsius"})
    assert accepts(grammars, tokenizer, both, json.dumps({"city": "Paris", "temp_c": 21}))
    assert accepts(grammars, tokenizer, both, weather)
    assert accepts(grammars, tokenizer, both, weather + call_text("add", {"a": 1, "b": 2}))
    assert not accepts(grammars, tokenizer, both, "It is sunny.")  # free text: no longer allowed
    assert not accepts(grammars, tokenizer, both, json.dumps({"city": "Paris"}))  # the reply schema holds
    assert not accepts(grammars, tokenizer, both, json.dumps({"city": "Paris", "temp_c": 21}) + weather)
    assert accepts(grammars, tokenizer, tool_format("auto"), "It is sunny.")  # cached apart from plain auto
    obj = ResponseFormat("tool_calls", tools=schemas(*TOOLS), tool_choice="auto", reply=ResponseFormat("json_object"))
    assert accepts(grammars, tokenizer, obj, json.dumps({"anything": [1, 2]}))
    assert not accepts(grammars, tokenizer, obj, "[1]")
    bad = ResponseFormat("json_schema", schema={"type": "object", "properties": {"t": {"type": "array",
                                                                                        "uniqueItems": True}}})
    with pytest.raises(GrammarError) as e:
        grammars.compile(ResponseFormat("tool_calls", tools=schemas(*TOOLS), tool_choice="auto", reply=bad))
    assert (e.value.in_reply, e.value.tool, e.value.param) == (True, None, "properties.t.uniqueItems")
    with pytest.raises(GrammarError) as e:  # a reply format only goes with auto
        grammars.compile(ResponseFormat("tool_calls", tools=schemas(*TOOLS), tool_choice="required", reply=reply))
    assert e.value.in_reply and e.value.code == "invalid_schema"


# -- the engine: lossless at T = 0 ---------------------------------------------------------------


def test_t0_tool_calls_under_speculation_equal_plain_decoding(target_gguf, tokenizer, gguf_kernel):
    """Required (two tools), named, single-call and auto requests with a free-text one in one
    batch, T = 0: hybrid speculation emits exactly the tokens of plain decoding, and every
    constrained reply that stopped parses into calls whose arguments validate."""
    sp = SamplingParams(temperature=0.0, max_tokens=48)
    weather_q = tool_prompt(tokenizer, "What is the weather in Paris?")
    add_q = tool_prompt(tokenizer, "What is 17 plus 25?")
    reqs = [("required", weather_q, sp, tool_format("required")),
            ("named", add_q, sp, tool_format("required", tools=[ADD])),
            ("single", add_q, sp, tool_format("required", parallel=False)),
            ("auto", weather_q, sp, tool_format("auto")),
            ("plain", "Name three colors.", sp, None)]
    _, plain = run_engine(target_gguf, tokenizer, reqs)
    engine, spec = run_engine(target_gguf, tokenizer, reqs, spec_method="hybrid", spec_policy="dspark-sla",
                              num_speculative_tokens=3, spec_gate=False)
    assert {k: v[1] for k, v in spec.items()} == {k: v[1] for k, v in plain.items()}
    drafted = sum(v[2].spec.drafted for k, v in spec.items() if k != "plain")
    accepted = sum(v[2].spec.accepted for k, v in spec.items() if k != "plain")
    assert drafted > accepted > 10, (drafted, accepted)
    for k in ("required", "named", "single"):
        text, _, fin = plain[k]
        assert fin.finish_reason.value == "stop", (k, text)
        content, calls = parse_tool_calls(text)
        assert content == "" and calls, (k, text)
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        if k == "named":
            assert {c.name for c in calls} == {"add"}
        if k == "single":
            assert len(calls) == 1
    print({k: v[0] for k, v in plain.items()})
