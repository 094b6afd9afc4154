"""The one narrow, typed interface between ``gateway/`` and ``runtime/``.

The gateway builds a :class:`GenerationRequest`, hands it to a :class:`Backend`
and consumes the :class:`Event` stream it yields. It never imports engine
internals; the engine never imports FastAPI. Everything here is plain
dataclasses so it can cross a thread or process boundary.

Event order for one request (always):
    zero or more ``TextDelta`` → exactly one ``Finished`` (or ``Failed``).
``TextDelta`` may carry several tokens at once (speculative rounds accept
several); joined in order the deltas are exactly the completion text.

Logprobs (``SamplingParams.logprobs``) are those of the TARGET model's raw
distribution: ``log_softmax`` of its logits before temperature / top-k / top-p
(vLLM's default, "raw logprobs"), so they do not depend on the sampling
parameters or on speculation (an accepted draft token gets the target's
logprob of the verification row that judged it, never the drafter's).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol, Sequence, runtime_checkable


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling controls (OpenAI chat-completions semantics).

    Attributes:
        temperature: 0 → greedy (argmax); >0 divides logits. OpenAI range [0, 2].
        top_p: nucleus mass in (0, 1]; 1 disables.
        top_k: keep the k most likely tokens; 0 or -1 disables (vLLM convention).
        max_tokens: cap on completion tokens, clamped to the context by
            :func:`clamp_max_tokens`; ``None`` → up to the context limit.
        stop: up to 4 stop strings, matched across token boundaries; the stop
            text itself is never returned.
        seed: per-request ``torch.Generator`` seed, reproducible; ``None`` → random.
        ignore_eos: keep generating past EOS (benchmarks only).
        logprobs: ``None`` → no logprobs (and no cost). ``n`` in
            ``0..MAX_TOP_LOGPROBS`` → every completion token's :class:`TokenLogprob`
            (its target logprob and the n most likely tokens, see the module
            docstring) rides on the :class:`TextDelta` that carries it.
        presence_penalty, frequency_penalty: OpenAI's, in [−2, 2]: the logit of a token
            already generated c > 0 times drops by ``presence + c · frequency``.
        repetition_penalty: vLLM/HF's, > 0 (1 = off): the logit of a token in the prompt
            or the output is divided by it when positive, multiplied when negative.
        logit_bias: ``(token id, bias)`` pairs, bias in [−100, 100], added to the logits.
        min_p: vLLM's, in [0, 1] (0 = off): after temperature, drop the tokens whose
            probability is below ``min_p`` times the most likely one's.
        min_tokens: EOS and ``stop_token_ids`` are never sampled, and stop strings not
            matched, before this many completion tokens (vLLM's ``min_tokens``).
        stop_token_ids: token ids that end the reply like EOS (finish ``stop``; the token
            counts but adds no text).

    The logits processors (penalties, ``logit_bias``, ``min_tokens``) act on the logits
    before temperature, ``min_p``, top-k and top-p, in vLLM's order
    (:mod:`runtime.engine.logits_processors`); logprobs stay the raw target's.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()

    @property
    def uses_logits_processors(self) -> bool:
        """Whether any penalty, ``logit_bias`` or ``min_tokens`` is set (else no cost at all)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens > 0)


MAX_TOP_LOGPROBS = 20  # OpenAI chat's ``top_logprobs`` limit; the engine refuses more


#: The tool-call syntax of :class:`ResponseFormat` ``"tool_calls"`` (Hermes / Qwen2.5 style), the one
#: the gateway renders into prompts and parses replies with: a call is
#: ``<tool_call>\n{"name": "<name>", "arguments": <JSON object>}\n</tool_call>``, several calls
#: back to back.
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ToolSchema:
    """One function a ``"tool_calls"`` :class:`ResponseFormat` may call.

    Attributes:
        name: the function's name (``[a-zA-Z0-9_-]{1,64}``, OpenAI's rule), generated verbatim.
        parameters: the JSON Schema of its ``arguments`` (an object schema, as OpenAI's
            ``function.parameters``); ``None`` → no parameters (``{}``).
    """

    name: str
    parameters: dict | None = None


