"""The SPS table corrected by the engine's own measured rounds (issue 28 item 3).

The verification budget (paper Alg. 1, :mod:`runtime.speculation.budget`) trades expected
accepted tokens against SPS(B), the rounds per second at B verified rows, from a table
profiled once at start-up (:mod:`runtime.speculation.sps_profiler`). The profile times the
verification forward, ``spec_round`` and the drafter-context commit on zero-filled caches
of an idle engine; a served round also pays what the profile leaves out (seeded rows' Gumbel
noise, detokenising and emitting the extra tokens, the budget itself) and runs on a machine
whose load changes. Measured at T = 1, c = 1 on the 2-core EPYC: one extra verified row cost
+9.6 % of a round where the profile said +7 %; with seeded requests +23 %.

:class:`LiveRoundCost` records every decode round that ran no prefill: its sampling mode
(greedy, sampled, seeded), its number of requests r, its extra verified rows E = B − r and
its wall time minus the drafting it did. For a round about to be scheduled,
:meth:`LiveRoundCost.corrected` returns a view of the profiled table whose round time at
B = r + E is multiplied by

    k(E) = [T̂(r, E) / T̂(r, 0)] / [T(r + E) / T(r)]

— the measured marginal cost of E extra rows over the profiled one (T̂: exponentially
weighted means of measured rounds, T: the table). Cells seen fewer than
:data:`MIN_SAMPLES` times borrow k from the largest smaller E that was (never below 1 for
them: a row is not assumed cheaper than measured for fewer rows); E = 0 is always 1.

Losslessness (Appendix A): the correction is a function of past rounds' timings only,
never of this round's draft tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: rounds of a cell after which an old measurement weighs ~1/e
WINDOW = 64
#: measured rounds a cell needs before its own correction is used
MIN_SAMPLES = 4
#: extra rows measured per cell; beyond, the last measured correction is carried
MAX_EXTRA = 16
#: a correction is kept inside [1/CLAMP, CLAMP] (one bad timing cannot switch speculation off)
CLAMP = 4.0


@dataclass
class _Cell:
    n: int = 0
    mean: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.mean += max(1.0 / WINDOW, 1.0 / self.n) * (x - self.mean)


@dataclass
class LiveRoundCost:
    """Measured round seconds per (sampling mode, requests r, extra rows E)."""

    cells: dict[tuple[str, int, int], _Cell] = field(default_factory=dict)

    def record(self, mode: str, requests: int, rows: int, seconds: float) -> None:
        """One decode round without prefill: ``rows`` ≥ ``requests`` verified rows, ``seconds``
        of wall time excluding drafting. ``mode``: ``"greedy"``, ``"sampled"`` or ``"seeded"``."""
        extra = rows - requests
        if requests < 1 or extra < 0 or seconds <= 0 or extra > MAX_EXTRA:
            return
        self.cells.setdefault((mode, requests, extra), _Cell()).add(seconds)

    def measured(self, mode: str, requests: int, extra: int) -> float | None:
        """T̂(r, E) in seconds, or ``None`` if seen fewer than :data:`MIN_SAMPLES` times."""
        c = self.cells.get((mode, requests, extra))
        return c.mean if c is not None and c.n >= MIN_SAMPLES else None

    def factors(self, mode: str, requests: int, table, context_len: float | None) -> list[float]:
        """k(E) for E = 0..:data:`MAX_EXTRA` (see the module docstring)."""
        base = self.measured(mode, requests, 0)
        ks = [1.0]
        t0 = table.round_seconds(requests, context_len)
        for e in range(1, MAX_EXTRA + 1):
            m = self.measured(mode, requests, e) if base is not None else None
            if m is None:
                ks.append(max(1.0, ks[-1]))
                continue
            k = (m / base) / (table.round_seconds(requests + e, context_len) / t0)
            ks.append(min(CLAMP, max(1.0 / CLAMP, k)))
        return ks

    def corrected(self, table, mode: str, requests: int, context_len: float | None) -> "CorrectedTable":
        """``table`` as seen by a round of ``requests`` requests in ``mode``."""
        return CorrectedTable(table, requests, self.factors(mode, requests, table, context_len))


class CorrectedTable:
    """An SPS table (``.sps(B, context_len)``, ``.round_seconds``) whose round time at
    B = r + E verified rows is the profiled one × k(E) (:class:`LiveRoundCost`)."""

    def __init__(self, table, requests: int, factors: list[float]) -> None:
        self.table, self.requests, self.factors = table, requests, factors

    def round_seconds(self, B: float, context_len: float | None = None) -> float:
        e = int(B) - self.requests
        k = self.factors[min(max(e, 0), len(self.factors) - 1)]
        return self.table.round_seconds(B, context_len) * k

    def sps(self, B: float, context_len: float | None = None) -> float:
        return 1.0 / self.round_seconds(B, context_len)

    def __call__(self, B: float, context_len: float | None = None) -> float:
        return self.sps(B, context_len)
