"""Fuzz the whole public surface of a running gateway (``/v1``, ``/admin/v1``, ``/metrics``,
the probes) with schemathesis, from the app's own OpenAPI schema (``app.openapi()`` of this
checkout; ``/openapi.json`` is not served).

    PYTHONPATH=. python bench/fuzz.py                        # own server (real model), long profile
    PYTHONPATH=. python bench/fuzz.py --examples 8           # the CI size (tests/gateway/hardening/test_fuzz.py)
    PYTHONPATH=. python bench/fuzz.py --url http://127.0.0.1:8000 --admin-token T

Three phases, then one JSON object on stdout (exit status 1 when an invariant fails):

1. **random**: every operation × {positive, negative} generation, ``--examples`` cases each;
   ``/admin/*`` and ``/metrics`` with the admin token, the rest with a tenant key (a fresh
   one per phase: the admin fuzz revokes and deletes what it finds). Positive
   chat/completions/responses cases get the served model's name 4 times in 5 (a random name
   is always a 404 and never reaches the engine), messages a valid role and a string content
   4 times in 5, and ``max_tokens`` (``max_output_tokens``) ≤ ``--max-tokens``.
   Every other case carries a **hostile string** — a lone surrogate or NUL, sent as a JSON
   escape (schemathesis itself never generates surrogates: they cannot be UTF-8) — in one
   string of the body, or in a declared top-level string property it lacked (``user``).
2. **sweep**: per operation, one case of phase 1 that got an answer < 500 (a 2xx when
   there was one) is re-sent with each string of its body, each declared top-level string
   property and each string path/query parameter set to each value of :data:`SWEEP`
   (bodies) or :data:`URL_HOSTILE` (percent-escaped: NUL, a UTF-8-encoded surrogate, …);
   chat/completions/responses without a 2xx case start from a minimal request the engine serves.
3. **health**: a normal request with a fresh key must show up in ``/v1/requests`` within
   ``--record-deadline`` seconds (the record writer still writes); the writer's counters.

Invariants: no answer ≥ 500 and no SSE ``server_error`` event; every 4xx body is
``{"error": {"message", "type", "param", "code"}}``; the health request is recorded; with
its own server, no traceback in the server log. Loopback only; bounded by ``--examples`` and
``--random-budget`` (operations the random phase had no time for are listed, not hidden).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import quote, urlencode

import httpx

ROOT = Path(__file__).resolve().parents[1]
HOSTILE = ["\ud800", "a\udfffb", "\udc00\ud800", "\x00", "x\x00y", "\ufffe", "\u202e"]
SWEEP = ["\ud800", "x\x00y"]  # the two classes of issue 25: a lone surrogate, NUL
URL_HOSTILE = ["%00", "%ED%A0%80", "%C0%80", "%FF"]
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
ROLES = ["user", "system", "assistant"]
SAMPLES = 20  # failure samples kept per kind (all are counted)


@dataclass
class FuzzResult:
    examples: int
    seed: int
    operations: int = 0
    requests: int = 0
    hostile_requests: int = 0
    by_phase: dict = field(default_factory=dict)
    statuses: dict = field(default_factory=dict)
    by_operation: dict = field(default_factory=dict)
    server_errors: int = 0
    server_error_samples: list = field(default_factory=list)
    bad_error_shapes: int = 0
    bad_error_shape_samples: list = field(default_factory=list)
    sse_server_errors: int = 0
    transport_errors: int = 0
    transport_error_samples: list = field(default_factory=list)
    health: dict = field(default_factory=dict)
    random_phase_skipped: list = field(default_factory=list)  # operations past the random phase's time budget
    duration_s: float = 0.0
    failures: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def openapi_schema() -> dict:
    """The OpenAPI document of this checkout's app (built, not started: no model load)."""
    sys.path.insert(0, str(ROOT))
    from gateway.core.config import Settings
    from gateway.main import create_app

    return create_app(Settings(database_url="sqlite+aiosqlite://", spec_method="none")).openapi()


