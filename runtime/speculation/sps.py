"""SPS table: target verification rounds per second vs verification tokens B.

Paper §3.2.2: the hardware-aware scheduler needs SPS(B), the number of full engine
rounds (draft + verify) per second when the target verifies B tokens in one forward
(B = Σ_r (1 + ℓ_r): one anchor/bonus slot per request plus the admitted drafts). It
is profiled once at start-up and cached on disk, keyed by everything that changes
it (model, dtype, device, thread count, engine version).

Torch-free on purpose: the engine supplies the measurement as a plain callable.

Layout: ``buckets`` (B values, strictly increasing, e.g. 1, 2, 4, …, 128) ×
``context_lens`` (strictly increasing, ≥ 1, normally ≥ 2) → steps/s.

Monotonisation (applied by the constructor, idempotent):
    1. profile() reduces the repeats of each cell to their median round time;
    2. along B: running minimum of SPS (more tokens never make a round faster);
    3. along B, if ``enforce_throughput``: throughput B·SPS(B) (tokens/s) is made
       non-decreasing by raising SPS(B_i) to at least B_{i−1}·SPS(B_{i−1})/B_i —
       that value never exceeds SPS(B_{i−1}), so step 2 still holds (a bigger batch
       can always be run as the smaller one plus idle slots, so it should not lose
       throughput; measurement noise otherwise creates fake "sweet spots");
    4. along context length: running minimum over increasing context (the min of
       functions that satisfy 2 and 3 still satisfies both).

Interpolation: linear in B and in context length **of the round time 1/SPS**
(bilinear), i.e. an affine cost model between measured points. Interpolating the
round time rather than SPS itself keeps both properties of steps 2 and 3 between
buckets (linear interpolation of SPS can make B·SPS dip inside a segment). Outside
the measured range: B below the first bucket uses the first bucket; B above the last
bucket keeps the last bucket's throughput (round time ∝ B, a conservative
compute-bound extrapolation); context length is clamped to the measured range.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

__all__ = [
    "SpsTable",
    "DEFAULT_BUCKETS",
    "DEFAULT_CONTEXT_LENS",
    "FORMAT",
    "cache_key",
    "cache_path",
    "load_cached",
    "save_cached",
    "profile",
]

FORMAT = "sparkgate-sps-v1"
DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
DEFAULT_CONTEXT_LENS: tuple[int, ...] = (256, 2048)


def _normalise_key(key: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """JSON round trip with sorted keys, so a key compares equal to its loaded copy."""
    if key is None:
        return None
    return json.loads(json.dumps(dict(key), sort_keys=True))


class SpsTable:
    """Profiled steps-per-second table, monotonised and interpolated (module docstring).

    Args:
        buckets: verification-token counts B, strictly increasing ints ≥ 1.
        context_lens: context lengths (tokens), strictly increasing ints ≥ 0.
        sps: ``sps[i][j]`` = rounds/s at ``context_lens[i]`` and ``buckets[j]``;
            finite and > 0.
        key: cache key (see :func:`cache_key`), JSON-serialisable; ``None`` if unkeyed.
        enforce_throughput: apply monotonisation step 3 (B·SPS non-decreasing).
        note: free text saved with the table.

    Raises:
        ValueError: on shape mismatch, non-increasing axes, or non-positive /
            non-finite values.
    """

    def __init__(
        self,
        buckets: Sequence[int],
        context_lens: Sequence[int],
        sps: Sequence[Sequence[float]],
        *,
        key: Mapping[str, Any] | None = None,
        enforce_throughput: bool = True,
        note: str = "",
    ) -> None:
        b = [int(x) for x in buckets]
        c = [int(x) for x in context_lens]
        if not b or any(x < 1 for x in b) or any(y <= x for x, y in zip(b, b[1:])):
            raise ValueError(f"buckets must be strictly increasing ints >= 1, got {b}")
        if not c or any(x < 0 for x in c) or any(y <= x for x, y in zip(c, c[1:])):
            raise ValueError(f"context_lens must be strictly increasing ints >= 0, got {c}")
        rows = [[float(v) for v in row] for row in sps]
        if len(rows) != len(c) or any(len(row) != len(b) for row in rows):
            raise ValueError(f"sps must be {len(c)} rows of {len(b)} values")
        if any(not (math.isfinite(v) and v > 0.0) for row in rows for v in row):
            raise ValueError("sps values must be finite and > 0")
        for row in rows:
            for j in range(1, len(b)):
                row[j] = min(row[j], row[j - 1])
                if enforce_throughput:
                    row[j] = max(row[j], row[j - 1] * b[j - 1] / b[j])
        for i in range(1, len(rows)):
            rows[i] = [min(v, u) for v, u in zip(rows[i], rows[i - 1])]
        self.buckets: tuple[int, ...] = tuple(b)
        self.context_lens: tuple[int, ...] = tuple(c)
        self.values: tuple[tuple[float, ...], ...] = tuple(tuple(r) for r in rows)
        self.key: dict[str, Any] | None = _normalise_key(key)
        self.enforce_throughput = bool(enforce_throughput)
        self.note = note
        self._times = [[1.0 / v for v in row] for row in rows]

    # ------------------------------------------------------------------ lookup
    def _row_time(self, i: int, B: float) -> float:
        b, t = self.buckets, self._times[i]
        if B <= b[0]:
            return t[0]
        if B >= b[-1]:
            return t[-1] * B / b[-1]
        j = bisect.bisect_right(b, B) - 1  # b[j] <= B < b[j+1]
        f = (B - b[j]) / (b[j + 1] - b[j])
        return t[j] + f * (t[j + 1] - t[j])

    def round_seconds(self, B: float, context_len: float | None = None) -> float:
        """Interpolated seconds per round at B verification tokens (see module doc).

        Args:
            B: verification tokens in the round (≥ 1; fractional allowed).
            context_len: context length in tokens; ``None`` → shortest profiled one.

        Raises:
            ValueError: ``B < 1`` or NaN.
        """
        if not (B >= 1):
            raise ValueError(f"B must be >= 1, got {B!r}")
        c = self.context_lens
        if context_len is None or len(c) == 1 or context_len <= c[0]:
            return self._row_time(0, B)
        if context_len >= c[-1]:
            return self._row_time(len(c) - 1, B)
        i = bisect.bisect_right(c, context_len) - 1
        f = (context_len - c[i]) / (c[i + 1] - c[i])
        t0, t1 = self._row_time(i, B), self._row_time(i + 1, B)
        return t0 + f * (t1 - t0)

    def sps(self, B: float, context_len: float | None = None) -> float:
        """Rounds per second at B verification tokens: ``1 / round_seconds(B, ctx)``.

        Non-increasing in B and in context length; ``B·sps(B)`` non-decreasing in B
        when ``enforce_throughput``. Raises ValueError for ``B < 1``.
        """
        return 1.0 / self.round_seconds(B, context_len)

    def __call__(self, B: float, context_len: float | None = None) -> float:
        return self.sps(B, context_len)

    def throughput(self, B: float, context_len: float | None = None) -> float:
        """Verification tokens per second, ``B · sps(B)``."""
        return B * self.sps(B, context_len)

    # ---------------------------------------------------------------- storage
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (format ``sparkgate-sps-v1``)."""
        return {
            "format": FORMAT,
            "key": self.key,
            "buckets": list(self.buckets),
            "context_lens": list(self.context_lens),
            "sps": [list(r) for r in self.values],
            "enforce_throughput": self.enforce_throughput,
            "note": self.note,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SpsTable":
        """Inverse of :meth:`to_dict`. Raises ValueError on a wrong ``format``."""
        if d.get("format") != FORMAT:
            raise ValueError(f"not an SPS table (format={d.get('format')!r})")
        return cls(
            d["buckets"],
            d["context_lens"],
            d["sps"],
            key=d.get("key"),
            enforce_throughput=bool(d.get("enforce_throughput", True)),
            note=str(d.get("note", "")),
        )

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write JSON atomically (temp file + rename); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".sps-", suffix=".json", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_dict(), f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "SpsTable":
        """Read a table written by :meth:`save`. Raises OSError / ValueError."""
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def __repr__(self) -> str:
        return (
            f"SpsTable(buckets={list(self.buckets)}, context_lens={list(self.context_lens)}, "
            f"key={self.key})"
        )


# -------------------------------------------------------------------- cache
def cache_key(
    *,
    model: str,
    dtype: str,
    device: str,
    num_threads: int,
    engine_version: str,
    **extra: Any,
) -> dict[str, Any]:
    """Cache key of a profile: everything that changes SPS. ``extra`` (e.g. drafter
    layers, γ, max batch) is included verbatim; values must be JSON-serialisable."""
    key = dict(
        model=str(model),
        dtype=str(dtype),
        device=str(device),
        num_threads=int(num_threads),
        engine_version=str(engine_version),
    )
    key.update(extra)
    return _normalise_key(key)  # type: ignore[return-value]


def cache_path(key: Mapping[str, Any], cache_dir: str | os.PathLike[str]) -> Path:
    """``<cache_dir>/sps-<sha256(key)[:16]>.json``."""
    blob = json.dumps(_normalise_key(key), sort_keys=True).encode()
    return Path(cache_dir) / f"sps-{hashlib.sha256(blob).hexdigest()[:16]}.json"


def load_cached(key: Mapping[str, Any], cache_dir: str | os.PathLike[str]) -> SpsTable | None:
    """The cached table for ``key``, or ``None`` if absent, unreadable, corrupt, or
    stored under a different key (hash collision or hand-edited file)."""
    path = cache_path(key, cache_dir)
    try:
        table = SpsTable.load(path)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if table.key != _normalise_key(key):
        return None
    return table


def save_cached(table: SpsTable, cache_dir: str | os.PathLike[str]) -> Path:
    """Store ``table`` under its own key. Raises ValueError if ``table.key`` is None."""
    if table.key is None:
        raise ValueError("cannot cache an SpsTable without a key")
    return table.save(cache_path(table.key, cache_dir))


# ------------------------------------------------------------------ profile
def profile(
    round_fn: Callable[[int, int], float],
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    context_lens: Sequence[int] = DEFAULT_CONTEXT_LENS,
    repeats: int = 5,
    *,
    warmup: int = 1,
    key: Mapping[str, Any] | None = None,
    enforce_throughput: bool = True,
    note: str = "",
    seed: int = 0,
) -> SpsTable:
    """Measure SPS(B, context) by timing full engine rounds, all cells interleaved.

    ``warmup`` untimed passes, then ``repeats`` timed passes; every pass runs each
    (context, B) cell once, in an order shuffled per pass. Timing a cell's repeats back to
    back let a slow spell of the machine (another tenant, frequency, page cache) land on
    whole cells: on the 2-core EPYC two profiles of the same engine 90 minutes apart
    disagreed by up to 34 % per cell (8 tokens: 114 vs 152 ms), and a slow first cell
    (B = 1) raised every small-B cell through the running minimum. Interleaved, a slow
    spell as long as a pass touches each cell at most twice, which the median of ≥ 5
    repeats ignores.

    Args:
        round_fn: ``round_fn(B, context_len) -> seconds``: runs one full engine round
            (draft + verify) with B verification tokens at that context length and
            returns its wall time in seconds (finite, > 0).
        buckets: B values to measure (strictly increasing ints ≥ 1).
        context_lens: context lengths to measure (strictly increasing).
        repeats: timed calls per cell; the median is kept (robust to hiccups).
        warmup: untimed calls per cell before the timed ones (results discarded).
        key, enforce_throughput, note: passed to :class:`SpsTable`.
        seed: seed of the per-pass cell order.

    Returns:
        The monotonised table (``sps = 1 / median seconds`` before monotonisation).

    Raises:
        ValueError: ``repeats < 1``, ``warmup < 0``, or round_fn returned a
            non-finite or non-positive time.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    cells = [(int(ctx), int(B)) for ctx in context_lens for B in buckets]
    times: dict[tuple[int, int], list[float]] = {c: [] for c in cells}
    order = random.Random(seed)
    for p in range(warmup + repeats):
        order.shuffle(cells)
        for ctx, B in cells:
            t = float(round_fn(B, ctx))
            if not (math.isfinite(t) and t > 0.0):
                raise ValueError(f"round_fn({B}, {ctx}) returned {t!r} seconds")
            if p >= warmup:
                times[(ctx, B)].append(t)
    rows = [[1.0 / statistics.median(times[(int(ctx), int(B))]) for B in buckets] for ctx in context_lens]
    return SpsTable(
        buckets, context_lens, rows, key=key, enforce_throughput=enforce_throughput, note=note
    )


def fallback_table() -> SpsTable:
    """An SPS table used until a profiled one exists (``sparkgate profile``).

    Shape measured once on the 2-core CPU dev machines for this model in bf16: a
    round costs about the same for 1..8 verification tokens, then grows roughly
    linearly (compute-bound). Replace it with a profiled table for real serving.
    """
    buckets = [1, 2, 4, 8, 16, 32, 64, 128]
    sps = [30.0, 29.5, 29.0, 27.0, 20.0, 12.0, 6.5, 3.4]
    return SpsTable(buckets, [512], [sps], note="fallback: illustrative CPU shape, not profiled")
