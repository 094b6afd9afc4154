"""Run one request on the :class:`Backend`: start it, then stream it as SSE or collect it.

Contract with the HTTP layer:

* :func:`start_generation` submits the request **and waits for its first event**
  before any response byte is sent, so queue-full (503 + ``retry-after``), a response
  format the backend refuses (400), engine failures before the first token and not-ready
  errors are real HTTP errors, also for ``stream: true``. A client that disconnects while queued aborts the request.
* :func:`sse_events` frames events as ``data: <json>\\n\\n`` and ends with
  ``data: [DONE]\\n\\n``; a failure after streaming began becomes one
  ``data: {"error": {...}}`` event followed by ``[DONE]``.
* Whatever ends the stream (completion, client disconnect → task cancellation,
  error), the backend's iterator is closed with ``aclose()``, which aborts the
  request in the engine (see ``Backend.generate``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Awaitable, Callable, Sequence, TypeVar

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.core.errors import (
    APIError, SERVER_ERROR, error_body, invalid_request, model_not_ready, overloaded, runtime_failure, server_error,
)
from gateway.openai.formatters import Formatter, sse
from gateway.observability.observe import REJECTED, RequestContext, RequestObserver, RequestOutcome, notify, observed
from runtime.interface import (
    Backend, Event, Failed, Finished, FinishReason, GenerationRequest, GrammarError, QueueFullError, TextDelta,
    TokenLogprob,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
CLOSE_TIMEOUT_S = 10.0


class ClientDisconnected(APIError):
    """The client went away before the response started (never seen by anyone)."""

    def __init__(self) -> None:
        super().__init__(499, "Client closed the request", code="client_closed_request")


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def unless_disconnected(request: Request, fn: Callable[[], Awaitable[T]]) -> T:
    """Await ``fn()`` in this task; if the client disconnects first, cancel it (the
    cancellation reaches the backend iterator being awaited, which aborts) and raise
    :class:`ClientDisconnected`. Call only after the request body has been read."""
    with anyio.CancelScope() as scope:
        watcher = asyncio.create_task(_cancel_on_disconnect(request.receive, scope))
        try:
            return await fn()
        finally:
            watcher.cancel()
    raise ClientDisconnected()


async def close_events(events: object) -> None:
    """``await events.aclose()`` shielded from cancellation (the task may be being
    cancelled because the client left), bounded by :data:`CLOSE_TIMEOUT_S`."""
    aclose = getattr(events, "aclose", None)
    if aclose is None:
        return
    with anyio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
        try:
            await aclose()
        except Exception:  # a failing close must not mask the real outcome
            log.exception("error while closing a backend event stream")


def failure_error(event: Failed | Finished) -> APIError:
    """The error for a :class:`Failed` event: 500 ``server_error``, or 502/503/504 for a failed
    upstream (:func:`gateway.core.errors.runtime_failure`); 500 for an abnormal ``Finished``."""
    if isinstance(event, Failed):
        return runtime_failure(event.message or "The engine failed while generating.", event.code)
    return server_error(f"The request ended with finish_reason '{event.finish_reason.value}'.",
                        "request_aborted")


def response_format_param(exc: GrammarError) -> str:
    """Where a refused ``response_format`` points: ``response_format.json_schema.schema.<path
    to the keyword>``, or ``response_format`` for the schema as a whole."""
    return "response_format" if exc.param is None else f"response_format.json_schema.schema.{exc.param}"


def grammar_error(exc: GrammarError, param_of: Callable[[GrammarError], str | None] = response_format_param) -> APIError:
    """400 for a response format (JSON or tool calls) the backend refused; ``param_of`` says
    where it points into the request (:func:`response_format_param`,
    :func:`gateway.openai.tools.grammar_param`)."""
    return invalid_request(exc.message, param_of(exc), exc.code)


def start_error(exc: BaseException,
                grammar_param: Callable[[GrammarError], str | None] = response_format_param) -> BaseException:
    """What to raise for ``exc`` raised while a generation starts: 503 for a full queue
    (raised by ``generate()`` or by the first ``__anext__()``), 400 for a refused response
    format (``param`` by ``grammar_param``), 500 for a stream that ended without an event;
    anything else as it is."""
    if isinstance(exc, QueueFullError):
        return overloaded(str(exc) or "The engine queue is full.", exc.retry_after_s)
    if isinstance(exc, GrammarError):
        return grammar_error(exc, grammar_param)
    if isinstance(exc, StopAsyncIteration):
        return server_error("The engine ended the request without a result.")
    return exc


def is_normal_finish(event: Event) -> bool:
    return isinstance(event, Finished) and event.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


class EventStream:
    """A started generation: its first event (already received) followed by the rest."""

    def __init__(self, events: AsyncIterator[Event], first: Event):
        self._events = events
        self._first: Event | None = first

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> Event:
        if self._first is not None:
            event, self._first = self._first, None
            return event
        return await self._events.__anext__()

    async def aclose(self) -> None:
        await close_events(self._events)


async def start_generation(
    backend: Backend,
    gen_request: GenerationRequest,
    request: Request,
    ctx: RequestContext | None = None,
    observers: Sequence[RequestObserver] = (),
    grammar_param: Callable[[GrammarError], str | None] = response_format_param,
) -> EventStream:
    """Submit ``gen_request`` and wait for its first event (see module docstring).

    With ``ctx``, the event stream is wrapped by :func:`gateway.observability.observe.observed`, so
    every observer sees this request's outcome exactly once (also when it is rejected).
    ``grammar_param``: where a refused response format points in the request (:func:`grammar_error`).

    Raises:
        APIError: 503 ``model_not_ready`` / ``queue_full`` (with ``retry-after``), 400 when the
            backend refuses the response format (:func:`grammar_error`), 500 when the engine
            fails or aborts before the first token (502/503/504 for a failed upstream,
            :func:`failure_error`), 499 when the client left.
    """
    if not backend.ready():
        raise model_not_ready()
    events: AsyncIterator[Event] | None = None
    try:
        try:
            events = backend.generate(gen_request)
        except QueueFullError as exc:  # refused before any stream existed: still one outcome
            if ctx is not None:
                notify(observers, RequestOutcome(ctx, REJECTED, error_code="queue_full", error_message=str(exc),
                                                 prompt_tokens=ctx.prompt_tokens))
            raise
        if ctx is not None:
            events = observed(events, ctx, observers)
        first = await unless_disconnected(request, events.__anext__)
    except BaseException as exc:
        if events is not None:
            await close_events(events)
        err = start_error(exc, grammar_param)
        if err is exc:
            raise
        raise err from None
    stream = EventStream(events, first)
    if isinstance(first, Failed) or (isinstance(first, Finished) and not is_normal_finish(first)):
        await stream.aclose()
        raise failure_error(first)
    return stream


async def collect(stream: EventStream, request: Request) -> tuple[str, Finished, list[TokenLogprob] | None]:
    """Non-streaming: join all text deltas; returns ``(text, finished, logprobs)``
    (``logprobs``: all tokens' entries in order, ``None`` when no delta carried any).

    Raises:
        APIError: 500 on ``Failed``/abnormal finish (502/503/504 for a failed upstream,
            :func:`failure_error`), 499 when the client left (aborted).
    """

    async def run() -> tuple[str, Finished, list[TokenLogprob] | None]:
        parts: list[str] = []
        logprobs: list[TokenLogprob] | None = None
        async for event in stream:
            if isinstance(event, TextDelta):
                parts.append(event.text)
                if event.logprobs is not None:
                    logprobs = logprobs if logprobs is not None else []
                    logprobs.extend(event.logprobs)
            elif is_normal_finish(event):
                return "".join(parts), event, logprobs
            else:
                raise failure_error(event)
        raise server_error("The engine ended the request without a result.")

    try:
        return await unless_disconnected(request, run)
    finally:
        await stream.aclose()


async def sse_events(
    stream: EventStream,
    fmt: Formatter,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """Streaming: SSE bytes of the whole response (role chunk, one chunk per delta with
    text or logprobs, finish chunk, optional usage chunk, ``[DONE]``)."""
    try:
        for payload in fmt.opening():
            yield sse(payload)
        async for event in stream:
            if isinstance(event, TextDelta):
                if event.text or event.logprobs:
                    data = fmt.delta_sse(event.text, event.logprobs)
                    if data:
                        yield data
            elif is_normal_finish(event):
                for payload in fmt.finish(event):
                    yield sse(payload)
                if include_usage:
                    yield sse(fmt.usage_chunk(event))
                break
            else:
                yield sse(failure_error(event).body())
                break
        else:
            yield sse(error_body("The engine ended the request without a result.", SERVER_ERROR, None, "engine_error"))
        yield DONE
    except Exception:
        log.exception("error while streaming %s", fmt.id)
        yield sse(error_body("The server had an error while streaming the response.", SERVER_ERROR, None,
                             "internal_error"))
        yield DONE
    finally:
        await stream.aclose()


class SSEResponse(StreamingResponse):
    """``text/event-stream`` response that always closes its body generator, even when
    the server reports a client disconnect as a failed send (ASGI ≥ 2.4 fast path)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes]):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:  # the client is gone; nobody is left to tell
            log.debug("client disconnected during an SSE response")
        finally:
            await close_events(self.body_iterator)
