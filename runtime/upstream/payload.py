"""The body of ``POST /v1/completions`` for one :class:`runtime.interface.GenerationRequest`.

Why ``/v1/completions`` with token ids and not ``/v1/chat/completions``: the gateway already
templates the chat with the served model's tokenizer and counts its tokens (context clamping,
rate limits, usage); a ``prompt`` given as a list of token ids (OpenAI's Completions API allows
it; vLLM, SGLang and llama-server accept it) makes the server run exactly those tokens, so
tools, tiers and counts behave as on the embedded engine, and one narrow interface serves
every backend.

Mapping (OpenAI Completions fields; vLLM ``CompletionRequest`` and SGLang's of the same name
for the extensions, ``vllm/entrypoints/openai/completion/protocol.py``,
``sglang/srt/entrypoints/openai/protocol.py``):

* always: ``model``, ``prompt`` (token ids), ``stream: true``, ``stream_options:
  {"include_usage": true}`` (the final chunk carries ``usage``), ``max_tokens`` (``None`` →
  the rest of the context: the servers' default is 16), ``temperature``, ``top_p``;
* when set (their off values are not sent, so a server without the extension is not asked
  for it): ``top_k`` (> 0), ``min_p``, ``presence_penalty``, ``frequency_penalty``,
  ``repetition_penalty``, ``logit_bias`` (``{"<token id>": bias}``), ``seed``, ``stop``,
  ``stop_token_ids``, ``min_tokens``, ``ignore_eos``;
* ``logprobs`` = n with ``return_tokens_as_token_ids: true`` (vLLM: tokens come back as
  ``"token_id:<id>"``, so they map to ids exactly);
* ``return_token_ids: true`` with :attr:`UpstreamConfig.return_token_ids`;
* ``priority`` with :attr:`UpstreamConfig.send_priority`: the tier priority (larger = more
  important), negated with :attr:`UpstreamConfig.priority_low_values_first` (vLLM runs lower
  values first);
* ``cache_salt`` with :attr:`UpstreamConfig.send_cache_salt`;
* ``response_format``: ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
  {"name": "response", "schema", "strict"}}`` (vLLM and SGLang honour it on completions). A
  ``"tool_calls"`` format with ``tool_choice="auto"`` and no reply format sends nothing: the
  reply is free text the gateway parses for calls, as on a backend without grammars. Other
  tool formats (``required``, a named tool, tools with a JSON reply) cannot be expressed
  portably → :class:`~runtime.interface.GrammarError` (HTTP 400).

``n`` > 1 never reaches a backend (the gateway runs one request per choice).
"""

from __future__ import annotations

from typing import Any

from runtime.interface import GenerationRequest, GrammarError, ResponseFormat
from runtime.upstream.config import UpstreamConfig

#: Sampling fields sent only when they differ from their off value: ours → (theirs, off).
OPTIONAL_FIELDS = {
    "presence_penalty": ("presence_penalty", 0.0),
    "frequency_penalty": ("frequency_penalty", 0.0),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "min_p": ("min_p", 0.0),
    "min_tokens": ("min_tokens", 0),
}


def response_format_field(fmt: ResponseFormat | None) -> dict | None:
    """The ``response_format`` to send for ``fmt`` (``None``: none; see the module docstring).

    Raises:
        GrammarError: a tool-call format that is not free ``auto`` (code ``unsupported_parameter``).
    """
    if fmt is None:
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.type == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": "response", "schema": fmt.schema, "strict": fmt.strict}}
    if fmt.type == "tool_calls" and fmt.tool_choice == "auto" and fmt.reply is None:
        return None
    raise GrammarError("This backend cannot constrain its output to tool calls (tool_choice 'required', a named "
                       "tool, or tools together with a response_format); use tool_choice 'auto' without one.",
                       code="unsupported_parameter")


def completion_budget(request: GenerationRequest, max_context: int) -> int:
    """Completion tokens to ask a server for: the request's ``max_tokens`` (already clamped by
    the gateway), else what the ``max_context``-token context leaves after the prompt.

    Raises:
        ValueError: no ``max_tokens`` and the prompt already fills the context.
    """
    if request.sampling.max_tokens is not None:
        return int(request.sampling.max_tokens)
    room = max_context - len(request.prompt_token_ids)
    if room < 1:
        raise ValueError(f"prompt of {len(request.prompt_token_ids)} tokens leaves no room "
                         f"in a {max_context}-token context")
    return room


def build_completions_payload(request: GenerationRequest, config: UpstreamConfig) -> dict[str, Any]:
    """The JSON body for ``request`` (mapping in the module docstring).

    Raises:
        ValueError: the prompt already fills ``config.max_context``.
        GrammarError: a response format the upstream cannot be asked for.
    """
    s = request.sampling
    max_tokens = completion_budget(request, config.max_context)
    body: dict[str, Any] = {
        "model": config.model or config.model_name,
        "prompt": list(request.prompt_token_ids),
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": float(s.temperature),
        "top_p": float(s.top_p),
    }
    if s.top_k and s.top_k > 0:
        body["top_k"] = int(s.top_k)
    for ours, (theirs, off) in OPTIONAL_FIELDS.items():
        value = getattr(s, ours)
        if value != off:
            body[theirs] = value
    if s.logit_bias:
        body["logit_bias"] = {str(t): float(b) for t, b in s.logit_bias}
    if s.seed is not None:
        body["seed"] = int(s.seed)
    if s.stop:
        body["stop"] = list(s.stop)
    if s.stop_token_ids:
        body["stop_token_ids"] = [int(t) for t in s.stop_token_ids]
    if s.ignore_eos:
        body["ignore_eos"] = True
    if s.logprobs is not None:
        body["logprobs"] = int(s.logprobs)
        body["return_tokens_as_token_ids"] = True
    if config.return_token_ids:
        body["return_token_ids"] = True
    if config.send_priority:
        body["priority"] = -int(request.priority) if config.priority_low_values_first else int(request.priority)
    if config.send_cache_salt and request.cache_salt:
        body["cache_salt"] = request.cache_salt
    fmt = response_format_field(request.response_format)
    if fmt is not None:
        body["response_format"] = fmt
    return body
