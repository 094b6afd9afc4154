"""Sequential Temperature Scaling (STS) of the confidence head (paper §3.2.1).

The confidence head outputs one logit z_k per draft position k (pre-sigmoid);
c_k = σ(z_k) estimates P(x_k accepted | x_1..x_{k−1} accepted). The scheduler uses the
prefix survival a_k = Π_{i≤k} c_i, so the magnitudes must be calibrated, and errors
compound along k. STS fixes one temperature per position, in order:

    for k = 1..γ:  T_k = argmin_T  ECE( Π_{i<k} σ(z_i/T_i) · σ(z_k/T),  s_k )

where s_k ∈ {0, 1} says whether the prefix x_1..x_k survived verification, T_1..T_{k−1}
are the ones already chosen, and ECE uses ``n_bins`` equal-width bins on [0, 1]:
ECE = Σ_b (n_b/n) · |mean(pred in b) − mean(s in b)|. The search is 1-D per position:
a log-spaced grid over [t_min, t_max] (default 0.1–10, 61 points, ratio ≈ 1.08), then a
second, finer log grid spanning the neighbours of the coarse optimum. Dividing by a
positive T preserves the ranking of z_k; only the magnitudes change.

Labels (held-out rounds where the draft block was verified): ``survived[n, k]`` = 1 iff
draft tokens 1..k of round n were all accepted (so it is non-increasing in k);
``mask[n, k]`` = True iff position k was verified in round n (k ≤ ℓ_n), the rows that
enter the fit of T_k. Rows with k > ℓ_n are excluded even when an earlier rejection
makes s_k = 0 known: keeping exactly those would select rows on their outcome and
bias T_k (the selection "k ≤ ℓ_n" depends only on the scheduler's inputs, so it keeps
E[s_k | prediction]). :func:`survival_labels` builds both from per-round counts.

Numpy implementation; inputs may be numpy arrays or torch tensors (moved to CPU).
:func:`calibrate` and :func:`apply_sts` keep torch tensors as torch (serving path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["StsResult", "fit_sts", "calibrate", "apply_sts", "ece", "survival_labels"]


@dataclass(frozen=True)
class StsResult:
    """Outcome of :func:`fit_sts`.

    Attributes:
        temperatures: T_1..T_γ (floats > 0), position order.
        ece_before: per-position ECE of the uncalibrated survival Π σ(z_i) (T ≡ 1).
        ece_after: per-position ECE of Π σ(z_i/T_i) with the fitted temperatures.
        n_valid: labelled rounds per position (mask sum); a position with 0 gets T = 1
            and NaN ECEs.
    """

    temperatures: tuple[float, ...]
    ece_before: tuple[float, ...]
    ece_after: tuple[float, ...]
    n_valid: tuple[int, ...]


def _np(x: Any, dtype: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) = inf for x << 0 gives exactly 0
        return 1.0 / (1.0 + np.exp(-x))


def ece(pred: Any, label: Any, n_bins: int = 15) -> float:
    """Expected calibration error with ``n_bins`` equal-width bins on [0, 1].

    Args:
        pred: predicted probabilities, shape [n] (clipped to [0, 1]).
        label: outcomes in [0, 1] (0/1 indicators or soft labels), shape [n].
        n_bins: number of bins (≥ 1).

    Returns:
        Σ_b (n_b/n)·|mean pred_b − mean label_b|, in [0, 1]; NaN if n = 0.

    Raises:
        ValueError: shape mismatch or n_bins < 1.
    """
    p = np.clip(_np(pred, np.float64).ravel(), 0.0, 1.0)
    y = _np(label, np.float64).ravel()
    if p.shape != y.shape:
        raise ValueError(f"pred {p.shape} vs label {y.shape}")
    if n_bins < 1:
        raise ValueError("n_bins must be >= 1")
    if p.size == 0:
        return float("nan")
    idx = np.minimum((p * n_bins).astype(np.int64), n_bins - 1)
    sp = np.bincount(idx, weights=p, minlength=n_bins)
    sy = np.bincount(idx, weights=y, minlength=n_bins)
    return float(np.abs(sp - sy).sum() / p.size)


def _ece_many(base: np.ndarray, zk: np.ndarray, y: np.ndarray, temps: np.ndarray,
              n_bins: int) -> np.ndarray:
    """ECE of base·σ(zk/T) against y for every T in temps (chunked over T)."""
    n = y.size
    out = np.empty(temps.size)
    binary = bool(np.all((y == 0.0) | (y == 1.0)))
    pos = y == 1.0
    for c0 in range(0, temps.size, 8):
        t = temps[c0:c0 + 8]
        g = t.size
        pred = base[None, :] * _sigmoid(zk[None, :] / t[:, None])
        idx = np.minimum((pred * n_bins).astype(np.int64), n_bins - 1)
        idx += (np.arange(g) * n_bins)[:, None]
        sp = np.bincount(idx.ravel(), weights=pred.ravel(), minlength=g * n_bins)
        if binary:
            sy = np.bincount(idx[:, pos].ravel(), minlength=g * n_bins)
        else:
            sy = np.bincount(idx.ravel(), weights=np.tile(y, g), minlength=g * n_bins)
        out[c0:c0 + g] = np.abs(sp - sy).reshape(g, n_bins).sum(axis=1) / n
    return out


def survival_labels(
    accepted: Any, gamma: int, verified: Any | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Labels for :func:`fit_sts` from per-round counts.

    Args:
        accepted: [N] ints, draft tokens accepted in the round (0..γ, bonus excluded).
        gamma: block size γ.
        verified: [N] ints, draft tokens that were verified (ℓ, ≥ accepted);
            ``None`` → all γ were verified.

    Returns:
        ``(survived, mask)``, both [N, γ]: survived float64 0/1 = (k ≤ accepted);
        mask bool = (k ≤ verified) (see the module docstring for why rows whose
        outcome is known only through an earlier rejection are left out).

    Raises:
        ValueError: counts outside [0, γ] or accepted > verified.
    """
    acc = _np(accepted, np.int64).ravel()
    ver = np.full_like(acc, gamma) if verified is None else _np(verified, np.int64).ravel()
    if acc.shape != ver.shape:
        raise ValueError("accepted and verified differ in length")
    if (acc < 0).any() or (ver > gamma).any() or (acc > ver).any():
        raise ValueError("need 0 <= accepted <= verified <= gamma")
    k = np.arange(1, gamma + 1)[None, :]
    survived = (k <= acc[:, None]).astype(np.float64)
    mask = k <= ver[:, None]
    return survived, mask


