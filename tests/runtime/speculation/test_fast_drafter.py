"""The fused CPU drafter (runtime/speculation/fast_drafter.py) against the reference torch drafter.

Q8_0 quantisation against gguf-py's reference bytes; the draft vocabulary file; and, on the
real gguf target with the committed drafter: the context K/V, greedy drafts, sampled p_d
and the kernel's argument checks. The engine-level T=0 check of the fused path is
tests/runtime/speculation/test_spec_engine.py's gguf case (the engine drafts with FastDrafter there).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from runtime.speculation.fast_drafter import DRAFT_VOCAB_FILE, build_draft_vocab, load_draft_vocab, quantize_q8_0
from runtime.kernels.cpu import gguf_cpu
from runtime.models.llama import SeqSpan
from runtime.engine.sampler import SamplingBatch

V = 49152


def test_quantize_q8_0_equals_gguf_py():
    import gguf
    from gguf import quants

    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(0)) * 0.05
    w[3, :32] = 0.0  # an all-zero block: d = 0, q = 0
    ours = quantize_q8_0(w)
    ref = quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert ours.shape == (48, 128 // 32 * 34)
    assert np.array_equal(ours.numpy(), ref)
    back = gguf_cpu.dequantize(ours, gguf_cpu.Q8_0, 48, 128)
    assert (back - w).abs().max() <= w.abs().max() / 127  # ≤ half a step (plus fp16 d rounding)
    with pytest.raises(ValueError):
        quantize_q8_0(torch.zeros(2, 40))


def test_draft_vocab_file_validation(tmp_path):
    assert load_draft_vocab(None, V) is None
    assert load_draft_vocab(tmp_path, V) is None  # no file: the whole vocabulary
    f = tmp_path / DRAFT_VOCAB_FILE
    f.write_text(json.dumps({"token_ids": list(range(32))}))
    assert load_draft_vocab(tmp_path, V).tolist() == list(range(32))
    for bad in (list(range(20)), [0] * 16, list(range(V - 8, V + 8))):
        f.write_text(json.dumps({"token_ids": bad}))
        with pytest.raises(ValueError):
            load_draft_vocab(tmp_path, V)


def test_committed_draft_vocab_is_reproducible():
    """The committed draft vocabulary is the 8,192 most frequent training-response tokens."""
    from training.data import load_data
    from runtime.speculation.speculator import DEFAULT_CHECKPOINT

    committed = json.loads((DEFAULT_CHECKPOINT / DRAFT_VOCAB_FILE).read_text())
    res = build_draft_vocab(load_data(), committed["size"], V)
    assert res["token_ids"] == committed["token_ids"]
    assert res["size"] == 8192 and 0.94 < res["heldout_coverage"] < 0.96
    with pytest.raises(ValueError):
        build_draft_vocab(None, 1000, V)


# -- on the real gguf target ------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(gguf_kernel, target_gguf, tokenizer):
    from runtime.speculation.checkpoint import load_drafter
    from runtime.speculation.fast_drafter import FastDrafter
    from runtime.speculation.speculator import DEFAULT_CHECKPOINT

    target = target_gguf
    drafter = load_drafter(DEFAULT_CHECKPOINT, target)
    fast = FastDrafter(drafter, load_draft_vocab(DEFAULT_CHECKPOINT, V))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Explain how a hash map works in Python."}],
                                         add_generation_prompt=True, tokenize=False)
    seq = tokenizer.encode(text, add_special_tokens=False)
    cache = target.new_cache(1, 256)
    s = cache.allocate()
    out = target.forward(torch.tensor(seq), [SeqSpan(s, 0, len(seq))], cache, torch.tensor([len(seq) - 1]), drafter.tap_layers)
    taps = [out.taps]
    for _ in range(48):  # a greedy continuation: the drafter's context
        seq.append(int(out.logits[-1].argmax()))
        out = target.forward(torch.tensor(seq[-1:]), [SeqSpan(s, len(seq) - 1, 1)], cache, torch.tensor([0]), drafter.tap_layers)
        taps.append(out.taps)
    return target, drafter, fast, seq, torch.cat(taps)


def _caches(drafter, fast, taps):
    ce, cf = drafter.new_context_cache(1, 256), drafter.new_context_cache(1, 256)
    drafter.extend_context(ce, taps, [0], [taps.shape[0]])
    fast.extend_context(cf, taps[:10], [0], [10])  # incrementally, as the engine commits
    fast.extend_context(cf, taps[10:], [0], [taps.shape[0] - 10])
    return ce, cf


def _params(n, t):
    return torch.full((n,), float(t)), torch.zeros(n, dtype=torch.long), torch.ones(n)


@pytest.mark.model
def test_context_kv_matches_reference(setup):
    _, drafter, fast, seq, taps = setup
    ce, cf = _caches(drafter, fast, taps)
    n = taps.shape[0]
    assert ce.lengths == cf.lengths == [n]
    k_e, k_f = ce.k[:, 0, :, :n].float(), cf.k[:, 0, :, :n].float()
    v_e, v_f = ce.v[:, 0, :, :n].float(), cf.v[:, 0, :, :n].float()
    # Q8_0 weights + fp32 RoPE vs bf16 weights + bf16 RoPE: a few bf16 ulps of |k| ≤ ~15.
    assert (k_e - k_f).abs().max() < 0.1 * k_e.abs().max() / 2 and (v_e - v_f).abs().max() < 0.05 * v_e.abs().max()
    assert torch.nn.functional.cosine_similarity(k_e.flatten(), k_f.flatten(), dim=0) > 0.9999


@pytest.mark.model
def test_greedy_drafts_agree_with_reference(setup):
    """T=0: the fused drafter (Q8_0 layers, draft vocabulary) proposes the reference's tokens
    at ≥ 97 % of the slots (99.6 % measured over 80 anchors of the γ 7 drafter), and the confidences agree."""
    _, drafter, fast, seq, taps = setup
    ce, cf = _caches(drafter, fast, taps)
    n = taps.shape[0]
    g = drafter.block_size
    agree = total = 0
    conf_err = 0.0
    for i in range(24):
        p = n - 1 - i  # anchor seq[p] at position p: context [0, p)
        ce.truncate(0, p)
        cf.truncate(0, p)
        a = torch.tensor([seq[p]])
        t, k, tp = _params(1, 0)
        ref = drafter.sample_block(drafter.propose(a, [0], ce, block_size=g), a, SamplingBatch(t, k, tp, [torch.Generator()]))
        got = fast.draft(a, [0], cf, g, SamplingBatch(t, k, tp, [torch.Generator()]))
        agree += int((ref.tokens == got.tokens).sum())
        total += g
        if torch.equal(ref.tokens[:, :1], got.tokens[:, :1]):
            conf_err = max(conf_err, float((ref.confidence[:, :2] - got.confidence[:, :2]).abs().max()))
        probs = got.dense_probs([g])
        assert torch.equal(probs.argmax(-1), got.tokens[0]) and torch.equal(probs.sum(-1), torch.ones(g))
        assert ce.lengths == cf.lengths == [p]  # drafting never commits
    assert agree / total >= 0.97, (agree, total)
    assert conf_err < 0.03


@pytest.mark.model
def test_sampled_draft_distribution_is_the_reference_restricted_to_the_draft_vocab(setup):
    """T=1: p_d is the reference's warped Markov distribution restricted to the draft
    vocabulary (zero elsewhere) and the drawn tokens come from it; batch rows independent."""
    _, drafter, fast, seq, taps = setup
    ce, cf = _caches(drafter, fast, taps)
    n = taps.shape[0]
    a = torch.tensor([seq[n - 1]])
    g = drafter.block_size
    t, k, tp = _params(1, 1.0)
    got = fast.draft(a, [0], cf, g, SamplingBatch(t, k, tp, [torch.Generator().manual_seed(3)]))
    probs = got.dense_probs([g])
    vocab = fast.vocab
    outside = torch.ones(V, dtype=torch.bool)
    outside[vocab] = False
    assert probs[:, outside].abs().max() == 0
    assert torch.allclose(probs.sum(-1), torch.ones(g), atol=1e-5)
    assert (probs[torch.arange(g), got.tokens[0]] > 0).all()
    # The reference's distribution of slot 1 (x_0 = the anchor for both), restricted.
    blk = drafter.propose(a, [0], ce, block_size=g)
    ref = torch.softmax(drafter.markov.corrected_logits(blk.base_logits[:, 0], a), -1)[0]
    ref_r = ref[vocab] / ref[vocab].sum()
    tv = 0.5 * (ref_r - probs[0, vocab]).abs().sum()
    assert tv < 0.03, tv
    # dense_probs of a ragged plan: rows of the first ℓ_r slots only.
    assert got.dense_probs([3]).shape == (3, V) and torch.equal(got.dense_probs([3]), probs[:3])
    assert got.dense_probs([0]).shape == (0, V)


@pytest.mark.model
def test_block_kernel_rejects_bad_kv_lens(setup):
    _, drafter, fast, _, _ = setup
    cf = drafter.new_context_cache(1, 64)
    x = torch.zeros(2, 576)
    one = torch.zeros(2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="kv_len"):  # a row may not see less than itself
        fast.fm.forward_block_(x, cf.k, cf.v, one, torch.tensor([3, 4]), torch.tensor([4, 4]))
    with pytest.raises(RuntimeError, match="kv_len"):  # nor past the cache
        fast.fm.forward_block_(x, cf.k, cf.v, one, torch.tensor([3, 4]), torch.tensor([5, 10_000]))
    with pytest.raises(RuntimeError, match="slots and positions"):  # sizes checked before positions is read
        fast.fm.forward_block_(x, cf.k, cf.v, one, torch.tensor([3]), torch.tensor([5, 5]))
    t, k, tp = _params(0, 0)
    g = drafter.block_size
    empty = fast.draft(torch.zeros(0, dtype=torch.long), [], cf, g, SamplingBatch(t, k, tp, []))
    assert empty.tokens.shape == (0, g) and empty.dense_probs([]).shape == (0, V)
