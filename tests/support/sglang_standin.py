"""STAND-IN for an SGLang 0.5.23 server's native HTTP API — NOT SGLang, no model inside.

A small Starlette app that speaks the wire protocol the SGLang backend
(:mod:`runtime.sglang.client`) relies on, so the client can be tested on CPU without
SGLang. It generates a scripted token sequence; everything else follows the 0.5.23
source (file paths below are inside the ``sglang-0.5.23`` wheel):

* ``POST /generate`` (``srt/entrypoints/http_server.py`` ``generate_request`` /
  ``serve_generate_request``): the body must satisfy the JSON contract
  (``srt/entrypoints/api_contract.py`` → ``api/v1/api_types.py`` ``GenerateRequest``,
  recorded in :data:`CONTRACT`; a violation is ``400 {"error": "<text>"}``). Streaming
  answer: ``data: {"text", "output_ids", "meta_info"}\\n\\n`` per step, ``data: [DONE]\\n\\n``
  last. ``text``/``output_ids`` are cumulative by default and deltas with
  ``incremental=True`` (the server flag ``--incremental-streaming-output``,
  ``srt/arg_groups/fields/serving.py``; ``tokenizer_manager._handle_batch_output``).
  ``meta_info``: ``id``, ``finish_reason`` (``None`` until the last chunk; then
  ``{"type": "stop", "matched": <str|int>}``, ``{"type": "length", "length": n}`` or
  ``{"type": "abort", "message", "status_code", "err_type"}``, ``schedule_batch.py``
  ``FINISH_*.to_json``), ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``,
  ``reasoning_tokens``, ``weight_version``, ``num_retractions``; on the last chunk
  ``e2e_latency`` and, with speculative decoding, the ``spec_*`` fields of
  ``tokenizer_manager._calculate_spec_decoding_metrics``. A stop string is trimmed
  only from the last chunk's tail, so a prefix of it can already have been streamed
  (``detokenizer_manager.trim_matched_stop``) — reproduced on purpose. Errors inside a
  stream: ``data: {"error": {"message", "type", "code", "retryable"}}``.
* ``POST /abort_request`` ``{"rid"}`` → 200; the request ends with an ``abort`` finish.
* ``GET /health``, ``GET /health_generate`` → 200, or 503 when marked unhealthy.
* ``GET /server_info`` → a few resolved server args (``speculative_algorithm``, …).
* ``GET /model_info`` → ``model_path``, ``served_model_name``, ``tokenizer_path``, … (read by
  sglang-router when it registers a worker, ``tests/scaleout/``).
* ``GET /v1/loads`` (``srt/entrypoints/v1_loads.py``; there is no ``/get_load`` in
  0.5.23) → ``{"timestamp", "version", "accelerator", "num_accelerators", "loads": [...]}``.

Constrained decoding (``sampling_params.json_schema`` / ``regex`` / ``ebnf`` /
``structural_tag``, JSON strings; ``srt/sampling/sampling_params.py`` ``verify``: at most one of
the first three, else 400 ``Only one of regex, json_schema, or ebnf can be set.``): instead of
its script the stand-in emits a reply the constraint allows — for a ``json_schema`` an
instance of the schema (:func:`schema_instance`, the keywords the tests use), for a
``structural_tag`` (xgrammar's format: ``triggered_tags`` / ``tags_with_separator`` of
``tag`` s with ``json_schema`` content) one call of its first tag — split into tokens of a few
characters. A constraint it cannot satisfy (a JSON type that does not exist, a keyword it does
not model) ends the request as SGLang's grammar manager does when xgrammar refuses it: an
``abort`` of ``status_code`` 400, ``Invalid grammar request …``, before any token. Every
constraint received is recorded (``constraints``: ``(field, parsed JSON)``).

Knobs (attributes of :class:`SGLangStandin`) make it refuse (HTTP status), abort for a
full queue, emit an error chunk, a malformed chunk, or drop the stream. It records
request bodies, aborts and client disconnects.
"""

from __future__ import annotations

import ast
import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

