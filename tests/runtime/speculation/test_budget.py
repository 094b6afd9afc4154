"""Prefix scheduler (runtime/speculation/budget.py) and SLA weights (runtime/speculation/sla.py).

Paper §3.2.2, Alg. 1, Appendix A.
"""

from __future__ import annotations

import itertools
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from runtime.speculation.budget import (
    POLICIES,
    Schedule,
    schedule,
    schedule_dspark,
    schedule_dspark_sla,
)
from runtime.speculation.sla import SlaTier, sla_weight, sla_weights
from runtime.speculation.sps import SpsTable

ROOT = Path(__file__).resolve().parents[3]
TABLE = SpsTable.load(ROOT / "tests" / "data" / "sps_table.json")


# --------------------------------------------------------------- reference schedulers
def alg1_literal(confidences, sps):
    """Paper Alg. 1 transcribed literally: compute every survival up front, sort all
    candidates by survival (ties: smaller j), admit one at a time, break at the first
    admission that does not improve Θ = τ*·SPS(B)."""
    n = len(confidences)
    cands = []
    for r, row in enumerate(confidences):
        a = 1.0
        for j, c in enumerate(row, 1):
            a *= c
            cands.append((a, j, r))
    cands.sort(key=lambda t: (-t[0], t[1], t[2]))
    ell = [0] * n
    B, tau = n, float(n)
    best = tau * sps(B)
    for a, j, r in cands:
        B += 1
        tau += a
        theta = tau * sps(B)
        if theta > best:
            best = theta
            ell[r] = j
        else:
            break
    return ell


def retrospective(confidences, sps, weights=None):
    """Test-only, NOT lossless: scan the whole sorted candidate list without the
    break and keep the prefix of the scan with the best Θ."""
    n = len(confidences)
    w = weights or [1.0] * n
    cands = []
    for r, row in enumerate(confidences):
        a = 1.0
        for j, c in enumerate(row, 1):
            a *= c
            cands.append((w[r] * a, j, r))
    cands.sort(key=lambda t: (-t[0], t[1], t[2]))
    ell, best_ell = [0] * n, [0] * n
    B, wtau = n, float(sum(w))
    best = wtau * sps(B)
    for v, j, r in cands:
        B += 1
        wtau += v
        ell[r] = j
        if wtau * sps(B) > best:
            best, best_ell = wtau * sps(B), list(ell)
    return best_ell


def theta_of(confidences, ell, sps, weights=None):
    w = weights or [1.0] * len(confidences)
    tot = 0.0
    for row, l, wr in zip(confidences, ell, w):
        a, s = 1.0, 1.0
        for c in row[:l]:
            a *= c
            s += a
        tot += wr * s
    return tot * sps(len(confidences) + sum(ell))


def brute_force_best(confidences, sps, weights=None):
    ranges = [range(len(row) + 1) for row in confidences]
    return max(theta_of(confidences, ell, sps, weights) for ell in itertools.product(*ranges))


# --------------------------------------------------------------- (a) Appendix A
def _sample(probs, u):
    """Binary-vocab sampling: probs [N, 2] rows, u [N] uniforms → token ids 0/1."""
    return (u >= probs[:, 0]).astype(np.int64)


def _residual(pt, pd):
    r = np.maximum(pt - pd, 0.0)
    s = r.sum(axis=1, keepdims=True)
    return np.where(s > 0, r / np.where(s > 0, s, 1.0), pt)