@dataclass(frozen=True)
class ResponseFormat:
    """Constrain the completion to JSON (OpenAI chat ``response_format``, "Structured Outputs")
    or to tool calls (OpenAI chat ``tools`` with ``tool_choice``).

    The engine masks every token the grammar forbids before sampling
    (:mod:`runtime.engine.grammar`), so a reply that ends with EOS (``finish_reason:
    "stop"``) is complete: a JSON object for ``json_object``, an instance of ``schema`` for
    ``json_schema``, and for ``tool_calls`` text in the syntax of :data:`TOOL_CALL_OPEN`
    whose every call names one of ``tools`` with arguments valid against its
    ``parameters``. A reply cut by ``max_tokens`` or a stop string is a prefix of one.

    Attributes:
        type: ``"json_object"`` (any JSON object), ``"json_schema"`` or ``"tool_calls"``.
        schema: the JSON Schema (a dict) for ``json_schema``; ``None`` otherwise.
        strict: OpenAI's ``strict`` flag. Both values constrain decoding to the schema;
            properties and array items the schema does not declare are never generated
            (the instances produced are a subset of the schema's, valid either way).
        tools: the functions a ``tool_calls`` reply may call (≥ 1).
        tool_choice: ``tool_calls`` only: ``"required"`` → the reply is one or more calls and
            nothing else; ``"auto"`` → free text in which calls may appear (each one, once
            its :data:`TOOL_CALL_OPEN` is generated, constrained like a required one).
        parallel_tool_calls: ``tool_calls`` only: ``False`` → at most one call.
        reply: ``tool_calls`` with ``tool_choice="auto"`` only: the ``json_object`` /
            ``json_schema`` format a reply that is not a call follows (OpenAI chat with both
            ``tools`` and ``response_format``: the model either calls tools or answers in the
            format); ``None`` → free text.
    """

    type: str
    schema: dict | None = None
    strict: bool = False
    tools: tuple[ToolSchema, ...] = ()
    tool_choice: str = "required"
    parallel_tool_calls: bool = True
    reply: ResponseFormat | None = None


class GrammarError(ValueError):
    """Raised by :meth:`Backend.generate` (before the first event) when a
    :class:`ResponseFormat` cannot be served: an unsupported JSON-Schema keyword, an invalid
    schema, or one over the size or compile-time limits (→ HTTP 400).

    Attributes:
        message: what is wrong, for the client.
        param: where, as a dotted path inside the schema ending in the offending keyword
            (``"properties.tags.uniqueItems"``), or ``None`` for the schema as a whole.
        code: ``"unsupported_schema_keyword"``, ``"invalid_schema"``, ``"schema_too_large"``
            or ``"schema_compile_timeout"``.
        tool: for a ``"tool_calls"`` format, the index in :attr:`ResponseFormat.tools` of the
            tool whose ``parameters`` are at fault (``param`` is then a path inside them);
            ``None`` when the format as a whole is.
        in_reply: for a ``"tool_calls"`` format, the fault is in its :attr:`ResponseFormat.reply`
            (``param`` is then a path inside the reply's schema).
    """

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_schema",
                 tool: int | None = None, in_reply: bool = False):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.tool = tool
        self.in_reply = in_reply


