"""Drafter training pipeline: data order/shards/regeneration, the batched training
forward vs. the serving forward, the loss, and a tiny training smoke run (real target, fp32)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from runtime.speculation.config import DrafterConfig
from training.data import (
    CATEGORIES,
    DrafterData,
    RegenConfig,
    Sample,
    balanced_order,
    done_ids,
    is_heldout,
    load_data,
    load_train_prompts,
    regenerate,
    write_shard,
)
from runtime.speculation.drafter import DSparkDrafter
from training.features import block_targets, sample_anchors, target_log_probs, teacher_forward
from training.train import (
    TrainConfig,
    block_forward,
    confidence_logits,
    draft_log_probs,
    dspark_loss,
    init_drafter,
    lr_at,
    micro_batch_loss,
    position_weights,
    train,
)
from runtime.engine.sampler import SamplingBatch
from tests.support.drafter_data import tiny_sequences

V = 49152


# -- data (no model) ----------------------------------------------------------------------

def test_balanced_order_prefixes_and_heldout_split():
    prompts = load_train_prompts()
    assert len(prompts) > 30000
    order = balanced_order(prompts, 400, seed=0)
    assert len({p["id"] for p in order}) == 400
    for n in (4, 40, 400):
        assert Counter(p["category"] for p in order[:n]) == {c: n // 4 for c in CATEGORIES}
    assert balanced_order(prompts, 400, seed=0) == order  # fixed
    assert [p["id"] for p in balanced_order(prompts, 40, seed=1)] != [p["id"] for p in order[:40]]
    assert [p["id"] for p in balanced_order(prompts, 1000, 0)[:400]] == [p["id"] for p in order]  # prefix-stable
    frac = np.mean([is_heldout(p["id"]) for p in prompts])
    assert 0.04 < frac < 0.06


def test_shards_round_trip(tmp_path):
    a = [Sample("x:1", "chat", [1, 2, 3, 4], 2, "stop", False), Sample("x:2", "code", [5, 6, 49151], 1, "length", True)]
    write_shard(tmp_path, 0, a)
    write_shard(tmp_path, 1, [Sample("x:3", "math", [7, 8], 1, "stop", False)])
    d = load_data(tmp_path)
    assert len(d) == 3 and d.sequence(1).tolist() == [5, 6, 49151] and d.sequence(2).tolist() == [7, 8]
    assert d.prompt_lens.tolist() == [2, 1, 1] and d.indices("heldout").tolist() == [1]
    assert d.response_tokens() == 2 + 2 + 1
    assert done_ids(tmp_path) == {"x:1", "x:2", "x:3"}
    assert d.tokens.dtype == np.uint16


@pytest.mark.model
def test_regen_is_resumable_and_balanced(tmp_path, target_fp32, tokenizer):
    cfg = RegenConfig(num_prompts=4, max_new_tokens=5, dtype="float32", max_batch_size=2)
    s1 = regenerate(cfg, tmp_path, shard_size=1, limit=2, model=target_fp32, tokenizer=tokenizer, progress=False)
    assert s1.new_prompts == 2 and len(done_ids(tmp_path)) == 2
    s2 = regenerate(cfg, tmp_path, shard_size=8, model=target_fp32, tokenizer=tokenizer, progress=False)
    assert s2.new_prompts == 2 and s2.prompts_done == 4
    d = load_data(tmp_path)
    assert sorted(d.categories.tolist()) == sorted(CATEGORIES)
    for i in range(len(d)):
        seq, n = d.sequence(i), int(d.prompt_lens[i])
        resp = seq[n:]
        assert 1 <= len(resp) <= 5
        assert (d.finish[i] == "stop") == (resp[-1] == 2)  # EOS ends "stop" responses
        assert tokenizer.decode(seq[:n].tolist()).rstrip().endswith("assistant")
    man = json.loads((tmp_path / "manifest.json").read_text())
    assert man["summary"]["sequences"] == 4
    with pytest.raises(ValueError):  # different settings must not mix into the same dir
        regenerate(RegenConfig(num_prompts=4, max_new_tokens=6, dtype="float32"), tmp_path,
                   model=target_fp32, tokenizer=tokenizer, progress=False)


# -- forward equivalence -------------------------------------------------------------------

@pytest.fixture(scope="module")
def teacher_batch(target_fp32):
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, V, (n,), generator=g) for n in (30, 45, 20)]
    dr = DSparkDrafter(target_fp32, DrafterConfig(init_seed=3))
    return teacher_forward(target_fp32, seqs, [10, 12, 8], dr.tap_layers)


@pytest.mark.model
@pytest.mark.parametrize("variant", ["vanilla", "gated"])
def test_training_forward_equals_serving_forward(target_fp32, teacher_batch, variant):
    """block_forward (batched, masked) == extend_context + forward_block/propose/sample_block."""
    tb = teacher_batch
    dr = DSparkDrafter(target_fp32, DrafterConfig(init_seed=3, markov_variant=variant))
    with torch.no_grad():  # non-trivial Markov weights (W2 starts random but make sure)
        dr.markov.w2.weight.normal_(0, 0.2, generator=torch.Generator().manual_seed(1))
    anchors, ok = sample_anchors(tb.prompt_lens, tb.lengths, 5, torch.Generator().manual_seed(2))
    bt = block_targets(tb, anchors, ok, 7)
    with torch.no_grad():
        h = block_forward(dr, tb.taps, anchors, bt.anchor_tokens)
    checked = 0
    for i in range(tb.lengths.numel()):
        for a in range(anchors.shape[1]):
            if not ok[i, a]:
                continue
            p = int(anchors[i, a])
            dc = dr.new_context_cache(1, 64)
            dr.extend_context(dc, tb.taps[i, :p], [0], [p])
            anchor = bt.anchor_tokens[i, a : a + 1]
            blk = dr.propose(anchor, [0], dc)
            torch.testing.assert_close(blk.hidden[0], h[i, a], atol=2e-5, rtol=1e-5)
            # p_d of the loss (teacher-forced prev) == serving p_d when prev = the sampled tokens
            ds = dr.sample_block(blk, anchor, SamplingBatch(torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1),
                                                            [torch.Generator().manual_seed(p)]))
            prev = torch.cat([anchor, ds.tokens[0, :-1]])
            with torch.no_grad():
                lp = draft_log_probs(dr, h[i, a], prev)
                z = confidence_logits(dr, h[i, a], prev)
            torch.testing.assert_close(lp.exp(), ds.probs[0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(z, ds.confidence_logits[0], atol=1e-4, rtol=1e-4)
            checked += 1
    assert checked >= 10


def test_sample_anchors_of_a_sequence_with_no_response_stay_inside_it():
    """A prompt cut at max_len fills the whole sequence: no valid anchor, and the placeholder
    anchor must still index a token of it (a real crash at step ~59 of a 5,500-sequence run)."""
    from training.features import TeacherBatch

    prompt_lens, lengths = torch.tensor([768, 5, 3]), torch.tensor([768, 9, 3])
    anchors, ok = sample_anchors(prompt_lens, lengths, 4, torch.Generator().manual_seed(0))
    assert not ok[0].any() and not ok[2].any() and ok[1].sum() == 3  # anchors 5, 6, 7 of [5, 9 − 2]
    assert (anchors < lengths[:, None]).all() and anchors[1, :3].tolist() == [5, 6, 7]
    N, L, d = 3, 768, 4
    tb = TeacherBatch(tokens=torch.randint(0, 50, (N, L)), lengths=lengths, prompt_lens=prompt_lens,
                      taps=torch.zeros(N, L, 1, d), hidden=torch.zeros(N, L, d))
    bt = block_targets(tb, anchors, ok, 7)
    assert not bt.valid[0].any() and bt.valid[1].sum() == 3 + 2 + 1  # slots up to position 8


@pytest.mark.model
def test_block_targets_and_loss_terms(target_fp32, teacher_batch):
    tb = teacher_batch
    dr = DSparkDrafter(target_fp32, DrafterConfig(init_seed=3))
    anchors = torch.tensor([[10, 27], [40, 43], [8, 18]])  # 43 → slot k valid iff 43+k ≤ 44; 18 → ≤ 19
    ok = torch.ones(3, 2, dtype=torch.bool)
    bt = block_targets(tb, anchors, ok, 7)
    assert bt.valid[1, 1].tolist() == [True] + [False] * 6
    assert bt.valid[2, 1].tolist() == [True] + [False] * 6
    assert bt.valid[0, 1].tolist() == [True, True] + [False] * 5  # L=30: 27+2 = 29
    assert bt.target_tokens[0, 0].tolist() == tb.tokens[0, 11:18].tolist()
    assert bt.prev_tokens[0, 0].tolist() == tb.tokens[0, 10:17].tolist()
    assert bt.anchor_tokens[1].tolist() == [int(tb.tokens[1, 40]), int(tb.tokens[1, 43])]
    logp_t = target_log_probs(target_fp32, bt.hidden_rows[bt.valid])
    # p_t row for (seq 0, anchor 10, k=1) is the target's distribution after position 10
    full = torch.log_softmax(target_fp32.lm_head(tb.hidden[0, 10:11]), -1)[0]
    torch.testing.assert_close(logp_t[0], full)
    with torch.no_grad():
        h = block_forward(dr, tb.taps, anchors, bt.anchor_tokens)
        lo = dspark_loss(dr, h, bt, logp_t)
        lp = draft_log_probs(dr, h[bt.valid], bt.prev_tokens[bt.valid])
    w = position_weights(7)
    assert w[0] == 1.0 and abs(float(w[6]) - np.exp(-6 / 7)) < 1e-6
    wk = w[torch.arange(7).expand(3, 2, 7)[bt.valid]]
    l1 = (lp.exp() - logp_t.exp()).abs().sum(-1)
    ce = -lp.gather(-1, bt.target_tokens[bt.valid][:, None])[:, 0]
    assert abs(lo.l1 - float((wk * l1).sum() / wk.sum())) < 1e-4
    assert abs(lo.ce - float((wk * ce).sum() / wk.sum())) < 1e-3
    assert abs(float(lo.total) - (0.1 * lo.ce + 0.9 * lo.l1 + lo.bce)) < 1e-4
    assert 0.0 <= lo.accept <= 1.0 and lo.l1 > 1.0  # a random drafter is far from the target
    assert lo.tau_prob[1] == 6 and 6.0 <= lo.tau_prob[0] <= 6 * 8


@pytest.mark.model
@pytest.mark.parametrize("variant", ["vanilla", "gated"])
def test_draft_vocab_loss_is_the_restricted_drafters_distance(target_fp32, teacher_batch, variant):
    """With a draft vocabulary D the loss is that of the served restricted drafter: p_d is the
    softmax over D (−∞ elsewhere), L1 = Σ_V |p_d − p_t| with p_d = 0 off D, CE over slots whose
    token is in D; with D = all ids it is the full loss."""
    tb = teacher_batch
    dr = DSparkDrafter(target_fp32, DrafterConfig(init_seed=5, markov_variant=variant))
    with torch.no_grad():
        dr.markov.w2.weight.normal_(0, 0.05)  # a non-zero Markov bias, so its restriction matters
    anchors = torch.tensor([[10, 20], [30, 36], [8, 12]])
    bt = block_targets(tb, anchors, torch.ones(3, 2, dtype=torch.bool), 7)
    logp_t = target_log_probs(target_fp32, bt.hidden_rows[bt.valid])
    tgt = bt.target_tokens[bt.valid]
    # D: every other id of a random permutation, half of the slots' own tokens left out of it.
    g = torch.Generator().manual_seed(0)
    others = torch.tensor(sorted(set(range(V)) - set(tgt.tolist())))
    D = torch.cat([tgt.unique()[::2], others[torch.randperm(others.numel(), generator=g)[:4000]]])
    with torch.no_grad():
        h = block_forward(dr, tb.taps, anchors, bt.anchor_tokens)
        lo = dspark_loss(dr, h, bt, logp_t, vocab=D)
        full = draft_log_probs(dr, h[bt.valid], bt.prev_tokens[bt.valid])
        restricted = draft_log_probs(dr, h[bt.valid], bt.prev_tokens[bt.valid], vocab=D)
        same = dspark_loss(dr, h, bt, logp_t, vocab=torch.arange(V))
        ref_full = dspark_loss(dr, h, bt, logp_t)
    off = torch.ones(V, dtype=torch.bool)
    off[D] = False
    dense = torch.log_softmax(full.masked_fill(off, float("-inf")), -1)  # the served p_d
    torch.testing.assert_close(restricted, dense[:, D], atol=1e-5, rtol=1e-5)
    wk = position_weights(7)[torch.arange(7).expand(3, 2, 7)[bt.valid]]
    l1 = (dense.exp() - logp_t.exp()).abs().sum(-1)
    inside = ~off[tgt]
    assert 0 < int(inside.sum()) < tgt.numel()
    ce = -dense.gather(-1, tgt[:, None])[:, 0][inside]
    assert lo.l1 == pytest.approx(float((wk * l1).sum() / wk.sum()), abs=1e-4)
    assert lo.ce == pytest.approx(float((wk[inside] * ce).sum() / wk[inside].sum()), abs=1e-3)
    assert lo.l1 > ref_full.l1  # mass off D is lost for sure
    for k in ("l1", "ce", "bce", "accept"):
        assert getattr(same, k) == pytest.approx(getattr(ref_full, k), abs=1e-4)


@pytest.mark.model
def test_warm_start_keeps_the_weights_drops_sts_and_copies_the_vocab(tmp_path, target_fp32, tokenizer):
    from runtime.speculation.checkpoint import load_drafter, read_config, save_drafter
    from runtime.speculation.fast_drafter import DRAFT_VOCAB_FILE

    data = _tiny_data(tokenizer)
    src = tmp_path / "src"
    dr = init_drafter(target_fp32, TrainConfig(drafter=DrafterConfig(num_layers=1, markov_rank=8).to_dict()))
    with torch.no_grad():
        dr.markov.w2.weight.normal_(0, 0.1)
    dr.cfg.sts_temperatures = [1.5] * 7
    save_drafter(dr, src)
    ids = sorted(set(data.tokens.tolist()))[:48]
    (src / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": ids, "size": 48}))
    # An architecture flag that disagrees with the checkpoint is ignored: the init's wins.
    cfg = TrainConfig(out=str(tmp_path / "ck"), drafter=DrafterConfig(num_layers=2).to_dict(), seqs_per_micro=4,
                      anchors_per_seq=4, max_len=64, steps=1, val_every=0, save_every=0, threads=2, lr=1e-9,
                      warmup_frac=0.0, init=str(src), draft_vocab=str(src))  # fmt: skip
    r = train(cfg, target=target_fp32, data=data, progress=False)
    out = tmp_path / "ck"
    assert read_config(out).num_layers == 1 and read_config(out).markov_rank == 8
    assert read_config(out).sts_temperatures is None
    assert json.loads((out / DRAFT_VOCAB_FILE).read_text())["token_ids"] == ids
    assert json.loads((out / "train_config.json").read_text())["drafter"]["num_layers"] == 1
    # lr 1e-9 for one step: the weights are the source's (the W2 noise survives), not a fresh init.
    a, b = load_drafter(src, target_fp32), r["drafter"]
    torch.testing.assert_close(b.markov.w2.weight, a.markov.w2.weight, atol=1e-6, rtol=0)
    assert float(a.markov.w2.weight.abs().sum()) > 1.0


# -- training smoke run --------------------------------------------------------------------

def _tiny_data(tokenizer) -> DrafterData:
    toks, offs, plens = [], [0], []
    for ids, plen in tiny_sequences(tokenizer):
        toks += ids[:64]
        offs.append(len(toks))
        plens.append(plen)
    n = len(plens)
    return DrafterData(np.array(toks, np.uint16), np.array(offs, np.int64), np.array(plens, np.int32),
                       np.array([f"t:{i}" for i in range(n)]), np.array(["chat"] * n), np.array(["stop"] * n),
                       np.array([False] * n))  # fmt: skip


@pytest.mark.model
def test_training_smoke_loss_falls_and_resumes(tmp_path, target_fp32, tokenizer):
    data = _tiny_data(tokenizer)
    dcfg = DrafterConfig(num_layers=1, markov_rank=16).to_dict()
    cfg = TrainConfig(out=str(tmp_path / "ck"), drafter=dcfg, seqs_per_micro=4, anchors_per_seq=6, accum=1,
                      max_len=64, lr=1e-3, warmup_frac=0.0, steps=6, save_every=3, val_every=0, threads=2)  # fmt: skip
    seqs = [data.sequence(i) for i in range(len(data))]
    plens = data.prompt_lens.tolist()

    def fixed_loss(dr):
        with torch.no_grad():
            lo, _ = micro_batch_loss(dr, target_fp32, seqs, plens, 6, torch.Generator().manual_seed(7))
        return lo

    cfg.steps = 3
    r1 = train(cfg, target=target_fp32, data=data, progress=False)
    assert r1["steps"] == 3
    before = fixed_loss(init_drafter(target_fp32, cfg))
    cfg.steps = 6
    r2 = train(cfg, target=target_fp32, data=data, progress=False)  # resumes at 3
    after = fixed_loss(r2["drafter"])
    rows = [json.loads(x) for x in (tmp_path / "ck" / "train_log.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert float(after.total) < float(before.total) - 0.3
    assert after.ce < before.ce - 2.0 and after.l1 < before.l1
    assert (tmp_path / "ck" / "learning_curve.png").stat().st_size > 1000
    from runtime.speculation.checkpoint import load_drafter

    reloaded = load_drafter(tmp_path / "ck", target_fp32)
    assert abs(float(fixed_loss(reloaded).total) - float(after.total)) < 1e-4


def test_lr_schedule_follows_the_time_budget_when_it_runs_out_first():
    cfg = TrainConfig(lr=1e-3, min_lr_ratio=0.1, warmup_frac=0.05, steps=100, max_minutes=10)
    assert lr_at(cfg, 0) == pytest.approx(1e-3 / 5)  # warmup: 5 steps
    assert lr_at(cfg, 5) == pytest.approx(1e-3)
    assert lr_at(cfg, 100) == pytest.approx(1e-4)
    # Step 10 of 100 but 5 of 10 minutes gone: the cosine is half-way, not at 5/95.
    assert lr_at(cfg, 10, elapsed_s=300) == pytest.approx(1e-4 + 0.9e-3 * 0.5)
    assert lr_at(cfg, 10, elapsed_s=600) == pytest.approx(1e-4)
    assert lr_at(cfg, 90, elapsed_s=60) == pytest.approx(lr_at(cfg, 90))  # steps further along: they rule
    no_budget = TrainConfig(lr=1e-3, steps=100)
    assert lr_at(no_budget, 10, elapsed_s=1e9) == lr_at(no_budget, 10)


@pytest.mark.model
def test_bf16_autocast_step_is_close_to_fp32_and_keeps_fp32_master_grads(target_fp32, teacher_batch):
    dr = init_drafter(target_fp32, TrainConfig(drafter=DrafterConfig(init_seed=4).to_dict())).requires_grad_(True)
    with torch.no_grad():
        dr.markov.w2.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))

    def run(dtype):
        dr.zero_grad(set_to_none=True)
        lo, _ = micro_batch_loss(dr, target_fp32, [], [], 8, torch.Generator().manual_seed(3), tb=teacher_batch,
                                 compute_dtype=dtype)  # fmt: skip
        lo.total.backward()
        return lo, {n: p.grad.clone() for n, p in dr.named_parameters() if p.grad is not None}

    lo32, g32 = run("float32")
    lo16, g16 = run("bfloat16")
    assert lo16.num_slots == lo32.num_slots > 20
    assert lo16.l1 == pytest.approx(lo32.l1, abs=0.02) and lo16.ce == pytest.approx(lo32.ce, rel=0.02)
    assert lo16.l1 != lo32.l1  # really computed in bf16
    assert set(g16) == set(g32) and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in g16.values())
    for n in ("layers.0.mlp.down_proj.weight", "fc.weight", "markov.w2.weight"):
        cos = torch.nn.functional.cosine_similarity(g16[n].flatten(), g32[n].flatten(), dim=0)
        assert cos > 0.95, (n, float(cos))
    with pytest.raises(ValueError, match="compute_dtype"):
        micro_batch_loss(dr, target_fp32, [], [], 8, torch.Generator(), tb=teacher_batch, compute_dtype="float16")
