"""Live recalibration of draft survival probabilities from the engine's own verified rounds.

The verification budget (:mod:`runtime.speculation.budget`, paper Alg. 1) ranks draft
positions by their survival probability a_{r,j} = Π_{k ≤ j} c_k. The conditionals c_k come
from calibration done offline: the drafter's confidence head after Sequential Temperature
Scaling (paper §3.3, :mod:`runtime.speculation.sts`) and the n-gram table
(``checkpoints/ngram_calibration.json``), both measured at T = 0 on the drafter's training
responses. Served traffic differs — chat repeats its prompt less than math or code, and at
T = 1 a one-hot n-gram draft x survives only with p_t(x) — and a budget that trusts c_k
where it is 5× too high verifies rows that do not pay (measured on mt-bench at T = 1: the
n-gram drafts' first position was accepted 5 % of the time against a calibrated ~50 %).

:class:`AcceptanceTracker` keeps, per key (proposer, match length, first or later position,
greedy or sampled), exponentially decayed sums of realised acceptances and of the
probabilities the budget was given for them; :meth:`AcceptanceTracker.factor` is their
ratio, shrunk towards 1 by a prior of pseudo-observations. The speculator multiplies each
c_k by its key's factor (clamped to [0, 1]) before scheduling.

Losslessness (paper Appendix A, notes "bug classes"): the factors are functions of rounds
that are already verified — never of this round's draft tokens — so whether position k is
verified still depends only on the past and on tokens before k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

#: weight of the oldest observation after this many newer ones: 1/e (an effective window)
DEFAULT_WINDOW = 256
#: pseudo-observations at the calibrated rate (factor 1) in every key's ratio
DEFAULT_PRIOR = 8.0


@dataclass
class _Sums:
    hits: float = 0.0
    expected: float = 0.0


class AcceptanceTracker:
    """Decayed (realised acceptances, calibrated expectation) per key.

    Args:
        window: observations of a key after which an old one weighs 1/e (decay 1 − 1/window).
        prior: pseudo-observations of expectation at factor 1 (so a key seen little stays near 1).

    Raises:
        ValueError: ``window`` < 1 or ``prior`` ≤ 0.
    """

    def __init__(self, window: int = DEFAULT_WINDOW, prior: float = DEFAULT_PRIOR) -> None:
        if window < 1 or prior <= 0:
            raise ValueError(f"window must be ≥ 1 and prior > 0, got {window}, {prior}")
        self.decay = 1.0 - 1.0 / window
        self.prior = prior
        self._sums: dict[Hashable, _Sums] = {}

    def add(self, key: Hashable, accepted: bool, probability: float) -> None:
        """One verified position: whether it was ``accepted`` and the conditional survival
        probability ``probability`` ∈ [0, 1] the budget was given for it (before this key's
        factor was applied)."""
        s = self._sums.setdefault(key, _Sums())
        s.hits = s.hits * self.decay + float(accepted)
        s.expected = s.expected * self.decay + float(probability)

    def factor(self, key: Hashable) -> float:
        """(hits + prior) / (expected + prior): realised over predicted acceptance, 1.0 for an unseen key."""
        s = self._sums.get(key)
        if s is None:
            return 1.0
        return (s.hits + self.prior) / (s.expected + self.prior)

    def scaled(self, key_first: Hashable, key_later: Hashable, conf: list[float]) -> list[float]:
        """``conf`` (conditionals c_1..c_γ) with c_1 scaled by ``key_first``'s factor and the
        rest by ``key_later``'s, each clamped to [0, 1]."""
        if not conf:
            return conf
        f1, f2 = self.factor(key_first), self.factor(key_later)
        return [min(1.0, conf[0] * f1)] + [min(1.0, c * f2) for c in conf[1:]]

    def labelled(self) -> list[tuple[str, str, str, str, float]]:
        """``(proposer, n, position, sampling, factor)`` for every key the speculator uses
        (``("ngram"|"dspark", n, later, greedy)`` and ``("dspark-a1", greedy)``, the DSpark prior
        of a new request: proposer ``dspark-prior``), sorted; for the ``sparkgate:spec_acceptance_ratio`` gauge."""
        out = []
        for key in self._sums:
            if len(key) == 4:
                proposer, n, later, greedy = key
                out.append((proposer, str(n), "later" if later else "first", "greedy" if greedy else "sampled",
                            self.factor(key)))
            elif len(key) == 2:
                out.append(("dspark-prior", "0", "first", "greedy" if key[1] else "sampled", self.factor(key)))
        return sorted(out)
