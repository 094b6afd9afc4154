"""The OpenAI-compatible upstream backend: :class:`runtime.interface.Backend` over one or more
servers' ``POST /v1/completions`` (vLLM, SGLang, llama-server, any server that accepts a
token-id ``prompt``), behind the gateway's own auth, tiers, limits, records and metrics.

Request: :func:`runtime.upstream.payload.build_completions_payload` (the gateway's token ids as
``prompt``, sampling fields, ``stream_options.include_usage``, optionally ``priority``).

Stream (:mod:`runtime.upstream.chunks`): each chunk's ``text`` is fed to a
:class:`runtime.upstream.assembler.StreamAssembler` (incremental mode), which holds back a
text tail that could still become a stop string and cuts at a match, as for SGLang, so the
stop text is never returned whatever the server does with it. Token counts: a chunk counts
``len(token_ids)`` tokens when the server sends ids (``return_token_ids``, or logprobs), else one
if it has text; the final ``usage`` (prompt, completion and cached tokens) overrides the
counts on :class:`~runtime.interface.Finished`. ``TextDelta.token_ids`` are the server's ids
when it sends them, else empty. Timings are client-side (``time.monotonic()`` at chunk
arrival). The :class:`~runtime.interface.Finished` event comes after the usage chunk (or
``[DONE]``, or the end of the body), the last text at the finishing chunk.

Errors (the ``code`` of the :class:`~runtime.interface.Failed` event; the gateway answers
``upstream_*`` codes with 502/503/504, :func:`gateway.openai.generation.failure_error`):

* connection refused or connect timeout → that upstream is ejected
  (:meth:`runtime.upstream.router.UpstreamRouter.mark_down`) and the next healthy one is
  tried (nothing was sent); none left → ``upstream_unavailable`` (503);
* HTTP 429/503 → the next upstream; all busy → :class:`~runtime.interface.QueueFullError`
  (503 ``queue_full``, the upstream's ``Retry-After``);
* any other HTTP error status, an error object inside the stream, ``finish_reason: "abort"``
  → ``upstream_error`` (502), the upstream's message kept;
* a stream that breaks or ends before a finish reason → ``upstream_disconnected`` (502); a
  chunk that is not a completions chunk → ``upstream_protocol_error`` (502);
* no headers or no chunk within ``read_timeout_s`` (or the request's wall-clock limit, when
  shorter), or a chunk after that limit → ``upstream_timeout`` (504). The limit is checked at
  each chunk, not by a timer per read (a few µs a chunk saved): a silent stream fails after
  the read timeout.

Whenever the iterator ends before the server finished (client disconnect: ``aclose()`` or task
cancellation; or a failure above) the HTTP response is closed, which closes its connection:
vLLM, SGLang and llama-server abort a request whose client went away. The close runs in a
task of its own, so it also happens while the consumer's task is being cancelled. A stream the
server finished is read to its end first, so its connection goes back to the pool.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, AsyncIterator

import httpx

from runtime.interface import (
    BackendInfo,
    Event,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    LoadSnapshot,
    QueueFullError,
    RequestTimings,
    SpecInfo,
    TokenLogprob,
)
from runtime.upstream.assembler import ProtocolError, StreamAssembler
from runtime.upstream.chunks import UpstreamStreamError, parse_chunk
from runtime.upstream.config import UpstreamConfig
from runtime.upstream.failover import OpenFailure, open_or_failed, open_stream
from runtime.upstream.http import BUSY_STATUS
from runtime.upstream.payload import build_completions_payload
from runtime.upstream.remote import RemoteBackend
from runtime.upstream.router import Upstream, UpstreamRouter

log = logging.getLogger(__name__)

LABEL = "OpenAI-compatible"
FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}
DRAIN_TIMEOUT_S = 1.0


async def sse_data(resp: httpx.Response) -> AsyncIterator[str]:
    """The ``data:`` payloads of an SSE body, in order (other fields and comments skipped;
    ``\\n`` or ``\\r\\n`` line ends; a last line without its newline is dropped, as an
    unfinished event)."""
    buffer = b""
    async for raw in resp.aiter_bytes():
        buffer = buffer + raw if buffer else raw
        start = 0
        while (end := buffer.find(b"\n", start)) >= 0:
            line = buffer[start:end]
            start = end + 1
            if line.startswith(b"data:"):
                yield line[5:].strip().decode("utf-8")
        buffer = buffer[start:]


class OpenAIUpstreamBackend(RemoteBackend):
    """:class:`runtime.interface.Backend` streaming from OpenAI-compatible servers (module
    docstring).

    Args:
        config: :class:`UpstreamConfig`.
        tokenizer: injected tokenizer (tests); loaded from ``config.tokenizer_path`` otherwise.
        transport: injected httpx transport (tests).
    """

    label = LABEL

    def __init__(self, config: UpstreamConfig, *, tokenizer: Any = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        super().__init__(config, UpstreamRouter(config.urls, api_keys=config.keys, health_path=config.health_path,
                                                health_timeout_s=config.health_timeout_s, label=LABEL),
                         tokenizer=tokenizer, transport=transport)
        self._info: BackendInfo | None = None

    # -- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        """Load the tokenizer, open the HTTP client, probe the upstreams once and start the
        periodic health checks. Starting with no healthy upstream is allowed: requests then
        fail with ``upstream_unavailable`` (503) until a probe finds one."""
        await self._open_client(max_keepalive=256)
        self._health_task = asyncio.create_task(self.router.run(self._client, self.config.health_interval_s),
                                                name="upstream-health")

    def ready(self) -> bool:
        """True once started: the gateway serves (and answers 503 ``upstream_unavailable``
        while no upstream is healthy, with a request record)."""
        return self._client is not None and self._tokenizer is not None

    @property
    def info(self) -> BackendInfo:
        """The served model's facts (read several times per request: built once the tokenizer is loaded)."""
        if self._info is not None:
            return self._info
        vocab = len(self._tokenizer) if self._tokenizer is not None else None
        info = BackendInfo(self.config.model_name, self.config.max_context, self._eos_token_id(),
                           supports_logprobs=self.config.logprobs,
                           supports_response_format=self.config.response_format,
                           chat_template_tools=self.chat_template_tools, vocab_size=vocab)
        if self._tokenizer is not None:
            self._info = info
        return info

    def load(self) -> LoadSnapshot:
        """``running`` = our in-flight requests; ``waiting`` = 0 and ``forward_steps`` = 0 (not
        observable through the OpenAI API); ``max_batch`` = the admission cap × healthy
        servers, else 0."""
        cap = self.config.max_in_flight_per_upstream
        return LoadSnapshot(sum(u.in_flight for u in self.router.upstreams), 0,
                            cap * len(self.router.healthy()) if cap else 0, 0)

    def spec_info(self) -> SpecInfo:
        """``SpecInfo("upstream")``: how the servers decode is not reported by the OpenAI API."""
        return SpecInfo(method="upstream")

    # -- opening --------------------------------------------------------------------
    async def _open(self, payload: dict, read_timeout: float) -> tuple[Upstream, httpx.Response]:
        """POST ``/v1/completions`` (:func:`runtime.upstream.failover.open_stream`);
        ``read_timeout``: the longest wait for the headers and then between two reads
        (seconds). No headers within it → ``upstream_timeout``; another HTTP error →
        ``upstream_disconnected`` (:class:`OpenFailure`)."""
        body = json.dumps(payload, separators=(",", ":")).encode()
        timeout = httpx.Timeout(read_timeout, connect=self.config.connect_timeout_s)

        def send(upstream: Upstream):
            req = self._client.build_request("POST", upstream.url + "/v1/completions", content=body,
                                             headers={"Content-Type": "application/json", **upstream.headers},
                                             timeout=timeout)
            return self._client.send(req, stream=True)

        def send_error(upstream: Upstream, exc: BaseException) -> None:
            if isinstance(exc, httpx.TimeoutException):
                raise OpenFailure(Failed(f"{LABEL} upstream {upstream.url} sent no response headers within "
                                         f"{read_timeout:g} s ({type(exc).__name__})",
                                         code="upstream_timeout")) from None
            if isinstance(exc, httpx.HTTPError):
                raise OpenFailure(Failed(f"{LABEL} upstream {upstream.url} failed: {type(exc).__name__}: {exc}",
                                         code="upstream_disconnected")) from None
            # cancelled while waiting for the headers: httpx closed the connection

        return await open_stream(self.router, send, path="/v1/completions", server=f"{LABEL} upstream",
                                 pool=f"{LABEL} upstreams", cap=self.config.max_in_flight_per_upstream,
                                 retry_after_s=self.config.retry_after_s, on_send_error=send_error)

    @staticmethod
    async def _close(resp: httpx.Response, lines: AsyncIterator[str], drain: bool) -> None:
        """Close the SSE reader and the response: mid-body (``drain`` false) that closes the
        connection, the abort; after ``[DONE]`` (``drain``) the rest of the body (the chunked
        terminator) is read first, within :data:`DRAIN_TIMEOUT_S`, so the connection goes back
        to the pool instead of being closed."""
        try:
            if drain:
                async with asyncio.timeout(DRAIN_TIMEOUT_S):
                    async for _ in lines:
                        pass
        except Exception:  # noqa: BLE001 — then the connection is closed below instead
            log.debug("draining an upstream stream failed", exc_info=True)
        try:
            await lines.aclose()
            await resp.aclose()
        except Exception:  # noqa: BLE001 — the connection is gone either way
            log.debug("closing an upstream stream failed", exc_info=True)

    # -- streaming ------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> AsyncIterator[Event]:
        """Stream ``request`` from an upstream (see the module docstring).

        Raises:
            QueueFullError: (before the first event) every upstream is busy.
            GrammarError: (before the first event) a response format that cannot be sent.
            RuntimeError: the backend was not started.
        """
        if self._client is None:
            raise RuntimeError(f"{LABEL} upstream backend not started")
        timings = RequestTimings(wall_queued=time.time(), queued=time.monotonic())
        limit = request.timeout_s or self.config.request_timeout_s
        deadline = timings.queued + limit
        prompt_len = len(request.prompt_token_ids)
        read_timeout = min(self.config.read_timeout_s, limit)
        opened = await open_or_failed(lambda: build_completions_payload(request, self.config),
                                      lambda payload: self._open(payload, read_timeout), prompt_len, timings)
        if isinstance(opened, Failed):
            yield opened
            return
        upstream, resp = opened
        timings.started = time.monotonic()
        num_top = request.sampling.logprobs
        asm = StreamAssembler(request.sampling.stop, incremental=True)
        pending_logprobs: list[TokenLogprob] = []
        reason: FinishReason | None = None
        usage: dict | None = None
        server_done = False
        where = f"{LABEL} upstream {upstream.url}"

        def failed(message: str, code: str) -> Failed:
            timings.finished = time.monotonic()
            return Failed(message, code=code, prompt_tokens=prompt_len, completion_tokens=asm.completion_tokens,
                          timings=timings)

        def finished() -> Finished:
            timings.finished = time.monotonic()
            u = usage or {}
            prompt = u.get("prompt_tokens")
            completion = u.get("completion_tokens")
            details = u.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            return Finished(reason, prompt if isinstance(prompt, int) else prompt_len,
                            completion if isinstance(completion, int) else asm.completion_tokens, timings,
                            cached_tokens=cached if isinstance(cached, int) else None)

        lines = sse_data(resp)
        try:
            while True:
                try:
                    if time.monotonic() >= deadline:  # checked per chunk; silence is the read timeout's
                        raise TimeoutError
                    data = await lines.__anext__()
                except StopAsyncIteration:
                    if reason is not None:  # finished, no [DONE]: the body simply ended
                        server_done = True
                        yield finished()
                        return
                    yield failed(f"{where} closed the stream before the request finished", "upstream_disconnected")
                    return
                except TimeoutError:
                    yield failed(f"request exceeded its {limit:g} s limit", "upstream_timeout")
                    return
                except httpx.TimeoutException as exc:
                    yield failed(f"{where} sent nothing for {read_timeout:g} s ({type(exc).__name__})",
                                 "upstream_timeout")
                    return
                except (httpx.HTTPError, UnicodeDecodeError) as exc:
                    yield failed(f"{where} stream broke: {type(exc).__name__}: {exc}", "upstream_disconnected")
                    return
                if data == "[DONE]":
                    server_done = True
                    if reason is None:
                        yield failed(f"{where} ended the stream without a finish reason", "upstream_protocol_error")
                    else:
                        yield finished()
                    return
                try:
                    chunk = parse_chunk(json.loads(data), num_top)
                except UpstreamStreamError as exc:
                    server_done = True  # the server ends the stream after an error object
                    if exc.status in BUSY_STATUS and asm.completion_tokens == 0 and reason is None:
                        raise QueueFullError(f"{where}: {exc.message}", self.config.retry_after_s) from None
                    yield failed(f"{where}: {exc.message}", "upstream_error")
                    return
                except (ProtocolError, ValueError) as exc:  # ValueError: json.JSONDecodeError
                    yield failed(f"malformed chunk from {where}: {exc}", "upstream_protocol_error")
                    return
                if chunk.usage is not None:
                    usage = chunk.usage
                if reason is not None:  # after the finishing chunk only usage is expected
                    continue
                ids = chunk.token_ids
                n = len(ids) if ids is not None else (1 if chunk.text else 0)
                if n:
                    now = time.monotonic()
                    if timings.first_token is None:
                        timings.first_token = now
                    timings.last_token = now
                    if chunk.logprobs:
                        pending_logprobs.extend(chunk.logprobs)
                asm.feed(chunk.text, ids, asm.completion_tokens + n)
                finish = chunk.finish_reason
                if finish is None:
                    delta = asm.release()
                    if delta is not None:
                        if pending_logprobs:
                            delta.logprobs, pending_logprobs = pending_logprobs, []
                        yield delta
                    continue
                reason = FINISH.get(finish)
                if reason is None:
                    server_done = finish == "abort"
                    message = (f"{where} aborted the request" if finish == "abort"
                               else f"unknown finish_reason {finish!r} from {where}")
                    yield failed(message, "upstream_error" if finish == "abort" else "upstream_protocol_error")
                    return
                matched = chunk.matched_stop if reason is FinishReason.STOP else None
                delta = asm.release(final=True, matched=matched)
                if delta is not None and (delta.text or pending_logprobs):
                    if pending_logprobs:
                        delta.logprobs, pending_logprobs = pending_logprobs, []
                    yield delta
        finally:
            self.router.release(upstream)
            if not server_done:
                log.debug("closing the %s stream of %s before it finished (abort)", LABEL, request.request_id)
            try:
                await asyncio.shield(self._spawn(self._close(resp, lines, drain=server_done)))
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 — _close logs its own failures
                pass
