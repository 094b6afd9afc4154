"""Translate a validated OpenAI request into a runtime :class:`GenerationRequest`.

Everything here is pure (no I/O) and raises :class:`gateway.core.errors.APIError`
(400/404) for requests the gateway must refuse before touching the engine.
"""

from __future__ import annotations

import json

from typing import Iterable

from gateway.core.errors import invalid_request, model_not_found, unsupported
from gateway.openai import tools
from gateway.openai.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, BaseCompletionRequest
from gateway.observability.observe import RequestContext
from runtime.interface import BackendInfo, GenerationRequest, ResponseFormat, SamplingParams, clamp_max_tokens

# OpenAI role → role given to the chat template. "developer" is OpenAI's newer name for "system".
TEMPLATE_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
UNSUPPORTED_ROLES = {"function"}


def _short_name(name: str) -> str:
    return name.rsplit("/", 1)[-1].lower()


def resolve_model(requested: str, info: BackendInfo, aliases: Iterable[str] = ()) -> str:
    """Return the served model name (``info.model_name``) if ``requested`` names it.

    Accepted: the exact name, any alias, and any of these without or with a
    different ``org/`` prefix (case-insensitive), e.g. ``SmolLM2-135M-Instruct`` for
    ``HuggingFaceTB/SmolLM2-135M-Instruct``. Raises 404 ``model_not_found`` otherwise.
    """
    names = {_short_name(info.model_name), *(_short_name(a) for a in aliases)}
    if requested == info.model_name or _short_name(requested) in names:
        return info.model_name
    raise model_not_found(requested)


def reject_unsupported_chat(body: ChatCompletionRequest) -> None:
    """400 naming the first OpenAI parameter we do not implement (never silently ignored).

    Neutral values are accepted: ``functions: []``, ``function_call: "none"``,
    ``modalities: ["text"]``; ``audio``, ``prediction`` and ``web_search_options`` (output
    features this server lacks) only when absent or null. (``response_format``:
    :func:`response_format`; ``tools``: :mod:`gateway.openai.tools`; the sampling fields:
    :func:`check_sampling`.) ``top_logprobs`` without ``logprobs: true`` is a 400 (as OpenAI
    answers it).
    """
    if body.functions not in (None, []):
        raise unsupported("functions", "The deprecated 'functions' are not supported; use 'tools'.")
    if body.function_call not in (None, "none"):
        raise unsupported("function_call", "The deprecated 'function_call' is not supported; use 'tool_choice'.")
    vllm_format(body)  # vLLM's structured-output fields: only the JSON ones
    if body.modalities not in (None, ["text"]):
        raise unsupported("modalities", "Only text output is supported: 'modalities' may only be [\"text\"].")
    for name in ("audio", "prediction", "web_search_options"):  # would change the output: refused, not ignored
        if getattr(body, name) is not None:
            raise unsupported(name)
    if body.top_logprobs is not None and body.logprobs is not True:
        raise invalid_request("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs", "invalid_value")


def reject_unsupported_completion(body: CompletionRequest) -> None:
    """Like :func:`reject_unsupported_chat` for ``/v1/completions`` (``echo``, ``suffix``
    and ``best_of`` > 1 are refused)."""
    if body.echo not in (None, False):
        raise unsupported("echo")
    if body.suffix not in (None, ""):
        raise unsupported("suffix")
    if body.best_of not in (None, 1):
        raise unsupported("best_of", "Only best_of=1 is supported.")


