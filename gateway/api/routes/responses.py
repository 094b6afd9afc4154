"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}`` (OpenAI Responses API).

A create is served as the chat request it translates to (:mod:`gateway.openai.responses_input`,
:func:`gateway.openai.chat_prompt.chat_prompt`, :func:`gateway.openai.respond.respond`), so
keys, tiers, admission, rate limits, request records (endpoint ``responses``, id the
``resp_…`` id), metrics and speculative stats are chat's; only the reply's shape differs
(:mod:`gateway.openai.responses_output`). With ``store`` (default true) the finished
response is saved for its tenant before the client gets it (:mod:`gateway.crud.responses`);
``previous_response_id`` continues a stored one (its conversation and output come first).
Another tenant's response id is answered as an unknown one: 404.
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.api.deps import CurrentPrincipal, get_ready_backend, get_session, openapi_body, responses_body
from gateway.core.errors import INVALID_REQUEST, APIError, overloaded
from gateway.core.security import Principal
from gateway.core.text import Label
from gateway.crud import responses as crud_responses
from gateway.openai.chat_prompt import chat_prompt
from gateway.openai.generation import EventStream, SSEResponse, collect
from gateway.openai.respond import record_refusal, respond
from gateway.openai.responses_input import (
    chat_request, check_call_outputs, check_parameters, conversation_items, function_tools, responses_param,
    stored_items,
)
from gateway.openai.responses_output import ResponseFormatter, new_id, request_echo, response_events
from gateway.openai.responses_schemas import ResponsesRequest
from gateway.openai.translate import constraint_kind
from runtime.interface import Backend

log = logging.getLogger(__name__)
router = APIRouter()
Session = Annotated[AsyncSession, Depends(get_session)]
DB_ERRORS = (SQLAlchemyError, OSError)


def response_not_found(response_id: str, param: str | None = None) -> APIError:
    what = "Previous response" if param == "previous_response_id" else "Response"
    code = "previous_response_not_found" if param == "previous_response_id" else "not_found"
    return APIError(404, f"{what} with id '{response_id}' not found.", INVALID_REQUEST, param, code)


async def previous_conversation(request: Request, principal: Principal, response_id: str | None) -> list[dict]:
    """The normalised conversation and output of the tenant's stored response ``response_id``
    (``[]`` for None). 404 (``param: previous_response_id``) when the tenant has none such;
    503 ``store_unavailable`` when the database cannot be read."""
    if response_id is None:
        return []
    try:
        async with request.app.state.sessionmaker() as session:
            row = await crud_responses.get_response(session, response_id, principal.tenant)
    except DB_ERRORS as exc:
        log.warning("previous_response_id lookup failed: %s", type(exc).__name__)
        raise overloaded("The response store is unavailable; try again shortly.", 2.0,
                         code="store_unavailable") from None
    if row is None:
        raise response_not_found(response_id, "previous_response_id")
    return row.input_items + stored_items(row.output_items)


@router.post("/v1/responses", openapi_extra=openapi_body(ResponsesRequest))
async def create_response(
    request: Request,
    principal: CurrentPrincipal,
    body: Annotated[ResponsesRequest, Depends(responses_body)],
    backend: Annotated[Backend, Depends(get_ready_backend)],
) -> Response:
    check_parameters(body)
    response_id = new_id("resp")
    try:  # the stored conversation, tools, tool_choice, call outputs: a refusal leaves a rejected record
        previous = await previous_conversation(request, principal, body.previous_response_id)
        items = conversation_items(body, previous)
        tools = function_tools(body.tools)
        check_call_outputs(items, len(previous))
        chat = chat_request(body, items, tools)
    except APIError as exc:
        record_refusal(request, principal, body, "responses", exc, response_id)
        raise
    prompt = chat_prompt(request, principal, chat, backend, "responses", responses_param, response_id)
    fmt = ResponseFormatter(prompt.model, len(prompt.prompt_ids), request_echo(body, tools),
                            tool_calls=prompt.plan is not None, return_spec_stats=bool(body.return_spec_stats),
                            response_id=response_id)
    sessionmaker = request.app.state.sessionmaker

    async def finalize(obj: dict) -> dict:
        """Store the finished response (``store``); a database failure is logged and the
        response is returned with ``store: false`` rather than lost."""
        if obj["store"]:
            try:
                async with sessionmaker() as session:
                    await crud_responses.save_response(session, principal.tenant, obj, items)
            except DB_ERRORS as exc:
                log.warning("could not store response %s: %s", obj["id"], type(exc).__name__)
                obj["store"] = False
        return obj

    async def reply(stream: EventStream) -> Response:
        if body.stream:
            return SSEResponse(response_events(stream, fmt, finalize))
        text, finished, _ = await collect(stream, request)
        return JSONResponse(await finalize(fmt.complete(text, finished)))

    return await respond(request, backend, principal, chat, prompt.prompt_ids, fmt, "input", prompt.constraint,
                         prompt.grammar_param, constraint_kind(chat), endpoint="responses", reply=reply)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: Label, principal: CurrentPrincipal, session: Session) -> dict:
    """The tenant's stored response object, as it was returned."""
    row = await crud_responses.get_response(session, response_id, principal.tenant)
    if row is None:
        raise response_not_found(response_id)
    return crud_responses.response_object(row)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: Label, principal: CurrentPrincipal, session: Session) -> dict:
    """Delete the tenant's stored response: ``{"id", "object": "response.deleted", "deleted": true}``."""
    if not await crud_responses.delete_response(session, response_id, principal.tenant):
        raise response_not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}
