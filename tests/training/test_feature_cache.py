"""The teacher-feature disk cache (training/feature_cache.py): layout, equality with the
online teacher features and loss, resumable multi-process build, key checks, and training from it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from runtime.speculation.config import DrafterConfig
from training.data import DrafterData, Sample, load_data, write_shard
from runtime.speculation.drafter import DSparkDrafter
from training.feature_cache import CacheLayout, FeatureCache, build_feature_cache
from training.features import TeacherHead, teacher_forward
from training.train import TrainConfig, micro_batch_loss, train
from tests.support.drafter_data import tiny_sequences

TAPS = [2, 8, 14, 20, 26]


def _layout_data(lens, plens) -> DrafterData:
    offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    n = len(lens)
    return DrafterData(np.zeros(int(offs[-1]), np.uint16), offs, np.array(plens, np.int32), np.array(["x"] * n),
                       np.array(["chat"] * n), np.array(["stop"] * n), np.zeros(n, bool))  # fmt: skip


def test_layout_cuts_to_max_len_and_keeps_only_block_target_rows():
    # L = 30 / prompt 10 → 19 rows (positions 10..28); L = 50 cut to 40 / prompt 12 → 27 rows;
    # prompt 45 cut to 40 = L → no rows; L = 11 / prompt 10 → 0 rows (position 10 is the last token).
    lay = CacheLayout.of(_layout_data([30, 50, 60, 11], [10, 12, 45, 10]), max_len=40)
    assert lay.lengths.tolist() == [30, 40, 40, 11]
    assert lay.prompt_lens.tolist() == [10, 12, 40, 10]
    assert lay.tok_off.tolist() == [0, 30, 70, 110, 121]
    assert lay.resp_off.tolist() == [0, 19, 46, 46, 46]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
    """Eight short chat sequences (two held out) written as a data dir."""
    samples = [Sample(f"t:{i}", "chat", ids, plen, "stop", i in (3, 6))
               for i, (ids, plen) in enumerate(tiny_sequences(tokenizer))]  # fmt: skip
    d = tmp_path_factory.mktemp("tinydata")
    write_shard(d, 0, samples)
    return d


MAX_LEN = 24  # cuts most responses, so the cut is exercised


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_dir, model_dir):
    """A cache built in two steps (resume) by two worker processes."""
    path = tmp_path_factory.mktemp("fc") / "cache"
    first = build_feature_cache(path, tiny_dir, TAPS, max_len=MAX_LEN, workers=2, limit=5, progress=False)
    second = build_feature_cache(path, tiny_dir, TAPS, max_len=MAX_LEN, workers=2, progress=False)
    return path, first, second


@pytest.mark.model
def test_build_is_resumable_and_complete(built, tiny_dir):
    path, first, second = built
    assert (first["done"], first["new"]) == (5, 5)
    assert (second["done"], second["new"]) == (8, 3)  # only the missing ones
    data = load_data(tiny_dir)
    cache = FeatureCache.open(path, data)
    assert len(cache.missing()) == 0
    assert first["new_tokens"] + second["new_tokens"] == int(cache.layout.lengths.sum())
    again = build_feature_cache(path, tiny_dir, TAPS, max_len=MAX_LEN, workers=2, progress=False)
    assert again["new"] == 0


@pytest.mark.model
def test_cached_features_equal_the_online_teacher(built, tiny_dir, target_fp32):
    path, _, _ = built
    data = load_data(tiny_dir)
    cache = FeatureCache.open(path, data)
    rows = [0, 1, 2, 5]
    lay = cache.layout
    seqs = [data.sequence(i)[: lay.lengths[i]] for i in rows]
    plens = [int(lay.prompt_lens[i]) for i in rows]
    c = cache.batch(rows, seqs)
    o = teacher_forward(target_fp32, seqs, plens, TAPS)
    assert c.tokens.tolist() == o.tokens.tolist() and c.lengths.tolist() == o.lengths.tolist()
    assert c.prompt_lens.tolist() == plens
    # taps are stored in bf16: within its rounding of the fp32 teacher's
    torch.testing.assert_close(c.taps, o.taps, rtol=8e-3, atol=1e-3)
    assert not torch.equal(c.taps, o.taps)  # (really rounded, not a copy of the fp32 tensor)
    for b, i in enumerate(rows):
        n, p = int(lay.lengths[i]), plens[b]
        assert n - 1 > p  # each of these has block-target rows
        torch.testing.assert_close(c.hidden[b, p : n - 1], o.hidden[b, p : n - 1].float(), rtol=0, atol=1e-4)
        want = torch.logsumexp(target_fp32.lm_head(o.hidden[b, p : n - 1]), -1)
        torch.testing.assert_close(c.lse[b, p : n - 1], want, rtol=0, atol=1e-4)
        assert float(c.hidden[b, :p].abs().sum()) == 0.0 and float(c.lse[b, n - 1 :].abs().sum()) == 0.0

    # The loss from cached features (p_t over the draft vocabulary via the cached logsumexp)
    # equals the online loss up to the taps' bf16 rounding.
    dr = DSparkDrafter(target_fp32, DrafterConfig(init_seed=2))
    with torch.no_grad():
        dr.markov.w2.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    vocab = torch.randperm(49152, generator=torch.Generator().manual_seed(1))[:4096]
    vocab = torch.unique(torch.cat([vocab, torch.as_tensor(np.concatenate(seqs))]))
    with torch.no_grad():
        lc, _ = micro_batch_loss(dr, target_fp32, seqs, plens, 6, torch.Generator().manual_seed(3), tb=c, vocab=vocab)
        lo, _ = micro_batch_loss(dr, target_fp32, seqs, plens, 6, torch.Generator().manual_seed(3), tb=o, vocab=vocab)
    assert lc.num_slots == lo.num_slots > 20
    assert lc.l1 == pytest.approx(lo.l1, abs=2e-3)
    assert lc.ce == pytest.approx(lo.ce, abs=2e-2)
    assert float(lc.total) == pytest.approx(float(lo.total), abs=1e-2)


@pytest.mark.model
def test_teacher_head_with_logsumexp_equals_the_full_softmax(target_fp32):
    h = torch.randn(5, 576, generator=torch.Generator().manual_seed(0))
    full = torch.log_softmax(target_fp32.lm_head(h), -1)
    vocab = torch.tensor([2, 7, 100, 30000, 49151])
    head = TeacherHead(target_fp32, vocab)
    lse = torch.logsumexp(target_fp32.lm_head(h), -1)
    # log-probs of ~−10…−30, where fp32's ulp is 1–2e-6: a few ulps of GEMM-order difference allowed
    torch.testing.assert_close(head.log_probs(h, lse), full[:, vocab], rtol=2e-6, atol=1e-5)
    torch.testing.assert_close(head.log_probs(h), full[:, vocab], rtol=2e-6, atol=1e-5)
    torch.testing.assert_close(TeacherHead(target_fp32).log_probs(h), full, rtol=2e-6, atol=1e-5)


@pytest.mark.model
def test_cache_refuses_other_settings(built, tiny_dir, tmp_path):
    path, _, _ = built
    data = load_data(tiny_dir)
    cache = FeatureCache.open(path, data)
    cache.check(data, TAPS, MAX_LEN)
    with pytest.raises(ValueError, match="tap_layers"):
        cache.check(data, [1, 2, 3], MAX_LEN)
    with pytest.raises(ValueError, match="max_len"):
        cache.check(data, TAPS, MAX_LEN + 1)
    with pytest.raises(ValueError, match="max_len"):
        build_feature_cache(path, tiny_dir, TAPS, max_len=MAX_LEN + 1, workers=1, progress=False)
    other = DrafterData(data.tokens.copy(), data.offsets, data.prompt_lens, data.ids, data.categories, data.finish,
                        data.heldout)  # fmt: skip
    other.tokens[5] += 1
    with pytest.raises(ValueError, match="data_sha1"):
        cache.check(other, TAPS, MAX_LEN)
    with pytest.raises(FileNotFoundError):
        FeatureCache.open(tmp_path / "nothing", data)


@pytest.mark.model
def test_training_from_the_cache_lowers_the_loss(built, tiny_dir, target_fp32, tmp_path):
    path, _, _ = built
    dcfg = DrafterConfig(num_layers=1, markov_rank=16).to_dict()
    cfg = TrainConfig(data_dir=str(tiny_dir), out=str(tmp_path / "ck"), drafter=dcfg, seqs_per_micro=4,
                      anchors_per_seq=6, accum=1, max_len=MAX_LEN, lr=1e-3, warmup_frac=0.0, steps=8, save_every=0,
                      val_every=4, val_seqs=2, threads=2, feature_cache=str(path))  # fmt: skip
    r = train(cfg, target=target_fp32, progress=False)
    assert r["steps"] == 8
    rows = [json.loads(x) for x in (tmp_path / "ck" / "train_log.jsonl").read_text().splitlines()]
    val = [x for x in rows if x["kind"] == "val"]
    assert [x["step"] for x in val] == [0, 4, 8]
    assert val[-1]["loss"] < val[0]["loss"] - 0.3 and val[-1]["ce"] < val[0]["ce"] - 1.0
    # A cache without these sequences (built for another max_len) is refused up front.
    with pytest.raises(ValueError, match="max_len"):
        train(TrainConfig(**{**cfg.__dict__, "max_len": MAX_LEN + 8, "out": str(tmp_path / "ck2")}),
              target=target_fp32, progress=False)  # fmt: skip