def logit_bias_pairs(body: BaseCompletionRequest, vocab_size: int | None = None) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as ``(token id, bias)`` pairs (keys are decimal token ids, as OpenAI's).

    400 ``invalid_value`` (``param: logit_bias``) for a key that is not a decimal integer or
    not below ``vocab_size`` (when known). Bias ranges ([−100, 100]) are the schema's."""
    out = []
    for key, bias in (body.logit_bias or {}).items():
        tid = int(key) if key.isascii() and key.isdecimal() else None
        if tid is None or (vocab_size is not None and tid >= vocab_size):
            limit = f" below the vocabulary size {vocab_size}" if vocab_size is not None else ""
            raise invalid_request(f"Invalid key {key!r} in 'logit_bias': keys must be token ids{limit}.",
                                  "logit_bias", "invalid_value")
        out.append((tid, float(bias)))
    return tuple(out)


def check_sampling(body: BaseCompletionRequest, info: BackendInfo) -> None:
    """400s the schema's ranges cannot express: ``logit_bias`` keys (:func:`logit_bias_pairs`),
    ``stop_token_ids`` at or above the vocabulary size, and ``min_tokens`` above the
    requested ``max_tokens`` (vLLM's rule). Call before admission (no record, no tokens)."""
    logit_bias_pairs(body, info.vocab_size)
    if info.vocab_size is not None:
        for i, tid in enumerate(body.stop_token_ids or ()):
            if tid >= info.vocab_size:
                raise invalid_request(f"stop_token_ids[{i}] = {tid} is not below the vocabulary size "
                                      f"{info.vocab_size}.", f"stop_token_ids[{i}]", "invalid_value")
    requested = requested_max_tokens(body)
    if body.min_tokens and requested is not None and body.min_tokens > requested:
        raise invalid_request(f"min_tokens ({body.min_tokens}) must not exceed max_tokens ({requested}).",
                              "min_tokens", "invalid_value")


#: vLLM's structured-output constraints (``structured_outputs`` keys) this server does not serve.
VLLM_UNSERVED = ("regex", "choice", "grammar", "structural_tag")


def vllm_format(body: ChatCompletionRequest) -> ResponseFormat | None:
    """vLLM's structured outputs as a :class:`ResponseFormat` (vLLM ``StructuredOutputsParams``,
    ``vllm/sampling_params.py``; older releases' ``guided_json``): ``structured_outputs.json``
    (a schema, or its JSON text) or ``guided_json`` → ``json_schema``;
    ``structured_outputs.json_object: true`` → ``json_object``; ``None`` when none is set.

    Raises:
        APIError: 400 ``unsupported_parameter`` naming a constraint that is not served
            (``structured_outputs.regex`` / ``.choice`` / ``.grammar`` / ``.structural_tag``,
            ``guided_regex`` / ``guided_choice`` / ``guided_grammar``); 400 ``invalid_value``
            for JSON text that does not parse or two constraints at once (with each other or
            with ``response_format``).
    """
    so = body.structured_outputs or {}
    for key in VLLM_UNSERVED:
        if so.get(key) is not None:
            raise unsupported(f"structured_outputs.{key}", "Only JSON constraints are served: use "
                              "'structured_outputs.json' or 'response_format'.")
    for name in ("guided_regex", "guided_choice", "guided_grammar"):
        if getattr(body, name) is not None:
            raise unsupported(name, "Only JSON constraints are served: use 'guided_json' or 'response_format'.")
    found = []
    for param, value in (("structured_outputs.json", so.get("json")), ("guided_json", body.guided_json)):
        if value is None:
            continue
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise invalid_request(f"'{param}' is not valid JSON.", param, "invalid_value") from None
        found.append((param, ResponseFormat("json_schema", value, True)))
    if so.get("json_object"):
        found.append(("structured_outputs.json_object", ResponseFormat("json_object")))
    rf = body.response_format
    if found and (len(found) > 1 or (rf is not None and rf.type != "text")):
        raise invalid_request("Give one output constraint: 'response_format', 'structured_outputs' or 'guided_json'.",
                              found[-1][0], "invalid_value")
    return found[0][1] if found else None


def vllm_format_field(body: BaseCompletionRequest) -> str | None:
    """Which vLLM field carries the request's JSON constraint (``structured_outputs.json``,
    ``structured_outputs.json_object`` or ``guided_json``; where a refusal of its schema points),
    ``None`` when none does."""
    so = getattr(body, "structured_outputs", None) or {}
    if so.get("json") is not None:
        return "structured_outputs.json"
    if getattr(body, "guided_json", None) is not None:
        return "guided_json"
    return "structured_outputs.json_object" if so.get("json_object") else None


def response_format(body: BaseCompletionRequest, info: BackendInfo) -> ResponseFormat | None:
    """The runtime :class:`ResponseFormat` of a chat request (``None``: free text).

    ``json_object`` → any JSON object; ``json_schema`` → an instance of its ``schema`` (any
    JSON object when it has none), ``strict`` passed along; vLLM's JSON constraints the same
    (:func:`vllm_format`). The schema's keywords are checked by the backend (400 naming an
    unsupported one, at submission).
    400 ``unsupported_parameter`` when the backend cannot constrain its output.
    """
    vllm = vllm_format(body) if isinstance(body, ChatCompletionRequest) else None
    if vllm is not None:
        if not info.supports_response_format:
            raise unsupported("structured_outputs", "This backend does not support JSON output constraints.")
        return vllm
    rf = getattr(body, "response_format", None)
    if rf is None or rf.type == "text":
        return None
    if not info.supports_response_format:
        raise unsupported("response_format", "This backend does not support JSON response formats.")
    if rf.type == "json_object":
        return ResponseFormat("json_object")
    spec = rf.json_schema
    if spec.schema_ is None:
        return ResponseFormat("json_object")
    return ResponseFormat("json_schema", spec.schema_, bool(spec.strict))


#: What a request's output can be constrained to (``RequestContext.constraint``, the request
#: record's ``constraint`` and the ``constraint`` label of the metrics).
CONSTRAINTS = ("json_object", "json_schema", "tools")


def constraint_kind(body: BaseCompletionRequest) -> str | None:
    """What the chat request asks its output to be, as the request was written (also for one
    about to be refused): ``"tools"`` when it has tools and ``tool_choice`` is not ``"none"``
    (:func:`gateway.openai.tools.tool_plan`'s rule), else ``"json_object"`` or
    ``"json_schema"`` for a JSON ``response_format`` (a ``json_schema`` without ``schema`` stays
    ``"json_schema"``, though it is served as JSON mode), else ``None`` (free text; legacy
    completions always)."""
    if getattr(body, "tools", None) and getattr(body, "tool_choice", None) != "none":
        return "tools"
    vllm = vllm_format_field(body)
    if vllm is not None:
        return "json_object" if vllm.endswith("json_object") else "json_schema"
    rf = getattr(body, "response_format", None)
    return rf.type if rf is not None and rf.type in CONSTRAINTS else None


def requested_logprobs(body: BaseCompletionRequest, info: BackendInfo) -> int | None:
    """Top alternatives per token the request asks for, ``None`` for no logprobs.

    Chat: ``logprobs: true`` → ``top_logprobs`` (default 0); legacy completions: the
    integer ``logprobs``. Ranges are checked by the schema (chat 0..20, legacy 0..5).
    400 ``unsupported_parameter`` when the backend cannot return them.
    """
    if isinstance(body, ChatCompletionRequest):
        n = (body.top_logprobs or 0) if body.logprobs else None
    else:
        n = getattr(body, "logprobs", None)
    if n is not None and not info.supports_logprobs:
        raise unsupported("logprobs", "This backend does not return logprobs.")
    return n


def _message_text(msg: ChatMessage, i: int) -> str:
    if msg.content is None:
        if msg.role == "assistant" and not msg.function_call:
            return ""
        raise invalid_request(f"messages[{i}].content is required for role '{msg.role}'.",
                              f"messages[{i}].content", "missing_required_parameter")
    if isinstance(msg.content, str):
        return msg.content
    texts = []
    for j, part in enumerate(msg.content):
        if part.type != "text" or part.text is None:
            raise unsupported(f"messages[{i}].content[{j}]", f"Only text content parts are supported, got '{part.type}'.")
        texts.append(part.text)
    return "".join(texts)


def template_messages(messages: list[ChatMessage], names: dict[str, str] | None = None) -> list[dict]:
    """The conversation in Hugging Face's shape: ``[{"role", "content": str}]``, assistant
    messages with calls as :func:`gateway.openai.tools.assistant_message`, tool results as
    :func:`gateway.openai.tools.tool_message` (:func:`gateway.openai.tools.prompt_messages`
    renders them for the template).

    Text parts are joined; ``developer`` → ``system``; the ``function`` role and an
    assistant's ``function_call`` → 400 unsupported; any other role → 400; tool messages
    must answer an earlier call (:func:`gateway.openai.tools.call_names`; ``names``: its
    result when the caller checked already).
    """
    out = []
    for i, msg in enumerate(messages):
        param = f"messages[{i}].role"
        if msg.role in UNSUPPORTED_ROLES:
            raise unsupported(param, f"Messages with role '{msg.role}' are not supported; use role 'tool'.")
        if msg.role not in TEMPLATE_ROLES:
            raise invalid_request(
                f"Invalid value for 'role': '{msg.role}'. Supported values are: 'system', 'developer', "
                "'user', 'assistant' and 'tool'.", param, "invalid_value")
        if msg.function_call:
            raise unsupported(f"messages[{i}].function_call", "Use 'tool_calls'.")
    names = tools.call_names(messages) if names is None else names
    for i, msg in enumerate(messages):
        text = _message_text(msg, i)
        if msg.role == "tool":
            out.append(tools.tool_message(text, msg.tool_call_id, names[msg.tool_call_id]))
        elif msg.tool_calls:
            out.append(tools.assistant_message(text, msg.tool_calls))
        else:
            out.append({"role": TEMPLATE_ROLES[msg.role], "content": text})
    return out


def completion_prompt(body: CompletionRequest) -> str:
    """The single prompt string of a legacy completion (string or list of one string)."""
    prompt = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    if not prompt:
        raise invalid_request("The prompt must not be empty.", "prompt", "invalid_value")
    return prompt


def completion_budget(prompt_len: int, max_context: int, requested: int | None, param: str) -> int:
    """Completion tokens allowed: ``min(requested, max_context − prompt_len)``; all of the
    remaining context when ``requested`` is None. 400 ``context_length_exceeded``
    (``param`` = where the prompt came from) when the prompt leaves no room, 400
    ``invalid_value`` when it has no token at all (e.g. ``"\x14"``, which the tokenizer drops)."""
    if prompt_len == 0:
        raise invalid_request(f"Your {param} resulted in 0 tokens; it needs at least one.", param, "invalid_value")
    if prompt_len >= max_context:
        raise invalid_request(
            f"This model's maximum context length is {max_context} tokens. However, your {param} "
            f"resulted in {prompt_len} tokens. Please reduce the length of the {param}.",
            param, "context_length_exceeded")
    return clamp_max_tokens(prompt_len, max_context, requested)  # the engine's own clamp


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """OpenAI ``stop`` (string or ≤4 strings) → tuple, empty strings dropped."""
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    return tuple(s for s in items if s)


def requested_max_tokens(body: BaseCompletionRequest) -> int | None:
    """``max_completion_tokens`` (newer alias, wins) or ``max_tokens``."""
    return getattr(body, "max_completion_tokens", None) or body.max_tokens


def prefix_cache_salt(scope: str, tenant: str | None, request_salt: str | None) -> str | None:
    """The runtime ``cache_salt`` (:func:`runtime.engine.prefix_cache.chain_root`).

    ``scope="tenant"`` (the default, ``SPARKGATE_PREFIX_CACHE_SCOPE``): cached prompt KV is
    shared only inside a tenant, so no tenant can tell from its time to first token what
    another tenant sent; ``"global"``: shared by everyone. A request's own ``cache_salt``
    (vLLM extension) narrows the namespace further inside that scope.
    """
    parts = []
    if scope == "tenant" and tenant is not None:
        parts.append(f"tenant:{tenant}")
    if request_salt:
        parts.append(f"request:{request_salt}")
    return "\x1f".join(parts) or None


def generation_request(
    ctx: RequestContext,
    prompt_token_ids: list[int],
    body: BaseCompletionRequest,
    timeout_s: float | None,
    logprobs: int | None = None,
    cache_scope: str = "tenant",
    fmt: ResponseFormat | None = None,
) -> GenerationRequest:
    """The runtime request: OpenAI defaults (temperature 1, top_p 1, no penalties), ``top_k``
    and ``min_p`` 0 = off, ``repetition_penalty`` 1 = off; ``logprobs`` from
    :func:`requested_logprobs`; ``cache_salt`` from :func:`prefix_cache_salt`; ``fmt`` from
    :func:`response_format`; the rest from ``ctx``, once admission resolved its tier.
    ``n`` is not here: each choice is a request of its own (:mod:`gateway.openai.choices`)."""
    sampling = SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        max_tokens=ctx.max_tokens,
        stop=stop_strings(body.stop),
        seed=body.seed,
        ignore_eos=bool(body.ignore_eos),
        logprobs=logprobs,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=logit_bias_pairs(body),
        min_p=body.min_p or 0.0,
        min_tokens=body.min_tokens or 0,
        stop_token_ids=tuple(body.stop_token_ids or ()),
    )
    return GenerationRequest(
        request_id=ctx.request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling=sampling,
        tenant=ctx.tenant,
        user=ctx.user,
        sla_target_tokens_per_s=ctx.sla_target_tokens_per_s,
        priority=ctx.priority,
        timeout_s=timeout_s,
        return_spec_stats=bool(body.return_spec_stats),
        cache_salt=prefix_cache_salt(cache_scope, ctx.tenant, body.cache_salt),
        response_format=fmt,
    )
