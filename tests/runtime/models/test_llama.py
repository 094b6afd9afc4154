"""The lean Llama model against transformers, and the ragged-forward / rollback design."""

from __future__ import annotations

import pytest
import torch

from runtime.models.llama import SeqSpan

pytestmark = pytest.mark.model

PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far away, there lived a",
]


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def _ids(tokenizer, text):
    return torch.tensor(tokenizer(text)["input_ids"])


def test_logits_and_taps_match_transformers(target_fp32, hf_model, tokenizer):
    taps = [0, 7, 14, 28]
    for text in PROMPTS:
        x = _ids(tokenizer, text)
        cache = target_fp32.new_cache(1, 128)
        slot = cache.allocate()
        out = target_fp32.forward(x, [SeqSpan(slot, 0, len(x))], cache, torch.arange(len(x)), taps)
        with torch.no_grad():
            ref = hf_model(x[None], output_hidden_states=True)
        assert (out.logits - ref.logits[0]).abs().max().item() <= 1e-3
        for j, layer in enumerate(taps):  # |h| reaches ~2e4 (massive activations): fp32 GEMM order differs in relative 1e-6s
            torch.testing.assert_close(out.taps[:, j], ref.hidden_states[layer + 1][0], rtol=1e-5, atol=1e-3)
        assert cache.lengths[slot] == len(x)


def _run_alone(model, prefix, new):
    cache = model.new_cache(1, 128)
    s = cache.allocate()
    model.forward(prefix, [SeqSpan(s, 0, len(prefix))], cache)
    return model.forward(new, [SeqSpan(s, len(prefix), len(new))], cache, torch.arange(len(new))).logits


def test_ragged_batch_equals_each_sequence_alone(target_fp32, tokenizer):
    """Sequences receiving 1, 5 and 8 new tokens in ONE forward give the same logits as alone."""
    g = torch.Generator().manual_seed(0)
    prefixes = [_ids(tokenizer, p) for p in PROMPTS]
    news = [torch.randint(0, 49152, (n,), generator=g) for n in (1, 5, 8)]
    cache = target_fp32.new_cache(3, 128)
    slots = [cache.allocate() for _ in prefixes]
    # Prefill all three in one ragged forward too.
    target_fp32.forward(
        torch.cat(prefixes), [SeqSpan(s, 0, len(p)) for s, p in zip(slots, prefixes)], cache
    )
    spans = [SeqSpan(s, len(p), len(n)) for s, p, n in zip(slots, prefixes, news)]
    T = sum(len(n) for n in news)
    batched = target_fp32.forward(torch.cat(news), spans, cache, torch.arange(T)).logits
    off = 0
    for p, n in zip(prefixes, news):
        alone = _run_alone(target_fp32, p, n)
        assert (batched[off : off + len(n)] - alone).abs().max().item() <= 1e-4
        off += len(n)


def test_rollback_equals_never_seen(target_fp32, tokenizer):
    """Append 8 tokens, roll back 5: next logits equal a cache that never saw them."""
    prefix = _ids(tokenizer, PROMPTS[0])
    extra = torch.randint(0, 49152, (8,), generator=torch.Generator().manual_seed(1))
    nxt = torch.tensor([42])
    cache = target_fp32.new_cache(1, 128)
    s = cache.allocate()
    target_fp32.forward(prefix, [SeqSpan(s, 0, len(prefix))], cache)
    target_fp32.forward(extra, [SeqSpan(s, len(prefix), 8)], cache)
    cache.truncate(s, len(prefix) + 3)
    rolled = target_fp32.forward(nxt, [SeqSpan(s, len(prefix) + 3, 1)], cache, torch.tensor([0])).logits
    clean = _run_alone(target_fp32, torch.cat([prefix, extra[:3]]), nxt)
    assert (rolled - clean).abs().max().item() <= 1e-4
    # and the rollback is visible: without truncation the answer differs
    assert cache.lengths[s] == len(prefix) + 4


def test_span_start_must_match_cache(target_fp32):
    cache = target_fp32.new_cache(1, 16)
    s = cache.allocate()
    with pytest.raises(ValueError):
        target_fp32.forward(torch.tensor([1, 2]), [SeqSpan(s, 3, 2)], cache)
    with pytest.raises(ValueError):
        target_fp32.forward(torch.arange(17), [SeqSpan(s, 0, 17)], cache)


