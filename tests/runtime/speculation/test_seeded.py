"""Seeded sampling (issue 27): a request with a seed gets the same text whatever shares its
batch, whether its prompt came from the prefix cache, and with speculation on or off —
its token at output position i is the Gumbel-max draw keyed by (seed, i)
(runtime.engine.sampler.gumbel_argmax; runtime.speculation.verifier.verify_seeded)."""

from __future__ import annotations

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.engine.sampler import gumbel_argmax, warp_probs
from runtime.interface import GenerationRequest, SamplingParams, TextDelta
from runtime.speculation.verifier import spec_round, verify, verify_seeded
from tests.runtime.speculation.test_spec_engine import chat_ids, eval_prompts

pytestmark = pytest.mark.model

SEEDS = (1, 2024, 2**63 + 5)
MAX_TOKENS = 24


def generate(model, tokenizer, requests, passes=1, **cfg):
    """Texts of ``requests`` = [(name, prompt ids, SamplingParams)], all admitted at once;
    ``passes`` > 1 runs them again on the same engine (prefix-cache hits)."""
    texts: dict[str, str] = {}
    engine = LLMEngine(
        EngineConfig(**{"dtype": "float32", "max_batch_size": len(requests), "max_context": 1024,
                        "request_timeout_s": 3600.0, **cfg}),
        lambda rid, ev: texts.__setitem__(rid, texts.get(rid, "") + ev.text) if isinstance(ev, TextDelta) else None,
        model=model, tokenizer=tokenizer,
    )  # fmt: skip
    runs = []
    for p in range(passes):
        for name, ids, params in requests:
            engine.add_request(GenerationRequest(f"{p}:{name}", ids, params))
        while engine.has_work():
            engine.step()
        runs.append({name: texts.get(f"{p}:{name}", "") for name, _, _ in requests})
    return runs, engine


@pytest.fixture(scope="module")
def seeded(tokenizer):
    prompts = [chat_ids(tokenizer, p) for p in eval_prompts(5)]
    return [(f"p{i}s{s}", ids, SamplingParams(temperature=1.0, top_p=0.95 if i % 2 else 1.0, max_tokens=MAX_TOKENS, seed=s))
            for i, ids in enumerate(prompts) for s in SEEDS]


@pytest.fixture(scope="module")
def reference(target_fp32, tokenizer, seeded):
    """Plain decoding, the 15 seeded requests together, twice on one engine (2nd: cache hits)."""
    (first, second), engine = generate(target_fp32, tokenizer, seeded, passes=2)
    assert engine.prefix_cache is not None and engine.prefix_cache.hits > 0
    assert first == second
    return first


def test_seed_changes_the_text_and_texts_are_real(reference):
    assert all(len(t) > 10 for t in reference.values())
    # the seed matters: most (prompt, seed) pairs differ (a code prompt may agree across seeds)
    assert len(set(reference.values())) >= 12
    assert all(len({reference[f"p{i}s{s}"] for s in SEEDS}) >= 2 for i in range(5))


def test_same_text_solo(target_fp32, tokenizer, seeded, reference):
    for req in seeded[::6]:  # a sample of the 15, each alone in its engine
        (solo,), _ = generate(target_fp32, tokenizer, [req])
        assert solo[req[0]] == reference[req[0]], req[0]


def test_same_text_among_fifteen_other_requests(target_fp32, tokenizer, seeded, reference):
    others = [(f"o{i}", chat_ids(tokenizer, f"Write a short story about the number {i}."),
               SamplingParams(temperature=0.7 if i % 3 else 0.0, max_tokens=MAX_TOKENS + i, seed=None if i % 2 else i))
              for i in range(15)]
    (mixed,), _ = generate(target_fp32, tokenizer, others[:7] + seeded + others[7:])
    assert {k: mixed[k] for k in reference} == reference


@pytest.mark.parametrize("method", ["dspark", "prompt_lookup"])
def test_same_text_with_speculation(target_fp32, tokenizer, seeded, reference, method):
    (spec,), engine = generate(target_fp32, tokenizer, seeded, spec_method=method, spec_gate=False,
                               spec_policy="fixed", num_speculative_tokens=4)
    assert engine.spec_steps > 0
    assert spec == reference


