"""SPS table (runtime/speculation/sps.py): interpolation, monotonisation, storage, profile()."""

from __future__ import annotations

import json
import math

import pytest

from runtime.speculation.sps import (
    SpsTable,
    cache_key,
    cache_path,
    load_cached,
    profile,
    save_cached,
)
from tests.support import TEST_DATA

DATA = TEST_DATA / "sps_table.json"


def _key(**over):
    k = dict(model="m", dtype="float32", device="cpu", num_threads=2, engine_version="0.1")
    k.update(over)
    return cache_key(**k)


def test_interpolation_is_linear_in_round_time():
    t = SpsTable([1, 4, 8], [100, 300], [[20.0, 10.0, 5.0], [10.0, 5.0, 4.0]])
    # exact at buckets
    assert t.sps(4) == pytest.approx(10.0)
    assert t.sps(8, 300) == pytest.approx(4.0)
    # between buckets: round time 1/20 .. 1/10 linear in B; B=2 is 1/3 of the way
    assert t.round_seconds(2) == pytest.approx(0.05 + (0.10 - 0.05) / 3)
    assert t.sps(2) == pytest.approx(1 / (0.05 + 0.05 / 3))
    # context: halfway between 100 and 300 at B=4: times 0.1 and 0.2
    assert t.round_seconds(4, 200) == pytest.approx(0.15)
    # clamped context, None = shortest
    assert t.sps(4, 10) == t.sps(4, None) == pytest.approx(10.0)
    assert t.sps(4, 10_000) == pytest.approx(5.0)
    # above the last bucket: constant throughput of the last bucket (8 * 5 = 40 tok/s)
    assert t.sps(16) == pytest.approx(2.5)
    assert t.throughput(80) == pytest.approx(40.0)
    # fractional B is allowed, B < 1 is not
    assert 10.0 > t.sps(5.5) > 5.0
    with pytest.raises(ValueError):
        t.sps(0)


def test_monotonisation_running_min_and_throughput():
    # noisy measurement: a fake sweet spot at B=4 and a throughput dip at B=16
    raw = [[30.0, 29.0, 31.0, 20.0, 8.0]]
    t = SpsTable([1, 2, 4, 8, 16], [128], raw)
    v = t.values[0]
    assert v[2] == pytest.approx(29.0)  # running min removes the sweet spot
    # throughput at 16 raised to that at 8: 8*20/16 = 10
    assert v[4] == pytest.approx(10.0)
    assert all(b >= a for a, b in zip(v[1:], v))  # non-increasing
    thr = [b * s for b, s in zip(t.buckets, v)]
    assert all(y >= x - 1e-12 for x, y in zip(thr, thr[1:]))
    # without the throughput rule the dip stays
    t2 = SpsTable([1, 2, 4, 8, 16], [128], raw, enforce_throughput=False)
    assert t2.values[0][4] == pytest.approx(8.0)
    # idempotent
    t3 = SpsTable(t.buckets, t.context_lens, t.values)
    assert t3.values == t.values
    # longer context never faster
    t4 = SpsTable([1, 2], [100, 200], [[10.0, 9.0], [12.0, 8.0]])
    assert t4.values[1] == (10.0, 8.0)


def test_monotone_everywhere_on_dense_grid():
    t = SpsTable.load(DATA)
    for ctx in (None, 256, 700, 2048, 4096):
        prev_s, prev_thr = math.inf, 0.0
        for B in range(1, 300):
            s = t.sps(B, ctx)
            assert s <= prev_s + 1e-12
            assert B * s >= prev_thr - 1e-9
            prev_s, prev_thr = s, B * s
    for B in (1, 8, 50, 128):
        assert t.sps(B, 256) >= t.sps(B, 1000) >= t.sps(B, 2048)


def test_committed_table_is_plausible():
    d = json.loads(DATA.read_text())
    assert "ILLUSTRATIVE" in d["note"]
    t = SpsTable.load(DATA)
    assert len(t.context_lens) >= 2
    assert t.sps(8) / t.sps(1) > 0.9  # ~free up to 8 tokens
    assert t.sps(128) < t.sps(16) / 4  # ~1/B beyond 16


