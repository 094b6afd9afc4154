"""Pydantic models of an OpenAI Responses API request (``POST /v1/responses``).

Validated as strictly as the chat request (:mod:`gateway.openai.schemas`: no coercion,
unknown fields ignored, every string valid Unicode), so a malformed field is a 400 naming it
(``input[2].call_id``, ``text.format.name``). ``tools`` and ``tool_choice`` are loose here and
checked by :mod:`gateway.openai.responses_input`, so that a refused tool leaves a request
record as on chat. Parameters OpenAI defines whose values this server cannot honour are
declared loosely and refused there by name (README, "Responses API": the parameter table).
Source: OpenAI API reference, "Responses" → "Create a model response" and its input items.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from gateway.core.text import Label, Text
from gateway.openai.schemas import FiniteFloat, ToolName, _Request

MAX_METADATA = 16  # OpenAI: at most 16 pairs, keys ≤ 64 characters, values ≤ 512


class ContentPart(_Request):
    """One element of a list-valued message ``content`` or ``function_call_output.output``:
    ``input_text`` / ``output_text`` (a message given back) carry ``text``; any other type is
    refused by name (:func:`gateway.openai.responses_input.part_text`)."""

    type: Text
    text: Text | None = None


class MessageItem(_Request):
    """A message: ``{"role", "content"}`` (``type: "message"`` optional). ``id``, ``status`` and
    the annotations of an output message given back as input are ignored."""

    type: Literal["message"] | None = None
    role: Text
    content: Text | list[ContentPart]


class FunctionCallItem(_Request):
    """A call the model made (an output item given back as input)."""

    type: Literal["function_call"]
    call_id: Annotated[Text, Field(min_length=1)]
    name: Text
    arguments: Text


class FunctionCallOutputItem(_Request):
    """The result of the call ``call_id``."""

    type: Literal["function_call_output"]
    call_id: Annotated[Text, Field(min_length=1)]
    output: Text | list[ContentPart]


class OtherItem(_Request):
    """An input item of another type (``reasoning``, ``item_reference``, hosted tool calls…):
    refused by name (``input[i].type``)."""

    type: Text


_ITEM_TAGS = {"message": "Message", "function_call": "FunctionCall", "function_call_output": "FunctionCallOutput"}


def _item_tag(value: Any) -> str | None:
    """The member of :data:`InputItem` by ``type`` (none → a message). Capitalised tags, so
    error locations skip them (``input[0].role``)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if kind is None:
        return "Message"
    return _ITEM_TAGS.get(kind, "Other") if isinstance(kind, str) else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("Message")] | Annotated[FunctionCallItem, Tag("FunctionCall")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutput")] | Annotated[OtherItem, Tag("Other")],
    Discriminator(_item_tag, custom_error_type="invalid_value", custom_error_message="'type' must be a string"),
]


class FunctionToolSpec(_Request):
    """``tools[i]`` in the Responses' flat shape (``{"type": "function", "name", …}``). Which
    schema keywords ``parameters`` may use: :func:`runtime.engine.grammar.check_schema`."""

    type: Literal["function"]
    name: ToolName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolList(_Request):
    """``tools`` of a Responses request (at most 128, OpenAI's limit)."""

    tools: Annotated[list[FunctionToolSpec], Field(max_length=128)]


class TextFormatText(_Request):
    type: Literal["text"]


class TextFormatJSONObject(_Request):
    type: Literal["json_object"]


class TextFormatJSONSchema(_Request):
    """``text.format`` for Structured Outputs: the chat ``json_schema`` spec, flattened.
    ``schema`` left out → any JSON object (as chat answers it)."""

    type: Literal["json_schema"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


_FORMAT_TAGS = {"text": "Text", "json_object": "JSONObject", "json_schema": "JSONSchema"}


def _format_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _FORMAT_TAGS.get(kind) if isinstance(kind, str) else None


TextFormat = Annotated[
    Annotated[TextFormatText, Tag("Text")] | Annotated[TextFormatJSONObject, Tag("JSONObject")]
    | Annotated[TextFormatJSONSchema, Tag("JSONSchema")],
    Discriminator(_format_tag, custom_error_type="invalid_value",
                  custom_error_message="'type' must be one of 'text', 'json_object', 'json_schema'"),
]


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Text | None = None  # only "medium" (or none) is accepted


MetadataKey = Annotated[Label, Field(max_length=64)]
MetadataValue = Annotated[Label, Field(max_length=512)]


class ResponsesRequest(_Request):
    """``POST /v1/responses``. The sampling fields have the chat ranges; ``user``,
    ``previous_response_id``, ``safety_identifier`` and ``metadata`` are stored, so they are
    :data:`~gateway.core.text.Label` (no NUL, ≤ 256 characters; metadata values ≤ 512)."""

    model: Text
    input: Text | list[InputItem] = []
    instructions: Text | None = None
    tools: Any = None  # list of FunctionToolSpec: gateway.openai.responses_input.function_tools
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "name": ...}
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[FiniteFloat, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[FiniteFloat, Field(gt=0.0, le=1.0)] | None = None
    user: Label | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: nothing to obfuscate, ignored
    store: bool | None = None  # default true, as OpenAI
    previous_response_id: Label | None = None
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA)] | None = None
    safety_identifier: Label | None = None
    prompt_cache_key: Annotated[Label, Field(max_length=64)] | None = None
    service_tier: Text | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None  # built-in tools only: none here
    return_spec_stats: bool | None = False  # Sparkgate extension, as on chat
    # refused unless neutral (gateway.openai.responses_input.check_parameters):
    include: list[Text] | None = None
    truncation: Text | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    prompt: Any = None
    conversation: Any = None
    context_management: Any = None
