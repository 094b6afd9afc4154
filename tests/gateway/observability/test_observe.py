"""Every submitted request reaches each observer exactly once, whatever its end."""

from __future__ import annotations

import asyncio

from tests.support.gateway_fixtures import chat


class Recorder:
    def __init__(self):
        self.outcomes = []

    def request_ended(self, outcome):
        self.outcomes.append(outcome)


async def test_finished_failed_rejected_cancelled_each_once(app, client, auth, backend):
    rec = Recorder()
    app.state.observers.append(rec)
    # finished (non-stream and stream)
    r = await client.post("/v1/chat/completions", json=chat(), headers=auth)
    assert r.status_code == 200
    r = await client.post("/v1/chat/completions", json=chat(stream=True), headers=auth)
    assert r.status_code == 200
    # failed mid-stream
    backend.fail_after_deltas = 2
    r = await client.post("/v1/chat/completions", json=chat(stream=True), headers=auth)
    backend.fail_after_deltas = None
    # rejected: queue full
    backend.queue_full = True
    r = await client.post("/v1/chat/completions", json=chat(), headers=auth)
    assert r.status_code == 503
    backend.queue_full = False
    backend.queue_full = backend.raise_lazily = True  # the embedded engine raises on the first __anext__()
    r = await client.post("/v1/chat/completions", json=chat(stream=True), headers=auth)
    assert r.status_code == 503
    backend.queue_full = False
    statuses = [o.status for o in rec.outcomes]
    assert statuses == ["finished", "finished", "failed", "rejected", "rejected"]
    assert len({o.ctx.request_id for o in rec.outcomes}) == 5
    fin = rec.outcomes[0]
    assert fin.finish_reason == "stop" and fin.completion_tokens == 7 and fin.ctx.tenant
    assert fin.ctx.endpoint == "chat" and fin.ctx.prompt_tokens > 0
    assert rec.outcomes[2].error_code and rec.outcomes[2].completion_tokens == 2
    # the built-in rolling stats observer saw only the finished ones
    assert app.state.stats.window(60).requests == 2


async def test_closing_the_stream_early_reports_cancelled_once():
    from gateway.observability.observe import RequestContext, observed
    from runtime.interface import TextDelta

    closed = []

    async def events():
        try:
            for i in range(100):
                yield TextDelta(f"w{i} ", 1, [i])
                await asyncio.sleep(0)
        finally:
            closed.append(True)

    rec = Recorder()
    ctx = RequestContext("r1", "chat", "m", True, prompt_tokens=5, max_tokens=100, tenant="t")
    it = observed(events(), ctx, [rec])
    got = [await it.__anext__() for _ in range(3)]
    await it.aclose()
    assert [o.status for o in rec.outcomes] == ["cancelled"] and closed == [True]
    assert rec.outcomes[0].completion_tokens == 3 and len(got) == 3
