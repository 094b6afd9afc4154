"""The model's full context (8,192 tokens) is served by default: a prompt past the old 2,048
default, served end to end on the real model, continues exactly as a single full-prompt
forward does (no chunking, fresh cache); a prompt that fills the context is an OpenAI-shaped
400; and every position a full context can reach — speculative lookahead included — has a
rotary row."""

from __future__ import annotations

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine.llm_engine import check_positions
from runtime.models.llama import ROTARY_HEADROOM, LlamaConfig, LlamaModel, SeqSpan
from tests.gateway.openai.test_validation import assert_openai_error
from tests.support.engine_checks import greedy_reference
from tests.support.gateway_fixtures import MODEL, served_engine
from training.data import load_train_prompts

URL = "/v1/chat/completions"
N_NEW = 8


def template(tokenizer, messages: list[dict]) -> list[int]:
    """The served prompt's token ids: the chat template, as the gateway renders it, encoded."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def history(tokenizer, min_tokens: int) -> tuple[list[dict], list[int]]:
    """A chat history of the repository's training prompts (user turns, in order) whose
    templated prompt has at least ``min_tokens`` tokens: (messages, prompt ids)."""
    rows, messages, estimate = iter(load_train_prompts()), [], 0
    while True:
        while estimate < min_tokens:  # each turn's tokens + its template's 5, templated once below
            content = next(rows)["messages"][0]["content"]
            messages.append({"role": "user", "content": content})
            estimate += len(tokenizer.encode(content, add_special_tokens=False)) + 5
        ids = template(tokenizer, messages)
        if len(ids) >= min_tokens:
            return messages, ids
        estimate = len(ids)


def test_the_default_context_is_the_models_full_context():
    assert EngineConfig().max_context == LlamaConfig().max_position == 8192
    assert EngineConfig().prefix_cache_blocks * EngineConfig().prefix_block_size >= 8192  # one full prompt fits


def tiny_model(max_position: int = 96) -> LlamaModel:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, max_position=max_position)
    return LlamaModel(cfg).eval().requires_grad_(False)


def test_rotary_rows_cover_the_lookahead_past_a_full_context():
    """The tables have ``max_position + ROTARY_HEADROOM`` rows, the last one the RoPE formula's;
    with speculation (γ = 7) a sequence at the end of the context writes its KV slot's last
    position, and the engine refuses a context or a γ whose positions have no row."""
    model = tiny_model()
    rows = model.rotary.cos.shape[0]
    assert rows == 96 + ROTARY_HEADROOM
    inv_freq = 1.0 / (model.cfg.rope_theta ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    last = (rows - 1) * inv_freq
    assert torch.allclose(model.rotary.cos[-1, :8].double(), last.cos(), atol=1e-6)
    assert torch.allclose(model.rotary.sin[-1, 8:].double(), last.sin(), atol=1e-6)

    gamma = 7
    cfg = EngineConfig(dtype="float32", max_context=96, spec_method="dspark", num_speculative_tokens=gamma)
    check_positions(cfg, model, gamma + 1)  # fits: 96 + 8 + 7 ≤ 160
    cache = model.new_cache(1, cfg.max_context + gamma + 1)
    slot = cache.allocate()
    cache.lengths[slot] = cache.max_len - 1  # the slot's last position, as a full context's last draft writes it
    out = model.forward(torch.tensor([5]), [SeqSpan(slot, cache.max_len - 1, 1)], cache, torch.tensor([0]))
    assert out.logits.shape == (1, 64) and bool(torch.isfinite(out.logits).all())
    assert cache.lengths[slot] == cache.max_len == 104

    with pytest.raises(ValueError, match="exceeds the model's context of 96"):
        check_positions(EngineConfig(dtype="float32", max_context=97), model, 1)
    big = EngineConfig(dtype="float32", max_context=96, spec_method="dspark", num_speculative_tokens=40)
    with pytest.raises(ValueError, match="needs rotary positions up to 176"):
        check_positions(big, model, 41)
    check_positions(EngineConfig(dtype="float32", max_context=96), model, 1)  # AR: no drafter block


@pytest.fixture(scope="module")
async def long_app(tmp_path_factory, migrated_template, target_gguf, tokenizer, gguf_kernel):
    """(app, client, headers): the gateway over the served engine (gguf, AR) at the default context."""
    async with served_engine(tmp_path_factory, migrated_template, "long_context", target_gguf, tokenizer,
                             dtype="gguf", max_batch_size=2, max_context=EngineConfig.max_context) as app_client_headers:
        yield app_client_headers


async def test_a_prompt_past_the_old_default_matches_a_single_full_forward(long_app, target_gguf, tokenizer):
    """A ~3,000-token history (prefilled in 256-token chunks) at T = 0: the reply is the model's
    argmax continuation after ONE forward over the whole prompt in a fresh cache."""
    _, client, headers = long_app
    messages, ids = history(tokenizer, 3000)
    r = await client.post(URL, json={"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": N_NEW},
                          headers=headers)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(ids) > 2048
    ref = greedy_reference(target_gguf, ids, N_NEW)
    eos = target_gguf.cfg.eos_token_id
    ref = ref[: ref.index(eos)] if eos in ref else ref
    assert body["usage"]["completion_tokens"] == len(ref) > 0
    assert body["choices"][0]["message"]["content"] == tokenizer.decode(ref, skip_special_tokens=True)


def exact_prompt(tokenizer, n: int) -> tuple[list[dict], list[int]]:
    """A history of training prompts topped up with a last turn of ``k`` ``x`` words (one token
    each; ``k`` by bisection) to exactly ``n`` templated tokens: (messages, prompt ids)."""
    messages, ids = history(tokenizer, n - 200)
    messages, ids = messages[:-1], template(tokenizer, messages[:-1])
    lo, hi = 1, n - len(ids)
    while lo <= hi:
        k = (lo + hi) // 2
        trial = messages + [{"role": "user", "content": " ".join(["x"] * k)}]
        got = template(tokenizer, trial)
        if len(got) == n:
            return trial, got
        lo, hi = (k + 1, hi) if len(got) < n else (lo, k - 1)
    raise AssertionError(f"no exact {n}-token prompt")


@pytest.mark.parametrize("extra", [0, 1])
async def test_a_prompt_that_fills_the_context_is_400(long_app, tokenizer, extra):
    """max_context and max_context + 1 prompt tokens: 400 context_length_exceeded naming both
    numbers."""
    _, client, headers = long_app
    messages, ids = exact_prompt(tokenizer, 8192 + extra)
    r = await client.post(URL, json={"model": MODEL, "messages": messages, "max_tokens": 4}, headers=headers)
    err = assert_openai_error(r, 400, "invalid_request_error", "messages", "context_length_exceeded")
    assert "maximum context length is 8192 tokens" in err["message"]
    assert f"resulted in {8192 + extra} tokens" in err["message"]
