"""``n`` > 1: independent choices of one request (OpenAI API reference, "Chat" and
"Completions", ``n``).

Each choice is an engine request of its own (:func:`choice_requests`): the same prompt and
parameters, id ``<id>-<i>`` for i ≥ 1 and, with a ``seed``, seed + i (choice 0 keeps the
response id and the seed, so it is what ``n: 1`` would have answered). They are submitted
together and decode in the same batches. As for one choice
(:func:`gateway.openai.generation.start_generation`), the first event of every choice is
awaited before the response starts, so a full queue is a 503 and an engine failure before
the first token a 500 also with ``stream: true``.

Response, in OpenAI's shape: non-streamed, ``choices[i]`` with ``index`` i, in order;
streamed, each choice's role chunk first, then the choices' chunks interleaved as the engine
produces them, each with its ``index``, one finish chunk per choice (with its own
``spec_stats`` when asked), then — with ``stream_options.include_usage`` — one usage chunk,
and ``[DONE]``. ``usage``: the prompt counted once and the completion tokens summed over
the choices (OpenAI's rule); ``cached_tokens`` the fewest any choice reused; a non-streamed
``spec_stats`` sums the choices'. A failure of any choice ends the whole response (500, or
one error event when streaming).

Accounting: the API request stays ONE request for the observers (records, metrics,
admission). Each choice's stream is observed into :class:`ChoiceOutcomes`, which reports
their merged outcome (:func:`merge_outcomes`) once. Admission reserves
``prompt + n · max_tokens`` tokens (``RequestContext.choices``) and bills what was served,
as for any request; a tenant's ``max_concurrent`` counts the request once.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
from typing import AsyncIterator, Callable, Sequence

from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from gateway.core.errors import SERVER_ERROR, error_body, model_not_ready, server_error
from gateway.observability.observe import (
    CANCELLED, FAILED, FINISHED, REJECTED, RequestContext, RequestObserver, RequestOutcome, notify, observed,
)
from gateway.openai.formatters import Formatter
from gateway.openai.tool_parser import ToolCallParser
from gateway.openai.generation import (
    DONE, EventStream, SSEResponse, close_events, failure_error, is_normal_finish, response_format_param, sse,
    start_error, unless_disconnected,
)
from runtime.interface import (
    Backend, Event, Failed, Finished, FinishReason, GenerationRequest, GrammarError, QueueFullError, RequestTimings, SpecStats,
    TextDelta, TokenLogprob,
)

log = logging.getLogger(__name__)

SEED_MAX = 2**64 - 1  # the schema's largest seed; seed + i wraps below it (the engine reduces mod 2**64)


def choice_requests(request: GenerationRequest, n: int) -> list[GenerationRequest]:
    """The ``n`` engine requests of ``request``'s choices (module docstring); ``[request]`` for n = 1."""
    out = [request]
    seed = request.sampling.seed
    for i in range(1, n):
        s = None if seed is None else (seed + i if seed + i <= SEED_MAX else seed + i - 2**64)
        out.append(dataclasses.replace(request, request_id=f"{request.request_id}-{i}",
                                       sampling=dataclasses.replace(request.sampling, seed=s)))
    return out


# ---------------------------------------------------------------- one outcome for n choices

def _merge_timings(timings: Sequence[RequestTimings | None]) -> RequestTimings | None:
    ts = [t for t in timings if t is not None]
    if not ts:
        return None

    def pick(name: str, fn):
        vals = [getattr(t, name) for t in ts if getattr(t, name)]
        return fn(vals) if vals else None

    return RequestTimings(wall_queued=pick("wall_queued", min) or 0.0, queued=pick("queued", min) or 0.0,
                          started=pick("started", min), first_token=pick("first_token", min),
                          last_token=pick("last_token", max), finished=pick("finished", max))


