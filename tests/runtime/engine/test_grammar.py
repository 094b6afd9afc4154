"""Constrained decoding (runtime/engine/grammar.py and its hooks in the engine): the schema
check, the compile cache and its limits, the verification masks, and losslessness under
speculation — T = 0 text equal to constrained plain decoding in a ragged batch that mixes
grammar and plain requests, and a T = 1 chi-square of the tokens verification emits."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter

import jsonschema
import pytest
import torch
from scipy import stats

from runtime.config import EngineConfig
from runtime.engine.grammar import (
    GrammarCache, RequestGrammar, check_schema, mask_logits, new_bitmask, to_prefix_items,
)
from runtime.engine import llm_engine
from runtime.engine.llm_engine import LLMEngine
from runtime.interface import (
    Failed, Finished, GenerationRequest, GrammarError, ResponseFormat, SamplingParams, TextDelta, ToolSchema,
)
from tests.runtime.speculation.test_engine_distribution import MIN_GROUP, chi2_tokens, continuation_logits
from tests.runtime.speculation.test_spec_engine import chat_ids
from tests.support.json_schemas import SCHEMAS, UNSUPPORTED

V = 49152
EOS = 2


# -- the schema check (no model) ------------------------------------------------------------


@pytest.mark.parametrize("schema,keyword,param", UNSUPPORTED, ids=[k for _, k, _ in UNSUPPORTED])
def test_unsupported_keywords_are_refused_by_name(schema, keyword, param):
    with pytest.raises(GrammarError) as e:
        check_schema(schema)
    assert e.value.code == "unsupported_schema_keyword" and e.value.param == param
    assert f"'{keyword}'" in e.value.message


def test_every_schema_of_the_test_set_passes_the_check():
    assert len(SCHEMAS) >= 50
    for name, _, schema in SCHEMAS:
        check_schema(schema)  # raises on a keyword it would not enforce
    with pytest.raises(GrammarError) as e:
        check_schema({"type": "object", "properties": {"a": 3}})
    assert e.value.code == "invalid_schema" and e.value.param == "properties.a"


INT_SCHEMA = {"type": "integer"}
#: A draft-07 tuple as the Vercel AI SDK sends ``z.tuple([z.string(), z.number()])`` (zod's draft-07 output).
DRAFT7_PAIR = {"type": "array", "items": [{"type": "string"}, {"type": "number"}], "additionalItems": False,
               "minItems": 2, "maxItems": 2}


def test_draft07_tuples_are_read_as_prefix_items():
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
              "properties": {"pair": DRAFT7_PAIR, "open": {"type": "array", "items": [{"type": "integer"}]},
                             "rest": {"type": "array", "items": [{"type": "integer"}], "additionalItems": {"type": "string"}},
                             "list": {"type": "array", "items": {"type": "integer"}, "additionalItems": False}},
              "$defs": {"t": {"anyOf": [{"items": [{"const": 1}]}, {"type": "null"}]}}}
    check_schema(schema)
    before = json.dumps(schema, sort_keys=True)
    out = to_prefix_items(schema)
    assert json.dumps(schema, sort_keys=True) == before  # not changed in place
    props = out["properties"]
    assert props["pair"] == {"type": "array", "prefixItems": [{"type": "string"}, {"type": "number"}], "items": False,
                             "minItems": 2, "maxItems": 2}
    assert props["open"] == {"type": "array", "prefixItems": [{"type": "integer"}]}  # extra items: any, as in draft-07
    assert props["rest"] == {"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"}}
    assert props["list"] == {"type": "array", "items": {"type": "integer"}}  # additionalItems beside one schema: ignored
    assert out["$defs"]["t"]["anyOf"][0] == {"prefixItems": [{"const": 1}]}
    # a keyword inside a tuple member is named by its draft-07 path; both forms at once are refused
    with pytest.raises(GrammarError) as e:
        check_schema({"type": "array", "items": [INT_SCHEMA, {"type": "array", "uniqueItems": True}]})
    assert e.value.code == "unsupported_schema_keyword" and e.value.param == "items.1.uniqueItems"
    with pytest.raises(GrammarError) as e:
        check_schema({"type": "array", "items": [INT_SCHEMA], "prefixItems": [INT_SCHEMA]})
    assert e.value.code == "invalid_schema" and e.value.param == "items"


# -- the compile cache (tokenizer only) -----------------------------------------------------


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return GrammarCache(tokenizer, V, [EOS])


def test_compile_is_cached_by_schema_hash_and_failures_too(grammars):
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    before = grammars.compiles
    g = grammars.compile(ResponseFormat("json_schema", schema))
    same = dict(reversed(list(schema.items())))  # the same schema, keys in another order
    assert grammars.compile(ResponseFormat("json_schema", same)) is g and grammars.compiles == before + 1
    assert grammars.compile(ResponseFormat("json_schema", schema, strict=True)) is not g  # strictness is part of the key
    bad = ResponseFormat("json_schema", {"type": "strin"})
    for _ in range(2):
        with pytest.raises(GrammarError) as e:
            grammars.compile(bad)
        assert e.value.code == "invalid_schema" and "strin" in e.value.message and "/project" not in e.value.message
    assert grammars.compiles == before + 3


def test_a_draft07_tuple_compiles_to_its_exact_instances(grammars, tokenizer):
    """The grammar of a draft-07 tuple (xgrammar itself refuses an array ``items``) accepts a
    [string, number] pair and refuses the other order, a third item and a lone item; as a
    tool's parameters too."""
    schema = {"type": "object", "properties": {"p": DRAFT7_PAIR}, "required": ["p"]}
    as_json = grammars.compile(ResponseFormat("json_schema", schema))
    as_tool = grammars.compile(ResponseFormat("tool_calls", tools=(ToolSchema("f", schema),), tool_choice="required"))

    def accepts(compiled, text: str) -> bool:
        g = RequestGrammar(compiled)
        return g.advance(tokenizer.encode(text, add_special_tokens=False) + [EOS]) and g.terminated

    assert accepts(as_json, '{"p": ["Paris", 2.35]}')
    assert not accepts(as_json, '{"p": [2.35, "Paris"]}') and not accepts(as_json, '{"p": ["Paris", 2.35, 1]}')
    assert not accepts(as_json, '{"p": ["Paris"]}')
    call = '<tool_call>\n{"name": "f", "arguments": %s}\n</tool_call>'
    assert accepts(as_tool, call % '{"p": ["Paris", 2.35]}') and not accepts(as_tool, call % '{"p": [2.35, "Paris"]}')


