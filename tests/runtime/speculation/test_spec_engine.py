"""Speculative decoding inside the engine: lossless at T=0, exact stop/EOS/max_tokens handling
on accepted blocks, and honest per-request stats (the bug classes in docs/dspark-notes)."""

from __future__ import annotations

import copy

import pytest
import torch

from runtime.config import EngineConfig, cpu_has_native_bf16
from training.evaluate import first_turns
from runtime.engine.llm_engine import LLMEngine
from runtime.interface import FinishReason, GenerationRequest, SamplingParams, TextDelta
from runtime.speculation.sps import SpsTable
from runtime.engine.sequence import SeqStatus

pytestmark = pytest.mark.model

def eval_prompts(n: int) -> list[str]:
    """The first ⌈n/3⌉ first turns of the shipped mt-bench, gsm8k and humaneval (data/eval)."""
    return [t for name in ("mt-bench", "gsm8k", "humaneval") for t in first_turns(name)[: (n + 2) // 3]][:n]


def chat_ids(tokenizer, text):
    s = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(s, add_special_tokens=False)


def run(model, tokenizer, prompts, sampling, setup=None, **cfg):
    """Run ``prompts`` to completion; ``setup(engine)`` (optional) runs before the first step."""
    events: dict[str, list] = {}
    engine = LLMEngine(
        EngineConfig(**{"dtype": "float32", "max_batch_size": len(prompts), "max_context": 1024,
                       "request_timeout_s": 3600.0, **cfg}),  # a loaded CPU must not time the batch out
        lambda rid, ev: events.setdefault(rid, []).append(ev),
        model=model,
        tokenizer=tokenizer,
    )
    if setup is not None:
        setup(engine)
    for i, ids in enumerate(prompts):
        engine.add_request(GenerationRequest(str(i), ids, sampling))
    while engine.has_work():
        engine.step()
    tokens = {k: [t for e in v if isinstance(e, TextDelta) for t in e.token_ids] for k, v in events.items()}
    texts = {k: "".join(e.text for e in v if isinstance(e, TextDelta)) for k, v in events.items()}
    finals = {k: v[-1] for k, v in events.items()}
    return engine, tokens, texts, finals


@pytest.fixture(scope="module")
def prompts20(tokenizer):
    return [chat_ids(tokenizer, p) for p in eval_prompts(21)[:21]]


@pytest.fixture(scope="module")
def ar_greedy(target_fp32, tokenizer, prompts20):
    return run(target_fp32, tokenizer, prompts20, SamplingParams(temperature=0, max_tokens=40))


@pytest.mark.parametrize(
    "method,policy",
    # dspark (fixed, dspark-sla), parallel and prompt_lookup are checked against AR at fp32 T = 0 with
    # the gate off (every round drafts) in tests/runtime/test_golden_outputs.py; hybrid's stats
    # depend on measured drafting times, so it is not in the golden file and is checked here.
    [("hybrid", "dspark-sla")],
)
def test_t0_speculative_equals_autoregressive_fp32(target_fp32, tokenizer, prompts20, ar_greedy, method, policy):
    """The committed drafters (DSpark, its rank-0 ablation) and prompt lookup: speculation
    never changes greedy output."""
    _, ar_tokens, _, _ = ar_greedy
    engine, tokens, _, finals = run(
        target_fp32, tokenizer, prompts20, SamplingParams(temperature=0, max_tokens=40), spec_method=method, spec_policy=policy
    )
    assert len(tokens) == 21
    for k in ar_tokens:
        assert tokens[k] == ar_tokens[k], f"prompt {k} diverged"
        st = finals[k].spec
        assert st.rounds >= 1 and st.emitted == finals[k].completion_tokens - 1  # first token came from prefill
        assert st.accepted <= st.verified <= st.drafted
        assert sum(st.accepted_per_position) == st.accepted


class ForcedGate:
    """Stand-in for :class:`runtime.speculation.gate.SpecGate`: ``decide(k)`` for the k-th
    decision (1-based); measurements are ignored."""

    def __init__(self, decide):
        self.decide = decide
        self.calls = 0
        self.last: bool | None = None  # the latest decision

    def speculate(self, num_seqs: int) -> bool:
        self.calls += 1
        self.last = self.decide(self.calls)
        return self.last

    def record(self, *args) -> None:
        pass


def check_draft_context_every_step(engine):
    """After every step, each decoding sequence's drafter context plus its queued positions
    (lazy commit) hold exactly its target-cached positions (the speculator invariant),
    whichever mode the step ran; whenever the drafter drafts a slot, nothing of it is queued."""
    step = engine.step
    spec = engine.speculator
    draft = spec.draft

    def checked_step():
        step()
        for seq in engine.scheduler.running:
            if seq.status is SeqStatus.DECODE:
                assert spec.dcache.lengths[seq.slot] + spec.queued(seq.slot) == seq.num_cached

    def checked_draft(anchors, slots, sampling):
        assert all(spec.queued(s) == 0 for s in slots)
        return draft(anchors, slots, sampling)

    engine.step = checked_step
    spec.draft = checked_draft


def test_gate_forced_to_ar_equals_ar_and_verifies_no_drafts(target_fp32, tokenizer, prompts20, ar_greedy):
    _, ar_tokens, _, _ = ar_greedy

    def setup(engine):
        engine.gate = ForcedGate(lambda k: False)
        engine.speculator.propose = None  # drafting must not even be attempted
        check_draft_context_every_step(engine)

    engine, tokens, _, finals = run(target_fp32, tokenizer, prompts20, SamplingParams(temperature=0, max_tokens=40),
                                    setup=setup, spec_method="dspark", spec_policy="fixed")
    assert tokens == ar_tokens
    assert engine.spec_steps == 0 and engine.gated_steps == engine.decode_steps > 0
    assert engine.verify_tokens == sum(f.completion_tokens - 1 for f in finals.values())  # anchors only
    for f in finals.values():
        st = f.spec
        assert st.drafted == st.verified == st.accepted == 0 and sum(st.accepted_per_position) == 0
        assert st.rounds == st.gated_rounds == st.emitted == f.completion_tokens - 1 and st.tau == 1.0


def test_gate_alternating_modes_keeps_drafting_correct(target_fp32, tokenizer, prompts20, ar_greedy):
    """AR steps between speculative ones still commit the target's taps to the drafter's
    context: the invariant holds after every step, and the trained drafter's drafts keep
    getting accepted after AR steps."""
    _, ar_tokens, _, _ = ar_greedy
    prompts = prompts20[:6]

    def setup(engine):
        engine.gate = ForcedGate(lambda k: k % 3 == 0)  # AR, AR, speculate, …
        engine.speculator.predraft = False  # the forced gate is the whole decision: every "speculate" drafts
        check_draft_context_every_step(engine)

    engine, tokens, _, finals = run(target_fp32, tokenizer, prompts, SamplingParams(temperature=0, max_tokens=40),
                                    setup=setup, spec_method="dspark", spec_policy="fixed")
    assert all(tokens[k] == ar_tokens[k] for k in tokens)
    assert engine.spec_steps > 0 and engine.gated_steps > engine.spec_steps
    assert engine.spec_steps + engine.gated_steps == engine.decode_steps
    assert sum(f.spec.accepted for f in finals.values()) > 0
    for f in finals.values():
        st = f.spec
        assert st.emitted == f.completion_tokens - 1 and 0 < st.gated_rounds < st.rounds
        assert st.drafted <= 7 * (st.rounds - st.gated_rounds)


def test_gate_on_is_lossless_and_its_counters_add_up(target_fp32, tokenizer, prompts20, ar_greedy):
    """The real gate (timing-driven; prompt lookup's — ``dspark`` and ``hybrid`` decide inside
    their budget instead): T = 0 output equals AR in fp32, and every forward with decoding
    sequences is counted once, as speculative or as gated."""
    _, ar_tokens, _, _ = ar_greedy
    decode_forwards = []

    def setup(engine):
        assert engine.gate is not None  # on by default
        schedule = engine.scheduler.schedule

        def counted(*args, **kwargs):
            plan = schedule(*args, **kwargs)
            decode_forwards.append(bool(plan.decode))
            return plan

        engine.scheduler.schedule = counted

    engine, tokens, _, finals = run(target_fp32, tokenizer, prompts20, SamplingParams(temperature=0, max_tokens=40),
                                    setup=setup, spec_method="prompt_lookup")
    assert tokens == ar_tokens
    n = sum(decode_forwards)
    assert engine.spec_steps + engine.gated_steps == engine.decode_steps == n > 0
    # warm-up runs each mode in the buckets it measures, whichever wins
    assert engine.spec_steps >= 2 and engine.gated_steps >= 2
    snap = engine.gate.snapshot()
    assert any(b["spec"]["n"] and b["ar"]["n"] for b in snap.values()), snap
    for f in finals.values():
        st = f.spec
        assert st.emitted == f.completion_tokens - 1 and st.gated_rounds <= st.rounds
        assert st.accepted <= st.verified <= st.drafted


def sps_affine(t0: float, c: float) -> SpsTable:
    """An SPS table with round time ``t0 + c·B`` seconds (B = verified tokens): the scheduler
    admits a draft while its weighted survival w·a beats about ``Σ_r w_r·τ_r · c / (t0 + c·B)``."""
    buckets = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    return SpsTable(buckets, [512], [[1.0 / (t0 + c * b) for b in buckets]], note="test: affine round time")


@pytest.mark.parametrize("row_cost", [1.0, 0.25])
def test_dspark_decides_before_drafting_inside_its_budget(target_fp32, tokenizer, prompts20, ar_greedy, row_cost):
    """``dspark`` with ``spec_gate`` on (the default) runs no speculation gate: each round,
    before anything is drafted, the budget's ℓ = 0 case (``Speculator._worth_drafting``,
    issue 28 items 2–3) drafts only the requests whose draft raises expected tokens per
    second — w_r·ĝ_r (SLA weight × drafts accepted per drafted round, prior 0.43 over 1.08
    verified rows at T = 0) against the SPS table's next rows and the drafting time. Three
    requests, the first with an SLA target no request reaches (weight ≈ 4 once its speed is
    measured), the others best effort:

    * a verified row costs a whole round: nobody is ever drafted (the drafter is not called);
    * a row costs 0.25 of a round: only the gold request is drafted (4·0.43 / 6 against
      1.08·0.25 / 1.5 of a round, + drafting); a best-effort 0.43 / 6 never is, nor anyone
      while every weight is still 1 (0.43 / 3 < 0.18).

    Either way the T = 0 text equals plain decoding's and the counters add up."""
    _, ar_tokens, _, _ = ar_greedy
    events: dict[str, list] = {}
    engine = LLMEngine(EngineConfig(dtype="float32", max_batch_size=3, max_context=1024, request_timeout_s=3600.0,
                                    spec_method="dspark", spec_policy="dspark-sla"),
                       lambda rid, ev: events.setdefault(rid, []).append(ev), model=target_fp32, tokenizer=tokenizer)
    sp = engine.speculator
    assert engine.gate is None and sp.decides_drafting
    # a one-row round takes 0.5 s (slow: drafting time is small beside it), each further row row_cost × that
    sp.sps_table = sp.sps_table_greedy = sps_affine(0.5 * (1.0 - row_cost), 0.5 * row_cost)
    sp.live_cost = None  # the choice follows the table, not this machine's round times
    check_draft_context_every_step(engine)
    drafted_slots = []
    draft = sp.draft

    def recorded(anchors, slots, sampling):
        drafted_slots.append(list(slots))
        return draft(anchors, slots, sampling)

    sp.draft = recorded
    for i, ids in enumerate(prompts20[:3]):
        engine.add_request(GenerationRequest(str(i), ids, SamplingParams(temperature=0, max_tokens=40),
                                             sla_target_tokens_per_s=1e6 if i == 0 else None))
    while engine.has_work():
        engine.step()
    tokens = {k: [t for e in v if isinstance(e, TextDelta) for t in e.token_ids] for k, v in events.items()}
    assert all(tokens[k] == ar_tokens[k] for k in tokens) and len(tokens) == 3
    stats = {k: v[-1].spec for k, v in events.items()}
    assert engine.spec_steps + engine.gated_steps == engine.decode_steps > 0
    for k, st in stats.items():
        assert st.accepted <= st.verified <= st.drafted and st.emitted == len(tokens[k]) - 1
    best_effort = [stats["1"], stats["2"]]
    assert all(st.drafted == st.verified == 0 for st in best_effort), best_effort
    if row_cost == 1.0:
        assert drafted_slots == [] and engine.spec_steps == 0 and stats["0"].drafted == 0
    else:
        assert drafted_slots and all(len(s) == 1 for s in drafted_slots)  # the gold request alone
        assert stats["0"].drafted == sp.gamma * (stats["0"].rounds - stats["0"].gated_rounds) > 0
        assert stats["0"].gated_rounds >= 1  # its first round: speed not yet measured, weight 1


class OracleProposer:
    """Test-only draft model that proposes the known greedy continuation, so every
    verified draft is accepted: exercises multi-token blocks through the stop/EOS/cap logic."""

    def __init__(self, continuation: dict[int, list[int]], prompt_len: dict[int, int]):
        self.continuation = continuation
        self.prompt_len = prompt_len

    def __call__(self, seqs):
        import runtime.speculation.speculator as sp
        from runtime.speculation.prompt_lookup import one_hot_probs

        tokens, drafted = [], []
        for s in seqs:
            cont = self.continuation[s.slot]
            done = len(s.token_ids) - self.prompt_len[s.slot]
            prop = cont[done : done + 7]
            drafted.append(len(prop))
            tokens.append(prop[: sp.Speculator._room(s)])
        lengths = [len(t) for t in tokens]
        flat = [t for ts in tokens for t in ts]
        return sp.Proposal(lengths, drafted, tokens, one_hot_probs(flat, 49152), 7)


def oracle_run(model, tokenizer, ids, sampling, continuation):
    events: list = []
    engine = LLMEngine(
        # spec_gate off: every round drafts, so the oracle's blocks go through every step
        EngineConfig(dtype="float32", max_batch_size=1, max_context=1024, spec_method="prompt_lookup", spec_gate=False),
        lambda rid, ev: events.append(copy.deepcopy(ev)),  # as emitted: later mutation must not matter
        model=model,
        tokenizer=tokenizer,
    )
    engine.speculator._propose_ngram = OracleProposer({0: continuation}, {0: len(ids)})
    engine.add_request(GenerationRequest("o", ids, sampling))
    while engine.has_work():
        engine.step()
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    toks = [t for e in events if isinstance(e, TextDelta) for t in e.token_ids]
    return text, toks, events[-1]


@pytest.fixture(scope="module")
def greedy_continuation(target_fp32, tokenizer):
    ids = chat_ids(tokenizer, "What is the capital of France?")
    _, tokens, texts, finals = run(target_fp32, tokenizer, [ids], SamplingParams(temperature=0, max_tokens=40))
    return ids, tokens["0"], texts["0"], finals["0"]


def test_oracle_blocks_are_accepted_and_tau_counts_bonus(target_fp32, tokenizer, greedy_continuation):
    ids, ref_tokens, ref_text, ref_final = greedy_continuation
    text, toks, fin = oracle_run(target_fp32, tokenizer, ids, SamplingParams(temperature=0, max_tokens=40), ref_tokens)
    assert toks == ref_tokens and text == ref_text
    st = fin.spec
    assert st.accepted > 0.8 * st.verified  # the oracle is (almost) always right
    assert st.emitted == fin.completion_tokens - 1
    assert st.rounds < fin.completion_tokens / 3  # several tokens per target forward
    assert st.tau == pytest.approx(st.emitted / st.rounds)


def test_eos_inside_accepted_block_is_final(target_fp32, tokenizer, greedy_continuation):
    ids, ref_tokens, ref_text, ref_final = greedy_continuation
    assert ref_final.finish_reason is FinishReason.STOP and ref_tokens[-1] == 2  # the reply ends with EOS
    # The oracle proposes EOS followed by junk: nothing after EOS may be emitted or counted.
    junk = ref_tokens + [100, 101, 102, 103, 104, 105, 106]
    text, toks, fin = oracle_run(target_fp32, tokenizer, ids, SamplingParams(temperature=0, max_tokens=200), junk)
    assert toks == ref_tokens and text == ref_text
    assert fin.completion_tokens == len(ref_tokens)
    assert fin.spec.emitted == fin.completion_tokens - 1
    assert fin.spec.accepted <= fin.spec.emitted


def test_max_tokens_exact_under_speculation(target_fp32, tokenizer, greedy_continuation):
    ids, ref_tokens, _, _ = greedy_continuation
    for cap in (1, 2, 5, 7):
        text, toks, fin = oracle_run(target_fp32, tokenizer, ids, SamplingParams(temperature=0, max_tokens=cap), ref_tokens)
        assert fin.completion_tokens == cap and toks == ref_tokens[:cap]
        assert fin.finish_reason is FinishReason.LENGTH
        assert text == tokenizer.decode(ref_tokens[:cap], skip_special_tokens=True)


def test_stop_string_inside_accepted_block(target_fp32, tokenizer, greedy_continuation):
    ids, ref_tokens, ref_text, _ = greedy_continuation
    # pick a stop string from the middle of the reply; it lands inside a multi-token accepted block
    stop = "Paris"
    assert stop in ref_text
    text, toks, fin = oracle_run(target_fp32, tokenizer, ids, SamplingParams(temperature=0, max_tokens=40, stop=(stop,)), ref_tokens)
    assert text == ref_text[: ref_text.index(stop)]
    assert fin.finish_reason is FinishReason.STOP
    assert fin.completion_tokens < len(ref_tokens)
    assert fin.spec.emitted == fin.completion_tokens - 1


def test_sampling_tensors_built_once_per_step(target_fp32, tokenizer, monkeypatch):
    """Issue 26: a step turns each sequence's sampling parameters into tensors once, shared by
    the drafter and verification (and the first-token sampler after prefill), so the rows
    converted are one per decode round of each request plus one first token per request."""
    import runtime.engine.llm_engine
    import runtime.engine.sampler
    import runtime.speculation.speculator

    rows: list[int] = []
    real = runtime.engine.sampler.params_to_tensors
    for mod in (runtime.engine.sampler, runtime.engine.llm_engine, runtime.speculation.speculator):  # wherever the engine calls it from
        if hasattr(mod, "params_to_tensors"):
            monkeypatch.setattr(mod, "params_to_tensors", lambda params, *a, **kw: rows.append(len(params)) or real(params, *a, **kw))
    prompts = [chat_ids(tokenizer, t) for t in ("Name three colours.", "Count to five.", "Say hi.")]
    engine, _, _, finals = run(target_fp32, tokenizer, prompts, SamplingParams(temperature=0.8, seed=3, max_tokens=12),
                               spec_method="dspark", spec_policy="fixed", spec_gate=False)
    assert engine.spec_steps == engine.decode_steps > 0  # every decode round drafted, then verified
    assert sum(rows) == sum(f.spec.rounds for f in finals.values()) + len(prompts)


NEAR_TIE = 0.25  # fp32 logit units; see docs/benchmarks.md "bf16 divergences"


def test_t0_speculative_equals_autoregressive_gguf(target_gguf, tokenizer, prompts20, gguf_kernel):
    """gguf where its kernel runs: the served path is row-invariant (a token's logits do not
    depend on the verification width nor on the other requests in the step,
    tests/runtime/kernels/test_row_invariance.py), so at T = 0 speculation gives AR's
    tokens exactly, like fp32 — and so does a request served alone instead of in a batch of 21."""
    model = target_gguf
    sp = SamplingParams(temperature=0, max_tokens=64)
    _, ar, _, _ = run(model, tokenizer, prompts20, sp, dtype="gguf")
    # hybrid with every draft verified: fused DSpark blocks and n-gram drafts both go through verification
    _, spec, _, _ = run(model, tokenizer, prompts20, sp, dtype="gguf", spec_method="hybrid", spec_policy="fixed")
    assert len(ar) == len(spec) == 21
    assert [k for k in ar if spec[k] != ar[k]] == []
    for k in ("0", "10", "20"):
        _, alone, _, _ = run(model, tokenizer, [prompts20[int(k)]], sp, dtype="gguf")
        assert alone["0"] == ar[k], f"prompt {k} alone differs from its batch of 21"


def test_t0_speculative_equals_autoregressive_gguf_a8(model_dir, tokenizer, prompts20, gguf_kernel):
    """``dtype="gguf-a8"`` (int8 activations, quantised per row and 32-group): as row-invariant
    as gguf, so speculation at T = 0 (hybrid, every draft verified) gives AR's tokens exactly."""
    from runtime.kernels.cpu.gguf_cpu import Q4_1_A8
    from runtime.models.llama import load_llama

    model = load_llama(model_dir, "gguf-a8")
    assert model.serving_dtype == "gguf-a8" and model.layers[0].mlp.down_proj.qtype == Q4_1_A8
    sp = SamplingParams(temperature=0, max_tokens=48)
    _, ar, _, _ = run(model, tokenizer, prompts20[:8], sp, dtype="gguf-a8")
    _, spec, _, _ = run(model, tokenizer, prompts20[:8], sp, dtype="gguf-a8", spec_method="hybrid", spec_policy="fixed")
    assert len(ar) == len(spec) == 8
    assert [k for k in ar if spec[k] != ar[k]] == []


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_reduced_precision_divergences_only_at_near_ties(model_dir, target_fp32, tokenizer, prompts20, dtype):
    """bf16: speculative vs AR may differ only at a near-tie of the AR logits (gguf is exact
    where its kernel runs: the test above).

    The gap is measured on the fp32 logits at the AR prefix (bf16 logits themselves are
    quantised to 0.03–0.06 at this magnitude). The issue asked for < 0.05; bf16 noise
    through 30 layers reaches ~0.15 here (a different batch composition means other
    matmul shapes, so even the prefill row can round differently), so the bound is 0.25,
    the gaps are printed, and the test also checks that such near-ties are rare among all
    AR positions — so "divergences only at near-ties" is a real constraint.

    On a CPU without native bf16 (AVX2 only: oneDNN converts in software, a bf16 step ~3× an
    fp32 one) the first 8 of the 21 prompts: the whole set took 185 s of the suite there."""
    from runtime.models.llama import SeqSpan, load_llama

    if not cpu_has_native_bf16():
        prompts20 = prompts20[:8]
    model = load_llama(model_dir, torch.bfloat16)
    sp = SamplingParams(temperature=0, max_tokens=32)
    _, ar, _, _ = run(model, tokenizer, prompts20, sp, dtype=dtype)
    _, spec, _, _ = run(model, tokenizer, prompts20, sp, dtype=dtype, spec_method="dspark", spec_policy="fixed")
    gaps = []
    for k in ar:
        a, b = ar[k], spec[k]
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if i is None:
            continue
        ids = prompts20[int(k)] + a[:i]
        cache = target_fp32.new_cache(1, len(ids) + 1)
        s = cache.allocate()
        logits = target_fp32.forward(torch.tensor(ids), [SeqSpan(s, 0, len(ids))], cache, torch.tensor([len(ids) - 1])).logits[0]
        top2 = logits.topk(2).values
        gaps.append((k, i, round((top2[0] - top2[1]).item(), 4)))
    # How rare are near-ties? fp32 top-2 gaps at every AR position of every prompt.
    all_gaps = []
    for k in ar:
        ids = prompts20[int(k)] + ar[k]
        cache = target_fp32.new_cache(1, len(ids))
        s = cache.allocate()
        n0 = len(prompts20[int(k)]) - 1
        lg = target_fp32.forward(torch.tensor(ids), [SeqSpan(s, 0, len(ids))], cache, torch.arange(n0, len(ids) - 1)).logits
        t2 = lg.topk(2, dim=-1).values
        all_gaps += (t2[:, 0] - t2[:, 1]).tolist()
    frac = sum(g < NEAR_TIE for g in all_gaps) / len(all_gaps)
    print(f"fraction of AR positions with a near-tie (< {NEAR_TIE}): {frac:.3f} of {len(all_gaps)}")
    assert frac < 0.25  # a logic bug diverging at random positions would land on near-ties with p = frac per divergence
    print(f"{dtype} speculative vs AR divergences: {len(gaps)}/{len(ar)} prompts; (prompt, position, fp32 top-2 gap): {gaps}")
    assert all(g < NEAR_TIE for _, _, g in gaps), gaps
