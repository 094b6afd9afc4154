"""Request lifecycle observers: one place where every generation's outcome is seen.

:func:`observed` wraps the backend's event stream of one request. Whatever happens —
a normal finish, an engine failure, the client going away (the stream is closed
before a terminal event), a full queue — each registered :class:`RequestObserver`
gets exactly one :meth:`~RequestObserver.request_ended` call with a
:class:`RequestOutcome`. The DB request-record writer, the Prometheus metrics and
the in-process rolling stats are all observers (``app.state.observers``), so they
can never disagree about which requests happened.

Observers run on the event loop and must not block: enqueue and return.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol, Sequence

from runtime.interface import (
    Event,
    Failed,
    Finished,
    FinishReason,
    GrammarError,
    QueueFullError,
    RequestTimings,
    SpecStats,
    decode_tokens_per_s,
)

log = logging.getLogger(__name__)

FINISHED, FAILED, CANCELLED, REJECTED = "finished", "failed", "cancelled", "rejected"
STATUSES = (FINISHED, FAILED, CANCELLED, REJECTED)


def is_served(status: str, completion_tokens: int) -> bool:
    """Whether a request was *served* — the one definition of what is billed.

    Served: it reached a normal end in the engine (``finished``: stop/length), or it
    ``failed`` (engine error, timeout) or was ``cancelled`` (client disconnect) after the
    engine produced at least one completion token. A served request bills its prompt
    tokens plus the completion tokens actually produced; anything else bills 0 tokens:
    ``rejected`` requests (429 budget/rate limit/queue, 503 engine queue full), requests
    that failed or were cancelled before their first token (left while queued, engine
    refused or failed during prefill). Validation errors (400) never reach the engine
    and leave no record at all, except a response format the backend refuses (it is checked
    at submission: a ``rejected`` record with its code) and refused tools, ``tool_choice`` or
    tool messages (:func:`gateway.openai.respond.record_refusal`). Used for usage rollups, ``api_keys.tokens_used`` and the
    admission budget check alike.
    """
    return status == FINISHED or (status in (FAILED, CANCELLED) and completion_tokens > 0)


@dataclass
class RequestContext:
    """Who asked for what (fixed when the request is submitted to the backend).

    Attributes:
        request_id: the response id (``chatcmpl-…`` / ``cmpl-…`` / ``resp_…``).
        endpoint: ``"chat"``, ``"completions"`` or ``"responses"``.
        tenant, user: tenant name; the OpenAI ``user`` field or the key's user label.
        key_id: DB id of the API key (``None`` for the admin token).
        tier: SLA tier name, when tiers are configured.
        sla_target_tokens_per_s: the tier's per-user decode target, if any.
        priority: the tier's priority (larger = more important).
        predicted_tokens_per_s: admission's predicted decode tok/s for this request.
        admission_wait_s: seconds spent in the admission queue (rate limits, concurrency, SLA).
        received_wall: ``time.time()`` when the gateway submitted it (seconds).
        choices: ``n``, the independent choices it asked for (each an engine request of up
            to ``max_tokens``; :mod:`gateway.openai.choices` reports them as one outcome).
        constraint: what its output was constrained to: ``"json_object"`` or
            ``"json_schema"`` (chat ``response_format``), ``"tools"`` (chat ``tools`` with a
            ``tool_choice`` other than ``"none"``), ``None`` for free text
            (:func:`gateway.openai.translate.constraint_kind`).
    """

    request_id: str
    endpoint: str
    model: str
    stream: bool
    prompt_tokens: int
    max_tokens: int
    tenant: str | None = None
    user: str | None = None
    key_id: int | None = None
    tier: str | None = None
    sla_target_tokens_per_s: float | None = None
    priority: int = 0
    predicted_tokens_per_s: float | None = None
    admission_wait_s: float | None = None
    received_wall: float = field(default_factory=time.time)
    received_mono: float = field(default_factory=time.monotonic)
    choices: int = 1
    constraint: str | None = None


@dataclass
class RequestOutcome:
    """How one request ended.

    Attributes:
        status: ``finished`` (stop/length), ``failed`` (engine error/timeout),
            ``cancelled`` (client went away), ``rejected`` (refused by admission, a full
            engine queue, a response format or tools the server refused; never ran). Whether it is billed: :attr:`served`.
        finish_reason: ``stop``/``length`` for finished requests.
        error_code, error_message: for failed/rejected ones.
        completion_tokens: tokens emitted (for cancelled ones: emitted before the abort).
        timings: the engine's monotonic timestamps (``None`` when it never ran).
        spec: speculative-decoding stats (``None`` without speculation).
        token_times: ``time.monotonic()`` (seconds) at which each ``TextDelta`` carrying
            ≥ 1 token reached the gateway (for TTFT/inter-token latency metrics).
        ended_mono: ``time.monotonic()`` when the gateway saw the end.
        grammar_mask_s: seconds the engine spent on the request's grammar masks
            (``Finished.grammar_mask_s``; ``None``: free text, or not measured).
    """

    ctx: RequestContext
    status: str
    finish_reason: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: RequestTimings | None = None
    spec: SpecStats | None = None
    token_times: list[float] = field(default_factory=list)
    ended_mono: float = field(default_factory=time.monotonic)
    grammar_mask_s: float | None = None

    @property
    def served(self) -> bool:
        """Billed or not (:func:`is_served`)."""
        return is_served(self.status, self.completion_tokens)

    @property
    def billed_tokens(self) -> int:
        """Prompt + completion tokens when served, else 0 (:func:`is_served`)."""
        return self.prompt_tokens + self.completion_tokens if self.served else 0

    @property
    def decode_tokens_per_s(self) -> float | None:
        """The project's one definition (``runtime.interface.decode_tokens_per_s``); with
        ``n`` > 1 choices, of the mean tokens per choice over the first to the last token of any."""
        t = self.timings
        return decode_tokens_per_s(round(self.completion_tokens / max(1, self.ctx.choices)), t and t.first_token,
                                   t and t.last_token)

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, seconds, from the engine receiving the request."""
        t = self.timings
        return None if t is None or t.first_token is None else t.first_token - t.queued

    @property
    def queue_s(self) -> float | None:
        """Seconds the request waited before its prefill began."""
        t = self.timings
        return None if t is None or t.started is None else t.started - t.queued

    @property
    def e2e_s(self) -> float:
        return self.ended_mono - self.ctx.received_mono

    @property
    def mask_ms_per_token(self) -> float | None:
        """Mean grammar-mask time per generated token, milliseconds: ``grammar_mask_s`` · 1000 /
        completion tokens; ``None`` without a measured mask time or without a token."""
        if self.grammar_mask_s is None or self.completion_tokens <= 0:
            return None
        return 1000.0 * self.grammar_mask_s / self.completion_tokens


