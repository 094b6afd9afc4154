"""``POST /v1/completions`` (OpenAI legacy text completions, streaming and not)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from gateway.api.deps import CurrentPrincipal, completion_body, get_ready_backend, openapi_body
from gateway.openai.respond import respond
from gateway.openai.formatters import CompletionFormatter
from gateway.openai.logprobs import LogprobsBuilder
from gateway.openai.schemas import CompletionRequest
from gateway.openai.translate import completion_prompt, reject_unsupported_completion, requested_logprobs, resolve_model
from runtime.interface import Backend

router = APIRouter()


@router.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
async def create_completion(
    request: Request,
    principal: CurrentPrincipal,
    body: Annotated[CompletionRequest, Depends(completion_body)],
    backend: Annotated[Backend, Depends(get_ready_backend)],
) -> Response:
    reject_unsupported_completion(body)
    num_top = requested_logprobs(body, backend.info)
    model = resolve_model(body.model, backend.info, [request.app.state.settings.model_name])
    prompt_ids = backend.encode(completion_prompt(body))
    logprobs = LogprobsBuilder(backend.token_bytes, num_top) if num_top is not None else None
    fmt = CompletionFormatter(model, len(prompt_ids), bool(body.return_spec_stats), logprobs)
    return await respond(request, backend, principal, body, prompt_ids, fmt, "prompt")
