"""Tool calling on chat completions: ``tools``, ``tool_choice`` and ``parallel_tool_calls``
checked, the tools and the conversation's calls rendered into the prompt, and the runtime
format that constrains the reply (OpenAI API reference, Chat, "tools"; the reply is parsed
by :mod:`gateway.openai.tool_parser`).

**Rendering** (:func:`prompt_messages`). A model whose chat template has a tool section of
its own (:attr:`runtime.interface.BackendInfo.chat_template_tools`) gets the tools and the
conversation in Hugging Face's shape (:func:`assistant_message`, :func:`tool_message`, the
tools passed to ``apply_chat_template``). Others (SmolLM2's plain ChatML) get Hermes-style
text, as the NousResearch Hermes 2 Pro and Qwen2.5 templates write it (:func:`hermes_messages`):

* the tool definitions, one JSON object a line inside ``<tools></tools>``, with the
  instructions of :data:`TOOLS_PROMPT`, appended to the first system message (a system
  message of their own when there is none);
* an assistant message's calls as ``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>``,
  back to back, on the line after its text (the syntax the tool grammars generate, so the
  model sees its own calls);
* tool results as ``<tool_response>\\n…\\n</tool_response>`` in a user turn, consecutive
  results in one turn.

**Choices** (:func:`tool_plan`): ``none`` (or no tools) → tools are not rendered and the
reply is plain text; ``auto`` (the default with tools) → text or calls; ``required`` → one
or more calls; ``{"type": "function", "function": {"name": …}}`` → calls of that tool.
``parallel_tool_calls: false`` → at most one call. :func:`tool_format` turns a plan into the
runtime's ``"tool_calls"`` :class:`~runtime.interface.ResponseFormat`, whose grammar the
engine enforces (``auto`` too: free text, and each call once it opens is valid).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

from pydantic import ValidationError

from gateway.core.errors import from_validation_error, invalid_request, unsupported
from gateway.openai.generation import response_format_param
from gateway.openai.schemas import ChatCompletionRequest, FunctionTool, MessageToolCall, ToolList
from runtime.interface import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, BackendInfo, GrammarError, ResponseFormat, ToolSchema

#: Hermes 2 Pro / Qwen2.5's tool instructions; ``{tools}`` is one JSON definition a line.
TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolPlan:
    """What a request with tools asks for.

    Attributes:
        tools: the request's tools, all rendered into the prompt, in order.
        choice: ``"auto"``, ``"required"`` or ``"named"`` (``"none"`` has no plan).
        named: the function a named choice forces.
        parallel: ``parallel_tool_calls`` (default true).
    """

    tools: list[FunctionTool]
    choice: str
    named: str | None = None
    parallel: bool = True

    @property
    def callable(self) -> list[int]:
        """Indices (in :attr:`tools`) of the tools a call may name."""
        return [i for i, t in enumerate(self.tools) if self.named in (None, t.function.name)]


def tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    """The request's :class:`ToolPlan`; ``None`` when there are no tools or ``tool_choice`` is ``"none"``.

    Raises:
        APIError: 400 with ``param`` for a malformed tool (``tools[i].function.name`` for one
            without a name, ``tools[i].type`` for one that is not a function, …), a malformed
            ``tool_choice`` (``invalid_value``), one that needs tools when there are none or
            names a function that is not among them, and two tools with one name.
    """
    try:
        tools = [] if body.tools is None else ToolList.model_validate({"tools": body.tools}).tools
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    choice, named = body.tool_choice, None
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, dict):
        if choice.get("type") != "function":
            raise invalid_request("'tool_choice.type' must be 'function' (or tool_choice one of 'none', 'auto', "
                                  "'required').", "tool_choice.type", "invalid_value")
        function = choice.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid_request("'tool_choice.function.name' must be the name of one of the tools.",
                                  "tool_choice.function.name", "invalid_value")
        choice, named = "named", function["name"]
    elif choice not in CHOICES:
        raise invalid_request(f"Invalid value for 'tool_choice': {json.dumps(choice)}. Supported values are 'none', "
                              "'auto', 'required' and {\"type\": \"function\", \"function\": {\"name\": ...}}.",
                              "tool_choice", "invalid_value")
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        if tool.function.name in seen:
            raise invalid_request(f"Two tools are named '{tool.function.name}' (tools[{seen[tool.function.name]}] "
                                  f"and tools[{i}]).", f"tools[{i}].function.name", "invalid_value")
        seen[tool.function.name] = i
    if choice in ("required", "named") and not tools:
        raise invalid_request(f"tool_choice '{'required' if choice == 'required' else named}' needs 'tools'.",
                              "tool_choice", "invalid_value")
    if named is not None and named not in seen:
        raise invalid_request(f"tool_choice names the function '{named}', which is not among the tools "
                              f"({', '.join(sorted(seen))}).", "tool_choice", "invalid_value")
    if choice == "none" or not tools:
        return None
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    return ToolPlan(list(tools), choice, named, parallel)


def tool_format(plan: ToolPlan, info: BackendInfo, reply: ResponseFormat | None = None) -> ResponseFormat | None:
    """The runtime format of ``plan``: a ``"tool_calls"`` grammar over the callable tools
    (``auto`` or ``required``, a named choice is ``required`` with its one tool). A backend
    that cannot constrain its output gets ``None`` for ``auto`` (its reply is only parsed).

    ``reply`` is the request's JSON ``response_format`` (OpenAI: with tools, the model either
    calls them or answers in that format): under ``auto`` a reply that is not a call follows
    it; ``required`` and named choices call a tool, so it has no effect there.

    Raises:
        APIError: 400 ``unsupported_parameter`` (``tool_choice``) for ``required`` or a named
            choice on a backend without grammars.
    """
    if not info.supports_response_format:
        if plan.choice != "auto":
            raise unsupported("tool_choice", "This backend cannot constrain its output to tool calls; use 'auto'.")
        return None
    tools = tuple(ToolSchema(plan.tools[i].function.name, plan.tools[i].function.parameters) for i in plan.callable)
    auto = plan.choice == "auto"
    return ResponseFormat("tool_calls", tools=tools, tool_choice="auto" if auto else "required",
                          parallel_tool_calls=plan.parallel, reply=reply if auto else None)


def grammar_param(plan: ToolPlan) -> Callable[[GrammarError], str]:
    """Where a refused tool format points in the request: ``tools[i].function.parameters``
    (``.<path to the keyword>``) for the tool at fault, ``response_format…`` for its reply
    format, ``tools`` for the format as a whole."""
    callable_ = plan.callable

    def param(exc: GrammarError) -> str:
        if exc.in_reply:
            return response_format_param(exc)
        if exc.tool is None:
            return "tools"
        base = f"tools[{callable_[exc.tool]}].function.parameters"
        return f"{base}.{exc.param}" if exc.param else base

    return param


# -- rendering --------------------------------------------------------------------------------


def definition(tool: FunctionTool) -> dict:
    """``{"type": "function", "function": {"name", "description"?, "parameters"?}}``."""
    fn = {"name": tool.function.name}
    if tool.function.description is not None:
        fn["description"] = tool.function.description
    if tool.function.parameters is not None:
        fn["parameters"] = tool.function.parameters
    return {"type": "function", "function": fn}


def _arguments(text: str):
    """A call's ``arguments`` text as a JSON value (the text itself when it is not JSON)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def call_names(messages) -> dict[str, str]:
    """``{tool_call_id: function name}`` of the conversation's calls, checking that every
    ``role: "tool"`` message answers an earlier call.

    Raises:
        APIError: 400 ``messages[i].tool_call_id`` for a tool message without one or with an
            id no earlier assistant message called; ``messages[i].tool_calls`` on a
            non-assistant message.
    """
    names: dict[str, str] = {}
    for i, msg in enumerate(messages):
        if msg.tool_calls and msg.role != "assistant":
            raise invalid_request(f"Only assistant messages may have 'tool_calls', not role '{msg.role}'.",
                                  f"messages[{i}].tool_calls", "invalid_value")
        for call in msg.tool_calls or []:
            names[call.id] = call.function.name
        if msg.role == "tool":
            if not msg.tool_call_id:
                raise invalid_request(f"messages[{i}] has role 'tool' but no 'tool_call_id'.",
                                      f"messages[{i}].tool_call_id", "missing_required_parameter")
            if msg.tool_call_id not in names:
                raise invalid_request(f"messages[{i}].tool_call_id '{msg.tool_call_id}' does not answer any tool call "
                                      "of an earlier assistant message.", f"messages[{i}].tool_call_id",
                                      "invalid_value")
    return names


