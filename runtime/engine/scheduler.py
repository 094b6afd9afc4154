"""Continuous-batching scheduler: who runs in the next engine step.

Requests join and leave between steps. Each step is one ragged target forward
holding (a) every decoding sequence's pending anchor token (plus its draft tokens
under speculative decoding) and (b) prefill chunks of sequences still reading
their prompt, up to a token budget. Decodes go first so running streams keep
flowing while a long prompt is prefilled chunk by chunk.

With a :class:`runtime.engine.prefix_cache.PrefixCache` attached (:attr:`BatchScheduler.prefix_cache`),
admission first restores the longest cached prefix of the prompt into the new slot
(prefill then starts after it), and a sequence's full blocks are stored when its
prompt is prefilled (:meth:`BatchScheduler.cache_prefix`) and when it leaves.

(The DSpark *verification-budget* scheduler, paper Alg. 1, is a different thing:
``runtime/speculation/budget.py`` decides how many draft tokens each decode
sequence verifies inside (a).)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from runtime.engine.kv_cache import KVCache
from runtime.engine.prefix_cache import PrefixCache
from runtime.engine.sequence import SeqStatus, SequenceState


@dataclass
class StepPlan:
    """What one engine step runs.

    Attributes:
        decode: sequences in DECODE, each contributing its anchor (+ drafts).
        prefill: ``(seq, num_tokens)`` prompt chunks to append to the KV cache.
    """

    decode: list[SequenceState] = field(default_factory=list)
    prefill: list[tuple[SequenceState, int]] = field(default_factory=list)

    def empty(self) -> bool:
        return not self.decode and not self.prefill


class BatchScheduler:
    """FCFS admission into KV slots + a per-step token budget.

    Args:
        cache: the target KV cache (its slots bound the running batch).
        max_step_tokens: max tokens in one forward (decode + prefill).
        prefill_chunk_tokens: max prompt tokens of one sequence per step.
        decode_tokens_per_seq: tokens a decoding sequence may need (1 + γ when
            speculating) — reserved in the budget before prefill chunks.
        prefix_cache: automatic prefix caching over ``cache`` (and the drafter's
            context cache); ``None`` → off.
    """

    def __init__(
        self, cache: KVCache, max_step_tokens: int, prefill_chunk_tokens: int, prefix_cache: PrefixCache | None = None
    ) -> None:
        self.cache = cache
        self.max_step_tokens = max_step_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.prefix_cache = prefix_cache
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add(self, seq: SequenceState) -> None:
        self.waiting.append(seq)

    def remove(self, seq: SequenceState) -> None:
        """Drop a sequence (finished/aborted/failed) and free its KV slot
        (its valid full blocks go to the prefix cache first)."""
        if seq.slot >= 0:
            self.cache_prefix(seq)
            self.cache.free(seq.slot)
            seq.slot = -1
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def schedule(self, decode_tokens_per_seq: int = 1) -> StepPlan:
        # Admit waiting requests while slots are free.
        while self.waiting and self.cache.num_free > 0:
            seq = self.waiting.popleft()
            seq.slot = self.cache.allocate()
            if self.prefix_cache is not None:
                seq.num_cached = self.prefix_cache.restore(seq.slot, seq.token_ids[: seq.num_prompt],
                                                           seq.request.cache_salt)
                seq.num_prompt_cached = seq.num_cached
            seq.status = SeqStatus.PREFILL
            self.running.append(seq)
        plan = StepPlan()
        budget = self.max_step_tokens
        for seq in self.running:
            if seq.status is SeqStatus.DECODE:
                plan.decode.append(seq)
                budget -= decode_tokens_per_seq
        for seq in self.running:
            if seq.status is SeqStatus.PREFILL and budget > 0:
                n = min(seq.prompt_remaining, self.prefill_chunk_tokens, budget)
                if n > 0:
                    plan.prefill.append((seq, n))
                    budget -= n
        return plan

    def cache_prefix(self, seq: SequenceState) -> None:
        """Store ``seq``'s full blocks (prompt, and completion so far) in the prefix cache."""
        if self.prefix_cache is not None and seq.slot >= 0:
            self.prefix_cache.insert(seq.slot, seq.token_ids, seq.request.cache_salt)