def test_fp32_row_padding_only_ever_adds_rows_and_is_stable():
    """FP32_PADDED_ROWS pads a row count to at least itself, never past SMALL_M_MAX, and a padded
    count is left as is (padding twice would change the GEMM again); 1 row (torch.mv) never pads."""
    from runtime.models.llama import FP32_PADDED_ROWS, SMALL_M_MAX

    assert len(FP32_PADDED_ROWS) == SMALL_M_MAX + 1 and FP32_PADDED_ROWS[1] == 1
    for m in range(1, SMALL_M_MAX + 1):
        p = FP32_PADDED_ROWS[m]
        assert m <= p <= SMALL_M_MAX and FP32_PADDED_ROWS[p] == p, (m, p)
    assert [FP32_PADDED_ROWS[m] for m in (3, 7, 15, 31)] == [4, 8, 16, 32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_linear_is_bitwise_f_linear(dtype):
    """``linear`` (torch.mv for one row) equals F.linear: bitwise in fp32 (fp32 with 2..SMALL_M_MAX
    rows goes through W·Xᵀ: within fp32 rounding of the fp64 product; 33 rows: F.linear itself), and in bf16 on
    CPUs with AMX-BF16. Without AMX (e.g. an AMD EPYC with AVX512-BF16) oneDNN's bf16 GEMV
    and GEMM sum in different orders, so a rare output differs in its last bits (seen: 1
    of 576 outputs, by 4e-6 on a value near 0); there it must agree to bf16 rounding."""
    import torch.nn.functional as F

    from runtime.config import AMX_FLAGS, cpu_flags
    from runtime.models.llama import SMALL_M_MAX, Linear, linear

    bitwise = dtype == torch.float32 or AMX_FLAGS <= cpu_flags()

    def same(a, b):
        if bitwise:
            return torch.equal(a, b)
        scale = b.float().abs().max()
        # one bf16 ulp (≤ 2⁻⁷ relative): on an Ice Lake Xeon (no AVX512-BF16, no AMX) an output
        # of 30.125 came out one ulp (0.125) apart, over the 2⁻⁸ this allowed before
        return bool(((a.float() - b.float()).abs() <= 2**-7 * b.float().abs() + 1e-6 * scale).all())

    g = torch.Generator().manual_seed(0)
    for out_f, in_f in [(960, 576), (3072, 576), (576, 1536), (49152, 576)]:
        w = torch.randn(out_f, in_f, generator=g).to(dtype)
        for rows in (1, 2, 3, 7, 15, 33):  # 3, 7, 15: padded to 4, 8, 16 rows (FP32_PADDED_ROWS)
            x = torch.randn(rows, in_f, generator=g).to(dtype)
            if dtype == torch.float32 and 1 < rows <= SMALL_M_MAX:  # W·Xᵀ: fp32 rounding, against fp64
                exact = F.linear(x.double(), w.double())
                assert linear(x, w).is_contiguous()  # the grammar mask writes logits in row order
                assert linear(x, w).shape == (rows, out_f)
                err = (linear(x, w).double() - exact).abs().max().item()
                assert err <= 1e-5 * exact.abs().max().item(), (rows, out_f, err)
            else:
                assert same(linear(x, w), F.linear(x, w))
    lin = Linear(576, 960).to(dtype)
    x = torch.randn(1, 576, generator=g).to(dtype)
    assert lin.bias is None and same(lin(x), F.linear(x, lin.weight))


def test_packed_linear_agrees_with_the_fp64_product_and_is_taken_only_where_meant(monkeypatch):
    """The MKL-packed route (2..PACKED_M_MAX fp32 rows with a packed weight) gives the product to
    fp32 rounding for every row count, a contiguous [M, out] result, and is the route taken:
    a packed copy of ANOTHER weight changes the output for 2..PACKED_M_MAX rows only (1 row:
    torch.mv; more rows: W·Xᵀ / F.linear on the weight itself)."""
    import torch.nn.functional as F

    from runtime.models.llama import PACKED_M_MAX, Linear, linear, mkl_packing_available, pack_weight

    if not mkl_packing_available():
        pytest.skip("this torch build has no MKL packed GEMM (linear keeps its W·Xᵀ route)")
    g = torch.Generator().manual_seed(0)
    for out_f, in_f in [(960, 576), (576, 1536), (49152, 576)]:
        w = torch.randn(out_f, in_f, generator=g)
        packed = pack_weight(w)
        other = pack_weight(torch.randn(out_f, in_f, generator=g))
        assert packed is not None and other is not None
        for rows in (1, 2, 3, 8, 13, PACKED_M_MAX, PACKED_M_MAX + 1, 40):
            x = torch.randn(rows, in_f, generator=g)
            exact = F.linear(x.double(), w.double())
            y = linear(x, w, packed)
            assert y.shape == (rows, out_f) and y.is_contiguous() and y.dtype == torch.float32
            err = (y.double() - exact).abs().max().item()
            assert err <= 1e-5 * exact.abs().max().item(), (rows, out_f, err)
            took_packed = not torch.allclose(linear(x, w, other), y)
            assert took_packed == (2 <= rows <= PACKED_M_MAX), rows
    assert pack_weight(torch.randn(8, 16).bfloat16()) is None  # fp32 only
    # an input that needs a gradient takes the differentiable route (the packed op has none)
    x = torch.randn(4, 576, generator=g, requires_grad=True)
    w = torch.randn(960, 576, generator=g)
    linear(x, w, pack_weight(torch.randn(960, 576, generator=g))).sum().backward()
    assert torch.allclose(x.grad, w.sum(0).expand(4, -1), atol=1e-3)
    lin = Linear(576, 960)
    lin.packed = pack_weight(lin.weight)
    x = torch.randn(4, 576, generator=g)
    assert (lin(x) - F.linear(x, lin.weight)).abs().max().item() <= 1e-4


def test_fp32_load_packs_every_projection_and_the_head(target_fp32):
    """An fp32 model from load_llama carries packed copies of all 4 projections of every layer
    and of the tied LM head (where MKL packs), so batched decode and verification use them."""
    from runtime.models.llama import Linear, mkl_packing_available

    linears = [m for m in target_fp32.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * target_fp32.cfg.num_layers
    if not mkl_packing_available():
        assert all(m.packed is None for m in linears) and target_fp32.lm_head_packed is None
        return
    assert all(m.packed is not None for m in linears) and target_fp32.lm_head_packed is not None


def test_attention_plan_groups_single_token_spans_over_a_dense_slot_range():
    from runtime.models.llama import attention_plan

    spans = [SeqSpan(0, 10, 1), SeqSpan(1, 40, 5), SeqSpan(2, 7, 1), SeqSpan(3, 3, 1)]
    plan = attention_plan(spans, torch.device("cpu"))
    g = plan.decode
    assert (g.lo, g.hi, g.length) == (0, 4, 11)
    assert g.rows.tolist() == [0, 6, 7] and g.slot_offsets.tolist() == [0, 2, 3]
    assert g.mask[:, 0, 0].sum(-1).tolist() == [11, 1, 8, 4]  # slot 1 is not in the group: key 0 only
    assert [(s.slot, off) for s, off, _ in plan.per_sequence] == [(1, 1)]
    assert plan.per_sequence[0][2].shape == (5, 45)
    # One decode span, or a slot range over twice the group: no group.
    assert attention_plan([SeqSpan(5, 10, 1), SeqSpan(0, 3, 4)], torch.device("cpu")).decode is None
    assert attention_plan([SeqSpan(0, 10, 1), SeqSpan(9, 3, 1)], torch.device("cpu")).decode is None


def test_grouped_decode_attention_equals_per_sequence(target_fp32, tokenizer, monkeypatch):
    """A decode step of 5 sequences (slots 0..5, one slot idle, ragged lengths) plus a
    prefill chunk: the grouped single-call attention gives the per-sequence logits."""
    import runtime.models.llama as llama

    g = torch.Generator().manual_seed(1)
    lens = [23, 61, 5, 130, 44]
    slots = [0, 1, 3, 4, 5]
    logits = {}
    for mode, min_group in (("per_sequence", 10**9), ("grouped", 2)):
        monkeypatch.setattr(llama, "MIN_DECODE_GROUP", min_group)
        g.manual_seed(1)
        cache = target_fp32.new_cache(6, 256)
        for s, n in zip(slots, lens):
            target_fp32.forward(torch.randint(0, 49152, (n,), generator=g), [SeqSpan(s, 0, n)], cache)
        new = torch.randint(0, 49152, (len(slots) + 9,), generator=g)
        spans = [SeqSpan(s, n, 1) for s, n in zip(slots, lens)] + [SeqSpan(2, 0, 9)]
        assert (llama.attention_plan(spans, torch.device("cpu")).decode is not None) == (mode == "grouped")
        logits[mode] = target_fp32.forward(new, spans, cache, torch.arange(new.numel())).logits
        assert cache.lengths[:6] == [24, 62, 9, 6, 131, 45]
    assert (logits["grouped"] - logits["per_sequence"]).abs().max().item() <= 1e-4