def test_size_limits(tokenizer):
    small = GrammarCache(tokenizer, V, [EOS], max_schema_bytes=200, max_grammar_bytes=10_000)
    big = {"type": "object", "properties": {f"field{i}": {"type": "integer"} for i in range(20)}}
    with pytest.raises(GrammarError) as e:
        small.compile(ResponseFormat("json_schema", big))
    assert e.value.code == "schema_too_large" and "200" in e.value.message
    with pytest.raises(GrammarError) as e:  # 60 bytes of schema, ~200 kB of grammar
        small.compile(ResponseFormat("json_schema", {"type": "object", "properties": {"a": {"type": "string"}}}))
    assert e.value.code == "schema_too_large" and "MiB grammar" in e.value.message


def slow_schema(n: int) -> dict:
    """Regex patterns compile slowly (~7 ms each on the 2-core box)."""
    return {"type": "object", "properties": {f"f{i}": {"type": "string", "pattern": "[a-z]{1,8}@x\\.com"}
                                             for i in range(n)}}


async def test_compile_time_limit_holds_the_tenant_not_the_others(tokenizer):
    """A compile over the time limit is a 400 at the limit; it keeps running and holds its
    tenant's turn (that tenant's next new schema times out waiting), not the other tenants';
    once it ends it is remembered as too slow."""
    cache = GrammarCache(tokenizer, V, [EOS], compile_timeout_s=0.3)
    slow = ResponseFormat("json_schema", slow_schema(150))  # ~1 s
    fast = [ResponseFormat("json_schema", {"type": "object", "properties": {k: {"type": "integer"}}}) for k in "xy"]
    t0 = time.perf_counter()
    with pytest.raises(GrammarError) as e:
        await cache.compile_async(slow, tenant="a")
    assert e.value.code == "schema_compile_timeout" and 0.3 <= time.perf_counter() - t0 < 0.6
    assert cache._inflight  # still compiling
    t0 = time.perf_counter()
    assert await cache.compile_async(fast[0], tenant="b") is not None  # another tenant: at once
    assert time.perf_counter() - t0 < 0.3
    with pytest.raises(GrammarError) as e:  # the same tenant: waits for its turn, in vain
        await cache.compile_async(fast[1], tenant="a")
    assert e.value.code == "schema_compile_timeout"
    while cache._inflight:
        await asyncio.sleep(0.05)
    assert await cache.compile_async(fast[1], tenant="a") is not None  # its turn is back
    t0 = time.perf_counter()
    with pytest.raises(GrammarError) as e:  # the slow schema finished late: refused from the cache, at once
        await cache.compile_async(slow, tenant="c")
    assert e.value.code == "schema_compile_timeout" and time.perf_counter() - t0 < 0.05
    cache.close()


