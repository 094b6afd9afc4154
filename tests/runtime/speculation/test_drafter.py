"""DSpark drafter on the real SmolLM2 target (fp32) with a random drafter.

Covers shapes/dtypes, the block attention pattern (bidirectional inside the block,
context strictly before the anchor) against a dense re-implementation, the Markov
head in the sampling loop, the confidence head, checkpoints, the incremental
DraftContextCache, the prompt-lookup baseline, and the engine protocol of
``spec_round`` end to end at T = 0 (speculative output == greedy AR).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from runtime.speculation.checkpoint import load_drafter, read_config, save_drafter
from runtime.speculation.config import DrafterConfig
from runtime.speculation.drafter import DSparkDrafter
from runtime.speculation.prompt_lookup import one_hot_probs, propose_ngram
from runtime.speculation.verifier import spec_round
from runtime.models.llama import SeqSpan
from runtime.engine.sampler import SamplingBatch

pytestmark = pytest.mark.model

V = 49152
GAMMA = 7


@pytest.fixture(scope="module")
def drafter(target_fp32):
    return DSparkDrafter(target_fp32, DrafterConfig())


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, V, (40,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def taps(target_fp32, drafter, ids):
    """Target taps [40, 5, 576] of a random 40-token sequence."""
    cache = target_fp32.new_cache(1, 64)
    s = cache.allocate()
    return target_fp32.forward(ids, [SeqSpan(s, 0, len(ids))], cache, None, drafter.tap_layers).taps


def _ctx(drafter, taps_list, max_len=64):
    """A context cache with slot i holding taps_list[i]."""
    dc = drafter.new_context_cache(len(taps_list), max_len)
    for s, t in enumerate(taps_list):
        drafter.extend_context(dc, t, [s], [t.shape[0]])
    return dc


def _params(n, t=1.0):
    return torch.full((n,), t), torch.zeros(n, dtype=torch.long), torch.ones(n)


def _gens(*seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_config_validation():
    DrafterConfig().validate(30)
    for bad in (
        DrafterConfig(target_layer_ids=[2, 29]),  # final layer
        DrafterConfig(target_layer_ids=[8, 2]),
        DrafterConfig(markov_variant="lstm"),
        DrafterConfig(sts_temperatures=[1.0] * 3),
        DrafterConfig(markov_rank=-1),
    ):
        with pytest.raises(ValueError):
            bad.validate(30)


def test_shapes_dtypes_and_ragged_batch(drafter, taps, ids):
    dc = _ctx(drafter, [taps[:25], taps[:40]])
    anchors = torch.tensor([int(ids[25]), 17])
    blk = drafter.propose(anchors, [0, 1], dc)
    assert blk.base_logits.shape == (2, GAMMA, V) and blk.base_logits.dtype == torch.float32
    assert blk.hidden.shape == (2, GAMMA, 576) and blk.hidden.dtype == torch.float32
    assert torch.isfinite(blk.base_logits).all()
    assert dc.lengths == [25, 40]  # proposing commits nothing
    # Ragged batch == each sequence alone.
    for i, s in enumerate([0, 1]):
        alone = drafter.propose(anchors[i : i + 1], [s], dc)
        torch.testing.assert_close(alone.base_logits[0], blk.base_logits[i], atol=1e-4, rtol=1e-4)
    # Row 0 sampled at T=1, row 1 greedy.
    temp = torch.tensor([1.0, 0.0])
    ds = drafter.sample_block(blk, anchors, SamplingBatch(temp, torch.zeros(2, dtype=torch.long), torch.ones(2), _gens(1, 2)))
    assert ds.tokens.shape == (2, GAMMA) and ds.tokens.dtype == torch.int64
    assert ((ds.tokens >= 0) & (ds.tokens < V)).all()
    assert ds.probs.shape == (2, GAMMA, V) and ds.probs.dtype == torch.float32
    torch.testing.assert_close(ds.probs.sum(-1), torch.ones(2, GAMMA))
    assert (ds.probs[0].gather(-1, ds.tokens[0, :, None]) > 0).all()
    # Greedy row: one-hot at the argmax of the Markov-corrected logits.
    prev = torch.cat([anchors[1:], ds.tokens[1, :-1]])
    corrected = drafter.markov.corrected_logits(blk.base_logits[1], prev, blk.hidden[1])
    assert torch.equal(ds.tokens[1], corrected.argmax(-1))
    assert torch.equal(ds.probs[1], F.one_hot(ds.tokens[1], V).float())
    assert ds.confidence.dtype == torch.float32 and ds.confidence.shape == (2, GAMMA)
    assert ((ds.confidence > 0) & (ds.confidence < 1)).all()
    torch.testing.assert_close(ds.confidence, torch.sigmoid(ds.confidence_logits))
    # A shorter serving block (γ' < γ).
    assert drafter.propose(anchors, [0, 1], dc, block_size=3).base_logits.shape == (2, 3, V)
    with pytest.raises(ValueError):
        drafter.propose(anchors, [0, 1], dc, block_size=GAMMA + 1)


def _dense_reference(drafter, taps, anchor, p):
    """Block hidden computed without any cache: K/V = [context 0..p−1 ; block], no mask."""
    tgt = drafter.target
    feats = drafter.context_features(taps[:p])
    x = drafter.block_inputs(torch.tensor([anchor]), GAMMA)[0]
    cos_c, sin_c = tgt.rotary.tables(torch.arange(p), torch.float32)
    cos_b, sin_b = tgt.rotary.tables(torch.arange(p, p + GAMMA), torch.float32)
    for layer in drafter.layers:
        a = layer.self_attn
        q, k, v = a.project_qkv(layer.input_layernorm(x), cos_b, sin_b)
        kc, vc = layer.context_kv(feats, cos_c, sin_c)
        K = torch.cat([kc, k]).transpose(0, 1).repeat_interleave(a.num_heads // a.num_kv_heads, 0)
        Vv = torch.cat([vc, v]).transpose(0, 1).repeat_interleave(a.num_heads // a.num_kv_heads, 0)
        att = torch.softmax(q.transpose(0, 1) @ K.transpose(1, 2) * a.scale, -1) @ Vv  # [H, γ, D]
        x = x + a.o_proj(att.transpose(0, 1).reshape(GAMMA, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)


@torch.inference_mode()
def test_block_matches_dense_reference(drafter, taps, ids):
    p = 30
    dc = _ctx(drafter, [taps[:p]])
    blk = drafter.propose(ids[p : p + 1], [0], dc)
    ref = _dense_reference(drafter, taps, int(ids[p]), p)
    torch.testing.assert_close(blk.hidden[0], ref, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_block_is_bidirectional(drafter, taps, ids):
    dc = _ctx(drafter, [taps[:20]])
    x = drafter.block_inputs(ids[20:21], GAMMA)
    h = drafter.forward_block(x, [0], dc)[0]
    x_last = x.clone()
    x_last[0, -1] += 0.5 * torch.randn(576, generator=torch.Generator().manual_seed(1))
    h_last = drafter.forward_block(x_last, [0], dc)[0]
    assert (h_last[0] - h[0]).abs().max() > 1e-3  # slot 0 sees the last slot
    x_first = x.clone()
    x_first[0, 0] += 0.5 * torch.randn(576, generator=torch.Generator().manual_seed(2))
    h_first = drafter.forward_block(x_first, [0], dc)[0]
    assert (h_first[-1] - h[-1]).abs().max() > 1e-3  # and the last slot sees slot 0


@torch.inference_mode()
def test_block_sees_only_context_before_anchor(drafter, taps, ids):
    p = 20
    anchor = ids[p : p + 1]
    clean = drafter.propose(anchor, [0], _ctx(drafter, [taps[:p]]))
    # Context at/after the anchor (positions p..p+11, incl. the anchor's own taps and
    # beyond the block's scratch) present in the cache, then rolled back: invisible.
    noisy = taps[: p + 12].clone()
    noisy[p:] += torch.randn(noisy[p:].shape, generator=torch.Generator().manual_seed(3))
    dc = _ctx(drafter, [noisy])
    dc.truncate(0, p)
    rolled = drafter.propose(anchor, [0], dc)
    torch.testing.assert_close(rolled.base_logits, clean.base_logits, atol=0, rtol=0)
    # Whereas position p−1 (strictly before the anchor) is seen.
    before = taps[:p].clone()
    before[p - 1] += torch.randn(before[p - 1].shape, generator=torch.Generator().manual_seed(4))
    moved = drafter.propose(anchor, [0], _ctx(drafter, [before]))
    assert (moved.base_logits - clean.base_logits).abs().max() > 1e-3


@pytest.mark.parametrize("variant", ["vanilla", "gated", "rank0"])
def test_markov_head_in_the_sampling_loop(target_fp32, taps, ids, variant):
    cfg = DrafterConfig(markov_rank=0) if variant == "rank0" else DrafterConfig(markov_variant=variant)
    d = DSparkDrafter(target_fp32, cfg)
    dc = _ctx(d, [taps[:30]])
    anchor = ids[30:31]
    blk = d.propose(anchor, [0], dc)
    runs = [d.sample_block(blk, anchor, SamplingBatch(*_params(1), _gens(seed))) for seed in range(6)]
    differing_prev = 0
    for r in runs[1:]:
        a, b = runs[0], r
        assert torch.equal(a.probs[0, 0], b.probs[0, 0])  # slot 1: x_0 = anchor in both
        for k in range(1, GAMMA):
            same_prev = bool(a.tokens[0, k - 1] == b.tokens[0, k - 1])
            differing_prev += not same_prev
            if same_prev or variant == "rank0":
                assert torch.equal(a.probs[0, k], b.probs[0, k])
                if variant == "rank0":  # confidence sees h_k only
                    assert torch.equal(a.confidence[0, k], b.confidence[0, k])
            else:
                assert (a.probs[0, k] - b.probs[0, k]).abs().max() > 1e-4
                assert a.confidence[0, k] != b.confidence[0, k]
    assert differing_prev > 0
    if variant != "rank0":  # direct check of the bias dependence on x_{k−1}
        h = blk.hidden[0, 3:4]
        b1 = d.markov.corrected_logits(blk.base_logits[0, 3:4], torch.tensor([5]), h)
        b2 = d.markov.corrected_logits(blk.base_logits[0, 3:4], torch.tensor([6]), h)
        assert (b1 - b2).abs().max() > 1e-3
    else:
        assert d.markov is None


def test_sts_temperatures_scale_confidence(target_fp32, taps, ids):
    temps = [0.5, 1.0, 2.0, 3.0, 1.5, 0.8, 4.0]
    d = DSparkDrafter(target_fp32, DrafterConfig(sts_temperatures=temps))
    dc = _ctx(d, [taps[:30]])
    blk = d.propose(ids[30:31], [0], dc)
    ds = d.sample_block(blk, ids[30:31], SamplingBatch(*_params(1), _gens(0)))
    torch.testing.assert_close(ds.confidence, torch.sigmoid(ds.confidence_logits / torch.tensor(temps)))


@pytest.mark.parametrize("variant", ["vanilla", "gated"])
def test_checkpoint_round_trip(target_fp32, taps, ids, tmp_path, variant):
    cfg = DrafterConfig(markov_variant=variant, markov_rank=32, num_layers=1, init_seed=7,
                        sts_temperatures=[1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6])  # fmt: skip
    d = DSparkDrafter(target_fp32, cfg)
    save_drafter(d, tmp_path / "ckpt")
    meta = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert meta["drafter"]["target_layer_ids"] == [2, 8, 14, 20, 26] and meta["drafter"]["block_size"] == GAMMA
    assert read_config(tmp_path / "ckpt") == cfg
    loaded = load_drafter(tmp_path / "ckpt", target_fp32)
    assert loaded.cfg == cfg
    # A different seed's drafter really differs, so equality below is meaningful.
    other = DSparkDrafter(target_fp32, DrafterConfig(markov_variant=variant, markov_rank=32, num_layers=1))
    outs = []
    for m in (d, loaded, other):
        dc = _ctx(m, [taps[:30]])
        blk = m.propose(ids[30:31], [0], dc)
        outs.append((blk, m.sample_block(blk, ids[30:31], SamplingBatch(*_params(1), _gens(9)))))
    (b0, s0), (b1, s1), (b2, _) = outs
    assert torch.equal(b0.base_logits, b1.base_logits) and torch.equal(b0.hidden, b1.hidden)
    assert torch.equal(s0.tokens, s1.tokens) and torch.equal(s0.probs, s1.probs)
    assert torch.equal(s0.confidence, s1.confidence)
    assert not torch.equal(b0.base_logits, b2.base_logits)
    # A checkpoint for another target geometry is refused.
    meta["target"]["vocab_size"] = 32000
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError):
        load_drafter(tmp_path / "ckpt", target_fp32)


@torch.inference_mode()
def test_context_cache_incremental_equals_from_scratch(drafter, taps, ids):
    full = _ctx(drafter, [taps[:40]])
    # Incremental: prefill chunk, then rounds committing 1..5 tokens, with rejected
    # verification rows appended and rolled back in between.
    inc = drafter.new_context_cache(2, 64)
    inc.reset(1)
    chunks, start = [12, 1, 4, 2, 5, 1, 7, 8], 0
    junk = torch.randn(3, *taps.shape[1:], generator=torch.Generator().manual_seed(5))
    for n in chunks:
        drafter.extend_context(inc, taps[start : start + n], [1], [n])
        start += n
        drafter.extend_context(inc, junk, [1], [3])  # rejected drafts' taps …
        inc.truncate(1, start)  # … rolled back
    assert start == 40 and inc.lengths[1] == 40
    L = 40
    torch.testing.assert_close(inc.k[:, 1, :, :L], full.k[:, 0, :, :L], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(inc.v[:, 1, :, :L], full.v[:, 0, :, :L], atol=1e-5, rtol=1e-5)
    a = drafter.propose(torch.tensor([5]), [1], inc)
    b = drafter.propose(torch.tensor([5]), [0], full)
    torch.testing.assert_close(a.base_logits, b.base_logits, atol=1e-4, rtol=1e-4)
    # Truncate + re-extend == never having gone further.
    inc.truncate(1, 17)
    drafter.extend_context(inc, taps[17:40], [1], [23])
    torch.testing.assert_close(inc.k[:, 1, :, :L], full.k[:, 0, :, :L], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        inc.truncate(1, 41)
    with pytest.raises(ValueError):
        drafter.extend_context(inc, taps[:30], [1], [30])  # 70 > max_len 64


def test_prompt_lookup_proposals():
    seq = [1, 2, 3, 10, 5, 2, 3, 11, 1, 2, 3]
    assert propose_ngram(seq, 3) == [10, 5, 2]  # longest (3-gram) match wins
    assert propose_ngram(seq, 3, max_ngram=2) == [11, 1, 2]  # most recent 2-gram
    assert propose_ngram([1, 2, 1], 5) == [2, 1]  # runs into the suffix, capped by the sequence
    assert propose_ngram([1, 2, 3, 4], 5) == []  # no match
    assert propose_ngram([7], 5) == []
    assert propose_ngram(seq, 0) == []
    p = one_hot_probs([4, 9], 16)
    assert p.shape == (2, 16) and p[0, 4] == 1 and p[1, 9] == 1 and p.sum() == 2


def _greedy_ar(target, prompt, n_new):
    cache = target.new_cache(1, 128)
    s = cache.allocate()
    out = target.forward(prompt, [SeqSpan(s, 0, len(prompt))], cache, torch.tensor([len(prompt) - 1]))
    seq = [int(out.logits[0].argmax())]
    while len(seq) < n_new:
        o = target.forward(torch.tensor(seq[-1:]), [SeqSpan(s, cache.lengths[s], 1)], cache, torch.tensor([0]))
        seq.append(int(o.logits[0].argmax()))
    return seq


def _greedy_spec(target, prompt, n_new, drafter=None, gamma=4):
    """The engine protocol of ``spec_round`` (see its docstring), one sequence, T = 0."""
    cache = target.new_cache(1, 128)
    s = cache.allocate()
    taps_at = drafter.tap_layers if drafter else ()
    out = target.forward(prompt, [SeqSpan(s, 0, len(prompt))], cache, torch.tensor([len(prompt) - 1]), taps_at)
    if drafter:
        dc = drafter.new_context_cache(1, 128)
        drafter.extend_context(dc, out.taps, [s], [len(prompt)])
    seq = prompt.tolist() + [int(out.logits[0].argmax())]
    params = (torch.zeros(1), torch.zeros(1, dtype=torch.long), torch.ones(1))
    gens, accepted = _gens(0), 0
    while len(seq) - len(prompt) < n_new:
        p, anchor = cache.lengths[s], torch.tensor(seq[-1:])
        if drafter:
            ds = drafter.sample_block(drafter.propose(anchor, [s], dc, gamma), anchor, SamplingBatch(*params, gens))
            drafts, probs = ds.tokens[0], ds.probs[0]
        else:
            prop = propose_ngram(seq, gamma)
            drafts, probs = torch.tensor(prop, dtype=torch.long), one_hot_probs(prop, V)
        ell = len(drafts)
        o = target.forward(torch.cat([anchor, drafts]), [SeqSpan(s, p, ell + 1)], cache, torch.arange(ell + 1), taps_at)
        res = spec_round(o.logits, probs, drafts, [ell], [p], *params, gens)
        cache.truncate(s, res.keep_target[0])
        if drafter:
            drafter.extend_context(dc, o.taps[res.commit_rows], [s], res.commit_counts)
            assert dc.lengths[s] == cache.lengths[s]
        seq += res.tokens[0]
        accepted += int(res.verify.accepted[0])
        assert cache.lengths[s] == len(seq) - 1  # the new anchor is pending
    return seq[len(prompt) :][:n_new], accepted


def test_greedy_speculative_equals_ar_end_to_end(target_fp32, drafter):
    g = torch.Generator().manual_seed(6)
    pattern = torch.randint(100, 20000, (6,), generator=g)
    prompt = torch.cat([torch.randint(100, 20000, (5,), generator=g), pattern, pattern, pattern])
    n_new = 20
    ar = _greedy_ar(target_fp32, prompt, n_new)
    spec_dspark, _ = _greedy_spec(target_fp32, prompt, n_new, drafter)
    spec_lookup, acc_lookup = _greedy_spec(target_fp32, prompt, n_new)
    assert spec_dspark == ar
    assert spec_lookup == ar
    assert acc_lookup > 0  # the repetitive prompt makes prompt lookup accept drafts


def test_export_casts_every_float_tensor_and_keeps_the_config(target_fp32, tmp_path):
    from safetensors.torch import load_file

    from runtime.speculation.checkpoint import export_checkpoint

    cfg = DrafterConfig(markov_rank=32, num_layers=1, init_seed=5, sts_temperatures=[1.0, 1.2, 0.9, 1.0, 1.1, 1.3, 2.0])
    d = DSparkDrafter(target_fp32, cfg)
    save_drafter(d, tmp_path / "src")
    (tmp_path / "src" / "calibration.json").write_text('{"ece_after": [0.01]}')
    (tmp_path / "src" / "draft_vocab.json").write_text('{"size": 16}')
    info = export_checkpoint(tmp_path / "src", tmp_path / "dst")
    src = load_file(str(tmp_path / "src" / "model.safetensors"))
    dst = load_file(str(tmp_path / "dst" / "model.safetensors"))
    assert info["tensors"] == len(src) == len(dst) and info["dtype"] == "bfloat16"
    assert all(dst[k].dtype == torch.bfloat16 for k in dst if src[k].is_floating_point())
    assert any(src[k].dtype == torch.float32 for k in src)  # there was something to cast
    assert all(torch.equal(dst[k].float(), src[k].to(torch.bfloat16).float()) for k in src)
    assert info["bytes"] < 0.6 * (tmp_path / "src" / "model.safetensors").stat().st_size
    assert (tmp_path / "dst" / "calibration.json").read_text() == '{"ece_after": [0.01]}'
    assert (tmp_path / "dst" / "draft_vocab.json").read_text() == '{"size": 16}'
    loaded = load_drafter(tmp_path / "dst", target_fp32)
    assert loaded.cfg == cfg  # STS temperatures travel in config.json
    with pytest.raises(FileNotFoundError):
        export_checkpoint(tmp_path / "nowhere", tmp_path / "x")
