"""Prometheus metrics, named like vLLM's (``vllm:…``) but under ``sparkgate:``.

Request-level series are fed by :class:`MetricsObserver` (a :mod:`gateway.observability.observe`
observer: every submitted request's outcome arrives exactly once) and carry the labels
``tenant`` and ``tier``. Engine state (running/waiting requests, engine step counters,
prefix-cache queries/hits in tokens, speculation config, SPS table) is read from
``backend.load()`` / ``backend.spec_info()`` at scrape time by :class:`EngineCollector`. Everything lives in prometheus-client's
default registry, exported by ``GET /metrics`` (see :func:`install`).

Latency definitions (all seconds, gateway clock ``time.monotonic()``):

* ``time_to_first_token_seconds``: the gateway accepting the request (``RequestContext``
  created, before admission control) → first token-bearing ``TextDelta`` it receives.
* ``inter_token_latency_seconds``: gap between consecutive token-bearing deltas of a
  request, one observation per delta after the first (measured per delta, not
  approximated; like vLLM, a delta holding k tokens from one speculative round is one
  observation of its gap, not k).
* ``request_time_per_output_token_seconds``: (last − first token) / (tokens − 1), once
  per finished request with ≥ 2 tokens.
* ``e2e_request_latency_seconds``: the same start → the end, finished requests.
* ``request_queue_time_seconds``: engine ``queued`` → prefill start (engine clock).

TTFT, ITL and queue time are observed for every request that got that far (also
cancelled/failed ones); e2e and per-output-token time only for finished ones.
Token counters count every request that reached the engine (cancelled ones: the
tokens emitted before the abort), at its end.

``request_errors_total{code}`` counts failed/rejected requests by error code (from the
observer: engine failures, ``queue_full`` and the admission controller's 429s, which it
reports as rejected outcomes) plus requests refused before admission — 4xx answers
other than 429/499, and ``model_not_ready`` — counted from the ``APIError`` handler with
``tenant``/``tier`` = ``unknown``. Cancelled requests are
``request_success_total{finished_reason="abort"}`` (vLLM's convention), not errors.

Tenancy series need no calls from the tenancy code: ``rate_limited_requests_total``
counts rejected outcomes with an admission code (:data:`ADMISSION_CODES`),
``admission_queue_time_seconds`` observes ``RequestContext.admission_wait_s``, and the
request-record writer's backlog/drops (``app.state.records``: ``buffered``,
``dropped``, ``rejected``) are read at scrape time.

Constrained decoding (chat ``response_format`` and ``tools``; ``constraint`` label
``json_object``/``json_schema``/``tools``, :func:`gateway.openai.translate.constraint_kind`):
``constrained_requests_total`` counts every such request at its end (refused ones too),
``grammar_mask_time_per_output_token_seconds`` observes each one's engine time spent computing
and applying grammar masks divided by its completion tokens (requests with ≥ 1 token on a
backend that measures it: the embedded engine), and ``spec_decode_num_*_by_constraint_total``
split the speculative counters by it (``constraint="none"``: free-text requests), so
acceptance under grammar masks can be told from plain acceptance.

Cardinality: tenant names pass through :data:`TENANTS` — the first
``metrics_max_tenants`` distinct tenants keep their name, later ones are ``other``;
tier names through :data:`TIERS` (cap 10); no user ids or keys are ever labels.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Iterator

from prometheus_client import REGISTRY, Counter, Histogram, disable_created_metrics, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.core.errors import APIError
from gateway.observability.observe import CANCELLED, FINISHED, REJECTED, RequestOutcome

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger(__name__)
disable_created_metrics()  # no *_created series (as vLLM)

OTHER, NONE, UNKNOWN = "other", "none", "unknown"
ADMISSION_CODES = frozenset({"rate_limit_exceeded", "insufficient_quota", "concurrency_limit_exceeded",
                             "sla_capacity_exceeded"})


class LabelCap:
    """Bounded label values: the first ``limit`` distinct values keep their name, later
    ones become ``"other"``; ``None``/empty becomes ``"none"``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._seen: set[str] = set()

    def configure(self, limit: int) -> None:
        """Set the cap and forget the values seen so far."""
        self.limit, self._seen = limit, set()

    def __call__(self, value: str | None) -> str:
        if not value:
            return NONE
        if value in self._seen:
            return value
        if len(self._seen) < self.limit:
            self._seen.add(value)
            return value
        return OTHER


TENANTS = LabelCap(20)
TIERS = LabelCap(10)
REQ = ("tenant", "tier")

# -- serving (vLLM names) -----------------------------------------------------------
TIME_TO_FIRST_TOKEN = Histogram(
    "sparkgate:time_to_first_token_seconds", "Time to first token, seconds.", REQ,
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0))
INTER_TOKEN_LATENCY = Histogram(
    "sparkgate:inter_token_latency_seconds", "Gap between consecutive token deltas of a request, seconds.", REQ,
    buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0))
