"""SGLangBackend against the SGLang 0.5.23 stand-in (tests/support/sglang_standin.py) served on
loopback: streaming, finish and spec-stats mapping, request fields, cancellation → abort,
upstream errors → Failed / QueueFullError, routing and failover over two servers."""

from __future__ import annotations

import asyncio
import time

import pytest

from runtime.interface import (
    Backend,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    QueueFullError,
    SamplingParams,
    SpecInfo,
    TextDelta,
)
from runtime.sglang.client import SGLangBackend, SGLangConfig
from tests.support.sglang_standin import EOS_ID, FIRST_TOKEN_ID, StandinServer, closed_port_url, validate_chunk


class WordTokenizer:
    """Tokenizer stand-in (the real one is tested in test_real_tokenizer_*)."""

    eos_token_id = EOS_ID

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return " ".join(f"<{m['role']}> {m['content']}" for m in messages) + " <assistant>"

    def encode(self, text, add_special_tokens=False):
        return [len(w) for w in text.split()]


@pytest.fixture(scope="module")
def servers():
    a, b = StandinServer().start(), StandinServer().start()
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture(autouse=True)
def _reset(servers):
    for s in servers:
        s.standin.reset()


async def _backend(urls, **cfg) -> SGLangBackend:
    cfg.setdefault("max_context", 256)
    cfg.setdefault("health_interval_s", 3600)
    backend = SGLangBackend(SGLangConfig(urls=tuple(urls), **cfg), tokenizer=WordTokenizer())
    await backend.start()
    return backend


def _req(rid="chatcmpl-t1", **sampling) -> GenerationRequest:
    return GenerationRequest(request_id=rid, prompt_token_ids=[11, 12, 13, 14],
                             sampling=SamplingParams(**sampling))


async def _collect(backend, req):
    return [e async for e in backend.generate(req)]