def _merge_spec(specs: Sequence[SpecStats | None]) -> SpecStats | None:
    specs = [s for s in specs if s is not None]
    if not specs:
        return None
    out = SpecStats()
    for s in specs:
        for name in ("rounds", "drafted", "verified", "accepted", "emitted", "gated_rounds"):
            setattr(out, name, getattr(out, name) + getattr(s, name))
        per = s.accepted_per_position
        out.accepted_per_position += [0] * (len(per) - len(out.accepted_per_position))
        for j, c in enumerate(per):
            out.accepted_per_position[j] += c
    return out


def merge_finished(finishes: Sequence[Finished]) -> Finished:
    """One :class:`Finished` for the choices' (usage and ``spec_stats`` of the response):
    completion tokens summed, the prompt once, ``cached_tokens`` the minimum (``None`` if any
    is unknown), ``length`` if any choice was cut, speculative stats summed."""
    cached = [f.cached_tokens for f in finishes]
    reason = FinishReason.LENGTH if any(f.finish_reason is FinishReason.LENGTH for f in finishes) else FinishReason.STOP
    return Finished(reason, finishes[0].prompt_tokens, sum(f.completion_tokens for f in finishes),
                    _merge_timings([f.timings for f in finishes]) or RequestTimings(),
                    _merge_spec([f.spec for f in finishes]), None if None in cached else min(cached))


