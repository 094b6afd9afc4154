"""Per-request timeout (issue: serving spine): a request past its deadline fails with
``Failed(code="timeout")`` and frees its KV slot; the others keep decoding.

The engine runs on an injected clock that only the test advances, so a forward that
takes seconds on a loaded machine cannot expire a deadline before the test means it to."""

from __future__ import annotations

import pytest

from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.interface import Failed, Finished, GenerationRequest, SamplingParams, TextDelta

pytestmark = pytest.mark.model


def engine_on_a_fake_clock(config, events, model, tokenizer):
    """An engine whose deadlines read ``now[0]`` (seconds); returns ``(engine, now)``."""
    now = [0.0]
    engine = LLMEngine(config, lambda rid, ev: events.setdefault(rid, []).append(ev), model=model,
                       tokenizer=tokenizer, clock=lambda: now[0])
    return engine, now


def test_request_past_its_deadline_fails_with_timeout_and_frees_its_slot(target_fp32, tokenizer):
    events: dict[str, list] = {}
    engine, now = engine_on_a_fake_clock(EngineConfig(dtype="float32", max_batch_size=2, max_context=256,
                                                      request_timeout_s=600), events, target_fp32, tokenizer)
    ids = tokenizer.encode("Tell me a long story about a dragon.")
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine.add_request(GenerationRequest("short", ids, sp, timeout_s=0.5))
    engine.add_request(GenerationRequest("long", ids, sp))  # engine default: 600 s
    for _ in range(3):  # prefill + 2 decode steps, however long they take: the clock stands at 0
        engine.step()
    emitted = sum(e.num_tokens for e in events["short"] if isinstance(e, TextDelta))
    assert emitted == 3 and not any(isinstance(e, Failed) for e in events["short"])
    now[0] = 0.6  # past the short request's deadline, far from the long one's
    while engine.has_work():
        engine.step()
    short, long = events["short"][-1], events["long"][-1]
    assert isinstance(short, Failed) and short.code == "timeout" and "timed out" in short.message
    assert short.completion_tokens == emitted  # failed at the first step after its deadline
    assert isinstance(long, Finished) and long.completion_tokens == 40
    assert engine.cache.num_free == 2 and engine.num_running == 0


def test_a_queued_request_times_out_too(target_fp32, tokenizer):
    events: dict[str, list] = {}
    engine, now = engine_on_a_fake_clock(EngineConfig(dtype="float32", max_batch_size=1, max_context=256),
                                         events, target_fp32, tokenizer)
    ids = tokenizer.encode("Hello there")
    engine.add_request(GenerationRequest("running", ids, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))
    engine.add_request(GenerationRequest("queued", ids, SamplingParams(temperature=0, max_tokens=6), timeout_s=0.01))
    now[0] = 0.05  # past the queued request's deadline before the engine ever ran it
    while engine.has_work():
        engine.step()
    assert isinstance(events["queued"][-1], Failed) and events["queued"][-1].code == "timeout"
    assert events["queued"][-1].completion_tokens == 0
    assert isinstance(events["running"][-1], Finished) and events["running"][-1].completion_tokens == 6
