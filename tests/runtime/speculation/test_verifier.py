"""Speculative sampling (runtime.speculation.verifier) is lossless; planted bugs are caught.

Synthetic setting: vocabulary V = 8, γ = 3. The target is a Markov chain over tokens
(p_t(· | prefix) = P_t[last token]); the drafter has per-(anchor, slot) base logits
plus a strong rank-4 Markov head (the real :class:`MarkovHead`), drawn through the
real :func:`sample_block`. Full speculative rounds are simulated for N = 20000
sequences at once until each has ≥ 3 output tokens; the joint distribution of the
first three output tokens must match the target chain's (chi-square).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from unittest import mock

import pytest
import torch
from scipy import stats

from runtime.speculation.confidence_head import ConfidenceHead
from runtime.speculation.drafter import sample_block
from runtime.speculation.markov_head import MarkovHead
from runtime.speculation import verifier
from runtime.speculation.verifier import spec_round, verify
from runtime.engine.sampler import SamplingBatch, warp_probs

V, GAMMA, RANK, HID = 8, 3, 4, 4
N = 20000
A0 = 0  # initial anchor of every simulated sequence


def _tables(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    target_logits = 1.5 * torch.randn(V, V, generator=g)  # row = previous token
    base = 1.5 * torch.randn(V, GAMMA, V, generator=g)  # [anchor, slot, V]
    head = MarkovHead(V, RANK, HID, "vanilla")
    with torch.no_grad():
        head.w1.weight.copy_(1.5 * torch.randn(V, RANK, generator=g))
        head.w2.weight.copy_(1.5 * torch.randn(V, RANK, generator=g))
    conf = ConfidenceHead(HID, RANK)
    return target_logits, base, head, conf


def _params(n: int, warp: tuple[float, int, float]):
    t, k, p = warp
    return torch.full((n,), t), torch.full((n,), k, dtype=torch.long), torch.full((n,), p)


@contextmanager
def residual_from_target():
    """Planted bug (a context manager): the extra token after a rejection is drawn from
    p_t instead of norm(max(0, p_t − p_d)) — :func:`verifier.residual` patched, in the torch
    specification (its C++ twin, which returns the same tokens, is turned off meanwhile)."""
    with mock.patch.object(verifier, "residual", lambda p_t, p_d: p_t), \
            mock.patch.object(verifier, "cpu_verify_path", lambda t: False):
        yield


def simulate(warp, *, bug: str | None = None, n: int = N, seed: int = 1) -> torch.Tensor:
    """First three output tokens of n sequences under full speculative rounds.

    ``bug``: None (correct), ``"residual_from_target"`` or ``"pre_markov_pd"``
    (verification uses the base distribution without the Markov bias while the
    drafts are sampled from the corrected one).
    """
    target_logits, base, head, conf = _tables()
    g = torch.Generator().manual_seed(seed)
    out = torch.full((n, 3 + GAMMA + 1), -1, dtype=torch.long)
    count = torch.zeros(n, dtype=torch.long)
    anchors = torch.full((n,), A0, dtype=torch.long)
    total_acc = total_rounds = 0
    while True:
        act = (count < 3).nonzero().squeeze(-1)
        B = act.numel()
        if B == 0:
            break
        anc = anchors[act]
        temp, tk, tp = _params(B, warp)
        U = base[anc]
        ds = sample_block(head, conf, U, torch.zeros(B, GAMMA, HID), anc, SamplingBatch(temp, tk, tp, [g] * B))
        inputs = torch.cat([anc[:, None], ds.tokens], dim=1)  # anchor + drafts
        rep = lambda x, r: x.repeat_interleave(r)  # noqa: E731
        p_t = warp_probs(target_logits[inputs].reshape(-1, V), rep(temp, GAMMA + 1), rep(tk, GAMMA + 1), rep(tp, GAMMA + 1))
        p_d = ds.probs.reshape(-1, V)
        if bug == "pre_markov_pd":
            p_d = warp_probs(U.reshape(-1, V), rep(temp, GAMMA), rep(tk, GAMMA), rep(tp, GAMMA))
        with residual_from_target() if bug == "residual_from_target" else nullcontext():
            res = verify(p_t, p_d, ds.tokens.reshape(-1), [GAMMA] * B, [g] * B)
        a = res.accepted
        emitted = torch.cat([ds.tokens, torch.zeros(B, 1, dtype=torch.long)], dim=1)
        emitted[torch.arange(B), a] = res.next_tokens
        j = torch.arange(GAMMA + 1)
        keep = j[None] <= a[:, None]
        rows = act[:, None].expand(-1, GAMMA + 1)[keep]
        cols = (count[act][:, None] + j[None])[keep]
        out[rows, cols] = emitted[keep]
        count[act] += a + 1
        anchors[act] = res.next_tokens
        total_acc += int(a.sum())
        total_rounds += B
    simulate.mean_accepted = total_acc / total_rounds
    return out[:, :3]


def expected_joint(warp) -> torch.Tensor:
    """P(y1, y2, y3) of the (warped) target chain from A0, flattened [V³]."""
    target_logits, *_ = _tables()
    P = warp_probs(target_logits, *_params(V, warp)).double()
    y1, y2, y3 = torch.meshgrid(torch.arange(V), torch.arange(V), torch.arange(V), indexing="ij")
    joint = P[A0][y1] * P[y1, y2] * P[y2, y3]
    return joint.reshape(-1)


def chi2_p(first3: torch.Tensor, probs: torch.Tensor) -> float:
    idx = first3[:, 0] * V * V + first3[:, 1] * V + first3[:, 2]
    obs = torch.bincount(idx, minlength=V**3).double()
    exp = probs * first3.shape[0]
    big = exp >= 5
    o = torch.cat([obs[big], obs[~big].sum()[None]])
    e = torch.cat([exp[big], exp[~big].sum()[None]])
    if e[-1] < 5:  # fold the tail bucket into the smallest kept cell
        i = int(e[:-1].argmin())
        o[i] += o[-1]
        e[i] += e[-1]
        o, e = o[:-1], e[:-1]
    stat = float(((o - e) ** 2 / e).sum())
    return float(stats.chi2.sf(stat, len(e) - 1))


def test_synthetic_pair_is_far_apart_and_markov():
    """The setting is hard enough: mean TV(p_t, p_d) ≥ 0.3 and p_d depends on x_{k−1}."""
    target_logits, base, head, _ = _tables()
    P = torch.softmax(target_logits, -1)  # [prev, V]
    prev = torch.arange(V)
    with torch.no_grad():
        pd = torch.softmax(base[:, :, None, :] + head.bias(prev)[None, None], -1)  # [anchor, k, prev, V]
    tv = 0.5 * (pd - P[None, None]).abs().sum(-1)
    assert tv.mean() >= 0.3
    markov_tv = 0.5 * (pd[:, :, :, None] - pd[:, :, None, :]).abs().sum(-1)  # across prev tokens
    assert markov_tv.mean() >= 0.3


@pytest.mark.slow
def test_t1_joint_matches_target():
    first3 = simulate((1.0, 0, 1.0))
    assert 0.1 < simulate.mean_accepted < 2.9  # both accept and reject paths exercised
    assert chi2_p(first3, expected_joint((1.0, 0, 1.0))) > 0.01


@pytest.mark.slow
def test_warped_joint_matches_warped_target():
    """Temperature 0.7 + top-k 5 + top-p 0.9 on both sides: output = warped target."""
    warp = (0.7, 5, 0.9)
    first3 = simulate(warp, seed=2)
    assert chi2_p(first3, expected_joint(warp)) > 0.01


@pytest.mark.slow
def test_planted_bug_residual_from_target_is_caught():
    first3 = simulate((1.0, 0, 1.0), bug="residual_from_target")
    assert chi2_p(first3, expected_joint((1.0, 0, 1.0))) < 1e-4


@pytest.mark.slow
def test_planted_bug_pre_markov_pd_is_caught():
    first3 = simulate((1.0, 0, 1.0), bug="pre_markov_pd")
    assert chi2_p(first3, expected_joint((1.0, 0, 1.0))) < 1e-4


def test_greedy_reduces_to_argmax_match():
    g = torch.Generator().manual_seed(3)
    R, Vb = 300, 50
    lens = torch.randint(0, 8, (R,), generator=g)
    T, D = int((lens + 1).sum()), int(lens.sum())
    logits = torch.randn(T, Vb, generator=g)
    p_t = warp_probs(logits, torch.zeros(T), torch.zeros(T, dtype=torch.long), torch.ones(T))
    best = logits.argmax(-1)
    req = torch.repeat_interleave(torch.arange(R), lens)
    d_rows = torch.arange(D) + req  # target row judging each draft
    match = torch.rand(D, generator=g) < 0.75
    other = (best[d_rows] + torch.randint(1, Vb, (D,), generator=g)) % Vb
    drafts = torch.where(match, best[d_rows], other)
    p_d = torch.zeros(D, Vb)
    p_d[torch.arange(D), drafts] = 1.0
    res = verify(p_t, p_d, drafts, lens, [torch.Generator().manual_seed(i) for i in range(R)])
    d_off = torch.cumsum(lens, 0) - lens
    for r in range(R):
        m = match[d_off[r] : d_off[r] + lens[r]].tolist() + [False]
        a = m.index(False)
        assert res.accepted[r] == a
        assert res.next_tokens[r] == best[d_off[r] + r + a]
    assert 0 < int(res.accepted.sum()) < D


def test_verify_greedy_equals_verify_on_one_hot_targets():
    """spec_round's greedy path (argmax only) decides every round as verify() on
    warp_probs' one-hot rows — for any draft distribution, and with tied maxima."""
    g = torch.Generator().manual_seed(11)
    R, Vb = 200, 12
    lens = torch.randint(0, 6, (R,), generator=g)
    T, D = int((lens + 1).sum()), int(lens.sum())
    logits = torch.randint(0, 4, (T, Vb), generator=g).float()  # many ties
    p_t = warp_probs(logits, torch.zeros(T), torch.zeros(T, dtype=torch.long), torch.ones(T))
    req = torch.repeat_interleave(torch.arange(R), lens)
    best = logits.argmax(-1)[torch.arange(D) + req]
    p_d = torch.softmax(torch.randn(D, Vb, generator=g), -1)  # non-one-hot drafts
    drafts = torch.where(torch.rand(D, generator=g) < 0.7, best, torch.multinomial(p_d, 1, generator=g)[:, 0])
    ref = verify(p_t, p_d, drafts, lens, [torch.Generator().manual_seed(i) for i in range(R)])
    got = verifier.verify_greedy(logits, drafts, lens)
    assert torch.equal(got.accepted, ref.accepted) and torch.equal(got.next_tokens, ref.next_tokens)
    assert got.tokens() == ref.tokens()
    assert 0 < int(got.accepted.sum()) < D
    z, k0, p1 = torch.zeros(R), torch.zeros(R, dtype=torch.long), torch.ones(R)
    gens = [torch.Generator().manual_seed(i) for i in range(R)]
    res = spec_round(logits, None, drafts, lens.tolist(), [0] * R, z, k0, p1, gens)  # p_d not needed at T=0
    assert res.tokens == ref.tokens()
    with pytest.raises(ValueError, match="draft_probs"):
        spec_round(logits, None, drafts, lens.tolist(), [0] * R, torch.ones(R), k0, p1, gens)
    with pytest.raises(ValueError):
        verifier.verify_greedy(logits[1:], drafts, lens)


