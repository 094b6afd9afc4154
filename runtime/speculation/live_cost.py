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

    def corrected(self, table, mode: str, requests: int, context_len: float | None) -> "CorrectedTable":
        """``table`` as seen by a round of ``requests`` requests in ``mode`` (factors computed
        on first use: a round asks for a few E only)."""
        return CorrectedTable(table, self, mode, requests, context_len)


class CorrectedTable:
    """An SPS table (``.sps(B, context_len)``, ``.round_seconds``) whose round time at
    B = r + E verified rows is the profiled one × k(E) (:class:`LiveRoundCost`)."""

    def __init__(self, table, cost: LiveRoundCost, mode: str, requests: int, context_len: float | None) -> None:
        self.table, self.requests = table, requests
        self._cost, self._mode, self._ctx = cost, mode, context_len
        self._base = cost.measured(mode, requests, 0)
        self._k = [1.0]  # k(0..len−1), filled on demand

    def factor(self, extra: int) -> float:
        """k(E) (module docstring); E beyond :data:`MAX_EXTRA` carries k(MAX_EXTRA)."""
        extra = min(max(extra, 0), MAX_EXTRA)
        while len(self._k) <= extra:
            e = len(self._k)
            m = self._cost.measured(self._mode, self.requests, e) if self._base is not None else None
            if m is None:
                self._k.append(max(1.0, self._k[-1]))
                continue
            profiled = self.table.round_seconds(self.requests + e, self._ctx) / self.table.round_seconds(self.requests, self._ctx)
            self._k.append(min(CLAMP, max(1.0 / CLAMP, (m / self._base) / profiled)))
        return self._k[extra]

    @property
    def factors(self) -> list[float]:
        """k(E) for E = 0..:data:`MAX_EXTRA`."""
        return [self.factor(e) for e in range(MAX_EXTRA + 1)]

    def round_seconds(self, B: float, context_len: float | None = None) -> float:
        return self.table.round_seconds(B, context_len) * self.factor(int(B) - self.requests)

    def sps(self, B: float, context_len: float | None = None) -> float:
        return 1.0 / self.round_seconds(B, context_len)

    def __call__(self, B: float, context_len: float | None = None) -> float:
        return self.sps(B, context_len)