def test_verify_seeded_accepts_a_draft_iff_it_is_the_seeded_draw():
    torch.manual_seed(0)
    V, lens = 50, [3, 0, 2]
    logits = torch.randn(sum(lens) + len(lens), V) * 2
    p_t = warp_probs(logits, torch.ones(len(logits)), torch.zeros(len(logits), dtype=torch.long), torch.ones(len(logits)))
    seeds, positions = [5, 6, 7], [10, 0, 3]
    rows = [(r, k) for r, n in enumerate(lens) for k in range(n + 1)]
    want = gumbel_argmax(p_t, [seeds[r] for r, _ in rows], [positions[r] + k for r, k in rows])
    # request 0 drafts its first two seeded tokens then a wrong one; request 2 both right
    drafts = torch.tensor([want[0], want[1], (want[2] + 1) % V, want[5], want[6]])
    res = verify_seeded(p_t, drafts, lens, seeds, positions)
    assert res.accepted.tolist() == [2, 0, 2]
    assert res.next_tokens.tolist() == [int(want[2]), int(want[4]), int(want[7])]


def test_mixed_round_leaves_unseeded_requests_to_rejection_sampling():
    """In one round, a seeded request takes the seeded mode, an unseeded one exactly what
    standard verification alone gives with the same generator."""
    torch.manual_seed(1)
    V, lens = 40, [2, 3]
    logits = torch.randn(sum(lens) + 2, V)
    p_d = torch.softmax(torch.randn(sum(lens), V), -1)
    drafts = torch.multinomial(p_d, 1).squeeze(-1)
    ones, zeros = torch.ones(2), torch.zeros(2, dtype=torch.long)
    res = spec_round(logits, p_d, drafts, lens, [0, 0], ones, zeros, ones,
                     [torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)],
                     seeds=[None, 9], positions=[0, 5])
    p_t = warp_probs(logits, torch.ones(len(logits)), torch.zeros(len(logits), dtype=torch.long), torch.ones(len(logits)))
    alone = verify(p_t[:3], p_d[:2], drafts[:2], [2], [torch.Generator().manual_seed(3)])
    seeded_alone = verify_seeded(p_t[3:], drafts[2:], [3], [9], [5])
    assert res.verify.accepted.tolist() == [int(alone.accepted[0]), int(seeded_alone.accepted[0])]
    assert res.verify.next_tokens.tolist() == [int(alone.next_tokens[0]), int(seeded_alone.next_tokens[0])]


def test_served_gguf_dtype_same_text_solo_batched_and_with_speculation(target_gguf, tokenizer, seeded, gguf_kernel):
    """The served dtype where its kernel runs: the gguf path is row-invariant
    (tests/runtime/kernels/test_row_invariance.py), so a seeded reply is the same alone,
    among 15 other requests, from the prefix cache, and under the hybrid proposer (DSpark's fused
    drafter and prompt lookup; drafts only change how many tokens a round accepts)."""
    model = target_gguf
    (batched, cached), _ = generate(model, tokenizer, seeded, passes=2, dtype="gguf")
    assert cached == batched
    # hybrid with every draft verified: fused DSpark blocks and n-gram drafts in the same rounds
    (spec,), engine = generate(model, tokenizer, seeded, dtype="gguf", spec_method="hybrid",
                               spec_policy="fixed", num_speculative_tokens=4)
    assert engine.spec_steps > 0 and engine.speculator.fast is not None
    assert spec == batched
    others = [(f"o{i}", chat_ids(tokenizer, f"List {i + 3} fruits."), SamplingParams(temperature=0.9, max_tokens=MAX_TOKENS))
              for i in range(15)]
    (mixed,), _ = generate(model, tokenizer, others + seeded, dtype="gguf")
    assert {k: mixed[k] for k in batched} == batched
    for req in seeded[::7]:
        (solo,), _ = generate(model, tokenizer, [req], dtype="gguf")
        assert solo[req[0]] == batched[req[0]], req[0]
