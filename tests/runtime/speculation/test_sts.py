"""Sequential Temperature Scaling (runtime/speculation/sts.py), paper §3.2.1."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.speculation.sts import apply_sts, calibrate, ece, fit_sts, survival_labels


def _synthetic(seed, n, temps_true, mean=1.5, sd=1.6):
    """True per-step conditional acceptance logits L[n, k] ~ N(mean, sd); outcome of
    step k ~ Bernoulli(σ(L)); survival = cumulative product. The head is miscalibrated
    by z = L·T_k, so the correct temperature at k is T_k."""
    rng = np.random.default_rng(seed)
    t = np.asarray(temps_true)
    L = rng.normal(mean, sd, size=(n, t.size))
    acc = rng.random((n, t.size)) < 1.0 / (1.0 + np.exp(-L))
    survived = np.cumprod(acc, axis=1).astype(np.float64)
    return (L * t).astype(np.float32), survived, acc


def test_recovers_known_temperatures():
    temps_true = [0.5, 0.7, 1.5, 2.5, 4.0, 1.2]
    z, survived, _ = _synthetic(0, 200_000, temps_true)
    res = fit_sts(torch.from_numpy(z), survived)  # torch input accepted
    got = np.array(res.temperatures)
    assert np.all(np.abs(got / temps_true - 1.0) < 0.10), got
    assert all(a < b for a, b in zip(res.ece_after, res.ece_before))
    assert max(res.ece_after) <= 0.02
    assert min(res.ece_before) > 0.015  # the synthetic head really is miscalibrated
    assert res.n_valid == (200_000,) * 6
    # ece_after is the ECE of apply_sts with the fitted temperatures
    surv = apply_sts(z, res.temperatures)
    for k in range(6):
        assert ece(surv[:, k], survived[:, k]) == pytest.approx(res.ece_after[k], abs=1e-12)


def test_mask_excludes_unverified_positions_without_selection_bias():
    temps_true = [0.6, 2.0, 3.0]
    rng = np.random.default_rng(3)
    z, full, _ = _synthetic(1, 200_000, temps_true)
    verified = rng.integers(0, 4, size=z.shape[0])  # independent of the outcomes
    accepted = np.minimum(full.sum(axis=1).astype(int), verified)
    survived, mask = survival_labels(accepted, 3, verified)
    res = fit_sts(z, survived, mask)
    got = np.array(res.temperatures)
    assert np.all(np.abs(got / temps_true - 1.0) < 0.10), got
    assert res.n_valid == tuple(int((verified >= k).sum()) for k in (1, 2, 3))
    # keeping the unverified rows whose label is "known" only because an earlier
    # token was rejected selects on the outcome and biases the fit badly
    biased = mask | (accepted < verified)[:, None]
    bad = np.array(fit_sts(z, survived, biased).temperatures)
    assert np.abs(bad / temps_true - 1.0).max() > 0.25


def test_survival_labels():
    s, m = survival_labels([0, 2, 3, 1], 3, verified=[0, 3, 3, 2])
    assert s.tolist() == [[0, 0, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert m.tolist() == [[False] * 3, [True] * 3, [True] * 3, [True, True, False]]
    s2, m2 = survival_labels(np.array([1, 0]), 2)
    assert s2.tolist() == [[1, 0], [0, 0]] and m2.all()
    with pytest.raises(ValueError):
        survival_labels([3], 3, verified=[2])
    with pytest.raises(ValueError):
        survival_labels([4], 3)


def test_ece_by_hand():
    # bins of width 0.5: {0.1, 0.2 | labels 0, 1} and {0.9 | label 1}
    pred = [0.1, 0.2, 0.9]
    label = [0, 1, 1]
    expect = (2 / 3) * abs(0.15 - 0.5) + (1 / 3) * abs(0.9 - 1.0)
    assert ece(pred, label, n_bins=2) == pytest.approx(expect)
    assert ece([1.0, 0.0], [1, 0], n_bins=15) == 0.0  # p = 1 falls in the last bin
    assert np.isnan(ece([], []))
    with pytest.raises(ValueError):
        ece([0.5], [1, 0])


def test_calibrate_and_apply_sts_numpy_and_torch():
    temps = [0.5, 2.0, 4.0]
    z = np.array([[1.0, -2.0, 8.0], [0.0, 3.0, -1.0]], dtype=np.float32)
    c_expect = 1.0 / (1.0 + np.exp(-z / np.array(temps)))
    assert np.allclose(calibrate(z, temps), c_expect, atol=1e-7)
    assert np.allclose(apply_sts(z, temps), np.cumprod(c_expect, axis=1), atol=1e-7)
    zt = torch.from_numpy(z)
    ct, at = calibrate(zt, temps), apply_sts(zt, temps)
    assert isinstance(at, torch.Tensor) and at.dtype == torch.float32 and at.shape == (2, 3)
    assert torch.allclose(ct, torch.from_numpy(c_expect.astype(np.float32)), atol=1e-6)
    assert torch.allclose(at, torch.from_numpy(np.cumprod(c_expect, 1).astype(np.float32)),
                          atol=1e-6)
    # serving block smaller than the checkpoint's: first temperatures are used
    assert np.allclose(apply_sts(z[:, :2], temps), np.cumprod(c_expect[:, :2], axis=1))
    with pytest.raises(ValueError):
        apply_sts(z, temps[:2])
    with pytest.raises(ValueError):
        calibrate(z, [1.0, 0.0, 1.0])


def test_fit_errors_and_degenerate_position():
    z = np.zeros((10, 2))
    with pytest.raises(ValueError):
        fit_sts(z, np.zeros((10, 3)))
    with pytest.raises(ValueError):
        fit_sts(np.full((10, 2), np.nan), np.zeros((10, 2)))
    with pytest.raises(ValueError):
        fit_sts(z, np.zeros((10, 2)), t_min=2.0, t_max=1.0)
    mask = np.ones((10, 2), dtype=bool)
    mask[:, 1] = False
    res = fit_sts(np.linspace(-3, 3, 20).reshape(10, 2), np.ones((10, 2)), mask)
    assert res.temperatures[1] == 1.0 and np.isnan(res.ece_after[1]) and res.n_valid == (10, 0)
