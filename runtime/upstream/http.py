"""HTTP helpers shared by the clients that stream from upstream servers."""

from __future__ import annotations

import json

import httpx

#: HTTP statuses meaning "busy, try another server or later" (→ ``QueueFullError``).
BUSY_STATUS = (429, 503)


def error_message(body: bytes) -> str:
    """Best-effort message from an error body (OpenAI ``{"error": {"message"}}``, FastAPI
    ``{"detail"}``, vLLM's older ``{"message"}``, or plain text; at most 500 characters)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")[:500]
    if isinstance(data, dict):
        err = data.get("error", data.get("detail", data.get("message")))
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
    return str(data)[:500]


def retry_after(resp: httpx.Response, default: float) -> float:
    """The response's ``Retry-After`` in seconds (``default`` when absent or not a number)."""
    try:
        return max(0.0, float(resp.headers.get("retry-after", default)))
    except ValueError:
        return default