def error_shape_problem(r: httpx.Response) -> str | None:
    """Why a 4xx body is not OpenAI's error object (None when it is)."""
    try:
        body = r.json()
    except ValueError:
        return "not JSON"
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or set(body) != {"error"} or set(err) != {"message", "type", "param", "code"}:
        return f"shape {json.dumps(body)[:200]}"
    if not (isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)):
        return f"message/type {err}"
    return None


def _resolve(node: dict, raw: dict) -> dict:
    while "$ref" in node:
        node = raw["components"]["schemas"][node["$ref"].rsplit("/", 1)[-1]]
    return node


def _is_string(node: dict, raw: dict) -> bool:
    node = _resolve(node, raw)
    return node.get("type") == "string" or any(_is_string(n, raw) for n in node.get("anyOf", []))


def string_properties(raw: dict, path: str, method: str) -> list[str]:
    """Top-level body properties the schema lets be a string (optional ones included)."""
    op = raw["paths"][path][method.lower()]
    schema = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
    if schema is None:
        return []
    return sorted(k for k, v in _resolve(schema, raw).get("properties", {}).items() if _is_string(v, raw))


def string_parameters(raw: dict, path: str, method: str) -> list[tuple[str, str]]:
    """``(in, name)`` of the path/query parameters that may be strings."""
    params = raw["paths"][path][method.lower()].get("parameters", [])
    return [(p["in"], p["name"]) for p in params if p["in"] in ("path", "query") and _is_string(p["schema"], raw)]