def _sum_known(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


_PRECEDENCE = (REJECTED, FAILED, CANCELLED, FINISHED)  # the merged status: the first any choice has


def merge_outcomes(ctx: RequestContext, outcomes: Sequence[RequestOutcome]) -> RequestOutcome:
    """The API request's outcome from its choices': the status of :data:`_PRECEDENCE` that
    any has (one rejected choice: the client got a 503/400, nothing was served), completion
    tokens summed, prompt tokens once, timings spanning all, token times merged, speculative
    stats summed, grammar-mask times summed; ``finish_reason`` ``length`` if any choice was cut,
    else ``stop``; the error of the first choice with the merged status."""
    status = next(s for s in _PRECEDENCE if any(o.status == s for o in outcomes))
    first = next(o for o in outcomes if o.status == status)
    merged = RequestOutcome(
        ctx, status, prompt_tokens=max(o.prompt_tokens for o in outcomes),
        completion_tokens=sum(o.completion_tokens for o in outcomes),
        timings=_merge_timings([o.timings for o in outcomes]), spec=_merge_spec([o.spec for o in outcomes]),
        token_times=sorted(t for o in outcomes for t in o.token_times), ended_mono=max(o.ended_mono for o in outcomes),
        grammar_mask_s=_sum_known([o.grammar_mask_s for o in outcomes]),
    )
    if status == FINISHED:
        merged.finish_reason = "length" if any(o.finish_reason == "length" for o in outcomes) else "stop"
    else:
        merged.error_code, merged.error_message = first.error_code, first.error_message
    return merged


class ChoiceOutcomes:
    """The observer of one request's ``n`` choice streams: once all n outcomes are in, it
    reports their :func:`merge_outcomes` to ``observers`` (exactly once; :meth:`close` ends
    the choices that never ran as cancelled, with no tokens)."""

    def __init__(self, ctx: RequestContext, n: int, observers: Sequence[RequestObserver]):
        self.ctx, self.n, self.observers = ctx, n, observers
        self.outcomes: list[RequestOutcome] = []

    def request_ended(self, outcome: RequestOutcome) -> None:
        if len(self.outcomes) < self.n:
            self.outcomes.append(outcome)
            if len(self.outcomes) == self.n:
                notify(self.observers, merge_outcomes(self.ctx, self.outcomes))

    def close(self) -> None:
        while len(self.outcomes) < self.n:
            self.request_ended(RequestOutcome(self.ctx, CANCELLED, prompt_tokens=self.ctx.prompt_tokens))


# ---------------------------------------------------------------- running the choices

async def _first_event(stream: AsyncIterator[Event]) -> Event:
    return await stream.__anext__()


async def _close_all(streams: Sequence) -> None:
    await asyncio.gather(*(close_events(s) for s in streams))


async def start_choices(
    backend: Backend,
    requests: Sequence[GenerationRequest],
    request: Request,
    ctx: RequestContext,
    observers: Sequence[RequestObserver],
    grammar_param: Callable[[GrammarError], str | None] = response_format_param,
) -> list[EventStream]:
    """Submit every choice's request and wait for each one's first event (module docstring;
    ``grammar_param`` as for :func:`gateway.openai.generation.start_generation`).

    Raises:
        APIError: as :func:`gateway.openai.generation.start_generation` (503 queue full or not
            ready, 400 refused response format, 500 engine failure before the first token,
            499 client gone); every choice already submitted is aborted first.
    """
    if not backend.ready():
        raise model_not_ready()
    outcomes = ChoiceOutcomes(ctx, len(requests), observers)
    streams: list[AsyncIterator[Event]] = []
    tasks: list[asyncio.Task] = []
    try:
        for req in requests:
            try:
                events = backend.generate(req)
            except QueueFullError as exc:  # refused before any stream existed: still an outcome
                outcomes.request_ended(RequestOutcome(ctx, REJECTED, error_code="queue_full", error_message=str(exc),
                                                      prompt_tokens=ctx.prompt_tokens))
                raise
            streams.append(observed(events, ctx, [outcomes]))
        tasks = [asyncio.ensure_future(_first_event(s)) for s in streams]

        async def all_first() -> list[Event]:
            return list(await asyncio.gather(*tasks))

        firsts = await unless_disconnected(request, all_first)
    except BaseException as exc:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close_all(streams)
        outcomes.close()
        err = start_error(exc, grammar_param)
        if err is exc:
            raise
        raise err from None
    started = [EventStream(s, f) for s, f in zip(streams, firsts)]
    bad = next((f for f in firsts if isinstance(f, Failed) or (isinstance(f, Finished) and not is_normal_finish(f))),
               None)
    if bad is not None:
        await _close_all(started)
        raise failure_error(bad)
    return started


_END = object()


async def interleave(streams: Sequence[EventStream]) -> AsyncIterator[tuple[int, Event]]:
    """``(choice index, event)`` of every stream, as the events arrive, each stream up to its
    terminal event. An exception of a stream is raised here; closing this closes every stream."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: EventStream) -> None:
        try:
            async for event in stream:
                queue.put_nowait((i, event))
                if isinstance(event, (Finished, Failed)):
                    break
        except Exception as exc:  # noqa: BLE001 — handed to the consumer
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, _END))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            i, item = await queue.get()
            if item is _END:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close_all(streams)


def indexed(payload: dict, index: int) -> dict:
    """``payload`` (a formatter's chunk or object) with ``index`` on each of its choices."""
    for choice in payload.get("choices", ()):
        choice["index"] = index
    return payload


def choice_formatter(fmt: Formatter, index: int) -> Formatter:
    """A formatter for choice ``index``: the same id, created and model, its own state (logprobs
    offsets; with tools, its own streaming tool-call parser)."""
    out = copy.copy(fmt)
    if fmt.logprobs is not None:
        out.logprobs = fmt.logprobs.fresh()
    if getattr(fmt, "parser", None) is not None:
        out.parser = ToolCallParser(fmt.parser.new_id)
    return out


async def collect_choices(
    streams: Sequence[EventStream], request: Request
) -> list[tuple[str, Finished, list[TokenLogprob] | None]]:
    """Non-streaming: per choice, ``(text, finished, logprobs)`` as
    :func:`gateway.openai.generation.collect` returns for one.

    Raises:
        APIError: 500 when any choice fails, 499 when the client left (all aborted).
    """

    async def run() -> list[tuple[str, Finished, list[TokenLogprob] | None]]:
        texts: list[list[str]] = [[] for _ in streams]
        logprobs: list[list[TokenLogprob] | None] = [None] * len(streams)
        ends: list[Finished | None] = [None] * len(streams)
        events = interleave(streams)
        try:
            async for i, event in events:
                if isinstance(event, TextDelta):
                    texts[i].append(event.text)
                    if event.logprobs is not None:
                        logprobs[i] = (logprobs[i] or []) + list(event.logprobs)
                elif is_normal_finish(event):
                    ends[i] = event
                else:
                    raise failure_error(event)
        finally:
            await events.aclose()
        if any(e is None for e in ends):
            raise server_error("The engine ended the request without a result.")
        return [("".join(t), e, lp) for t, e, lp in zip(texts, ends, logprobs)]

    try:
        return await unless_disconnected(request, run)
    finally:
        await _close_all(streams)


def complete_choices(fmts: Sequence[Formatter], results: Sequence[tuple[str, Finished, list[TokenLogprob] | None]]) -> dict:
    """The non-streamed response object of ``n`` choices (``fmts[i]``: choice i's formatter)."""
    bodies = [fmts[i].complete(text, fin, lps) for i, (text, fin, lps) in enumerate(results)]
    out = bodies[0]
    out["choices"] = [indexed(body, i)["choices"][0] for i, body in enumerate(bodies)]
    merged = merge_finished([fin for _, fin, _ in results])
    out["usage"] = fmts[0].usage(merged).model_dump(mode="json")
    if "spec_stats" in out:
        out["spec_stats"] = fmts[0].spec_stats(merged)
    return out


async def sse_choices(streams: Sequence[EventStream], fmts: Sequence[Formatter], include_usage: bool) -> AsyncIterator[bytes]:
    """Streaming: the SSE bytes of ``n`` choices (module docstring); as
    :func:`gateway.openai.generation.sse_events` for one."""
    events = interleave(streams)
    try:
        for i, fmt in enumerate(fmts):
            for payload in fmt.opening():
                yield sse(indexed(payload, i))
        ends: list[Finished | None] = [None] * len(fmts)
        failed = False
        async for i, event in events:
            if isinstance(event, TextDelta):
                if event.text or event.logprobs:
                    for payload in fmts[i].delta(event.text, event.logprobs):
                        yield sse(indexed(payload, i))
            elif is_normal_finish(event):
                ends[i] = event
                for payload in fmts[i].finish(event):
                    yield sse(indexed(payload, i))
            else:
                yield sse(failure_error(event).body())
                failed = True
                break
        if not failed:
            if all(e is not None for e in ends):
                if include_usage:
                    yield sse(fmts[0].usage_chunk(merge_finished(ends)))
            else:
                yield sse(error_body("The engine ended the request without a result.", SERVER_ERROR, None,
                                     "engine_error"))
        yield DONE
    except Exception:
        log.exception("error while streaming %s", fmts[0].id)
        yield sse(error_body("The server had an error while streaming the response.", SERVER_ERROR, None,
                             "internal_error"))
        yield DONE
    finally:
        await events.aclose()
        await _close_all(streams)


async def respond_choices(
    request: Request,
    backend: Backend,
    gen_request: GenerationRequest,
    n: int,
    ctx: RequestContext,
    observers: Sequence[RequestObserver],
    fmt: Formatter,
    stream: bool,
    include_usage: bool,
    grammar_param: Callable[[GrammarError], str | None] = response_format_param,
) -> Response:
    """Run ``n`` choices of ``gen_request`` and build the HTTP response (SSE or JSON)."""
    streams = await start_choices(backend, choice_requests(gen_request, n), request, ctx, observers, grammar_param)
    fmts = [choice_formatter(fmt, i) for i in range(n)]
    if stream:
        return SSEResponse(sse_choices(streams, fmts, include_usage))
    return JSONResponse(complete_choices(fmts, await collect_choices(streams, request)))
