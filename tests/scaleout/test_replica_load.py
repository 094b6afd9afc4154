"""A shortened ``bench/replica_load.py`` (issue 30 item 5's load test): 12 streamed clients for
12 s through HAProxy → two gateway replicas (one Postgres, one Redis) → the real sglang-router →
two SGLang stand-ins, a fifth of the requests cut by their client mid-stream, replica ``ra``
restarted with SIGTERM halfway. docs/reliability.md has the full-size run's figures.

Skips without haproxy, the pinned sglang-router, Postgres or Redis; fails under ``CI=true``.
"""

from __future__ import annotations

import shutil

import pytest
import redis

from tests.conftest import require_or_skip
from tests.support.hardening_util import load_bench
from tests.support.scaleout import router_missing

pytestmark = [pytest.mark.scaleout, pytest.mark.slow, pytest.mark.postgres]


def test_replica_pair_under_load_with_disconnects_and_a_restart(tmp_path, capsys):
    require_or_skip(shutil.which("haproxy") is not None, "haproxy (apt-get install haproxy)")
    require_or_skip(router_missing() is None, f"sglang-router ({router_missing()}; pip install -e '.[scaleout]')")
    try:
        redis.Redis.from_url("redis://127.0.0.1:6379/0", socket_connect_timeout=1).ping()
    except redis.RedisError as exc:
        require_or_skip(False, f"Redis at 127.0.0.1:6379 ({exc!r})")
    out = load_bench("replica_load").run(streams=12, duration_s=12, disconnect=0.2, cap=8, tokens=16, step_ms=50,
                                         seed=1, tmp=tmp_path)
    with capsys.disabled():
        print(f"\nreplica pair: {out['requests']} requests {out['by_end']}, records {out['records']['by_status']}, "
              f"peak {out['peak_running']}/{out['cap']}, restart {out['restart']}")
    assert out["http_5xx"] == 0 and out["errors"] == {}, out
    ends = out["by_end"]
    assert set(ends) == {"done", "disconnected"} and ends["disconnected"] >= 1, ends
    rec = out["records"]
    assert (rec["lost"], rec["duplicated"], rec["unexpected"]) == (0, 0, 0), rec
    assert rec["rows"] == out["requests"]  # every request answered 200 and left exactly one record
    # a stream its client cut after 3 chunks may have finished at the gateway before it saw the close
    assert sum(rec["by_status"].values()) == rec["rows"] and set(rec["by_status"]) <= {"finished", "cancelled"}
    assert 1 <= rec["by_status"].get("cancelled", 0) <= ends["disconnected"], rec
    assert out["peak_running"] == out["cap"] == 8  # the cap bound and held across both replicas
    assert out["restart"]["exit_code"] == -15 and out["restart"]["ra_records_after_restart"] >= 1
    assert set(rec["by_replica"]) == {"ra", "rb"}
    assert out["ok"]
