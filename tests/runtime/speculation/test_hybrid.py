"""The hybrid proposer (n-gram draft where it is likely accepted, else DSpark), its n-gram
calibration, and the lazily committed drafter context (runtime/speculation/speculator.py)."""

from __future__ import annotations

import random

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.interface import GenerationRequest, SamplingParams, TextDelta
from runtime.speculation import speculator as sp_mod
from runtime.speculation.prompt_lookup import NgramIndex, ngram_survival, propose_ngram
from tests.support.golden import SPS_TABLE
from training.data import chat_ids
from training.ngram import count_acceptance


@pytest.mark.parametrize("max_ngram", [1, 3, 5])
def test_ngram_index_proposes_what_the_scan_proposes(max_ngram):
    rng = random.Random(max_ngram)
    for trial in range(30):
        toks = [rng.randrange(4 + trial % 5) for _ in range(rng.randrange(1, 120))]  # small vocab: many repeats
        idx = NgramIndex(max_ngram=max_ngram)
        for L in range(1, len(toks) + 1):
            idx.extend(toks[L - 1 : L])
            prop, n = idx.propose(4)
            assert prop == propose_ngram(toks[:L], 4, max_ngram=max_ngram)
            if prop:  # n is the longest suffix that occurred earlier with a continuation
                assert toks[L - n : L] in [toks[i : i + n] for i in range(L - n)]
    assert NgramIndex().propose(0) == ([], 0)
    with pytest.raises(ValueError):
        NgramIndex(max_ngram=2, min_ngram=3)


def test_count_acceptance_counts_by_match_length_and_position():
    #           prompt | response: 1 2 3 1 2 4
    seq = [1, 2, 3] + [1, 2, 4]
    tried, acc = count_acceptance([seq], [3], gamma=3, max_ngram=2)
    # p=3 (anchor 3): "3" never seen before → no draft. p=4 (anchor 1): 1-gram "1" → [2, 3, 1]:
    # 2 accepted, 3 ≠ 4 rejected. p=5 (anchor 2): 2-gram "1 2" → [3, 1, 2]: 3 ≠ 4 rejected.
    assert tried[1].tolist() == [1, 1, 0] and acc[1].tolist() == [1, 0, 0]
    assert tried[2].tolist() == [1, 0, 0] and acc[2].tolist() == [0, 0, 0]


def test_committed_calibration_is_sane():
    c = ngram_survival()
    assert sorted(c) == list(range(1, sp_mod.HYBRID_MAX_NGRAM + 1))
    assert all(0.0 <= x <= 1.0 for row in c.values() for x in row)
    firsts = [c[n][0] for n in sorted(c)]
    assert firsts == sorted(firsts) and firsts[-1] > firsts[0] + 0.3  # longer matches are accepted more often


def run(model, tokenizer, prompts, setup=None, **cfg):
    events: dict[str, list] = {}
    engine = LLMEngine(EngineConfig(**{"dtype": "float32", "max_batch_size": len(prompts), "max_context": 1024,
                                       "request_timeout_s": 3600.0, **cfg}),
                       lambda rid, ev: events.setdefault(rid, []).append(ev), model=model, tokenizer=tokenizer)
    if setup is not None:
        setup(engine)
    for i, ids in enumerate(prompts):
        engine.add_request(GenerationRequest(str(i), ids, SamplingParams(temperature=0, max_tokens=48)))
    while engine.has_work():
        engine.step()
    return engine, {k: [t for e in v if isinstance(e, TextDelta) for t in e.token_ids] for k, v in events.items()}


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [chat_ids(tokenizer, "List the days of the week twice."),
            chat_ids(tokenizer, "Write a haiku about autumn leaves.")]


