"""``POST /v1/chat/completions`` (OpenAI Chat Completions, streaming and not)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from gateway.api.deps import CurrentPrincipal, chat_body, get_ready_backend, openapi_body
from gateway.openai.respond import respond
from gateway.core.errors import invalid_request
from gateway.openai.formatters import ChatFormatter
from gateway.openai.logprobs import LogprobsBuilder
from gateway.openai.schemas import ChatCompletionRequest
from gateway.openai.translate import (
    reject_unsupported_chat, requested_logprobs, resolve_model, response_format, template_messages,
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
    messages = template_messages(body.messages)
    try:
        prompt_ids = backend.apply_chat_template(messages)
    except ValueError as exc:
        raise invalid_request(f"Invalid messages: {exc}", "messages") from None
    logprobs = LogprobsBuilder(backend.token_bytes, num_top) if num_top is not None else None
    fmt = ChatFormatter(model, len(prompt_ids), bool(body.return_spec_stats), logprobs)
    return await respond(request, backend, principal, body, prompt_ids, fmt, "messages", structured)
