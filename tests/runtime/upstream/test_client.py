"""The OpenAI-compatible upstream backend (:class:`runtime.upstream.client.OpenAIUpstreamBackend`)
against FAKE OpenAI-compatible servers (``tests/support/openai_upstream.py``, real HTTP on
127.0.0.1): what arrives upstream, the events, failures, timeouts, ejection and rejoin,
least-outstanding routing and the abort of an abandoned stream."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from runtime.interface import (
    Failed, Finished, FinishReason, GenerationRequest, QueueFullError, SamplingParams, TextDelta,
)
from runtime.upstream.client import OpenAIUpstreamBackend
from runtime.upstream.config import UpstreamConfig
from tests.support.openai_upstream import FIRST_ID, SCRIPT, UpstreamServer
from tests.support.polling import async_wait_until
from tests.support.sglang_standin import closed_port_url

PROMPT = [3, 6, 7, 4]
TEXT = "".join(SCRIPT)  # "Hello world, how are you?"


def word_tokenizer():
    """A word-level tokenizer with a chat template: the backend only needs it for ``info``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["[UNK]", "<s>", "</s>", "<user>", "<assistant>", "<system>", "Say", "hello"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}<assistant>"
    return tok


@pytest.fixture(scope="module")
def servers():
    a, b = UpstreamServer().start(), UpstreamServer().start()
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture(autouse=True)
def _fresh(servers):
    for s in servers:
        s.fake.reset()


@contextlib.asynccontextmanager
async def backend(*urls: str, **cfg):
    b = OpenAIUpstreamBackend(UpstreamConfig(urls=urls, health_interval_s=cfg.pop("health_interval_s", 3600), **cfg),
                              tokenizer=word_tokenizer())
    await b.start()
    try:
        yield b
    finally:
        await b.stop()


async def run(b: OpenAIUpstreamBackend, sampling: SamplingParams = SamplingParams(max_tokens=16), **request) -> list:
    return [e async for e in b.generate(GenerationRequest("cmpl-t", PROMPT, sampling, **request))]


def text_of(events: list) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


async def test_streams_the_reply_with_the_usage_and_sends_token_ids(servers):
    srv = servers[0]
    srv.fake.cached_tokens = 2
    async with backend(srv.url, keys=("sk-up",), send_priority=True, model="served") as b:
        assert b.ready() and b.info.eos_token_id == 2 and not b.info.supports_response_format
        events = await run(b, SamplingParams(max_tokens=16, temperature=0.0, seed=3), priority=2)
    deltas, fin = events[:-1], events[-1]
    assert [d.text for d in deltas] == list(SCRIPT) and all(d.num_tokens == 1 for d in deltas)
    assert isinstance(fin, Finished) and fin.finish_reason is FinishReason.STOP
    assert (fin.prompt_tokens, fin.completion_tokens, fin.cached_tokens) == (4, len(SCRIPT), 2)
    t = fin.timings
    assert t.queued <= t.started <= t.first_token <= t.last_token <= t.finished
    (sent,) = srv.fake.requests
    assert sent == {"model": "served", "prompt": PROMPT, "stream": True, "stream_options": {"include_usage": True},
                    "max_tokens": 16, "temperature": 0.0, "top_p": 1.0, "seed": 3, "priority": -2}
    assert srv.fake.headers[0]["authorization"] == "Bearer sk-up"
    assert srv.fake.completed == [0] and srv.fake.disconnects == []


async def test_a_finished_stream_leaves_its_connection_to_the_next_request(servers):
    """After ``[DONE]`` the body's end is read, so the pooled connection is reused (a stream
    closed mid-body would close it: one TCP connect per request)."""
    srv = servers[0]
    async with backend(srv.url) as b:
        for _ in range(3):
            assert text_of(await run(b)) == TEXT
            await async_wait_until(lambda: not b._background, "the stream's close task")
    assert len(set(srv.fake.peers)) == 1 and len(srv.fake.peers) == 3