def test_hybrid_uses_both_proposers_and_equals_plain_decoding(target_fp32, tokenizer, prompts):
    """T = 0, every draft verified: both proposers appear and the text is plain decoding's."""
    _, plain = run(target_fp32, tokenizer, prompts)
    seen = []

    def setup(engine):
        spec = engine.speculator
        record = spec.record_outcome

        def spy(seqs, proposal, accepted):
            seen.append([(s.request.request_id, d, n) for s, d, n in zip(seqs, proposal.from_drafter, proposal.drafted)])
            record(seqs, proposal, accepted)

        spec.record_outcome = spy
        # every request preferring a DSpark draft gets one (the cost check is timing-driven)
        spec._worth_drafting = lambda seqs, rnd, wanted: wanted

    engine, spec = run(target_fp32, tokenizer, prompts, setup, spec_method="hybrid", spec_policy="fixed")
    assert spec == plain
    by_req = {"0": [0, 0], "1": [0, 0]}  # [n-gram rounds, DSpark rounds]
    for rnd in seen:
        for rid, from_drafter, drafted in rnd:
            by_req[rid][from_drafter] += 1
    # measured {'0': [1, 29], '1': [5, 20]}: on the repetition the drafter's own record beats the n-gram's
    assert sum(v[0] for v in by_req.values()) >= 3 and sum(v[1] for v in by_req.values()) >= 20, by_req
    assert engine.spec_steps > 0


def test_lazy_commit_batches_the_draft_context(target_fp32, tokenizer, prompts):
    """Plain steps (gate forced) run no drafter-context call; the next drafting step commits
    every queued position in one call, and the output is still plain decoding's."""
    _, plain = run(target_fp32, tokenizer, prompts[1:])
    calls = []

    class EveryFourth:
        n = 0

        def speculate(self, num_seqs):
            self.n += 1
            return self.n % 4 == 0

        def record(self, *a):
            pass

    def setup(engine):
        engine.gate = EveryFourth()
        spec = engine.speculator
        extend = spec.extend_context

        def spy(taps, slots, counts):
            calls.append(list(counts))
            extend(taps, slots, counts)

        spec.extend_context = spy

    engine, spec = run(target_fp32, tokenizer, prompts[1:], setup, spec_method="dspark", spec_policy="fixed")
    assert spec == plain
    decode_calls = calls[1:]  # the first commits the prompt (prefill)
    assert len(decode_calls) <= engine.spec_steps + 1  # one flush per drafting step (+ none at the end)
    assert max(c[0] for c in decode_calls) >= 3  # three plain steps' positions in one call
    assert engine.gated_steps >= 3 * (engine.spec_steps - 1)


@pytest.mark.parametrize("bad", [dict(draft_checkpoint="no/such/dir"), dict(spec_method="nope"),
                                 dict(spec_policy="nope")])
def test_a_wrong_method_policy_or_checkpoint_is_a_start_up_error(target_fp32, tokenizer, bad, tmp_path):
    cfg = {"dtype": "float32", "max_batch_size": 1, "spec_method": "hybrid", **bad}
    words = {"draft_checkpoint": "SPARKGATE_DRAFT_CHECKPOINT", "spec_method": "spec_method", "spec_policy": "spec_policy"}
    with pytest.raises(ValueError, match=words[next(iter(bad))]):
        LLMEngine(EngineConfig(**cfg), lambda rid, ev: None, model=target_fp32, tokenizer=tokenizer)


def copying(tokenizer) -> list[int]:
    """A chat prompt whose reply copies a passage of it (n-gram drafts at any temperature)."""
    return chat_ids(tokenizer, "Repeat this text exactly, word for word: The quick brown fox jumps over the lazy dog. "
                               "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.")


