"""A deterministic fake :class:`runtime.interface.Backend` for gateway tests.

Tokenizer: whitespace split; each word gets a stable id from a growing vocabulary.
Chat template: ``<|im_start|> ROLE <words> <|im_end|>`` per message, then
``<|im_start|> assistant`` (so a message costs ``len(words) + 3`` tokens, plus 2).
Generation: emits the words of ``script`` (first word bare, later ones with a
leading space), ``tokens_per_delta`` words per :class:`TextDelta`, then ``stop``; or
``length`` once ``max_tokens`` tokens were emitted (with ``ignore_eos`` the script
repeats until ``max_tokens``). Knobs make it fail mid-stream, refuse with a full
queue, or go slowly; it records every request and every abort (iterator closed
before its terminal event).

Token ids of the generated text: each emitted piece (``"Hello"``, ``" there,"``, …)
is one token of the same growing vocabulary, so ``token_bytes`` gives the piece back.
With ``sampling.logprobs`` set, the j-th completion token gets logprob ``-0.25·(j % 4)
- 0.125`` and its alternatives are the next script words, each 1.0 lower (see
:meth:`FakeBackend.fake_logprob`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Sequence

from runtime.interface import (
    BackendInfo,
    Event,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    LoadSnapshot,
    QueueFullError,
    RequestTimings,
    SpecInfo,
    SpecStats,
    TextDelta,
    TokenLogprob,
)

DEFAULT_SCRIPT = ("Hello", "there,", "I", "am", "a", "fake", "model.")


@dataclass
class FakeBackend:
    model_name: str = "SmolLM2-135M-Instruct"
    max_context: int = 64
    script: Sequence[str] = DEFAULT_SCRIPT
    tokens_per_delta: int = 1
    fail_after_deltas: int | None = None  # yield Failed after this many deltas
    queue_full: bool = False
    raise_lazily: bool = False  # raise QueueFullError on the first __anext__, not in generate()
    retry_after_s: float = 2.5
    first_event_delay_s: float = 0.0
    token_delay_s: float = 0.0
    ready_on_start: bool = True
    start_error: Exception | None = None
    gate: asyncio.Event | None = None  # set: generations start only once the test sets it (holding their slot)
    vocab_size: int | None = 1000  # BackendInfo.vocab_size: logit_bias / stop_token_ids ids must be below it
    supports_response_format: bool = False  # True: JSON formats reach it (recorded, not enforced)

    requests: list[GenerationRequest] = field(default_factory=list)
    templated: list[list[dict]] = field(default_factory=list)  # messages given to apply_chat_template
    aborted: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    started: bool = False
    stopped: bool = False
    _ready: bool = False
    _vocab: dict[str, int] = field(default_factory=dict)
    _running: int = 0

    # ---------------------------------------------------------------- Backend protocol
    @property
    def info(self) -> BackendInfo:
        return BackendInfo(model_name=self.model_name, max_context=self.max_context, eos_token_id=0,
                           vocab_size=self.vocab_size, supports_response_format=self.supports_response_format)

    def ready(self) -> bool:
        return self._ready

    async def start(self) -> None:
        self.started = True
        if self.start_error is not None:
            raise self.start_error
        self._ready = self.ready_on_start

    async def stop(self) -> None:
        self.stopped = True
        self._ready = False

    def set_ready(self, ready: bool) -> None:
        self._ready = ready

    def encode(self, text: str) -> list[int]:
        return [self._vocab.setdefault(w, len(self._vocab) + 1) for w in text.split()]

    def apply_chat_template(self, messages: Sequence[dict]) -> list[int]:
        self.templated.append([dict(m) for m in messages])
        words: list[str] = []
        for m in messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError("each message needs a string role and content")
            words += ["<|im_start|>", m["role"], *m["content"].split(), "<|im_end|>"]
        words += ["<|im_start|>", "assistant"]
        return self.encode(" ".join(words))

    def token_bytes(self, token_ids: Sequence[int]) -> list[bytes]:
        by_id = {i: w for w, i in self._vocab.items()}
        return [by_id.get(int(t), f"<{t}>").encode() for t in token_ids]

    def generate(self, request: GenerationRequest) -> AsyncIterator[Event]:
        self.requests.append(request)
        if self.queue_full and not self.raise_lazily:
            raise QueueFullError("engine queue is full", retry_after_s=self.retry_after_s)
        return self._run(request)

    def load(self) -> LoadSnapshot:
        return LoadSnapshot(running=self._running, waiting=0, max_batch=16, forward_steps=0)

    def spec_info(self) -> SpecInfo:
        return SpecInfo(method="none")

    # ---------------------------------------------------------------- helpers
    def word(self, i: int) -> str:
        return self.script[i % len(self.script)]

    def expected_text(self, n_tokens: int) -> str:
        return " ".join(self.word(i) for i in range(n_tokens))

    def piece(self, i: int) -> str:
        """Text of completion token i: the script word, with a leading space after the first."""
        return self.word(i) if i == 0 else " " + self.word(i)

    def piece_id(self, i: int) -> int:
        return self._vocab.setdefault(self.piece(i), len(self._vocab) + 1)

    def fake_logprob(self, i: int, num_top: int) -> TokenLogprob:
        """Completion token i's deterministic fake logprob and ``num_top`` alternatives
        (token i itself first, then the next script pieces, sorted)."""
        lp = -0.25 * (i % 4) - 0.125
        top = [(self.piece_id(i + j), lp - 1.0 * j) for j in range(num_top)]
        return TokenLogprob(self.piece_id(i), lp, top)

    async def _run(self, req: GenerationRequest) -> AsyncIterator[Event]:
        if self.queue_full:
            raise QueueFullError("engine queue is full", retry_after_s=self.retry_after_s)
        if self.gate is not None:
            await self.gate.wait()
        timings = RequestTimings(wall_queued=time.time(), queued=time.monotonic())
        limit = req.sampling.max_tokens if req.sampling.max_tokens is not None else self.max_context
        if req.sampling.ignore_eos:
            total, reason = limit, FinishReason.LENGTH
        else:  # EOS follows the script; max_tokens wins if it comes first
            total = min(limit, len(self.script))
            reason = FinishReason.STOP if len(self.script) < limit else FinishReason.LENGTH
        self._running += 1
        done = False
        try:
            await asyncio.sleep(self.first_event_delay_s)
            timings.started = time.monotonic()
            emitted, deltas = 0, 0
            while emitted < total:
                if self.fail_after_deltas is not None and deltas >= self.fail_after_deltas:
                    done = True
                    yield Failed("fake engine exploded", code="engine_error", completion_tokens=emitted)
                    return
                k = min(self.tokens_per_delta, total - emitted)
                text = "".join(self.piece(emitted + j) for j in range(k))
                ids = [self.piece_id(emitted + j) for j in range(k)]
                n_top = req.sampling.logprobs
                lps = None if n_top is None else [self.fake_logprob(emitted + j, n_top) for j in range(k)]
                now = time.monotonic()
                timings.first_token = timings.first_token or now
                timings.last_token = now
                emitted += k
                deltas += 1
                yield TextDelta(text=text, num_tokens=k, token_ids=ids, logprobs=lps)
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
            timings.finished = time.monotonic()
            spec = None
            if req.return_spec_stats:
                rounds = max(1, (emitted + 2) // 3)
                spec = SpecStats(rounds=rounds, drafted=rounds * 4, verified=rounds * 4,
                                 accepted=emitted - rounds, emitted=emitted, accepted_per_position=[rounds, 1])
            done = True
            self.completed.append(req.request_id)
            yield Finished(reason, len(req.prompt_token_ids), emitted, timings, spec)
        finally:
            self._running -= 1
            if not done:
                self.aborted.append(req.request_id)