@dataclass
class GenerationRequest:
    """One completion request as the runtime sees it.

    Attributes:
        request_id: unique id (the gateway's ``chatcmpl-…`` id).
        prompt_token_ids: the already-templated prompt tokens (gateway applies the
            chat template via :meth:`Backend.apply_chat_template`).
        sampling: sampling parameters.
        tenant: tenant name (for stats/metrics; may be ``None``).
        user: the OpenAI ``user`` field or the key's user label.
        sla_target_tokens_per_s: the tenant tier's min decode tok/s per user; ``None``
            → no target (scheduler weight 1).
        priority: tier priority, larger = more important (admission/scheduling).
        timeout_s: per-request wall-clock limit; ``None`` → engine default.
        return_spec_stats: include :class:`SpecStats` in the API response.
        cache_salt: prefix-cache namespace (vLLM ``cache_salt``): cached prompt KV is
            shared only between requests with equal salts (``None`` = the shared one).
        response_format: constrain the completion to JSON or tool calls (``None``: free
            text); only for backends whose :attr:`BackendInfo.supports_response_format` is true.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tenant: str | None = None
    user: str | None = None
    sla_target_tokens_per_s: float | None = None
    priority: int = 0
    timeout_s: float | None = None
    return_spec_stats: bool = False
    cache_salt: str | None = None
    response_format: ResponseFormat | None = None


@dataclass
class SpecStats:
    """Speculative-decoding statistics of one request (paper §4 metrics).

    ``accepted`` counts accepted *draft* tokens; ``tau`` = emitted tokens per
    round (bonus/anchor token included). ``accepted_per_position[j]`` counts
    rounds whose draft token at position j+1 was accepted. Tokens cut by stop
    strings, EOS or max_tokens are not counted.

    A round is one target forward the request decoded in. ``gated_rounds`` of them
    were plain decode steps chosen by the speculation gate (``runtime.speculation.gate``)
    or, under ``hybrid``, rounds in which the budget would verify no draft of any request
    (n-gram continuations found then are not counted as drafted):
    each counts as a round with 0 drafted / 0 verified / 0 accepted / 1 emitted, so
    ``emitted`` is still every token after the first and ``tau`` the tokens per forward.
    """

    rounds: int = 0
    drafted: int = 0
    verified: int = 0
    accepted: int = 0
    emitted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    gated_rounds: int = 0

    @property
    def tau(self) -> float:
        """Mean accepted length τ per round, bonus token included (0 if no rounds)."""
        return self.emitted / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "verified": self.verified,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "tau": round(self.tau, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "gated_rounds": self.gated_rounds,
        }


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or context limit
    ABORT = "abort"  # cancelled (client went away) — never sent to a client
    ERROR = "error"  # engine failure


@dataclass
class RequestTimings:
    """Monotonic-clock timestamps (``time.monotonic()`` seconds) and wall start.

    Decode tok/s (the project's one definition, see ``decode_tokens_per_s``):
    (completion_tokens − 1) / (t_last_token − t_first_token).
    """

    wall_queued: float = 0.0  # time.time() when the engine received it
    queued: float = 0.0
    started: float | None = None  # first scheduled (prefill began)
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


def decode_tokens_per_s(completion_tokens: int, t_first: float | None, t_last: float | None) -> float | None:
    """A request's decode speed: (completion_tokens − 1) / (t_last − t_first), tok/s.

    ``None`` when fewer than 2 tokens were produced or the interval is not positive.
    This is the single definition used by the engine, gateway, DB and bench.
    """
    if completion_tokens < 2 or t_first is None or t_last is None or t_last <= t_first:
        return None
    return (completion_tokens - 1) / (t_last - t_first)


@dataclass
class TokenLogprob:
    """One completion token's log-probability under the target (module docstring).

    Attributes:
        token_id: the emitted token.
        logprob: its natural-log probability (float, ≤ 0).
        top: the n most likely tokens of the same distribution as
            ``(token_id, logprob)``, most likely first (n = ``SamplingParams.logprobs``;
            the emitted token is among them only if it ranks in the top n).
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class TextDelta:
    """New completion text and the number of tokens it came from (≥ 1, may be 0
    when held-back text — a stop-string prefix, the complete characters of
    held-back tokens — is released at the end; an incomplete trailing UTF-8
    character is never released, its tokens are counted all the same).

    ``logprobs`` is ``None`` unless the request asked for them; then it is aligned
    1:1 with ``token_ids`` (the tokens kept this step, EOS included). The text of
    those tokens may lag behind them (a held-back partial character or possible
    stop-string prefix comes in a later delta).
    """

    text: str
    num_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Finished:
    """Terminal event: the request ended normally (stop/length) or was aborted.

    ``cached_tokens``: prompt tokens whose KV came from the prefix cache instead of a
    prefill (OpenAI ``usage.prompt_tokens_details.cached_tokens``); ``None`` when the
    backend does not report it.

    ``grammar_mask_s``: for a request with a :class:`ResponseFormat`, the seconds
    (``time.perf_counter``) the engine spent computing and applying its grammar's token masks
    (xgrammar bitmask fills, its share of each step's apply; under
    speculation every verification row, rejected drafts' rows too); ``None`` for free text or
    when the backend does not measure it (SGLang)."""

    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    timings: RequestTimings
    spec: SpecStats | None = None
    cached_tokens: int | None = None
    grammar_mask_s: float | None = None

    @property
    def decode_tokens_per_s(self) -> float | None:
        return decode_tokens_per_s(self.completion_tokens, self.timings.first_token, self.timings.last_token)


@dataclass
class Failed:
    """Terminal event: the engine failed this request. ``code`` is an OpenAI-style
    error code (e.g. ``"engine_error"``, ``"timeout"``)."""

    message: str
    code: str = "engine_error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings: RequestTimings | None = None


Event = TextDelta | Finished | Failed


class QueueFullError(RuntimeError):
    """Raised by :meth:`Backend.generate` when the waiting queue is full (→ HTTP 503
    with ``retry-after``)."""

    def __init__(self, message: str = "engine queue is full", retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def clamp_max_tokens(prompt_len: int, max_context: int, requested: int | None) -> int:
    """The one ``max_tokens`` clamp (engine, and gateway for 400s and rate limits): ``min(requested,
    max_context − prompt_len)``, the rest of the context when ``None``; ≤ 0: the prompt leaves no room."""
    room = max_context - prompt_len
    return room if requested is None else min(requested, room)


@dataclass
class BackendInfo:
    """Static facts the gateway needs (``/v1/models``, context clamping)."""

    model_name: str
    max_context: int
    eos_token_id: int
    supports_logprobs: bool = True  # False → the gateway refuses logprobs with a 400
    supports_response_format: bool = False  # False → the gateway refuses JSON response formats with a 400
    # True → the chat template renders tools itself (it reads ``tools``): the gateway passes tool
    # definitions and tool messages to apply_chat_template instead of rendering them (Hermes style)
    chat_template_tools: bool = False
    vocab_size: int | None = None  # token ids in logit_bias / stop_token_ids must be below it (None: unknown)


@dataclass
class LoadSnapshot:
    """Live engine load, for admission control and metrics."""

    running: int
    waiting: int
    max_batch: int
    forward_steps: int  # engine counter: target forward passes since start
    decode_steps: int = 0  # engine counter: forwards that verified ≥ 1 decoding request (rounds)
    verify_tokens: int = 0  # engine counter: Σ over those rounds of B = Σ_r (1 + ℓ_r) tokens verified
    prefix_cache_queries: int = 0  # engine counter: prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # engine counter: of those, KV reused (not prefilled again)
    spec_steps: int = 0  # engine counter: decode rounds that drafted (speculation on)
    spec_gated_steps: int = 0  # engine counter: decode rounds the speculation gate ran as plain decode
    decode_rows: int = 0  # engine counter: request-rounds (Σ over decode rounds of the requests in each)
    zero_budget_rows: int = 0  # engine counter: request-rounds verified with ℓ_r = 0 (no draft token)
    decode_tokens: int = 0  # engine counter: tokens decode rounds produced (τ = decode_tokens / decode_rows)
    # live survival correction: (proposer, n, position, sampling, realised ÷ calibrated acceptance), see
    # runtime/speculation/acceptance.py; empty without a speculator (or before its first verified draft)
    acceptance_ratios: list[tuple[str, str, str, str, float]] = field(default_factory=list)


@dataclass
class SpecInfo:
    """How the backend speculates (for ``/admin`` endpoints and metrics).

    Attributes:
        method: ``none``, ``dspark``, ``parallel``, ``prompt_lookup`` (or ``sglang``).
        policy: verification-budget policy (``fixed``, ``mtp1``, ``threshold``,
            ``dspark``, ``dspark-sla``); ``None`` without speculation.
        block_size: γ drafted per round (0 without speculation).
        sps_table: the SPS table in use as a JSON-able dict
            (``runtime.speculation.sps.SpsTable.to_dict()``), or ``None``.
    """

    method: str
    policy: str | None = None
    block_size: int = 0
    sps_table: dict | None = None


@runtime_checkable
class Backend(Protocol):
    """What the gateway talks to. Implemented by the embedded engine
    (``runtime.engine.async_engine.AsyncEngine``) and later the SGLang client."""

    @property
    def info(self) -> BackendInfo: ...

    def ready(self) -> bool:
        """True once the model is loaded and the engine loop runs."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def apply_chat_template(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
        """Token ids of the templated prompt (tokenizer's own chat template,
        generation prompt appended). Raises ``ValueError`` on bad messages.

        ``tools`` (only when :attr:`BackendInfo.chat_template_tools`): OpenAI function tools
        (``{"type": "function", "function": {...}}``) for the template's own tool section;
        ``messages`` may then hold Hugging Face tool messages (assistant ``tool_calls`` with
        ``arguments`` as objects, ``role: "tool"``)."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of a raw completion prompt (``/v1/completions``)."""
        ...

    def token_bytes(self, token_ids: Sequence[int]) -> list[bytes]:
        """The UTF-8 bytes each token stands for (for logprobs' ``token``/``bytes``).

        Byte-level BPE: a multibyte character may be split over tokens, so one
        token's bytes need not be valid UTF-8; joined in order they are the
        completion's bytes. Special tokens give their literal text (``<|im_end|>``).
        """
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[Event]:
        """Submit and stream events. Raises :class:`QueueFullError` (before the
        first event) when the waiting queue is full, :class:`GrammarError` (before the
        first event) when its ``response_format`` cannot be served. Closing the iterator early
        (``aclose()`` / task cancellation) aborts the request and frees its slot
        and KV before the next engine step."""
        ...

    def load(self) -> LoadSnapshot: ...

    def spec_info(self) -> SpecInfo: ...