# ---------------------------------------------------------------------------------------
# The JSON contract, recorded from sglang-0.5.23's generated ``sglang/api/v1/api_types.py``
# (class bodies at the given lines; field → annotation exactly as in the source).
# tests/runtime/sglang/test_source.py re-extracts it from the wheel (SPARKGATE_CHECK_SGLANG_SOURCE=1).
# ---------------------------------------------------------------------------------------
API_TYPES_PATH = "sglang/api/v1/api_types.py"

CONTRACT: dict[str, dict[str, Any]] = {
    "ErrorBody": {"line": 114, "unknown": "ignored", "fields": {"message": "str", "code": "int"}},
    "FinishStop": {"line": 130, "unknown": "ignored", "fields": {"matched": "Optional[Matched]"}},
    "FinishLength": {"line": 145, "unknown": "ignored", "fields": {"length": "Optional[int]"}},
    "FinishAbort": {"line": 160, "unknown": "ignored", "fields": {
        "message": "Optional[str]", "status_code": "Optional[int]", "err_type": "Optional[str]"}},
    "SamplingParams": {"line": 177, "unknown": "rejected", "fields": {
        "max_new_tokens": "Optional[int]", "stop": "Optional[StringOrList]",
        "stop_token_ids": "Optional[Int64List]", "stop_regex": "Optional[StringOrList]",
        "temperature": "Optional[float]", "top_p": "Optional[float]", "top_k": "Optional[int]",
        "min_p": "Optional[float]", "frequency_penalty": "Optional[float]",
        "presence_penalty": "Optional[float]", "repetition_penalty": "Optional[float]",
        "min_new_tokens": "Optional[int]", "n": "Optional[int]", "json_schema": "Optional[str]",
        "regex": "Optional[str]", "ebnf": "Optional[str]", "structural_tag": "Optional[str]",
        "ignore_eos": "Optional[bool]", "skip_special_tokens": "Optional[bool]",
        "spaces_between_special_tokens": "Optional[bool]", "no_stop_trim": "Optional[bool]",
        "stream_interval": "Optional[int]", "logit_bias": "Dict[str, float]",
        "sampling_seed": "Optional[int]", "custom_params": "Optional[Any]",
        "beam_width": "Optional[int]", "watermark": "Optional[WatermarkRequestConfig]",
        "choice": "List[str]"}},
    "GenerateRequest": {"line": 236, "unknown": "ignored", "fields": {
        "rid": "Optional[StringOrList]", "text": "Optional[StringOrList]",
        "input_ids": "Optional[TokenIdsOrList]", "stream": "Optional[bool]",
        "sampling_params": "Optional[SamplingParamsOrList]",
        "return_logprob": "Optional[BoolOrList]", "logprob_start_len": "Optional[Int64OrList]",
        "top_logprobs_num": "Optional[Int64OrList]", "token_ids_logprob": "Optional[TokenIdsOrList]",
        "return_hidden_states": "Optional[BoolOrList]", "return_text_in_logprobs": "Optional[bool]",
        "bootstrap_host": "Optional[OptionalStringOrList]",
        "bootstrap_port": "Optional[OptionalInt64OrList]",
        "bootstrap_room": "Optional[OptionalInt64OrList]",
        "bootstrap_pair_key": "Optional[OptionalStringOrList]",
        "decode_tp_size": "Optional[OptionalInt64OrList]", "routed_dp_rank": "Optional[int]",
        "disagg_prefill_dp_rank": "Optional[int]", "image_data": "Optional[MediaInput]",
        "mm_hashes": "Optional[StringListOrList]", "video_data": "Optional[MediaInput]",
        "audio_data": "Optional[MediaInput]", "extra_key": "Optional[StringOrList]",
        "priority": "Optional[int]", "cache_salt": "Optional[StringOrList]",
        "require_reasoning": "Optional[bool]", "lora_path": "Optional[OptionalStringOrList]",
        "session_params": "Optional[Any]", "kv_hints": "Optional[KvHintsEnvelopeOrList]",
        "routing_key": "Optional[str]", "max_thinking_tokens": "Optional[int]",
        "session_id": "Optional[str]", "custom_logit_processor": "Optional[OptionalStringOrList]",
        "custom_labels": "Dict[str, str]", "images_config": "Optional[ImagesConfig]",
        "return_prompt_token_ids": "bool", "routed_experts_start_len": "int",
        "return_sampling_mask": "Optional[BoolOrList]", "modalities": "Optional[OptionalStringList]"}},
    "GenerateMetaInfo": {"line": 357, "unknown": "ignored", "fields": {
        "id": "str", "prompt_tokens": "int", "completion_tokens": "int",
        "finish_reason": "Optional[FinishReason]", "output_token_logprobs": "Optional[LogprobEntries]",
        "input_token_logprobs": "Optional[LogprobEntries]",
        "output_top_logprobs": "List[NullableTopLogprobs]",
        "input_top_logprobs": "List[NullableTopLogprobs]",
        "output_token_ids_logprobs": "List[NullableTopLogprobs]",
        "input_token_ids_logprobs": "List[NullableTopLogprobs]",
        "hidden_states": "List[HiddenStateRow]", "e2e_latency": "Optional[float]",
        "cached_tokens": "int", "reasoning_tokens": "int",
        "output_token_logprobs_length": "Optional[int]", "weight_version": "Optional[str]",
        "weight_versions": "List[WeightVersionSpan]", "image_tokens": "Optional[int]",
        "audio_tokens": "Optional[int]", "video_tokens": "Optional[int]"}},
    "GenerateResponse": {"line": 408, "unknown": "ignored", "fields": {
        "text": "str", "meta_info": "Optional[GenerateMetaInfo]", "output_ids": "Optional[TokenIds]",
        "index": "Optional[int]", "prompt_token_ids": "Optional[TokenIds]"}},
    "GenerateStreamError": {"line": 427, "unknown": "ignored", "fields": {
        "error": "Optional[ErrorBody]", "index": "Optional[int]"}},
    "AbortRequest": {"line": 639, "unknown": "ignored", "fields": {"rid": "str", "abort_all": "bool"}},
}

