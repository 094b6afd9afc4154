"""Logprobs from the engine on the real model (fp32): the raw target distribution
(log_softmax of the target logits, before temperature/top-k/top-p) of the row that
produced each emitted token — checked against a separate full forward, and equal
with and without speculation, also when a stop string / max_tokens / EOS cuts an
accepted block."""

from __future__ import annotations

import copy

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.interface import Failed, Finished, FinishReason, GenerationRequest, SamplingParams, TextDelta
from runtime.models.llama import SeqSpan
from tests.runtime.speculation.test_spec_engine import OracleProposer, chat_ids

pytestmark = pytest.mark.model

TOL = 1e-4  # fp32: a different batch layout moves logits by ~1e-5
PROMPTS = ("What is the capital of France?", "Write a haiku about autumn leaves.", "List three prime numbers.")


def run(model, tokenizer, reqs, oracle=None, **cfg):
    """Run ``reqs`` [(id, prompt ids, SamplingParams)] to the end; events as emitted."""
    events: dict[str, list] = {}
    engine = LLMEngine(
        EngineConfig(**{"dtype": "float32", "max_batch_size": len(reqs), "max_context": 1024, **cfg}),
        lambda rid, ev: events.setdefault(rid, []).append(copy.deepcopy(ev)),
        model=model,
        tokenizer=tokenizer,
    )
    if oracle is not None:
        engine.speculator._propose_ngram = oracle
    for rid, ids, sp in reqs:
        engine.add_request(GenerationRequest(rid, ids, sp))
    while engine.has_work():
        engine.step()
    return events


def deltas(events):
    return [e for e in events if isinstance(e, TextDelta)]


def tokens_and_logprobs(events):
    ds = deltas(events)
    toks = [t for d in ds for t in d.token_ids]
    lps = [lp for d in ds if d.logprobs is not None for lp in d.logprobs]
    return toks, lps


def reference_logprobs(model, prompt, completion):
    """log_softmax of ONE separate full forward of prompt + completion: row j is the
    distribution of completion token j (fp32 ``[len(completion), V]``)."""
    ids = prompt + completion
    cache = model.new_cache(1, len(ids))
    slot = cache.allocate()
    rows = torch.arange(len(prompt) - 1, len(ids) - 1)
    logits = model.forward(torch.tensor(ids), [SeqSpan(slot, 0, len(ids))], cache, rows).logits
    return torch.log_softmax(logits.float(), dim=-1)