def simulate_round(scheduler, sps, n, seed):
    """Full speculative rounds of Appendix A, vectorised over n independent rounds.

    Vocab {A=0, B=1}; target p_t(t1) = (0.7, 0.3), p_t(t2 | A) = (0.4, 0.6),
    p_t(t2 | B) = (0.9, 0.1); draft (0.5, 0.5) at both positions. Confidences:
    c_1 = 0.8, c_2 = 0.9 if x_1 = A else 0 (c_2 is a function of x_1). The scheduler
    output depends only on x_1, so it is called once per value of x_1. Returns the
    first two output tokens (when the round yields one token, the second is drawn
    from the target, as an exact next round would) and the ℓ chosen for x_1 = A/B.
    """
    rng = np.random.default_rng(seed)
    pt1 = np.array([0.7, 0.3])
    pd1 = np.array([0.5, 0.5])
    pt2 = np.array([[0.4, 0.6], [0.9, 0.1]])
    pd2 = np.array([[0.5, 0.5], [0.5, 0.5]])
    conf = {0: [0.8, 0.9], 1: [0.8, 0.0]}
    ell_by_x1 = np.array([scheduler([conf[v]], sps)[0] for v in (0, 1)])

    x1 = _sample(np.broadcast_to(pd1, (n, 2)), rng.random(n))
    x2 = _sample(pd2[x1], rng.random(n))
    ell = ell_by_x1[x1]

    acc1 = rng.random(n) < np.minimum(1.0, pt1[x1] / pd1[x1])
    resid1 = _sample(_residual(pt1[None], pd1[None]).repeat(n, 0), rng.random(n))
    bonus1 = _sample(np.broadcast_to(pt1, (n, 2)), rng.random(n))
    t1 = np.where(ell == 0, bonus1, np.where(acc1, x1, resid1))

    next_round = _sample(pt2[t1], rng.random(n))  # round ended after t1
    bonus2 = _sample(pt2[x1], rng.random(n))  # ℓ = 1, x_1 accepted
    acc2 = rng.random(n) < np.minimum(1.0, pt2[x1, x2] / pd2[x1, x2])
    resid2 = _sample(_residual(pt2[x1], pd2[x1]), rng.random(n))
    t2_l2 = np.where(acc2, x2, resid2)
    t2 = np.where(
        (ell == 0) | ~acc1, next_round, np.where(ell == 1, bonus2, t2_l2)
    )
    target_joint = (pt1[:, None] * pt2).ravel()  # order AA, AB, BA, BB
    return t1, t2, target_joint, ell_by_x1


def _dspark_ell(conf, sps):
    return list(schedule_dspark(conf, sps).lengths)


@pytest.mark.parametrize(
    "sps_values, expect_ell",
    [
        ({1: 1.0, 2: 0.5, 3: 0.45}, [0, 0]),  # paper: Θ1 = 0.9 ≤ Θ0 = 1 → stop
        ({1: 1.0, 2: 0.6, 3: 0.45}, [2, 1]),  # Θ1 = 1.08 > 1: x_1 admitted, then a_2 used
    ],
)
def test_appendix_a_lossless_with_early_stop(sps_values, expect_ell):
    n = 40_000
    t1, t2, target_joint, ell_by_x1 = simulate_round(_dspark_ell, sps_values.__getitem__, n, 1)
    assert list(ell_by_x1) == expect_ell
    counts = np.bincount(t1 * 2 + t2, minlength=4)
    p = chisquare(counts, n * target_joint).pvalue
    assert p > 0.01, (counts / n, target_joint)
    p1 = chisquare(np.bincount(t1, minlength=2), n * np.array([0.7, 0.3])).pvalue
    assert p1 > 0.01


def test_appendix_a_retrospective_is_biased():
    n = 40_000
    sps = {1: 1.0, 2: 0.5, 3: 0.45}.__getitem__
    t1, _, _, ell_by_x1 = simulate_round(retrospective, sps, n, 2)
    assert list(ell_by_x1) == [2, 0]  # verifies x_1 only when x_1 = A
    counts = np.bincount(t1, minlength=2)
    assert counts[0] / n == pytest.approx(0.85, abs=0.01)
    assert chisquare(counts, n * np.array([0.7, 0.3])).pvalue < 1e-4