def test_greedy_spec_rounds_equal_greedy_ar():
    """T = 0 speculative decoding through spec_round emits exactly the greedy chain."""
    g = torch.Generator().manual_seed(4)
    Vb = 16
    target_logits = torch.randn(Vb, Vb, generator=g)
    head = MarkovHead(Vb, Vb, HID, "vanilla")
    with torch.no_grad():  # draft ≈ target chain + noise: partial acceptance
        head.w1.weight.copy_(torch.eye(Vb))
        head.w2.weight.copy_((target_logits + 0.6 * torch.randn(Vb, Vb, generator=g)).T)
    conf = ConfidenceHead(HID, Vb)
    ar = [3]
    while len(ar) < 60:
        ar.append(int(target_logits[ar[-1]].argmax()))
    seq, accepted, rejected = [3], 0, 0
    zero, k0, p1 = torch.zeros(1), torch.zeros(1, dtype=torch.long), torch.ones(1)
    gen = [torch.Generator().manual_seed(0)]
    while len(seq) < 60:
        anc = torch.tensor([seq[-1]])
        gamma = 1 + len(seq) % 5  # varying verified lengths
        ds = sample_block(head, conf, torch.zeros(1, gamma, Vb), torch.zeros(1, gamma, HID), anc, SamplingBatch(zero, k0, p1, gen))
        inputs = torch.cat([anc, ds.tokens[0]])
        res = spec_round(
            target_logits[inputs], ds.probs[0], ds.tokens[0], [gamma], [len(seq) - 1], zero, k0, p1, gen
        )
        a = int(res.verify.accepted[0])
        accepted += a
        rejected += a < gamma
        assert res.commit_counts == [a + 1] and res.commit_rows.tolist() == list(range(a + 1))
        assert res.keep_target == [len(seq) - 1 + a + 1]
        seq += res.tokens[0]
    assert seq[:60] == ar
    assert accepted > 0 and rejected > 0


