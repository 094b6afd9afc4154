"""Weight-only int8 serving dtype (``runtime.models.quant``): quantisation error bounds,
logits close to fp32 on real prompts, and ``EngineConfig(dtype="int8")`` through the engine."""

from __future__ import annotations

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.models.llama import SeqSpan, load_llama
from runtime.models.quant import KERNEL_MAX_ROWS, Int8Linear, dequantize_int8, quantize_int8
from tests.support.engine_checks import assert_engine_greedy_is_model_argmax

PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
]


def _weight() -> torch.Tensor:
    """Rows of very different magnitude, an outlier row and an all-zero row."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) * torch.logspace(-3, 1, 64)[:, None]
    w[5, 7] = 40.0
    w[9] = 0.0
    return w


def test_round_trip_error_is_half_a_step_per_channel():
    w = _weight()
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and s.dtype == torch.bfloat16 and s.shape == (64,)
    assert int(q.min()) >= -127 and int(q.max()) <= 127
    amax = w.abs().amax(1)
    nz = amax > 0
    step = s.float()
    # Each channel has its own scale, within one bf16 rounding (up) of max|w|/127 ...
    assert (step[nz] >= amax[nz] / 127).all()
    assert (step[nz] <= amax[nz] / 127 * (1 + 2**-7)).all()
    # ... and every element is within half a step of its channel's grid.
    err = (dequantize_int8(q, s) - w).abs().amax(1)
    assert (err <= step / 2 * (1 + 1e-6)).all(), (err / step).max()
    assert err[9] == 0  # the zero row round-trips exactly
    # The largest element of each non-zero row uses (nearly) the full int8 range.
    assert (q.abs().amax(1)[nz] >= 126).all()


def test_int8_linear_matches_its_dequantised_weight_on_both_paths():
    w = _weight()
    lin = Int8Linear(w)
    ref_w = dequantize_int8(lin.weight, lin.scales)
    g = torch.Generator().manual_seed(1)
    for rows in (1, 4, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 100):
        x = torch.randn(rows, 96, generator=g)
        y = lin(x)
        assert y.dtype == torch.float32 and y.shape == (rows, 64)
        ref = x @ ref_w.T
        # The few-row kernel path rounds activations and outputs to bf16 (rel. 2⁻⁸ each).
        tol = 1e-5 if rows > KERNEL_MAX_ROWS else 2e-2
        assert ((y - ref).abs() <= tol * ref.abs().amax(1, keepdim=True) + 1e-6).all(), rows
    with_float = Int8Linear(w, keep_float=True)
    x = torch.randn(KERNEL_MAX_ROWS + 1, 96, generator=g)
    torch.testing.assert_close(with_float(x), x @ w.T)  # many rows: the exact float weight


@pytest.mark.model
def test_int8_model_logits_close_to_fp32(target_fp32, model_dir, tokenizer):
    model = load_llama(model_dir, torch.int8)
    assert isinstance(model.layers[0].mlp.down_proj, Int8Linear) and model.lm_head_quant is not None
    assert model.dtype == torch.float32 and model.embed_tokens.weight.dtype == torch.float32
    for text in PROMPTS:
        x = torch.tensor(tokenizer(text)["input_ids"])
        logits = []
        for m in (target_fp32, model):
            cache = m.new_cache(1, 64)
            slot = cache.allocate()
            logits.append(m.forward(x, [SeqSpan(slot, 0, len(x))], cache, torch.arange(len(x))).logits)
        ref, got = logits
        lp_ref = ref.log_softmax(-1)
        kl = (lp_ref.exp() * (lp_ref - got.log_softmax(-1))).sum(-1)
        # Measured on these prompts (AVX2): max |Δlogit| 1.47 / 1.60, KL per position
        # ≤ 0.030 / 0.058 nats, mean 0.0075 / 0.0083; bounds ≈ 2× that.
        assert (got - ref).abs().max().item() < 3.0
        assert kl.max().item() < 0.15 and kl.mean().item() < 0.02, kl
        assert (got[-1].argmax() == ref[-1].argmax()).item()
        # Not accidentally fp32: the int8 rounding must be visible.
        assert (got - ref).abs().max().item() > 1e-3


@pytest.mark.model
def test_engine_serves_int8_greedy(model_dir, tokenizer):
    events: dict[str, list] = {}
    engine = LLMEngine(EngineConfig(dtype="int8", max_batch_size=2, max_context=256),
                       lambda rid, ev: events.setdefault(rid, []).append(ev), tokenizer=tokenizer)
    assert isinstance(engine.model.layers[0].self_attn.qkv_proj, Int8Linear)
    # The engine's greedy tokens are the int8 model's own argmax continuation.
    assert_engine_greedy_is_model_argmax(engine, events, [tokenizer(p)["input_ids"] for p in PROMPTS])
