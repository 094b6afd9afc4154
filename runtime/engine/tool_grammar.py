"""The grammar of a ``"tool_calls"`` response format: Hermes-style calls as an xgrammar structural tag.

A call is ``<tool_call>\\n{"name": "<name>", "arguments": <arguments>}\\n</tool_call>``
(:data:`runtime.interface.TOOL_CALL_OPEN`; the format of NousResearch's Hermes 2 Pro and
Qwen2.5 templates), where ``<arguments>`` is an instance of that tool's ``parameters``
schema, generated with the same JSON grammar as ``response_format`` (compact whitespace,
strict: no undeclared properties; :meth:`runtime.engine.grammar.GrammarCache`). One tag per
tool, its name fixed in the tag's opening text, so a call can only name a known tool.

* ``tool_choice="required"`` (named choices arrive here as ``required`` with one tool): the
  reply is one or more calls, back to back (:data:`SEPARATOR`), and nothing else (xgrammar
  ``tags_with_separator``, ``at_least_one``); exactly one without parallel tool calls.
* ``tool_choice="auto"``: free text; once the text contains ``<tool_call>`` (the trigger)
  it must continue as one of the tags, and after its ``</tool_call>`` free text resumes
  (xgrammar ``triggered_tags``); without parallel tool calls the reply ends after one call.
  With a JSON ``reply`` format (OpenAI's ``tools`` + ``response_format``), ``auto`` is instead
  either that JSON or calls as for ``required`` (xgrammar ``or``).

The structural tag is a plain JSON document (xgrammar's ``StructuralTag`` schema), built
here without importing xgrammar; :class:`~runtime.engine.grammar.GrammarCache` compiles it.
"""

from __future__ import annotations

import json
from typing import Sequence

from runtime.interface import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ResponseFormat, ToolSchema

#: The arguments of a tool without ``parameters``: OpenAI's "empty parameter list".
NO_PARAMETERS = {"type": "object", "properties": {}}
#: Between two parallel calls: nothing. With ``"\n"`` (Qwen2.5's) a small model that never saw
#: tools takes the newline after ``</tool_call>`` and is then held to a second call, most often a
#: repeat of the first; back to back, it chooses between another ``<tool_call>`` and EOS.
SEPARATOR = ""


def call_opening(name: str) -> str:
    """The fixed text before a call's arguments: ``<tool_call>\\n{"name": "<name>", "arguments": ``."""
    return f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '


#: The fixed text after a call's arguments.
CALL_CLOSING = "}\n" + TOOL_CALL_CLOSE


def parameters(tool: ToolSchema) -> dict:
    """The schema a tool's arguments are generated from."""
    return NO_PARAMETERS if tool.parameters is None else tool.parameters


def structural_tag(fmt: ResponseFormat, arguments: Sequence[str], reply: str | None = None) -> dict:
    """xgrammar's structural tag (as JSON) of a ``"tool_calls"`` format (module docstring).

    Args:
        fmt: ``type == "tool_calls"``, ≥ 1 tool, ``tool_choice`` ``"auto"`` or ``"required"``.
        arguments: per tool of ``fmt.tools``, the EBNF grammar (root rule ``root``) of the
            JSON instances of its :func:`parameters`.
        reply: ``auto`` only: the EBNF grammar of the reply when it is not a call (the
            request's JSON ``response_format``): the reply is then either that JSON or one or
            more calls, never text around a call. ``None`` → free text with calls.

    Raises:
        ValueError: no tools, a grammar count other than the tools', or an unknown ``tool_choice``.
    """
    if not fmt.tools or len(arguments) != len(fmt.tools):
        raise ValueError(f"{len(fmt.tools)} tools and {len(arguments)} argument grammars")
    tags = [{"type": "tag", "begin": call_opening(t.name), "content": {"type": "grammar", "grammar": ebnf},
             "end": CALL_CLOSING} for t, ebnf in zip(fmt.tools, arguments)]
    once = not fmt.parallel_tool_calls
    if fmt.tool_choice == "required":
        body = {"type": "tags_with_separator", "tags": tags, "separator": SEPARATOR, "at_least_one": True,
                "stop_after_first": once}
    elif fmt.tool_choice == "auto" and reply is not None:
        calls = {"type": "tags_with_separator", "tags": tags, "separator": SEPARATOR, "at_least_one": True,
                 "stop_after_first": once}
        body = {"type": "or", "elements": [{"type": "grammar", "grammar": reply}, calls]}
    elif fmt.tool_choice == "auto":
        body = {"type": "triggered_tags", "triggers": [TOOL_CALL_OPEN], "tags": tags, "stop_after_first": once}
    else:
        raise ValueError(f"unknown tool_choice {fmt.tool_choice!r}")
    return {"type": "structural_tag", "format": body}
