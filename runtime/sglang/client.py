"""The SGLang backend: :class:`runtime.interface.Backend` over SGLang 0.5.23's native API.

Why the native ``POST /generate`` and not ``/v1/chat/completions``
--------------------------------------------------------------------
* The gateway already applies the chat template and tokenizes (it needs exact token
  counts for context clamping and usage). ``/generate`` takes ``input_ids``, so SGLang
  runs exactly the tokens we counted; the OpenAI endpoint would re-template on the
  server and the counts could drift from ours.
* Every streamed chunk carries ``meta_info`` (``id``, ``prompt_tokens``,
  ``completion_tokens``, ``finish_reason``) and the final one the speculative-decoding
  counters (``spec_verify_ct``, ``spec_num_correct_drafts``, …) with no extra flag; the
  OpenAI endpoint only returns them with its ``return_spec_tokens_details`` extension.
* ``rid``, ``priority`` and ``sampling_params.custom_params`` are first-class fields of
  the request (``sglang/api/v1/api_types.py``: ``GenerateRequest`` line 236,
  ``SamplingParams`` line 177 — unknown *sampling* keys are rejected with HTTP 400).

Request (:func:`build_generate_payload`)
----------------------------------------
``rid`` = request id, ``input_ids`` = prompt tokens, ``stream`` = true, and
``sampling_params``: ``temperature``, ``top_p``, ``top_k`` (our 0 → −1 "disabled";
SGLang rejects 0), ``max_new_tokens`` (``None`` → ``max_context − len(prompt)``, because
SGLang's default is 128), ``stop``, ``ignore_eos``, when set ``presence_penalty``,
``frequency_penalty``, ``repetition_penalty``, ``min_p``, ``min_new_tokens`` (= ``min_tokens``),
``logit_bias`` and ``stop_token_ids``, the request's constraint (below), ``sampling_seed`` (= ``seed``;
SGLang honours it only when the server runs with ``--enable-deterministic-inference``,
``srt/sampling/sampling_batch_info.py``) and, when the tenant's tier has an SLA target,
``custom_params`` = ``{"sparkgate_sla_target_tokens_per_s": target,
"sparkgate_sla_max_weight": cap}`` (read by :mod:`runtime.sglang.plugin.sla_hook`
inside SGLang). ``priority`` (larger = more important, negated with
``priority_low_values_first``) is sent only with ``send_priority`` — the server must run
with ``--enable-priority-scheduling``. With ``sla_in_custom_labels`` the same two SLA values
also go in the top-level ``custom_labels`` (strings, ``repr`` of the floats): sglang-router
0.3.2 rebuilds ``/generate`` bodies from its own types and drops ``sampling_params.custom_params``
but keeps ``custom_labels``; the plugin moves them back into ``custom_params`` inside SGLang
(:mod:`runtime.sglang.plugin.sla_hook` patch point 3; docs/deploy-gpu.md "sglang-router").

Constraints (``GenerationRequest.response_format``, :func:`constraint_params`) map to the
fields SGLang's own OpenAI adapter fills (``srt/entrypoints/openai/serving_chat.py``
``_build_sampling_params``), which its grammar backend compiles (xgrammar by default):
``json_object`` → ``json_schema = '{"type": "object"}'``; ``json_schema`` → ``json_schema`` = the
schema as JSON text; ``tool_calls`` → ``structural_tag`` = the same structural tag the embedded
engine compiles (:func:`runtime.engine.tool_grammar.structural_tag`: Hermes-style
``<tool_call>`` tags, one per tool, ``triggered_tags`` for ``auto``, ``tags_with_separator`` for
``required``; with a JSON reply format, ``auto`` is that format or calls), each tool's arguments
(and the reply) a ``json_schema`` content, draft-07 tuples rewritten as 2020-12's
(:func:`runtime.engine.grammar.to_prefix_items`). Before anything is sent the format
passes the embedded engine's checks (:func:`runtime.engine.grammar.check_format`: unsupported
keywords, size), so both backends refuse the same schemas with the same 400. A grammar SGLang
cannot compile ends the request with an ``abort`` of status 400 before any text
(``Invalid grammar request``, ``grammar_manager.py``): raised as
:class:`~runtime.interface.GrammarError` ``invalid_schema`` (a 400 too). The reply comes back
as text and is parsed by the gateway as for the embedded engine (tool calls:
:mod:`gateway.openai.tool_parser`). Whitespace inside the JSON follows SGLang's server
setting (the embedded engine writes compact JSON). SGLang does not report mask times
(``Finished.grammar_mask_s`` stays ``None``).

Stream (``srt/entrypoints/http_server.py`` ``serve_generate_request``;
``srt/managers/tokenizer_manager.py`` ``_handle_batch_output``)
--------------------------------------------------------------------------------------
SSE lines ``data: {"text", "output_ids", "meta_info"}`` then ``data: [DONE]``. With the
server default (``incremental_streaming_output=False``) ``text``/``output_ids`` are
cumulative; with ``--incremental-streaming-output`` they are deltas.
:class:`StreamAssembler` auto-detects which from ``len(output_ids)`` versus
``completion_tokens`` (or takes ``SGLangConfig.incremental_streaming_output``).
Errors inside a stream arrive as ``data: {"error": {"message", "code", …}}``. SGLang
trims a matched stop string only from the final chunk's *tail*
(``detokenizer_manager.trim_matched_stop``), so a prefix of it may already have been
streamed; the assembler holds back every text suffix that is a prefix of a stop string
and cuts at the match, so the stop text is never returned (interface contract).

Finish reasons: ``stop`` → STOP, ``length`` → LENGTH; ``abort`` with ``status_code``
429/503 before any text → :class:`QueueFullError` (scheduler queue full), with 400 before any
text for a constrained request → :class:`GrammarError` (above), with another
``status_code`` → ``Failed("upstream_rejected")``, without one → ``Finished(ABORT)``;
any other type → ``Failed("upstream_protocol_error")``.

Spec stats (:func:`spec_stats_from_meta`; ``tokenizer_manager._calculate_spec_decoding_metrics``)
--------------------------------------------------------------------------------------------
``rounds`` = ``spec_verify_ct`` (verify forwards); ``drafted`` =
``spec_num_proposed_drafts`` (= rounds × (``speculative_num_draft_tokens`` − 1), γ per
round); ``verified`` = Σ_k k·``spec_cap_lens_histogram[k]`` − rounds (DSpark ragged
verify: the per-round verify length incl. the anchor), else
round(``spec_cap_length``·rounds) − rounds, else ``drafted`` (static verify-all);
``accepted`` = ``spec_num_correct_drafts`` (bonus excluded); ``emitted`` =
``completion_tokens`` (SGLang's ``spec_accept_length`` = completion_tokens/verify_ct = τ);
``accepted_per_position[j]`` = Σ_{k>j} ``spec_correct_drafts_histogram[k]`` (index k =
drafts accepted in one round). Unlike the embedded engine, SGLang's counters include
tokens later cut by a stop string.

Errors and cancellation
-----------------------
Connection refused/timeout → that upstream is marked down and the next healthy one is
tried (nothing was sent); none left → ``Failed("upstream_unavailable")``. HTTP 429/503 →
next upstream; all busy → :class:`QueueFullError` (``Retry-After`` honoured). Other
HTTP errors → ``Failed("upstream_error")``; a broken stream → ``Failed
("upstream_disconnected")``; a malformed chunk → ``Failed("upstream_protocol_error")``;
the wall-clock limit → ``Failed("timeout")``. Whenever the iterator ends before SGLang
finished (client disconnect: ``aclose()`` or task cancellation; or one of the failures
above) the HTTP stream is closed and ``POST /abort_request {"rid": …}``
(``api_types.AbortRequest``, line 639) is sent to the same upstream — in a background
task, so it also happens when the consumer's task is being cancelled.

Timings are client-side (``time.monotonic()`` at chunk arrival; SGLang streams every
``stream_interval`` steps, so first/last-token times have chunk granularity).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import httpx

from runtime.engine.grammar import check_format, to_prefix_items
from runtime.engine.tool_grammar import json_schema_contents, reply_content, structural_tag
from runtime.interface import (
    BackendInfo,
    Event,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    GrammarError,
    LoadSnapshot,
    QueueFullError,
    RequestTimings,
    ResponseFormat,
    SpecInfo,
    SpecStats,
)
from runtime.sglang.router import SGLangRouter
from runtime.upstream.assembler import ProtocolError, StreamAssembler
from runtime.upstream.failover import open_or_failed, open_stream
from runtime.upstream.http import BUSY_STATUS
from runtime.upstream.payload import completion_budget
from runtime.upstream.remote import RemoteBackend
from runtime.upstream.router import Upstream
from runtime.speculation.sla import DEFAULT_MAX_WEIGHT

log = logging.getLogger(__name__)

SLA_TARGET_KEY = "sparkgate_sla_target_tokens_per_s"
SLA_MAX_WEIGHT_KEY = "sparkgate_sla_max_weight"


@dataclass
class SGLangConfig:
    """Settings of the SGLang backend.

    Attributes:
        urls: SGLang server base URLs (one per server, or one sglang-router URL).
        model_name: public model name reported to the gateway.
        max_context: context length in tokens (must match the servers' ``--context-length``).
        tokenizer_path: local dir (or hub id) of the served model's tokenizer; ``None`` →
            the embedded model's converted cache (``runtime.models.loader.ensure_converted``).
        eos_token_id: override; ``None`` → the tokenizer's.
        api_key: the servers' ``--api-key`` (sent as ``Authorization: Bearer``).
        send_priority: send ``priority`` (servers run ``--enable-priority-scheduling``).
        priority_low_values_first: servers run ``--schedule-low-priority-values-first``
            (then the priority is negated so larger still means more important).
        sla_max_weight: weight cap sent with the SLA target (``sla_weight``'s ``max_weight``).
        sla_in_custom_labels: also send the SLA target and cap in ``custom_labels`` (for
            servers behind sglang-router, which drops ``sampling_params.custom_params``; the
            servers must run the SLA plugin, which takes the labels out again).
        incremental_streaming_output: the servers' ``--incremental-streaming-output``;
            ``None`` → detect per stream.
        connect_timeout_s: httpx connect timeout (seconds).
        read_timeout_s: the longest silence between two chunks of a stream (seconds).
        request_timeout_s: default wall-clock limit per request (seconds).
        health_path: the servers' health endpoint.
        health_interval_s: seconds between two health probes of a server.
        health_timeout_s: timeout of one health probe (seconds).
        max_in_flight_per_upstream: admission cap per server; beyond it on every healthy
            server → :class:`QueueFullError`. ``None`` → no cap (SGLang queues).
        retry_after_s: ``retry_after_s`` of a :class:`QueueFullError` without ``Retry-After``.
        abort_timeout_s: timeout of the ``/abort_request`` call (seconds).
    """

    urls: tuple[str, ...] = ("http://127.0.0.1:30000",)
    model_name: str = "SmolLM2-135M-Instruct"
    max_context: int = 8192
    tokenizer_path: str | None = None
    eos_token_id: int | None = None
    api_key: str | None = None
    send_priority: bool = False
    priority_low_values_first: bool = False
    sla_max_weight: float = DEFAULT_MAX_WEIGHT
    sla_in_custom_labels: bool = False
    incremental_streaming_output: bool | None = None
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    health_path: str = "/health"
    health_interval_s: float = 10.0
    health_timeout_s: float = 25.0
    max_in_flight_per_upstream: int | None = None
    retry_after_s: float = 1.0
    abort_timeout_s: float = 5.0


#: SGLang's JSON mode: its OpenAI adapter sends ``response_format: json_object`` as this schema.
JSON_OBJECT_SCHEMA = '{"type": "object"}'


def constraint_params(fmt: ResponseFormat | None) -> dict[str, str]:
    """The ``sampling_params`` field (one of ``json_schema`` / ``structural_tag``, a JSON string)
    that constrains a reply to ``fmt`` (mapping in the module docstring); ``{}`` for free text.

    Raises:
        ValueError: an unknown format type.
    """
    if fmt is None:
        return {}
    if fmt.type == "json_object" or (fmt.type == "json_schema" and fmt.schema is None):
        return {"json_schema": JSON_OBJECT_SCHEMA}
    if fmt.type == "json_schema":
        return {"json_schema": json.dumps(to_prefix_items(fmt.schema), ensure_ascii=False)}
    if fmt.type == "tool_calls":
        contents = [{**c, "json_schema": to_prefix_items(c["json_schema"])} for c in json_schema_contents(fmt)]
        reply = reply_content(fmt)
        if reply is not None:
            reply = {**reply, "json_schema": to_prefix_items(reply["json_schema"])}
        return {"structural_tag": json.dumps(structural_tag(fmt, contents, reply), ensure_ascii=False)}
    raise ValueError(f"unknown response format type {fmt.type!r}")


def build_generate_payload(request: GenerationRequest, config: SGLangConfig) -> dict[str, Any]:
    """The JSON body of ``POST /generate`` for ``request`` (mapping in the module docstring).

    Raises:
        ValueError: the prompt already fills ``config.max_context``.
    """
    s = request.sampling
    max_new = completion_budget(request, config.max_context)
    sampling: dict[str, Any] = {
        "max_new_tokens": max_new,
        "temperature": float(s.temperature),
        "top_p": float(s.top_p),
        "top_k": int(s.top_k) if s.top_k and s.top_k > 0 else -1,
        "ignore_eos": bool(s.ignore_eos),
    }
    if s.stop:
        sampling["stop"] = list(s.stop)
    # penalties, logit_bias, min_p, min_tokens, stop_token_ids: SGLang's fields of the same
    # meaning (SamplingParams line 177), sent only when set
    for ours, theirs, off in (("presence_penalty", "presence_penalty", 0.0), ("frequency_penalty", "frequency_penalty", 0.0),
                              ("repetition_penalty", "repetition_penalty", 1.0), ("min_p", "min_p", 0.0),
                              ("min_tokens", "min_new_tokens", 0)):
        if getattr(s, ours) != off:
            sampling[theirs] = getattr(s, ours)
    if s.logit_bias:
        sampling["logit_bias"] = {str(t): float(b) for t, b in s.logit_bias}
    if s.stop_token_ids:
        sampling["stop_token_ids"] = [int(t) for t in s.stop_token_ids]
    sampling.update(constraint_params(request.response_format))
    if s.seed is not None:
        sampling["sampling_seed"] = int(s.seed)
    if request.sla_target_tokens_per_s is not None:
        sampling["custom_params"] = {
            SLA_TARGET_KEY: float(request.sla_target_tokens_per_s),
            SLA_MAX_WEIGHT_KEY: float(config.sla_max_weight),
        }
    payload: dict[str, Any] = {
        "rid": request.request_id,
        "input_ids": list(request.prompt_token_ids),
        "sampling_params": sampling,
        "stream": True,
    }
    if config.sla_in_custom_labels and "custom_params" in sampling:
        payload["custom_labels"] = {k: repr(v) for k, v in sampling["custom_params"].items()}
    if config.send_priority:
        payload["priority"] = -int(request.priority) if config.priority_low_values_first else int(request.priority)
    return payload


def spec_stats_from_meta(meta: dict[str, Any]) -> SpecStats | None:
    """:class:`SpecStats` from a final SGLang ``meta_info`` (mapping in the module
    docstring); ``None`` when the server reported no speculative rounds."""
    rounds = meta.get("spec_verify_ct")
    if not isinstance(rounds, int) or rounds <= 0:
        return None
    drafted = int(meta.get("spec_num_proposed_drafts") or 0)
    cap_hist = meta.get("spec_cap_lens_histogram")
    if isinstance(cap_hist, list) and cap_hist:
        verified = sum(k * int(n) for k, n in enumerate(cap_hist)) - rounds
    elif isinstance(meta.get("spec_cap_length"), (int, float)):
        verified = round(float(meta["spec_cap_length"]) * rounds) - rounds
    else:
        verified = drafted
    hist = meta.get("spec_correct_drafts_histogram") or []
    per_position = [sum(int(n) for n in hist[j + 1:]) for j in range(max(len(hist) - 1, 0))]
    return SpecStats(
        rounds=rounds,
        drafted=drafted,
        verified=max(verified, 0),
        accepted=int(meta.get("spec_num_correct_drafts") or 0),
        emitted=int(meta.get("completion_tokens") or 0),
        accepted_per_position=per_position,
    )


def _find_key(obj: Any, key: str) -> Any:
    """First value of ``key`` anywhere in nested dicts/lists (``None`` if absent)."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        values = obj.values()
    elif isinstance(obj, list):
        values = obj
    else:
        return None
    for value in values:
        found = _find_key(value, key)
        if found is not None:
            return found
    return None


def spec_info_from_server_info(info: dict[str, Any]) -> SpecInfo:
    """:class:`SpecInfo` from SGLang's ``GET /server_info`` (0.5.23: the resolved server
    args, ``srt/utils/common.py`` ``build_server_info``; keys searched at any depth).

    ``method`` = ``speculative_algorithm`` lower-cased (``"dspark"``) or ``"none"``;
    ``block_size`` = ``speculative_dspark_block_size`` (else ``speculative_num_draft_tokens``
    − 1); ``policy`` and ``sps_table`` are ``None``: SGLang's budget policy and SPS table
    live on the GPU host and are not reported over HTTP.
    """
    algo = _find_key(info, "speculative_algorithm")
    if not algo:
        return SpecInfo(method="none")
    gamma = _find_key(info, "speculative_dspark_block_size")
    if not isinstance(gamma, int):
        n = _find_key(info, "speculative_num_draft_tokens")
        gamma = n - 1 if isinstance(n, int) and n > 1 else 0
    return SpecInfo(method=str(algo).lower(), block_size=gamma)


class SGLangBackend(RemoteBackend):
    """:class:`runtime.interface.Backend` streaming from SGLang servers (module docstring).

    Args:
        config: :class:`SGLangConfig`.
        tokenizer: injected tokenizer (tests); loaded from ``config.tokenizer_path`` otherwise.
        transport: injected httpx transport (tests).
    """

    label = "SGLang"

    def __init__(self, config: SGLangConfig, *, tokenizer: Any = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        super().__init__(config, SGLangRouter(config.urls, health_path=config.health_path,
                                              health_timeout_s=config.health_timeout_s),
                         tokenizer=tokenizer, transport=transport)
        self._spec_info: SpecInfo | None = None
        self.aborts_sent = 0

    @property
    def background_timeout_s(self) -> float:
        """:meth:`stop` waits for pending aborts: their own timeout and a second."""
        return self.config.abort_timeout_s + 1

    # -- lifecycle ----------------------------------------------------------------
    async def start(self) -> None:
        """Load the tokenizer, open the HTTP client, probe the upstreams once and start
        the periodic health checks. Starting with no healthy upstream is allowed
        (``ready()`` stays false until one answers)."""
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else None
        await self._open_client(max_keepalive=64, headers=headers)
        await self._refresh_spec_info()
        self._health_task = asyncio.create_task(self._watch(), name="sglang-health")

    async def _watch(self) -> None:
        """Probe the upstreams every ``health_interval_s``; fetch the speculation
        settings until one server reported them."""
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.router.check_all(self._client)
                if self._spec_info is None:
                    await self._refresh_spec_info()
            except Exception:  # noqa: BLE001 — the loop must survive
                log.exception("SGLang health check round failed")

    async def _refresh_spec_info(self) -> None:
        for upstream in self.router.healthy():
            try:
                resp = await self._client.get(upstream.url + "/server_info", timeout=self.config.health_timeout_s)
                if resp.status_code == 200:
                    self._spec_info = spec_info_from_server_info(resp.json())
                    return
            except (httpx.HTTPError, ValueError) as exc:
                log.debug("GET %s/server_info failed: %s", upstream.url, exc)

    def ready(self) -> bool:
        return self._client is not None and self._tokenizer is not None and bool(self.router.healthy())

    @property
    def info(self) -> BackendInfo:
        # logprobs are not mapped from SGLang's return_logprob meta yet: the gateway answers 400;
        # response formats and tool calls are constrained by SGLang's grammar backend
        return BackendInfo(self.config.model_name, self.config.max_context, self._eos_token_id(),
                           supports_logprobs=False, supports_response_format=True)

    # -- load -----------------------------------------------------------------------
    def load(self) -> LoadSnapshot:
        """``running`` = our in-flight requests; ``waiting`` = SGLang-reported waiting
        requests (``/v1/loads``, as of the last probe); ``max_batch`` = Σ SGLang
        ``max_running_requests`` (else the admission cap × servers, else 0);
        ``forward_steps`` = 0 (not observable from outside)."""
        ups = self.router.upstreams
        waiting = sum(u.server_waiting or 0 for u in ups if u.healthy)
        max_batch = sum(u.server_max_running or 0 for u in ups if u.healthy)
        if not max_batch and self.config.max_in_flight_per_upstream:
            max_batch = self.config.max_in_flight_per_upstream * len(self.router.healthy())
        return LoadSnapshot(sum(u.in_flight for u in ups), waiting, max_batch, 0)

    def spec_info(self) -> SpecInfo:
        """The servers' speculation settings (:func:`spec_info_from_server_info`, from the
        first healthy server); ``SpecInfo("sglang")`` until one answered ``/server_info``."""
        return self._spec_info or SpecInfo(method="sglang")

    # -- streaming ------------------------------------------------------------------
    async def _open(self, payload: dict) -> tuple[Upstream, httpx.Response]:
        """POST ``/generate`` (:func:`runtime.upstream.failover.open_stream`); cancelled or
        failed before the headers, the request is aborted on that upstream."""

        def send(upstream: Upstream):
            return self._client.send(self._client.build_request("POST", upstream.url + "/generate", json=payload),
                                     stream=True)

        def send_error(upstream: Upstream, exc: BaseException) -> None:
            self._spawn(self._abandon(upstream, None, str(payload.get("rid")), abort=True))

        return await open_stream(self.router, send, path="/generate", server="SGLang", pool="SGLang upstreams",
                                 cap=self.config.max_in_flight_per_upstream, retry_after_s=self.config.retry_after_s,
                                 on_send_error=send_error)

    async def _abandon(self, upstream: Upstream, resp: httpx.Response | None, rid: str, abort: bool) -> None:
        """Close the HTTP stream and, with ``abort``, ask SGLang to abort ``rid``."""
        if resp is not None:
            try:
                await resp.aclose()
            except Exception:  # noqa: BLE001
                log.debug("closing the SGLang stream of %s failed", rid, exc_info=True)
        if not abort or self._client is None:
            return
        try:
            r = await self._client.post(upstream.url + "/abort_request", json={"rid": rid},
                                        timeout=self.config.abort_timeout_s)
            self.aborts_sent += 1
            if r.status_code != 200:
                log.warning("SGLang %s /abort_request %s → HTTP %s", upstream.url, rid, r.status_code)
        except httpx.HTTPError as exc:
            log.warning("SGLang %s /abort_request %s failed: %s", upstream.url, rid, exc)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Event]:
        """Stream ``request`` from SGLang (see the module docstring).

        Raises:
            QueueFullError: (before the first event) every upstream is busy.
            GrammarError: (before the first event) the response format fails
                :func:`runtime.engine.grammar.check_format`, or SGLang could not compile it.
            RuntimeError: the backend was not started.
        """
        if self._client is None:
            raise RuntimeError("SGLang backend not started")
        if request.response_format is not None:
            check_format(request.response_format)  # the embedded engine's refusals, before anything is sent
        timings = RequestTimings(wall_queued=time.time(), queued=time.monotonic())
        deadline = timings.queued + (request.timeout_s or self.config.request_timeout_s)
        rid = request.request_id
        prompt_len = len(request.prompt_token_ids)
        opened = await open_or_failed(lambda: build_generate_payload(request, self.config), self._open, prompt_len,
                                      timings)
        if isinstance(opened, Failed):
            yield opened
            return
        upstream, resp = opened
        timings.started = time.monotonic()
        asm = StreamAssembler(request.sampling.stop, self.config.incremental_streaming_output, self._tokenizer)
        server_done = False
        yielded = False
        prompt_tokens = prompt_len

        def failed(message: str, code: str) -> Failed:
            timings.finished = time.monotonic()
            return Failed(message, code=code, prompt_tokens=prompt_tokens,
                          completion_tokens=asm.completion_tokens, timings=timings)

        try:
            lines = resp.aiter_lines()
            while True:
                remaining = deadline - time.monotonic()
                try:
                    if remaining <= 0:
                        raise TimeoutError
                    async with asyncio.timeout(remaining):
                        line = await lines.__anext__()
                except StopAsyncIteration:
                    yield failed(f"SGLang {upstream.url} closed the stream before the request finished",
                                 "upstream_disconnected")
                    return
                except TimeoutError:
                    yield failed(f"request exceeded its {deadline - timings.queued:.0f} s limit", "timeout")
                    return
                except httpx.HTTPError as exc:
                    yield failed(f"SGLang {upstream.url} stream broke: {type(exc).__name__}: {exc}",
                                 "upstream_disconnected")
                    return
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    server_done = True
                    yield failed(f"SGLang {upstream.url} ended the stream without a finish reason",
                                 "upstream_protocol_error")
                    return
                try:
                    chunk = json.loads(data)
                    if not isinstance(chunk, dict):
                        raise ProtocolError(f"chunk is a {type(chunk).__name__}, not an object")
                    if "error" in chunk:
                        server_done = True  # SGLang ends the stream after an error chunk
                        err = chunk["error"]
                        message = str(err.get("message", err)) if isinstance(err, dict) else str(err)
                        status = err.get("code") if isinstance(err, dict) else None
                        if status in BUSY_STATUS and not yielded:
                            raise QueueFullError(f"SGLang {upstream.url}: {message}", self.config.retry_after_s)
                        yield failed(f"SGLang {upstream.url}: {message}", "upstream_error")
                        return
                    meta = chunk.get("meta_info")
                    text = chunk.get("text", "")
                    ids = chunk.get("output_ids")
                    if not isinstance(meta, dict) or not isinstance(text, str):
                        raise ProtocolError("chunk lacks meta_info or text")
                    completion = meta.get("completion_tokens")
                    if not isinstance(completion, int) or completion < 0:
                        raise ProtocolError("meta_info.completion_tokens is not a non-negative integer")
                    if ids is not None and not isinstance(ids, list):
                        raise ProtocolError("output_ids is not a list")
                    if isinstance(meta.get("prompt_tokens"), int):
                        prompt_tokens = meta["prompt_tokens"]
                    before = asm.completion_tokens
                    asm.feed(text, ids, completion)
                except ProtocolError as exc:
                    yield failed(f"malformed chunk from SGLang {upstream.url}: {exc}", "upstream_protocol_error")
                    return
                except ValueError as exc:  # json.JSONDecodeError
                    yield failed(f"malformed chunk from SGLang {upstream.url}: {exc}", "upstream_protocol_error")
                    return
                now = time.monotonic()
                if asm.completion_tokens > before:
                    if timings.first_token is None:
                        timings.first_token = now
                    timings.last_token = now
                finish = meta.get("finish_reason")
                if finish is None:
                    delta = asm.release()
                    if delta is not None:
                        yielded = True
                        yield delta
                    continue
                server_done = True
                kind = finish.get("type") if isinstance(finish, dict) else None
                if kind == "abort":
                    status = finish.get("status_code")
                    message = f"SGLang {upstream.url} aborted the request: {finish.get('message')}"
                    if status in BUSY_STATUS and not yielded:
                        raise QueueFullError(message, self.config.retry_after_s)
                    if status == 400 and not yielded and request.response_format is not None:
                        raise GrammarError(f"SGLang could not compile the response format: {finish.get('message')}",
                                           None, "invalid_schema")
                    if isinstance(status, int) and status >= 400:
                        yield failed(message, "upstream_rejected")
                        return
                    reason = FinishReason.ABORT
                elif kind == "stop":
                    reason = FinishReason.STOP
                elif kind == "length":
                    reason = FinishReason.LENGTH
                else:
                    yield failed(f"unknown finish_reason {finish!r} from SGLang {upstream.url}",
                                 "upstream_protocol_error")
                    return
                matched = finish.get("matched") if kind == "stop" else None
                delta = asm.release(final=True, matched=matched if isinstance(matched, str) else None)
                if delta is not None and delta.text:
                    yielded = True
                    yield delta
                timings.finished = time.monotonic()
                yield Finished(reason, prompt_tokens, asm.completion_tokens, timings, spec_stats_from_meta(meta))
                return
        finally:
            self.router.release(upstream)
            task = self._spawn(self._abandon(upstream, resp, rid, abort=not server_done))
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 — _abandon logs its own failures
                pass


