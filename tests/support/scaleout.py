"""The processes of the scale-out tests and ``bench/replica_load.py``: gateway replicas
(``uvicorn --factory gateway.main:create_app`` subprocesses), HAProxy (Debian's ``haproxy``)
round-robin in front of them, and the real sglang-router (PyPI ``sglang-router``, pinned in
pyproject's ``scaleout`` extra) in front of SGLang workers (here: stand-ins).

docs/deploy.md "From one machine to many" shows the same commands.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import httpx

from tests.support.servers import free_port, wait_for_http

ROOT = Path(__file__).resolve().parents[2]

ROUTER_VERSION = "0.3.2"  # pyproject.toml [project.optional-dependencies] scaleout
ROUTER_HEALTH_INTERVAL_S = 1  # --health-check-interval-secs
ROUTER_FAILURES = 3  # --health-failure-threshold: a dead worker is out after ~FAILURES intervals
ROUTER_CB_OPEN_S = 1  # --cb-timeout-duration-secs: an open circuit (default 60 s) half-opens after this
#: router flags besides host, port and workers (all checked against 0.3.2's --help and behaviour;
#: docs/deploy-gpu.md "sglang-router" says what each was checked for)
ROUTER_FLAGS = [
    "--policy", "round_robin",
    "--health-check-interval-secs", str(ROUTER_HEALTH_INTERVAL_S),
    "--health-check-timeout-secs", "1",
    "--health-failure-threshold", str(ROUTER_FAILURES),
    "--health-success-threshold", "1",
    "--worker-startup-check-interval", "1",
    "--cb-timeout-duration-secs", str(ROUTER_CB_OPEN_S),
    "--log-level", "warn",
]

HAPROXY_CFG = """
global
    maxconn 1024
defaults
    mode http
    timeout connect 1s
    timeout client 120s
    timeout server 120s
    timeout check 3s
    retries 3
    option redispatch
frontend fe
    bind 127.0.0.1:{port}
    default_backend gateways
