"""``Formatter.delta_sse``, the streaming hot path: the bytes of a step's chunks are exactly
:func:`sse` of :meth:`delta`'s chunks, whether they come from the chunk template (plain text
steps) or from the models (tool parsing, logprobs)."""

from __future__ import annotations

import json

import pytest

from gateway.openai.formatters import ChatFormatter, CompletionFormatter, sse
from gateway.openai.logprobs import LogprobsBuilder
from runtime.interface import TokenLogprob

TEXTS = ["Hello", " world", "", 'quote " and \\ backslash', "line\nbreak\ttab", "é ü 中文 😀", "\u2028\u2029",
         "\x00\x1f control", "x" * 3000]
MODEL = 'odd "model" é'


def slow(fmt, text: str, logprobs=None) -> bytes:
    return b"".join(sse(p) for p in fmt.delta(text, logprobs))


@pytest.mark.parametrize("make", [
    lambda: ChatFormatter(MODEL, 7, False),
    lambda: CompletionFormatter(MODEL, 7, False),
    lambda: ChatFormatter(MODEL, 7, True),
])
def test_plain_steps_are_byte_identical_to_the_models(make):
    fmt = make()
    assert fmt.plain()
    for text in TEXTS:
        data = fmt.delta_sse(text)
        assert data == slow(fmt, text)
        event = json.loads(data[len(b"data: "):-2])
        content = event["choices"][0].get("text", event["choices"][0].get("delta", {}).get("content"))
        assert content == text and event["id"] == fmt.id and event["model"] == MODEL


def test_tool_parsing_and_logprobs_steps_take_the_models():
    tools = ChatFormatter(MODEL, 7, False, tool_calls=True)
    assert not tools.plain()
    made: list[dict] = []
    delta = tools.delta
    tools.delta = lambda *a: made.extend(out := delta(*a)) or out  # what the models made, per step
    steps = []
    for text in ["Sure. ", "<tool_call>\n", '{"name": "f", "arguments": {"a": 1}}', "\n</tool_call>"]:
        made.clear()
        steps.append(tools.delta_sse(text))
        assert steps[-1] == b"".join(sse(p) for p in made)
    assert steps[1] == b"" and b'"name":"f"' in steps[2]  # "<tool_call>" alone decides nothing yet
    pieces = [b"He", b"llo"]
    lp = ChatFormatter(MODEL, 7, False, LogprobsBuilder(lambda ids: [pieces[i] for i in ids], 1))
    assert not lp.plain()
    entries = [TokenLogprob(0, -0.25, [(0, -0.25)]), TokenLogprob(1, -1.5, [(0, -0.75)])]
    data = lp.delta_sse("Hello", entries)
    assert data == slow(lp, "Hello", entries)
    assert json.loads(data[6:-2])["choices"][0]["logprobs"]["content"][1]["logprob"] == -1.5