async def test_token_ids_and_length_from_the_server(servers):
    async with backend(servers[0].url, return_token_ids=True) as b:
        events = await run(b, SamplingParams(max_tokens=3))
    assert [(e.text, e.token_ids) for e in events[:-1]] == [(p, [FIRST_ID + i]) for i, p in enumerate(SCRIPT[:3])]
    assert events[-1].finish_reason is FinishReason.LENGTH and events[-1].completion_tokens == 3


async def test_a_stop_string_the_server_streamed_is_cut(servers):
    """The fake ignores ``stop`` (as SGLang does for the part already streamed): the stop text
    and what follows never reach the client, and a held-back prefix is released at the end."""
    async with backend(servers[0].url) as b:
        events = await run(b, SamplingParams(max_tokens=16, stop=(" are",)))
        assert text_of(events) == "Hello world, how"
        events = await run(b, SamplingParams(max_tokens=16, stop=("?!",)))
        assert text_of(events) == TEXT and events[-2].text == "?"  # "?" waited: it may start "?!"


async def test_logprobs_become_token_logprobs(servers):
    async with backend(servers[0].url, logprobs=True) as b:
        assert b.info.supports_logprobs
        events = await run(b, SamplingParams(max_tokens=2, logprobs=2))
    assert servers[0].fake.requests[0]["return_tokens_as_token_ids"] is True
    deltas = events[:-1]
    assert [d.token_ids for d in deltas] == [[FIRST_ID], [FIRST_ID + 1]]
    entry = deltas[1].logprobs[0]
    assert (entry.token_id, entry.logprob, entry.top) == (FIRST_ID + 1, -0.5,
                                                          [(FIRST_ID + 1, -0.5), (FIRST_ID + 2, -1.0)])


async def test_http_error_is_upstream_error_and_busy_everywhere_is_queue_full(servers):
    a, b_ = servers
    a.fake.fail_status = 500
    async with backend(a.url) as b:
        (ev,) = await run(b)
    assert isinstance(ev, Failed) and ev.code == "upstream_error" and ev.prompt_tokens == 4
    assert "answered HTTP 500: fake upstream refuses with 500" in ev.message
    a.fake.fail_status = b_.fake.fail_status = 503
    b_.fake.retry_after = "7"
    async with backend(a.url, b_.url) as b:
        with pytest.raises(QueueFullError) as err:
            await run(b)
    # one try on each (a first: a tie goes to the first listed), the last one's Retry-After
    assert err.value.retry_after_s == 7.0 and (len(a.fake.requests), len(b_.fake.requests)) == (2, 1)


async def test_the_in_flight_cap_is_queue_full(servers):
    a, b_ = servers
    for s in servers:
        s.fake.chunk_delay_s = 0.05
    async with backend(a.url, b_.url, max_in_flight_per_upstream=1, retry_after_s=3) as b:
        streams = [b.generate(GenerationRequest(f"cmpl-{i}", PROMPT, SamplingParams(max_tokens=16))) for i in range(3)]
        firsts = [await s.__anext__() for s in streams[:2]]  # one stream on each upstream
        assert [f.text for f in firsts] == ["Hello", "Hello"] and b.load().running == 2
        assert b.load().max_batch == 2
        with pytest.raises(QueueFullError, match="at 1 in-flight requests") as err:
            await streams[2].__anext__()
        assert err.value.retry_after_s == 3
        for s in streams[:2]:
            await s.aclose()
    assert [len(s.fake.requests) for s in servers] == [1, 1]


async def test_error_object_mid_stream(servers):
    servers[0].fake.error_after = 2
    async with backend(servers[0].url) as b:
        events = await run(b)
    assert text_of(events) == "Hello world" and isinstance(events[-1], Failed)
    assert events[-1].code == "upstream_error" and "fake upstream error" in events[-1].message
    assert events[-1].completion_tokens == 2