async def _wait_for(cond, timeout=3.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("incremental", [False, True])
async def test_streams_text_then_finished(servers, incremental):
    srv = servers[0]
    srv.standin.incremental = incremental
    srv.standin.tokens_per_step = 2
    backend = await _backend([srv.url])
    try:
        assert isinstance(backend, Backend)  # the runtime-checkable protocol, spec_info() included
        assert backend.ready() and backend.info.eos_token_id == EOS_ID
        events = await _collect(backend, _req())
    finally:
        await backend.stop()
    deltas, fin = events[:-1], events[-1]
    assert all(isinstance(d, TextDelta) for d in deltas)
    assert "".join(d.text for d in deltas) == "Hello world, how are you?"
    assert [d.num_tokens for d in deltas] == [2, 2, 2, 2]  # 7 words + EOS, 2 per step
    assert [t for d in deltas for t in d.token_ids] == [FIRST_TOKEN_ID + i for i in range(7)] + [EOS_ID]
    assert isinstance(fin, Finished) and fin.finish_reason is FinishReason.STOP
    assert (fin.prompt_tokens, fin.completion_tokens) == (4, 8)
    t = fin.timings
    assert t.queued <= t.started <= t.first_token <= t.last_token <= t.finished
    assert fin.spec is None  # the stand-in ran without speculative decoding
    assert len(srv.standin.aborts) == 0  # finished normally: nothing to abort
    for chunk in srv.standin.chunks_sent:  # every chunk the client parsed is contract-valid
        assert validate_chunk(chunk) == "response"


async def test_request_fields_reach_sglang(servers):
    srv = servers[0]
    backend = await _backend([srv.url], send_priority=True, sla_max_weight=2.5)
    req = _req(rid="chatcmpl-sla", temperature=0.0, top_k=0, max_tokens=3, seed=9, stop=("zzz",))
    req.sla_target_tokens_per_s, req.priority, req.tenant = 80.0, 5, "acme"
    try:
        events = await _collect(backend, req)
    finally:
        await backend.stop()
    body = srv.standin.requests[0]
    assert body["rid"] == "chatcmpl-sla" and body["priority"] == 5 and body["input_ids"] == [11, 12, 13, 14]
    assert body["sampling_params"]["custom_params"] == {
        "sparkgate_sla_target_tokens_per_s": 80.0, "sparkgate_sla_max_weight": 2.5}
    assert body["sampling_params"]["top_k"] == -1 and body["sampling_params"]["sampling_seed"] == 9
    assert "custom_labels" not in body  # only with sla_in_custom_labels (behind sglang-router)
    fin = events[-1]
    assert fin.finish_reason is FinishReason.LENGTH and fin.completion_tokens == 3
    assert "".join(e.text for e in events[:-1]) == "Hello world,"


def test_sla_in_custom_labels_for_sglang_router():
    """``sla_in_custom_labels``: the SLA pair also goes in ``custom_labels`` as text (sglang-router
    0.3.2 keeps that field, drops ``custom_params``); without a target nothing is added."""
    from runtime.sglang.client import SGLangConfig, build_generate_payload

    req = _req(rid="chatcmpl-lab")
    req.sla_target_tokens_per_s = 12.5
    body = build_generate_payload(req, SGLangConfig(sla_in_custom_labels=True, sla_max_weight=3.0))
    assert body["custom_labels"] == {"sparkgate_sla_target_tokens_per_s": "12.5", "sparkgate_sla_max_weight": "3.0"}
    assert body["sampling_params"]["custom_params"] == {"sparkgate_sla_target_tokens_per_s": 12.5,
                                                        "sparkgate_sla_max_weight": 3.0}
    req.sla_target_tokens_per_s = None
    assert "custom_labels" not in build_generate_payload(req, SGLangConfig(sla_in_custom_labels=True))


async def test_spec_stats_from_meta_info(servers):
    srv = servers[0]
    srv.standin.spec_gamma, srv.standin.tokens_per_step = 7, 3
    backend = await _backend([srv.url])
    try:
        fin = (await _collect(backend, _req()))[-1]
    finally:
        await backend.stop()
    meta = srv.standin.chunks_sent[-1]["meta_info"]
    # 7 words + EOS in rounds of 3, 3, 2 tokens → accepted drafts 2, 2, 1
    assert meta["spec_verify_ct"] == 3 and meta["spec_correct_drafts_histogram"] == [0, 1, 2]
    s = fin.spec
    assert (s.rounds, s.drafted, s.accepted, s.emitted) == (3, 21, 5, 8)
    assert s.verified == (4 + 4 + 3) - 3  # verify lengths incl. anchor minus anchors
    assert s.accepted_per_position == [3, 2]
    assert s.tau == pytest.approx(meta["spec_accept_length"]) == pytest.approx(8 / 3)


async def test_spec_info_from_server_info(servers):
    a, b = servers
    a.standin.spec_gamma = 7
    backend = await _backend([a.url])
    try:
        assert backend.spec_info() == SpecInfo(method="dspark", policy=None, block_size=7, sps_table=None)
    finally:
        await backend.stop()
    backend = await _backend([b.url])
    try:
        assert backend.spec_info() == SpecInfo(method="none")
    finally:
        await backend.stop()
    backend = await _backend([closed_port_url()])
    try:
        assert backend.spec_info() == SpecInfo(method="sglang")  # not known yet
    finally:
        await backend.stop()


async def test_stop_string_prefix_streamed_by_sglang_is_not_returned(servers):
    srv = servers[0]
    srv.standin.script = ("Hi", " #", "#", "#", " never")
    backend = await _backend([srv.url])
    try:
        events = await _collect(backend, _req(stop=("###",)))
    finally:
        await backend.stop()
    sent = [c["text"] for c in srv.standin.chunks_sent]
    assert sent == ["Hi", "Hi #", "Hi ##", "Hi ##"]  # SGLang's own leak, reproduced
    assert "".join(e.text for e in events[:-1]) == "Hi "
    assert events[-1].finish_reason is FinishReason.STOP and events[-1].completion_tokens == 4


async def test_early_close_aborts_and_closes_the_stream(servers):
    srv = servers[0]
    srv.standin.step_delay_s = 0.05
    srv.standin.script = tuple(f" w{i}" for i in range(200))
    backend = await _backend([srv.url])
    try:
        gen = backend.generate(_req(rid="chatcmpl-gone"))
        first = await gen.__anext__()
        assert isinstance(first, TextDelta)
        await gen.aclose()  # the client went away
        assert srv.standin.aborts == ["chatcmpl-gone"]
        await _wait_for(lambda: "chatcmpl-gone" in srv.standin.disconnects)
        assert backend.router.upstreams[0].in_flight == 0
    finally:
        await backend.stop()


async def test_task_cancellation_aborts(servers):
    srv = servers[0]
    srv.standin.step_delay_s = 0.05
    srv.standin.script = tuple(f" w{i}" for i in range(200))
    backend = await _backend([srv.url])
    seen = []

    async def consume():
        async for ev in backend.generate(_req(rid="chatcmpl-cancel")):
            seen.append(ev)

    try:
        task = asyncio.create_task(consume())
        await _wait_for(lambda: len(seen) >= 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_for(lambda: srv.standin.aborts == ["chatcmpl-cancel"])
    finally:
        await backend.stop()


async def test_connection_refused_is_failed():
    backend = await _backend([closed_port_url()])
    try:
        assert not backend.ready()
        events = await _collect(backend, _req())
    finally:
        await backend.stop()
    assert len(events) == 1 and isinstance(events[0], Failed)
    assert events[0].code == "upstream_unavailable" and events[0].prompt_tokens == 4


async def test_upstream_down_after_start_is_failed(servers):
    srv = servers[0]
    backend = await _backend([srv.url])
    try:
        backend.router.upstreams[0].url = closed_port_url()  # the server vanished
        events = await _collect(backend, _req())
        assert isinstance(events[0], Failed) and events[0].code == "upstream_unavailable"
        assert not backend.router.upstreams[0].healthy and not backend.ready()
    finally:
        await backend.stop()


@pytest.mark.parametrize("status", [503, 429])
async def test_busy_http_status_is_queue_full(servers, status):
    srv = servers[0]
    srv.standin.fail_status, srv.standin.retry_after = status, "7"
    backend = await _backend([srv.url])
    try:
        with pytest.raises(QueueFullError) as info:
            await _collect(backend, _req())
    finally:
        await backend.stop()
    assert info.value.retry_after_s == 7.0 and str(status) in str(info.value)


async def test_queue_full_abort_chunk_is_queue_full(servers):
    srv = servers[0]
    srv.standin.queue_full_abort = True
    backend = await _backend([srv.url], retry_after_s=2.0)
    try:
        with pytest.raises(QueueFullError, match="queue is full") as info:
            await _collect(backend, _req())
    finally:
        await backend.stop()
    assert info.value.retry_after_s == 2.0 and srv.standin.aborts == []
    assert validate_chunk(srv.standin.chunks_sent[0]) == "response"


async def test_http_500_is_failed(servers):
    srv = servers[0]
    srv.standin.fail_status = 500
    backend = await _backend([srv.url])
    try:
        events = await _collect(backend, _req())
    finally:
        await backend.stop()
    assert [type(e) for e in events] == [Failed]
    assert events[0].code == "upstream_error" and "500" in events[0].message
    assert "stand-in refuses" in events[0].message


async def test_error_chunk_is_failed(servers):
    srv = servers[0]
    srv.standin.error_after = 2
    backend = await _backend([srv.url])
    try:
        events = await _collect(backend, _req())
    finally:
        await backend.stop()
    assert [type(e) for e in events] == [TextDelta, TextDelta, Failed]
    assert events[-1].code == "upstream_error" and "stand-in error" in events[-1].message
    assert events[-1].completion_tokens == 2
    assert validate_chunk(srv.standin.chunks_sent[-1]) == "error"
    assert srv.standin.aborts == []  # SGLang ended the request itself


async def test_malformed_chunk_is_failed_and_aborted(servers):
    srv = servers[0]
    srv.standin.malformed_after, srv.standin.step_delay_s = 1, 0.02
    backend = await _backend([srv.url])
    try:
        events = await _collect(backend, _req(rid="chatcmpl-bad"))
    finally:
        await backend.stop()
    assert [type(e) for e in events] == [TextDelta, Failed]
    assert events[-1].code == "upstream_protocol_error"
    assert srv.standin.aborts == ["chatcmpl-bad"]


async def test_dropped_stream_is_failed_and_aborted(servers):
    srv = servers[0]
    srv.standin.drop_after = 3
    backend = await _backend([srv.url])
    try:
        events = await _collect(backend, _req(rid="chatcmpl-drop"))
    finally:
        await backend.stop()
    assert [type(e) for e in events] == [TextDelta] * 3 + [Failed]
    assert events[-1].code == "upstream_disconnected" and events[-1].completion_tokens == 3
    assert srv.standin.aborts == ["chatcmpl-drop"]


async def test_timeout_is_failed_and_aborted(servers):
    """A 0.5 s limit on a stream that would take 20 s (100 tokens × 0.2 s): cut at the
    limit, never before it; the upper bound only has to tell the cut from the stream's end."""
    srv = servers[0]
    srv.standin.step_delay_s = 0.2
    srv.standin.script = tuple(f" w{i}" for i in range(100))
    backend = await _backend([srv.url])
    req = _req(rid="chatcmpl-slow")
    req.timeout_s = 0.5
    try:
        t0 = time.monotonic()
        events = await _collect(backend, req)
        elapsed = time.monotonic() - t0
    finally:
        await backend.stop()
    assert isinstance(events[-1], Failed) and events[-1].code == "timeout"
    assert events[-1].completion_tokens < 100 and 0.45 < elapsed < 15
    assert srv.standin.aborts == ["chatcmpl-slow"]


async def test_least_loaded_routing_across_two_servers(servers):
    a, b = servers
    for s in servers:
        s.standin.step_delay_s = 0.05
        s.standin.script = tuple(f" w{i}" for i in range(100))
    backend = await _backend([a.url, b.url])
    try:
        gens = [backend.generate(_req(rid=f"chatcmpl-r{i}")) for i in range(4)]
        for g in gens:  # start them one after the other: each goes to the least loaded
            await g.__anext__()
        assert [u.in_flight for u in backend.router.upstreams] == [2, 2]
        assert backend.load().running == 4
        assert sorted(r["rid"] for r in a.standin.requests) == ["chatcmpl-r0", "chatcmpl-r2"]
        assert sorted(r["rid"] for r in b.standin.requests) == ["chatcmpl-r1", "chatcmpl-r3"]
        await gens[1].aclose()  # b now carries one → the next request goes to b
        g5 = backend.generate(_req(rid="chatcmpl-r4"))
        await g5.__anext__()
        assert [r["rid"] for r in b.standin.requests][-1] == "chatcmpl-r4"
        assert b.standin.aborts == ["chatcmpl-r1"]
        for g in (*gens, g5):
            await g.aclose()
        assert [u.in_flight for u in backend.router.upstreams] == [0, 0]
    finally:
        await backend.stop()


async def test_failover_when_one_server_is_unhealthy(servers):
    a, b = servers
    a.standin.healthy = False
    backend = await _backend([a.url, b.url])
    try:
        assert [u.healthy for u in backend.router.upstreams] == [False, True]
        events = [await _collect(backend, _req(rid=f"chatcmpl-f{i}")) for i in range(3)]
        assert all(isinstance(e[-1], Finished) for e in events)
        assert a.standin.requests == [] and len(b.standin.requests) == 3
        a.standin.healthy = True  # back: the next probe round puts it into rotation
        await backend.router.check_all(backend._client)
        assert backend.router.upstreams[0].healthy
        await _collect(backend, _req(rid="chatcmpl-f3"))
        assert [r["rid"] for r in a.standin.requests] == ["chatcmpl-f3"]
    finally:
        await backend.stop()


async def test_connect_failure_fails_over_to_the_next_server(servers):
    b = servers[1]
    backend = await _backend([closed_port_url(), b.url])
    try:
        backend.router.upstreams[0].healthy = True  # pretend the probe has not noticed yet
        backend.router.upstreams[0].in_flight = -1  # make it the preferred pick
        events = await _collect(backend, _req())
        assert isinstance(events[-1], Finished)
        assert not backend.router.upstreams[0].healthy and len(b.standin.requests) == 1
    finally:
        await backend.stop()


async def test_busy_server_fails_over_before_queue_full(servers):
    a, b = servers
    a.standin.fail_status = 503
    backend = await _backend([a.url, b.url])
    try:
        events = await _collect(backend, _req())
        assert isinstance(events[-1], Finished) and len(b.standin.requests) == 1
        b.standin.fail_status = 429
        with pytest.raises(QueueFullError):
            await _collect(backend, _req())
    finally:
        await backend.stop()


async def test_admission_cap_raises_queue_full(servers):
    srv = servers[0]
    srv.standin.step_delay_s = 0.05
    srv.standin.script = tuple(f" w{i}" for i in range(100))
    backend = await _backend([srv.url], max_in_flight_per_upstream=1)
    try:
        g = backend.generate(_req(rid="chatcmpl-c1"))
        await g.__anext__()
        with pytest.raises(QueueFullError, match="in-flight"):
            await _collect(backend, _req(rid="chatcmpl-c2"))
        assert len(srv.standin.requests) == 1
        await g.aclose()
    finally:
        await backend.stop()


async def test_load_reads_v1_loads(servers):
    srv = servers[0]
    srv.standin.waiting, srv.standin.max_running = 3, 48
    backend = await _backend([srv.url])
    try:
        snap = backend.load()
    finally:
        await backend.stop()
    assert (snap.running, snap.waiting, snap.max_batch) == (0, 3, 48)
    assert srv.standin.health_checks == 1


@pytest.mark.model
async def test_real_tokenizer_from_the_converted_model(servers):
    from runtime.models.loader import ensure_converted

    backend = SGLangBackend(SGLangConfig(urls=(servers[0].url,), tokenizer_path=str(ensure_converted()),
                                         health_interval_s=3600))
    await backend.start()
    try:
        ids = backend.apply_chat_template([{"role": "user", "content": "Hi"}])
        tok = backend._tokenizer
        assert tok.decode(ids).startswith("<|im_start|>") and ids == tok.encode(
            tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                    tokenize=False), add_special_tokens=False)
        assert backend.info.eos_token_id == tok.eos_token_id
    finally:
        await backend.stop()
