"""What a client library sends and gets back, recorded at its HTTP client.

The OpenAI Python SDK, and every library built on it (the OpenAI Agents SDK, LangChain,
pydantic-ai), accept an ``httpx`` client; :class:`Wire` gives them one whose event hooks
record each request's JSON body and each JSON response's body, so a test can assert on the
real traffic (that the tool's result went back to the model, which parameters the library
sent) instead of on the library's own account of it. Streamed (SSE) responses are not read
here: the library reads them as usual.
"""

from __future__ import annotations

import json

import httpx


class Wire:
    """Requests and JSON responses of one client, in order.

    Attributes:
        requests: the JSON body of each request (``None`` for a request without a body).
        responses: the decoded body of each ``application/json`` response (errors included).
    """

    def __init__(self) -> None:
        self.requests: list[dict | None] = []
        self.responses: list[dict] = []

    def _request(self, request: httpx.Request) -> None:
        self.requests.append(json.loads(request.content) if request.content else None)

    @staticmethod
    def _is_json(response: httpx.Response) -> bool:
        return response.headers.get("content-type", "").startswith("application/json")

    def client(self) -> httpx.Client:
        """A sync ``httpx.Client`` that records into this wire."""

        def on_response(response: httpx.Response) -> None:
            if self._is_json(response):
                response.read()
                self.responses.append(response.json())

        return httpx.Client(timeout=300, event_hooks={"request": [self._request], "response": [on_response]})

    def async_client(self) -> httpx.AsyncClient:
        """An ``httpx.AsyncClient`` that records into this wire."""

        async def on_request(request: httpx.Request) -> None:
            self._request(request)

        async def on_response(response: httpx.Response) -> None:
            if self._is_json(response):
                await response.aread()
                self.responses.append(response.json())

        return httpx.AsyncClient(timeout=300, event_hooks={"request": [on_request], "response": [on_response]})

    def finish_reasons(self) -> list[str]:
        """``choices[0].finish_reason`` of each recorded chat completion (non-streamed)."""
        return [r["choices"][0]["finish_reason"] for r in self.responses if r.get("object") == "chat.completion"]