def fit_sts(
    logits: Any,
    survived: Any,
    mask: Any | None = None,
    *,
    n_bins: int = 15,
    t_min: float = 0.1,
    t_max: float = 10.0,
    grid_points: int = 61,
    refine_points: int = 41,
) -> StsResult:
    """Fit one temperature per draft position by sequential ECE minimisation.

    Args:
        logits: confidence-head logits z, [N, γ], fp32/fp64 (numpy or torch).
        survived: prefix-survival indicators s, [N, γ], 0/1 (see module docstring).
        mask: [N, γ] bool, True where position k was verified; ``None`` → all.
        n_bins: ECE bins (paper/SGLang: 15).
        t_min, t_max: search range of T (log-spaced grid), 0 < t_min < t_max.
        grid_points: coarse grid size (≥ 2).
        refine_points: fine grid size between the coarse optimum's neighbours
            (0 disables refinement).

    Returns:
        :class:`StsResult` with T_1..T_γ and per-position ECE before/after.

    Raises:
        ValueError: shape mismatch, non-finite logits, bad search range.
    """
    z = _np(logits, np.float64)
    s = _np(survived, np.float64)
    if z.ndim != 2 or s.shape != z.shape:
        raise ValueError(f"logits {z.shape} and survived {s.shape} must both be [N, gamma]")
    m = np.ones(z.shape, dtype=bool) if mask is None else _np(mask, bool)
    if m.shape != z.shape:
        raise ValueError(f"mask {m.shape} must be {z.shape}")
    if not np.isfinite(z).all():
        raise ValueError("logits must be finite")
    if not (0.0 < t_min < t_max) or grid_points < 2 or refine_points < 0:
        raise ValueError("need 0 < t_min < t_max, grid_points >= 2, refine_points >= 0")

    coarse = np.geomspace(t_min, t_max, grid_points)
    n, gamma = z.shape
    base = np.ones(n)  # Π_{i<k} σ(z_i/T_i) with the chosen temperatures
    raw_base = np.ones(n)  # Π_{i<k} σ(z_i), for the "before" ECE
    temps, before, after, counts = [], [], [], []
    for k in range(gamma):
        sel = m[:, k]
        cnt = int(sel.sum())
        zk, yk = z[sel, k], s[sel, k]
        raw_next = raw_base * _sigmoid(z[:, k])
        if cnt == 0:
            t_best = 1.0
            before.append(float("nan"))
            after.append(float("nan"))
        else:
            b = base[sel]
            errs = _ece_many(b, zk, yk, coarse, n_bins)
            i = int(np.argmin(errs))
            t_best, e_best = float(coarse[i]), float(errs[i])
            if refine_points > 0:
                lo = coarse[max(i - 1, 0)]
                hi = coarse[min(i + 1, grid_points - 1)]
                fine = np.geomspace(lo, hi, refine_points)
                ferrs = _ece_many(b, zk, yk, fine, n_bins)
                j = int(np.argmin(ferrs))
                if ferrs[j] < e_best:
                    t_best, e_best = float(fine[j]), float(ferrs[j])
            before.append(ece(raw_next[sel], yk, n_bins))
            after.append(e_best)
        temps.append(t_best)
        counts.append(cnt)
        base = base * _sigmoid(z[:, k] / t_best)
        raw_base = raw_next
    return StsResult(tuple(temps), tuple(before), tuple(after), tuple(counts))


