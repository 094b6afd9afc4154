"""One request's state inside the engine (nano-vllm's ``sequence.py``)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from runtime.interface import GenerationRequest, RequestTimings, SpecStats


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued, no KV slot yet
    PREFILL = "prefill"  # has a slot, prompt partly in the KV cache
    DECODE = "decode"  # prompt cached, one pending (anchor) token
    FINISHED = "finished"


@dataclass
class SequenceState:
    """Token state of one request.

    ``token_ids`` = prompt + generated tokens. ``num_cached`` tokens are in the
    target KV cache (equals ``cache.lengths[slot]``); during decode exactly one
    token, the *anchor* (last sampled token), is pending: ``token_ids[num_cached:]``.

    Attributes:
        max_tokens: completion-token cap (already clamped to the context).
        generator: per-request ``torch.Generator`` (seeded when the request has a seed),
            so sampling is reproducible whatever else is in the batch.
        deadline: time on the engine's clock (``LLMEngine.clock``, by default
            ``time.monotonic()``) after which the request fails with ``timeout``.
        grammar: the request's :class:`runtime.engine.grammar.RequestGrammar` (its
            ``response_format``), ``None`` for free text.
        processors: its :class:`runtime.engine.logits_processors.RequestProcessors`
            (penalties, ``logit_bias``, ``min_tokens``), ``None`` when it uses none.
        mask_s: seconds spent computing and applying its grammar masks so far
            (``time.perf_counter``; ``LLMEngine._masked``), 0 without a grammar.
    """

    request: GenerationRequest
    max_tokens: int
    generator: torch.Generator
    deadline: float
    detok: object  # runtime.engine.detokenizer.Detokenizer
    token_ids: list[int] = field(default_factory=list)
    num_prompt: int = 0
    num_cached: int = 0
    num_prompt_cached: int = 0  # prompt tokens restored from the prefix cache on admission
    num_completion: int = 0  # tokens kept (emitted) so far
    slot: int = -1
    status: SeqStatus = SeqStatus.WAITING
    aborted: bool = False
    timings: RequestTimings = field(default_factory=RequestTimings)
    spec: SpecStats = field(default_factory=SpecStats)
    grammar: object | None = None
    processors: object | None = None
    mask_s: float = 0.0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        """Completion tokens sampled so far (= the output position of the next one)."""
        return len(self.token_ids) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        """The completion tokens generated so far."""
        return self.token_ids[self.num_prompt :]

    @property
    def prompt_remaining(self) -> int:
        return self.num_prompt - self.num_cached

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    def measured_tokens_per_s(self, now: float | None = None) -> float | None:
        """Live decode tok/s so far (same definition as the final one)."""
        t = self.timings
        if self.num_completion < 2 or t.first_token is None:
            return None
        end = now if now is not None else time.monotonic()
        return (self.num_completion - 1) / max(end - t.first_token, 1e-6)