#: type aliases used above (``api_types.py``, module level)
ALIASES: dict[str, str] = {
    "TokenIds": "List[int]", "StringList": "List[str]", "StringListList": "List[StringList]",
    "BoolList": "List[bool]", "Int64List": "List[int]", "TokenIdsList": "List[TokenIds]",
    "OptionalString": "Optional[str]", "OptionalStringList": "List[OptionalString]",
    "OptionalInt64": "Optional[int]", "OptionalInt64List": "List[OptionalInt64]",
    "MatchedTokens": "List[int]",
    "FinishReason": "Union[FinishStop, FinishLength, FinishAbort, Dict[str, Any]]",
    "SamplingParamsList": "List[SamplingParams]", "StringOrList": "Union[str, StringList]",
    "StringListOrList": "Union[StringList, StringListList]", "BoolOrList": "Union[bool, BoolList]",
    "Int64OrList": "Union[int, Int64List]", "TokenIdsOrList": "Union[TokenIds, TokenIdsList]",
    "OptionalStringOrList": "Union[OptionalString, OptionalStringList]",
    "OptionalInt64OrList": "Union[OptionalInt64, OptionalInt64List]",
    "Matched": "Union[int, str, MatchedTokens]",
    "SamplingParamsOrList": "Union[SamplingParams, SamplingParamsList]",
}

#: fields the generated decoders read with ``_expect_uint`` (non-negative integers)
UNSIGNED: dict[str, set[str]] = {
    "GenerateMetaInfo": {"prompt_tokens", "completion_tokens", "cached_tokens", "reasoning_tokens",
                         "output_token_logprobs_length", "image_tokens", "audio_tokens", "video_tokens"},
    "GenerateResponse": {"index"},
    "GenerateStreamError": {"index"},
    "FinishLength": {"length"},
    "FinishAbort": {"status_code"},
}

#: the ``type`` tags decode_FinishReason knows (``api_types.py``)
FINISH_TYPES = {"stop": "FinishStop", "length": "FinishLength", "abort": "FinishAbort"}


class ContractError(ValueError):
    """A JSON value violates :data:`CONTRACT`."""