TIME_PER_OUTPUT_TOKEN = Histogram(
    "sparkgate:request_time_per_output_token_seconds", "(last - first token) / (tokens - 1) per request, seconds.",
    REQ, buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0))
E2E_LATENCY = Histogram(
    "sparkgate:e2e_request_latency_seconds", "Submission to end of a finished request, seconds.", REQ,
    buckets=(0.1, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0))
QUEUE_TIME = Histogram(
    "sparkgate:request_queue_time_seconds", "Engine queue time before prefill started, seconds.", REQ,
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0))
PROMPT_TOKENS = Counter("sparkgate:prompt_tokens_total", "Prompt tokens of requests that reached the engine.", REQ)
GENERATION_TOKENS = Counter("sparkgate:generation_tokens_total", "Completion tokens emitted.", REQ)
REQUEST_SUCCESS = Counter("sparkgate:request_success_total",
                          "Requests ended normally (stop/length) or cancelled (abort).", ("finished_reason", *REQ))
REQUEST_ERRORS = Counter("sparkgate:request_errors_total", "Failed or refused requests, by error code.",
                         ("code", *REQ))

# -- speculative decoding (vLLM names) -----------------------------------------------
SPEC_DRAFTS = Counter("sparkgate:spec_decode_num_drafts_total", "Speculative rounds (one draft block each).")
SPEC_DRAFT_TOKENS = Counter("sparkgate:spec_decode_num_draft_tokens_total", "Draft tokens proposed.")
SPEC_VERIFIED_TOKENS = Counter("sparkgate:spec_decode_num_verified_tokens_total",
                               "Draft tokens sent to the target for verification (the budget l_r).")
SPEC_ACCEPTED_TOKENS = Counter("sparkgate:spec_decode_num_accepted_tokens_total", "Draft tokens accepted.")
SPEC_ACCEPTED_PER_POS = Counter("sparkgate:spec_decode_num_accepted_tokens_per_pos_total",
                                "Rounds whose draft token at this 0-based position was accepted.", ("position",))
SPEC_VERIFIED_PER_ROUND = Histogram(
    "sparkgate:spec_decode_verified_tokens_per_round", "Per request: mean draft tokens verified per round (tokens).",
    ("tier",), buckets=(0.5, 1, 1.5, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16))

SPEC_DRAFTS_BY = Counter("sparkgate:spec_decode_num_drafts_by_constraint_total",
                         "Speculative rounds, by the request's output constraint (none: free text).", ("constraint",))
SPEC_DRAFT_TOKENS_BY = Counter("sparkgate:spec_decode_num_draft_tokens_by_constraint_total",
                               "Draft tokens proposed, by the request's output constraint (none: free text).",
                               ("constraint",))
SPEC_ACCEPTED_TOKENS_BY = Counter("sparkgate:spec_decode_num_accepted_tokens_by_constraint_total",
                                  "Draft tokens accepted, by the request's output constraint (none: free text).",
                                  ("constraint",))

# -- constrained decoding ---------------------------------------------------------------
CONSTRAINED_REQUESTS = Counter("sparkgate:constrained_requests_total",
                               "Requests whose output a grammar constrained (JSON response formats, tools), "
                               "by kind, whatever their end.", ("constraint", *REQ))
GRAMMAR_MASK_PER_TOKEN = Histogram(
    "sparkgate:grammar_mask_time_per_output_token_seconds",
    "Per constrained request: engine time computing and applying grammar masks / completion tokens, seconds.",
    ("constraint",),
    buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25))

# -- tenancy ----------------------------------------------------------------------------
SLA_REQUESTS = Counter("sparkgate:sla_requests_total",
                       "Finished requests with a tier target, by whether their decode tok/s met it.",
                       ("result", *REQ))
RATE_LIMITED = Counter("sparkgate:rate_limited_requests_total",
                       "Requests refused by admission control (rate limit, budget, concurrency, SLA), by code.",
                       ("code", *REQ))
ADMISSION_WAIT = Histogram(
    "sparkgate:admission_queue_time_seconds", "Time in the gateway's admission control, seconds.", ("tier",),
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0))