def assert_matches_reference(lps, completion, ref, num_top, greedy):
    assert [e.token_id for e in lps] == completion  # aligned 1:1 with the kept tokens
    for j, e in enumerate(lps):
        row = ref[j]
        assert abs(e.logprob - row[e.token_id].item()) <= TOL, (j, e.logprob, row[e.token_id].item())
        if greedy:
            assert abs(e.logprob - row.max().item()) <= TOL  # T=0 emits the row's argmax
        assert len(e.top) == num_top
        ids = [t for t, _ in e.top]
        vals = [v for _, v in e.top]
        assert vals == sorted(vals, reverse=True)
        if num_top:
            ref_vals, ref_ids = row.topk(num_top)
            assert torch.allclose(torch.tensor(vals), ref_vals, atol=TOL, rtol=0)
            assert torch.allclose(row[ids], torch.tensor(vals), atol=TOL, rtol=0)  # each id has its value
            for k, (a, b) in enumerate(zip(ids, ref_ids.tolist())):
                if a != b:  # only possible at a near-tie of the reference
                    near = [abs(ref_vals[k] - ref_vals[m]).item() for m in (k - 1, k + 1) if 0 <= m < num_top]
                    assert min(near) < TOL, (j, k, ids, ref_ids.tolist())


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [chat_ids(tokenizer, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def ar(target_fp32, tokenizer, prompts):
    """AR greedy, 3 requests with 0 / 5 / 20 alternatives, plus one without logprobs."""
    tops = (0, 5, 20)
    reqs = [(str(i), ids, SamplingParams(temperature=0, max_tokens=32, logprobs=n)) for i, (ids, n) in
            enumerate(zip(prompts, tops))]
    reqs.append(("plain", prompts[0], SamplingParams(temperature=0, max_tokens=32)))
    return run(target_fp32, tokenizer, reqs), tops


def test_t0_logprobs_equal_a_separate_full_forward(target_fp32, prompts, ar):
    events, tops = ar
    for i, (ids, n) in enumerate(zip(prompts, tops)):
        toks, lps = tokens_and_logprobs(events[str(i)])
        fin = events[str(i)][-1]
        assert isinstance(fin, Finished) and len(lps) == fin.completion_tokens == len(toks) > 5
        assert all(d.logprobs is not None and len(d.logprobs) == len(d.token_ids) for d in deltas(events[str(i)])
                   if d.token_ids)
        assert_matches_reference(lps, toks, reference_logprobs(target_fp32, ids, toks), n, greedy=True)
    # a request that did not ask gets none, and batching with it changed nothing
    assert all(d.logprobs is None for d in deltas(events["plain"]))
    assert tokens_and_logprobs(events["plain"])[0] == tokens_and_logprobs(events["0"])[0]


def test_logprobs_are_raw_target_not_the_warped_sampling_distribution(target_fp32, tokenizer, prompts):
    """Sampled at T=0.7 / top-k 5 / top-p 0.9: the values are still log_softmax of the raw
    logits (a warped distribution would put −inf outside the top 5 and differ inside)."""
    sp = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=7, max_tokens=24, logprobs=8)
    events = run(target_fp32, tokenizer, [("s", prompts[1], sp)])
    toks, lps = tokens_and_logprobs(events["s"])
    assert len(lps) == len(toks) > 5
    assert_matches_reference(lps, toks, reference_logprobs(target_fp32, prompts[1], toks), 8, greedy=False)


def test_no_logprobs_no_work(target_fp32, tokenizer, prompts, monkeypatch):
    """Requests that do not ask never reach the logprob computation."""
    import runtime.engine.llm_engine as eng

    def boom(*a, **k):
        raise AssertionError("token_logprobs called for a request without logprobs")

    monkeypatch.setattr(eng, "token_logprobs", boom)
    events = run(target_fp32, tokenizer, [("p", prompts[0], SamplingParams(temperature=0, max_tokens=6))],
                 spec_method="prompt_lookup", spec_policy="fixed")
    assert isinstance(events["p"][-1], Finished) and events["p"][-1].completion_tokens == 6


def test_out_of_range_logprobs_fail_cleanly(target_fp32, tokenizer, prompts):
    events = run(target_fp32, tokenizer, [("x", prompts[0], SamplingParams(logprobs=21))])
    assert isinstance(events["x"][-1], Failed) and events["x"][-1].code == "invalid_request"


@pytest.mark.parametrize("method", ["prompt_lookup", "dspark"])
def test_speculation_gives_the_same_logprobs(target_fp32, tokenizer, prompts, ar, method):
    """Random-init drafter / n-gram drafts, fixed policy: same tokens and logprobs as AR."""
    ar_events, tops = ar
    reqs = [(str(i), ids, SamplingParams(temperature=0, max_tokens=32, logprobs=n)) for i, (ids, n) in
            enumerate(zip(prompts, tops))]
    events = run(target_fp32, tokenizer, reqs, spec_method=method, spec_policy="fixed")
    for i, n in enumerate(tops):
        want_toks, want = tokens_and_logprobs(ar_events[str(i)])
        toks, got = tokens_and_logprobs(events[str(i)])
        assert toks == want_toks and len(got) == len(want) == events[str(i)][-1].completion_tokens
        assert events[str(i)][-1].spec.rounds >= 1
        for a, b in zip(got, want):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= TOL
            assert len(a.top) == len(b.top) == n
            assert max((abs(x[1] - y[1]) for x, y in zip(a.top, b.top)), default=0.0) <= TOL


@pytest.fixture(scope="module")
def greedy_reply(target_fp32, tokenizer, prompts):
    """The AR greedy reply to prompt 0 (ends with EOS) and its reference logprobs."""
    events = run(target_fp32, tokenizer, [("r", prompts[0], SamplingParams(temperature=0, max_tokens=60, logprobs=3))])
    toks, lps = tokens_and_logprobs(events["r"])
    assert toks[-1] == 2 and events["r"][-1].finish_reason is FinishReason.STOP
    return toks, lps, "".join(d.text for d in deltas(events["r"]))


def oracle_events(model, tokenizer, ids, sp, continuation):
    oracle = OracleProposer({0: continuation}, {0: len(ids)})  # every verified draft is accepted
    # spec_gate off: every round drafts, so the oracle's blocks go through every step
    return run(model, tokenizer, [("o", ids, sp)], oracle=oracle, spec_method="prompt_lookup", spec_gate=False)["o"]


@pytest.mark.parametrize("case", ["full", "stop", "max_tokens", "eos_then_junk"])
def test_accepted_blocks_cut_by_stop_eos_max_tokens(target_fp32, tokenizer, prompts, greedy_reply, case):
    """Multi-token accepted blocks (rows k ≥ 1 of a span) and the detokenizer's cuts:
    exactly one logprob per kept token, equal to the AR ones."""
    ref_toks, ref_lps, ref_text = greedy_reply
    cont, sp = ref_toks, SamplingParams(temperature=0, max_tokens=60, logprobs=3)
    if case == "stop":
        assert "Paris" in ref_text
        sp = SamplingParams(temperature=0, max_tokens=60, logprobs=3, stop=("Paris",))
    elif case == "max_tokens":
        sp = SamplingParams(temperature=0, max_tokens=6, logprobs=3)
    elif case == "eos_then_junk":
        cont = ref_toks + [100, 101, 102, 103, 104, 105]
    events = oracle_events(target_fp32, tokenizer, prompts[0], sp, cont)
    fin = events[-1]
    toks, lps = tokens_and_logprobs(events)
    assert isinstance(fin, Finished) and len(lps) == len(toks) == fin.completion_tokens
    assert fin.spec.accepted > 0 and fin.spec.rounds < fin.completion_tokens  # several tokens per round
    if case == "stop":
        assert fin.finish_reason is FinishReason.STOP and fin.completion_tokens < len(ref_toks)
    if case == "max_tokens":
        assert fin.finish_reason is FinishReason.LENGTH and fin.completion_tokens == 6
    if case in ("full", "eos_then_junk"):
        assert fin.completion_tokens == len(ref_toks)
    assert toks == ref_toks[: len(toks)]
    for a, b in zip(lps, ref_lps):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= TOL
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
