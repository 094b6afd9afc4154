"""The SPS profile (runtime.speculation.sps_profiler, runtime.engine.profile): the real round function,
cache-or-profile at start-up, and that disabled profiling never profiles.

Only ``test_round_fn_*`` time real rounds (tiny B, fp32, a few ms each); everything
else replaces the round function with a counting fake, so no test pays for a profile.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest

import runtime.speculation.sps_profiler as sp
from runtime.engine import profile as engine_profile
from runtime.config import EngineConfig
from runtime.speculation.sps import SpsTable, cache_path, load_cached
from runtime.engine.llm_engine import LLMEngine
from tests.support import TEST_DATA

pytestmark = pytest.mark.model

COMMITTED = TEST_DATA / "sps_table.json"


class FakeRound:
    """Counting stand-in for EngineRoundFn: round time 10 ms + 1 ms per token (seconds)."""

    def __init__(self):
        self.calls: list[tuple[int, int]] = []

    def __call__(self, B: int, ctx: int) -> float:
        self.calls.append((B, ctx))
        return 0.010 + 0.001 * B + 1e-6 * ctx


@pytest.fixture
def fake_round(monkeypatch, tmp_path):
    """Empty SPS cache dir + make_round_fn → FakeRound (records every call)."""
    monkeypatch.setattr(sp, "sps_cache_dir", lambda: tmp_path / "sps")
    monkeypatch.setattr(sp, "GLOBAL_WARMUP_S", 0.0)  # the fake needs no warming (calls are counted below)
    fake = FakeRound()
    monkeypatch.setattr(sp, "make_round_fn", lambda model, speculator, cache, temperature=1.0: fake)
    return fake


def make(target_fp32, tokenizer, **kw):
    cfg = dict(dtype="float32", spec_method="dspark", max_batch_size=2, max_context=512, num_speculative_tokens=3)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), lambda rid, ev: None, model=target_fp32, tokenizer=tokenizer)


def test_split_budget_and_buckets():
    assert sp.split_budget(1, 7) == [0]
    assert sp.split_budget(8, 7) == [7]
    assert sp.split_budget(9, 7) == [4, 3]  # 2 requests: 5 + 4 tokens
    assert sp.split_budget(128, 7) == [7] * 16
    assert sp.split_budget(5, 0) == [0] * 5
    for B in range(1, 200):
        ells = sp.split_budget(B, 7)
        assert sum(1 + l for l in ells) == B and all(0 <= l <= 7 for l in ells)
        assert len(ells) == math.ceil(B / 8)
    # every B to 16 (a round's cost steps at small B), then 17, 24, 32, 48, … and the top
    assert sp.profile_buckets(16, 7) == list(range(1, 18)) + [24, 32, 48, 64, 96, 128]
    assert sp.profile_buckets(16, 4) == list(range(1, 18)) + [24, 32, 48, 64, 80]
    assert sp.profile_buckets(2, 3) == list(range(1, 9))
    assert sp.profile_buckets(3, 4) == list(range(1, 16))
    assert sp.profile_buckets(1, 0) == [1]
    assert sp.profile_context_lens(2048, 7) == [256, 1024]
    assert sp.profile_context_lens(512, 7) == [256, 503]


@pytest.mark.parametrize("method", ["dspark", "prompt_lookup"])
def test_round_fn_times_real_rounds_and_restores_caches(target_fp32, tokenizer, monkeypatch, tmp_path, method):
    monkeypatch.setattr(sp, "sps_cache_dir", lambda: tmp_path / "sps")
    engine = make(target_fp32, tokenizer, spec_method=method)
    rf = sp.EngineRoundFn(engine.model, engine.speculator, engine.cache)
    for B, ctx in [(1, 16), (3, 16), (4, 40), (8, 100)]:  # 8 = 2 requests × (1 + γ=3)
        t = rf(B, ctx)
        assert math.isfinite(t) and 0.0 < t < 30.0
    assert rf.calls == 4
    assert engine.cache.num_free == 2 and engine.cache.lengths == [0, 0]
    if engine.speculator.dcache is not None:
        assert engine.speculator.dcache.lengths == [0, 0]
    with pytest.raises(ValueError):
        rf(9, 16)  # needs 3 slots, the engine has 2
    with pytest.raises(ValueError):
        rf(1, 513)  # context + γ + 1 > the KV slot (512 + 1 + γ)
    # explicit served shapes (bench/round_shapes.py): 2 requests with 0 and 3 drafts
    t = rf.time_round([0, 3], 32)
    assert math.isfinite(t) and 0.0 < t < 30.0 and rf.calls == 5
    for bad in ([], [4], [-1, 0], [1, 1, 1]):  # none, > γ = 3, negative, 3 slots of 2
        with pytest.raises(ValueError):
            rf.time_round(bad, 16)
    assert engine.cache.num_free == 2 and engine.cache.lengths == [0, 0]


def test_profile_disabled_uses_fallback_and_never_profiles(target_fp32, tokenizer, fake_round):
    engine = make(target_fp32, tokenizer, profile_on_start=False)
    assert fake_round.calls == []
    table = engine.speculator.sps_table
    assert table.key is None and table.note.startswith("fallback")
    # explicit table file: used as is, even with profile_on_start
    engine = make(target_fp32, tokenizer, profile_on_start=True, sps_table_path=str(COMMITTED))
    assert fake_round.calls == []
    assert engine.speculator.sps_table.to_dict() == SpsTable.load(COMMITTED).to_dict()


def test_profile_on_start_profiles_once_then_hits_cache(target_fp32, tokenizer, fake_round):
    engine = make(target_fp32, tokenizer, profile_on_start=True)
    buckets, ctxs = list(range(1, 9)), [256, 507]  # B ≤ 2 requests × (1+γ); 1024 clipped to 512 − γ − 2
    per_cell = sp.DEFAULT_WARMUP + sp.DEFAULT_REPEATS
    # one table for sampled batches (T = 1) and one for greedy batches (T = 0)
    assert len(fake_round.calls) == len(buckets) * len(ctxs) * per_cell * len(sp.PROFILE_TEMPERATURES)
    greedy = engine.speculator.sps_table_greedy
    assert greedy.key == sp.sps_cache_key(engine.config, engine.model, engine.speculator, 0.0)
    assert greedy.key["temperature"] == 0.0
    assert sorted(set(fake_round.calls)) == sorted((b, c) for b in buckets for c in ctxs)
    table = engine.speculator.sps_table
    assert list(table.buckets) == buckets and list(table.context_lens) == ctxs
    key = sp.sps_cache_key(engine.config, engine.model, engine.speculator)
    assert table.key == key and key["gamma"] == 3 and key["dtype"] == "float32"
    assert key["drafter"].startswith("dspark:L2:r64")
    # the fake's cost model survives monotonisation: SPS(B) = 1/(0.010 + 0.001 B + 1e-6 ctx)
    assert table.sps(4, 256) == pytest.approx(1 / (0.014 + 256e-6))
    assert table.sps(8, 507) == pytest.approx(1 / (0.018 + 507e-6))
    assert cache_path(key, sp.sps_cache_dir()).exists()
    assert load_cached(key, sp.sps_cache_dir()).to_dict() == table.to_dict()
    # second start with the same config: cached, no profiling; also without profile_on_start
    n = len(fake_round.calls)
    for on_start in (True, False):
        again = make(target_fp32, tokenizer, profile_on_start=on_start)
        assert len(fake_round.calls) == n
        assert again.speculator.sps_table.to_dict() == table.to_dict()


def test_a_profile_taken_on_a_busy_machine_is_used_but_not_cached(target_fp32, tokenizer, fake_round, monkeypatch):
    """Other processes above BUSY_CORES_LIMIT during the profile: the engine serves with the
    table it measured, nothing is cached, and the next start profiles again; idle: cached."""
    load = {"cores": sp.BUSY_CORES_LIMIT + 0.5}
    monkeypatch.setattr(sp, "other_cpu_load", lambda: lambda: load["cores"])
    engine = make(target_fp32, tokenizer, profile_on_start=True)
    n = len(fake_round.calls)
    key = sp.sps_cache_key(engine.config, engine.model, engine.speculator)
    assert n > 0 and engine.speculator.sps_table.key == key and "not cached" in engine.speculator.sps_table.note
    assert not cache_path(key, sp.sps_cache_dir()).exists()
    load["cores"] = sp.BUSY_CORES_LIMIT - 0.25
    again = make(target_fp32, tokenizer, profile_on_start=True)
    assert len(fake_round.calls) == 2 * n  # profiled again, now cached
    assert load_cached(key, sp.sps_cache_dir()).to_dict() == again.speculator.sps_table.to_dict()


def test_a_profiled_table_keeps_the_step_of_a_row_count(monkeypatch):
    """A round whose cost steps up past 8 rows (MKL's GEMM: +40 % from 8 to 9 fp32 rows on the
    Ice Lake Xeon) keeps that step in the profiled table; throughput monotonisation would cap
    9 rows at 9/8 of 8 and let the budget admit a 9th row at c = 8 for +12.5 %."""
    monkeypatch.setattr(sp, "GLOBAL_WARMUP_S", 0.0)

    def stepped(B: int, ctx: int) -> float:
        return 0.040 if B <= 8 else 0.056

    table = sp.profile_table(stepped, {"test": "step"}, max_requests=2, max_context=512, gamma=4,
                             context_lens=[256], repeats=1, warmup=0, save=False)
    assert table.round_seconds(8, 256) == pytest.approx(0.040)
    assert table.round_seconds(9, 256) == pytest.approx(0.056)
    assert table.round_seconds(10, 256) == pytest.approx(0.056)


def test_other_cpu_load_counts_other_processes_not_this_one():
    """A busy loop in a child process reads as ~1 core of other load above what an idle
    window reads (whatever else the machine runs); the same loop in this process (own CPU
    time is subtracted) adds nearly nothing."""
    import subprocess
    import sys
    import time

    probe = sp.other_cpu_load()
    time.sleep(0.8)
    idle = probe()
    spin = "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < 0.8: pass"
    probe = sp.other_cpu_load()
    subprocess.run([sys.executable, "-c", spin], check=True)
    child = probe()
    probe = sp.other_cpu_load()
    t = time.perf_counter()
    while time.perf_counter() - t < 0.8:
        pass
    own = probe()
    assert child - idle > 0.5 and own - idle < 0.35, (idle, child, own)


def test_cache_key_mismatch_reprofiles(target_fp32, tokenizer, fake_round):
    make(target_fp32, tokenizer, profile_on_start=True)
    n = len(fake_round.calls)
    assert n > 0
    other = make(target_fp32, tokenizer, profile_on_start=True, num_speculative_tokens=2)  # γ differs
    assert sp.profile_buckets(2, 2) == [1, 2, 3, 4, 5, 6]
    # 6 buckets × 2 contexts × (warm-up + repeats) × 2 temperatures
    assert len(fake_round.calls) == n + 6 * 2 * (sp.DEFAULT_WARMUP + sp.DEFAULT_REPEATS) * 2
    assert other.speculator.sps_table.key["gamma"] == 2
    # a cache file whose stored key differs (hand-edited) is not trusted
    key = sp.sps_cache_key(other.config, other.model, other.speculator)
    path = cache_path(key, sp.sps_cache_dir())
    d = json.loads(path.read_text())
    d["key"]["num_threads"] = 999
    path.write_text(json.dumps(d))
    m = len(fake_round.calls)
    make(target_fp32, tokenizer, profile_on_start=True, num_speculative_tokens=2)
    assert len(fake_round.calls) > m
    # a different engine version (edited hot-path code) is a miss too
    assert sp.engine_version().startswith(f"{sp.PROFILE_VERSION}+")


def test_cli_profiles_and_prints_json(target_fp32, tokenizer, fake_round, monkeypatch, capsys):
    import runtime.engine.llm_engine

    monkeypatch.setattr(runtime.engine.llm_engine, "load_llama", lambda path, dtype: target_fp32)  # no reload (time)
    monkeypatch.setattr(runtime.engine.llm_engine, "load_tokenizer", lambda path: tokenizer)
    assert str(sp.sps_cache_dir()).startswith(str(Path(tempfile.gettempdir())))  # never the real cache
    rc = engine_profile.main(["--dtype", "float32", "--max-batch-size", "1", "--gamma", "1", "--max-context", "64",
                  "--contexts", "16", "32", "--repeats", "1", "--warmup", "0"])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["format"] == "sparkgate-sps-v1" and out["buckets"] == [1, 2] and out["context_lens"] == [16, 32]
    assert len(fake_round.calls) == 4
    assert out["sps"][0][0] == pytest.approx(1 / (0.011 + 16e-6))
    engine_profile.main(["--dtype", "float32", "--max-batch-size", "1", "--gamma", "1", "--max-context", "64", "--contexts", "16", "32"])
    assert len(fake_round.calls) == 4  # second call: cache hit