@pytest.mark.parametrize("dtype", ["float32", "gguf"])
def test_sampled_rounds_hand_each_draft_its_own_p_d(request, dtype, tokenizer, prompts):
    """T = 1, n-gram and DSpark drafts in the same rounds, on fp32 (every machine) and on the
    served ``gguf`` path (where its kernel runs): verification gets, for every verified draft
    token, the distribution it was drawn from — one-hot on the n-gram token, the drafter's p_d
    (positive at the token, zero off the draft vocabulary) for DSpark — in request order. A
    misaligned row would bias every sampled reply (speculative sampling is exact only under the
    p_d the token came from). Every batch pairs two requests that copy their prompt (n-gram
    drafts whatever the kernels sample) with two that do not (DSpark drafts); the budget reads
    the committed SPS table, never this machine's cached profile or live timings."""
    import runtime.engine.llm_engine as llm_engine

    if dtype == "gguf":
        request.getfixturevalue("gguf_kernel")
    model = request.getfixturevalue("target_gguf" if dtype == "gguf" else "target_fp32")

    checked = {"ngram": 0, "dspark": 0, "mixed_rounds": 0}
    proposals = []
    real = llm_engine.spec_round

    def spy(logits, draft_probs, draft_tokens, lengths, *args, **kw):
        prop = proposals[-1]
        row = 0
        for i, ell in enumerate(lengths):
            for k in range(ell):
                p, x = draft_probs[row], int(draft_tokens[row])
                assert x == prop.tokens[i][k]
                if prop.from_drafter[i]:
                    assert p[x] > 0 and abs(float(p.sum()) - 1) < 1e-4
                    checked["dspark"] += 1
                else:
                    assert p[x] == 1.0 and float(p.sum()) == 1.0
                    checked["ngram"] += 1
                row += 1
        kinds = {d for d, ell in zip(prop.from_drafter, lengths) if ell}
        checked["mixed_rounds"] += len(kinds) == 2
        return real(logits, draft_probs, draft_tokens, lengths, *args, **kw)

    events: dict[str, list] = {}
    engine = LLMEngine(EngineConfig(dtype=dtype, max_batch_size=4, max_context=1024, spec_method="hybrid",
                                    spec_policy="fixed", sps_table_path=str(SPS_TABLE), request_timeout_s=3600.0),
                       lambda rid, ev: events.setdefault(rid, []).append(ev), model=model, tokenizer=tokenizer)
    engine.speculator.live_cost = None
    propose = engine.speculator.propose

    def keep(*a, **kw):
        out = propose(*a, **kw)
        if out is not None:
            proposals.append(out)
        return out

    engine.speculator.propose = keep
    # every request that prefers a DSpark draft gets one (the cost check is timing-driven, so not reproducible)
    engine.speculator._worth_drafting = lambda seqs, rnd, wanted: wanted
    gens = iter(range(100, 200))  # unseeded requests (standard verification) with fixed generator seeds
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llm_engine, "spec_round", spy)
        mp.setattr(llm_engine, "request_generator", lambda sampling: torch.Generator().manual_seed(next(gens)))
        copy = copying(tokenizer)
        for i, ids in enumerate([prompts[0], copy, prompts[1], copy] * 2):
            engine.add_request(GenerationRequest(str(i), ids, SamplingParams(temperature=1.0, max_tokens=48)))
        while engine.has_work():
            engine.step()
    print(checked)  # measured on fp32: 222 n-gram, 289 DSpark drafts, 16 mixed rounds
    assert checked["ngram"] >= 30 and checked["dspark"] >= 200 and checked["mixed_rounds"] >= 8, checked


@pytest.mark.parametrize("draft_seconds,drafts", [(1.0, False), (0.0, True)])
def test_a_draft_that_cannot_pay_for_itself_is_not_drafted(target_fp32, tokenizer, prompts, monkeypatch,
                                                            draft_seconds, drafts):
    """The pre-draft budget (Speculator._worth_drafting): with a drafting cost of a whole second
    per request no DSpark draft is ever made (and the text is plain decoding's); with a free draft
    and flat round times every request that prefers DSpark is drafted."""
    from runtime.speculation.sps import SpsTable

    monkeypatch.setattr(sp_mod, "DRAFT_COST_ALPHA", 0.0)  # the cost stays what the test sets
    calls = []

    def setup(engine):
        spec = engine.speculator
        spec.draft_seconds, spec._drafts_timed = draft_seconds, 10**9
        spec.sps_table = spec.sps_table_greedy = SpsTable([1, 64], [1024], [[100.0, 100.0]], note="test: flat")
        spec.live_cost = None  # round times stay what the table says
        draft = spec.draft
        spec.draft = lambda *a: calls.append(len(a[1])) or draft(*a)

    _, plain = run(target_fp32, tokenizer, prompts[1:])
    engine, spec = run(target_fp32, tokenizer, prompts[1:], setup, spec_method="hybrid", spec_policy="dspark-sla")
    assert spec == plain
    assert (len(calls) > 10) if drafts else calls == [], calls


