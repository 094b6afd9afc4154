"""The live corrections the verification budget schedules with: realised vs calibrated
acceptance (runtime/speculation/acceptance.py) and measured vs profiled round cost
(runtime/speculation/live_cost.py), and their effect on what the speculator verifies."""

from __future__ import annotations

import math

import pytest

from runtime.speculation import live_cost
from runtime.speculation.acceptance import AcceptanceTracker
from runtime.speculation.budget import schedule
from runtime.speculation.live_cost import LiveRoundCost
from runtime.speculation.sps import SpsTable


def linear_table(step_s: float = 0.006, row_s: float = 0.0006) -> SpsTable:
    """A table whose round costs step_s + row_s per verified row beyond the first."""
    buckets = [1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32]
    return SpsTable(buckets, [512], [[1.0 / (step_s + row_s * (b - 1)) for b in buckets]], enforce_throughput=False)


def test_tracker_factor_is_realised_over_calibrated_with_a_prior():
    t = AcceptanceTracker(window=10**9, prior=8.0)  # no decay: plain sums
    assert t.factor("k") == 1.0
    for i in range(40):  # calibrated 0.5, accepted 1 in 10
        t.add("k", i % 10 == 0, 0.5)
    assert t.factor("k") == pytest.approx((4 + 8) / (20 + 8))
    # first position and later ones scale separately, clamped to [0, 1]
    for _ in range(200):
        t.add("later", True, 0.5)
    f1, f2 = t.factor("k"), t.factor("later")
    assert f2 > 1.5
    assert t.scaled("k", "later", [0.5, 0.6, 0.9]) == [pytest.approx(0.5 * f1), 1.0, 1.0]
    assert t.scaled("k", "later", []) == []


def test_tracker_labels_name_every_key_the_speculator_uses():
    t = AcceptanceTracker()
    t.add(("ngram", 3, False, True), True, 0.5)
    t.add(("dspark", 0, True, False), False, 0.5)
    t.add(("dspark-a1", False), True, 0.4)
    assert [row[:4] for row in t.labelled()] == [("dspark", "0", "later", "sampled"),
                                                 ("dspark-prior", "0", "first", "sampled"),
                                                 ("ngram", "3", "first", "greedy")]
    assert t.labelled()[2][4] == pytest.approx(t.factor(("ngram", 3, False, True)))


def test_tracker_forgets_old_observations():
    t = AcceptanceTracker(window=32, prior=1.0)
    for _ in range(500):
        t.add("k", False, 0.6)
    low = t.factor("k")
    assert low < 0.1
    for _ in range(200):  # the workload changed: now every draft is accepted
        t.add("k", True, 0.6)
    assert t.factor("k") > 1.5
    with pytest.raises(ValueError):
        AcceptanceTracker(window=0)


def test_live_cost_corrects_the_marginal_row_cost_only():
    table = linear_table()  # +10 % per extra row
    cost = LiveRoundCost()
    assert cost.corrected(table, "sampled", 1, 512).factors == [1.0] * (live_cost.MAX_EXTRA + 1)
    for _ in range(20):  # measured: the machine is 20 % slower overall, and a row costs +30 %
        cost.record("sampled", 1, 1, 0.0072)
        cost.record("sampled", 1, 2, 0.0072 * 1.3)
    view = cost.corrected(table, "sampled", 1, 512)
    # k(1) = measured ratio 1.3 over profiled ratio 1.1; unmeasured E = 2, 3 carry it; E = 0 stays 1
    assert view.factors[1] == pytest.approx(1.3 / 1.1, rel=1e-3)
    assert view.factors[2] == view.factors[1] and view.factors[0] == 1.0
    assert view.round_seconds(1, 512) == pytest.approx(table.round_seconds(1, 512))
    assert view.round_seconds(2, 512) / view.round_seconds(1, 512) == pytest.approx(1.3, rel=1e-3)
    # other modes and batch sizes are not affected; rounds with prefill-size extras are ignored
    assert cost.corrected(table, "greedy", 1, 512).factors[1] == 1.0
    assert cost.corrected(table, "sampled", 2, 512).factors[1] == 1.0
    cost.record("sampled", 1, 1 + live_cost.MAX_EXTRA + 1, 1.0)
    assert ("sampled", 1, live_cost.MAX_EXTRA + 1) not in cost.cells


def test_live_cost_needs_samples_and_is_clamped():
    table = linear_table()
    cost = LiveRoundCost()
    for _ in range(live_cost.MIN_SAMPLES - 1):
        cost.record("greedy", 4, 4, 0.01)
        cost.record("greedy", 4, 5, 1.0)
    assert cost.corrected(table, "greedy", 4, 512).factors[1] == 1.0  # too few rounds yet
    cost.record("greedy", 4, 4, 0.01)
    cost.record("greedy", 4, 5, 1.0)
    assert cost.corrected(table, "greedy", 4, 512).factors[1] == live_cost.CLAMP


def test_budget_stops_verifying_a_row_that_measured_rounds_show_does_not_pay():
    """c = 0.15 on one row: the profile's +10 % says verify it (1.15 / 1.1 > 1); measured +20 %
    says do not (1.15 / 1.2 < 1) — the Alg. 1 stopping rule on the corrected table."""
    table = linear_table()
    assert schedule("dspark-sla", [[0.15]], table, weights=[1.0], context_len=512).lengths == (1,)
    cost = LiveRoundCost()
    for _ in range(10):
        cost.record("sampled", 1, 1, 0.006)
        cost.record("sampled", 1, 2, 0.0072)
    view = cost.corrected(table, "sampled", 1, 512)
    assert schedule("dspark-sla", [[0.15]], view, weights=[1.0], context_len=512).lengths == (0,)
    assert math.isclose(view.sps(2, 512), 1 / 0.0072, rel_tol=1e-3)