def test_ragged_batch_equals_each_request_alone():
    g = torch.Generator().manual_seed(5)
    Vb = 16
    lens = [0, 3, 7]
    T, D = sum(lens) + len(lens), sum(lens)
    p_t = torch.softmax(torch.randn(T, Vb, generator=g), -1)
    p_d = torch.softmax(torch.randn(D, Vb, generator=g), -1)
    drafts = torch.multinomial(p_d, 1, generator=g).squeeze(-1)
    seeds = [11, 12, 13]
    for trial in range(20):
        gens = [torch.Generator().manual_seed(s + 100 * trial) for s in seeds]
        res = verify(p_t, p_d, drafts, lens, gens)
        t0 = d0 = 0
        for r, ell in enumerate(lens):
            alone = verify(
                p_t[t0 : t0 + ell + 1], p_d[d0 : d0 + ell], drafts[d0 : d0 + ell], [ell],
                [torch.Generator().manual_seed(seeds[r] + 100 * trial)],
            )  # fmt: skip
            assert alone.accepted[0] == res.accepted[r]
            assert alone.next_tokens[0] == res.next_tokens[r]
            assert alone.tokens()[0] == res.tokens()[r]
            t0, d0 = t0 + ell + 1, d0 + ell
    assert res.tokens()[0] == [int(res.next_tokens[0])]  # ℓ = 0: plain sampling step
