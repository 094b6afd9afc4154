"""A Responses API request as the chat request the rest of the gateway serves.

``POST /v1/responses`` runs the chat path (:mod:`gateway.api.routes.chat`'s steps): this
module turns its body (and a stored conversation it continues) into a
:class:`~gateway.openai.schemas.ChatCompletionRequest`, so tools, formats, admission, limits,
records and metrics are chat's. Pure: no I/O; 400s as :class:`~gateway.core.errors.APIError`.

* :func:`check_parameters`: the parameters OpenAI defines whose values this server cannot
  honour (README, "Responses API": background, truncation "auto", reasoning effort,
  logprobs, other service tiers, saved prompts, conversations …) → 400 naming them.
* :func:`conversation_items`: the input as normalised items (stored with the response):
  ``{"type": "message", "role", "content": str}``, ``{"type": "function_call", "call_id",
  "name", "arguments"}``, ``{"type": "function_call_output", "call_id", "output": str}``;
  content parts are joined. :func:`check_call_outputs`: every ``function_call_output``
  answers an earlier call (in this input or the conversation it continues).
* :func:`chat_request`: instructions (a system message first; a previous response's
  instructions are not carried over, as OpenAI), the items as chat messages (an assistant
  message followed by calls: one assistant message with ``tool_calls``; a call output: a
  ``tool`` message), tools in chat's nested shape, ``tool_choice`` and ``text.format`` as
  ``response_format``.
* :func:`responses_param`: a chat ``param`` (``tools[1].function.parameters…``,
  ``response_format.json_schema.schema…``) as the Responses request spells it.

Source: OpenAI API reference, "Responses" (create; input items; function calling guide).
"""

from __future__ import annotations

import json
import re

from pydantic import TypeAdapter, ValidationError

from gateway.core.errors import from_validation_error, invalid_request, unsupported
from gateway.openai.responses_schemas import (
    ContentPart, FunctionCallItem, FunctionCallOutputItem, FunctionToolSpec, InputItem, MessageItem,
    ResponsesRequest, ResponsesToolList, TextFormatJSONObject, TextFormatJSONSchema,
)
from gateway.openai.schemas import ChatCompletionRequest, ChatMessage, MessageToolCall, ToolCallFunction

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
# `include` values that only add data to item types this server never produces: accepted, no effect
INERT_INCLUDES = frozenset({
    "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
    "web_search_call.action.sources", "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
})
ACCEPTED_SERVICE_TIERS = ("auto", "default")
_ITEMS = TypeAdapter(list[InputItem])


def check_parameters(body: ResponsesRequest) -> None:
    """400 (``unsupported_parameter``, ``param`` = the field) for a value this server would
    have to ignore while it changes what OpenAI returns (README's Responses parameter table);
    neutral values (``background: false``, ``truncation: "disabled"``, …) pass."""
    if body.background:
        raise unsupported("background", "Background responses are not supported; send background: false.")
    if body.truncation not in (None, "disabled"):
        raise unsupported("truncation", "Only truncation 'disabled' is supported: an input longer than the "
                                        "context is a 400.")
    for key in ("effort", "summary", "generate_summary"):
        value = (body.reasoning or {}).get(key)
        if value is not None and not (key == "effort" and value == "none"):
            raise unsupported(f"reasoning.{key}", "This model does not reason.")
    for i, item in enumerate(body.include or []):
        if item == "message.output_text.logprobs":
            raise unsupported(f"include[{i}]", "Logprobs are not available on /v1/responses; use chat completions.")
        if item not in INERT_INCLUDES:
            raise invalid_request(f"Invalid value for 'include[{i}]': {json.dumps(item)}.", f"include[{i}]",
                                  "invalid_value")
    if body.top_logprobs:
        raise unsupported("top_logprobs", "Logprobs are not available on /v1/responses; use chat completions.")
    if body.service_tier not in (None, *ACCEPTED_SERVICE_TIERS):
        raise unsupported("service_tier", "The SLA tier of the key's tenant decides scheduling; send 'auto' or "
                                          "'default'.")
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        raise unsupported("text.verbosity", "Only 'medium' is supported.")
    for name in ("prompt", "conversation", "context_management"):
        if getattr(body, name) not in (None, [], {}):
            raise unsupported(name)


