"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the gateway returns goes through :class:`APIError` or one of the
handlers installed by :func:`gateway.api.error_handlers.install_error_handlers`, so clients never see a
bare 500, FastAPI's 422 shape or a stack trace.
"""

from __future__ import annotations

import logging
import math
import re

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An error answered as ``status`` with the OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400 ``invalid_request_error``."""
    return APIError(400, message, INVALID_REQUEST, param, code)


def unsupported(param: str, detail: str = "") -> APIError:
    """400 for an OpenAI parameter this gateway does not implement (yet)."""
    extra = f" {detail}" if detail else ""
    return APIError(400, f"The '{param}' parameter is not supported by this server.{extra}",
                    INVALID_REQUEST, param, "unsupported_parameter")


def unauthorized(message: str) -> APIError:
    """401 ``authentication_error`` / ``invalid_api_key``."""
    return APIError(401, message, AUTHENTICATION, None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})


def forbidden(message: str = "This route needs the admin token; tenant API keys cannot use it.") -> APIError:
    """403 ``permission_error`` (a valid key without the right to this route)."""
    return APIError(403, message, "permission_error", None, "insufficient_permissions")


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist or you do not have access to it.",
                    INVALID_REQUEST, "model", "model_not_found")


def overloaded(message: str, retry_after_s: float, code: str = "queue_full") -> APIError:
    """503 with an integer ``retry-after`` header (seconds, at least 1)."""
    retry = str(max(1, math.ceil(retry_after_s)))
    return APIError(503, message, SERVER_ERROR, None, code, {"Retry-After": retry})


def model_not_ready(start_failed: bool = False) -> APIError:
    """503 ``model_not_ready`` (with ``retry-after``): the backend is still loading, or its
    start-up failed (then see /readyz and the server log)."""
    if start_failed:
        return overloaded("The model failed to start (see /readyz and the server log).", 30.0, code="model_not_ready")
    return overloaded("The model is still loading; try again shortly.", 5.0, code="model_not_ready")


def server_error(message: str, code: str | None = "engine_error") -> APIError:
    return APIError(500, message, SERVER_ERROR, None, code)


#: The status of a runtime failure of a backend that streams from upstream servers, by the
#: ``Failed.code`` it reports (``runtime/upstream/client.py``, ``runtime/sglang/client.py``): the
#: upstream answered wrongly (502 Bad Gateway), none is reachable (503, ``retry-after``), it did
#: not answer in time (504 Gateway Timeout). Other codes are the gateway's own failures (500).
UPSTREAM_STATUS = {
    "upstream_bad_request": 400,  # the upstream refused the request itself (e.g. longer than its context)
    "upstream_error": 502,
    "upstream_rejected": 502,
    "upstream_disconnected": 502,
    "upstream_protocol_error": 502,
    "upstream_unavailable": 503,
    "upstream_timeout": 504,
}
UPSTREAM_RETRY_AFTER_S = 5.0


def runtime_failure(message: str, code: str | None) -> APIError:
    """The error for a backend's ``Failed`` event: 400 ``invalid_request_error`` and 502/503/504
    ``server_error`` for the ``upstream_*`` codes of :data:`UPSTREAM_STATUS` (503 with
    ``retry-after``), else 500 ``server_error``."""
    status = UPSTREAM_STATUS.get(code or "")
    if status == 503:
        return overloaded(message, UPSTREAM_RETRY_AFTER_S, code=code)
    if status == 400:
        return APIError(400, message, INVALID_REQUEST, None, code)
    return APIError(status or 500, message, SERVER_ERROR, None, code)


_FIELD = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def param_path(loc: tuple) -> str | None:
    """Pydantic location → OpenAI-style param, e.g. ``('messages', 0, 'role')`` → ``messages[0].role``.

    Union-member tags pydantic inserts (``'str'``, ``'list[ContentPart]'``) are dropped.
    """
    out = ""
    for part in loc:
        if isinstance(part, str) and (not _FIELD.fullmatch(part) or part in _TYPE_TAGS):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None


def from_validation_error(exc: ValidationError | RequestValidationError, strip_body: bool = False) -> APIError:
    """First pydantic error → 400 naming its field in ``param``.

    A field typed as a union (``stop: str | list[str]``) fails once per member; of those
    errors (and those of the field's items) the first that is not a plain type mismatch says
    what is wrong (``['a'] * 10`` → "at most 4 items", ``['a', '\\ud800']`` → ``stop[1]``
    "not valid Unicode", not "should be a valid string")."""
    errs = exc.errors()

    def loc_of(e) -> tuple:
        loc = tuple(e.get("loc", ()))
        return loc[1:] if strip_body and loc and loc[0] == "body" else loc

    first = param_path(loc_of(errs[0]))

    def within_first(e) -> bool:
        p = param_path(loc_of(e))
        return p == first or (p is not None and first is not None and p.startswith((first + "[", first + ".")))

    err = next((e for e in errs if within_first(e) and not str(e.get("type", "")).endswith("_type")), errs[0])
    loc = loc_of(err)
    if err.get("type") == "json_invalid":
        return invalid_request("We could not parse the JSON body of your request.", None, "invalid_json")
    param = param_path(loc)
    if err.get("type") == "missing" and param:
        return invalid_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    where = f" for '{param}'" if param else ""
    return invalid_request(f"Invalid value{where}: {err.get('msg', 'invalid')}", param, "invalid_value")