class MetricsObserver:
    """:class:`gateway.observability.observe.RequestObserver` that updates the request-level metrics."""

    def request_ended(self, o: RequestOutcome) -> None:
        labels = (TENANTS(o.ctx.tenant), TIERS(o.ctx.tier))
        if o.ctx.constraint is not None:
            CONSTRAINED_REQUESTS.labels(o.ctx.constraint, *labels).inc()
            if o.mask_ms_per_token is not None:
                GRAMMAR_MASK_PER_TOKEN.labels(o.ctx.constraint).observe(o.mask_ms_per_token / 1000.0)
        if o.ctx.admission_wait_s is not None:
            ADMISSION_WAIT.labels(labels[1]).observe(o.ctx.admission_wait_s)
        if o.status == FINISHED:
            REQUEST_SUCCESS.labels(o.finish_reason, *labels).inc()
        elif o.status == CANCELLED:
            REQUEST_SUCCESS.labels("abort", *labels).inc()
        else:
            REQUEST_ERRORS.labels(o.error_code or "engine_error", *labels).inc()
        if o.status == REJECTED:
            if o.error_code in ADMISSION_CODES:
                RATE_LIMITED.labels(o.error_code, *labels).inc()
            return
        PROMPT_TOKENS.labels(*labels).inc(o.prompt_tokens)
        GENERATION_TOKENS.labels(*labels).inc(o.completion_tokens)
        self._latencies(o, labels)
        if o.spec is not None:
            self._spec(o, labels[1])
        target = o.ctx.sla_target_tokens_per_s
        if o.status == FINISHED and target and o.decode_tokens_per_s is not None:
            SLA_REQUESTS.labels("met" if o.decode_tokens_per_s >= target else "missed", *labels).inc()

    @staticmethod
    def _latencies(o: RequestOutcome, labels: tuple[str, str]) -> None:
        times = o.token_times
        if times:
            TIME_TO_FIRST_TOKEN.labels(*labels).observe(times[0] - o.ctx.received_mono)
            itl = INTER_TOKEN_LATENCY.labels(*labels)
            for prev, cur in zip(times, times[1:]):
                itl.observe(cur - prev)
        if o.queue_s is not None:
            QUEUE_TIME.labels(*labels).observe(o.queue_s)
        if o.status == FINISHED:
            E2E_LATENCY.labels(*labels).observe(o.e2e_s)
            if o.completion_tokens >= 2 and len(times) >= 2:
                TIME_PER_OUTPUT_TOKEN.labels(*labels).observe((times[-1] - times[0]) / (o.completion_tokens - 1))

    @staticmethod
    def _spec(o: RequestOutcome, tier: str) -> None:
        s = o.spec
        SPEC_DRAFTS.inc(s.rounds - s.gated_rounds)  # gated rounds drafted nothing
        SPEC_DRAFT_TOKENS.inc(s.drafted)
        SPEC_VERIFIED_TOKENS.inc(s.verified)
        SPEC_ACCEPTED_TOKENS.inc(s.accepted)
        for pos, n in enumerate(s.accepted_per_position):
            SPEC_ACCEPTED_PER_POS.labels(str(pos)).inc(n)
        kind = o.ctx.constraint or NONE
        SPEC_DRAFTS_BY.labels(kind).inc(s.rounds - s.gated_rounds)
        SPEC_DRAFT_TOKENS_BY.labels(kind).inc(s.drafted)
        SPEC_ACCEPTED_TOKENS_BY.labels(kind).inc(s.accepted)
        if s.rounds:
            SPEC_VERIFIED_PER_ROUND.labels(tier).observe(s.verified / s.rounds)


