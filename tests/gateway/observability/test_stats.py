"""gateway.observability.stats throughput definitions and gateway.core.config Settings."""

from __future__ import annotations

import statistics

import pytest

from gateway.observability import stats
from gateway.core.config import Settings
from runtime.config import EngineConfig
from runtime.interface import Finished, FinishReason, RequestTimings, decode_tokens_per_s


def finished(tokens: int, t_first: float, t_last: float) -> Finished:
    return Finished(FinishReason.STOP, 5, tokens, RequestTimings(first_token=t_first, last_token=t_last))


def test_user_tokens_per_s_is_median_of_decode_speeds():
    # decode tok/s = (n - 1) / (t_last - t_first): 9/1 = 9, 19/1 = 19, 4/2 = 2, None (1 token)
    rates = [finished(10, 0.0, 1.0), finished(20, 5.0, 6.0), finished(5, 0.0, 2.0), finished(1, 0.0, 0.0)]
    per_request = [f.decode_tokens_per_s for f in rates]
    assert per_request == [9.0, 19.0, 2.0, None]
    assert stats.user_tokens_per_s(per_request) == 9.0
    assert stats.user_tokens_per_s([4.0, 8.0]) == 6.0
    assert stats.user_tokens_per_s([None]) is None and stats.user_tokens_per_s([]) is None
    assert stats.decode_tokens_per_s is decode_tokens_per_s  # one definition, re-exported


def test_aggregate_tokens_per_s():
    assert stats.aggregate_tokens_per_s(300, 2.0) == 150.0
    assert stats.aggregate_tokens_per_s(300, 0.0) is None


def test_rolling_window():
    now = [0.0]
    rs = stats.RollingStats(horizon_s=100.0, clock=lambda: now[0])
    now[0] = 10.0
    rs.record(finished(11, 0.0, 1.0), "a")  # 10 tok/s
    now[0] = 50.0
    rs.record(finished(21, 0.0, 1.0), "b")  # 20 tok/s
    rs.record(finished(31, 0.0, 1.0), "a")  # 30 tok/s
    w = rs.window(60.0)
    assert (w.requests, w.completion_tokens) == (3, 63)
    assert w.user_tokens_per_s == 20.0 and w.aggregate_tokens_per_s == pytest.approx(63 / 50.0)  # only 50 s old
    assert rs.window(60.0, tenant="a").user_tokens_per_s == statistics.median([10.0, 30.0])
    now[0] = 100.0
    w = rs.window(60.0)  # the t=10 record fell out of the window
    assert (w.requests, w.completion_tokens, w.aggregate_tokens_per_s) == (2, 52, pytest.approx(52 / 60.0))
    now[0] = 140.0
    rs.record(finished(2, 0.0, 1.0))  # horizon 100 s: the t=10 record is dropped, t=50 ones kept
    assert len(rs._records) == 3 and rs.window(1000).requests == 3
    now[0] = 400.0
    rs.record(finished(2, 0.0, 1.0))
    assert len(rs._records) == 1  # older than the horizon: dropped


def test_settings_defaults_env_and_engine_config(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for var in ("SPARKGATE_DATABASE_URL", "SPARKGATE_PORT", "SPARKGATE_CORS_ORIGINS", "SPARKGATE_DTYPE",
                "SPARKGATE_SPEC_METHOD"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SPARKGATE_CACHE_DIR", str(tmp_path / "cache"))
    s = Settings()
    assert (s.host, s.port, s.dtype, s.max_batch_size, s.max_context, s.max_waiting) == (
        "127.0.0.1", 8000, "auto", 16, 8192, 256)
    assert (s.spec_method, s.cors_origins, s.admin_token, s.model_name) == ("auto", [], None, "SmolLM2-135M-Instruct")
    assert s.database_url == f"sqlite+aiosqlite:///{tmp_path / 'cache' / 'sparkgate.db'}"

    monkeypatch.setenv("SPARKGATE_PORT", "9001")
    monkeypatch.setenv("SPARKGATE_CORS_ORIGINS", "http://a.example, http://b.example")
    monkeypatch.setenv("SPARKGATE_SPEC_METHOD", "dspark")
    monkeypatch.setenv("SPARKGATE_NUM_SPECULATIVE_TOKENS", "5")
    (tmp_path / ".env").write_text("SPARKGATE_DTYPE=float32\nSPARKGATE_MAX_CONTEXT=1024\n")
    s = Settings()
    assert s.port == 9001 and s.cors_origins == ["http://a.example", "http://b.example"]
    assert s.dtype == "float32" and s.max_context == 1024
    cfg = s.engine_config()
    assert isinstance(cfg, EngineConfig)
    assert (cfg.dtype, cfg.max_context, cfg.spec_method, cfg.num_speculative_tokens, cfg.request_timeout_s) == (
        "float32", 1024, "dspark", 5, 600.0)
    monkeypatch.setenv("SPARKGATE_CORS_ORIGINS", '["http://c.example"]')
    assert Settings().cors_origins == ["http://c.example"]
