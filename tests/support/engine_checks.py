"""Checks shared by the serving-dtype tests (int8, gguf): an engine's greedy output is its
own model's one-token-at-a-time argmax continuation."""

from __future__ import annotations

import torch

from runtime.interface import Finished, GenerationRequest, SamplingParams, TextDelta
from runtime.models.llama import SeqSpan


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """``n`` argmax tokens after ``prompt``: one prefill forward, then one token per forward."""
    cache = model.new_cache(1, len(prompt) + n + 1)
    slot = cache.allocate()
    out = model.forward(torch.tensor(prompt), [SeqSpan(slot, 0, len(prompt))], cache, torch.tensor([len(prompt) - 1]))
    ref: list[int] = []
    for _ in range(n):
        ref.append(int(out.logits[-1].argmax()))
        out = model.forward(torch.tensor(ref[-1:]), [SeqSpan(slot, len(prompt) + len(ref) - 1, 1)], cache,
                            torch.tensor([0]))
    return ref


def assert_engine_greedy_is_model_argmax(engine, events: dict[str, list], prompts: list[list[int]], n: int = 8) -> None:
    """Serve ``prompts`` greedily (``n`` tokens each, batched) on ``engine`` whose emit fills
    ``events``; every request must finish with non-empty text equal to :func:`greedy_reference`."""
    for i, p in enumerate(prompts):
        engine.add_request(GenerationRequest(str(i), p, SamplingParams(temperature=0, max_tokens=n)))
    while engine.has_work():
        engine.step()
    for i, p in enumerate(prompts):
        evs = events[str(i)]
        assert isinstance(evs[-1], Finished)
        tokens = [t for e in evs if isinstance(e, TextDelta) for t in e.token_ids]
        assert len(tokens) == n and "".join(e.text for e in evs if isinstance(e, TextDelta)).strip()
        assert tokens == greedy_reference(engine.model, p, n)