backend gateways
    balance roundrobin
    option httpchk GET /readyz
    default-server check inter 500ms fall 2 rise 1
{servers}
"""


def router_missing() -> str | None:
    """Why the pinned sglang-router cannot run here (``None``: it can)."""
    if importlib.util.find_spec("sglang_router") is None:
        return "not installed"
    from importlib.metadata import version

    if version("sglang-router") != ROUTER_VERSION:
        return f"{version('sglang-router')} installed"
    return None


class Process:
    """A subprocess with its output in ``log``; :meth:`stop` terminates, then kills after ``grace_s``."""

    proc: subprocess.Popen | None = None
    log: Path

    def _popen(self, cmd: list[str], **kw) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **kw)

    def stop(self, grace_s: float = 25) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def replica_command(port: int, python: str = sys.executable) -> list[str]:
    """The argv of one gateway replica (docs/deploy.md "From one machine to many", step 4)."""
    return [python, "-m", "uvicorn", "--factory", "gateway.main:create_app", "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", "--timeout-graceful-shutdown", "20"]


def router_command(port: int, worker_urls: list[str], prometheus_port: int, python: str = sys.executable) -> list[str]:
    """The argv of sglang-router over ``worker_urls`` (docs/deploy.md "From one machine to many", step 3)."""
    return [python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(prometheus_port), "--worker-urls", *worker_urls, *ROUTER_FLAGS]


class Replica(Process):
    """One gateway process (``SPARKGATE_REPLICA_ID`` = ``name``) on a free port, configured by ``env``."""

    def __init__(self, name: str, env: dict, tmp: Path) -> None:
        self.name, self.env, self.port = name, env, free_port()
        self.log = tmp / f"{name}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Replica:
        return self.launch().wait_ready()

    def launch(self) -> Replica:
        self._popen(replica_command(self.port), env={**self.env, "SPARKGATE_REPLICA_ID": self.name},
                    cwd=self.log.parent)
        return self

    def wait_ready(self, timeout_s: float = 60) -> Replica:
        wait_for_http(self.url + "/readyz", self.proc, self.log, f"replica {self.name}", timeout_s, interval_s=0.05)
        return self


class Balancer(Process):
    """HAProxy on a free port, round robin over ``replicas`` with a ``/readyz`` check every 500 ms
    (``fall 2``: out after two failed checks, each given 3 s — a busy replica on a loaded machine
    can take more than the check interval to answer, and with ``fall 1`` and the default check
    timeout (= ``inter``) both replicas were marked down under load: HAProxy's own 503s;
    ``retries 3`` + ``option redispatch``: a connection refused by a draining replica is retried
    on the other)."""

    def __init__(self, replicas: list[Replica], tmp: Path) -> None:
        self.port, self.log = free_port(), tmp / "haproxy.log"
        self.cfg = tmp / "haproxy.cfg"
        self.cfg.write_text(HAPROXY_CFG.format(port=self.port, servers="\n".join(
            f"    server {r.name} 127.0.0.1:{r.port}" for r in replicas)))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Balancer:
        self._popen(["haproxy", "-db", "-f", str(self.cfg)])
        wait_for_http(self.url + "/readyz", self.proc, self.log, "haproxy", 20, interval_s=0.05)
        return self


class Router(Process):
    """``python -m sglang_router.launch_router`` with :data:`ROUTER_FLAGS` over ``worker_urls``."""

    def __init__(self, worker_urls: list[str], tmp: Path) -> None:
        self.worker_urls, self.port, self.log = worker_urls, free_port(), tmp / "router.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Router:
        self._popen(router_command(self.port, self.worker_urls, free_port()))
        n = len(self.worker_urls)
        wait_for_http(self.url + "/readiness", self.proc, self.log, "sglang-router with every worker healthy", 30,
                      ok=lambda r: r.json().get("healthy_workers") == n, interval_s=0.05)
        return self

    def healthy_workers(self) -> set[str]:
        r = httpx.get(self.url + "/workers", timeout=5)
        assert r.status_code == 200, r.text
        return {w["url"] for w in r.json()["workers"] if w["is_healthy"]}


def replica_env(pg_url: str, admin_token: str, model: str, tokenizer_dir: Path, sglang_urls: list[str],
                redis_prefix: str, **settings: str) -> dict[str, str]:
    """The environment of a gateway replica on Postgres ``pg_url`` and Redis 127.0.0.1:6379 (keys
    under ``redis_prefix``), streaming from SGLang servers (or a router) at ``sglang_urls`` with the
    tokenizer saved at ``tokenizer_dir``; ``settings`` adds ``SPARKGATE_<NAME>`` variables. The
    caller's own ``SPARKGATE_*`` variables are dropped."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKGATE_")}
    env.update({"PYTHONPATH": str(ROOT), "SPARKGATE_DATABASE_URL": pg_url, "SPARKGATE_ADMIN_TOKEN": admin_token,
                "SPARKGATE_MODEL_NAME": model, "SPARKGATE_MAX_CONTEXT": "256", "SPARKGATE_BACKEND": "sglang",
                "SPARKGATE_SGLANG_URLS": ",".join(sglang_urls), "SPARKGATE_SGLANG_TOKENIZER_PATH": str(tokenizer_dir),
                "SPARKGATE_RECORD_FLUSH_INTERVAL_S": "0.1", "SPARKGATE_REDIS_URL": "redis://127.0.0.1:6379/0",
                "SPARKGATE_REDIS_PREFIX": redis_prefix})
    env.update({f"SPARKGATE_{k.upper()}": str(v) for k, v in settings.items()})
    return env


async def fetch_records(pg_url: str) -> list[dict]:
    """Every request record in the database at ``pg_url`` (id, tenant, status, replica, error_code,
    completion_tokens, finished_at)."""
    import asyncpg

    conn = await asyncpg.connect(pg_url.replace("postgresql+asyncpg", "postgresql"))
    try:
        return [dict(r) for r in await conn.fetch(
            "SELECT id, tenant, status, replica, error_code, completion_tokens, finished_at FROM request_records")]
    finally:
        await conn.close()