def test_validation_errors():
    with pytest.raises(ValueError):
        SpsTable([1, 1], [0], [[1.0, 1.0]])
    with pytest.raises(ValueError):
        SpsTable([1, 2], [0], [[1.0]])
    with pytest.raises(ValueError):
        SpsTable([1, 2], [0], [[1.0, -1.0]])
    with pytest.raises(ValueError):
        SpsTable([1, 2], [5, 3], [[1.0, 1.0], [1.0, 1.0]])
    with pytest.raises(ValueError):
        SpsTable.from_dict({"format": "other"})


def test_save_load_round_trip(tmp_path):
    t = SpsTable([1, 2, 4], [64, 512], [[9.0, 8.0, 7.0], [6.0, 5.5, 5.0]], key=_key(), note="x")
    p = t.save(tmp_path / "a" / "t.json")
    u = SpsTable.load(p)
    assert u.values == t.values and u.buckets == t.buckets and u.context_lens == t.context_lens
    assert u.key == t.key and u.note == "x"
    assert u.sps(3, 300) == t.sps(3, 300)


def test_cache_hit_and_key_mismatch(tmp_path):
    key = _key()
    t = SpsTable([1, 2], [64, 128], [[9.0, 8.0], [7.0, 6.0]], key=key)
    assert load_cached(key, tmp_path) is None  # nothing cached yet
    path = save_cached(t, tmp_path)
    assert path == cache_path(key, tmp_path)
    hit = load_cached(_key(), tmp_path)
    assert hit is not None and hit.values == t.values
    # any field differing → different file → miss
    for over in ({"dtype": "bfloat16"}, {"num_threads": 4}, {"model": "n"},
                 {"engine_version": "0.2"}, {"device": "cuda"}):
        assert load_cached(_key(**over), tmp_path) is None
    # a file at the right path whose stored key differs (hand-edited) → miss
    other = SpsTable([1, 2], [64, 128], [[9.0, 8.0], [7.0, 6.0]], key=_key(dtype="bfloat16"))
    other.save(cache_path(key, tmp_path))
    assert load_cached(key, tmp_path) is None
    # corrupt file → miss
    cache_path(key, tmp_path).write_text("{not json")
    assert load_cached(key, tmp_path) is None
    with pytest.raises(ValueError):
        save_cached(SpsTable([1], [0], [[1.0]]), tmp_path)


def test_profile_with_synthetic_round_fn():
    # affine cost: 20 ms + 1 ms/token beyond 8 tokens + 10 µs per context token;
    # every 7th call of the first two passes is a 10x hiccup (≤ 1 per cell), and one slow spell
    # (3x) lasts a whole pass's worth of calls, starting mid-pass (≤ 2 per cell): the
    # interleaved passes + median of 7 must ignore both. (Timing a cell's repeats back to back,
    # the spell covers two whole cells and corrupts them.)
    calls = []
    buckets, ctxs = [1, 2, 4, 8, 16, 32], [100, 1000]
    n = len(buckets) * len(ctxs)
    spell = range(2 * n + n // 2, 3 * n + n // 2)  # call indices of the slow spell (a timed pass's length)

    def round_fn(B: int, ctx: int) -> float:
        calls.append((B, ctx))
        base = 0.020 + 0.001 * max(0, B - 8) + 1e-5 * ctx
        i = len(calls) - 1
        return base * (10.0 if len(calls) % 7 == 0 and i < 2 * n else 1.0) * (3.0 if i in spell else 1.0)

    t = profile(round_fn, buckets, ctxs, repeats=7, warmup=1, key=_key())
    assert len(calls) == n * (7 + 1)
    for p in range(8):  # every pass visits every cell once, in a shuffled order
        assert sorted(calls[p * n:(p + 1) * n]) == sorted((B, c) for B in buckets for c in ctxs)
    assert calls[n:2 * n] != calls[2 * n:3 * n]
    for i, ctx in enumerate(ctxs):
        for j, B in enumerate(buckets):
            expect = 1.0 / (0.020 + 0.001 * max(0, B - 8) + 1e-5 * ctx)
            assert t.values[i][j] == pytest.approx(expect, rel=1e-9)
    assert t.key == _key()
    with pytest.raises(ValueError):
        profile(lambda B, c: 0.0, [1], [0], repeats=1)
    with pytest.raises(ValueError):
        profile(round_fn, [1], [0], repeats=0)
