"""FastAPI dependencies: settings, backend, DB session, API-key auth and JSON bodies."""

from __future__ import annotations

import hmac
import json
import logging
from typing import Annotated, AsyncIterator, TypeVar

from fastapi import Depends, Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.core.config import Settings
from gateway.core.security import AuthCache, Principal, key_digest
from gateway.crud import keys as crud_keys
from gateway.db.models import utcnow
from gateway.core.errors import (forbidden, from_validation_error, invalid_request, model_not_ready, overloaded,
                            unauthorized)
from gateway.openai.responses_schemas import ResponsesRequest
from gateway.openai.schemas import ChatCompletionRequest, CompletionRequest
from runtime.interface import Backend

M = TypeVar("M", bound=BaseModel)
log = logging.getLogger(__name__)


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_backend(request: Request) -> Backend:
    return request.app.state.backend


def backend_start_error(request: Request) -> BaseException | None:
    """The exception the backend's start-up task ended with, if it failed."""
    task = getattr(request.app.state, "backend_start", None)
    if task is not None and task.done() and not task.cancelled():
        return task.exception()
    return None


def get_ready_backend(request: Request) -> Backend:
    """The backend, or 503 ``model_not_ready`` while it loads (or when it failed to start):
    generation routes need its tokenizer before anything else."""
    backend = request.app.state.backend
    if not backend.ready():
        raise model_not_ready(start_failed=backend_start_error(request) is not None)
    return backend


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    async with request.app.state.sessionmaker() as session:
        yield session


def authorization_header(request: Request) -> str | None:
    """The request's one ``Authorization`` header (None when absent).

    Raises:
        APIError: 400 ``invalid_request_error`` when it has several: which one a proxy
            in front checked is unknown, so the request is refused rather than guessed at.
    """
    values = request.headers.getlist("authorization")
    if len(values) > 1:
        raise invalid_request(f"The request has {len(values)} Authorization headers; send exactly one "
                              "('Authorization: Bearer YOUR_KEY').", None, "duplicate_authorization_header")
    return values[0] if values else None


def bearer_token(header: str | None) -> str:
    """The token of an ``Authorization: Bearer <token>`` header; 401 when absent/malformed."""
    if not header:
        raise unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.")
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise unauthorized("Malformed Authorization header; expected 'Authorization: Bearer YOUR_KEY'.")
    return token


async def require_principal(request: Request) -> Principal:
    """Authenticate the bearer key (or the admin token). 401 for missing, unknown,
    revoked or expired keys, 400 for several ``Authorization`` headers. Positive lookups
    are cached for ``auth_cache_ttl_s``."""
    token = bearer_token(authorization_header(request))
    state = request.app.state
    admin = state.settings.admin_token
    if admin and hmac.compare_digest(token.encode(), admin.encode()):
        return Principal(tenant="admin", is_admin=True)
    digest = key_digest(token)
    cache: AuthCache = state.auth_cache
    principal = cache.get(digest)
    if principal is None:
        try:
            async with state.sessionmaker() as session:
                principal = await crud_keys.authenticate(session, digest)
        except (SQLAlchemyError, OSError) as exc:  # database down: known keys keep working
            principal = cache.get_stale(digest)
            if principal is None:
                raise overloaded("The key database is unavailable; try again shortly.", 2.0,
                                 code="auth_unavailable") from None
            log.warning("key lookup failed (%s); using the cached principal of tenant %s", type(exc).__name__,
                        principal.tenant)
        else:
            if principal is not None:
                cache.put(digest, principal)
            else:
                cache.invalidate(digest)
    if principal is None or (principal.expires_at is not None and principal.expires_at <= utcnow()):
        raise unauthorized("Incorrect API key provided, or the key was revoked or has expired.")
    return principal


CurrentPrincipal = Annotated[Principal, Depends(require_principal)]


async def require_admin(principal: CurrentPrincipal) -> Principal:
    """The admin token only; a valid tenant key gets 403."""
    if not principal.is_admin:
        raise forbidden()
    return principal


AdminPrincipal = Annotated[Principal, Depends(require_admin)]


async def read_json_object(request: Request) -> dict:
    """The body as a JSON object (any content type); 400 for non-JSON or non-objects."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: absurdly nested JSON
        raise invalid_request("We could not parse the JSON body of your request. The body must be "
                              "a JSON object.", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise invalid_request(f"The request body must be a JSON object, not {_json_type(data)}.", None, "invalid_json")
    return data


class JSONBodyRoute(APIRoute):
    """A route whose body is read as JSON whatever its ``Content-Type`` (missing, or
    ``application/x-www-form-urlencoded`` as ``curl -d`` sends), like
    :func:`read_json_object` on ``/v1/chat/completions``. Not a CSRF opening: these
    routes need an ``Authorization`` header, which a browser never sends cross-site
    without a CORS preflight."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def as_json(request: Request) -> Response:
            headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
            scope = {**request.scope, "headers": [*headers, (b"content-type", b"application/json")]}
            return await handler(Request(scope, request.receive))

        return as_json


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {list: "an array", str: "a string"}.get(type(value), "a number")


def validate_body(model: type[M], data: dict) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def openapi_body(model: type[BaseModel]) -> dict:
    """``openapi_extra`` declaring ``model`` as the JSON body of a route that reads its body
    itself (:func:`chat_body`), so the OpenAPI schema — and the fuzzer reading it — see it.
    Nested models are inlined (a ``#/$defs/...`` ref would not resolve inside a path)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


async def chat_body(request: Request, _: CurrentPrincipal) -> ChatCompletionRequest:
    """Parsed ``/v1/chat/completions`` body (auth runs first)."""
    return validate_body(ChatCompletionRequest, await read_json_object(request))


async def completion_body(request: Request, _: CurrentPrincipal) -> CompletionRequest:
    """Parsed ``/v1/completions`` body (auth runs first)."""
    return validate_body(CompletionRequest, await read_json_object(request))


async def responses_body(request: Request, _: CurrentPrincipal) -> ResponsesRequest:
    """Parsed ``/v1/responses`` body (auth runs first)."""
    return validate_body(ResponsesRequest, await read_json_object(request))
