"""Penalties, ``logit_bias``, ``min_tokens`` and ``min_p`` through the real engine (``gguf``,
the served dtype, row-invariant): the
text with speculation (prompt lookup, DSpark; every round drafts) is plain decoding's at
T = 0 and — seeded — at T = 1, in one ragged batch with a request that uses none; and the
same check has the power to catch processing the verification rows with the output only
(ignoring the draft prefix). The T = 1 law itself is tested on a synthetic model in
tests/runtime/engine/test_logits_processors.py."""

from __future__ import annotations

import dataclasses

import pytest

from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.engine.logits_processors import RequestProcessors
from runtime.interface import Finished, GenerationRequest, SamplingParams, TextDelta
from tests.runtime.speculation.test_spec_engine import chat_ids

pytestmark = pytest.mark.model

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def requests(tokenizer):
    """(name, prompt ids, params) at T = 0: each processor, and one request with none. The
    "hello" requests repeat "hello," — n-gram drafts accepted many at a time — until their
    frequency penalty makes "." win, at a count that depends on the draft prefix rows see."""
    the, a = tokenizer.encode(" the", add_special_tokens=False)[0], tokenizer.encode(" a", add_special_tokens=False)[0]
    comma = tokenizer.encode(",", add_special_tokens=False)[0]
    hello = chat_ids(tokenizer, "Repeat the word 'hello' 20 times.")
    days = chat_ids(tokenizer, "List the days of the week, then list them again.")
    story = chat_ids(tokenizer, "Write a short story about a robot who learns to paint.")
    yes = chat_ids(tokenizer, "Is the sky blue? Answer yes or no.")
    base = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return [
        *[(f"hello_f{f}", hello, dataclasses.replace(base, frequency_penalty=f, logit_bias=((comma, 1.0),)))
          for f in (0.35, 0.45, 0.6)],
        ("hello_rep", hello, dataclasses.replace(base, repetition_penalty=1.1, frequency_penalty=0.1)),
        ("freq", story, dataclasses.replace(base, frequency_penalty=0.8, presence_penalty=0.5)),
        ("rep", days, dataclasses.replace(base, repetition_penalty=1.3)),
        ("bias", story, dataclasses.replace(base, logit_bias=((the, -100.0), (a, 4.0)))),
        ("min", yes, dataclasses.replace(base, min_tokens=20, presence_penalty=0.3)),
        ("plain", days, base),
    ]


def generate(model, tokenizer, requests, **cfg):
    """``{name: (tokens, Finished)}`` of ``requests`` run together on one engine."""
    events: dict[str, list] = {}
    engine = LLMEngine(
        EngineConfig(**{"dtype": "gguf", "max_batch_size": len(requests), "max_context": 512,
                        "request_timeout_s": 3600.0, "num_speculative_tokens": 4, **cfg}),
        lambda rid, ev: events.setdefault(rid, []).append(ev), model=model, tokenizer=tokenizer,
    )  # fmt: skip
    for name, ids, params in requests:
        engine.add_request(GenerationRequest(name, ids, params))
    while engine.has_work():
        engine.step()
    return {k: ([t for e in v if isinstance(e, TextDelta) for t in e.token_ids], v[-1]) for k, v in events.items()}


SPEC = {"prompt_lookup": dict(spec_method="prompt_lookup", spec_policy="fixed", spec_gate=False),
        "dspark": dict(spec_method="dspark", spec_policy="fixed", spec_gate=False)}


@pytest.fixture(scope="module")
def model(target_gguf, gguf_kernel):
    return target_gguf


@pytest.fixture(scope="module")
def plain_t0(model, tokenizer, requests):
    return generate(model, tokenizer, requests)


def test_processors_change_the_text(model, tokenizer, plain_t0, requests):
    """Each parameter really acts (else the equalities below would prove little): every
    request's text differs from its twin's without processors; " the" is banned, EOS is held
    back for 20 tokens."""
    twins = generate(model, tokenizer, [
        (name, ids, dataclasses.replace(p, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                                        logit_bias=(), min_tokens=0)) for name, ids, p in requests])
    assert twins["plain"][0] == plain_t0["plain"][0]
    assert [name for name, _, _ in requests if twins[name][0] == plain_t0[name][0]] == ["plain"]
    the = tokenizer.encode(" the", add_special_tokens=False)[0]
    assert the in twins["bias"][0] and the not in plain_t0["bias"][0]
    short, held = twins["min"][0], plain_t0["min"][0]
    assert short[-1] == 2 and len(short) < 20 and 2 not in held[:20] and len(held) > 20, (short, held)


@pytest.mark.parametrize("method", list(SPEC))
def test_t0_speculative_equals_plain_with_processors(model, tokenizer, requests, plain_t0, method):
    spec = generate(model, tokenizer, requests, **SPEC[method])
    for name, _, _ in requests:
        assert spec[name][0] == plain_t0[name][0], f"{method}: {name} diverged"
        assert spec[name][1].finish_reason == plain_t0[name][1].finish_reason
    accepted = {name: spec[name][1].spec.accepted for name, _, _ in requests}
    print(f"\n{method}: accepted drafts per request {accepted}")
    hello = sum(v for k, v in accepted.items() if k.startswith("hello"))
    assert hello >= 15 and sum(accepted.values()) >= 35, accepted  # multi-row rounds were verified


def test_t0_check_catches_processing_rows_with_the_output_only(model, tokenizer, requests, plain_t0,
                                                               monkeypatch):
    real = RequestProcessors.apply

    def output_only(self, logits, output, drafts=()):
        for k in range(logits.shape[0]):
            real(self, logits[k : k + 1], output, ())

    monkeypatch.setattr(RequestProcessors, "apply", output_only)
    spec = generate(model, tokenizer, requests, **SPEC["prompt_lookup"])
    diverged = [name for name, _, _ in requests if spec[name][0] != plain_t0[name][0]]
    print(f"\noutput-only processing diverged on {diverged}")
    assert diverged and all(name.startswith("hello") for name in diverged), diverged


def test_seeded_t1_speculative_equals_plain_with_processors(model, tokenizer, requests):
    """Seeded requests draw the Gumbel-max token of (seed, position) from the processed, warped
    row, so speculation cannot change their text either (also with min_p and top-k). Prompt
    lookup only (DSpark's seeded drafting is the same verification: tests/runtime/speculation/test_seeded.py)."""
    method = "prompt_lookup"
    seeded = [(name, ids, dataclasses.replace(p, temperature=0.8, seed=100 + i, min_p=0.05 if i % 2 else 0.0,
                                              top_k=40 if i % 3 == 0 else 0))
              for i, (name, ids, p) in enumerate(requests)]
    plain = generate(model, tokenizer, seeded)
    spec = generate(model, tokenizer, seeded, **SPEC[method])
    assert {k: v[0] for k, v in spec.items()} == {k: v[0] for k, v in plain.items()}
    assert all(isinstance(v[1], Finished) for v in spec.values())
