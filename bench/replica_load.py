"""Load across a gateway replica pair (issue 30 item 5; docs/reliability.md "Replica pair under load").

The scale-out stack of docs/deploy.md, all real processes but the engines: HAProxy (Debian's
``haproxy``) round robin over two gateway replicas (uvicorn subprocesses) on one Postgres database
(new, dropped at the end) and one Redis (127.0.0.1:6379, a key prefix of its own), both streaming
from the real sglang-router (``sglang-router==0.3.2``, the ``scaleout`` extra) in front of two SGLang
stand-ins (``tests/support/sglang_standin.py``: SGLang's HTTP API, ``--tokens`` tokens
``--step-ms`` apart, no model).

``--streams`` clients each send streamed chat requests back to back for ``--duration`` seconds
through HAProxy with one tenant's key; a fraction ``--disconnect`` of the requests (drawn with
``--seed``) closes the connection after its third content chunk. Halfway through, replica ``ra``
gets SIGTERM (it drains its streams and exits), then is started again; the load goes on past
``--duration`` until ``ra`` has been back for 3 s. The tenant's tier caps
concurrency at ``--cap`` (Redis leases, shared by both replicas) with a long queue wait, so the
cap binds and nothing is refused.

Prints one JSON object: requests by HTTP status and by end (done / disconnected / error event /
transport error), 5xx count, the records in the database against the responses the clients saw
(``lost``: a response id without a record; ``duplicated``: more rows than ids; ``unexpected``:
rows without a client-visible id; statuses), the peak of requests running at the stand-ins vs the
cap, TTFT p50/p99 (ms, as the clients saw them), the drain and restart times, the requests each
replica served, and ``ok`` (0 5xx, 0 transport errors, 0 error events, 0 lost or duplicated, cap
held, both replicas served after the restart). Exit status 0 iff ``ok``.

Needs: haproxy, the pinned sglang-router, Postgres at 127.0.0.1:5432 and Redis at 127.0.0.1:6379.
Usage::

    .venv/bin/python bench/replica_load.py --streams 64 --duration 120 --disconnect 0.1

``tests/scaleout/test_replica_load.py`` runs a shortened one (12 streams, 12 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import redis  # noqa: E402

from gateway.db.migrate import upgrade  # noqa: E402
from tests.runtime.sglang.test_gateway import write_tokenizer  # noqa: E402
from tests.support.polling import wait_until  # noqa: E402
from tests.support.scaleout import Balancer, Replica, Router, fetch_records, replica_env  # noqa: E402
from tests.support.sglang_standin import StandinServer  # noqa: E402
from tests.support.tenancy_fixtures import new_pg_database  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
ADMIN = "sk-admin-replica-load"
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}
DISCONNECT_AFTER = 3  # content chunks read before a disconnecting client closes
AFTER_RESTART_S = 3.0  # load continues at least this long after the restarted replica is ready


@dataclass
class Result:
    """One request as its client saw it."""

    status: int | None = None  # HTTP status (None: no response)
    id: str | None = None  # the completion id of the first chunk
    end: str = "open"  # done | disconnected | error_event | transport_error | http_error
    error: str | None = None  # the OpenAI error code of an HTTP error or an error event
    ttft_s: float | None = None


@dataclass
class Load:
    """What the clients saw, and the peaks of requests running at the stand-ins (both), polled every
    5 ms: ``peak_at_workers`` counts every open stream, ``peak`` leaves out those whose client has
    already closed (the gateway admits the next request when it sees the close, while the worker
    notices at its next chunk): the concurrency the gateways' cap governs."""

    results: list[Result] = field(default_factory=list)
    closed: set[str] = field(default_factory=set)  # ids of requests whose client disconnected
    peak: int = 0
    peak_at_workers: int = 0
    back_at: float = 0.0  # time.monotonic() when the restarted replica was ready


async def one_request(client: httpx.AsyncClient, url: str, headers: dict, body: dict, disconnect: bool,
                      closed: set[str]) -> Result:
    res, t0 = Result(), time.monotonic()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            res.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                res.end = "http_error"
                try:
                    res.error = r.json()["error"]["code"]
                except (ValueError, KeyError, TypeError):
                    res.error = r.text[:80]
                return res
            chunks = 0
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    res.end = "done" if res.end == "open" else res.end
                    break
                if not line.startswith("data: {"):
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    res.end, res.error = "error_event", data["error"].get("code")
                    continue
                if res.id is None:
                    res.id, res.ttft_s = data["id"], time.monotonic() - t0
                if data["choices"] and data["choices"][0]["delta"].get("content"):
                    chunks += 1
                    if disconnect and chunks >= DISCONNECT_AFTER:
                        res.end = "disconnected"
                        closed.add(res.id)  # from now on not counted as running (see Load)
                        break  # leaving the block closes the connection mid-stream
    except httpx.HTTPError:
        res.end = "transport_error"
    return res


