"""``POST /v1/chat/completions`` (OpenAI Chat Completions, streaming and not)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from gateway.api.deps import CurrentPrincipal, chat_body, get_ready_backend, openapi_body
from gateway.openai.chat_prompt import chat_prompt
from gateway.openai.respond import respond
from gateway.openai.formatters import ChatFormatter
from gateway.openai.logprobs import LogprobsBuilder
from gateway.openai.schemas import ChatCompletionRequest
from gateway.openai.translate import constraint_kind, reject_unsupported_chat
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
    prompt = chat_prompt(request, principal, body, backend)
    logprobs = LogprobsBuilder(backend.token_bytes, prompt.num_top) if prompt.num_top is not None else None
    fmt = ChatFormatter(prompt.model, len(prompt.prompt_ids), bool(body.return_spec_stats), logprobs,
                        tool_calls=prompt.plan is not None)
    return await respond(request, backend, principal, body, prompt.prompt_ids, fmt, "messages", prompt.constraint,
                         prompt.grammar_param, constraint_kind(body))