def string_leaves(value, at=()) -> list[tuple]:
    """Paths (keys/indices) of every string inside a JSON value."""
    if isinstance(value, str):
        return [at]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in string_leaves(v, (*at, k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in string_leaves(v, (*at, i))]
    return []


def with_value(body, at: tuple, value):
    """A deep copy of ``body`` with the item at path ``at`` set to ``value``."""
    body = json.loads(json.dumps(body))
    node = body
    for k in at[:-1]:
        node = node[k]
    node[at[-1]] = value
    return body


class Fuzzer:
    """Sends cases and keeps the tally; see the module docstring for the phases."""

    def __init__(self, base: str, admin_token: str, examples: int, seed: int, max_tokens: int,
                 record_deadline_s: float = 20.0, random_budget_s: float | None = None):
        self.raw = openapi_schema()
        self.base = base
        self.http = httpx.Client(base_url=base, timeout=httpx.Timeout(120, connect=10))
        self.admin = {"Authorization": f"Bearer {admin_token}"}
        self.res = FuzzResult(examples, seed)
        self.max_tokens, self.record_deadline_s, self.random_budget_s = max_tokens, record_deadline_s, random_budget_s
        self.phase = "setup"
        self.key = ""
        self.model = ""
        self.baselines: dict[tuple[str, str], tuple[int, dict]] = {}

    # ------------------------------------------------------------------ plumbing
    def fresh_key(self) -> str:
        """A key of a new tenant in a new tier without limits (the fuzz edits the others)."""
        name = f"fuzz-{uuid.uuid4().hex[:10]}"
        for path, body in (("/admin/v1/tiers", {"name": name}), ("/admin/v1/tenants", {"name": name, "tier": name}),
                           ("/admin/v1/keys", {"tenant": name, "user": "fuzzer"})):
            r = self.http.post(path, json=body, headers=self.admin)
            if r.status_code != 201:
                raise RuntimeError(f"could not create a fuzz key ({path}): {r.status_code} {r.text[:300]}")
        return r.json()["key"]

    def auth(self, path: str) -> dict:
        admin = path.startswith("/admin/") or path == "/metrics"
        return self.admin if admin else {"Authorization": f"Bearer {self.key}"}

    def send(self, method: str, url: str, path: str, *, params=None, body=None, content: bytes | None = None,
             hostile: str | None = None) -> int | None:
        """One request (``body`` as JSON, else ``content`` as is), checked; the status (None
        on a transport error). ``hostile``: where a hostile string was put (for the samples)."""
        res = self.res
        res.requests += 1
        res.hostile_requests += hostile is not None
        res.by_phase[self.phase] = res.by_phase.get(self.phase, 0) + 1
        if body is not None:
            content = json.dumps(body).encode()  # surrogates and NUL as \\u escapes
        sent = (f"{method} {url}{f' [hostile: {hostile}]' if hostile else ''} params={params} "
                f"body={content[:300] if content else None}")
        for attempt in (1, 2):  # a server closes a kept-alive connection after a 500: one retry on a new one
            try:
                r = self.http.request(method, url, params=params, content=content, headers=self.auth(path))
                break
            except httpx.HTTPError as exc:
                if attempt == 2 or not isinstance(exc, (httpx.ReadError, httpx.RemoteProtocolError)):
                    res.transport_errors += 1
                    _sample(res.transport_error_samples, f"{exc!r} ← {sent}"[:500])
                    return None
        status = str(r.status_code)
        res.statuses[status] = res.statuses.get(status, 0) + 1
        per = res.by_operation.setdefault(f"{method} {path}", {})
        per[status] = per.get(status, 0) + 1
        if r.status_code >= 500:
            res.server_errors += 1
            _sample(res.server_error_samples, f"{r.status_code} ← {sent} → {r.text[:200]}")
        elif r.status_code >= 400 and (problem := error_shape_problem(r)):
            res.bad_error_shapes += 1
            _sample(res.bad_error_shape_samples, f"{r.status_code} ← {sent}: {problem}")
        elif r.headers.get("content-type", "").startswith("text/event-stream"):
            for line in r.text.splitlines():
                if line.startswith("data: {") and '"server_error"' in line:
                    res.sse_server_errors += 1
                    _sample(res.server_error_samples, f"SSE ← {sent}: {line[:200]}")
        return r.status_code

    def declared(self, path: str, method: str, body: dict) -> list[tuple]:
        """Declared top-level string properties the body lacks or holds a non-string in."""
        return [(p,) for p in string_properties(self.raw, path, method) if not isinstance(body.get(p), str)]

    # ------------------------------------------------------------------ phase 1
    def operations(self) -> list:
        import schemathesis

        ops = [r.ok() for r in schemathesis.openapi.from_dict(self.raw).get_all_operations()]
        # /v1 and the probes first: the admin fuzz revokes keys and edits tiers
        return sorted(ops, key=lambda op: (op.path.startswith("/admin/") or op.path == "/metrics", op.label))

    def shape(self, op, body, draw, positive: bool) -> tuple[object, str | None]:
        """Steer a generated body (served model, bounded max_tokens) and maybe make it
        hostile; the body and where a hostile string was put (None: nowhere). (After schemathesis
        serialised the case: it cannot validate a lone surrogate.)"""
        if not isinstance(body, dict):
            return body, None
        if positive and op.path in GENERATION_PATHS:
            if draw(_st().integers(0, 4)) > 0:
                body["model"] = self.model
            for m in body.get("messages") if isinstance(body.get("messages"), list) else []:
                if isinstance(m, dict) and draw(_st().integers(0, 4)) > 0:
                    m["role"] = draw(_st().sampled_from(ROLES))
                    m["content"] = m["content"] if isinstance(m.get("content"), str) else "Hi"
            for k in ("max_output_tokens",) if op.path == "/v1/responses" else ("max_tokens", "max_completion_tokens"):
                if not isinstance(body.get(k), int) or body[k] > self.max_tokens:
                    body[k] = draw(_st().integers(1, self.max_tokens))
        targets = string_leaves(body) + self.declared(op.path, op.method, body)
        if not targets or not draw(_st().booleans()):
            return body, None
        at, value = draw(_st().sampled_from(targets)), draw(_st().sampled_from(HOSTILE))
        return with_value(body, at, value), f"body{_where(at)}={value!r}"

    def fuzz_operation(self, op, mode: str) -> None:
        import schemathesis
        from hypothesis import HealthCheck, Phase, given, seed, settings
        from hypothesis.errors import Unsatisfiable

        st = _st()
        positive = mode == "positive"

        @given(case=op.as_strategy(schemathesis.GenerationMode(mode)), data=st.data())
        @settings(max_examples=self.res.examples, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @seed(self.res.seed)
        def run(case, data):
            kw = case.as_transport_kwargs(base_url=self.base)
            body, hostile = self.shape(op, kw["json"], data.draw, positive) if "json" in kw else (None, None)
            status = self.send(kw["method"], kw["url"], op.path, params=kw.get("params"), body=body,
                               content=_raw_body(kw), hostile=hostile)
            key = (op.method.upper(), op.path)
            if positive and hostile is None and status is not None and status < 500:
                best = self.baselines.get(key)
                if best is None or (best[0] >= 300 and status < 300):
                    self.baselines[key] = (status, {"path": case.path_parameters or {}, "query": case.query or {},
                                                    "body": kw.get("json")})

        try:
            run()
        except Unsatisfiable:  # nothing in this operation can be made invalid
            pass

    # ------------------------------------------------------------------ phase 2
    def sweep(self, op) -> None:
        method, path = op.method.upper(), op.path
        status, base = self.baselines.get((method, path), (None, None))
        if path in GENERATION_PATHS and (status is None or status >= 300):  # a request the engine serves
            prompt = ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": self.max_tokens} if "chat" in path
                      else {"input": "Hi", "max_output_tokens": self.max_tokens} if "responses" in path
                      else {"prompt": "Hi", "max_tokens": self.max_tokens})
            base = {"path": {}, "query": {}, "body": {"model": self.model, **prompt}}
        params = string_parameters(self.raw, path, method)
        if base is None and (params or string_properties(self.raw, path, method)):
            base = {"path": {n: "x" for loc, n in params if loc == "path"}, "query": {}, "body": None}
        if base is None:
            return
        body = base["body"]
        targets = [*string_leaves(body), *self.declared(path, method, body)] if isinstance(body, dict) else []
        url = self.url(path, base["path"], base["query"])
        for at in targets:
            for value in SWEEP:
                where = f"body{_where(at)}={value!r}"
                if self.send(method, url, path, body=with_value(body, at, value), hostile=where) == 409:
                    # the baseline's name exists by now: the same with fresh names around the hostile one
                    fresh = body
                    for other in string_leaves(body):
                        fresh = with_value(fresh, other, f"fz{uuid.uuid4().hex[:8]}") if other != at else fresh
                    self.send(method, url, path, body=with_value(fresh, at, value), hostile=where)
        for loc, name in params:
            query = {k: v for k, v in base["query"].items() if k != name}
            for value in URL_HOSTILE:
                path_params = {**base["path"], **({name: value} if loc == "path" else {})}
                extra = f"{name}={value}" if loc == "query" else None
                self.send(method, self.url(path, path_params, query, extra), path, body=body,
                          hostile=f"{loc} {name}={value}")

    def url(self, template: str, path_params: dict, query: dict, raw_query: str | None = None) -> str:
        """``template`` filled in; values already percent-escaped (``%``-led) are kept as they are."""
        out = template
        for k, v in path_params.items():
            v = str(v)
            out = out.replace("{" + k + "}", v if v.startswith("%") else quote(v, safe=""))
        qs = "&".join(x for x in (urlencode(query, doseq=True) if query else "", raw_query or "") if x)
        return f"{out}?{qs}" if qs else out

    # ------------------------------------------------------------------ phase 3
    def health(self) -> dict:
        """A normal request with a fresh key, then its record in /v1/requests within the deadline."""
        out: dict = {}
        try:
            self.key = self.fresh_key()
        except (RuntimeError, httpx.HTTPError) as exc:
            return {"error": str(exc)[:300]}
        r = self.http.post("/v1/chat/completions", headers=self.auth("/v1"),
                           json={"model": self.model, "messages": [{"role": "user", "content": "Say hi"}],
                                 "max_tokens": 4, "temperature": 0})
        out["status"] = r.status_code
        rid = r.json().get("id") if r.status_code == 200 else None
        t0 = time.monotonic()
        while rid is not None:
            ids = [x["id"] for x in self.http.get("/v1/requests", params={"limit": 20},
                                                  headers=self.auth("/v1")).json().get("data", [])]
            if rid in ids:
                out["recorded_after_s"] = round(time.monotonic() - t0, 2)
                break
            if time.monotonic() - t0 > self.record_deadline_s:
                out["recorded_after_s"] = None
                break
            time.sleep(0.25)
        status = self.http.get("/admin/v1/tenancy/status", headers=self.admin)
        out["records"] = status.json().get("records") if status.status_code == 200 else status.status_code
        return out

    # ------------------------------------------------------------------ all
    def run(self) -> FuzzResult:
        t0 = time.monotonic()
        res = self.res
        self.key = self.fresh_key()
        self.model = self.http.get("/v1/models", headers=self.auth("/v1")).json()["data"][0]["id"]
        ops = self.operations()
        res.operations = len(ops)
        self.phase = "random"
        for op in ops:
            if self.random_budget_s is not None and time.monotonic() - t0 > self.random_budget_s:
                res.random_phase_skipped.append(op.label)
                continue
            for mode in ("positive", "negative"):
                self.fuzz_operation(op, mode)
        self.phase = "sweep"
        self.key = self.fresh_key()
        for op in ops:
            self.sweep(op)
        self.phase = "health"
        res.health = self.health()
        res.duration_s = round(time.monotonic() - t0, 1)
        if res.server_errors or res.sse_server_errors:
            res.failures.append(f"{res.server_errors} answers >= 500, {res.sse_server_errors} SSE server errors")
        if res.bad_error_shapes:
            res.failures.append(f"{res.bad_error_shapes} 4xx bodies not OpenAI-shaped")
        if res.transport_errors:
            res.failures.append(f"{res.transport_errors} transport errors")
        if res.health.get("status") != 200 or res.health.get("recorded_after_s") is None:
            res.failures.append(f"health request not served and recorded: {res.health}")
        return res


def _st():
    from hypothesis import strategies

    return strategies


def _where(at: tuple) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in at)