class RequestObserver(Protocol):
    def request_ended(self, outcome: RequestOutcome) -> None:
        """Called exactly once per submitted request. Must not block or raise."""
        ...


def notify(observers: Sequence[RequestObserver], outcome: RequestOutcome) -> None:
    for obs in observers:
        try:
            obs.request_ended(outcome)
        except Exception:  # an observer bug must never break serving
            log.exception("request observer %r failed", obs)


async def observed(
    events: AsyncIterator[Event], ctx: RequestContext, observers: Sequence[RequestObserver]
) -> AsyncIterator[Event]:
    """Yield ``events`` unchanged; report the outcome to ``observers`` exactly once."""
    outcome = RequestOutcome(ctx, CANCELLED, prompt_tokens=ctx.prompt_tokens)
    emitted = 0
    try:
        async for event in events:
            if isinstance(event, Finished):
                if event.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                    outcome.status, outcome.finish_reason = FINISHED, event.finish_reason.value
                else:
                    outcome.status = CANCELLED if event.finish_reason is FinishReason.ABORT else FAILED
                    if outcome.status == FAILED:  # the record's code = the metric's (request_errors_total)
                        outcome.error_code = "engine_error"
                        outcome.error_message = f"finish_reason {event.finish_reason.value!r}"
                outcome.prompt_tokens, outcome.completion_tokens = event.prompt_tokens, event.completion_tokens
                outcome.timings, outcome.spec = event.timings, event.spec
                outcome.grammar_mask_s = event.grammar_mask_s
            elif isinstance(event, Failed):
                outcome.status, outcome.error_code, outcome.error_message = FAILED, event.code, event.message
                outcome.completion_tokens = event.completion_tokens
                outcome.timings = event.timings
            else:
                emitted += event.num_tokens
                outcome.completion_tokens = emitted
                if event.num_tokens:
                    outcome.token_times.append(time.monotonic())
            yield event
    except QueueFullError as exc:
        outcome.status, outcome.error_code, outcome.error_message = REJECTED, "queue_full", str(exc)
        raise
    except GrammarError as exc:  # a response format the backend refused (HTTP 400)
        outcome.status, outcome.error_code, outcome.error_message = REJECTED, exc.code, exc.message
        raise
    except Exception as exc:
        outcome.status, outcome.error_code, outcome.error_message = FAILED, "internal_error", repr(exc)
        raise
    finally:
        await events.aclose() if hasattr(events, "aclose") else None
        outcome.ended_mono = time.monotonic()
        notify(observers, outcome)
