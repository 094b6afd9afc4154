"""SLA weights for the verification-budget scheduler (``dspark-sla`` policy).

Stdlib only (no torch, no numpy): this module is also imported inside SGLang's
own environment by a plugin, so it must stay dependency-free.

A tenant's SLA tier promises a decode speed (tokens/s per request). The scheduler
(:mod:`runtime.speculation.budget`) weights each request's expected accepted tokens by
``w_r`` so that requests falling behind their target get a larger share of the
verification budget. This module maps (target, measured speed) to ``w_r``.

Formula (our extension of paper §3.2.2; the paper itself has no weights)::

    d = clamp((target − measured) / target, 0, 1)           # relative deficit
    g(d) = (1 − exp(−s·d)) / (1 − exp(−s))   for s > 0       # saturating, g(0)=0, g(1)=1
    g(d) = d                                  for s = 0       # linear limit
    w = 1 + (max_weight − 1) · g(d)

so ``w`` is 1 when the target is met, rises continuously and monotonically with the
deficit (steepest for small deficits when s > 0, so a request that just slipped
reacts quickly), and reaches ``max_weight`` only when the request is fully stalled
(measured = 0). ``s`` is ``sharpness``.

Special cases:
    * no target (``None``) or ``target <= 0`` → 1.0 (best-effort tier);
    * unknown measurement (``None`` or NaN) → ``unknown_weight`` (default 1.0): a new
      request is neutral until it has produced enough tokens to be measured, so a
      burst of new requests cannot starve running ones; set it higher to favour
      fresh requests (time-to-first-tokens) — it is validated to lie in
      ``[1, max_weight]``.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

__all__ = ["sla_weight", "sla_weights", "SlaTier", "DEFAULT_MAX_WEIGHT", "DEFAULT_SHARPNESS"]

DEFAULT_MAX_WEIGHT = 4.0
DEFAULT_SHARPNESS = 3.0


def sla_weight(
    target_tokens_per_s: float | None,
    measured_tokens_per_s: float | None,
    *,
    max_weight: float = DEFAULT_MAX_WEIGHT,
    sharpness: float = DEFAULT_SHARPNESS,
    unknown_weight: float = 1.0,
) -> float:
    """Scheduler weight ``w_r`` of one request from its SLA target and measured speed.

    Args:
        target_tokens_per_s: promised decode speed of the request's SLA tier
            (tokens/s); ``None`` or ``<= 0`` means no target.
        measured_tokens_per_s: the request's measured decode speed (tokens/s, e.g. an
            EMA over recent rounds); ``None``/NaN means not measured yet.
        max_weight: weight of a fully stalled request (``>= 1``).
        sharpness: ``s >= 0`` in the module formula; 0 is linear in the deficit.
        unknown_weight: weight while the speed is unknown, in ``[1, max_weight]``.

    Returns:
        ``w`` in ``[1, max_weight]`` (formula in the module docstring): 1.0 when the
        target is absent or met, continuous and non-decreasing in the relative
        deficit ``(target − measured)/target``.

    Raises:
        ValueError: ``max_weight < 1``, ``sharpness < 0`` or non-finite,
            ``unknown_weight`` outside ``[1, max_weight]``, NaN target, or a
            negative measured speed.
    """
    if not (max_weight >= 1.0) or math.isinf(max_weight):
        raise ValueError(f"max_weight must be a finite number >= 1, got {max_weight!r}")
    if not (sharpness >= 0.0) or math.isinf(sharpness):
        raise ValueError(f"sharpness must be a finite number >= 0, got {sharpness!r}")
    if not (1.0 <= unknown_weight <= max_weight):
        raise ValueError(f"unknown_weight must lie in [1, max_weight], got {unknown_weight!r}")
    if target_tokens_per_s is None:
        return 1.0
    target = float(target_tokens_per_s)
    if math.isnan(target):
        raise ValueError("target_tokens_per_s is NaN")
    if target <= 0.0:
        return 1.0
    if measured_tokens_per_s is None:
        return float(unknown_weight)
    measured = float(measured_tokens_per_s)
    if math.isnan(measured):
        return float(unknown_weight)
    if measured < 0.0:
        raise ValueError(f"measured_tokens_per_s must be >= 0, got {measured!r}")
    if measured >= target:  # also covers target = +inf with measured = +inf
        return 1.0
    deficit = min(1.0, (target - measured) / target) if math.isfinite(target) else 1.0
    if sharpness == 0.0:
        g = deficit
    else:
        g = -math.expm1(-sharpness * deficit) / -math.expm1(-sharpness)
    return min(max_weight, 1.0 + (max_weight - 1.0) * g)


def sla_weights(
    targets: Sequence[float | None],
    measured: Sequence[float | None],
    **kwargs: float,
) -> list[float]:
    """Vector form of :func:`sla_weight`: one weight per request, same order.

    Raises:
        ValueError: the two sequences differ in length, or as :func:`sla_weight`.
    """
    if len(targets) != len(measured):
        raise ValueError(f"{len(targets)} targets but {len(measured)} measurements")
    return [sla_weight(t, m, **kwargs) for t, m in zip(targets, measured)]


class SlaTier(NamedTuple):
    """An SLA tier: a name, a per-request decode-speed target and its weight cap.

    Attributes:
        name: tier name as configured per tenant (e.g. ``"free"``, ``"pro"``).
        target_tokens_per_s: promised tokens/s per request; ``None`` = best effort.
        max_weight: cap passed to :func:`sla_weight`.
    """

    name: str
    target_tokens_per_s: float | None = None
    max_weight: float = DEFAULT_MAX_WEIGHT

    def weight(self, measured_tokens_per_s: float | None, **kwargs: float) -> float:
        """:func:`sla_weight` with this tier's target and cap (kwargs: ``sharpness``,
        ``unknown_weight``)."""
        return sla_weight(
            self.target_tokens_per_s, measured_tokens_per_s, max_weight=self.max_weight, **kwargs
        )