def test_early_stop_never_reads_past_a_rejected_candidate():
    """Structural non-anticipation: a confidence row whose later entries raise on
    access shows c_{r,k+1} is read only after (r, k) was admitted."""

    class Tripwire(list):
        def __init__(self, vals, readable):
            super().__init__(vals)
            self.readable = readable

        def tolist(self):
            return self

        def __getitem__(self, i):
            if i >= self.readable:
                raise AssertionError(f"read c[{i}] before x_{i} was admitted")
            return list.__getitem__(self, i)

        def __iter__(self):
            return (self[i] for i in range(len(self)))

    from runtime.speculation import budget as sch

    sps = {1: 1.0, 2: 0.5, 3: 0.45}.__getitem__
    rows = sch._rows([[0.8, 0.9]])
    rows[0] = Tripwire(rows[0], readable=1)  # c_2 must never be read: Θ1 ≤ Θ0
    assert sch.greedy_lengths(rows, [1.0], sps, None) == [0]
    sps2 = {1: 1.0, 2: 0.6, 3: 0.45}.__getitem__
    rows[0] = Tripwire([0.8, 0.9], readable=1)
    with pytest.raises(AssertionError, match="before x_1"):
        sch.greedy_lengths(rows, [1.0], sps2, None)  # x_1 admitted → c_2 legitimately read


# --------------------------------------------------------------- (b) optimality
def _convex_time_sps(rng, max_b):
    """SPS = 1/t with round time t(B) convex: random non-decreasing increments
    (flat stretches, affine stretches and accelerating ones all occur)."""
    incs = sorted(rng.choice([0.0, rng.uniform(0.0, 0.3), rng.uniform(0.0, 1.0)])
                  for _ in range(max_b))
    t = [rng.uniform(0.2, 1.0)]
    for d in incs:
        t.append(t[-1] + d)
    return lambda B: 1.0 / t[B - 1]


def _random_conf(rng, n, gmax):
    rows = []
    for _ in range(n):
        g = rng.randint(0, gmax)
        rows.append([rng.choice([rng.random(), rng.uniform(0.6, 1.0), 0.0, 1.0])
                     if rng.random() < 0.2 else rng.uniform(0.3, 1.0) for _ in range(g)])
    return rows


def test_greedy_equals_brute_force_when_round_time_convex():
    """Condition: round time t(B) = 1/SPS(B) convex in B (non-decreasing increments;
    affine cost and log-concave SPS are special cases). Θ(m) = G(m)/t(N+m) with G
    concave, so G − λt is concave and the first non-improvement is the global optimum
    (weighted or not)."""
    rng = random.Random(7)
    for case in range(300):
        n = rng.randint(1, 3)
        rows = _random_conf(rng, n, 4)
        sps = _convex_time_sps(rng, n * 5 + 1)
        w = None if case % 2 else [rng.uniform(1.0, 4.0) for _ in range(n)]
        got = schedule_dspark_sla(rows, sps, weights=w)
        best = brute_force_best(rows, sps, w)
        assert got.objective == pytest.approx(best, rel=1e-12), (rows, w)
    # the committed (illustrative) table is convex in round time up to B = 64
    rng = random.Random(8)
    for _ in range(100):
        rows = _random_conf(rng, 3, 4)
        got = schedule_dspark(rows, TABLE)
        assert got.objective == pytest.approx(brute_force_best(rows, TABLE.sps), rel=1e-12)


