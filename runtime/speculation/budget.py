"""Hardware-aware prefix scheduler: how many draft tokens each request verifies.

Source: DSpark paper §3.2.2, Algorithm 1 and Appendix A; the per-request weights
``w_r`` (``dspark-sla``) are our extension (see :mod:`runtime.speculation.sla`).

Problem
-------
Each active request r drafted γ_r tokens with STS-calibrated confidences
c_{r,1..γ_r} (c_{r,k} ≈ P(x_{r,k} accepted | x_{r,<k} accepted)); its prefix survival
is a_{r,j} = Π_{i≤j} c_{r,i}. The scheduler picks verification lengths
ℓ_r ∈ {0..γ_r}; the target then scores B = Σ_r (1 + ℓ_r) tokens in one forward
(anchor + ℓ_r drafts each). Expected accepted tokens τ* = Σ_r (1 + Σ_{j≤ℓ_r} a_{r,j})
(bonus included) and the objective is

    Θ(ℓ) = Σ_r w_r · (1 + Σ_{j≤ℓ_r} a_{r,j}) · SPS(B),

expected (weighted) tokens per second, SPS from :class:`runtime.speculation.sps.SpsTable`.
With all w_r = 1, Θ = τ*·SPS(B), exactly the paper's objective.

Greedy with early stop (Alg. 1)
-------------------------------
Candidates (r, j) are taken in order of w_r·a_{r,j} descending (ties: smaller j first,
then smaller r); each is admitted (ℓ_r ← j, B += 1) only if it strictly increases Θ,
and the scan STOPS at the first candidate that does not. With w ≡ 1 this is Alg. 1.

Why this is lossless (and why the stop is essential)
----------------------------------------------------
Speculative sampling reproduces the target distribution as long as, for every
request r and position k, the event {ℓ_r ≥ k} ("x_{r,k} is verified") is decided
from information that is independent of x_{r,k} given x_{r,<k}: ℓ_r must be a
*stopping time* of r's draft. Then at position k either x_{r,k} is verified while
still distributed as p_d (nothing selected on its value), so accept/residual-resample
yields p_t, or ℓ_r = k−1 and the bonus token is drawn from p_t — p_t either way.

The confidences endanger this: c_{r,k+1} = σ(wᵀ[h_{k+1}; W1[x_{r,k}]]) is a function
of the sampled x_{r,k}, so a_{r,k+1}, a_{r,k+2}, … carry information about x_{r,k}.
{ℓ_r ≥ k} may therefore use a_{r,1..k} (c_{r,k} depends on x_{r,<k} only), anything
about other requests (their drafts are sampled independently of r's), the weights
(fixed before the step from past measurements — never from this step's drafts) and
the SPS table — but never a_{r,k+1} or later.

Appendix A shows what goes wrong otherwise. One request, γ = 2, a_1 = 0.8,
SPS(1) = 1, SPS(2) = 0.5, SPS(3) = 0.45; c_2 = 0.9 if x_1 = A else 0; target (0.7, 0.3),
draft (0.5, 0.5). Θ0 = 1.0, Θ1 = 1.8·0.5 = 0.9, Θ2 = 2.52·0.45 = 1.134 if x_1 = A,
1.8·0.45 = 0.81 if x_1 = B. A "retrospective" scheduler that scans everything and keeps
the best Θ prefix verifies x_1 exactly when x_1 = A (a decision about x_1 taken by
looking at c_2, a function of x_1): P(first token = A) = 0.5·1 + 0.5·0.7 = 0.85, not
0.7. With the stop, Θ1 ≤ Θ0 ends the scan before a_2 is ever considered: ℓ = 0
whatever x_1 is, and the output is the target's. If instead Θ1 > Θ0, x_1 is admitted
and only then is a_2 looked at; a_2 may decide whether x_2 is verified (allowed: it
depends on x_1, not x_2), but it can no longer undo x_1's admission.

Note what the stop does and does not forbid. A rejected candidate changes no state
(W, B, Θ) and every later candidate has a value ≤ it, so every later candidate would
be rejected too: skipping instead of stopping would give the same ℓ. What the stop
rules out is the retrospective scan above — tentatively admitting non-improving
candidates and keeping the best prefix afterwards — which lets later values (the
a_{r,k+1} that depend on x_{r,k}) decide about earlier tokens.

The implementation makes this structural. It is a lazy k-way merge: a heap holds
exactly one candidate per request — its next unadmitted position — and c_{r,k+1} is
read (a_{r,k+1} = a_{r,k}·c_{r,k+1} computed and pushed) only after (r, k) has been
popped *and admitted*. When (r, k) is decided, the whole state (admitted set, B, Θ,
heap) is a function of allowed information only; nothing derived from x_{r,k} exists
yet. Because c ∈ [0, 1], a_{r,j} is non-increasing in j, so under the key
(−w_r·a_{r,j}, j, r) every request's candidate list is strictly increasing; merging
such lists yields exactly the global sort of Alg. 1, so the pop sequence (and the
result) is Alg. 1's. Two things would break it and are avoided: ranking by the
per-step c_{r,j} instead of survival a_{r,j}, or tie-breaking by larger j first —
either could place (r, k+1) before (r, k), i.e. look at a function of x_{r,k} before
x_{r,k}'s admission (and violate the prefix order). Decisions about another request
s that are taken after (r, k+1) was examined do depend on x_{r,k}; that is harmless,
since x_{s,·} is independent of x_{r,·}: conditioned on all other requests, each ℓ_s is
still a stopping time of s's own draft. Stopping because ``max_budget`` is reached
depends only on earlier admissions, so it is allowed too.

Optimality and caveats
----------------------
For a fixed number m of admitted drafts the best set is the top-m values (they form
prefixes automatically), so Θ_max = max_m G(m)·SPS(N+m) = max_m G(m)/t(N+m) with
G(m) = Σw + (sum of the top-m values), concave in m, and t = 1/SPS the round time.
If t(B) is convex in B (non-decreasing increments: affine cost, flat-then-linear, or
any log-concave SPS), G − λ·t is concave for every λ ≥ 0, so once Θ(m+1) ≤ Θ(m) =: λ
all later Θ stay ≤ λ: the greedy's first non-improvement is the global optimum over
all prefix-closed ℓ (weighted or not). Step-shaped round times (e.g. GPU tile/wave
quantisation: flat, jump, flat) violate this; there the stop is a lossless
heuristic that can end below the optimum. A larger weight need not always give a
request more tokens under a soft SPS curve (a larger w_r also adds (w_r − 1) to Σ w·τ
through r's anchor, which raises the improvement bar W·(SPS(B)/SPS(B+1) − 1) for
every candidate, so the scan may end before r's next candidate); under a hard
budget (flat SPS, then a cliff) the allocation is exactly the top-K values, so ℓ_r is
non-decreasing in w_r.

Other policies (same :class:`Schedule` output)
----------------------------------------------
``fixed``: ℓ_r = γ_r; ``mtp1``: ℓ_r = min(1, γ_r); ``threshold``: ℓ_r = largest j with
a_{r,i} ≥ threshold_i for all i ≤ j (stop at the first position below); ``dspark``:
Alg. 1 with w ≡ 1; ``dspark-sla``: Alg. 1 with the given weights. With ``max_budget``
the static policies fill positions round-robin (j = 1 for all requests, then j = 2, …),
which is also non-anticipating.

Cost: O(M log N) for M considered candidates and N requests; the confidences are
read with ``.tolist()``; ≈0.04 ms per call at batch 16, γ = 7 (CPython, this CPU).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

__all__ = [
    "POLICIES",
    "DEFAULT_THRESHOLD",
    "Schedule",
    "SpsLike",
    "schedule",
    "schedule_fixed",
    "schedule_mtp1",
    "schedule_threshold",
    "schedule_dspark",
    "schedule_dspark_sla",
    "greedy_lengths",
]

POLICIES: tuple[str, ...] = ("fixed", "mtp1", "threshold", "dspark", "dspark-sla")
DEFAULT_THRESHOLD = 0.5

#: an object with ``.sps(B, context_len)`` (e.g. :class:`SpsTable`) or a plain
#: callable ``B -> steps/s`` (context length ignored).
SpsLike = Union[Any, Callable[[int], float]]


@dataclass(frozen=True)
class Schedule:
    """Verification plan for one engine step.

    Attributes:
        lengths: ℓ_r per request (same order as the input), ``0 <= ℓ_r <= γ_r``: the
            request verifies its draft prefix x_{r,1..ℓ_r}.
        budget: B = Σ_r (1 + ℓ_r), tokens in the verification forward.
        expected_tokens: τ* = Σ_r (1 + Σ_{j≤ℓ_r} a_{r,j}), expected committed tokens
            (bonus included, unweighted).
        objective: Θ = Σ_r w_r (1 + Σ_{j≤ℓ_r} a_{r,j}) · SPS(B) (weights 1 unless the
            caller passed weights); ``None`` when no SPS was given or N = 0.
        steps_per_s: SPS(B); ``None`` when no SPS was given or N = 0.
        policy: the policy name that produced it.
    """

    lengths: tuple[int, ...]
    budget: int
    expected_tokens: float
    objective: float | None
    steps_per_s: float | None
    policy: str


# ---------------------------------------------------------------- helpers
def _rows(confidences: Any) -> list[list[float]]:
    """Confidences → list of per-request float lists; validates c ∈ [0, 1]."""
    if hasattr(confidences, "tolist") and not isinstance(confidences, (list, tuple)):
        data = confidences.tolist()  # 2-D tensor / array [N, γ]
    else:
        data = [c.tolist() if hasattr(c, "tolist") else c for c in confidences]
    rows = []
    for r, row in enumerate(data):
        if not isinstance(row, list):
            row = list(row)
        vals = [float(x) for x in row]
        for x in vals:
            if not (0.0 <= x <= 1.0):
                raise ValueError(f"confidence of request {r} is {x!r}, not in [0, 1]")
        rows.append(vals)
    return rows


def _weights(weights: Sequence[float] | None, n: int) -> list[float]:
    if weights is None:
        return [1.0] * n
    if hasattr(weights, "tolist") and not isinstance(weights, (list, tuple)):
        weights = weights.tolist()
    w = [float(x) for x in weights]
    if len(w) != n:
        raise ValueError(f"{len(w)} weights for {n} requests")
    for x in w:
        if not (x > 0.0 and math.isfinite(x)):
            raise ValueError(f"weights must be finite and > 0, got {x!r}")
    return w


def _sps_fn(sps: SpsLike | None, context_len: float | None) -> Callable[[int], float] | None:
    if sps is None:
        return None
    if hasattr(sps, "sps"):
        return lambda B: float(sps.sps(B, context_len))
    if callable(sps):
        return lambda B: float(sps(B))
    raise TypeError(f"sps must be an SpsTable-like object or a callable, got {type(sps)!r}")


def _finish(
    policy: str,
    rows: list[list[float]],
    lengths: list[int],
    w: list[float],
    sps_fn: Callable[[int], float] | None,
) -> Schedule:
    tau = 0.0
    wtau = 0.0
    for row, ell, wr in zip(rows, lengths, w):
        a, s = 1.0, 1.0
        for c in row[:ell]:
            a *= c
            s += a
        tau += s
        wtau += wr * s
    B = len(rows) + sum(lengths)
    S = sps_fn(B) if (sps_fn is not None and B > 0) else None
    return Schedule(
        lengths=tuple(lengths),
        budget=B,
        expected_tokens=tau,
        objective=None if S is None else wtau * S,
        steps_per_s=S,
        policy=policy,
    )


def _static(
    rows: list[list[float]],
    admissible: Callable[[int, float], bool],
    max_budget: int | None,
) -> list[int]:
    """ℓ_r = longest prefix with every (j, a_{r,j}) admissible; with a budget, fill
    round-robin by position so the cut is non-anticipating."""
    n = len(rows)
    lengths = [0] * n
    if max_budget is None:
        for r, row in enumerate(rows):
            a = 1.0
            for j, c in enumerate(row, 1):
                a *= c
                if not admissible(j, a):
                    break
                lengths[r] = j
        return lengths
    left = int(max_budget) - n
    surv = [1.0] * n
    active = [r for r in range(n) if rows[r]]
    j = 1
    while active and left > 0:
        nxt = []
        for r in active:
            if left <= 0:
                break
            if j > len(rows[r]):
                continue
            a = surv[r] * rows[r][j - 1]
            if not admissible(j, a):
                continue
            surv[r], lengths[r] = a, j
            left -= 1
            nxt.append(r)
        active, j = nxt, j + 1
    return lengths


# ---------------------------------------------------------------- policies
def _schedule_static(policy: str, admissible: Callable[[int, float], bool], confidences: Any, sps: SpsLike | None,
                     weights: Sequence[float] | None, context_len: float | None, max_budget: int | None) -> Schedule:
    rows = _rows(confidences)
    lengths = _static(rows, admissible, max_budget)
    return _finish(policy, rows, lengths, _weights(weights, len(rows)), _sps_fn(sps, context_len))


def schedule_fixed(confidences: Any, sps: SpsLike | None = None, *, weights: Sequence[float] | None = None,
                   context_len: float | None = None, max_budget: int | None = None) -> Schedule:
    """``fixed``: verify every drafted token, ℓ_r = γ_r (round-robin cut by
    ``max_budget`` if given). Arguments as :func:`schedule`."""
    return _schedule_static("fixed", lambda j, a: True, confidences, sps, weights, context_len, max_budget)


def schedule_mtp1(confidences: Any, sps: SpsLike | None = None, *, weights: Sequence[float] | None = None,
                  context_len: float | None = None, max_budget: int | None = None) -> Schedule:
    """``mtp1``: one draft token per request, ℓ_r = min(1, γ_r) (MTP-1 style baseline).
    Arguments as :func:`schedule`."""
    return _schedule_static("mtp1", lambda j, a: j <= 1, confidences, sps, weights, context_len, max_budget)


def schedule_threshold(
    confidences: Any,
    sps: SpsLike | None = None,
    *,
    threshold: float | Sequence[float] = DEFAULT_THRESHOLD,
    weights: Sequence[float] | None = None,
    context_len: float | None = None,
    max_budget: int | None = None,
) -> Schedule:
    """``threshold``: verify x_{r,j} while the survival a_{r,j} ≥ threshold_j; stop at
    the first position below it.

    Args:
        threshold: one value for all positions, or one per position (index j−1),
            at least max γ_r long; values in [0, 1].
        others: as :func:`schedule`.

    Raises:
        ValueError: threshold outside [0, 1] or too short.
    """
    rows = _rows(confidences)
    w = _weights(weights, len(rows))
    gamma = max((len(r) for r in rows), default=0)
    if isinstance(threshold, (int, float)):
        thr = [float(threshold)] * gamma
    else:
        thr = [float(t) for t in (threshold.tolist() if hasattr(threshold, "tolist") else threshold)]
        if len(thr) < gamma:
            raise ValueError(f"{len(thr)} thresholds for block size {gamma}")
    if any(not (0.0 <= t <= 1.0) for t in thr):
        raise ValueError(f"thresholds must lie in [0, 1], got {thr}")
    lengths = _static(rows, lambda j, a: a >= thr[j - 1], max_budget)
    return _finish("threshold", rows, lengths, w, _sps_fn(sps, context_len))


def greedy_lengths(
    rows: list[list[float]],
    w: list[float],
    sps_fn: Callable[[int], float],
    max_budget: int | None = None,
) -> list[int]:
    """Alg. 1 with weights, as a lazy k-way merge (see module docstring): ℓ_r per request from
    its survival rows c_{r,1..γ_r} (validated floats in [0, 1]), weights w_r, ``sps_fn(B)`` in
    rounds per second and an optional cap on B."""
    n = len(rows)
    lengths = [0] * n
    if n == 0:
        return lengths
    B = n
    wtau = math.fsum(w)  # Σ_r w_r (1 + Σ_{j≤ℓ_r} a_{r,j}) with ℓ = 0
    theta = wtau * sps_fn(B)
    heap: list[tuple[float, int, int, float]] = []
    for r, row in enumerate(rows):
        if row:
            a = row[0]
            heap.append((-w[r] * a, 1, r, a))
    heapq.heapify(heap)
    while heap and (max_budget is None or B < max_budget):
        neg_v, j, r, a = heap[0]
        theta_next = (wtau - neg_v) * sps_fn(B + 1)
        if not theta_next > theta:
            break  # early stop: nothing after this candidate is ever looked at
        heapq.heappop(heap)
        lengths[r] = j
        B += 1
        wtau -= neg_v
        theta = theta_next
        row = rows[r]
        if j < len(row):  # only now may c_{r,j+1} (a function of x_{r,j}) be read
            a_next = a * row[j]
            heapq.heappush(heap, (-w[r] * a_next, j + 1, r, a_next))
    return lengths


def _dspark(policy, confidences, sps, weights, context_len, max_budget) -> Schedule:
    rows = _rows(confidences)
    w = _weights(weights, len(rows))
    fn = _sps_fn(sps, context_len)
    if fn is None:
        raise ValueError(f"policy {policy!r} needs an SPS table")
    return _finish(policy, rows, greedy_lengths(rows, w, fn, max_budget), w, fn)


def schedule_dspark(
    confidences: Any,
    sps: SpsLike,
    *,
    context_len: float | None = None,
    max_budget: int | None = None,
) -> Schedule:
    """``dspark``: paper Alg. 1 (all weights 1). Arguments as :func:`schedule`;
    ``sps`` is required."""
    return _dspark("dspark", confidences, sps, None, context_len, max_budget)


def schedule_dspark_sla(
    confidences: Any,
    sps: SpsLike,
    *,
    weights: Sequence[float] | None = None,
    context_len: float | None = None,
    max_budget: int | None = None,
) -> Schedule:
    """``dspark-sla``: Alg. 1 on w_r·a_{r,j} with Θ = Σ w_r τ_r · SPS(B).

    ``weights`` must be fixed before the step (e.g. :func:`runtime.speculation.sla.sla_weight`
    of the measured speed so far); ``None`` → all 1 (= ``dspark``). Arguments as
    :func:`schedule`; ``sps`` is required.
    """
    return _dspark("dspark-sla", confidences, sps, weights, context_len, max_budget)


def schedule(
    policy: str,
    confidences: Any,
    sps: SpsLike | None = None,
    *,
    weights: Sequence[float] | None = None,
    threshold: float | Sequence[float] = DEFAULT_THRESHOLD,
    context_len: float | None = None,
    max_budget: int | None = None,
) -> Schedule:
    """Choose verification lengths ℓ_r for one engine step.

    Args:
        policy: one of :data:`POLICIES`: ``fixed``, ``mtp1``, ``threshold``,
            ``dspark``, ``dspark-sla``.
        confidences: per active request r, the calibrated per-step confidences
            c_{r,1..γ_r} (fp32/fp64 1-D tensors, numpy arrays or float sequences, or one
            2-D [N, γ] tensor/array); values in [0, 1]; γ_r may differ (and be 0).
        sps: SPS table (``.sps(B, context_len)``) or callable ``B -> steps/s``;
            required for ``dspark``/``dspark-sla``, optional (diagnostics only) for
            the others.
        weights: w_r > 0 per request, fixed before the step; used by ``dspark-sla``
            and in the reported objective of the static policies; ignored by ``dspark``.
        threshold: survival threshold(s) of ``threshold``.
        context_len: context length (tokens) for the SPS lookup.
        max_budget: optional hard cap on B; drafts are admitted only while B < cap
            (anchors always count, so B ≥ N).

    Returns:
        :class:`Schedule` with ℓ_r (a prefix length ≤ γ_r) and diagnostics.

    Raises:
        ValueError: unknown policy, confidences outside [0, 1] or NaN, bad weights or
            thresholds, missing SPS for a DSpark policy.
    """
    if policy == "fixed":
        return schedule_fixed(confidences, sps, weights=weights, context_len=context_len,
                              max_budget=max_budget)
    if policy == "mtp1":
        return schedule_mtp1(confidences, sps, weights=weights, context_len=context_len,
                             max_budget=max_budget)
    if policy == "threshold":
        return schedule_threshold(confidences, sps, threshold=threshold, weights=weights,
                                  context_len=context_len, max_budget=max_budget)
    if policy == "dspark":
        return schedule_dspark(confidences, sps, context_len=context_len, max_budget=max_budget)
    if policy == "dspark-sla":
        return schedule_dspark_sla(confidences, sps, weights=weights, context_len=context_len,
                                   max_budget=max_budget)
    raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
