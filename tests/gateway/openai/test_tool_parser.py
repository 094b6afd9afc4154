"""The Hermes tool-call parser (gateway/openai/tool_parser.py): whole replies, and the same
replies fed in every split — tags, names and string escapes cut across pieces — giving the
same content and calls, with no tag ever in the content."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from gateway.openai.formatters import tool_deltas
from gateway.openai.tool_parser import ToolCallParser, parse_tool_calls
from gateway.openai.tools import call_text

WEATHER = call_text("get_weather", {"city": "Paris", "unit": "celsius"})
ADD = call_text("add", {"a": 2, "b": 3})
TRICKY = call_text("search", {"q": 'a}b"</tool_call><tool_call>\\', "n": [1, {"x": []}]})


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def parsed(text: str):
    content, calls = parse_tool_calls(text, ids())
    return content, [(c.id, c.name, c.arguments) for c in calls]


def streamed(pieces: list[str]):
    """Feed ``pieces``; (content, calls, the parser's pieces) as a streaming client sees them."""
    parser = ToolCallParser(ids())
    out = []
    for p in pieces:
        out += parser.feed(p)
    out += parser.finish()
    content = "".join(p.text for p in out if p.kind == "content")
    calls = {}
    for p in out:
        if p.kind == "call":
            assert p.index == len(calls)
            calls[p.index] = [p.id, p.name, ""]
        elif p.kind == "arguments":
            calls[p.index][2] += p.text
    return content, [tuple(c) for c in calls.values()], out


CASES = [
    # (reply, content, [(name, arguments)])
    (WEATHER, "", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    (WEATHER + "\n" + ADD, "", [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("add", '{"a": 2, "b": 3}')]),
    ("Let me check.\n" + WEATHER, "Let me check.", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("Checking.\n" + ADD + "\n\nIt is 5.", "Checking.\n\nIt is 5.", [("add", '{"a": 2, "b": 3}')]),
    (ADD + "\nIt is 5. ", "It is 5.", [("add", '{"a": 2, "b": 3}')]),
    (TRICKY, "", [("search", json.dumps({"q": 'a}b"</tool_call><tool_call>\\', "n": [1, {"x": []}]}))]),
    ("  Plain text, no call: x < y and <b>bold</b> <tool\n", "  Plain text, no call: x < y and <b>bold</b> <tool\n", []),
    ("Cut <tool_c", "Cut <tool_c", []),  # a prefix at the very end is text
    ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', "", [("f", '{"a": 1}')]),  # other key order
    ('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', "", [("f", '"{\\"a\\": 1}"')]),
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),  # not a call: text
    ('Hi <tool_call>\n{"na', "Hi", []),  # cut before the name: dropped
    ('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b', "", [("add", '{"a": 2, "b')]),  # cut in the arguments
    ('<tool_call>\n{"name": "add", "arguments": {"a": 2</tool_call>ok', "ok", [("add", '{"a": 2')]),  # never closed
]


@pytest.mark.parametrize("reply,content,calls", CASES, ids=[str(i) for i in range(len(CASES))])
def test_whole_and_streamed_in_every_split(reply, content, calls):
    want = (content, [(f"call_{i}", n, a) for i, (n, a) in enumerate(calls)])
    assert parsed(reply) == want
    rng = random.Random(0)
    splits = [[reply[:k], reply[k:]] for k in range(len(reply) + 1)]  # every cut point
    splits.append(list(reply))  # one character at a time
    splits += [[reply[i:j] for i, j in itertools.pairwise([0, *sorted(rng.sample(range(len(reply) + 1), 6)),
                                                           len(reply)])] for _ in range(20)]
    for pieces in splits:
        got_content, got_calls, out = streamed(pieces)
        assert (got_content, got_calls) == want, pieces
        if calls:  # no tag, and no whitespace next to a call, ever streamed as content
            assert not any("tool_call" in p.text for p in out if p.kind == "content"), pieces


def test_content_is_released_as_soon_as_it_is_decided():
    parser = ToolCallParser(ids())
    assert [(p.kind, p.text) for p in parser.feed("Let me check <tool")] == [("content", "Let me check")]
    assert parser.feed("_ca") == []  # still a prefix of <tool_call>
    assert [p.text for p in parser.feed("t is here.")] == [" <tool_cat is here."]  # not a tag after all
    assert [(p.kind, p.name) for p in parser.feed('\n<tool_call>\n{"name": "add", "arguments": ')] == [("call", "add")]
    assert [(p.kind, p.text) for p in parser.feed('{"a": 2,')] == [("arguments", '{"a": 2,')]
    assert [p.text for p in parser.feed(' "b": 3}}\n</tool_call>')] == [' "b": 3}']
    assert parser.finish() == []


def test_deltas_are_openai_shaped():
    """A call's first delta: index, id, type, name and arguments ""; then argument fragments;
    content runs joined."""
    parser = ToolCallParser(ids())
    pieces = parser.feed("Sure. <tool_call>\n" + '{"name": "add", "arguments": {"a": 2') + parser.feed(", \"b\": 3}}")
    pieces += parser.feed("\n</tool_call>\n" + WEATHER[:WEATHER.index("Paris") + 2]) + parser.finish()
    assert tool_deltas(pieces) == [
        {"content": "Sure."},
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function", "function": {"name": "add", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 2, "b": 3}'}}]},
        {"tool_calls": [{"index": 1, "id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 1, "function": {"arguments": '{"city": "Pa'}}]},
    ]
