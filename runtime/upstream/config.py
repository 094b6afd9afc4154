"""Settings of the OpenAI-compatible upstream backend (:mod:`runtime.upstream.client`).

Plain data, no imports beyond the standard library: the gateway's settings
(:mod:`gateway.core.config`) derive one ``SPARKGATE_UPSTREAM_<FIELD>`` variable from each field.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class UpstreamConfig:
    """Settings of the OpenAI-compatible upstream backend.

    Attributes:
        urls: base URLs of the OpenAI-compatible servers (vLLM, SGLang, llama-server, …), without
            the ``/v1`` suffix, e.g. ``http://10.0.0.5:8000``; requests are spread over them by
            least outstanding requests.
        keys: their API keys (sent as ``Authorization: Bearer``): none, one for every server,
            or one per URL in the same order.
        model: the ``model`` sent upstream (the servers' served model name); ``None`` → the
            public ``model_name``.
        model_name: public model name reported to the gateway's clients.
        max_context: context length in tokens (must not exceed the servers' ``--max-model-len``
            / ``--ctx-size``).
        tokenizer_path: local dir (or hub id) of the served model's tokenizer, which templates
            and counts the prompts sent as token ids; ``None`` → the embedded model's converted
            cache (``runtime.models.loader.ensure_converted``).
        eos_token_id: override; ``None`` → the tokenizer's.
        send_priority: send the tier's ``priority`` in the body (vLLM run with
            ``--scheduling-policy priority``; SGLang with ``--enable-priority-scheduling``).
        priority_low_values_first: the servers run the lower ``priority`` first (vLLM; SGLang
            with ``--schedule-low-priority-values-first``): the tier priority is negated so a
            more important tier still goes first. ``False`` for SGLang's default order.
        response_format: the servers constrain ``/v1/completions`` to ``response_format``
            ``json_object`` / ``json_schema`` (vLLM, SGLang): JSON response formats are served;
            ``False`` → the gateway answers them with 400.
        logprobs: the servers return completion logprobs with token ids (vLLM's
            ``return_tokens_as_token_ids``): ``logprobs`` requests are served; ``False`` → 400.
        return_token_ids: ask for each chunk's token ids (vLLM and SGLang ``return_token_ids``)
            so the per-chunk token counts are exact; otherwise a chunk with text counts as one
            token until the final usage.
        send_cache_salt: send the request's prefix-cache namespace as ``cache_salt`` (vLLM,
            SGLang), so a tenant's cached prompts are not reused for another's (see
            ``prefix_cache_scope``).
        connect_timeout_s: connect timeout (seconds); an upstream that does not accept the
            connection in time is ejected until its next healthy probe.
        read_timeout_s: the longest wait for the response headers or between two chunks of a
            stream (seconds); beyond it the request fails with 504.
        request_timeout_s: default wall-clock limit per request (seconds; → 504).
        health_path: the servers' health endpoint (``/health`` on vLLM, SGLang and llama-server;
            ``/v1/models`` for others).
        health_interval_s: seconds between two health probes of a server; an ejected server
            rejoins at its first healthy probe.
        health_timeout_s: timeout of one health probe (seconds).
        max_in_flight_per_upstream: admission cap per server; beyond it on every healthy
            server → 503 ``queue_full``. ``None`` → no cap (the servers queue).
        retry_after_s: ``Retry-After`` of a 503 when the upstream sent none (seconds).
    """

    urls: tuple[str, ...] = ("http://127.0.0.1:8080",)
    keys: tuple[str, ...] = ()
    model: str | None = None
    model_name: str = "SmolLM2-135M-Instruct"
    max_context: int = 8192
    tokenizer_path: str | None = None
    eos_token_id: int | None = None
    send_priority: bool = False
    priority_low_values_first: bool = True
    response_format: bool = False
    logprobs: bool = False
    return_token_ids: bool = False
    send_cache_salt: bool = False
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    health_path: str = "/health"
    health_interval_s: float = 10.0
    health_timeout_s: float = 5.0
    max_in_flight_per_upstream: int | None = None
    retry_after_s: float = 1.0
