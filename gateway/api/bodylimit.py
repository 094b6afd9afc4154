"""Request-body size limit (``Settings.max_body_bytes``), enforced before the body is read.

A pure ASGI middleware: a ``Content-Length`` over the limit is answered 413 at once
(nothing is read); a chunked body is counted as it arrives and the request fails with
413 as soon as it crosses the limit, so a client can never make the gateway buffer
more than ``max_body_bytes`` (+ one chunk) of one request.
"""

from __future__ import annotations

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.core.errors import APIError


def too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is too large; the limit is {limit} bytes.", code="request_too_large")


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.max_bytes <= 0:
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.max_bytes:
                    await too_large(self.max_bytes).response()(scope, receive, send)
                    return
        seen = 0
        limit = self.max_bytes

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # FastAPI re-raises HTTPException from body parsing; our handler shapes it
                    raise HTTPException(413, too_large(limit).message)
            return message

        await self.app(scope, limited, send)