# -- input items ----------------------------------------------------------------------------


def part_text(parts: str | list[ContentPart], param: str) -> str:
    """A message's ``content`` (or a call output's ``output``) as one string: text parts
    joined; 400 ``unsupported_parameter`` (``<param>[j].type``) for any other part."""
    if isinstance(parts, str):
        return parts
    texts = []
    for j, part in enumerate(parts):
        if part.type not in TEXT_PARTS or part.text is None:
            raise unsupported(f"{param}[{j}].type", f"Only text content parts are supported, got '{part.type}'.")
        texts.append(part.text)
    return "".join(texts)


def _normalise(item, i: int) -> dict:
    where = f"input[{i}]"
    if isinstance(item, MessageItem):
        if item.role not in ROLES:
            raise invalid_request(f"Invalid value for '{where}.role': '{item.role}'. Supported values are: 'user', "
                                  "'system', 'developer' and 'assistant'.", f"{where}.role", "invalid_value")
        return {"type": "message", "role": item.role, "content": part_text(item.content, f"{where}.content")}
    if isinstance(item, FunctionCallItem):
        return {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments}
    if isinstance(item, FunctionCallOutputItem):
        return {"type": "function_call_output", "call_id": item.call_id,
                "output": part_text(item.output, f"{where}.output")}
    raise unsupported(f"{where}.type", f"Input items of type '{item.type}' are not supported; send messages, "
                                       "function_call and function_call_output items.")


def stored_items(items: list[dict]) -> list[dict]:
    """Items read back from a stored response (its conversation, or its output items) in
    normalised form (the output's ids and statuses dropped)."""
    return [_normalise(item, i) for i, item in enumerate(_ITEMS.validate_python(items))]


def conversation_items(body: ResponsesRequest, previous: list[dict]) -> list[dict]:
    """``previous`` (normalised items of the conversation continued, ``[]`` for none) followed by
    this request's input, normalised (module docstring).

    Raises:
        APIError: 400 naming the item: a role other than user/system/developer/assistant
            (``input[i].role``), a part that is not text (``input[i].content[j].type``), an
            item of another type (``input[i].type``), an empty conversation (``input``).
    """
    raw = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    items = [*previous, *(_normalise(item, i) for i, item in enumerate(raw))]
    if not items:
        raise invalid_request("The input must not be empty.", "input", "invalid_value")
    return items


def check_call_outputs(items: list[dict], first_input: int) -> None:
    """Every ``function_call_output`` must answer an earlier ``function_call`` (same
    ``call_id``) of the conversation; ``items[first_input:]`` are the request's input.

    Raises:
        APIError: 400 ``invalid_value`` (``input[i].call_id``) for one that answers no call.
    """
    calls: set[str] = set()
    for k, item in enumerate(items):
        if item["type"] == "function_call":
            calls.add(item["call_id"])
        elif item["type"] == "function_call_output" and item["call_id"] not in calls:
            raise invalid_request(f"No tool call found for function call output with call_id '{item['call_id']}' "
                                  "(it must follow a function_call item with that call_id, in the input or the "
                                  "previous response).", f"input[{k - first_input}].call_id", "invalid_value")


def chat_messages(instructions: str | None, items: list[dict]) -> list[ChatMessage]:
    """The conversation as chat messages (module docstring); ``instructions`` first as a
    system message."""
    out: list[ChatMessage] = []
    if instructions:
        out.append(ChatMessage(role="system", content=instructions))
    for item in items:
        if item["type"] == "message":
            out.append(ChatMessage(role=item["role"], content=item["content"]))
        elif item["type"] == "function_call":
            call = MessageToolCall(id=item["call_id"],
                                   function=ToolCallFunction(name=item["name"], arguments=item["arguments"]))
            if out and out[-1].role == "assistant":
                out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
        else:
            out.append(ChatMessage(role="tool", tool_call_id=item["call_id"], content=item["output"]))
    return out


# -- tools, tool_choice, text.format ----------------------------------------------------------