async def test_silence_is_upstream_timeout(servers):
    srv = servers[0]
    srv.fake.stall_after, srv.fake.stall_s = 2, 5
    async with backend(srv.url, read_timeout_s=0.3) as b:
        events = await run(b)
        assert text_of(events) == "Hello world" and events[-1].code == "upstream_timeout"
        assert "sent nothing for 0.3 s" in events[-1].message
        await async_wait_until(lambda: srv.fake.disconnects == [0], "the stalled stream closed")
        srv.fake.stall_after, srv.fake.stall_before_headers_s = None, 5
        (ev,) = await run(b)
        assert ev.code == "upstream_timeout" and "no response headers within 0.3 s" in ev.message
        srv.fake.stall_before_headers_s, srv.fake.chunk_delay_s = 0, 0.2
        events = await run(b, timeout_s=0.5)  # the request's own wall-clock limit
        assert events[-1].code == "upstream_timeout" and "0.5 s limit" in events[-1].message
        assert 1 <= len(events) - 1 <= 3


async def test_refused_connection_ejects_then_all_down_is_unavailable(servers):
    dead = closed_port_url()
    async with backend(dead, servers[0].url) as b:
        assert [u.healthy for u in b.router.upstreams] == [False, True]  # the first probe at start
        b.router.upstreams[0].healthy = True  # as if the server died after the last probe
        b.router.upstreams[0].in_flight = -1  # and would be picked first
        events = await run(b)
        assert text_of(events) == TEXT and len(servers[0].fake.requests) == 1
        assert not b.router.upstreams[0].healthy and "ConnectError" in b.router.upstreams[0].last_error
    async with backend(dead) as b:
        assert b.ready()  # serving: requests get a clear 503 while no upstream is up
        (ev,) = await run(b)
    assert ev.code == "upstream_unavailable" and "no healthy OpenAI-compatible upstream" in ev.message


async def test_a_dead_upstream_rejoins_when_it_comes_back():
    srv = UpstreamServer().start()
    port = srv.port
    try:
        async with backend(srv.url, health_interval_s=0.05) as b:
            (up,) = b.router.upstreams
            srv.stop()
            await async_wait_until(lambda: not up.healthy, "the probe ejected the dead upstream")
            (ev,) = await run(b)
            assert ev.code == "upstream_unavailable"
            srv = UpstreamServer(port=port).start()
            await async_wait_until(lambda: up.healthy, "the probe let the upstream rejoin")
            assert text_of(await run(b)) == TEXT
    finally:
        srv.stop()


async def test_least_outstanding_spreads_concurrent_streams(servers):
    a, b_ = servers
    for s in servers:
        s.fake.chunk_delay_s = 0.05
    async with backend(a.url, b_.url) as b:
        results = await asyncio.gather(*(run(b) for _ in range(6)))
        assert all(text_of(r) == TEXT for r in results)
        assert [len(s.fake.requests) for s in servers] == [3, 3]
        assert [s.fake.max_in_flight for s in servers] == [3, 3]
        assert [u.in_flight for u in b.router.upstreams] == [0, 0]
        assert [u.served for u in b.router.upstreams] == [3, 3]


async def test_closing_the_iterator_closes_the_upstream_connection(servers):
    srv = servers[0]
    srv.fake.script, srv.fake.chunk_delay_s = tuple(f" w{i}" for i in range(200)), 0.02  # 4 s unless aborted
    async with backend(srv.url) as b:
        stream = b.generate(GenerationRequest("cmpl-t", PROMPT, SamplingParams(max_tokens=200)))
        seen = [await stream.__anext__() for _ in range(3)]
        await stream.aclose()
        assert [e.text for e in seen] == [" w0", " w1", " w2"]
        assert b.router.upstreams[0].in_flight == 0
        await async_wait_until(lambda: srv.fake.disconnects == [0], "the upstream saw the connection close")
        assert srv.fake.completed == []