async def drive(lb: str, key: str, streams: int, duration_s: float, disconnect: float, seed: int,
                load: Load, restarted: threading.Event) -> None:
    """Keep ``streams`` clients busy for ``duration_s`` seconds and, past that, until the restarted
    replica has been back for :data:`AFTER_RESTART_S` (at most 120 s more)."""
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello"}], "stream": True,
            "max_tokens": 64}
    end = time.monotonic() + duration_s
    hard_end = end + 120
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(base_url=lb, timeout=httpx.Timeout(120, connect=5), limits=limits) as client:
        async def worker() -> None:
            while time.monotonic() < hard_end and (time.monotonic() < end or not restarted.is_set()
                                                   or time.monotonic() < load.back_at + AFTER_RESTART_S):
                cut = rng.random() < disconnect
                load.results.append(await one_request(client, "/v1/chat/completions", headers, body, cut,
                                                     load.closed))

        await asyncio.gather(*(worker() for _ in range(streams)))


def restart(replica: Replica, at_s: float, out: dict, load: Load, restarted: threading.Event) -> None:
    """SIGTERM ``replica`` after ``at_s`` seconds, wait for it to drain and exit, start it again."""
    time.sleep(at_s)
    t0 = time.monotonic()
    replica.proc.send_signal(signal.SIGTERM)
    out["exit_code"] = replica.proc.wait(60)
    out["drain_s"] = round(time.monotonic() - t0, 2)
    t1 = time.monotonic()
    replica.start()
    out["restart_s"] = round(time.monotonic() - t1, 2)
    out["back_at_s"] = round(at_s + time.monotonic() - t0, 2)
    out["back_wall"], load.back_at = time.time(), time.monotonic()
    restarted.set()


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(streams: int = 64, duration_s: float = 120, disconnect: float = 0.1, cap: int | None = None,
        tokens: int = 24, step_ms: float = 50, seed: int = 0, tmp: Path | None = None) -> dict:
    """Run the load (see the module docstring) and return the JSON object it prints.

    Args:
        streams: concurrent clients. duration_s: seconds each keeps sending (the restart is at half).
        disconnect: fraction of requests closed after their third content chunk.
        cap: the tier's max_concurrent (default 3/4 of ``streams``). tokens, step_ms: each
            stand-in stream's length and pace. tmp: where logs and the tokenizer go (default: a
            new temporary directory).

    Raises:
        AssertionError: a process did not start (its log tail in the message).
    """
    cap = cap or max(1, streams * 3 // 4)
    tmp = Path(tmp or tempfile.mkdtemp(prefix="replica-load-"))
    red = redis.Redis.from_url("redis://127.0.0.1:6379/0", socket_connect_timeout=1)
    red.ping()
    prefix = f"bench:{uuid.uuid4().hex}:"
    workers = [StandinServer().start() for _ in range(2)]
    for w in workers:
        w.standin.script, w.standin.step_delay_s = tuple(f" w{i}" for i in range(tokens)), step_ms / 1000
    router = Router([w.url for w in workers], tmp)
    load, restart_info, restarted = Load(), {}, threading.Event()
    stop = threading.Event()

    def poll_peak() -> None:
        while not stop.is_set():
            active = set().union(*(set(w.standin.active) for w in workers))
            load.peak_at_workers = max(load.peak_at_workers, len(active))
            load.peak = max(load.peak, len(active - load.closed))
            time.sleep(0.005)

    with new_pg_database("sparkgate_load") as pg_url:
        upgrade(pg_url)
        env = replica_env(pg_url, ADMIN, MODEL, write_tokenizer(tmp / "tokenizer"), [router.url], prefix,
                          sglang_health_path="/readiness", sglang_health_interval_s=1)
        replicas = [Replica(n, env, tmp) for n in ("ra", "rb")]
        lb = Balancer(replicas, tmp)
        try:
            router.start()
            for rep in replicas:
                rep.launch()
            for rep in replicas:
                rep.wait_ready()
            lb.start()
            with httpx.Client(base_url=lb.url, headers=ADMIN_H, timeout=30) as c:
                assert c.post("/admin/v1/tiers", json={"name": "load", "max_concurrent": cap,
                                                       "max_queue_wait_s": 120}).status_code == 201
                assert c.post("/admin/v1/tenants", json={"name": "load", "tier": "load"}).status_code == 201
                k = c.post("/admin/v1/keys", json={"tenant": "load", "user": "bench"})
                assert k.status_code == 201, k.text
            poller = threading.Thread(target=poll_peak, daemon=True)
            restarter = threading.Thread(target=restart, args=(replicas[0], duration_s / 2, restart_info, load, restarted))
            poller.start()
            restarter.start()
            t0 = time.monotonic()
            asyncio.run(drive(lb.url, k.json()["key"], streams, duration_s, disconnect, seed, load, restarted))
            wall_s = time.monotonic() - t0
            restarter.join()
            stop.set()
            poller.join()

            seen = {r.id for r in load.results if r.id}

            def settled() -> list[dict] | None:
                rows = [r for r in asyncio.run(fetch_records(pg_url)) if r["tenant"] == "load"]
                done = len({r["id"] for r in rows} & seen) == len(seen) and not any(
                    r["status"] == "running" for r in rows)
                return rows if done else None

            try:
                rows = wait_until(settled, "every response's final record", timeout_s=30, interval_s=0.5)
            except AssertionError:
                rows = [r for r in asyncio.run(fetch_records(pg_url)) if r["tenant"] == "load"]
        finally:
            stop.set()
            lb.stop(10)
            for rep in replicas:
                rep.stop()
            router.stop(10)
            for w in workers:
                w.stop()
            red.delete(*red.keys(prefix + "*") or [prefix])

    row_ids = [r["id"] for r in rows]
    statuses = Counter(r.status for r in load.results)
    ends = Counter(r.end for r in load.results)
    ttfts = [r.ttft_s for r in load.results if r.ttft_s is not None]
    back = restart_info.pop("back_wall", float("inf"))
    after = sum(r["replica"] == "ra" and r["finished_at"].timestamp() > back for r in rows)
    out = {
        "stack": "HAProxy -> 2 gateway replicas (Postgres, Redis) -> sglang-router 0.3.2 -> 2 SGLang stand-ins",
        "streams": streams, "duration_s": duration_s, "wall_s": round(wall_s, 1), "disconnect": disconnect,
        "stand_in_stream": {"tokens": tokens, "step_ms": step_ms},
        "requests": len(load.results), "by_http_status": {str(k): v for k, v in sorted(statuses.items(),
                                                                                        key=lambda kv: str(kv[0]))},
        "by_end": dict(ends), "http_5xx": sum(v for k, v in statuses.items() if k is not None and k >= 500),
        "records": {"rows": len(rows), "by_status": dict(Counter(r["status"] for r in rows)),
                    "lost": len(seen - set(row_ids)), "duplicated": len(row_ids) - len(set(row_ids)),
                    "unexpected": len(set(row_ids) - seen),
                    "by_replica": dict(Counter(r["replica"] for r in rows))},
        "cap": cap, "peak_running": load.peak, "peak_open_at_workers": load.peak_at_workers,
        "errors": dict(Counter(r.error for r in load.results if r.error)),
        "ttft_ms": {"p50": round(1000 * statistics.median(ttfts), 1) if ttfts else None,
                    "p99": round(1000 * percentile(ttfts, 0.99), 1) if ttfts else None},
        "restart": {**restart_info, "ra_records_after_restart": after},
    }
    out["ok"] = (out["http_5xx"] == 0 and ends["transport_error"] == 0 and ends["error_event"] == 0
                 and ends["open"] == 0 and out["records"]["lost"] == 0 and out["records"]["duplicated"] == 0
                 and out["records"]["unexpected"] == 0 and load.peak <= cap
                 and restart_info.get("exit_code") == -signal.SIGTERM
                 and after > 0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--duration", type=float, default=120, help="seconds of load (replica ra restarts at half)")
    ap.add_argument("--disconnect", type=float, default=0.1, help="fraction of requests cut after 3 chunks")
    ap.add_argument("--cap", type=int, default=None, help="the tier's max_concurrent (default 3/4 of --streams)")
    ap.add_argument("--tokens", type=int, default=24, help="tokens per stand-in stream")
    ap.add_argument("--step-ms", type=float, default=50, help="ms between a stand-in's chunks")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = run(args.streams, args.duration, args.disconnect, args.cap, args.tokens, args.step_ms, args.seed)
    print(json.dumps(out, indent=1))
    sys.exit(0 if out["ok"] else 1)


if __name__ == "__main__":
    main()
