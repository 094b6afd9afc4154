"""asyncio front of the engine: implements :class:`runtime.interface.Backend`.

The engine runs in one worker thread (``LLMEngine.step`` in a loop); the HTTP
event loop only enqueues commands (add/abort) and awaits per-request
``asyncio.Queue`` s that the engine thread fills via ``call_soon_threadsafe``.
PyTorch releases the GIL inside its kernels, so streaming stays responsive.
Because the engine lives in the gateway process, metrics are exported from it.

A request with a ``response_format`` (JSON or tool calls) has its grammar compiled here, before it is queued,
on the grammar cache's compile pool (:meth:`runtime.engine.grammar.GrammarCache.compile_async`:
cached by schema hash, size and time limits): never on the engine thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import AsyncIterator

from runtime.config import EngineConfig
from runtime.engine.detokenizer import GatewayTokenization
from runtime.interface import (
    BackendInfo,
    Event,
    Failed,
    Finished,
    GenerationRequest,
    LoadSnapshot,
    QueueFullError,
    SpecInfo,
)

log = logging.getLogger(__name__)


class AsyncEngine(GatewayTokenization):
    """The embedded backend. ``await start()`` loads the model (in a thread)."""

    def __init__(self, config: EngineConfig, engine_factory=None) -> None:
        self.config = config
        self._engine_factory = engine_factory
        self.engine = None
        self._inbox: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._pending_adds = 0
        self._tokenizer = None  # gateway-side tokenizer (separate from the engine's)

    # -- lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        from runtime.engine.llm_engine import LLMEngine, load_tokenizer
        from runtime.models.loader import ensure_converted

        self._loop = asyncio.get_running_loop()
        factory = self._engine_factory or (lambda cfg, emit: LLMEngine(cfg, emit))
        self.engine = await asyncio.to_thread(factory, self.config, self._emit)
        self._tokenizer = await asyncio.to_thread(load_tokenizer, ensure_converted())
        self._thread = threading.Thread(target=self._run_loop, name="sparkgate-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopping = True
        if self.engine is not None and getattr(self.engine, "grammars", None) is not None:
            self.engine.grammars.close()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)

    def ready(self) -> bool:
        return self.engine is not None and self._thread is not None and self._thread.is_alive()

    @property
    def info(self) -> BackendInfo:
        if self.engine is None:
            from runtime.models.loader import MODEL_NAME

            return BackendInfo(MODEL_NAME, self.config.max_context, 2, supports_response_format=True)
        cfg = getattr(getattr(self.engine, "model", None), "cfg", None)
        return BackendInfo(self.engine.model_name, self.config.max_context, self.engine.eos_token_id,
                           supports_response_format=True, chat_template_tools=self.chat_template_tools,
                           vocab_size=getattr(cfg, "vocab_size", None))

    # -- streaming --------------------------------------------------------------
    def load(self) -> LoadSnapshot:
        e = self.engine
        if e is None:
            return LoadSnapshot(0, 0, self.config.max_batch_size, 0)
        pc = getattr(e, "prefix_cache", None)
        return LoadSnapshot(e.num_running, e.num_waiting + self._pending_adds, self.config.max_batch_size,
                            e.forward_steps, e.decode_steps, e.verify_tokens,
                            pc.queries if pc is not None else 0, pc.hits if pc is not None else 0,
                            e.spec_steps, e.gated_steps, e.decode_rows, e.zero_budget_rows, e.decode_tokens,
                            spec.learned.labelled() if (spec := getattr(e, "speculator", None)) is not None else [])

    def spec_info(self) -> SpecInfo:
        spec = self.engine.speculator if self.engine is not None else None
        if spec is None:
            return SpecInfo(method="none")
        return SpecInfo(spec.method, spec.policy, spec.gamma, spec.sps_table.to_dict())

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Event]:
        if self.engine is None:
            raise RuntimeError("engine not started")
        if self.engine.num_waiting + self._pending_adds >= self.config.max_waiting:
            raise QueueFullError(retry_after_s=1.0)
        grammar = None
        if request.response_format is not None:  # raises GrammarError (→ 400) before anything is queued
            grammar = await self.engine.grammars.compile_async(request.response_format, request.tenant)
        rid = request.request_id
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = q
        self._pending_adds += 1
        self._inbox.put(("add", (request, grammar)))
        self._wake.set()
        done = False
        try:
            while True:
                event = await q.get()
                if isinstance(event, (Finished, Failed)):
                    done = True
                yield event
                if done:
                    return
        finally:
            if not done:
                self._inbox.put(("abort", rid))
                self._wake.set()
            self._queues.pop(rid, None)

    # -- engine thread ----------------------------------------------------------
    def _emit(self, request_id: str, event: Event) -> None:
        q = self._queues.get(request_id)
        if q is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(q.put_nowait, event)

    def _drain_inbox(self) -> None:
        while True:
            try:
                cmd, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                if cmd == "add":
                    self._pending_adds -= 1
                    arg, grammar = arg
                    if arg.request_id in self._queues:  # not already abandoned by the client
                        self.engine.add_request(arg, grammar) if grammar is not None else self.engine.add_request(arg)
                elif cmd == "abort":
                    self.engine.abort(arg)
            except Exception as exc:  # noqa: BLE001 — one bad request must not stop the engine thread
                log.exception("engine refused a %s command", cmd)
                if cmd == "add":
                    self._emit(arg.request_id, Failed(f"the engine could not start the request: {type(exc).__name__}",
                                                      "engine_error"))

    def _run_loop(self) -> None:
        while not self._stopping:
            self._drain_inbox()
            if not self.engine.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                self.engine.step()
            except Exception:  # noqa: BLE001 — the loop must survive; step() already isolates failures
                log.exception("engine loop error")
