"""Soak test: N concurrent streaming clients against a gateway on the real model.

    PYTHONPATH=. python bench/soak.py                      # own server (real model), 64 clients, 60 s
    PYTHONPATH=. python bench/soak.py --clients 16 --duration 15
    PYTHONPATH=. python bench/soak.py --url http://127.0.0.1:8000 --admin-token T [--pid PID]

Every client loops: one streaming chat request (random ``max_tokens`` 8–40,
temperature 0.7); 10 % of them (``--disconnect``) close the connection after a random
number (1–6) of chunks. Afterwards it checks, and reports as JSON:

* 0 server errors (HTTP ≥ 500, SSE error events, transport errors);
* the engine is back to baseline (``GET /admin/v1/engine``: running == waiting == 0,
  i.e. every KV slot free);
* one request record per request sent (``GET /admin/v1/requests?tenant=<soak tenant>``),
  every completed stream ``finished``, every cut one ``cancelled`` (or ``finished`` when
  the cut came after the last token);
* server RSS growth (MiB) from after warm-up to the end (needs the server's pid: own
  server, or ``--pid``).

Exit status 1 when an invariant fails. Loopback only; bounded by ``--duration``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["Tell me about the ocean.", "Write a haiku about autumn.", "What is the capital of France?",
           "List three colours.", "Explain gravity to a child.", "Describe a cat in one sentence."]


@dataclass
class SoakResult:
    clients: int
    duration_s: float
    sent: int = 0
    completed: int = 0
    disconnected: int = 0
    statuses: dict = field(default_factory=dict)
    server_errors: int = 0
    sse_errors: int = 0
    transport_errors: int = 0
    error_samples: list = field(default_factory=list)
    tokens: int = 0
    engine_after: dict = field(default_factory=dict)
    engine_idle_after_s: float | None = None
    records: int = 0
    records_by_status: dict = field(default_factory=dict)
    records_missing: int = 0
    records_wrong_status: int = 0
    rss_start_mib: float | None = None
    rss_end_mib: float | None = None
    rss_growth_mib: float | None = None
    failures: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


async def _one(http: httpx.AsyncClient, key: str, rng: random.Random, disconnect_p: float, res: SoakResult,
               ids: dict, user: str) -> None:
    cut_after = rng.randint(1, 6) if rng.random() < disconnect_p else None
    body = {"model": MODEL, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "stream": True,
            "max_tokens": rng.randint(8, 40), "temperature": 0.7, "user": user,
            "stream_options": {"include_usage": True}}
    rid, chunks, done = None, 0, False
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {key}"}) as r:
            res.sent += 1
            res.statuses[r.status_code] = res.statuses.get(r.status_code, 0) + 1
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                if r.status_code >= 500:
                    res.server_errors += 1
                    res.error_samples.append(f"{r.status_code}: {text[:200]}")
                return
            async for line in r.aiter_lines():
                if not line:
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                obj = json.loads(line[6:])
                if "error" in obj:
                    res.sse_errors += 1
                    res.error_samples.append(f"SSE error: {json.dumps(obj)[:200]}")
                    continue
                rid = rid or obj.get("id")
                if obj.get("usage"):
                    res.tokens += obj["usage"]["completion_tokens"]
                chunks += 1
                if cut_after is not None and chunks >= cut_after:
                    break  # leaving the context manager closes the connection mid-stream
    except httpx.HTTPError as exc:
        res.transport_errors += 1
        res.error_samples.append(f"transport: {exc!r}"[:200])
        return
    if rid is not None:
        ids[rid] = "done" if done else "cut"
    if done:
        res.completed += 1
    elif cut_after is not None:
        res.disconnected += 1


async def _client_loop(i: int, base: str, key: str, end: float, seed: int, disconnect_p: float, res: SoakResult,
                       ids: dict) -> None:
    rng = random.Random(seed * 1000 + i)
    limits = httpx.Limits(max_connections=2, max_keepalive_connections=1)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(120, connect=10), limits=limits) as http:
        while time.monotonic() < end:
            await _one(http, key, rng, disconnect_p, res, ids, f"soak-user-{i}")


def _rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss / 2**20
    except Exception:  # noqa: BLE001
        return None


async def _records(http: httpx.AsyncClient, admin: dict, tenant: str) -> list[dict]:
    out, cursor = [], None
    for _ in range(100):  # bounded pagination
        params = {"tenant": tenant, "limit": 1000, **({"cursor": cursor} if cursor else {})}
        page = (await http.get("/admin/v1/requests", params=params, headers=admin)).json()
        out += page["data"]
        if not page["has_more"]:
            break
        cursor = page["next_cursor"]
    return out


async def run_soak(base: str, admin_token: str, clients: int = 64, duration_s: float = 60.0,
                   disconnect_p: float = 0.10, pid: int | None = None, seed: int = 0,
                   drain_timeout_s: float = 60.0) -> SoakResult:
    """Run the soak against ``base`` (a key for a fresh tenant is created via the admin API)."""
    res = SoakResult(clients, duration_s)
    admin = {"Authorization": f"Bearer {admin_token}"}
    tenant = f"soak-{uuid.uuid4().hex[:8]}"
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        r = await http.post("/admin/v1/keys", json={"tenant": tenant, "user": "soak"}, headers=admin)
        if r.status_code != 201:
            raise RuntimeError(f"could not create a soak key: {r.status_code} {r.text}")
        key = r.json()["key"]
        warm = await http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                               json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        if warm.status_code != 200:
            raise RuntimeError(f"warm-up failed: {warm.status_code} {warm.text}")
        res.rss_start_mib = _rss_mib(pid)
        ids: dict[str, str] = {}
        end = time.monotonic() + duration_s
        await asyncio.gather(*(_client_loop(i, base, key, end, seed, disconnect_p, res, ids)
                               for i in range(clients)))
        t0 = time.monotonic()
        while True:  # engine back to baseline: nothing running or waiting (all KV slots free)
            res.engine_after = (await http.get("/admin/v1/engine", headers=admin)).json()
            if res.engine_after["running"] == 0 and res.engine_after["waiting"] == 0:
                res.engine_idle_after_s = round(time.monotonic() - t0, 2)
                break
            if time.monotonic() - t0 > drain_timeout_s:
                break
            await asyncio.sleep(0.2)
        expected = res.sent + 1  # + the warm-up request
        t0 = time.monotonic()
        while True:  # records are written in batches every ~0.5 s (``running`` ones until their end)
            recs = await _records(http, admin, tenant)
            ended = all(r["status"] != "running" for r in recs)
            if (len(recs) >= expected and ended) or time.monotonic() - t0 > 30:
                break
            await asyncio.sleep(0.5)
        res.rss_end_mib = _rss_mib(pid)
    by_id = {r["id"]: r for r in recs}
    res.records = len(recs)
    for r in recs:
        res.records_by_status[r["status"]] = res.records_by_status.get(r["status"], 0) + 1
    for rid, how in ids.items():
        rec = by_id.get(rid)
        if rec is None:
            res.records_missing += 1
        elif (how == "done" and rec["status"] != "finished") or (how == "cut" and rec["status"] not in
                                                                  ("cancelled", "finished")):
            res.records_wrong_status += 1
    if res.rss_start_mib is not None and res.rss_end_mib is not None:
        res.rss_growth_mib = round(res.rss_end_mib - res.rss_start_mib, 1)
    # invariants
    if res.server_errors or res.sse_errors or res.transport_errors:
        res.failures.append(f"errors: http5xx={res.server_errors} sse={res.sse_errors} "
                            f"transport={res.transport_errors}")
    if res.engine_idle_after_s is None:
        res.failures.append(f"engine not idle after the run: {res.engine_after}")
    if res.records != expected:
        res.failures.append(f"{res.records} request records for {expected} requests sent")
    if res.records_missing or res.records_wrong_status:
        res.failures.append(f"records missing={res.records_missing} wrong_status={res.records_wrong_status}")
    if res.disconnected and res.records_by_status.get("cancelled", 0) == 0:
        res.failures.append("client disconnects produced no cancelled records")
    if res.sent < clients:
        res.failures.append(f"only {res.sent} requests sent by {clients} clients")
    return res


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(dtype: str, max_batch: int, env: dict | None = None) -> tuple[subprocess.Popen, str, str, Path]:
    """The real gateway + engine under uvicorn in a subprocess (SQLite in a temp dir);
    ``env``: more ``SPARKGATE_*`` settings."""
    sys.path.insert(0, str(ROOT))
    from gateway.db.migrate import upgrade

    tmp = Path(tempfile.mkdtemp(prefix="sparkgate-soak-"))
    db = f"sqlite+aiosqlite:///{tmp}/soak.db"
    upgrade(db)
    admin = "admin-" + os.urandom(16).hex()
    port = _free_port()
    env = {**os.environ, "SPARKGATE_DATABASE_URL": db, "SPARKGATE_ADMIN_TOKEN": admin, "SPARKGATE_DTYPE": dtype,
           "SPARKGATE_MAX_BATCH_SIZE": str(max_batch), "SPARKGATE_SPEC_METHOD": "none", "PYTHONPATH": str(ROOT),
           **(env or {})}
    log = tmp / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "gateway.main:create_app", "--factory", "--host",
                             "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                            env=env, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                return proc, base, admin, log
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("server did not become ready")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    ap.add_argument("--disconnect", type=float, default=0.10, help="fraction of requests cut mid-stream")
    ap.add_argument("--url", help="an already running gateway (else one is started on the real model)")
    ap.add_argument("--admin-token")
    ap.add_argument("--pid", type=int, help="server pid for RSS (with --url)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    proc = log = None
    if args.url:
        base, admin, pid = args.url, args.admin_token, args.pid
        if not admin:
            ap.error("--admin-token is required with --url")
    else:
        proc, base, admin, log = start_server(args.dtype, args.max_batch)
        pid = proc.pid
    try:
        res = asyncio.run(run_soak(base, admin, args.clients, args.duration, args.disconnect, pid, args.seed))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    out = {**asdict(res), "ok": res.ok}
    if log is not None:
        text = log.read_text()
        out["server_log_tracebacks"] = text.count("Traceback")
        out["admin_token_in_log"] = admin in text
        if out["server_log_tracebacks"] or out["admin_token_in_log"]:
            res.failures.append("server log has tracebacks or the admin token")
            out["ok"] = False
    print(json.dumps(out, indent=2, default=str))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