def _check(annotation: ast.expr, value: Any, where: str) -> None:
    if isinstance(annotation, ast.Name):
        name = annotation.id
        if name == "Any":
            return
        if name == "str":
            ok = isinstance(value, str)
        elif name == "bool":
            ok = isinstance(value, bool)
        elif name == "int":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif name == "float":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif name in ALIASES:
            return _check(ast.parse(ALIASES[name], mode="eval").body, value, where)
        elif name in CONTRACT:
            return validate(name, value, where)
        else:
            return  # a type we do not model (media, logprobs, kv hints): not used here
        if not ok:
            raise ContractError(f"{where}: expected {name}, got {type(value).__name__} {value!r}")
        return
    if isinstance(annotation, ast.Subscript):
        outer = annotation.value.id  # type: ignore[attr-defined]
        inner = annotation.slice
        args = list(inner.elts) if isinstance(inner, ast.Tuple) else [inner]
        if outer == "Optional":
            if value is not None:
                _check(args[0], value, where)
            return
        if outer == "List":
            if not isinstance(value, list):
                raise ContractError(f"{where}: expected a list, got {type(value).__name__}")
            for i, item in enumerate(value):
                _check(args[0], item, f"{where}[{i}]")
            return
        if outer == "Dict":
            if not isinstance(value, dict):
                raise ContractError(f"{where}: expected a map, got {type(value).__name__}")
            for k, v in value.items():
                _check(args[1], v, f"{where}[{k!r}]")
            return
        if outer == "Union":
            errors = []
            for arg in args:
                try:
                    return _check(arg, value, where)
                except ContractError as exc:
                    errors.append(str(exc))
            raise ContractError(f"{where}: matches no variant ({'; '.join(errors)})")
    raise ContractError(f"unsupported annotation {ast.unparse(annotation)}")


def validate(struct: str, value: Any, where: str | None = None) -> None:
    """Check ``value`` (parsed JSON) against the recorded ``struct``.

    Raises:
        ContractError: wrong types, an unknown key where unknown keys are rejected, a
            negative unsigned field, or an unknown ``finish_reason.type``.
    """
    spec = CONTRACT[struct]
    where = where or struct
    if not isinstance(value, dict):
        raise ContractError(f"{where}: expected struct {struct}, got {type(value).__name__}")
    for key, item in value.items():
        annotation = spec["fields"].get(key)
        if annotation is None:
            if spec["unknown"] == "rejected":
                raise ContractError(f"unknown field `{key}` in {struct}")
            continue
        _check(ast.parse(annotation, mode="eval").body, item, f"{where}.{key}")
        if key in UNSIGNED.get(struct, ()) and item is not None and item < 0:
            raise ContractError(f"{where}.{key}: expected an unsigned integer, got {item}")
    if struct == "GenerateMetaInfo" and value.get("finish_reason") is not None:
        fr = value["finish_reason"]
        tag = fr.get("type")
        if tag not in FINISH_TYPES:
            raise ContractError(f"{where}.finish_reason: unknown type {tag!r}")
        validate(FINISH_TYPES[tag], {k: v for k, v in fr.items() if k != "type"}, f"{where}.finish_reason")


def validate_chunk(chunk: Any) -> str:
    """Validate one streamed ``data:`` JSON object; returns ``"response"`` or ``"error"``."""
    if isinstance(chunk, dict) and "error" in chunk:
        validate("GenerateStreamError", chunk)
        return "error"
    validate("GenerateResponse", chunk)
    return "response"


# ---------------------------------------------------------------------------------------
# Constrained replies
# ---------------------------------------------------------------------------------------
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")  # mutually exclusive (SamplingParams.verify)
FORMATS = {"date": "2026-01-02", "date-time": "2026-01-02T03:04:05Z", "email": "a@b.co",
           "uuid": "12345678-1234-5678-1234-567812345678"}


class InvalidGrammar(ValueError):
    """A constraint the stand-in cannot satisfy (SGLang: xgrammar refuses to compile it)."""