def test_brute_force_check_has_teeth_for_step_shaped_round_time():
    """A step-shaped round time (flat to 4 tokens, a jump, flat again — tile
    quantisation) is not convex: the greedy then sometimes stops below the optimum
    (while staying lossless)."""
    rng = random.Random(3)
    worse = 0
    for _ in range(300):
        n = rng.randint(1, 3)
        rows = _random_conf(rng, n, 4)
        jump = rng.uniform(0.1, 1.0)
        sps = lambda B, j=jump: 1.0 / (1.0 + j * ((B - 1) // 4))
        got = schedule_dspark(rows, sps).objective
        best = brute_force_best(rows, sps)
        assert got <= best * (1 + 1e-12)
        worse += got < best * (1 - 1e-9)
    assert worse > 0


# --------------------------------------------------------------- (c) Alg. 1 exactly
def test_unit_weights_reproduce_alg1_exactly():
    rng = random.Random(11)
    trng = torch.Generator().manual_seed(0)
    for case in range(400):
        n = rng.randint(1, 32)
        if case % 3 == 0:  # fp32 tensors, equal γ, as the engine passes them
            g = rng.randint(1, 8)
            conf = list(torch.rand(n, g, generator=trng) * 0.5 + 0.5)
            rows = [c.tolist() for c in conf]
        else:
            rows = _random_conf(rng, n, 8)
            conf = rows
        ctx = rng.choice([None, 256, 1000, 2048])
        sps = lambda B, c=ctx: TABLE.sps(B, c)
        expect = alg1_literal(rows, sps)
        for s in (schedule("dspark", conf, TABLE, context_len=ctx),
                  schedule("dspark-sla", conf, TABLE, context_len=ctx),
                  schedule("dspark-sla", conf, TABLE, context_len=ctx, weights=[1.0] * n)):
            assert list(s.lengths) == expect
            assert s.budget == n + sum(expect)
            assert s.objective == pytest.approx(theta_of(rows, expect, sps), rel=1e-12)
    # 2-D tensor input gives the same answer as a list of rows
    c2 = torch.rand(16, 7, generator=trng) * 0.4 + 0.6
    assert list(schedule("dspark", c2, TABLE).lengths) == alg1_literal(c2.tolist(), TABLE.sps)


def test_dspark_ignores_weights_and_sla_uses_them():
    conf = [[0.9] * 7 for _ in range(16)]
    w = [4.0] + [1.0] * 15
    plain = schedule("dspark", conf, TABLE, weights=w)
    assert plain == schedule("dspark", conf, TABLE)
    sla = schedule("dspark-sla", conf, TABLE, weights=w)
    assert sla.lengths[0] > plain.lengths[0]
    assert sla.policy == "dspark-sla" and plain.policy == "dspark"


# --------------------------------------------------------------- (d) SLA weights
def test_max_weight_gets_more_tokens_under_binding_budget():
    """Hard budget: SPS flat up to K tokens, then a 1000× cliff, so exactly the
    top-(K−N) values are verified (K−N < #candidates: the budget binds). With the
    other requests fixed, request 0 at weight 4 gets ℓ ≥ its ℓ at weight 1, and
    strictly more iff 4·a_{0,ℓ+1} beats the smallest admitted value of another
    request (a positive survival alone is not enough: 4·1e-3 loses to 0.5)."""
    rng = random.Random(5)
    strict = same = 0
    for _ in range(400):
        n = rng.randint(2, 12)
        rows = [[rng.uniform(0.05, 1.0) for _ in range(rng.randint(1, 7))] for _ in range(n)]
        total = sum(len(r) for r in rows)
        K = n + rng.randint(1, total - 1)
        sps = lambda B, K=K: 10.0 if B <= K else 0.01
        others = [1.0] * (n - 1)
        l1 = schedule_dspark_sla(rows, sps, weights=[1.0] + others)
        l4 = schedule_dspark_sla(rows, sps, weights=[4.0] + others)
        assert l1.budget == l4.budget == K  # binding
        e1, e4 = l1.lengths[0], l4.lengths[0]
        assert e4 >= e1
        if e1 == len(rows[0]):
            assert e4 == e1
            continue
        a_next = math.prod(rows[0][: e1 + 1])
        admitted_other = [math.prod(rows[r][:j]) for r in range(1, n)
                          for j in range(1, l1.lengths[r] + 1)]
        v_min = min(admitted_other, default=math.inf)
        assert (e4 > e1) == (4.0 * a_next > v_min)
        strict += e4 > e1
        same += e4 == e1
    assert strict > 50 and same > 50
    # the explicit small case
    rows = [[0.3, 0.3], [0.5, 0.5], [0.6]]
    sps = lambda B: 10.0 if B <= 5 else 0.01
    assert schedule_dspark_sla(rows, sps, weights=[1, 1, 1]).lengths == (0, 1, 1)
    assert schedule_dspark_sla(rows, sps, weights=[4, 1, 1]).lengths == (1, 0, 1)
    rows[0] = [1e-3, 1.0]
    assert schedule_dspark_sla(rows, sps, weights=[4, 1, 1]).lengths == (0, 1, 1)


def test_sla_weight_values_and_shape():
    # neutral cases
    assert sla_weight(None, 1.0) == 1.0
    assert sla_weight(0.0, 1.0) == 1.0
    assert sla_weight(-3.0, 0.0) == 1.0
    assert sla_weight(20.0, 20.0) == 1.0
    assert sla_weight(20.0, 35.0) == 1.0
    assert sla_weight(20.0, None) == 1.0
    assert sla_weight(20.0, float("nan")) == 1.0
    assert sla_weight(20.0, None, unknown_weight=2.5) == 2.5
    # formula at deficit 0.5, s = 3, cap 4
    expect = 1 + 3 * (1 - math.exp(-1.5)) / (1 - math.exp(-3))
    assert sla_weight(20.0, 10.0, max_weight=4.0, sharpness=3.0) == pytest.approx(expect)
    assert sla_weight(20.0, 10.0, max_weight=4.0, sharpness=0.0) == pytest.approx(2.5)
    assert sla_weight(20.0, 0.0, max_weight=6.0) == pytest.approx(6.0)
    # monotone, continuous, capped on a dense grid of measured speeds
    for s in (0.0, 0.5, 3.0, 10.0):
        ms = [20.0 * (1 - i / 4000) for i in range(4001)] + [0.0]
        ws = [sla_weight(20.0, m, sharpness=s) for m in ms]
        assert all(b >= a for a, b in zip(ws, ws[1:]))
        assert max(ws) == pytest.approx(4.0) and all(1.0 <= x <= 4.0 for x in ws)
        lip = 3.0 * s / (1 - math.exp(-s)) if s else 3.0  # max slope of w in d
        assert all(abs(b - a) <= lip / 4000 + 1e-12 for a, b in zip(ws, ws[1:]))
    assert sla_weights([20.0, None, 10.0], [10.0, 5.0, None]) == [
        sla_weight(20.0, 10.0), 1.0, 1.0]
    tier = SlaTier("pro", 30.0, max_weight=3.0)
    assert tier.weight(0.0) == pytest.approx(3.0)
    assert tier.weight(15.0) == sla_weight(30.0, 15.0, max_weight=3.0)
    assert SlaTier("free").weight(0.0) == 1.0


def test_sla_weight_errors_and_stdlib_only():
    for kw in ({"max_weight": 0.5}, {"sharpness": -1.0}, {"unknown_weight": 0.5},
               {"unknown_weight": 9.0}, {"max_weight": math.inf}):
        with pytest.raises(ValueError):
            sla_weight(10.0, 5.0, **kw)
    with pytest.raises(ValueError):
        sla_weight(float("nan"), 5.0)
    with pytest.raises(ValueError):
        sla_weight(10.0, -1.0)
    with pytest.raises(ValueError):
        sla_weights([1.0], [])
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('sla', {str(ROOT / 'runtime/speculation/sla.py')!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "assert m.sla_weight(10.0, 0.0) == 4.0\n"
        "bad = {'torch', 'numpy'} & set(sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------- (e) static policies
def test_static_policies():
    conf = [[0.9, 0.8, 0.4, 0.9], [0.3, 1.0], [], [1.0, 1.0, 1.0]]
    assert schedule("fixed", conf).lengths == (4, 2, 0, 3)
    assert schedule("mtp1", conf).lengths == (1, 1, 0, 1)
    # survivals: r0 0.9, 0.72, 0.288, 0.2592; r1 0.3, 0.3; r3 1, 1, 1
    assert schedule("threshold", conf, threshold=0.5).lengths == (2, 0, 0, 3)
    assert schedule("threshold", conf, threshold=0.3).lengths == (2, 2, 0, 3)
    assert schedule("threshold", conf, threshold=0.0).lengths == (4, 2, 0, 3)
    assert schedule("threshold", conf, threshold=1.0).lengths == (0, 0, 0, 3)
    # per-position thresholds; stop at the first position below (no resumption)
    assert schedule("threshold", conf, threshold=[0.95, 0.1, 0.1, 0.1]).lengths == (0, 0, 0, 3)
    assert schedule("threshold", conf, threshold=[0.5, 0.8, 0.1, 0.1]).lengths == (1, 0, 0, 3)
    # diagnostics
    s = schedule("fixed", conf, TABLE, weights=[2.0, 1.0, 1.0, 1.0])
    assert s.budget == 4 + 9
    tau = [1 + 0.9 + 0.72 + 0.288 + 0.2592, 1 + 0.3 + 0.3, 1.0, 4.0]
    assert s.expected_tokens == pytest.approx(sum(tau))
    assert s.steps_per_s == pytest.approx(TABLE.sps(13))
    assert s.objective == pytest.approx((sum(tau) + tau[0]) * TABLE.sps(13))
    assert schedule("mtp1", conf).objective is None
    # round-robin cut under a hard cap (B ≤ 7: 3 drafts after 4 anchors)
    assert schedule("fixed", conf, max_budget=7).lengths == (1, 1, 0, 1)
    assert schedule("fixed", conf, max_budget=8).lengths == (2, 1, 0, 1)
    assert schedule("threshold", conf, threshold=0.5, max_budget=9).lengths == (2, 0, 0, 3)
    assert schedule("fixed", conf, max_budget=2).lengths == (0, 0, 0, 0)


def test_invariants_all_policies():
    rng = random.Random(13)
    for _ in range(200):
        n = rng.randint(0, 20)
        rows = _random_conf(rng, n, 8)
        w = [rng.uniform(1.0, 4.0) for _ in range(n)]
        cap = rng.choice([None, n + rng.randint(0, 10)])
        for pol in POLICIES:
            s = schedule(pol, rows, TABLE, weights=w, threshold=0.4, max_budget=cap)
            assert isinstance(s, Schedule) and len(s.lengths) == n
            assert all(0 <= l <= len(r) for l, r in zip(s.lengths, rows))
            assert s.budget == n + sum(s.lengths)
            if cap is not None:
                assert s.budget <= max(cap, n)
            if pol.startswith("dspark"):
                ww = w if pol == "dspark-sla" else [1.0] * n
                # admitted set is a top set: every admitted w·a ≥ every next candidate's
                adm = [ww[r] * math.prod(rows[r][:j]) for r in range(n)
                       for j in range(1, s.lengths[r] + 1)]
                nxt = [ww[r] * math.prod(rows[r][: s.lengths[r] + 1]) for r in range(n)
                       if s.lengths[r] < len(rows[r])]
                if adm and nxt:
                    assert min(adm) >= max(nxt)
                assert all(math.prod(rows[r][: s.lengths[r]]) > 0 for r in range(n))
    empty = schedule("dspark", [], TABLE)
    assert empty.lengths == () and empty.budget == 0 and empty.objective is None


def test_errors():
    with pytest.raises(ValueError):
        schedule("eagle", [[0.5]], TABLE)
    with pytest.raises(ValueError):
        schedule("dspark", [[0.5]])  # needs SPS
    with pytest.raises(ValueError):
        schedule("dspark", [[1.5]], TABLE)
    with pytest.raises(ValueError):
        schedule("fixed", [[float("nan")]])
    with pytest.raises(ValueError):
        schedule("dspark-sla", [[0.5]], TABLE, weights=[1.0, 1.0])
    with pytest.raises(ValueError):
        schedule("dspark-sla", [[0.5]], TABLE, weights=[0.0])
    with pytest.raises(ValueError):
        schedule("threshold", [[0.5, 0.5]], threshold=[0.5])
    with pytest.raises(ValueError):
        schedule("threshold", [[0.5]], threshold=1.5)


def test_speed_batch16_gamma7():
    import time

    conf = list(torch.rand(16, 7, generator=torch.Generator().manual_seed(1)) * 0.3 + 0.7)
    w = [1.0] * 16
    schedule("dspark-sla", conf, TABLE, weights=w)
    t0 = time.process_time()  # CPU time: other processes loading the machine do not count
    reps = 200
    for _ in range(reps):
        schedule("dspark-sla", conf, TABLE, weights=w, context_len=700)
    per_call = (time.process_time() - t0) / reps
    assert per_call < 1e-3, per_call
