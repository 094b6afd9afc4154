"""``POST /v1/chat/completions`` (OpenAI Chat Completions, streaming and not)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from gateway.api.deps import CurrentPrincipal, chat_body, get_ready_backend, openapi_body
from gateway.openai.respond import record_refusal, respond
from gateway.core.errors import APIError, invalid_request
from gateway.openai.formatters import ChatFormatter
from gateway.openai.generation import response_format_param
from gateway.openai.logprobs import LogprobsBuilder
from gateway.openai.schemas import ChatCompletionRequest
from gateway.openai.tools import call_names, grammar_param, prompt_messages, tool_format, tool_plan
from gateway.openai.translate import (
    constraint_kind, reject_unsupported_chat, requested_logprobs, resolve_model, response_format, template_messages,
)
from runtime.interface import Backend

router = APIRouter()


@router.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
async def create_chat_completion(
    request: Request,
    principal: CurrentPrincipal,
    body: Annotated[ChatCompletionRequest, Depends(chat_body)],
    backend: Annotated[Backend, Depends(get_ready_backend)],
) -> Response:
    reject_unsupported_chat(body)
    num_top = requested_logprobs(body, backend.info)
    structured = response_format(body, backend.info)
    model = resolve_model(body.model, backend.info, [request.app.state.settings.model_name])
    try:  # tools, tool_choice and the conversation's calls: a refusal leaves a rejected record
        plan = tool_plan(body)
        names = call_names(body.messages)
        constraint = tool_format(plan, backend.info, structured) if plan is not None else structured
    except APIError as exc:
        record_refusal(request, principal, body, "chat", exc)
        raise
    messages, tools = prompt_messages(template_messages(body.messages, names), plan, backend.info)
    try:
        prompt_ids = (backend.apply_chat_template(messages) if tools is None
                      else backend.apply_chat_template(messages, tools=tools))
    except ValueError as exc:
        raise invalid_request(f"Invalid messages: {exc}", "messages") from None
    logprobs = LogprobsBuilder(backend.token_bytes, num_top) if num_top is not None else None
    fmt = ChatFormatter(model, len(prompt_ids), bool(body.return_spec_stats), logprobs, tool_calls=plan is not None)
    return await respond(request, backend, principal, body, prompt_ids, fmt, "messages", constraint,
                         grammar_param(plan) if plan is not None else response_format_param, constraint_kind(body))
