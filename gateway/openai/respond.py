"""The part of ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/responses`` after the
prompt is tokenized: clamp ``max_tokens``, admit, submit, then stream (SSE) or answer JSON."""

from __future__ import annotations

from typing import Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from gateway.core.security import Principal
from gateway.core.errors import APIError
from gateway.openai.choices import respond_choices
from gateway.openai.formatters import Formatter, new_id
from gateway.openai.generation import (
    EventStream, SSEResponse, collect, response_format_param, sse_events, start_generation,
)
from gateway.observability.observe import REJECTED, RequestContext, RequestOutcome, notify
from gateway.openai.schemas import BaseCompletionRequest
from gateway.openai.translate import (
    check_sampling, completion_budget, constraint_kind, generation_request, requested_max_tokens,
)
from runtime.interface import Backend, GrammarError, ResponseFormat


async def respond(
    request: Request,
    backend: Backend,
    principal: Principal,
    body: BaseCompletionRequest,
    prompt_ids: list[int],
    fmt: Formatter,
    prompt_param: str,
    response_format: ResponseFormat | None = None,
    grammar_param: Callable[[GrammarError], str | None] = response_format_param,
    constraint: str | None = None,
    endpoint: str | None = None,
    reply: Callable[[EventStream], Awaitable[Response]] | None = None,
) -> Response:
    """Run the request and build the HTTP response (``response_format``: the chat request's,
    :func:`gateway.openai.translate.response_format` or :func:`gateway.openai.tools.tool_format`;
    ``grammar_param``: where a refusal of it points, :func:`gateway.openai.generation.grammar_error`;
    ``constraint``: :func:`gateway.openai.translate.constraint_kind`, for records and metrics).

    ``endpoint``: the request record's (default ``chat`` for ``prompt_param`` ``messages``, else
    ``completions``). ``reply``: builds the response from the started generation instead of
    the chat/completions formatter (``/v1/responses``: its own object and events); ``n`` is
    then 1.

    ``max_tokens`` is clamped to ``max_context − len(prompt_ids)`` (the whole remaining
    context when absent), so an over-long request ends with ``finish_reason: "length"``.
    Admission resolves the tier's SLA target into ``ctx``; the runtime request is built from it.
    ``n`` > 1 runs that many choices (:mod:`gateway.openai.choices`).
    """
    state = request.app.state
    check_sampling(body, backend.info)
    n = body.n or 1
    ctx = RequestContext(
        request_id=fmt.id,
        endpoint=endpoint or (prompt_param == "messages" and "chat" or "completions"),
        model=fmt.model,
        stream=bool(body.stream),
        prompt_tokens=len(prompt_ids),
        max_tokens=completion_budget(len(prompt_ids), backend.info.max_context, requested_max_tokens(body), prompt_param),
        tenant=principal.tenant,
        user=body.user or principal.user_label,
        key_id=principal.key_id,
        choices=n,
        constraint=constraint,
    )
    admission = getattr(state, "admission", None)  # gateway.tenancy.admission: limits, queue, SLA (429s)
    ticket = await admission.admit(request, principal, ctx, state.observers) if admission is not None else None
    headers = ticket.headers if ticket is not None else {}  # x-ratelimit-*, also before the first SSE byte
    if ticket is not None and getattr(state, "records", None) is not None:
        state.records.request_started(ctx)  # a ``running`` record until it ends (records.py)
    try:
        gen_request = generation_request(ctx, prompt_ids, body, state.settings.request_timeout_s,
                                         fmt.num_top_logprobs, state.settings.prefix_cache_scope, response_format)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if n > 1:
            response: Response = await respond_choices(request, backend, gen_request, n, ctx, state.observers, fmt,
                                                       bool(body.stream), include_usage, grammar_param)
        elif reply is not None:
            stream = await start_generation(backend, gen_request, request, ctx, state.observers, grammar_param)
            response = await reply(stream)
        elif body.stream:
            stream = await start_generation(backend, gen_request, request, ctx, state.observers, grammar_param)
            response = SSEResponse(sse_events(stream, fmt, include_usage))
        else:
            stream = await start_generation(backend, gen_request, request, ctx, state.observers, grammar_param)
            text, finished, logprobs = await collect(stream, request)
            response = JSONResponse(fmt.complete(text, finished, logprobs))
    except BaseException as exc:
        if ticket is not None:
            admission.release(ticket.request_id)  # no-op when an observer already saw the outcome
        if isinstance(exc, APIError) and headers:
            exc.headers = {**headers, **(exc.headers or {})}
        raise
    response.headers.update(headers)
    return response


def record_refusal(request: Request, principal: Principal, body: BaseCompletionRequest, endpoint: str,
                   exc: APIError, request_id: str | None = None) -> None:
    """Leave a ``rejected`` request record (and outcome for every observer) for a request
    refused with ``exc`` before it reached the engine — used for refused tools, which a
    tenant should be able to find in its records like a refused response format (its
    ``constraint`` as the request asked, :func:`gateway.openai.translate.constraint_kind`). ``body``:
    any request with ``model``, ``stream`` and ``user``; ``request_id``: the record's id
    (default a new ``chatcmpl-…`` / ``cmpl-…``)."""
    request_id = request_id or new_id("chatcmpl" if endpoint == "chat" else "cmpl")
    ctx = RequestContext(request_id=request_id, endpoint=endpoint,
                         model=body.model, stream=bool(body.stream), prompt_tokens=0, max_tokens=0,
                         tenant=principal.tenant, user=body.user or principal.user_label, key_id=principal.key_id,
                         constraint=constraint_kind(body))
    notify(request.app.state.observers, RequestOutcome(ctx, REJECTED, error_code=exc.code, error_message=exc.message))
