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
here without importing xgrammar; :class:`~runtime.engine.grammar.GrammarCache` compiles it
with each tool's arguments as an EBNF grammar it compiled itself, and the SGLang backend
(:mod:`runtime.sglang.client`) sends it as ``sampling_params.structural_tag`` with each tool's
arguments as a ``json_schema`` content (:func:`json_schema_contents`), which SGLang's xgrammar
backend compiles (SGLang 0.5.23 ``srt/constrained/xgrammar_backend.py``
``dispatch_structural_tag``: a non-legacy tag is compiled as given).
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


def json_schema_contents(fmt: ResponseFormat) -> list[dict]:
    """Per tool of ``fmt.tools``: its arguments as a structural-tag ``json_schema`` content
    (``{"type": "json_schema", "json_schema": <its parameters>}``), for :func:`structural_tag`."""
    return [{"type": "json_schema", "json_schema": parameters(t)} for t in fmt.tools]


def reply_content(fmt: ResponseFormat) -> dict | None:
    """``fmt.reply`` as a structural-tag ``json_schema`` content (``json_object``: any object),
    for :func:`structural_tag`; ``None`` without a reply format."""
    if fmt.reply is None:
        return None
    schema = fmt.reply.schema if fmt.reply.type == "json_schema" and fmt.reply.schema is not None else {"type": "object"}
    return {"type": "json_schema", "json_schema": schema}


def structural_tag(fmt: ResponseFormat, arguments: Sequence[str | dict], reply: str | dict | None = None) -> dict:
    """xgrammar's structural tag (as JSON) of a ``"tool_calls"`` format (module docstring).

    Args:
        fmt: ``type == "tool_calls"``, ≥ 1 tool, ``tool_choice`` ``"auto"`` or ``"required"``.
        arguments: per tool of ``fmt.tools``, what its arguments are: the EBNF grammar (a
            string, root rule ``root``) of the JSON instances of its :func:`parameters`, or a
            structural-tag content format (a dict, :func:`json_schema_contents`).
        reply: ``auto`` only: the reply when it is not a call (the request's JSON
            ``response_format``), as an EBNF grammar or a content format (:func:`reply_content`):
            the reply is then either that JSON or one or more calls, never text around a call.
            ``None`` → free text with calls.

    Raises:
        ValueError: no tools, a grammar count other than the tools', or an unknown ``tool_choice``.
    """
    if not fmt.tools or len(arguments) != len(fmt.tools):
        raise ValueError(f"{len(fmt.tools)} tools and {len(arguments)} argument grammars")
    tags = [{"type": "tag", "begin": call_opening(t.name),
             "content": {"type": "grammar", "grammar": arg} if isinstance(arg, str) else arg,
             "end": CALL_CLOSING} for t, arg in zip(fmt.tools, arguments)]
    once = not fmt.parallel_tool_calls
    if fmt.tool_choice == "required":
        body = {"type": "tags_with_separator", "tags": tags, "separator": SEPARATOR, "at_least_one": True,
                "stop_after_first": once}
    elif fmt.tool_choice == "auto" and reply is not None:
        calls = {"type": "tags_with_separator", "tags": tags, "separator": SEPARATOR, "at_least_one": True,
                 "stop_after_first": once}
        answer = {"type": "grammar", "grammar": reply} if isinstance(reply, str) else reply
        body = {"type": "or", "elements": [answer, calls]}
    elif fmt.tool_choice == "auto":
        body = {"type": "triggered_tags", "triggers": [TOOL_CALL_OPEN], "tags": tags, "stop_after_first": once}
    else:
        raise ValueError(f"unknown tool_choice {fmt.tool_choice!r}")
    return {"type": "structural_tag", "format": body}