def schema_instance(schema: Any) -> Any:
    """A JSON value that validates against ``schema``: ``const``, the first ``enum`` value, the
    first ``anyOf``/``oneOf`` branch; objects with their ``required`` properties; a tuple's
    ``prefixItems``; arrays of ``max(minItems, 1)`` items (at most ``maxItems``); strings of ``minLength`` (at least 1, at
    most ``maxLength``) ``"a"`` s or a fixed value of a known ``format``; the least allowed
    integer or number. Raises :class:`InvalidGrammar` for what it does not model."""
    if schema is True or schema == {}:
        return {}
    if not isinstance(schema, dict):
        raise InvalidGrammar(f"not a schema: {schema!r}")
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return schema_instance(schema[key][0])
    kind = schema.get("type", "object")
    if kind == "object":
        props = schema.get("properties", {})
        return {name: schema_instance(props.get(name, {})) for name in schema.get("required", [])}
    if kind == "array":
        if "prefixItems" in schema:  # a tuple: one instance per position, nothing after it
            return [schema_instance(s) for s in schema["prefixItems"]]
        n = max(schema.get("minItems", 0), 1)
        n = min(n, schema.get("maxItems", n))
        return [schema_instance(schema.get("items", {})) for _ in range(n)]
    if kind == "string":
        if "pattern" in schema:
            raise InvalidGrammar("the stand-in does not generate patterns")
        if "format" in schema:
            return FORMATS[schema["format"]]
        return "a" * min(max(schema.get("minLength", 0), 1), schema.get("maxLength", 1 << 30))
    if kind in ("integer", "number"):
        lo = schema.get("minimum", schema.get("exclusiveMinimum", -1) + 1 if "exclusiveMinimum" in schema else 0)
        hi = schema.get("maximum")
        value = lo if hi is None else min(lo, hi)
        return int(value) if kind == "integer" else float(value)
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    raise InvalidGrammar(f"unknown JSON type {kind!r}")


def constrained_text(field: str, value: Any) -> str | None:
    """The reply the stand-in writes under the constraint ``field`` = ``value`` (parsed JSON;
    ``None``: a constraint it does not generate for — regex, EBNF — and free text it is)."""
    if field == "json_schema":
        return json.dumps(schema_instance(value), ensure_ascii=False)
    if field == "structural_tag":
        fmt = value.get("format") if isinstance(value, dict) else None
        if isinstance(fmt, dict) and fmt.get("type") == "or":  # a JSON reply or calls: the reply
            answer = fmt["elements"][0]
            if answer.get("type") != "json_schema":
                raise InvalidGrammar(f"unsupported 'or' element {answer.get('type')!r}")
            return json.dumps(schema_instance(answer["json_schema"]), ensure_ascii=False)
        if not isinstance(fmt, dict) or fmt.get("type") not in ("triggered_tags", "tags_with_separator"):
            raise InvalidGrammar(f"unsupported structural tag {value!r}")
        tag = fmt["tags"][0]
        content = tag["content"]
        if content.get("type") != "json_schema":
            raise InvalidGrammar(f"unsupported tag content {content.get('type')!r}")
        return tag["begin"] + json.dumps(schema_instance(content["json_schema"]), ensure_ascii=False) + tag["end"]
    return None


def split_tokens(text: str, size: int = 3) -> tuple[str, ...]:
    """``text`` as "tokens" of ``size`` characters."""
    return tuple(text[i:i + size] for i in range(0, len(text), size))


# ---------------------------------------------------------------------------------------
# The stand-in server
# ---------------------------------------------------------------------------------------
EOS_ID = 2
FIRST_TOKEN_ID = 1000


