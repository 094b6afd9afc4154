"""The speculation gate (runtime/speculation/gate.py) with injected step timings: it picks the
faster mode per batch-size bucket, warms up each mode first, probes the losing mode every
``probe_every`` decisions, and follows changes. The engine side (real model) is in
tests/runtime/speculation/test_spec_engine.py."""

from __future__ import annotations

import pytest

from runtime.speculation.gate import SpecGate, bucket_of


def drive(gate: SpecGate, n: int, steps: int, t_spec: float, tau: float, t_ar: float) -> list[bool]:
    """Run ``steps`` decisions for a batch of ``n``, feeding back the injected cost of the
    chosen mode (speculation: t_spec seconds, τ tokens per request; AR: t_ar, 1 token)."""
    picks = []
    for _ in range(steps):
        spec = gate.speculate(n)
        gate.record(n, spec, t_spec if spec else t_ar, n * tau if spec else n)
        picks.append(spec)
    return picks


def test_buckets_are_powers_of_two():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 32]


def test_warmup_runs_each_mode_then_compares():
    gate = SpecGate(warmup=2, probe_every=16)
    # speculation first until it has 2 measurements, then AR until it has 2
    assert drive(gate, 1, 4, t_spec=0.010, tau=1.5, t_ar=0.007) == [True, True, False, False]
    # decisions without a measurement (e.g. steps that also prefilled) keep trying the missing mode
    fresh = SpecGate(warmup=2)
    assert [fresh.speculate(4) for _ in range(3)] == [True] * 3
    fresh.record(4, True, 0.02, 6)
    fresh.record(4, True, 0.02, 6)
    assert [fresh.speculate(4) for _ in range(3)] == [False] * 3


def test_picks_ar_when_ar_is_faster():
    # this CPU at batch 1: speculation 1.5 tokens in 14 ms (107 tok/s) vs AR 1 token in 7 ms (143 tok/s)
    gate = SpecGate(probe_every=16)
    picks = drive(gate, 1, 4 + 64, t_spec=0.014, tau=1.5, t_ar=0.007)[4:]
    assert picks.count(True) == 4  # only the probes
    assert gate.snapshot()["1"]["speculating"] is False


def test_picks_speculation_when_it_is_faster():
    gate = SpecGate(probe_every=16)
    picks = drive(gate, 1, 4 + 64, t_spec=0.009, tau=2.5, t_ar=0.007)[4:]
    assert picks.count(False) == 4  # only the probes
    assert gate.snapshot()["1"]["speculating"] is True


def test_margin_keeps_ar_on_a_near_tie():
    gate = SpecGate(margin=0.02)
    # speculation 1 % faster per request than AR: not enough
    picks = drive(gate, 2, 4 + 32, t_spec=0.010, tau=1.01 * 0.010 / 0.007, t_ar=0.007)[4:]
    assert picks.count(True) == 2  # probes only
    gate = SpecGate(margin=0.02)
    picks = drive(gate, 2, 4 + 32, t_spec=0.010, tau=1.05 * 0.010 / 0.007, t_ar=0.007)[4:]
    assert picks.count(False) == 2


def test_probes_the_losing_mode_every_probe_every_decisions():
    gate = SpecGate(probe_every=8, warmup=1)
    picks = drive(gate, 1, 40, t_spec=0.014, tau=1.5, t_ar=0.007)
    # decision k (1-based): 1 warm-up speculation, 2 warm-up AR, then AR except every 8th → speculation
    expected = [True, False] + [k % 8 == 0 for k in range(3, 41)]
    assert picks == expected


def test_buckets_are_independent():
    gate = SpecGate(probe_every=16)
    # batch 1: speculation wins; batch 16 (and 9..16): drafting 16 requests costs more than it buys
    small = drive(gate, 1, 36, t_spec=0.008, tau=1.6, t_ar=0.007)
    large = drive(gate, 12, 36, t_spec=0.060, tau=1.6, t_ar=0.030)
    assert small[4:].count(True) == 32 - 2 and large[4:].count(False) == 32 - 2
    snap = gate.snapshot()
    assert set(snap) == {"1", "16"} and snap["1"]["speculating"] and not snap["16"]["speculating"]
    assert snap["16"]["spec"]["tau"] == pytest.approx(1.6) and snap["16"]["ar"]["ms"] == pytest.approx(30.0)
    # interleaving does not mix them
    assert gate.speculate(1) is True and gate.speculate(16) is False


def test_follows_a_change_through_the_probes():
    gate = SpecGate(probe_every=4, alpha=0.3)
    drive(gate, 1, 40, t_spec=0.009, tau=2.0, t_ar=0.007)  # speculation wins
    assert gate.speculate(1) is True
    # acceptance collapses (e.g. a new prompt mix): the AR probes alone are not what flips it —
    # the speculative steps measured every step pull τ down, and the gate switches to AR
    picks = drive(gate, 1, 40, t_spec=0.009, tau=1.0, t_ar=0.007)
    assert picks[-8:].count(True) <= 2
    # and back: the speculation probes (every 4th decision) see τ recover
    picks = drive(gate, 1, 80, t_spec=0.009, tau=2.0, t_ar=0.007)
    assert picks[-8:].count(False) <= 2


def test_first_outlier_is_averaged_out():
    """A cold first speculative step (10× slower) must not keep speculation off for long:
    the first 1/alpha samples are a plain mean."""
    gate = SpecGate(probe_every=4, warmup=1, alpha=0.1)
    gate.record(1, True, 0.090, 2)  # cold drafter
    picks = drive(gate, 1, 80, t_spec=0.009, tau=2.0, t_ar=0.007)
    # ~16 speculation probes (64 decisions) bring the mean under AR's cost; an EMA started at the
    # outlier (weight 0.1 from the first sample) would need ~27 probes (108 decisions)
    assert picks[-8:].count(True) >= 6


def test_invalid_settings_and_empty_records():
    with pytest.raises(ValueError):
        SpecGate(probe_every=1)
    with pytest.raises(ValueError):
        SpecGate(alpha=0)
    gate = SpecGate()
    gate.record(0, True, 0.01, 0)
    gate.record(1, True, 0.0, 1)
    assert gate.snapshot() == {}
