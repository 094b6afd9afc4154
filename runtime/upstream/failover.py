"""Opening a stream on the least-loaded healthy upstream, failing over: shared by the clients
that stream from remote servers (:mod:`runtime.upstream.client`, :mod:`runtime.sglang.client`).

An upstream that refuses the connection is marked down (the router's health checks bring it
back) and the next one is tried; one that is busy (HTTP 429/503, or at the client's in-flight
cap) is skipped, and when every reachable one was busy the request is a
:class:`~runtime.interface.QueueFullError` with the busiest answer's ``Retry-After``; any other
non-200 answer ends the request (:class:`OpenFailure`): ``upstream_bad_request`` for HTTP
400/413/422 (the server refused this request — a prompt longer than its context, a value it does
not take — which the gateway answers 400 with the server's message), else ``upstream_error``.
"""

from __future__ import annotations

import time
from typing import Any, Awaitable, Callable

import httpx

from runtime.interface import Failed, QueueFullError, RequestTimings
from runtime.upstream.http import BUSY_STATUS, error_message, retry_after
from runtime.upstream.router import NoHealthyUpstream, Upstream, UpstreamRouter


BAD_REQUEST_STATUS = frozenset({400, 413, 422})  # the server refuses the request itself


class OpenFailure(Exception):
    """A terminal :class:`Failed` found while opening the stream."""

    def __init__(self, event: Failed) -> None:
        super().__init__(event.message)
        self.event = event


class _Busy(Exception):
    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


async def open_stream(
    router: UpstreamRouter,
    send: Callable[[Upstream], Awaitable[httpx.Response]],
    *,
    path: str,
    server: str,
    pool: str,
    cap: int | None,
    retry_after_s: float,
    on_send_error: Callable[[Upstream, BaseException], None] | None = None,
) -> tuple[Upstream, httpx.Response]:
    """``send`` the request (a streamed POST to ``path``) to the least-loaded healthy upstream,
    failing over (module docstring). The returned upstream is acquired; its response is 200.

    Args:
        send: sends the request to one upstream and returns the streamed response (headers read).
        server, pool: how messages name one upstream (``f"{server} {url}"``) and all of them.
        cap: in-flight requests per upstream beyond which it counts as busy (``None``: none).
        retry_after_s: ``Retry-After`` of a busy answer without one, and of the cap.
        on_send_error: called (after the upstream is released) for an exception of ``send``
            other than a refused connection, before it propagates: it may raise the
            :class:`OpenFailure` it stands for, or start clean-up (a cancellation included).

    Raises:
        QueueFullError: every reachable upstream is busy.
        NoHealthyUpstream: none is reachable.
        OpenFailure: a non-200, non-busy answer (``upstream_error``), or what ``on_send_error`` raised.
    """
    tried: list[Upstream] = []
    busy: _Busy | None = None
    while True:
        try:
            upstream = router.pick(exclude=tried)
        except NoHealthyUpstream:
            if busy is not None:
                raise QueueFullError(str(busy), busy.retry_after_s) from None
            raise
        tried.append(upstream)
        if cap is not None and upstream.in_flight >= cap:
            busy = _Busy(f"all {pool} are at {cap} in-flight requests", retry_after_s)
            continue
        router.acquire(upstream)
        try:
            resp = await send(upstream)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            router.release(upstream)
            router.mark_down(upstream, f"{path}: {type(exc).__name__}: {exc}")
            continue
        except BaseException as exc:  # cancelled while waiting for the headers, or a failed send
            router.release(upstream)
            if on_send_error is not None:
                on_send_error(upstream, exc)
            raise
        if resp.status_code == 200:
            return upstream, resp
        router.release(upstream)
        try:
            text = await resp.aread()
        except httpx.HTTPError:
            text = b""
        finally:
            await resp.aclose()
        message = f"{server} {upstream.url} answered HTTP {resp.status_code}: {error_message(text)}"
        if resp.status_code in BUSY_STATUS:
            busy = _Busy(message, retry_after(resp, retry_after_s))
            continue
        code = "upstream_bad_request" if resp.status_code in BAD_REQUEST_STATUS else "upstream_error"
        raise OpenFailure(Failed(message, code=code))


async def open_or_failed(
    build: Callable[[], Any],
    open_: Callable[[Any], Awaitable[tuple[Upstream, httpx.Response]]],
    prompt_tokens: int,
    timings: RequestTimings,
) -> tuple[Upstream, httpx.Response] | Failed:
    """Build a request's payload and open its stream (``open_(build())``, e.g. with
    :func:`open_stream`), or the terminal event to yield instead: the payload could not be built
    (``ValueError`` → ``invalid_request``), no upstream is healthy (``upstream_unavailable``) or
    opening failed (:class:`OpenFailure`'s event). The event carries ``prompt_tokens`` and
    ``timings`` with ``finished`` set.

    Raises:
        QueueFullError: from ``open_`` (every reachable upstream busy), unchanged.
    """
    try:
        return await open_(build())
    except (ValueError, NoHealthyUpstream) as exc:
        event = Failed(str(exc), code="upstream_unavailable" if isinstance(exc, NoHealthyUpstream) else "invalid_request")
    except OpenFailure as exc:
        event = exc.event
    timings.finished = time.monotonic()
    event.prompt_tokens, event.timings = prompt_tokens, timings
    return event