@dataclass
class SGLangStandin:
    """State and knobs of one stand-in server (mutate between tests; :meth:`reset`).

    Generation: the words of ``script`` are the tokens (ids ``1000 + i``), emitted
    ``tokens_per_step`` per chunk (a speculative round accepting several tokens) with
    ``step_delay_s`` between chunks; then EOS (``finish_reason.type = "stop"``,
    ``matched = 2``) unless ``max_new_tokens`` came first (``length``) or a stop string
    matched (``stop``, ``matched = <str>``).
    """

    script: tuple[str, ...] = ("Hello", " world", ",", " how", " are", " you", "?")
    tokens_per_step: int = 1
    step_delay_s: float = 0.0
    incremental: bool = False
    spec_gamma: int | None = None  # speculative decoding with γ draft tokens per round
    healthy: bool = True
    fail_status: int | None = None  # answer /generate with this HTTP status
    retry_after: str | None = None
    queue_full_abort: bool = False  # scheduler rejects: abort finish with status 503
    error_after: int | None = None  # send an error chunk after this many chunks
    malformed_after: int | None = None  # send a non-JSON data line after this many chunks
    drop_after: int | None = None  # end the body after this many chunks (no finish, no [DONE])
    running: int = 0  # reported by /v1/loads
    waiting: int = 0
    max_running: int = 64

    requests: list[dict] = field(default_factory=list)
    constraints: list[tuple[str, Any]] = field(default_factory=list)  # (sampling field, parsed JSON) received
    aborts: list[str] = field(default_factory=list)
    disconnects: list[str] = field(default_factory=list)
    chunks_sent: list[dict] = field(default_factory=list)
    health_checks: int = 0
    active: set[str] = field(default_factory=set)  # rids generating (left before the finishing chunk)

    def reset(self) -> None:
        fresh = SGLangStandin()
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(fresh, name))

    # -- routes -------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        self.health_checks += 1
        return Response(status_code=200 if self.healthy else 503)

    async def loads(self, request: Request) -> Response:
        load = {"timestamp": time.time(), "dp_rank": 0, "num_running_reqs": self.running + len(self.active),
                "num_waiting_reqs": self.waiting, "num_waiting_uncached_tokens": 0, "num_used_tokens": 0,
                "num_total_tokens": 0, "num_active_tokens": 0, "num_prealloc_ready_tokens": 0,
                "max_total_num_tokens": 100000, "max_running_requests": self.max_running,
                "token_usage": 0.0, "gen_throughput": 0.0, "cache_hit_rate": 0.0, "utilization": 0.0,
                "total_prefill_uncached_tokens": 0, "total_prefill_busy_us": 0}
        return JSONResponse({"timestamp": "1970-01-01T00:00:00+00:00", "version": "0.5.23",
                             "accelerator": None, "num_accelerators": 1, "loads": [load]})

    async def server_info(self, request: Request) -> Response:
        """A few of the resolved server args ``/server_info`` returns (flat, as the stand-in
        assumes; the real body holds every server arg plus scheduler state)."""
        return JSONResponse({
            "model_path": "standin/model", "speculative_algorithm": "DSPARK" if self.spec_gamma else None,
            "speculative_dspark_block_size": self.spec_gamma,
            "speculative_num_draft_tokens": self.spec_gamma + 1 if self.spec_gamma else None,
            "max_running_requests": self.max_running, "version": "0.5.23", "frontend": "python",
        })

    async def model_info(self, request: Request) -> Response:
        """A few of ``GET /model_info``'s fields (``http_server.py`` ``model_info``); sglang-router
        reads the model path from it when it registers a worker."""
        return JSONResponse({"model_path": "standin/model", "served_model_name": "standin/model",
                             "tokenizer_path": "standin/model", "is_generation": True,
                             "weight_version": "default"})

    async def abort_request(self, request: Request) -> Response:
        body = await request.json()
        try:
            validate("AbortRequest", body)
        except ContractError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        self.aborts.append(body.get("rid", ""))
        return Response(status_code=200)

    async def generate(self, request: Request) -> Response:
        try:
            body = await request.json()
            validate("GenerateRequest", body)
            sp = body.get("sampling_params") or {}
            if isinstance(sp, dict):
                validate("SamplingParams", sp)
        except (ContractError, ValueError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)  # api_contract.py shape
        top_k = sp.get("top_k")
        if top_k is not None and top_k != -1 and top_k < 1:  # SamplingParams.verify
            return JSONResponse({"error": {"message": f"top_k must be -1 (disable) or at least 1, got {top_k}."}},
                                status_code=400)
        if sum(sp.get(f) is not None for f in GRAMMAR_FIELDS) > 1:  # SamplingParams.verify
            return JSONResponse({"error": {"message": "Only one of regex, json_schema, or ebnf can be set."}},
                                status_code=400)
        self.requests.append(body)
        for name in (*GRAMMAR_FIELDS, "structural_tag"):
            if sp.get(name) is not None:
                try:
                    parsed = json.loads(sp[name]) if name in ("json_schema", "structural_tag") else sp[name]
                except ValueError:
                    parsed = sp[name]  # not JSON: refused when the stream starts
                self.constraints.append((name, parsed))
        if self.fail_status is not None:
            headers = {"retry-after": self.retry_after} if self.retry_after else None
            return JSONResponse({"error": {"message": f"stand-in refuses with {self.fail_status}"}},
                                status_code=self.fail_status, headers=headers)
        if not body.get("stream"):
            return JSONResponse({"error": {"message": "the stand-in only streams"}}, status_code=400)
        return StreamingResponse(self._stream(body), media_type="text/event-stream")

    def _chunk(self, rid: str, text: str, ids: list[int], prompt: int, completion: int,
               finish: dict | None, extra: dict | None = None) -> bytes:
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": prompt, "weight_version": "default",
                "num_retractions": 0, "reasoning_tokens": 0, "completion_tokens": completion, "cached_tokens": 0}
        if extra:
            meta.update(extra)
        chunk = {"text": text, "output_ids": ids, "meta_info": meta}
        self.chunks_sent.append(chunk)
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    def _script(self, sp: dict) -> tuple[str, ...]:
        """The tokens to emit: the constrained reply (SGLang's priority: json_schema, regex,
        ebnf, structural_tag), else :attr:`script`. Raises :class:`InvalidGrammar`."""
        for name in (*GRAMMAR_FIELDS, "structural_tag"):
            if sp.get(name) is not None:
                try:
                    value = json.loads(sp[name]) if name in ("json_schema", "structural_tag") else sp[name]
                except ValueError as exc:
                    raise InvalidGrammar(str(exc)) from None
                text = constrained_text(name, value)
                return self.script if text is None else split_tokens(text)
        return self.script

    async def _stream(self, body: dict):
        rid = body.get("rid") or "standin-rid"
        prompt = len(body.get("input_ids") or [])
        sp = body.get("sampling_params") or {}
        max_new = sp.get("max_new_tokens", 128)
        stops = sp.get("stop") or []
        stops = [stops] if isinstance(stops, str) else list(stops)
        started = time.monotonic()
        self.active.add(rid)
        text, ids = "", []
        sent_text, sent_ids = 0, 0
        verify_ct, correct_hist, cap_hist = 0, [], []
        n_chunks = 0
        try:
            if self.queue_full_abort:
                finish = {"type": "abort", "message": "The request queue is full.", "status_code": 503,
                          "err_type": None}
                yield self._chunk(rid, "", [], prompt, 0, finish)
                yield b"data: [DONE]\n\n"
                return
            try:
                script = self._script(sp)
            except (InvalidGrammar, KeyError, TypeError, IndexError) as exc:  # grammar_manager: abort, 400
                finish = {"type": "abort", "message": f"Invalid grammar request: {exc}", "status_code": 400,
                          "err_type": None}
                yield self._chunk(rid, "", [], prompt, 0, finish)
                yield b"data: [DONE]\n\n"
                return
            pos = 0
            while True:
                if self.step_delay_s:
                    await asyncio.sleep(self.step_delay_s)
                if rid in self.aborts:
                    finish = {"type": "abort", "message": "Abort request", "status_code": None, "err_type": None}
                    yield self._chunk(rid, "" if self.incremental else text, [] if self.incremental else ids,
                                      prompt, len(ids), finish)
                    yield b"data: [DONE]\n\n"
                    return
                if self.drop_after is not None and n_chunks >= self.drop_after:
                    return
                if self.error_after is not None and n_chunks >= self.error_after:
                    err = {"error": {"message": "stand-in error", "type": "invalid_request_error", "code": 400,
                                     "retryable": False}}
                    self.chunks_sent.append(err)
                    yield b"data: " + json.dumps(err).encode() + b"\n\n"
                    yield b"data: [DONE]\n\n"
                    return
                if self.malformed_after is not None and n_chunks == self.malformed_after:
                    yield b"data: {this is not json\n\n"
                # one step: up to tokens_per_step tokens, or EOS
                step = []
                finish = None
                while len(step) < self.tokens_per_step and finish is None:
                    if len(ids) + len(step) >= max_new:
                        finish = {"type": "length", "length": max_new}
                    elif pos >= len(script) and not sp.get("ignore_eos"):
                        step.append(EOS_ID)
                        finish = {"type": "stop", "matched": EOS_ID}
                    else:
                        step.append(FIRST_TOKEN_ID + pos % max(len(script), 1))
                        text += script[pos % len(script)] if script else ""
                        pos += 1
                        hits = [(text.find(s), s) for s in stops if s and text.find(s) >= 0]
                        if hits:
                            finish = {"type": "stop", "matched": min(hits)[1]}
                ids.extend(step)
                if step:
                    verify_ct += 1
                    accepted = len(step) - 1
                    correct_hist += [0] * (accepted + 1 - len(correct_hist))
                    correct_hist[accepted] += 1
                    if self.spec_gamma:
                        cap = min(self.spec_gamma + 1, len(step) + 1)
                        cap_hist += [0] * (cap + 1 - len(cap_hist))
                        cap_hist[cap] += 1
                extra = None
                if finish is not None:
                    out = text
                    if finish["type"] == "stop" and isinstance(finish.get("matched"), str):
                        out = text[:text.find(finish["matched"])]  # trim_matched_stop
                    text = text[:sent_text] + out[sent_text:]  # the tail only: a streamed prefix stays
                    extra = {"e2e_latency": time.monotonic() - started}
                    if self.spec_gamma and verify_ct:
                        proposed = verify_ct * self.spec_gamma
                        correct = sum(k * n for k, n in enumerate(correct_hist))
                        extra.update({
                            "spec_accept_rate": correct / proposed,
                            "spec_accept_length": len(ids) / verify_ct,
                            "spec_num_correct_drafts": correct,
                            "spec_num_proposed_drafts": proposed,
                            "spec_verify_ct": verify_ct,
                            "spec_cap_length": sum(k * n for k, n in enumerate(cap_hist)) / verify_ct,
                            "spec_correct_drafts_histogram": correct_hist,
                            "spec_cap_lens_histogram": cap_hist,
                        })
                if self.incremental:
                    chunk_text, chunk_ids = text[sent_text:], ids[sent_ids:]
                else:
                    chunk_text, chunk_ids = text, list(ids)
                sent_text, sent_ids = len(text), len(ids)
                if finish is not None:  # generation is over: the slot is free before the last chunk goes out
                    self.active.discard(rid)
                yield self._chunk(rid, chunk_text, chunk_ids, prompt, len(ids), finish, extra)
                n_chunks += 1
                if finish is not None:
                    yield b"data: [DONE]\n\n"
                    return
        except (asyncio.CancelledError, GeneratorExit):
            self.disconnects.append(rid)
            raise
        finally:
            self.active.discard(rid)

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/generate", self.generate, methods=["POST", "PUT"]),
            Route("/abort_request", self.abort_request, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/health_generate", self.health, methods=["GET"]),
            Route("/v1/loads", self.loads, methods=["GET"]),
            Route("/server_info", self.server_info, methods=["GET"]),
            Route("/model_info", self.model_info, methods=["GET"]),
        ])


class StandinServer:
    """Serves an :class:`SGLangStandin` with uvicorn on 127.0.0.1 (``port``; 0 = ephemeral) in
    a daemon thread. ``url`` is valid after :meth:`start`. A stopped server cannot start again:
    serve the same stand-in on the same port with a new ``StandinServer(standin, port)``."""

    def __init__(self, standin: SGLangStandin | None = None, port: int = 0) -> None:
        self.standin = standin or SGLangStandin()
        config = uvicorn.Config(self.standin.app(), host="127.0.0.1", port=port, log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self.url = ""

    def start(self) -> "StandinServer":
        self._thread = threading.Thread(target=self._server.run, name="sglang-standin", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("stand-in server did not start")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(5)


def closed_port_url() -> str:
    """A loopback URL where nothing listens (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"