@pytest.mark.parametrize("policy", ["dspark", "dspark-sla", "fixed"])
def test_a_round_is_plain_exactly_when_the_budget_would_verify_no_ngram_draft(policy):
    """hybrid without a DSpark draft this round (Speculator._ngram_admitted): the round proposes
    nothing — a plain step, no p_d rows — exactly when the schedule over its n-gram drafts would
    give every request ℓ = 0 (Alg. 1's first comparison); ``fixed`` verifies any n-gram draft.
    Random rounds: 1–8 requests, SLA weights (``dspark-sla``; 1 under the other policies, as
    ``Speculator._round`` builds them), n-gram drafts with c_1 in [0, 1], round times
    whose extra row costs 2–40 % of a step."""
    from types import SimpleNamespace

    from runtime.speculation.budget import schedule
    from runtime.speculation.sps import SpsTable

    rng = random.Random(policy)
    outcomes = []
    for trial in range(400):
        n = rng.randint(1, 8)
        step, row = 0.006, 0.006 * rng.uniform(0.02, 0.4)
        rows = list(range(1, 41))
        table = SpsTable(rows, [1024], [[1.0 / (step + row * (b - 1)) for b in rows]])
        ngrams = [([7] * rng.randint(1, 4), rng.randint(1, 5)) if rng.random() < 0.6 else ([], 0) for _ in range(n)]
        c1 = [rng.random() if toks else 0.0 for toks, _ in ngrams]
        weights = [rng.choice([1.0, 1.0, 1.7, 3.0]) if policy == "dspark-sla" else 1.0 for _ in range(n)]  # as _round
        rnd = sp_mod._Round(sampling=None, weights=weights, context_len=300.0, table=table, ngrams=ngrams,
                            ngram_c1=c1)
        conf = [[c] + [0.9] * (len(toks) - 1) if toks else [] for (toks, _), c in zip(ngrams, c1)]
        plan = schedule(policy, conf, table, weights=weights, context_len=300.0)
        admitted = sp_mod.Speculator._ngram_admitted(SimpleNamespace(policy=policy), rnd)
        assert admitted == any(plan.lengths), (trial, ngrams, c1, weights, plan.lengths)
        outcomes.append(admitted)
    assert outcomes.count(True) > 20 and outcomes.count(False) > 20  # both answers occur


def test_a_request_that_dspark_cannot_pay_for_gets_no_drafter_context(target_fp32, tokenizer):
    """hybrid at admission: beside a batch where even the engine's prior acceptance cannot pay
    for a drafted row, the new request gets no drafter context (its prompt's is never computed);
    alone, or with an SLA target (its weight may exceed 1), it keeps it."""
    from types import SimpleNamespace

    from runtime.speculation.sps import SpsTable

    engine = LLMEngine(EngineConfig(dtype="float32", max_batch_size=4, max_context=256, spec_method="hybrid"),
                       lambda rid, ev: None, model=target_fp32, tokenizer=tokenizer)
    spec = engine.speculator
    spec.live_cost = None
    # rows nearly free up to 2, then each verified row costs as much as the whole round before it
    spec.sps_table = spec.sps_table_greedy = SpsTable([1, 2, 3, 4, 8], [1024], [[100.0, 99.0, 50.0, 25.0, 12.5]],
                                                      enforce_throughput=False)
    spec.draft_seconds = 0.0

    def seq(target=None):
        return SimpleNamespace(request=SimpleNamespace(sla_target_tokens_per_s=target,
                                                       sampling=SimpleNamespace(temperature=0.0)), num_prompt=100)

    spec.start_sequence(0, 0, seq(), batch=0)
    assert spec.has_context(0)
    spec.start_sequence(1, 0, seq(), batch=2)  # a 4th row would double the round: 0.4 tokens cannot pay
    assert not spec.has_context(1) and spec.dcache.lengths[1] == 0
    spec.start_sequence(2, 0, seq(target=50.0), batch=2)
    assert spec.has_context(2)
    spec.extend_context(torch.zeros(5, len(spec.tap_layers), target_fp32.cfg.hidden_size), [0, 1], [3, 2])
    assert (spec.dcache.lengths[0], spec.dcache.lengths[1]) == (3, 0)  # the context-less slot is skipped
    spec.release(1, keep_context=True)
    spec.start_sequence(1, 0, seq(), batch=0)
    assert spec.has_context(1)
