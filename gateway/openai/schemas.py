"""Pydantic models of the OpenAI chat-completions / completions wire format.

Requests are validated strictly (no ``"1"`` → ``1`` coercion, no bools as ints)
and unknown fields are ignored, because agent frameworks send extras. Parameters
that OpenAI defines but this server does not implement are declared as loose
``Any`` fields so :mod:`gateway.openai.translate` can reject them by name instead of
ignoring them; sampling fields carry their OpenAI (or vLLM) ranges, so an out-of-range
value is a 400 naming the field. Every string must be valid Unicode (:mod:`gateway.core.text`: a lone
surrogate is a 400 naming the field); ``user`` is stored, so it also may not hold NUL.
Source: OpenAI API reference, "Chat" and "Completions (legacy)".
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_serializer

from gateway.core.text import Label, Text

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
MAX_CHOICES = 8  # n: 1..8 (each choice is an engine request)
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_STOP_TOKEN_IDS = 64


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ContentPart(_Request):
    """One element of a list-valued message ``content``; only ``type: "text"`` is supported."""

    type: Text
    text: Text | None = None


ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]  # OpenAI's rule for function names


class ToolCallFunction(_Request):
    name: Text
    arguments: Text  # the JSON text of the arguments, as the model wrote it


class MessageToolCall(_Request):
    """One element of an assistant message's ``tool_calls`` (a call made earlier in the conversation)."""

    id: Text
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Request):
    role: Text
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    tool_call_id: Text | None = None  # tool messages: the call they answer
    function_call: Any = None  # deprecated by OpenAI: refused by name (gateway.openai.translate)


class FunctionDefinition(_Request):
    """``tools[i].function``. Which schema keywords ``parameters`` may use:
    :func:`runtime.engine.grammar.check_schema` (others → 400 naming the keyword)."""

    name: ToolName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class ToolList(_Request):
    """``tools`` of a chat request (at most 128, OpenAI's limit)."""

    tools: Annotated[list[FunctionTool], Field(max_length=128)]


class StreamOptions(_Request):
    include_usage: bool | None = None


class JSONSchemaSpec(_Request):
    """``response_format.json_schema`` (OpenAI "Structured Outputs"). ``schema`` left out →
    any JSON object (as ``json_object``). Which keywords the schema may use:
    :func:`runtime.engine.grammar.check_schema` (others → 400 naming the keyword)."""

    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormatText(_Request):
    type: Literal["text"]


class ResponseFormatJSONObject(_Request):
    type: Literal["json_object"]


class ResponseFormatJSONSchema(_Request):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


_FORMAT_TAGS = {"text": "Text", "json_object": "JSONObject", "json_schema": "JSONSchema"}


def _format_tag(value: Any) -> str | None:
    """The member of :data:`ResponseFormat` by ``type``. Capitalised tags: error locations skip
    them (``response_format.json_schema.name``, not ``response_format.json_schema.json_schema.name``)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _FORMAT_TAGS.get(kind) if isinstance(kind, str) else None


ResponseFormat = Annotated[
    Annotated[ResponseFormatText, Tag("Text")] | Annotated[ResponseFormatJSONObject, Tag("JSONObject")]
    | Annotated[ResponseFormatJSONSchema, Tag("JSONSchema")],
    Discriminator(_format_tag, custom_error_type="invalid_value",
                  custom_error_message="'type' must be one of 'text', 'json_object', 'json_schema'"),
]


class BaseCompletionRequest(_Request):
    """Fields shared by chat and legacy completions."""

    model: Text
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[FiniteFloat, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[FiniteFloat, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # vLLM extension
    stop: Text | Annotated[list[Text], Field(max_length=4)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None  # a 64-bit generator seed
    user: Label | None = None  # stored in request_records.user: no NUL, ≤ 256 characters
    ignore_eos: bool | None = False  # extension (benchmarks)
    return_spec_stats: bool | None = False  # Sparkgate extension
    cache_salt: Annotated[Text, Field(min_length=1, max_length=256)] | None = None  # vLLM extension
    # The sampling surface (README "Sampling parameters"; engine: runtime.engine.logits_processors)
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None  # independent choices: gateway.openai.choices
    presence_penalty: Annotated[FiniteFloat, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[FiniteFloat, Field(ge=-2.0, le=2.0)] | None = None
    # token id (a decimal string, checked against the vocabulary in translate) → bias
    logit_bias: Annotated[dict[str, Annotated[FiniteFloat, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    repetition_penalty: Annotated[FiniteFloat, Field(gt=0.0)] | None = None  # vLLM extension
    min_p: Annotated[FiniteFloat, Field(ge=0.0, le=1.0)] | None = None  # vLLM extension
    min_tokens: Annotated[int, Field(ge=0)] | None = None  # vLLM extension
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None  # vLLM


class ChatCompletionRequest(BaseCompletionRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    # validated by gateway.openai.tools (so that a refused tool leaves a request record):
    tools: Any = None  # list of FunctionTool (ToolList)
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    parallel_tool_calls: bool | None = None
    functions: Any = None
    function_call: Any = None
    # OpenAI output features this server does not have: accepted only when neutral (translate)
    modalities: Any = None  # ["text"] only
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    response_format: ResponseFormat | None = None
    # vLLM's structured outputs (gateway.openai.translate.vllm_format): JSON constraints served,
    # the others refused by name
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # needs logprobs: true


class CompletionRequest(BaseCompletionRequest):
    prompt: Text | Annotated[list[Text], Field(min_length=1, max_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # OpenAI's legacy default
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None  # top alternatives per token
    echo: Any = None
    suffix: Any = None
    best_of: Any = None


# ---------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from the prefix cache (not prefilled again)


class Usage(BaseModel):
    """``prompt_tokens_details`` is left out (not ``null``) when the backend does not
    report cached tokens."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _omit_unknown_details(self, handler):  # no return annotation: the JSON schema stays the fields'
        out = handler(self)
        if out.get("prompt_tokens_details") is None:
            out.pop("prompt_tokens_details", None)
        return out


class TopLogprob(BaseModel):
    """One token of chat ``logprobs`` (see :mod:`gateway.openai.logprobs` for token/bytes)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    """Chat ``choices[i].logprobs``: one entry per completion token."""

    content: list[TokenLogprobEntry] | None = None
    refusal: list[TokenLogprobEntry] | None = None


class CompletionLogprobs(BaseModel):
    """Legacy ``/v1/completions`` ``choices[i].logprobs``."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text (a prefix of it when the reply was cut by max_tokens)


class ToolCall(BaseModel):
    id: str  # call_…
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    """``tool_calls`` is left out (not ``null``) when the reply has none; ``content`` is
    ``null`` when it has calls and no text."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_no_tool_calls(self, handler):
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage
    spec_stats: dict | None = None  # only serialized when requested


class ChunkChoice(BaseModel):
    index: int = 0
    delta: dict  # {"role": "assistant", "content": ""} first, then {"content": "..."} / {"tool_calls": [...]}, last {}
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChunkChoice]
    usage: Usage | None = None
    spec_stats: dict | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class TextCompletion(BaseModel):
    """Non-streamed result and streamed chunk of ``/v1/completions`` (same object name)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None
    spec_stats: dict | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sparkgate"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
