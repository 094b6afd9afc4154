"""The app's exception handlers: every error answered in the OpenAI shape
(:mod:`gateway.core.errors`), 400 instead of FastAPI's 422, never a bare 500."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from gateway.api.deps import require_admin, require_principal
from gateway.core.errors import INVALID_REQUEST, SERVER_ERROR, APIError, from_validation_error, invalid_request, server_error

log = logging.getLogger(__name__)


async def _auth_first(request: Request) -> JSONResponse | None:
    """FastAPI parses a route's body before running its dependencies, so an unparsable
    body would be refused 400 before authentication. Check the key first (no key → 401,
    tenant key on an admin route → 403), like every other request; None when allowed."""
    if request.url.path in ("/healthz", "/readyz"):
        return None
    try:
        principal = await require_principal(request)
        if request.url.path.startswith("/admin/"):
            await require_admin(principal)
    except APIError as err:
        return err.response()
    return None


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error in the OpenAI shape (400 instead of FastAPI's 422)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        if exc.errors() and exc.errors()[0].get("type") == "json_invalid":
            refused = await _auth_first(request)
            if refused is not None:
                return refused
        return from_validation_error(exc, strip_body=True).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:  # FastAPI: "There was an error parsing the body"
            refused = await _auth_first(request)
            if refused is not None:
                return refused
        if exc.status_code == 404:
            err = APIError(404, f"Invalid URL ({request.method} {request.url.path})", code="unknown_url")
        elif exc.status_code == 405:
            err = APIError(405, f"Method {request.method} is not allowed on {request.url.path}",
                           code="method_not_allowed")
        else:
            kind = SERVER_ERROR if exc.status_code >= 500 else INVALID_REQUEST
            err = APIError(exc.status_code, str(exc.detail), kind,
                           code="request_too_large" if exc.status_code == 413 else None)
        err.headers = dict(exc.headers or {})
        return err.response()

    from sqlalchemy.exc import DataError

    @app.exception_handler(OverflowError)
    @app.exception_handler(DataError)
    async def _out_of_range(request: Request, exc: Exception) -> JSONResponse:
        # a value the database cannot store (e.g. an integer > 2**63: OverflowError from
        # SQLite, DataError from asyncpg) is the client's error, not a 500
        log.info("out-of-range value on %s %s: %s", request.method, request.url.path, type(exc).__name__)
        return invalid_request("A numeric value in the request is out of range.", None, "invalid_value").response()

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, exc: ClientDisconnect) -> Response:
        # The client closed the connection before its body arrived (read_json_object): nobody is
        # left to answer, and it is not a server error. 499 as nginx logs it; never delivered.
        log.info("client disconnected while sending %s %s", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after this response is sent, so the server logs the traceback.
        log.error("unhandled %s on %s %s", type(exc).__name__, request.method, request.url.path)
        return server_error("The server had an error while processing your request.", None).response()