# -- the matcher and the verification masks ---------------------------------------------------


def bits(bitmask: torch.Tensor, row: int) -> torch.Tensor:
    """bool [V] of the allowed tokens of ``bitmask[row]``."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bitmask[row].unsqueeze(-1) >> shifts) & 1).bool().flatten()[:V]


def test_verification_rows_are_the_masks_of_the_draft_prefixes(grammars, tokenizer):
    fmt = ResponseFormat("json_schema", {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    compiled = grammars.compile(fmt)
    text = tokenizer.encode('{"n": 12}', add_special_tokens=False)
    g = RequestGrammar(compiled)
    assert g.advance(text[:1])
    drafts = text[1:] + [EOS, 5]  # ends with the stop token, then one more draft
    mask = new_bitmask(len(drafts) + 1, V)
    g.fill_verification(drafts, mask, 0)
    step = RequestGrammar(compiled)  # the reference: one token at a time
    step.advance(text[:1])
    for k, tok in enumerate(drafts[:-1]):
        ref = new_bitmask(1, V)
        step.fill(ref, 0)
        assert torch.equal(bits(mask, k), bits(ref, 0)), k
        assert bits(mask, k)[tok]
        step.advance([tok])
    assert bits(mask, len(drafts)).all()  # after the stop token: nothing masked (the reply ended)
    # the matcher was rolled back: the same masks again, and the tokens still advance it
    again = new_bitmask(len(drafts) + 1, V)
    g.fill_verification(drafts, again, 0)
    assert torch.equal(mask, again) and g.advance(text[1:] + [EOS]) and g.terminated
    # a forbidden draft: its own row forbids it, the rows after it are left all-allowed
    g2 = RequestGrammar(compiled)
    bad = [tokenizer.encode("x", add_special_tokens=False)[0], text[1]]
    m2 = new_bitmask(3, V)
    g2.fill_verification(bad, m2, 0)
    assert not bits(m2, 0)[bad[0]] and bits(m2, 1).all() and bits(m2, 2).all()
    logits = torch.zeros(3, V)
    out = mask_logits(logits, m2, [0])
    assert torch.isinf(out[0]).sum() == (~bits(m2, 0)).sum() and not torch.isinf(out[1:]).any()
    assert not torch.isinf(logits).any()  # the raw logits are untouched (logprobs read them)


# -- the engine: lossless at T = 0, mixed batches -----------------------------------------------

PLAIN_PROMPTS = ["Tell me a joke.", "What is 2 + 3?", "Write a haiku about the sea.", "Name three colors."]


def run_engine(model, tokenizer, reqs, warm_up: str | None = None, **cfg):
    """Run ``reqs`` (``(id, prompt, SamplingParams, ResponseFormat | None)``, the prompt a user
    message or token ids) in one engine; returns ``{id: (text, tokens, final event)}``. ``warm_up``: a prompt run alone first, so
    the requests that share it prefill only its last block (prefix cache)."""
    events: dict[str, list] = {}
    engine = LLMEngine(EngineConfig(**{"dtype": "gguf", "max_batch_size": 64, "max_context": 1024,
                                       "request_timeout_s": 3600.0, **cfg}),
                       lambda rid, ev: events.setdefault(rid, []).append(ev), model=model, tokenizer=tokenizer)
    if warm_up is not None:
        engine.add_request(GenerationRequest("warm-up", chat_ids(tokenizer, warm_up), SamplingParams(max_tokens=1)))
        while engine.has_work():
            engine.step()
        del events["warm-up"]
    for rid, prompt, sp, fmt in reqs:
        ids = chat_ids(tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
        engine.add_request(GenerationRequest(rid, ids, sp, response_format=fmt))
    while engine.has_work():
        engine.step()
    return engine, {k: ("".join(e.text for e in v if isinstance(e, TextDelta)),
                        [t for e in v if isinstance(e, TextDelta) for t in e.token_ids], v[-1]) for k, v in events.items()}


def test_t0_constrained_speculative_text_is_constrained_plain_text(target_gguf, tokenizer, gguf_kernel):
    """14 schemas, JSON mode and 4 free-text requests in one ragged batch, T = 0: hybrid
    speculation (n-gram and DSpark drafts) emits exactly the tokens of plain decoding; every constrained
    reply that stopped validates; the free-text ones are those of a batch without any grammar.
    Every constrained request reports the time its masks took (``Finished.grammar_mask_s`` > 0),
    the free-text ones none."""
    sp = SamplingParams(temperature=0.0, max_tokens=64)
    picked = SCHEMAS[::4]
    reqs = [(name, prompt, sp, ResponseFormat("json_schema", schema)) for name, prompt, schema in picked]
    reqs += [(f"plain{i}", p, sp, None) for i, p in enumerate(PLAIN_PROMPTS)]
    reqs.insert(5, ("json_object", "Describe a cat as JSON.", sp, ResponseFormat("json_object")))
    _, plain = run_engine(target_gguf, tokenizer, reqs)
    _, free = run_engine(target_gguf, tokenizer, [r for r in reqs if r[3] is None])
    for method, policy in (("hybrid", "dspark-sla"),):
        engine, spec = run_engine(target_gguf, tokenizer, reqs, spec_method=method, spec_policy=policy,
                                  num_speculative_tokens=3, spec_gate=False)
        assert {k: v[1] for k, v in spec.items()} == {k: v[1] for k, v in plain.items()}, method
        drafted = sum(v[2].spec.drafted for k, v in spec.items() if not k.startswith("plain"))
        accepted = sum(v[2].spec.accepted for k, v in spec.items() if not k.startswith("plain"))
        assert drafted > accepted > 30, (method, drafted, accepted)  # drafts accepted and rejected under masks
        assert_mask_times(spec, method)
    assert_mask_times(plain, "none")
    for k in free:
        assert plain[k][1] == free[k][1]
    schemas = {name: schema for name, _, schema in picked}
    stopped = 0
    for k, (text, _, fin) in plain.items():
        assert isinstance(fin, Finished), fin
        if k in schemas and fin.finish_reason.value == "stop":
            jsonschema.validate(json.loads(text), schemas[k])
            stopped += 1
    assert stopped >= 10
    text, _, fin = plain["json_object"]
    assert text.startswith("{") and (fin.finish_reason.value != "stop" or isinstance(json.loads(text), dict))


def assert_mask_times(out: dict, method: str) -> None:
    """Constrained requests (every id but ``plain*``) measured a positive mask time, below their
    wall time; free-text ones report none. Prints the mean ms per generated token."""
    per_token = []
    for k, (_, tokens, fin) in out.items():
        if k.startswith("plain"):
            assert fin.grammar_mask_s is None, k
            continue
        t = fin.timings
        assert 0 < fin.grammar_mask_s < t.finished - t.queued, (k, fin.grammar_mask_s)
        per_token.append(1000 * fin.grammar_mask_s / fin.completion_tokens)
    print(f"\n{method}: grammar mask {sum(per_token) / len(per_token):.3f} ms per generated token "
          f"(mean over {len(per_token)} requests, max {max(per_token):.3f})")


def test_invalid_schema_fails_only_its_request(target_gguf, tokenizer, gguf_kernel):
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    _, out = run_engine(target_gguf, tokenizer, [
        ("bad", "Hi", sp, ResponseFormat("json_schema", {"type": "object", "uniqueItems": True})),
        ("ok", "Hi", sp, None)])
    assert isinstance(out["bad"][2], Failed) and out["bad"][2].code == "invalid_request"
    assert "uniqueItems" in out["bad"][2].message
    assert isinstance(out["ok"][2], Finished)


# -- the engine: the T = 1 distribution under speculation ----------------------------------------

COLORS = ["red", "green", "blue", "yellow", "purple", "orange"]
# one option a line: the reply's opening quote is a token of the prompt, so prompt lookup drafts a colour;
# 65 tokens with the template (16·k + 1: after the warm-up each request prefills one token)
COLOR_PROMPT = "Pick one colour from this list and answer in quotes.\n" + "\n".join(f'"{c}"' for c in COLORS)
N_T1 = 200  # requests per run (the engine's time is ~all of the test's: ~0.02 s of a loaded 2-core CPU per row)


T1_GEN_SEED = 7_000  # unseeded requests' generators: seeds 7000, 7001, … in admission order (reproducible)


def t1_run(model, tokenizer, spec_method: str):
    fmt = ResponseFormat("json_schema", {"enum": COLORS})
    reqs = [(f"r{i}", COLOR_PROMPT, SamplingParams(temperature=1.0, max_tokens=8), fmt) for i in range(N_T1)]
    cfg = {} if spec_method == "none" else {"spec_method": spec_method, "spec_policy": "fixed",
                                             "num_speculative_tokens": 2, "spec_gate": False}
    gens = itertools.count(T1_GEN_SEED)
    with pytest.MonkeyPatch.context() as mp:  # standard (unseeded) verification, fixed random numbers
        mp.setattr(llm_engine, "request_generator",
                   lambda params, device="cpu": torch.Generator(device=device).manual_seed(next(gens)))
        return run_engine(model, tokenizer, reqs, warm_up=COLOR_PROMPT, **cfg)


def test_t1_constrained_speculative_tokens_follow_the_masked_target(target_gguf, tokenizer, gguf_kernel, grammars):
    """T = 1, a six-way enum: the second token of every reply (the first one a verification round
    emits — prompt-lookup drafts taken from the list in the prompt, often forbidden or
    rejected) is distributed as the masked target's, exactly: chi-square against
    softmax(logits masked by the grammar) from an independent forward, for speculative and
    plain decoding alike, per group of replies sharing their first token."""
    prompt = chat_ids(tokenizer, COLOR_PROMPT)
    assert len(prompt) % 16 == 1, len(prompt)
    compiled = grammars.compile(ResponseFormat("json_schema", {"enum": COLORS}))
    pvalues = {}
    for method in ("prompt_lookup", "none"):
        _, out = t1_run(target_gguf, tokenizer, method)
        assert all(v[2].finish_reason.value == "stop" and json.loads(v[0]) in COLORS for v in out.values())
        firsts = Counter(v[1][0] for v in out.values())
        groups = [t for t, n in firsts.items() if n >= MIN_GROUP]
        rows = continuation_logits(target_gguf, prompt, [(t,) for t in groups])
        stat, df = 0.0, 0
        for t in groups:
            g = RequestGrammar(compiled)
            assert g.advance([t])
            mask = new_bitmask(1, V)
            g.fill(mask, 0)
            p = torch.softmax(mask_logits(rows[(t,)][1:2], mask, [0])[0], -1)
            seconds = Counter(v[1][1] for v in out.values() if v[1][0] == t)
            s, d = chi2_tokens(seconds, p, firsts[t])
            stat, df = stat + s, df + d
        pvalues[method] = float(stats.chi2.sf(stat, df)) if df else 1.0
        print(f"\n{method}: first tokens {dict(firsts)}, chi2 {stat:.1f} df {df} p {pvalues[method]:.3g}")
        assert df >= 2
        if method != "none":
            st = [v[2].spec for v in out.values()]
            verified, accepted = sum(s.verified for s in st), sum(s.accepted for s in st)
            assert verified - accepted >= 100 and accepted >= 100, (verified, accepted)
    assert min(pvalues.values()) * len(pvalues) > 0.01, pvalues
