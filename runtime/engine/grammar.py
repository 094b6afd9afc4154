"""Constrained decoding: JSON grammars compiled once per schema, matched once per request.

Two parts, one concept (the grammar of a request's :class:`runtime.interface.ResponseFormat`:
JSON, or tool calls whose grammar :mod:`runtime.engine.tool_grammar` builds):

* :class:`GrammarCache` compiles a response format into an xgrammar ``CompiledGrammar``
  (the grammar engine SGLang and vLLM use: a pushdown automaton over the tokenizer's
  vocabulary with precomputed per-state token masks; Dong et al. 2024, "XGrammar",
  arXiv:2411.15100). Before compiling it checks the schema against the keywords xgrammar
  enforces (:func:`check_schema`: anything else would be silently ignored, so it is a
  :class:`~runtime.interface.GrammarError` naming the keyword). Compiled grammars are cached
  by the SHA-256 of the canonical schema (failures too), in an LRU bounded in bytes.
  :meth:`GrammarCache.compile_async` runs the compile on a small thread pool (xgrammar
  releases the GIL), never on the engine thread, with a size limit and a time limit; a
  tenant compiles one schema at a time, and a compile that outlives its time limit keeps
  that tenant's turn until it ends, so one tenant's slow schemas hold at most one worker
  and never stall decoding or other tenants.
* :class:`RequestGrammar` is a request's matcher (``xgrammar.GrammarMatcher``): the engine
  asks it for token bitmasks (``int32 [rows, ceil(V/32)]``, bit v of a row set iff token v
  is allowed) and advances it over every emitted token.

How the engine uses the masks (:mod:`runtime.engine.llm_engine`): a masked row's disallowed
logits are set to −inf (:func:`mask_logits`) **before** temperature, top-k and top-p, so
every mode samples from the constrained distribution ``p(v) ∝ p_t(v)·[v allowed]``. Under
speculation the drafts are drawn unmasked and verified normally against the masked target
(Leviathan et al. 2023, §2.3): verification row k of a request gets the mask of the prefix
``x_<k`` (:meth:`RequestGrammar.fill_verification` advances the matcher over the drafts
and rolls it back), a forbidden draft has p_t = 0 and is rejected with probability 1, and
the residual ``norm(max(0, p_t − p_d))`` is drawn from the masked p_t. So the output is
distributed exactly as constrained plain decoding (identical text at temperature 0). A
draft is never cut at its first invalid token with the token then drawn from the masked
distribution: that would bias sampling at T > 0.

Logprobs stay the raw target's (before the mask), as for temperature and top-p.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from typing import Any, Sequence

import torch

from runtime.engine.tool_grammar import parameters, structural_tag
from runtime.interface import GrammarError, ResponseFormat

#: Largest schema accepted, in bytes of its compact JSON.
MAX_SCHEMA_BYTES = 64 * 1024
#: Largest compiled grammar accepted (xgrammar's ``memory_size_bytes``: its rules and
#: precomputed token masks); typical schemas compile to 0.1–3 MB.
MAX_GRAMMAR_BYTES = 32 * 1024 * 1024
#: Wall-clock limit of one compile (seconds; a 20-field schema compiles in ~10 ms, one
#: with 200 regex patterns in ~26 s on a 2-core CPU).
COMPILE_TIMEOUT_S = 5.0
#: Byte budget of the compiled-grammar cache (LRU).
CACHE_BYTES = 256 * 1024 * 1024
#: Compile threads (a tenant uses at most one at a time).
COMPILE_WORKERS = 2

# Keywords that only annotate (no effect on which instances are valid).
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "$schema", "$id", "deprecated", "readOnly",
    "writeOnly", "discriminator",  # OpenAPI's, emitted by pydantic beside oneOf; the branches enforce it
})
# Keywords xgrammar 0.2.9 enforces (checked one by one: a violating instance is refused).
ASSERTIONS = frozenset({
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
    "properties", "required", "additionalProperties", "patternProperties", "propertyNames", "minProperties",
    "maxProperties", "unevaluatedProperties",
    "items", "prefixItems", "minItems", "maxItems", "contains",
    "additionalItems",  # draft-07 tuples (read as 2020-12 by to_prefix_items)
    "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
})
#: String ``format`` values xgrammar enforces; any other is refused (it would be ignored).
FORMATS = frozenset({
    "email", "date", "date-time", "time", "duration", "uri", "uri-reference", "uri-template", "uuid", "ipv4",
    "ipv6", "hostname", "json-pointer", "relative-json-pointer",
})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name → subschema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # [subschema]
_SCHEMA_ONE = ("items", "additionalProperties", "unevaluatedProperties", "propertyNames", "contains",
               "additionalItems")


def _path(parts: Sequence[str]) -> str | None:
    return ".".join(parts) or None


def check_schema(schema: Any, where: tuple[str, ...] = ()) -> None:
    """Refuse what xgrammar would not enforce, so a schema is either served exactly or refused.

    Walks every subschema (``properties``, ``$defs``, ``items``, ``anyOf``, …). A keyword
    outside :data:`ANNOTATIONS` ∪ :data:`ASSERTIONS` (``not``, ``uniqueItems``,
    ``if``/``then``/``else``, ``dependentRequired``, ``minContains``, …), a ``format``
    outside :data:`FORMATS`, an ``allOf`` of more than one schema, or a constraint beside a
    ``$ref`` (its siblings are ignored) raises. ``oneOf`` is enforced as ``anyOf``: exclusive
    when its branches are disjoint (pydantic's discriminated unions), not otherwise. Draft-07
    tuples (an array-valued ``items``, ``additionalItems``) are accepted and compiled as
    2020-12's ``prefixItems``/``items`` (:func:`to_prefix_items`).

    Args:
        schema: a JSON Schema (dict or bool) as parsed from JSON.
        where: the path to ``schema`` (for the error).

    Raises:
        GrammarError: ``code="unsupported_schema_keyword"`` with ``param`` = the dotted path
            ending in the keyword, or ``"invalid_schema"`` for a schema that is not an
            object or boolean.
    """
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GrammarError(f"A JSON schema must be an object or a boolean, got {type(schema).__name__} at "
                           f"'{_path(where) or '(root)'}'.", _path(where), "invalid_schema")
    for key, value in schema.items():
        at = (*where, key)
        if key not in ANNOTATIONS and key not in ASSERTIONS:
            raise GrammarError(f"The JSON-schema keyword '{key}' (at '{_path(at)}') is not supported by "
                               "structured outputs on this server.", _path(at), "unsupported_schema_keyword")
        if key == "format" and value not in FORMATS:
            raise GrammarError(f"The 'format' {json.dumps(value)} (at '{_path(at)}') is not supported; "
                               f"supported formats: {', '.join(sorted(FORMATS))}.", _path(at),
                               "unsupported_schema_keyword")
        if key == "allOf" and isinstance(value, list) and len(value) != 1:
            raise GrammarError(f"'allOf' with {len(value)} schemas (at '{_path(at)}') is not supported; "
                               "only a single schema.", _path(at), "unsupported_schema_keyword")
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                check_schema(sub, (*at, str(name)))
        elif (key in _SCHEMA_LISTS or key == "items") and isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema(sub, (*at, str(i)))
        elif key in _SCHEMA_ONE:
            check_schema(value, at)
    if isinstance(schema.get("items"), list) and "prefixItems" in schema:
        at = (*where, "items")
        raise GrammarError(f"An array-valued 'items' (draft-07's tuple, at '{_path(at)}') beside 'prefixItems' is "
                           "ambiguous; use one of them.", _path(at), "invalid_schema")
    if "$ref" in schema:
        extra = sorted(k for k in schema if k not in ANNOTATIONS and k not in ("$ref", "$defs", "definitions"))
        if extra:
            at = (*where, extra[0])
            raise GrammarError(f"The keyword '{extra[0]}' beside '$ref' (at '{_path(at)}') is not supported; "
                               "wrap the reference in 'allOf' or move the constraint into the referenced schema.",
                               _path(at), "unsupported_schema_keyword")


def to_prefix_items(schema: Any) -> Any:
    """``schema`` (checked by :func:`check_schema`) with its draft-07 tuples written as 2020-12's.

    Draft-07 (JSON Schema Validation, draft-handrews-json-schema-validation-01, §6.4.1–6.4.2)
    writes a tuple as an array-valued ``items`` (item i an instance of ``items[i]``) and
    constrains the items after them with ``additionalItems`` (any when absent; ignored when
    ``items`` is one schema). 2020-12 (JSON Schema Core, §10.3.1.1–10.3.1.2) writes the same
    as ``prefixItems`` and ``items``. The Vercel AI SDK sends zod schemas as draft-07
    (``z.tuple`` → ``{"items": [...], "additionalItems": false}``) and xgrammar 0.2.9 reads
    only 2020-12 (an array ``items`` fails its compile), so every subschema is rewritten:
    ``{"items": [A, B], "additionalItems": S}`` → ``{"prefixItems": [A, B], "items": S}``
    (``items`` left out without ``additionalItems``); a lone ``additionalItems`` is dropped.
    Returns a new schema (the argument is not changed); booleans as they are.
    """
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: to_prefix_items(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [to_prefix_items(sub) for sub in value]
        elif key in _SCHEMA_ONE:
            out[key] = [to_prefix_items(sub) for sub in value] if isinstance(value, list) else to_prefix_items(value)
        else:
            out[key] = value
    extra = out.pop("additionalItems", None)
    if isinstance(out.get("items"), list):
        out["prefixItems"] = out.pop("items")
        if extra is not None:
            out["items"] = extra
    return out


def check_format(fmt: ResponseFormat, max_schema_bytes: int = MAX_SCHEMA_BYTES) -> None:
    """The cheap checks of a response format, before anything is compiled (type, size,
    keywords): a format that passes is served exactly (or refused by the compiler itself).
    Used by :class:`GrammarCache` and by the SGLang backend before it sends one.

    Raises:
        GrammarError: as :func:`check_schema` (for tool calls with ``tool`` = the index of
            the tool whose parameters fail it); ``schema_too_large`` over
            ``max_schema_bytes`` (for tool calls: all tools' parameters together);
            ``invalid_schema`` for an unknown type, or a tool-calls format without tools or
            with an unknown ``tool_choice``, or with a reply format other than JSON or beside a
            choice other than ``auto`` (``in_reply``; as are the reply schema's own faults).
    """
    if fmt.type not in ("json_object", "json_schema", "tool_calls"):
        raise GrammarError(f"Unknown response format type {fmt.type!r}.", None, "invalid_schema")
    size = len(canonical(fmt).encode("utf-8", "surrogatepass"))
    if size > max_schema_bytes:
        what = "The tools' parameter schemas are" if fmt.type == "tool_calls" else "The schema is"
        raise GrammarError(f"{what} {size} bytes; the limit is {max_schema_bytes}.", None, "schema_too_large")
    if fmt.type == "json_schema":
        check_schema(fmt.schema)
    elif fmt.type == "tool_calls":
        if not fmt.tools or fmt.tool_choice not in ("auto", "required"):
            raise GrammarError(f"A tool-calls format needs tools and tool_choice 'auto' or 'required', got "
                               f"{len(fmt.tools)} tools and {fmt.tool_choice!r}.", None, "invalid_schema")
        for i, tool in enumerate(fmt.tools):
            if tool.parameters is not None:
                try:
                    check_schema(tool.parameters)
                except GrammarError as exc:
                    exc.tool = i
                    raise
        if fmt.reply is not None:
            if fmt.tool_choice != "auto" or fmt.reply.type not in ("json_object", "json_schema"):
                raise GrammarError(f"A tool-calls format takes a '{fmt.reply.type}' reply format only with "
                                   "tool_choice 'auto' and a JSON reply.", None, "invalid_schema", in_reply=True)
            if fmt.reply.type == "json_schema":
                try:
                    check_schema(fmt.reply.schema)
                except GrammarError as exc:
                    exc.in_reply = True
                    raise


def canonical(fmt: ResponseFormat) -> str:
    """The format's identity: compact JSON with sorted keys, prefixed by type and strictness
    (for tool calls: the tools' names and parameters in order, the choice and parallelism, and
    the reply format's identity when there is one)."""
    spec = fmt.schema
    if fmt.type == "tool_calls":
        spec = [[[t.name, t.parameters] for t in fmt.tools], fmt.tool_choice, bool(fmt.parallel_tool_calls)]
        if fmt.reply is not None:
            spec.append(canonical(fmt.reply))
    body = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return f"{fmt.type}\x1f{bool(fmt.strict)}\x1f{body}"


def schema_hash(fmt: ResponseFormat) -> str:
    """SHA-256 hex of :func:`canonical`: the cache key."""
    return hashlib.sha256(canonical(fmt).encode("utf-8", "surrogatepass")).hexdigest()


_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: .*? is false: )?")


def _json_args(fmt: ResponseFormat) -> tuple[str, bool]:
    """``(schema JSON, strict_mode)`` for xgrammar of a ``json_object`` / ``json_schema``
    format: ``json_object`` (or no schema) is any JSON object with any properties; a schema is
    generated strictly (no undeclared properties)."""
    if fmt.type == "json_object" or fmt.schema is None:
        return '{"type": "object"}', False
    return json.dumps(to_prefix_items(fmt.schema), ensure_ascii=False), True


def _xgrammar_message(exc: Exception) -> str:
    """xgrammar's error text without its ``[time] /file.cc:line:`` prefix."""
    return _XGR_PREFIX.sub("", str(exc).strip()).strip() or type(exc).__name__


class GrammarCache:
    """Compiles response formats for one tokenizer and caches the results (module docstring).

    Thread-safe: :meth:`compile` may run on any thread. Nothing is imported or built until
    the first compile (xgrammar's import takes ~2 s, its tokenizer table ~0.1 s).

    Args:
        tokenizer: the HF tokenizer of the served model.
        vocab_size: V, the width of the model's logits (≥ the tokenizer's).
        stop_token_ids: the tokens that end a reply (EOS): allowed once the JSON is complete.
        max_schema_bytes, max_grammar_bytes, compile_timeout_s, cache_bytes, workers: limits
            (defaults: the module constants).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int], *,
                 max_schema_bytes: int = MAX_SCHEMA_BYTES, max_grammar_bytes: int = MAX_GRAMMAR_BYTES,
                 compile_timeout_s: float = COMPILE_TIMEOUT_S, cache_bytes: int = CACHE_BYTES,
                 workers: int = COMPILE_WORKERS) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.max_schema_bytes = max_schema_bytes
        self.max_grammar_bytes = max_grammar_bytes
        self.compile_timeout_s = compile_timeout_s
        self.cache_bytes = cache_bytes
        self.workers = workers
        self._lock = threading.Lock()
        self._compiler = None
        self._cache: OrderedDict[str, Any] = OrderedDict()  # key → CompiledGrammar | GrammarError (LRU)
        self._cached_bytes = 0
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._inflight: dict[str, asyncio.Future] = {}
        self._tenant_turns: dict[str | None, asyncio.Lock] = {}
        self.compiles = 0  # grammars actually compiled (cache misses)

    # -- compiling ----------------------------------------------------------------
    def compiler(self):
        """The xgrammar ``GrammarCompiler`` (built on first use)."""
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                # one thread per compile; its own cache off (this class caches, bounded in bytes)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _lookup(self, key: str):
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def _store(self, key: str, value) -> None:
        size = value.memory_size_bytes if not isinstance(value, GrammarError) else 256
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = value
            self._cached_bytes += size
            while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= old.memory_size_bytes if not isinstance(old, GrammarError) else 256

    def precheck(self, fmt: ResponseFormat) -> str:
        """The cheap checks (:func:`check_format`, within ``max_schema_bytes``) in the caller's
        thread; returns the cache key.

        Raises:
            GrammarError: as :func:`check_format`.
        """
        check_format(fmt, self.max_schema_bytes)
        return schema_hash(fmt)

    def _build(self, key: str, fmt: ResponseFormat, limit_s: float | None = None):
        """Compile (cache miss): the CompiledGrammar, or the GrammarError it earned (both cached);
        one that took longer than ``limit_s`` earns the time-out error."""
        t0 = time.perf_counter()
        try:
            comp = self.compiler()
            if fmt.type == "tool_calls":
                out = self._compile_tools(comp, fmt)
            else:
                schema, strict = _json_args(fmt)
                out = comp.compile_json_schema(schema, any_whitespace=False, strict_mode=strict)
        except GrammarError as exc:
            out = exc
        except Exception as exc:  # noqa: BLE001 — xgrammar raises RuntimeError/ValueError on bad schemas
            out = GrammarError(f"Invalid JSON schema: {_xgrammar_message(exc)}", None, "invalid_schema")
        self.compiles += 1
        seconds = time.perf_counter() - t0
        if not isinstance(out, GrammarError):
            if limit_s is not None and seconds > limit_s:  # finished late: the answer it got when it timed out
                out = self._timeout_error()
            elif out.memory_size_bytes > self.max_grammar_bytes:
                out = GrammarError(f"The schema compiles to a {out.memory_size_bytes / 2**20:.0f} MiB grammar; "
                                   f"the limit is {self.max_grammar_bytes / 2**20:.0f} MiB.", None,
                                   "schema_too_large")
        self._store(key, out)
        return out

    @staticmethod
    def _compile_tools(comp, fmt: ResponseFormat):
        """The structural tag of :mod:`runtime.engine.tool_grammar`, each tool's arguments
        (and the reply format, if any) under the same JSON grammar as a ``json_schema`` format
        (compact, strict). A schema xgrammar refuses is a GrammarError naming its tool (or
        ``in_reply``)."""
        import xgrammar as xgr

        grammars = []
        for i, tool in enumerate(fmt.tools):
            try:
                schema = json.dumps(to_prefix_items(parameters(tool)), ensure_ascii=False)
                grammars.append(str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)))
            except Exception as exc:  # noqa: BLE001 — as in _build
                raise GrammarError(f"Invalid JSON schema in the parameters of tool '{tool.name}': "
                                   f"{_xgrammar_message(exc)}", None, "invalid_schema", tool=i) from None
        reply = None
        if fmt.reply is not None:
            try:
                schema, strict = _json_args(fmt.reply)
                reply = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict))
            except Exception as exc:  # noqa: BLE001 — as in _build
                raise GrammarError(f"Invalid JSON schema: {_xgrammar_message(exc)}", None, "invalid_schema",
                                   in_reply=True) from None
        return comp.compile_structural_tag(json.dumps(structural_tag(fmt, grammars, reply), ensure_ascii=False))

    def _timeout_error(self) -> GrammarError:
        return GrammarError(f"The schema took longer than {self.compile_timeout_s:g} s to compile; simplify it "
                            "(fewer regular-expression patterns and long bounded repetitions).", None,
                            "schema_compile_timeout")

    def compile(self, fmt: ResponseFormat):
        """The compiled grammar of ``fmt``, in this thread (cached; no time limit).

        Returns:
            an ``xgrammar.CompiledGrammar``.

        Raises:
            GrammarError: see :meth:`precheck`; ``invalid_schema`` when xgrammar refuses it;
                ``schema_too_large`` over ``max_grammar_bytes``.
        """
        key = self.precheck(fmt)
        out = self._lookup(key)
        if out is None:
            out = self._build(key, fmt)
        if isinstance(out, GrammarError):
            raise out
        return out

    async def compile_async(self, fmt: ResponseFormat, tenant: str | None = None):
        """:meth:`compile` off the caller's thread, within ``compile_timeout_s``.

        A cache hit returns at once. A miss runs on the compile pool; concurrent requests
        for the same schema share one compile; a tenant waits for its previous compile to
        end (even one that timed out) before its next starts, inside the same time limit.

        Raises:
            GrammarError: as :meth:`compile`, or ``schema_compile_timeout``.
        """
        key = self.precheck(fmt)
        out = self._lookup(key)
        if out is None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.compile_timeout_s
            fut = self._inflight.get(key)
            if fut is None:
                turn = self._tenant_turns.setdefault(tenant, asyncio.Lock())
                try:
                    await asyncio.wait_for(turn.acquire(), self.compile_timeout_s)
                except TimeoutError:
                    raise self._timeout_error() from None
                out = self._lookup(key)  # compiled while this one waited for its turn
                if out is not None:
                    turn.release()
                else:
                    if self._pool is None:
                        self._pool = concurrent.futures.ThreadPoolExecutor(self.workers, "sparkgate-grammar")
                    fut = self._inflight[key] = loop.run_in_executor(self._pool, self._build, key, fmt,
                                                                     self.compile_timeout_s)

                    def done(_f, key=key, turn=turn) -> None:
                        self._inflight.pop(key, None)
                        turn.release()

                    fut.add_done_callback(done)
            if out is None:
                try:
                    out = await asyncio.wait_for(asyncio.shield(fut), max(deadline - loop.time(), 0.0))
                except TimeoutError:
                    raise self._timeout_error() from None
        if isinstance(out, GrammarError):
            raise out
        return out

    def close(self) -> None:
        """Stop the compile pool (running compiles finish in the background)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One request's grammar state: an ``xgrammar.GrammarMatcher`` over its emitted tokens.

    Once the matcher accepted a stop token (the JSON is complete and EOS was emitted) it is
    *terminated*: it masks nothing and ignores further tokens (only ``ignore_eos`` requests
    generate past EOS).
    """

    def __init__(self, compiled) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the mask of the next token into ``bitmask[row]``; ``False`` (row untouched:
        all allowed) once terminated."""
        if self.matcher.is_terminated():
            return False
        self.matcher.fill_next_token_bitmask(bitmask, row)
        return True

    def fill_verification(self, drafts: Sequence[int], bitmask: torch.Tensor, row0: int) -> None:
        """Masks of verification rows ``row0 + k`` (k = 0..ℓ): row k is the mask after the
        prefix ``x_<k+1`` of ``drafts``, i.e. the one that judges draft ``x_{k+1}`` (k < ℓ)
        or the bonus token (k = ℓ). The matcher advances over the drafts and is rolled back
        to where it was. At the first draft the grammar forbids, the rows after its own are
        left all-allowed: that draft is rejected with probability 1 (its p_t is 0), so
        verification never reads them. After a drafted stop token likewise (the reply ends)."""
        m = self.matcher
        if not self.fill(bitmask, row0):
            return
        advanced = 0
        for k, tok in enumerate(drafts):
            if not m.accept_token(int(tok)):
                break
            advanced += 1
            if m.is_terminated():
                break
            m.fill_next_token_bitmask(bitmask, row0 + k + 1)
        if advanced:
            m.rollback(advanced)

    def advance(self, tokens: Sequence[int]) -> bool:
        """Accept the emitted ``tokens`` in order; ``False`` if the grammar refuses one (a bug:
        every emitted token was sampled under its mask)."""
        for tok in tokens:
            if self.matcher.is_terminated():
                return True
            if not self.matcher.accept_token(int(tok)):
                return False
        return True

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """``int32 [rows, ceil(V/32)]``, every token allowed (all bits set)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """A fp32 copy of ``logits`` ``[N, V]`` with the tokens ``bitmask`` forbids set to −inf in
    ``rows`` (the other rows unchanged). ``bitmask``: ``int32 [N, ceil(V/32)]``."""
    import xgrammar as xgr

    out = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
    if rows:
        xgr.apply_token_bitmask_inplace(out, bitmask, vocab_size=out.shape[-1], indices=list(rows))
    return out