def assistant_message(text: str, calls: list[MessageToolCall]) -> dict:
    """An assistant turn with calls, in Hugging Face's shape (``arguments`` as JSON values)."""
    return {"role": "assistant", "content": text,
            "tool_calls": [{"id": c.id, "type": "function",
                            "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                           for c in calls]}


def tool_message(text: str, call_id: str, name: str) -> dict:
    """A tool result in Hugging Face's shape."""
    return {"role": "tool", "content": text, "tool_call_id": call_id, "name": name}


def call_text(name: str, arguments) -> str:
    """One call as the model writes it: ``<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>``
    (compact JSON, as the grammar generates it)."""
    return (f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, '
            f'"arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n{TOOL_CALL_CLOSE}')


def hermes_messages(messages: list[dict], plan: ToolPlan | None) -> list[dict]:
    """Hugging Face-shaped messages (:func:`assistant_message`, :func:`tool_message`, plain
    ``{"role", "content"}``) → plain ``{"role", "content"}`` ChatML turns with Hermes-style
    tools, calls and results (module docstring). Without a plan the tools are not listed."""
    out: list[dict] = []
    previous_tool = False
    for msg in messages:
        if msg["role"] == "tool":
            block = f"<tool_response>\n{msg['content']}\n</tool_response>"
            if previous_tool:
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block})
            previous_tool = True
            continue
        previous_tool = False
        if msg.get("tool_calls"):
            calls = "".join(call_text(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"])
            out.append({"role": "assistant", "content": f"{msg['content']}\n{calls}" if msg["content"] else calls})
        else:
            out.append({"role": msg["role"], "content": msg["content"]})
    if plan is not None:
        listing = TOOLS_PROMPT.format(tools="\n".join(json.dumps(definition(t), ensure_ascii=False)
                                                      for t in plan.tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{listing}" if out[0]["content"]
                      else listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def prompt_messages(messages: list[dict], plan: ToolPlan | None, info: BackendInfo) -> tuple[list[dict], list | None]:
    """``(messages, tools)`` for :meth:`Backend.apply_chat_template`: the model's own tool
    section when its template has one (``tools`` = the definitions, or ``None`` without a
    plan), else Hermes-style text (:func:`hermes_messages`) and ``tools`` ``None``."""
    if info.chat_template_tools:
        return messages, [definition(t) for t in plan.tools] if plan is not None else None
    return hermes_messages(messages, plan), None