def _raw_body(kw: dict) -> bytes | None:
    """A non-JSON body schemathesis serialised (none of this app's operations has one yet)."""
    data = kw.get("data") if kw.get("data") is not None else kw.get("content")
    return data.encode() if isinstance(data, str) else data


def _sample(samples: list, text: str) -> None:
    if len(samples) < SAMPLES:
        samples.append(text)


def run_fuzz(base: str, admin_token: str, examples: int = 8, seed: int = 0, max_tokens: int = 4,
             record_deadline_s: float = 20.0, random_budget_s: float | None = None) -> FuzzResult:
    fz = Fuzzer(base, admin_token, examples, seed, max_tokens, record_deadline_s, random_budget_s)
    try:
        return fz.run()
    finally:
        fz.http.close()


def server_log_tracebacks(log: Path) -> int:
    return log.read_text(errors="replace").count("Traceback")


def start_server(dtype: str, max_batch: int, env: dict) -> tuple:
    """``bench/soak.py``'s real-model server (importable however this file was loaded)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from soak import start_server as start

    return start(dtype, max_batch, env)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=500, help="cases per operation and generation mode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=16, help="max_tokens of the chat/completions cases")
    ap.add_argument("--record-deadline", type=float, default=20.0, help="seconds for the health request's record")
    ap.add_argument("--random-budget", type=float, default=420.0,
                    help="seconds for the random phase; operations not started by then are skipped (listed)")
    ap.add_argument("--url", help="an already running gateway (else one is started on the real model)")
    ap.add_argument("--admin-token")
    args = ap.parse_args(argv)
    proc = log = None
    if args.url:
        base, admin = args.url, args.admin_token
        if not admin:
            ap.error("--admin-token is required with --url")
    else:
        proc, base, admin, log = start_server("float32", 4, {"SPARKGATE_MAX_CONTEXT": "512"})
    try:
        res = run_fuzz(base, admin, args.examples, args.seed, args.max_tokens, args.record_deadline,
                       args.random_budget)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    out = {**asdict(res), "ok": res.ok}
    if log is not None:
        out["server_log_tracebacks"] = server_log_tracebacks(log)
        if out["server_log_tracebacks"]:
            out["ok"] = False
    print(json.dumps(out, indent=2, default=str))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