def _check_temps(gamma: int, temps: Sequence[float]) -> list[float]:
    t = [float(x) for x in temps]
    if gamma > len(t):
        raise ValueError(f"{len(t)} temperatures for {gamma} positions")
    if any(not (x > 0.0) for x in t):
        raise ValueError(f"temperatures must be > 0, got {t}")
    return t[:gamma]


def calibrate(z: Any, temps: Sequence[float]) -> Any:
    """Calibrated per-step confidences c_k = σ(z_k / T_k) — the scheduler's input.

    Args:
        z: confidence logits [..., γ'] (torch tensor → torch tensor on the same device
            and dtype; otherwise numpy float64), γ' ≤ len(temps) (serving may use a
            smaller block than the checkpoint; positions use T_1..T_γ').
        temps: T_1..T_γ from :func:`fit_sts`.

    Raises:
        ValueError: γ' > len(temps) or a temperature ≤ 0.
    """
    t = _check_temps(z.shape[-1], temps)
    if hasattr(z, "detach"):
        import torch

        return torch.sigmoid(z / torch.tensor(t, dtype=z.dtype, device=z.device))
    return _sigmoid(np.asarray(z, dtype=np.float64) / np.asarray(t))


def apply_sts(z: Any, temps: Sequence[float]) -> Any:
    """Calibrated prefix survival a_k = Π_{i≤k} σ(z_i / T_i), shape [..., γ'].

    Same input rules and errors as :func:`calibrate`.
    """
    c = calibrate(z, temps)
    if hasattr(c, "cumprod") and hasattr(c, "detach"):
        return c.cumprod(dim=-1)
    return np.cumprod(c, axis=-1)
