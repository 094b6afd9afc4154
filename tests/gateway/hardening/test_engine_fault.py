"""Hardening, engine fault: an exception inside one model step (injected into the real
SmolLM2 forward) fails exactly that step's requests with a ``Failed``/SSE error event,
frees their KV slots, and the engine keeps serving queued and new requests — through
``runtime.engine.async_engine.AsyncEngine`` and through HTTP (SSE error event, then [DONE])."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from runtime.engine.async_engine import AsyncEngine
from runtime.config import EngineConfig
from runtime.interface import Failed, Finished, FinishReason, GenerationRequest, SamplingParams, TextDelta
from tests.support.polling import async_wait_until

pytestmark = pytest.mark.model


class FaultyModel:
    """Delegates to the real model; ``arm(n)`` makes the n-th next forward raise once."""

    def __init__(self, model):
        self._model = model
        self._countdown: int | None = None
        self.faults = 0
        self.lock = threading.Lock()

    def arm(self, after: int = 0) -> None:
        with self.lock:
            self._countdown = after

    def forward(self, *args, **kwargs):
        with self.lock:
            if self._countdown is not None:
                if self._countdown == 0:
                    self._countdown = None
                    self.faults += 1
                    raise RuntimeError("injected fault: CUDA error: an illegal memory access was encountered")
                self._countdown -= 1
        return self._model.forward(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def make_backend(target_fp32, tokenizer, batch: int = 2) -> tuple[AsyncEngine, dict]:
    from runtime.engine.llm_engine import LLMEngine

    holder: dict = {}

    def factory(cfg, emit):
        engine = LLMEngine(cfg, emit, model=target_fp32, tokenizer=tokenizer)
        engine.model = holder["model"] = FaultyModel(engine.model)
        return engine

    cfg = EngineConfig(dtype="float32", max_batch_size=batch, max_context=256, spec_method="none")
    return AsyncEngine(cfg, engine_factory=factory), holder


def req(rid: str, tokenizer, n: int) -> GenerationRequest:
    ids = tokenizer.encode("Tell me a long story about a dragon.", add_special_tokens=False)
    return GenerationRequest(rid, ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))


async def run(engine: AsyncEngine, r: GenerationRequest, deltas: dict) -> object:
    deltas[r.request_id] = 0
    async for ev in engine.generate(r):
        if isinstance(ev, TextDelta):
            deltas[r.request_id] += ev.num_tokens
        else:
            return ev
    return None


async def test_async_engine_step_fault_fails_only_that_step_and_keeps_serving(target_fp32, tokenizer):
    engine, holder = make_backend(target_fp32, tokenizer, batch=2)
    await engine.start()
    try:
        model, deltas = holder["model"], {}
        # two running (batch = 2 slots) + one queued
        tasks = {rid: asyncio.create_task(run(engine, req(rid, tokenizer, n), deltas))
                 for rid, n in (("r1", 60), ("r2", 60), ("r3", 8))}
        await async_wait_until(lambda: deltas.get("r1", 0) >= 3 and deltas.get("r2", 0) >= 3, "3 tokens of r1 and r2")
        assert engine.engine.num_waiting == 1 and engine.engine.num_running == 2
        model.arm(0)  # the next decode forward (r1 + r2) raises
        res = {rid: await asyncio.wait_for(t, 120) for rid, t in tasks.items()}
        assert model.faults == 1
        for rid in ("r1", "r2"):
            assert isinstance(res[rid], Failed) and res[rid].code == "engine_error", res[rid]
            assert "RuntimeError" in res[rid].message and 3 <= deltas[rid] < 60
        assert isinstance(res["r3"], Finished) and res["r3"].finish_reason is FinishReason.LENGTH
        assert deltas["r3"] == 8  # the queued request ran after the fault

        # a fault during a prefill step fails the prefilling request only
        model.arm(0)
        bad = await asyncio.wait_for(run(engine, req("r4", tokenizer, 8), deltas), 60)
        assert isinstance(bad, Failed) and bad.code == "engine_error" and deltas["r4"] == 0
        ok = await asyncio.wait_for(run(engine, req("r5", tokenizer, 8), deltas), 60)
        assert isinstance(ok, Finished) and deltas["r5"] == 8
        e = engine.engine
        assert e.num_running == 0 and e.num_waiting == 0 and not e._by_id
        assert e.cache.num_free == 2 and engine.load().running == 0  # KV slots back
        assert engine.ready()
    finally:
        await engine.stop()


async def test_a_request_the_engine_cannot_start_fails_alone_and_the_engine_thread_survives(target_fp32, tokenizer):
    """An exception in ``add_request`` (e.g. a seed no generator takes) used to end the engine
    thread: every later request got 503 until a restart. Now that request fails with
    ``engine_error`` and the next one is served. Any integer seed is reduced mod 2^64."""
    engine, _ = make_backend(target_fp32, tokenizer)
    await engine.start()
    try:
        real_add = engine.engine.add_request

        def add_request(r):
            if r.request_id == "boom":
                raise ValueError("Overflow when unpacking long long")
            real_add(r)

        engine.engine.add_request = add_request
        deltas: dict = {}
        bad = await asyncio.wait_for(run(engine, req("boom", tokenizer, 4), deltas), 60)
        assert isinstance(bad, Failed) and bad.code == "engine_error" and "ValueError" in bad.message
        ok = await asyncio.wait_for(run(engine, req("next", tokenizer, 4), deltas), 60)
        assert isinstance(ok, Finished) and deltas["next"] == 4 and engine.ready()
        for seed in (2**64 + 5, -(2**63) - 7):  # out of torch's range before the reduction
            r = req(f"seed{seed}", tokenizer, 3)
            r = GenerationRequest(r.request_id, r.prompt_token_ids, SamplingParams(temperature=1.0, max_tokens=3, seed=seed))
            res = await asyncio.wait_for(run(engine, r, deltas), 60)
            assert isinstance(res, Finished) and deltas[r.request_id] >= 1
    finally:
        await engine.stop()


def test_http_sse_error_event_then_done_and_next_request_ok(target_fp32, tokenizer, tmp_path, migrated_template):
    import shutil

    from gateway.crud.keys import issue_key
    from gateway.main import create_app
    from tests.support.gateway_fixtures import make_settings, sqlite_url
    from tests.support.hardening_util import serve_in_thread

    shutil.copy(migrated_template, tmp_path / "db.sqlite")
    url = sqlite_url(tmp_path / "db.sqlite")
    key = asyncio.run(issue_key(url, "fault-tenant", "u"))
    engine, holder = make_backend(target_fp32, tokenizer, batch=2)
    app = create_app(make_settings(url, admin_token="adm-fault-test"), engine)
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Tell me a story."}],
            "stream": True, "max_tokens": 60, "temperature": 0}
    with serve_in_thread(app) as base:
        events = []
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=auth, timeout=120) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if not line:
                    continue
                payload = line.removeprefix("data: ")
                events.append(payload if payload == "[DONE]" else json.loads(payload))
                if len(events) == 3:  # role chunk + 2 content chunks: fault the next step
                    holder["model"].arm(0)
        assert events[-1] == "[DONE]"
        err = events[-2]
        assert set(err) == {"error"} and err["error"]["type"] == "server_error"
        assert err["error"]["code"] == "engine_error"
        assert sum(1 for e in events if isinstance(e, dict) and "choices" in e) >= 3
        r = httpx.post(base + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 5},
                       headers=auth, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        load = httpx.get(base + "/admin/v1/engine", headers={"Authorization": "Bearer adm-fault-test"}).json()
        assert load["running"] == 0, load
    assert engine.engine.cache.num_free == 2
