"""The whole gateway on the SGLang backend, over HTTP, against the SGLang 0.5.23 STAND-IN.

``tests/support/sglang_standin.py`` is a protocol-faithful stand-in of SGLang's native HTTP API
(``POST /generate``, ``/abort_request``, ``/health``, ``/server_info``, ``/v1/loads``); it is
not SGLang and runs no model. The gateway is the real app: ``create_app(settings)`` with
``Settings.backend = "sglang"`` builds :class:`runtime.sglang.client.SGLangBackend` through
``runtime.factory.create_backend``, and ``SGLangBackend.start`` loads the tokenizer named by
``sglang_tokenizer_path`` with ``transformers.AutoTokenizer`` — a tiny word-level tokenizer
written here (no model weights anywhere). Both servers run under uvicorn on 127.0.0.1 in
daemon threads, so a client disconnect is a real TCP close.

Checked through HTTP only (OpenAI API, admin API, ``/metrics``):

* streamed and non-streamed chat completions return exactly the stand-in's text, the
  token counts it reported, and send it the gateway's own token ids, request id, the
  tenant tier's ``priority`` and SLA ``custom_params``;
* the request record (``GET /admin/v1/requests/{id}``) carries the tenant, tier and the
  speculative stats mapped from SGLang's final ``meta_info`` as ``runtime/sglang/client.py``
  defines the mapping (``spec_verify_ct`` → rounds, Σ k·``spec_cap_lens_histogram[k]`` −
  rounds → verified, ``spec_num_correct_drafts`` → accepted, ``spec_accept_length`` = τ);
* the ``sparkgate:spec_decode_*`` counters on ``/metrics`` moved by the same amounts;
* upstream failures become OpenAI error objects ``{"error": {"message", "type", "param",
  "code"}}`` with the right status, or — once streaming has begun — one SSE error event
  followed by ``data: [DONE]``;
* a client that disconnects mid-stream makes the gateway abort the request upstream
  (``POST /abort_request {"rid"}``, SGLang 0.5.23 ``api_types.AbortRequest``);
* ``response_format`` and ``tools`` reach SGLang as ``sampling_params.json_schema`` /
  ``structural_tag`` (what the stand-in recorded), its schema-valid replies come back as
  content or parsed ``tool_calls`` (``finish_reason: "tool_calls"``), the records mark them,
  schemas the embedded engine refuses are refused before anything is sent and a grammar SGLang
  cannot compile is a 400; the sampling fields and ``n`` arrive as SGLang's own.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from gateway.main import create_app
from runtime.sglang.client import SLA_MAX_WEIGHT_KEY, SLA_TARGET_KEY, SGLangBackend
from tests.support.gateway_fixtures import MODEL, make_settings, parse_sse, sqlite_url
from tests.support.sglang_standin import EOS_ID, FIRST_TOKEN_ID, SGLangStandin, StandinServer, closed_port_url

ADMIN = "admin-token-sglang-gateway"
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}
TENANT, TIER, TIER_TARGET_TPS, TIER_PRIORITY = "acme", "gold", 5.0, 3
SLA_MAX_WEIGHT = 2.5
SCRIPT_TEXT = "".join(SGLangStandin.script)  # "Hello world, how are you?"

# The served model's tokenizer, in miniature: whitespace-split words → ids; EOS = the
# stand-in's EOS id, so the gateway and the "server" agree on it.
VOCAB = ["[UNK]", "<s>", "</s>", "<user>", "<assistant>", "<system>", "Say", "hello"]
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
PROMPT = [{"role": "user", "content": "Say hello"}]
PROMPT_IDS = [3, 6, 7, 4]  # <user> Say hello <assistant>


def write_tokenizer(path: Path) -> Path:
    """Save a word-level ``PreTrainedTokenizerFast`` with a chat template to ``path``
    (loadable by ``AutoTokenizer.from_pretrained``, like a served model's tokenizer dir)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(path))
    assert VOCAB.index("</s>") == EOS_ID
    return path


@dataclass
class Stack:
    """The running gateway (``base``), its app, a tenant key and the stand-in."""

    base: str
    app: object
    key: str
    standin_server: StandinServer
    tokenizer_dir: Path

    @property
    def standin(self) -> SGLangStandin:
        return self.standin_server.standin

    @property
    def backend(self) -> SGLangBackend:
        return self.app.state.backend

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.base, timeout=30, **kw)

    @property
    def auth(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"}


def _wait(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, migrated_template):  # noqa: F811
    """Stand-in (speculating, γ = 7, when the gateway starts) + the gateway on uvicorn with
    ``backend=sglang``; tier ``gold`` (target 5 tok/s, priority 3), tenant ``acme`` in it,
    one key. Torn down at the end of the module."""
    tmp = tmp_path_factory.mktemp("sglang-gateway")
    db = tmp / "gateway.db"
    shutil.copy(migrated_template, db)
    tok_dir = write_tokenizer(tmp / "tokenizer")
    upstream = StandinServer().start()
    upstream.standin.spec_gamma = 7  # /server_info at backend start → SpecInfo("dspark", γ=7)
    settings = make_settings(
        sqlite_url(db), admin_token=ADMIN, model_name=MODEL, max_context=256,
        backend="sglang", sglang_urls=[upstream.url], sglang_tokenizer_path=str(tok_dir),
        sglang_send_priority=True, sglang_sla_max_weight=SLA_MAX_WEIGHT, sglang_health_interval_s=3600,
        record_flush_interval_s=0.05,
    )
    app = create_app(settings)  # no backend passed: built from settings.backend
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="gateway", daemon=True)
    thread.start()

    def ready() -> bool:
        try:
            return httpx.get(base + "/readyz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        _wait(ready, "the gateway's /readyz", timeout=60)
        with httpx.Client(base_url=base, headers=ADMIN_H, timeout=30) as c:
            r = c.post("/admin/v1/tiers", json={"name": TIER, "min_tokens_per_s": TIER_TARGET_TPS,
                                                "priority": TIER_PRIORITY})
            assert r.status_code == 201, r.text
            assert c.post("/admin/v1/tenants", json={"name": TENANT, "tier": TIER}).status_code == 201
            r = c.post("/admin/v1/keys", json={"tenant": TENANT, "user": "alice"})
            assert r.status_code == 201, r.text
            key = r.json()["key"]
        yield Stack(base, app, key, upstream, tok_dir)
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
        upstream.stop()
    assert not thread.is_alive() and app.state.backend._client is None  # the lifespan stopped the backend


@pytest.fixture(autouse=True)
def _fresh_standin(stack):
    stack.standin.reset()
    yield
    stack.standin.reset()


def chat(stream: bool, **extra) -> dict:
    body = {"model": MODEL, "messages": PROMPT, "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def scrape(client: httpx.Client) -> dict[tuple[str, frozenset], float]:
    """``/metrics`` (admin token) as ``{(sample name, labels): value}``."""
    r = client.get("/metrics", headers=ADMIN_H)
    assert r.status_code == 200, r.text
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def moved(before: dict, after: dict, name: str, **labels) -> float:
    """Change of Σ samples ``name`` whose labels include ``labels``."""
    def total(samples: dict) -> float:
        return sum(v for (n, lab), v in samples.items() if n == name and labels.items() <= dict(lab).items())
    return total(after) - total(before)


def record(client: httpx.Client, rid: str, timeout: float = 10.0) -> dict:
    """The request record ``rid`` via the admin API, once the writer has stored it (the
    outcome is reported when the response stream closes, so it can trail the last byte; until
    then the record is ``running``)."""
    deadline = time.monotonic() + timeout
    while True:
        assert client.post("/admin/v1/rollups/refresh", headers=ADMIN_H).status_code == 204
        r = client.get(f"/admin/v1/requests/{rid}", headers=ADMIN_H)
        if r.status_code == 200 and r.json()["status"] != "running":
            return r.json()
        assert r.status_code in (200, 404), r.text
        assert time.monotonic() < deadline, f"no request record {rid}"
        time.sleep(0.05)


def mapped_spec(meta: dict) -> dict:
    """The record's spec fields from SGLang's final ``meta_info``, by the mapping of
    ``runtime/sglang/client.py`` (``tokenizer_manager._calculate_spec_decoding_metrics``
    names): rounds = verify forwards, verified = Σ k·cap_hist[k] − rounds (per-round
    verify length minus the anchor), accepted = correct drafts (bonus excluded), emitted =
    completion tokens, per-position[j] = rounds that accepted more than j drafts."""
    rounds = meta["spec_verify_ct"]
    hist = meta["spec_correct_drafts_histogram"]
    return {
        "spec_rounds": rounds,
        "spec_drafted": meta["spec_num_proposed_drafts"],
        "spec_verified": sum(k * n for k, n in enumerate(meta["spec_cap_lens_histogram"])) - rounds,
        "spec_accepted": meta["spec_num_correct_drafts"],
        "spec_emitted": meta["completion_tokens"],
        "accepted_per_position": [sum(hist[j + 1:]) for j in range(len(hist) - 1)],
    }


def assert_sent_to_sglang(body: dict, rid: str, tok_dir: Path) -> None:
    """The ``/generate`` body carries our ids, rid, tier priority and SLA custom_params."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    ids = tok.encode(tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)
    assert body["input_ids"] == ids == PROMPT_IDS  # exactly the tokens the gateway counted
    assert body["rid"] == rid and body["stream"] is True
    assert body["priority"] == TIER_PRIORITY  # sglang_send_priority=True
    assert body["sampling_params"]["custom_params"] == {SLA_TARGET_KEY: TIER_TARGET_TPS,
                                                        SLA_MAX_WEIGHT_KEY: SLA_MAX_WEIGHT}


def assert_openai_error(payload: dict, code: str, type_: str = "server_error") -> str:
    """OpenAI error object: exactly ``message``, ``type``, ``param``, ``code``; returns the message."""
    err = payload["error"]
    assert set(payload) == {"error"} and set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == (type_, None, code)
    assert isinstance(err["message"], str) and err["message"]
    return err["message"]


# -- the backend came from settings ---------------------------------------------------

def test_backend_is_built_from_settings_and_reports_sglang_state(stack):
    assert isinstance(stack.backend, SGLangBackend)
    assert stack.backend.config.urls == (stack.standin_server.url,)
    with stack.client() as c:
        models = c.get("/v1/models", headers=stack.auth).json()
        after = scrape(c)
    assert [m["id"] for m in models["data"]] == [MODEL]
    # the stand-in's /server_info (DSPARK, γ = 7) and /v1/loads (max_running_requests 64)
    key = ("sparkgate:spec_decode_config_info",
           frozenset({"method": "dspark", "policy": "none", "num_speculative_tokens": "7"}.items()))
    assert after[key] == 1.0
    assert after[("sparkgate:max_num_seqs", frozenset())] == SGLangStandin.max_running


# -- success: stream and non-stream -----------------------------------------------------

def test_streamed_chat_completion(stack):
    stack.standin.spec_gamma, stack.standin.tokens_per_step = 7, 3  # rounds of 3, 3, 2 tokens
    with stack.client() as c:
        before = scrape(c)
        r = c.post("/v1/chat/completions", json=chat(True, return_spec_stats=True), headers=stack.auth)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(r.text)
        rec = record(c, events[0]["id"])
        after = scrape(c)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    rid = chunks[0]["id"]
    assert {ch["id"] for ch in chunks} == {rid} and rid.startswith("chatcmpl-")
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    final = stack.standin.chunks_sent[-1]
    meta = final["meta_info"]
    assert text == final["text"] == SCRIPT_TEXT  # the stand-in's cumulative text, nothing lost or added
    assert final["output_ids"] == [FIRST_TOKEN_ID + i for i in range(7)] + [EOS_ID]
    assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]][-1] == "stop"
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage == {"prompt_tokens": meta["prompt_tokens"], "completion_tokens": meta["completion_tokens"],
                     "total_tokens": meta["prompt_tokens"] + meta["completion_tokens"]}
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(PROMPT_IDS), 8)  # 7 words + EOS
    assert len(stack.standin.requests) == 1
    assert_sent_to_sglang(stack.standin.requests[0], rid, stack.tokenizer_dir)

    spec = mapped_spec(meta)
    assert spec == {"spec_rounds": 3, "spec_drafted": 21, "spec_verified": 8, "spec_accepted": 5,
                    "spec_emitted": 8, "accepted_per_position": [3, 2]}
    stats = chunks[-2]["spec_stats"]  # on the finishing chunk (return_spec_stats)
    assert (stats["rounds"], stats["verified"], stats["accepted"]) == (3, 8, 5)
    assert_record(rec, rid, meta, spec, stream=True, finish_reason="stop")
    assert_spec_counters_moved(before, after, rec)


def test_non_streamed_chat_completion(stack):
    stack.standin.spec_gamma, stack.standin.tokens_per_step = 4, 2  # rounds of 2, 2, 1 tokens
    with stack.client() as c:
        before = scrape(c)
        r = c.post("/v1/chat/completions", json=chat(False, max_tokens=5, return_spec_stats=True),
                   headers=stack.auth)
        assert r.status_code == 200, r.text
        out = r.json()
        rec = record(c, out["id"])
        after = scrape(c)
    final = stack.standin.chunks_sent[-1]
    meta = final["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert out["object"] == "chat.completion" and out["model"] == MODEL
    message = out["choices"][0]["message"]
    assert (message["role"], message["content"]) == ("assistant", final["text"])
    assert final["text"] == "Hello world, how are"
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": 5,
                            "total_tokens": len(PROMPT_IDS) + 5}
    assert meta["prompt_tokens"] == len(PROMPT_IDS) and meta["completion_tokens"] == 5
    body = stack.standin.requests[0]
    assert_sent_to_sglang(body, out["id"], stack.tokenizer_dir)
    assert body["sampling_params"]["max_new_tokens"] == 5

    spec = mapped_spec(meta)
    assert spec == {"spec_rounds": 3, "spec_drafted": 12, "spec_verified": 5, "spec_accepted": 2,
                    "spec_emitted": 5, "accepted_per_position": [2]}
    assert out["spec_stats"] == {"rounds": 3, "drafted": 12, "verified": 5, "accepted": 2, "emitted": 5,
                                 "tau": round(meta["spec_accept_length"], 4), "accepted_per_position": [2],
                                 "gated_rounds": 0}
    assert_record(rec, out["id"], meta, spec, stream=False, finish_reason="length")
    assert_spec_counters_moved(before, after, rec)


def assert_record(rec: dict, rid: str, meta: dict, spec: dict, stream: bool, finish_reason: str) -> None:
    assert (rec["id"], rec["tenant"], rec["user"], rec["tier"]) == (rid, TENANT, "alice", TIER)
    assert (rec["status"], rec["finish_reason"], rec["error_code"]) == ("finished", finish_reason, None)
    assert (rec["endpoint"], rec["stream"], rec["model"]) == ("chat", stream, MODEL)
    assert (rec["prompt_tokens"], rec["completion_tokens"]) == (meta["prompt_tokens"], meta["completion_tokens"])
    assert {k: rec[k] for k in spec} == spec
    assert rec["spec_tau"] == pytest.approx(meta["spec_accept_length"])  # SGLang's τ = tokens / verify forward
    assert rec["sla_target_tokens_per_s"] == TIER_TARGET_TPS


def assert_spec_counters_moved(before: dict, after: dict, rec: dict) -> None:
    """``sparkgate:spec_decode_*`` moved by exactly the record's numbers (the Grafana panels
    read these)."""
    d = lambda name, **lab: moved(before, after, name, **lab)  # noqa: E731
    assert d("sparkgate:spec_decode_num_drafts_total") == rec["spec_rounds"]
    assert d("sparkgate:spec_decode_num_draft_tokens_total") == rec["spec_drafted"]
    assert d("sparkgate:spec_decode_num_verified_tokens_total") == rec["spec_verified"]
    assert d("sparkgate:spec_decode_num_accepted_tokens_total") == rec["spec_accepted"]
    for pos, n in enumerate(rec["accepted_per_position"]):
        assert d("sparkgate:spec_decode_num_accepted_tokens_per_pos_total", position=str(pos)) == n
    assert d("sparkgate:spec_decode_verified_tokens_per_round_count", tier=TIER) == 1
    assert d("sparkgate:spec_decode_verified_tokens_per_round_sum", tier=TIER) == pytest.approx(
        rec["spec_verified"] / rec["spec_rounds"])
    assert d("sparkgate:request_success_total", finished_reason=rec["finish_reason"], tenant=TENANT, tier=TIER) == 1
    assert d("sparkgate:generation_tokens_total", tenant=TENANT, tier=TIER) == rec["completion_tokens"]
    assert d("sparkgate:prompt_tokens_total", tenant=TENANT, tier=TIER) == rec["prompt_tokens"]


# -- upstream errors → OpenAI errors -----------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_upstream_http_500_is_an_openai_bad_gateway_error(stack, stream):
    stack.standin.fail_status = 500
    with stack.client() as c:
        before = scrape(c)
        r = c.post("/v1/chat/completions", json=chat(stream), headers=stack.auth)
        # the first event is awaited before any byte is sent, so even a stream gets a real status
        assert r.status_code == 502 and r.headers["content-type"] == "application/json"
        message = assert_openai_error(r.json(), "upstream_error")
        after = scrape(c)
        rid = stack.standin.requests[0]["rid"]
        rec = record(c, rid)
    assert "HTTP 500" in message and "stand-in refuses with 500" in message
    assert (rec["status"], rec["error_code"], rec["tenant"]) == ("failed", "upstream_error", TENANT)
    assert moved(before, after, "sparkgate:request_errors_total", code="upstream_error", tenant=TENANT) == 1
    assert stack.standin.aborts == []  # SGLang refused it: nothing to abort


@pytest.mark.parametrize("stream", [False, True])
def test_upstream_busy_is_503_with_retry_after(stack, stream):
    stack.standin.fail_status, stack.standin.retry_after = 503, "7"
    with stack.client() as c:
        r = c.post("/v1/chat/completions", json=chat(stream), headers=stack.auth)
        assert r.status_code == 503 and r.headers["retry-after"] == "7"
        message = assert_openai_error(r.json(), "queue_full")
        rec = record(c, stack.standin.requests[0]["rid"])
    assert "503" in message
    assert (rec["status"], rec["error_code"]) == ("rejected", "queue_full")


def test_error_after_streaming_began_is_an_sse_error_event_then_done(stack):
    stack.standin.error_after = 2  # two token chunks, then SGLang's in-stream error chunk
    with stack.client() as c:
        before = scrape(c)
        r = c.post("/v1/chat/completions", json=chat(True), headers=stack.auth)
        assert r.status_code == 200  # headers were already sent when the upstream failed
        events = parse_sse(r.text)
        rec = record(c, events[0]["id"])
        after = scrape(c)
    assert stack.standin.chunks_sent[-1]["error"]["message"] == "stand-in error"
    assert events[-1] == "[DONE]"
    message = assert_openai_error(events[-2], "upstream_error")
    assert "stand-in error" in message
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-2] if e.get("choices"))
    assert text == "Hello world"  # what was streamed before the failure
    assert not any(e["choices"][0].get("finish_reason") for e in events[:-2] if e.get("choices"))
    assert (rec["status"], rec["error_code"], rec["completion_tokens"]) == ("failed", "upstream_error", 2)
    assert moved(before, after, "sparkgate:request_errors_total", code="upstream_error", tenant=TENANT) == 1
    assert stack.standin.aborts == []  # SGLang ended the request itself


def test_error_mid_generation_without_stream_is_502(stack):
    stack.standin.error_after = 2
    with stack.client() as c:
        r = c.post("/v1/chat/completions", json=chat(False), headers=stack.auth)
    assert r.status_code == 502
    assert "stand-in error" in assert_openai_error(r.json(), "upstream_error")


def test_unreachable_upstream_fails_then_gateway_is_not_ready(stack):
    backend = stack.backend
    upstream = backend.router.upstreams[0]
    good_url = upstream.url
    loop = stack.app.state.backend_start.get_loop()  # the gateway's event loop (uvicorn thread)
    try:
        upstream.url = closed_port_url()  # the SGLang server vanished; the health probe has not noticed
        with stack.client() as c:
            r = c.post("/v1/chat/completions", json=chat(False), headers=stack.auth)
            assert r.status_code == 503 and r.headers["retry-after"] == "5"
            message = assert_openai_error(r.json(), "upstream_unavailable")
            assert "no healthy SGLang upstream" in message and "ConnectError" in message
            assert not upstream.healthy  # the failed connect took it out of rotation
            r = c.post("/v1/chat/completions", json=chat(True), headers=stack.auth)
            assert r.status_code == 503 and r.headers["retry-after"] == "5"
            assert_openai_error(r.json(), "model_not_ready")
            assert c.get("/readyz").status_code == 503
    finally:
        upstream.url = good_url
        asyncio.run_coroutine_threadsafe(backend.router.check_all(backend._client), loop).result(15)
    assert upstream.healthy and stack.standin.requests == []
    with stack.client() as c:
        assert c.get("/readyz").status_code == 200


# -- client disconnect → SGLang abort ----------------------------------------------------

def test_client_disconnect_mid_stream_aborts_upstream(stack):
    stack.standin.step_delay_s = 0.05
    stack.standin.script = tuple(f" w{i}" for i in range(400))  # 20 s if nobody aborts
    seen: list[str] = []
    rid = None
    with httpx.stream("POST", f"{stack.base}/v1/chat/completions", json=chat(True), headers=stack.auth,
                      timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: "):])
                rid = chunk["id"]
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    seen.append(chunk["choices"][0]["delta"]["content"])
            if len(seen) == 3:
                break  # leaving the block closes the TCP connection mid-stream
    assert seen == [" w0", " w1", " w2"]
    _wait(lambda: stack.standin.aborts == [rid], "POST /abort_request for the request")
    _wait(lambda: rid in stack.standin.disconnects, "the upstream HTTP stream to close")
    assert [b["rid"] for b in stack.standin.requests] == [rid]
    assert len(stack.standin.chunks_sent) < 100  # stopped long before the 400-token script ended
    assert backend_in_flight(stack) == 0
    with stack.client() as c:
        rec = record(c, rid)
    assert (rec["status"], rec["tenant"], rec["stream"]) == ("cancelled", TENANT, True)
    assert 3 <= rec["completion_tokens"] < 100


def backend_in_flight(stack) -> int:
    return sum(u.in_flight for u in stack.backend.router.upstreams)


# -- constrained decoding: response formats and tools reach SGLang, replies come back shaped ----------

def person_schema() -> dict:
    return {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 10},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "email": {"type": "string", "format": "email"}}, "required": ["name", "age", "tags", "email"]}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_reaches_sglang_and_the_reply_validates(stack, stream):
    import jsonschema

    schema = person_schema()
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    with stack.client() as c:
        before = scrape(c)
        r = c.post("/v1/chat/completions", json=chat(stream, response_format=rf, temperature=0.3, seed=11),
                   headers=stack.auth)
        assert r.status_code == 200, r.text
        if stream:
            events = parse_sse(r.text)
            rid = events[0]["id"]
            content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
            finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1]
        else:
            rid, choice = r.json()["id"], r.json()["choices"][0]
            content, finish = choice["message"]["content"], choice["finish_reason"]
        rec = record(c, rid)
        after = scrape(c)
    (body,) = stack.standin.requests
    sp = body["sampling_params"]
    assert json.loads(sp["json_schema"]) == schema and stack.standin.constraints == [("json_schema", schema)]
    assert not {"regex", "ebnf", "structural_tag"} & set(sp)
    assert (sp["temperature"], sp["sampling_seed"]) == (0.3, 11)  # the sampling fields ride along
    jsonschema.validate(json.loads(content), schema)
    assert content == stack.standin.chunks_sent[-1]["text"] and finish == "stop"
    # SGLang reports no mask time: marked json_schema, not measured
    assert (rec["constraint"], rec["mask_ms_per_token"], rec["status"]) == ("json_schema", None, "finished")
    assert moved(before, after, "sparkgate:constrained_requests_total", constraint="json_schema", tenant=TENANT) == 1
    assert moved(before, after, "sparkgate:grammar_mask_time_per_output_token_seconds_count") == 0


def test_json_object_is_sglangs_object_schema(stack):
    with stack.client() as c:
        r = c.post("/v1/chat/completions", json=chat(False, response_format={"type": "json_object"}),
                   headers=stack.auth)
        assert r.status_code == 200, r.text
        rec = record(c, r.json()["id"])
    assert stack.standin.requests[0]["sampling_params"]["json_schema"] == '{"type": "object"}'
    assert json.loads(r.json()["choices"][0]["message"]["content"]) == {}
    assert rec["constraint"] == "json_object"


WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "ping"}}]


@pytest.mark.parametrize("choice,kind,names", [
    ("required", "tags_with_separator", ["get_weather", "ping"]),
    ("auto", "triggered_tags", ["get_weather", "ping"]),
    ({"type": "function", "function": {"name": "ping"}}, "tags_with_separator", ["ping"]),
])
def test_tools_reach_sglang_as_a_structural_tag_and_come_back_as_tool_calls(stack, choice, kind, names):
    import jsonschema

    from runtime.engine.tool_grammar import call_opening

    body = chat(False, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    with stack.client() as c:
        r = c.post("/v1/chat/completions", json=body, headers=stack.auth)
        assert r.status_code == 200, r.text
        out = r.json()
        rec = record(c, out["id"])
        streamed = parse_sse(c.post("/v1/chat/completions", json={**body, "stream": True}, headers=stack.auth).text)
    (field, tag), _ = stack.standin.constraints
    fmt = tag["format"]
    assert field == "structural_tag" and fmt["type"] == kind and fmt["stop_after_first"] is True
    assert [t["begin"] for t in fmt["tags"]] == [call_opening(n) for n in names]
    params = {"get_weather": WEATHER_PARAMS, "ping": {"type": "object", "properties": {}}}
    assert [t["content"]["json_schema"] for t in fmt["tags"]] == [params[n] for n in names]
    assert "json_schema" not in stack.standin.requests[0]["sampling_params"]
    choice0 = out["choices"][0]
    assert choice0["finish_reason"] == "tool_calls" and choice0["message"]["content"] is None
    (call,) = choice0["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == names[0]
    jsonschema.validate(json.loads(call["function"]["arguments"]), params[names[0]])
    assert "<tool_call>" not in json.dumps(out)  # the tags never reach the client
    deltas = [e["choices"][0] for e in streamed[:-1] if e["choices"]]
    calls = [d["delta"]["tool_calls"][0] for d in deltas if "tool_calls" in d["delta"]]
    assert calls[0]["function"]["name"] == names[0] and deltas[-1]["finish_reason"] == "tool_calls"
    assert "".join(x["function"]["arguments"] for x in calls) == call["function"]["arguments"]
    assert (rec["constraint"], rec["finish_reason"]) == ("tools", "stop")  # the engine's reason: EOS


def test_tools_with_a_response_format_reach_sglang_as_the_format_or_calls(stack):
    import jsonschema

    answer = {"type": "object", "properties": {"city": {"type": "string"}, "pair": {
        "type": "array", "items": [{"type": "integer"}, {"type": "string"}], "additionalItems": False}},
        "required": ["city", "pair"]}  # a draft-07 tuple, as the Vercel AI SDK sends zod's
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": answer}}
    with stack.client() as c:
        r = c.post("/v1/chat/completions", json=chat(False, tools=TOOLS, response_format=fmt), headers=stack.auth)
        assert r.status_code == 200, r.text
    ((field, tag),) = stack.standin.constraints
    assert field == "structural_tag" and tag["format"]["type"] == "or"
    reply, calls = tag["format"]["elements"]
    assert calls["type"] == "tags_with_separator" and calls["at_least_one"] is True
    assert reply["json_schema"]["properties"]["pair"] == {  # read as 2020-12
        "type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False}
    message = r.json()["choices"][0]["message"]
    assert r.json()["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in message
    jsonschema.Draft7Validator(answer).validate(json.loads(message["content"]))


def test_refused_schemas_never_reach_sglang_and_sglangs_refusal_is_a_400(stack):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}
    with stack.client() as c:
        r = c.post("/v1/chat/completions", json=chat(True, response_format=bad), headers=stack.auth)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "unsupported_schema_keyword"
        assert err["param"] == "response_format.json_schema.schema.properties.tags.uniqueItems"
        assert stack.standin.requests == []  # checked like the embedded engine, before anything is sent
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]
        r = c.post("/v1/chat/completions", json=chat(False, tools=tools, tool_choice="required"), headers=stack.auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.parameters.not"
        assert stack.standin.requests == []
        # a schema only the compiler can refuse: SGLang aborts it (400, "Invalid grammar request")
        typo = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
        for stream in (False, True):
            r = c.post("/v1/chat/completions", json=chat(stream, response_format=typo), headers=stack.auth)
            err = r.json()["error"]
            assert r.status_code == 400 and (err["code"], err["param"]) == ("invalid_schema", "response_format")
            assert "Invalid grammar request" in err["message"]
        rec = record(c, stack.standin.requests[-1]["rid"])
    assert (rec["status"], rec["error_code"], rec["constraint"]) == ("rejected", "invalid_schema", "json_schema")
    assert stack.standin.aborts == []  # SGLang ended them itself


def test_sampling_fields_and_n_reach_sglang(stack):
    extra = {"n": 2, "seed": 5, "temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.1,
             "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
             "logit_bias": {"7": -100}, "min_tokens": 2, "stop_token_ids": [6], "stop": ["zz"], "max_tokens": 4}
    with stack.client() as c:
        r = c.post("/v1/chat/completions", json=chat(False, **extra), headers=stack.auth)
    assert r.status_code == 200, r.text
    assert [ch["index"] for ch in r.json()["choices"]] == [0, 1]
    sent = sorted(stack.standin.requests, key=lambda b: b["rid"])
    assert [b["rid"] for b in sent] == [r.json()["id"], r.json()["id"] + "-1"]
    for i, b in enumerate(sent):
        sp = {k: v for k, v in b["sampling_params"].items() if k != "custom_params"}
        assert sp == {"max_new_tokens": 4, "temperature": 0.8, "top_p": 0.9, "top_k": 20, "ignore_eos": False,
                      "stop": ["zz"], "presence_penalty": 0.5, "frequency_penalty": -0.5,
                      "repetition_penalty": 1.1, "min_p": 0.1, "min_new_tokens": 2, "logit_bias": {"7": -100.0},
                      "stop_token_ids": [6], "sampling_seed": 5 + i}