class StateCollector:
    """Engine and record-writer state read at scrape time from ``app.state``."""

    def __init__(self) -> None:
        self.state = None  # set by install(); the last installed app wins

    def describe(self) -> list[Metric]:
        return []  # nothing to check at registration; collect() needs an app

    def collect(self) -> Iterator[Metric]:
        if self.state is None:
            return
        writer = getattr(self.state, "records", None)  # gateway.observability.records.RecordWriter
        if writer is not None:
            yield GaugeMetricFamily("sparkgate:db_writer_queue_depth", "Request records waiting to be written.",
                                    writer.buffered)
            yield CounterMetricFamily("sparkgate:db_records_dropped", "Request records dropped (buffer full).",
                                      writer.dropped)
            yield CounterMetricFamily("sparkgate:db_records_rejected",
                                      "Request records the database refused for their data (dropped, logged).",
                                      writer.rejected)
        yield from self._engine(self.state.backend)

    @staticmethod
    def _engine(backend) -> Iterator[Metric]:
        try:
            load, spec = backend.load(), backend.spec_info()
        except Exception:  # a scrape must never fail because the backend is unhappy
            log.exception("backend.load()/spec_info() failed during a metrics scrape")
            return
        yield GaugeMetricFamily("sparkgate:num_requests_running", "Requests in the running batch.", load.running)
        yield GaugeMetricFamily("sparkgate:num_requests_waiting", "Requests waiting for a batch slot.", load.waiting)
        yield GaugeMetricFamily("sparkgate:max_num_seqs", "Batch capacity (max running requests).", load.max_batch)
        yield CounterMetricFamily("sparkgate:engine_forward_steps", "Target forward passes.", load.forward_steps)
        yield CounterMetricFamily("sparkgate:engine_decode_steps",
                                  "Forwards that verified >= 1 decoding request (rounds).", load.decode_steps)
        yield CounterMetricFamily("sparkgate:engine_verify_tokens",
                                  "Tokens verified over those rounds: sum of B = sum_r (1 + l_r).", load.verify_tokens)
        yield CounterMetricFamily("sparkgate:spec_decode_steps",
                                  "Decode rounds that drafted and verified (speculation on).", load.spec_steps)
        yield CounterMetricFamily("sparkgate:spec_decode_gated_steps",
                                  "Decode rounds run as plain decode (the speculation gate, or hybrid with nothing to verify).",
                                  load.spec_gated_steps)
        yield CounterMetricFamily("sparkgate:engine_decode_rows",
                                  "Request-rounds: sum over decode rounds of the requests each verified.",
                                  load.decode_rows)
        yield CounterMetricFamily("sparkgate:spec_decode_zero_budget_rows",
                                  "Request-rounds verified with l_r = 0 (the budget or gate gave no draft token).",
                                  load.zero_budget_rows)
        yield CounterMetricFamily("sparkgate:engine_decode_tokens",
                                  "Tokens decode rounds produced; tau = rate(decode_tokens) / rate(decode_rows).",
                                  load.decode_tokens)
        ratio = GaugeMetricFamily("sparkgate:spec_acceptance_ratio",
                                  "Realised / calibrated draft acceptance the budget scales survival by (decayed).",
                                  labels=("proposer", "n", "position", "sampling"))
        for proposer, n, position, sampling, value in load.acceptance_ratios:
            ratio.add_metric([proposer, n, position, sampling], value)
        yield ratio
        yield CounterMetricFamily("sparkgate:prefix_cache_queries",
                                  "Prefix cache queries, in prompt tokens looked up.", load.prefix_cache_queries)
        yield CounterMetricFamily("sparkgate:prefix_cache_hits",
                                  "Prefix cache hits, in prompt tokens whose KV was reused.", load.prefix_cache_hits)
        info = GaugeMetricFamily("sparkgate:spec_decode_config_info", "Speculation method, budget policy and gamma.",
                                 labels=("method", "policy", "num_speculative_tokens"))
        info.add_metric((spec.method, spec.policy or NONE, str(spec.block_size)), 1)
        yield info
        if spec.sps_table:
            yield from _sps_family(spec.sps_table)


def _sps_family(table: dict) -> Iterator[Metric]:
    """``sparkgate:sps{budget_tokens, context_len}`` from ``SpsTable.to_dict()``."""
    sps = GaugeMetricFamily("sparkgate:sps", "SPS table: target rounds per second at B verification tokens.",
                            labels=("budget_tokens", "context_len"))
    try:
        for ctx_len, row in zip(table["context_lens"], table["sps"], strict=True):
            for b, value in zip(table["buckets"], row, strict=True):
                sps.add_metric((str(b), str(ctx_len)), float(value))
    except (KeyError, TypeError, ValueError):  # not a sparkgate-sps-v1 table: skip it, keep the scrape
        log.warning("spec_info().sps_table is not an SPS table dict; sparkgate:sps not exported")
        return
    yield sps


STATE = StateCollector()
REGISTRY.register(STATE)


def _count_refusals(app: FastAPI) -> None:
    """Count requests refused before reaching the engine in ``request_errors_total``."""
    inner = app.exception_handlers[APIError]

    async def handler(request, exc: APIError):
        if (exc.status < 500 and exc.status not in (429, 499)) or exc.code == "model_not_ready":
            REQUEST_ERRORS.labels(exc.code or f"http_{exc.status}", UNKNOWN, UNKNOWN).inc()
        return await inner(request, exc)

    app.exception_handlers[APIError] = handler


def install(app: FastAPI) -> None:
    """Register the observer, the refusal counter and the ``/metrics`` endpoint.

    ``settings.metrics_port`` unset (default): ``GET /metrics`` on the API port, admin
    token required. Set: served without auth by a separate listener on
    ``metrics_host:metrics_port`` (started/stopped with the app), not on the API port.
    Call after the error handlers and routers are installed.
    """
    from gateway.api.routes import metrics as route

    settings = app.state.settings
    TENANTS.configure(settings.metrics_max_tenants)
    STATE.state = app.state
    app.state.observers.append(MetricsObserver())
    _count_refusals(app)
    if settings.metrics_port is None:
        app.include_router(route.router)
        return
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        server, thread = start_http_server(settings.metrics_port, settings.metrics_host)
        try:
            async with inner(a):
                yield
        finally:
            server.shutdown()
            server.server_close()
            thread.join(5)

    app.router.lifespan_context = lifespan
