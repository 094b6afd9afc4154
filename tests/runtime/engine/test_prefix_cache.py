"""Automatic prefix caching (runtime/engine/prefix_cache.py): the store's block/LRU logic on
synthetic KV, then the real model in fp32 — reused KV gives the same logits and greedy
outputs as a fresh prefill (also under speculation), the hit counter counts exactly the
reused block-aligned tokens, eviction and aborts leave a consistent store, and the
counters reach /metrics and /admin/v1/engine.

The engine's KV cache is zeroed between sequential requests, so a restore that copied
nothing (or the wrong blocks) could not pass by reading a previous occupant's KV."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.interface import FinishReason, GenerationRequest, LoadSnapshot, SamplingParams, TextDelta
from runtime.engine.kv_cache import KVCache
from runtime.models.llama import SeqSpan
from runtime.engine.prefix_cache import PrefixCache, block_hashes
from runtime.engine.sequence import SeqStatus
from tests.support.fakes import FakeBackend
from tests.support.gateway_fixtures import make_settings

B = 16  # block size used throughout
SYSTEM = (
    "You are Sparky, a careful assistant for a small hardware shop. Answer in plain English, "
    "keep answers short, never invent prices, and say so when you do not know something. "
    "The shop sells resistors, capacitors, microcontrollers, soldering irons, and cables. "
    "Opening hours are nine to five on weekdays. Returns are accepted within thirty days with a receipt."
)
OTHER_SYSTEM = "You are a terse pirate. Answer every question in one short sentence, in pirate speak."
QUESTIONS = ["Do you sell soldering irons?", "When are you open?", "Can I return a cable?"]
TURNS = ["Hi! What do you sell?", "Which of those do I need for a blinking LED?", "Thanks. Are you open on Sunday?"]
SP = SamplingParams(temperature=0, max_tokens=10)


# -- synthetic stores: block and LRU logic ----------------------------------------------

def store(num_slots=3, max_len=96, layers=2, heads=2, dim=4, seed=0) -> KVCache:
    c = KVCache(layers, num_slots, heads, dim, max_len, torch.float32)
    g = torch.Generator().manual_seed(seed)
    c.k.copy_(torch.randn(c.k.shape, generator=g))
    c.v.copy_(torch.randn(c.v.shape, generator=g))
    return c


def test_restore_copies_the_matched_chain_and_leaves_a_token_to_prefill():
    c = store()
    pc = PrefixCache([c], num_blocks=8, block_size=B)
    toks = list(range(100, 164))  # 4 full blocks
    c.lengths[0] = 64
    assert pc.insert(0, toks) == 4 and pc.num_cached_blocks == 4
    assert pc.insert(0, toks) == 0  # already stored: nothing copied twice
    # Same 64 tokens: only 3 blocks restored, the last block's final token must be prefilled.
    assert pc.restore(1, toks) == 48
    assert c.lengths[1] == 48
    assert torch.equal(c.k[:, 1, :, :48], c.k[:, 0, :, :48]) and torch.equal(c.v[:, 1, :, :48], c.v[:, 0, :, :48])
    # A prompt that diverges inside block 2: blocks 0 and 1 only.
    other = toks[:40] + [7] * 30
    assert pc.restore(2, other) == 32 and c.lengths[2] == 32
    assert torch.equal(c.k[:, 2, :, :32], c.k[:, 0, :, :32])
    assert (pc.queries, pc.hits) == (64 + 70, 48 + 32)
    # Same tokens in block 1 but a different block 0: the chain key differs, no hit.
    assert pc.restore(2, [9] * 16 + toks[16:]) == 0 and c.lengths[2] == 0
    assert block_hashes(toks, B, 2)[1] != block_hashes([9] * 16 + toks[16:], B, 2)[1]


def test_insert_trusts_only_positions_valid_in_every_store_and_known_tokens():
    target, draft = store(seed=1), store(seed=2)
    pc = PrefixCache([target, draft], num_blocks=8, block_size=B)
    toks = list(range(200, 260))
    target.lengths[0], draft.lengths[0] = 60, 20  # drafter context committed only 20
    assert pc.insert(0, toks) == 1
    target.lengths[0], draft.lengths[0] = 60, 60
    assert pc.insert(0, toks[:40]) == 1  # only 40 tokens known → 2 blocks in total
    assert pc.restore(1, toks) == 32 and target.lengths[1] == draft.lengths[1] == 32
    for s in (target, draft):
        assert torch.equal(s.k[:, 1, :, :32], s.k[:, 0, :, :32]) and torch.equal(s.v[:, 1, :, :32], s.v[:, 0, :, :32])


def test_an_optional_store_is_cached_where_it_covers_and_added_later():
    """``hybrid`` abandons drafter contexts: the target's blocks are cached whatever the draft
    store holds, the draft store's data only with the blocks it covers, and a later insert
    from a slot that has it fills it in."""
    target, draft = store(seed=1), store(seed=2)
    pc = PrefixCache([target, draft], num_blocks=8, block_size=B, optional=[False, True])
    toks = list(range(200, 265))
    target.lengths[0], draft.lengths[0] = 64, 20  # drafter context abandoned after 20 positions
    assert pc.insert(0, toks) == 4  # every target block, not just the drafter's one
    assert pc.restore(1, toks) == 64 and (target.lengths[1], draft.lengths[1]) == (64, 16)
    assert torch.equal(target.k[:, 1, :, :64], target.k[:, 0, :, :64])
    assert torch.equal(draft.k[:, 1, :, :16], draft.k[:, 0, :, :16])
    # slot 2 has the whole drafter context for the same tokens: its insert adds it to the cached blocks
    for s in (target, draft):
        s.k[:, 2], s.v[:, 2] = s.k[:, 0], s.v[:, 0]
    draft.k[:, 2, :, 16:64] += 1.0  # (different values, so the test sees which slot they came from)
    target.lengths[2], draft.lengths[2] = 64, 64
    assert pc.insert(2, toks) == 0  # no new block...
    assert pc.restore(1, toks) == 64 and draft.lengths[1] == 64  # ...but the drafter's data is there now
    assert torch.equal(draft.k[:, 1, :, :64], draft.k[:, 2, :, :64]) and torch.equal(draft.v[:, 1, :, :64], draft.v[:, 2, :, :64])
    # a gap: the draft store covers block 0 only, block 1 not, so block 2's data is not restored either
    pc2 = PrefixCache([target, draft], num_blocks=8, block_size=B, optional=[False, True])
    target.lengths[0], draft.lengths[0] = 64, 16
    pc2.insert(0, toks)
    target.lengths[2], draft.lengths[2] = 48, 48
    pc2._covered[1][pc2._lru[block_hashes(toks, B, 2)[1]]] = False  # as if evicted and re-cached without it
    assert pc2.restore(1, toks) == 64 and draft.lengths[1] == 16
    with pytest.raises(ValueError):
        PrefixCache([target], num_blocks=8, optional=[True])  # at least one required store


def test_lru_evicts_the_oldest_chain_tail_first():
    c = store()
    pc = PrefixCache([c], num_blocks=3, block_size=B)
    a, b = [1] * 32, [2] * 32
    c.lengths[0] = 32
    c.k[:, 0, :, :32] = 1.0
    assert pc.insert(0, a) == 2
    c.k[:, 0, :, :32] = 2.0
    assert pc.insert(0, b) == 2  # one free block, then evicts a's tail (never its first block)
    assert pc.evictions == 1
    ka, kb = block_hashes(a, B, 2), block_hashes(b, B, 2)
    assert ka[0] in pc and ka[1] not in pc and kb[0] in pc and kb[1] in pc
    assert pc.restore(1, a + [0]) == 16 and bool((c.k[:, 1, :, :16] == 1.0).all())
    assert pc.restore(2, b + [0]) == 32 and bool((c.k[:, 2, :, :32] == 2.0).all())
    # b was used last: a third chain evicts a's remaining block first.
    c.k[:, 0, :, :16] = 3.0
    c.lengths[0] = 16
    assert pc.insert(0, [3] * 16) == 1 and ka[0] not in pc and kb[0] in pc and kb[1] in pc


def test_a_chain_longer_than_the_pool_keeps_its_head_and_never_evicts_itself():
    c = store()
    pc = PrefixCache([c], num_blocks=2, block_size=B)
    toks = list(range(300, 380))
    c.lengths[0] = 80
    assert pc.insert(0, toks) == 2 and pc.evictions == 0
    assert pc.restore(1, toks) == 32
    assert torch.equal(c.k[:, 1, :, :32], c.k[:, 0, :, :32])


# -- the real model ------------------------------------------------------------------------

def test_salts_are_separate_namespaces():
    c = store()
    pc = PrefixCache([c], num_blocks=8, block_size=B)
    toks = list(range(100, 164))
    c.lengths[0] = 64
    assert pc.insert(0, toks, salt="tenant:acme") == 4
    assert pc.restore(1, toks, salt="tenant:globex") == 0  # another tenant: a miss
    assert pc.restore(1, toks) == 0  # the unsalted namespace too
    assert pc.restore(1, toks, salt="tenant:acme") == 48
    assert (c.k[:, 1, :, :48] == c.k[:, 0, :, :48]).all()
    # The same tokens under another salt are stored again, in their own blocks.
    assert pc.insert(0, toks, salt="tenant:globex") == 4 and pc.num_cached_blocks == 8
    assert block_hashes(toks, B, 4) != block_hashes(toks, B, 4, "x") != block_hashes(toks, B, 4, "y")
    assert block_hashes(toks, B, 4, "") == block_hashes(toks, B, 4)


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def single_turn(tokenizer, system, question):
    return chat_ids(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": question}])


class Runner:
    """One engine driven synchronously, one request at a time, KV zeroed in between."""

    def __init__(self, model, tokenizer, **cfg):
        self.events: dict[str, list] = {}
        config = EngineConfig(**{"dtype": "float32", "max_batch_size": 2, "max_context": 768, **cfg})
        self.engine = LLMEngine(config, lambda rid, ev: self.events.setdefault(rid, []).append(ev),
                                model=model, tokenizer=tokenizer)
        self.tokenizer = tokenizer
        self.n = 0
        self.hits: list[int] = []  # per request: prefix-cache hit tokens

    def zero_kv(self):
        for c in (self.engine.cache, getattr(self.engine.speculator, "dcache", None)):
            if c is not None:
                c.k.zero_()
                c.v.zero_()

    def ask(self, ids, sampling=SP) -> list[int]:
        self.zero_kv()
        rid = f"r{self.n}"
        self.n += 1
        pc = self.engine.prefix_cache
        before = pc.hits if pc is not None else 0
        self.engine.add_request(GenerationRequest(rid, ids, sampling))
        steps = 0
        while self.engine.has_work():
            self.engine.step()
            steps += 1
            assert steps < 500
        self.hits.append((pc.hits if pc is not None else 0) - before)
        return self.tokens(rid)

    def tokens(self, rid):
        return [t for e in self.events.get(rid, []) if isinstance(e, TextDelta) for t in e.token_ids]

    def converse(self, system, turns) -> list[tuple[list[int], list[int]]]:
        """A multi-turn chat that resends the whole history every turn."""
        messages = [{"role": "system", "content": system}]
        out = []
        for user in turns:
            messages.append({"role": "user", "content": user})
            ids = chat_ids(self.tokenizer, messages)
            toks = self.ask(ids)
            out.append((ids, toks))
            messages.append({"role": "assistant", "content": self.tokenizer.decode(toks, skip_special_tokens=True)})
        return out


def scenario(runner: Runner, tokenizer):
    """3 requests sharing SYSTEM, then a 3-turn conversation with SYSTEM → [(prompt, completion)]."""
    out = [(ids, runner.ask(ids)) for ids in (single_turn(tokenizer, SYSTEM, q) for q in QUESTIONS)]
    return out + runner.converse(SYSTEM, TURNS)


def expected_hits(history: list[tuple[list[int], list[int]]]) -> list[int]:
    """Hit tokens per request, from first principles: the longest block-aligned prefix shared
    with an earlier sequence's cached tokens (AR: prompt + all but the last completion
    token), capped so ≥ 1 prompt token is prefilled. Assumes nothing was evicted."""
    out, seen = [], []
    for prompt, completion in history:
        best = 0
        for prev in seen:
            lcp = 0
            while lcp < min(len(prev), len(prompt)) and prev[lcp] == prompt[lcp]:
                lcp += 1
            best = max(best, lcp)
        out.append(min(best // B, (len(prompt) - 1) // B) * B)
        seen.append(prompt + completion[:-1])
    return out


@pytest.fixture(scope="module")
def reference(target_fp32, tokenizer):
    """The scenario and the eviction prompts with the prefix cache off."""
    r = Runner(target_fp32, tokenizer, prefix_cache_blocks=0)
    assert r.engine.prefix_cache is None
    hist = scenario(r, tokenizer)
    evict = [(ids, r.ask(ids)) for ids in eviction_prompts(tokenizer)]
    p1, c1 = hist[1]
    return hist, evict, r.ask(p1 + c1[:2])  # the second request resumed after 2 tokens


def eviction_prompts(tokenizer):
    return [single_turn(tokenizer, s, q) for s, q in
            [(SYSTEM, QUESTIONS[0]), (OTHER_SYSTEM, QUESTIONS[1]), (SYSTEM, QUESTIONS[2]), (OTHER_SYSTEM, QUESTIONS[0])]]


@pytest.mark.model
def test_outputs_equal_cache_off_and_hits_count_exactly_the_reused_tokens(target_fp32, tokenizer, reference):
    ref_hist = reference[0]
    r = Runner(target_fp32, tokenizer, prefix_block_size=B)
    hist = scenario(r, tokenizer)
    assert [c for _, c in hist] == [c for _, c in ref_hist]
    assert [p for p, _ in hist] == [p for p, _ in ref_hist]
    exp = expected_hits(hist)
    assert r.hits == exp
    pc = r.engine.prefix_cache
    assert pc.hits == sum(exp) and pc.queries == sum(len(p) for p, _ in hist) and pc.evictions == 0
    # The shared system prompt is reused by every request after the first...
    assert all(h >= 80 for h in exp[1:])
    # ...and each later turn reuses the previous turn's prompt and reply (history), not just SYSTEM.
    for (prev, _), h in zip(hist[3:5], exp[4:6]):
        assert h >= (len(prev) // B) * B  # the whole previous prompt, block-aligned
    assert exp[4] > len(hist[3][0])  # turn 2 reuses KV of turn 1's decoded reply too


@pytest.mark.model
def test_logits_after_a_reused_prefix_equal_a_fresh_prefill(target_fp32):
    model = target_fp32
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(100, 40000, (70,), generator=g).tolist()
    first, second = shared + [11, 12, 13], shared + torch.randint(100, 40000, (25,), generator=g).tolist()
    cache = model.new_cache(3, 128)
    n1, n2 = len(first), len(second)
    model.forward(torch.tensor(first), [SeqSpan(0, 0, n1)], cache, torch.tensor([n1 - 1]))
    pc = PrefixCache([cache], num_blocks=16, block_size=B)
    assert pc.insert(0, first) == n1 // B
    fresh = model.forward(torch.tensor(second), [SeqSpan(1, 0, n2)], cache, torch.tensor([n2 - 1]))
    reused = pc.restore(2, second)
    assert reused == (70 // B) * B  # the shared full blocks
    out = model.forward(torch.tensor(second[reused:]), [SeqSpan(2, reused, n2 - reused)], cache,
                        torch.tensor([n2 - reused - 1]))
    assert (out.logits - fresh.logits).abs().max().item() <= 1e-4
    assert (cache.k[:, 2, :, :n2] - cache.k[:, 1, :, :n2]).abs().max().item() <= 1e-4
    assert out.logits.argmax().item() == fresh.logits.argmax().item()


@pytest.mark.model
def test_engine_shares_cached_prefixes_only_within_a_salt(target_fp32, tokenizer, reference):
    r = Runner(target_fp32, tokenizer)
    (p0, c0), (p1, c1) = reference[0][0], reference[0][1]
    salted = lambda rid, ids, salt: GenerationRequest(rid, ids, SP, cache_salt=salt)  # noqa: E731
    out = []
    for i, (ids, salt) in enumerate([(p0, "tenant:a"), (p1, "tenant:b"), (p1, "tenant:a")]):
        r.zero_kv()
        before = r.engine.prefix_cache.hits
        r.engine.add_request(salted(f"s{i}", ids, salt))
        while r.engine.has_work():
            r.engine.step()
        out.append((r.engine.prefix_cache.hits - before, r.tokens(f"s{i}")))
    shared = expected_hits([(p0, c0), (p1, c1)])[1]
    assert shared >= 32  # the two prompts share SYSTEM's blocks
    assert out[1][0] == 0 and out[2][0] == shared  # tenant b misses; tenant a hits
    assert [t for _, t in out] == [c0, c1, c1]


@pytest.mark.model
def test_tiny_pool_evicts_lru_blocks_and_outputs_stay_correct(target_fp32, tokenizer, reference):
    ref = reference[1]
    r = Runner(target_fp32, tokenizer, prefix_cache_blocks=6, prefix_block_size=B)
    got = [(ids, r.ask(ids)) for ids in eviction_prompts(tokenizer)]
    assert [c for _, c in got] == [c for _, c in ref]
    pc = r.engine.prefix_cache
    assert pc.evictions > 0 and pc.num_cached_blocks == 6
    # The header block "<|im_start|>system\n…" differs between the two system prompts after a few
    # tokens, so hits here come only from the same system prompt's surviving blocks.
    assert r.hits[0] == 0 and r.hits[1] == 0 and 0 < r.hits[2] <= 6 * B


@pytest.mark.model
def test_abort_mid_prefill_and_mid_decode_leaves_the_store_consistent(target_fp32, tokenizer, reference):
    ref_hist = reference[0]
    (p0, c0), (p1, c1) = ref_hist[0], ref_hist[1]
    assert len(c1) >= 3
    r = Runner(target_fp32, tokenizer, prefill_chunk_tokens=B, prefix_block_size=B)
    e, pc = r.engine, r.engine.prefix_cache
    # Mid-prefill: two chunks of 16 cached, then the client goes away.
    e.add_request(GenerationRequest("a", p0, SP))
    e.step()
    e.step()
    assert e._by_id["a"].num_cached == 32 and e._by_id["a"].status is SeqStatus.PREFILL
    e.abort("a")
    assert r.events["a"][-1].finish_reason is FinishReason.ABORT
    assert pc.num_cached_blocks == 2 and e.cache.num_free == 2
    assert r.ask(p0) == c0 and r.hits[-1] == 32
    # Mid-decode: 3 tokens out (2 of them processed), abort.
    r.zero_kv()
    e.add_request(GenerationRequest("b", p1, SP))
    while len(r.tokens("b")) < 3:
        e.step()
    seq = e._by_id["b"]
    assert seq.status is SeqStatus.DECODE and seq.num_cached == len(p1) + 2
    e.abort("b")
    assert e.cache.num_free == 2
    # Exactly the blocks of what was validly cached: a's 32 tokens, p0's run, b's prompt + 2.
    stored = [p0[:32], p0 + c0[:-1], p1 + c1[:2]]
    expected = {k for toks in stored for k in block_hashes(toks, B, len(toks) // B)}
    assert pc.num_cached_blocks == len(expected) and all(k in pc for k in expected)
    # b's decoded tokens are reusable history: a prompt continuing them hits past the prompt.
    resumed = p1 + c1[:2]
    assert r.ask(resumed) == reference[2] and r.hits[-1] == (len(resumed) - 1) // B * B
    assert r.ask(p1) == c1 and r.hits[-1] == (len(p1) - 1) // B * B


@pytest.mark.model
@pytest.mark.parametrize("method", ["prompt_lookup", "dspark"])
def test_speculative_outputs_equal_autoregressive_with_reuse(target_fp32, tokenizer, reference, method):
    ref_hist = reference[0]
    r = Runner(target_fp32, tokenizer, spec_method=method, spec_policy="fixed", prefix_block_size=B)
    hist = scenario(r, tokenizer)
    assert [c for _, c in hist] == [c for _, c in ref_hist]
    assert all(h >= 80 for h in r.hits[1:])
    if method == "dspark":
        assert len(r.engine.prefix_cache.stores) == 2  # target KV + drafter context


@pytest.mark.model
def test_hybrid_abandoned_drafter_contexts_keep_outputs_and_target_reuse(target_fp32, tokenizer, reference, monkeypatch):
    """``hybrid`` with every request's drafter context abandoned after 8 positions without a
    DSpark draft: T = 0 outputs are still plain decoding's, the target KV of replies is still
    reused by the next turn, and a request restored past its drafter context drafts n-grams only."""
    from runtime.speculation import speculator as sp_mod

    monkeypatch.setattr(sp_mod, "LAZY_COMMIT_MAX", 8)
    ref_hist = reference[0]
    r = Runner(target_fp32, tokenizer, spec_method="hybrid", spec_policy="fixed", prefix_block_size=B)
    sp = r.engine.speculator
    sp._worth_drafting = lambda seqs, rnd, wanted: []  # never a DSpark draft: every context is abandoned
    drafted = []
    propose = sp._propose_blocks

    def spy(seqs, rnd, rows):
        drafted.append([(seqs[i].slot, sp.has_context(seqs[i].slot)) for i in rows])
        return propose(seqs, rnd, rows)

    sp._propose_blocks = spy
    abandoned: list[int] = []
    abandon = sp._abandon
    sp._abandon = lambda slot: (abandoned.append(slot), abandon(slot))
    hist = scenario(r, tokenizer)
    assert [c for _, c in hist] == [c for _, c in ref_hist]
    assert abandoned and r.hits == expected_hits(hist)  # the target's reuse is unchanged
    assert all(not rows for rows in drafted)
    pc = r.engine.prefix_cache
    assert pc.optional == [False, True] and not all(pc._covered[1][i] for i in pc._lru.values())
    # the next request restores the whole history for the target, only part of it for the drafter:
    # its slot keeps no drafter context, and even a DSpark-hungry budget drafts nothing for it
    sp._worth_drafting = lambda seqs, rnd, wanted: wanted
    seen = []
    sp._propose_blocks = lambda seqs, rnd, rows: (seen.append((rows, [sp.has_context(s.slot) for s in seqs])),
                                                  propose(seqs, rnd, rows))[1]
    p, c = hist[-1]
    assert r.ask(p + c) and r.hits[-1] >= len(p) // B * B
    assert seen and all(rows == [] and has == [False] for rows, has in seen)
    # a fresh prompt (no hit) keeps its drafter context and is DSpark-drafted again
    seen.clear()
    r.ask(single_turn(tokenizer, OTHER_SYSTEM, "Name a colour."))
    assert all(has == [True] for _, has in seen) and any(rows == [0] for rows, _ in seen)


@pytest.mark.model
def test_dspark_draft_context_is_restored_with_the_target_kv(target_fp32, tokenizer):
    """After a hit, both the target KV and the drafter's per-position context K/V of the new
    sequence equal those of a fresh prefill (so drafting sees exactly the same context)."""
    p_a, p_b = (single_turn(tokenizer, SYSTEM, q) for q in QUESTIONS[:2])
    caches = []
    for blocks in (256, 0):
        r = Runner(target_fp32, tokenizer, spec_method="dspark", spec_policy="fixed", prefix_cache_blocks=blocks)
        if blocks:
            r.ask(p_a, SamplingParams(temperature=0, max_tokens=2))
        r.zero_kv()
        e = r.engine
        e.add_request(GenerationRequest("b", p_b, SamplingParams(temperature=0, max_tokens=4)))
        e.step()  # the whole prompt in one chunk
        seq = e._by_id["b"]
        assert seq.status is SeqStatus.DECODE
        d = e.speculator.dcache
        assert d.lengths[seq.slot] == e.cache.lengths[seq.slot] == len(p_b)
        caches.append(tuple(t[:, seq.slot, :, : len(p_b)].clone() for t in (e.cache.k, e.cache.v, d.k, d.v)))
        if blocks:
            assert r.engine.prefix_cache.hits >= 80
    for on, off in zip(*caches):
        assert (on - off).abs().max().item() <= 1e-4


# -- counters on the interfaces -------------------------------------------------------------

def test_async_engine_load_reports_the_prefix_cache_counters():
    from runtime.engine.async_engine import AsyncEngine

    a = AsyncEngine(EngineConfig())
    a.engine = SimpleNamespace(num_running=1, num_waiting=0, forward_steps=9, decode_steps=4, verify_tokens=4,
                               spec_steps=3, gated_steps=1, decode_rows=7, zero_budget_rows=2, decode_tokens=15,
                               prefix_cache=SimpleNamespace(queries=120, hits=80))
    snap = a.load()
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits) == (120, 80)
    assert (snap.spec_steps, snap.spec_gated_steps) == (3, 1)
    assert (snap.decode_rows, snap.zero_budget_rows, snap.decode_tokens) == (7, 2, 15)
    a.engine.prefix_cache = None
    assert (a.load().prefix_cache_queries, a.load().prefix_cache_hits) == (0, 0)


class PrefixFake(FakeBackend):
    def load(self) -> LoadSnapshot:
        return LoadSnapshot(0, 0, 16, 3, prefix_cache_queries=500, prefix_cache_hits=320)


async def test_prefix_cache_counters_on_metrics_and_admin_engine(db_url):  # noqa: F811
    from gateway.main import create_app

    admin = {"Authorization": "Bearer admin-test-token"}
    application = create_app(make_settings(db_url, admin_token="admin-test-token"), PrefixFake())
    async with application.router.lifespan_context(application):
        await application.state.backend_start
        transport = httpx.ASGITransport(app=application, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway.test") as c:
            metrics_text = (await c.get("/metrics", headers=admin)).text
            engine = (await c.get("/admin/v1/engine", headers=admin)).json()
    samples = {s.name: s.value for f in text_string_to_metric_families(metrics_text) for s in f.samples}
    assert samples["sparkgate:prefix_cache_queries_total"] == 500
    assert samples["sparkgate:prefix_cache_hits_total"] == 320
    assert engine["prefix_cache_queries"] == 500 and engine["prefix_cache_hits"] == 320


async def test_gateway_salts_the_prefix_cache_per_tenant_unless_global(db_url):  # noqa: F811
    from gateway.main import create_app
    from gateway.openai.translate import prefix_cache_salt

    assert prefix_cache_salt("tenant", "acme", None) == "tenant:acme"
    assert prefix_cache_salt("tenant", "acme", "s1") == "tenant:acme\x1frequest:s1"
    assert prefix_cache_salt("global", "acme", None) is None
    assert prefix_cache_salt("global", "acme", "s1") == "request:s1"
    assert prefix_cache_salt("tenant", None, None) is None
    seen = {}
    for scope in ("tenant", "global"):
        backend = FakeBackend()
        application = create_app(make_settings(db_url, admin_token="tok", prefix_cache_scope=scope), backend)
        async with application.router.lifespan_context(application):
            await application.state.backend_start
            transport = httpx.ASGITransport(app=application, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway.test") as c:
                body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}]}
                h = {"Authorization": "Bearer tok"}
                assert (await c.post("/v1/chat/completions", json=body, headers=h)).status_code == 200
                r = await c.post("/v1/chat/completions", json={**body, "cache_salt": "conv-7"}, headers=h)
                assert r.status_code == 200
                bad = await c.post("/v1/chat/completions", json={**body, "cache_salt": "x" * 257}, headers=h)
                assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
        seen[scope] = [req.cache_salt for req in backend.requests]
    assert seen == {"tenant": ["tenant:admin", "tenant:admin\x1frequest:conv-7"], "global": [None, "request:conv-7"]}


def test_prefix_cache_settings_reach_the_engine_config(monkeypatch):
    from gateway.core.config import Settings

    monkeypatch.setenv("SPARKGATE_PREFIX_CACHE_BLOCKS", "0")
    monkeypatch.setenv("SPARKGATE_PREFIX_CACHE_SCOPE", "global")
    s = Settings()
    assert s.engine_config().prefix_cache_blocks == 0 and s.prefix_cache_scope == "global"
    assert Settings(_env_file=None, prefix_cache_blocks=64).engine_config().prefix_cache_blocks == 64
    with pytest.raises(ValueError):
        Settings(prefix_cache_scope="everyone")
    with pytest.raises(ValueError):
        Settings(prefix_cache_blocks=-1)
