"""The continuous-batching engine on the real model (fp32), driven synchronously."""

from __future__ import annotations

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.interface import Failed, Finished, FinishReason, GenerationRequest, SamplingParams, TextDelta

pytestmark = pytest.mark.model


class Collector:
    def __init__(self):
        self.events: dict[str, list] = {}

    def __call__(self, rid, ev):
        self.events.setdefault(rid, []).append(ev)

    def text(self, rid):
        return "".join(e.text for e in self.events[rid] if isinstance(e, TextDelta))

    def final(self, rid):
        return self.events[rid][-1]


def make_engine(target_fp32, tokenizer, **kw):
    col = Collector()
    cfg = EngineConfig(dtype="float32", **{"max_batch_size": 8, "max_context": 512, **kw})
    return LLMEngine(cfg, col, model=target_fp32, tokenizer=tokenizer), col


def chat_ids(tokenizer, text):
    s = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(s, add_special_tokens=False)


def run_all(engine, limit=2000):
    n = 0
    while engine.has_work():
        engine.step()
        n += 1
        assert n < limit
    return n


def hf_greedy(model_dir, ids, n):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_greedy_matches_transformers(target_fp32, tokenizer, model_dir):
    engine, col = make_engine(target_fp32, tokenizer)
    ids = chat_ids(tokenizer, "What is the capital of France?")
    engine.add_request(GenerationRequest("r1", ids, SamplingParams(temperature=0, max_tokens=20)))
    run_all(engine)
    fin = col.final("r1")
    assert isinstance(fin, Finished)
    got = [t for e in col.events["r1"] if isinstance(e, TextDelta) for t in e.token_ids]
    ref = hf_greedy(model_dir, ids, 20)
    assert got == ref[: len(got)]
    assert "Paris" in col.text("r1")
    assert fin.prompt_tokens == len(ids)
    assert fin.completion_tokens == len(got)


def test_batching_is_real_and_matches_alone(target_fp32, tokenizer):
    """8 concurrent 40-token requests: ≤ 56 forward steps, each text equal to its solo run."""
    prompts = [f"Write a short poem about the number {i}." for i in range(8)]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    solo = {}
    for i, p in enumerate(prompts[:3]):  # solo references for a few (time)
        engine, col = make_engine(target_fp32, tokenizer)
        engine.add_request(GenerationRequest(f"s{i}", chat_ids(tokenizer, p), sp))
        run_all(engine)
        solo[i] = col.text(f"s{i}")
    engine, col = make_engine(target_fp32, tokenizer)
    for i, p in enumerate(prompts):
        engine.add_request(GenerationRequest(f"b{i}", chat_ids(tokenizer, p), sp))
    steps = run_all(engine)
    assert engine.forward_steps == steps
    assert steps <= 56
    for i in range(8):
        assert col.final(f"b{i}").completion_tokens == 40
    for i, text in solo.items():
        assert col.text(f"b{i}") == text


def test_chunked_prefill_equals_single_shot(target_fp32, tokenizer):
    ids = chat_ids(tokenizer, "Explain why the sky is blue. " * 12)
    sp = SamplingParams(temperature=0, max_tokens=12)
    texts = []
    for chunk in (16, 512):
        engine, col = make_engine(target_fp32, tokenizer, prefill_chunk_tokens=chunk)
        engine.add_request(GenerationRequest("r", ids, sp))
        run_all(engine)
        texts.append(col.text("r"))
    assert texts[0] == texts[1] and texts[0]


def test_decode_keeps_flowing_during_long_prefill(target_fp32, tokenizer):
    engine, col = make_engine(target_fp32, tokenizer, prefill_chunk_tokens=16, max_step_tokens=32)
    engine.add_request(GenerationRequest("short", chat_ids(tokenizer, "Hi"), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)))
    for _ in range(3):
        engine.step()
    engine.add_request(GenerationRequest("long", chat_ids(tokenizer, "word " * 300), SamplingParams(temperature=0, max_tokens=2)))
    before = sum(e.num_tokens for e in col.events["short"] if isinstance(e, TextDelta))
    for _ in range(5):  # the long prompt needs ~20 chunks; the short stream gets a token every step
        engine.step()
    after = sum(e.num_tokens for e in col.events["short"] if isinstance(e, TextDelta))
    assert after - before == 5
    run_all(engine)


def test_abort_frees_slot_before_next_step(target_fp32, tokenizer):
    engine, col = make_engine(target_fp32, tokenizer)
    engine.add_request(GenerationRequest("a", chat_ids(tokenizer, "Count to 100"), SamplingParams(temperature=0, max_tokens=100)))
    engine.step()
    engine.step()
    assert engine.num_running == 1 and engine.cache.num_free == 7
    engine.abort("a")
    assert engine.num_running == 0 and engine.cache.num_free == 8
    assert col.final("a").finish_reason is FinishReason.ABORT


def test_seeded_sampling_is_reproducible_and_batch_independent(target_fp32, tokenizer):
    ids = chat_ids(tokenizer, "Tell me a story.")
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234)
    engine, col = make_engine(target_fp32, tokenizer)
    engine.add_request(GenerationRequest("alone", ids, sp))
    run_all(engine)
    engine, col2 = make_engine(target_fp32, tokenizer)
    engine.add_request(GenerationRequest("other", chat_ids(tokenizer, "Hello"), SamplingParams(temperature=1.0, max_tokens=16, seed=7)))
    engine.add_request(GenerationRequest("batched", ids, sp))
    run_all(engine)
    assert col.text("alone") == col2.text("batched")


def test_prompt_too_long_fails_cleanly(target_fp32, tokenizer):
    engine, col = make_engine(target_fp32, tokenizer, max_context=32)
    engine.add_request(GenerationRequest("x", list(range(100, 140)), SamplingParams(max_tokens=4)))
    assert isinstance(col.final("x"), Failed)
    assert not engine.has_work()


def test_step_failure_fails_only_that_step_and_engine_recovers(target_fp32, tokenizer, monkeypatch):
    engine, col = make_engine(target_fp32, tokenizer)
    engine.add_request(GenerationRequest("bad", chat_ids(tokenizer, "Hi"), SamplingParams(temperature=0, max_tokens=8)))
    real = engine.model.forward
    calls = {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real(*a, **k)

    monkeypatch.setattr(engine.model, "forward", flaky)
    engine.step()
    assert isinstance(col.final("bad"), Failed)
    assert engine.cache.num_free == 8
    engine.add_request(GenerationRequest("good", chat_ids(tokenizer, "Hi"), SamplingParams(temperature=0, max_tokens=8)))
    run_all(engine)
    assert isinstance(col.final("good"), Finished)