def function_tools(tools) -> list[FunctionToolSpec]:
    """``tools`` checked in the Responses shape.

    Raises:
        APIError: 400 ``unsupported_parameter`` (``tools[i].type``) for a hosted tool
            (``web_search``, ``file_search``, ``mcp`` …), 400 naming the field for a
            malformed function tool (``tools[i].name`` for one without a valid name).
    """
    if tools is None:
        return []
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise unsupported(f"tools[{i}].type", f"Only function tools are supported, not '{kind}'.")
    try:
        return ResponsesToolList.model_validate({"tools": tools}).tools
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def chat_tool(tool: FunctionToolSpec) -> dict:
    """One Responses function tool in chat's nested shape."""
    fn = {"name": tool.name, "description": tool.description, "parameters": tool.parameters, "strict": tool.strict}
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


def chat_tool_choice(choice):
    """``tool_choice`` in chat's shape: the strings as they are, ``{"type": "function", "name"}``
    → ``{"type": "function", "function": {"name"}}`` (:func:`gateway.openai.tools.tool_plan`
    then checks it names a tool).

    Raises:
        APIError: 400 for another object (``allowed_tools``, hosted tools: unsupported,
            ``tool_choice.type``) or a function choice without a name (``tool_choice.name``).
    """
    if not isinstance(choice, dict):
        return choice
    kind = choice.get("type")
    if kind != "function":
        raise unsupported("tool_choice.type" if isinstance(kind, str) else "tool_choice",
                          "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}.")
    if not isinstance(choice.get("name"), str):
        raise invalid_request("'tool_choice.name' must be the name of one of the tools.", "tool_choice.name",
                              "invalid_value")
    return {"type": "function", "function": {"name": choice["name"]}}


def chat_response_format(body: ResponsesRequest) -> dict | None:
    """``text.format`` as chat's ``response_format`` (``None``: free text)."""
    fmt = body.text.format if body.text is not None else None
    if isinstance(fmt, TextFormatJSONObject):
        return {"type": "json_object"}
    if isinstance(fmt, TextFormatJSONSchema):
        spec = {"name": fmt.name, "description": fmt.description, "schema": fmt.schema_, "strict": fmt.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}
    return None


def chat_request(body: ResponsesRequest, items: list[dict], tools: list[FunctionToolSpec]) -> ChatCompletionRequest:
    """The chat request served for ``body`` over the conversation ``items``
    (:func:`conversation_items`) with its checked ``tools`` (:func:`function_tools`).

    Raises:
        APIError: 400 from :func:`chat_tool_choice`.
    """
    data = {
        "model": body.model,
        "messages": chat_messages(body.instructions, items),
        "stream": bool(body.stream),
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "user": body.user or body.safety_identifier,
        "tools": [chat_tool(t) for t in tools] or None,
        "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": chat_response_format(body),
        "return_spec_stats": body.return_spec_stats,
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in data.items() if v is not None})
    except ValidationError as exc:  # every field was checked in its Responses shape already
        raise from_validation_error(exc) from None


_TOOL_PARAM = re.compile(r"^tools\[(\d+)\]\.function(?=\.|$)")


def responses_param(param: str | None) -> str | None:
    """A chat ``param`` as the Responses request spells it: ``tools[i].function.X`` →
    ``tools[i].X``, ``tool_choice.function.name`` → ``tool_choice.name``,
    ``response_format.json_schema.X`` → ``text.format.X``, ``response_format`` → ``text.format``,
    ``messages…`` → ``input`` (where no item index is known)."""
    if param is None:
        return None
    param = _TOOL_PARAM.sub(r"tools[\1]", param)
    if param.startswith("tool_choice.function."):
        return "tool_choice." + param[len("tool_choice.function."):]
    if param.startswith("response_format.json_schema."):
        return "text.format." + param[len("response_format.json_schema."):]
    if param == "response_format" or param.startswith("response_format."):
        return "text.format" + param[len("response_format"):]
    if param == "messages" or param.startswith("messages["):
        return "input"
    if param == "max_tokens":
        return "max_output_tokens"
    return param
