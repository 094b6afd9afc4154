"""The embedded engine: ``schedule() → run one ragged forward → postprocess()``.

Synchronous and single-threaded on purpose (nano-vllm style); the asyncio side
lives in :mod:`runtime.engine.async_engine`, which runs :meth:`LLMEngine.step` in a
worker thread so the HTTP event loop never blocks.

One step = ONE target forward (counted in :attr:`LLMEngine.forward_steps`) over
every decoding sequence's anchor token (plus verified draft tokens when
speculating) and the prefill chunks the batch scheduler picked. With a speculator,
``dspark`` and ``hybrid`` decide before drafting, per request, whether a draft pays (the
verification budget's ℓ = 0 case, ``Speculator._worth_drafting``); for ``parallel`` and
``prompt_lookup`` the speculation gate (:mod:`runtime.speculation.gate`,
``EngineConfig.spec_gate``) decides per step whether to speculate or decode plainly (every ℓ_r = 0).

Logprobs (requests with ``SamplingParams.logprobs`` set) come from the same
forward: the raw target logits of the row that produced each emitted token
(:mod:`runtime.engine.logprobs`), one batched ``log_softmax`` over just those rows.

Constrained requests (``GenerationRequest.response_format``) carry a grammar matcher
(:mod:`runtime.engine.grammar`): each step their rows' logits are masked (−inf outside the
grammar) before sampling and verification, the same way in both (drafts verified against
the masked target), and the matcher advances over the tokens emitted. The time spent filling
and applying those masks is summed per request (``Finished.grammar_mask_s``) and for the
engine (:attr:`LLMEngine.grammar_mask_s`, beside ``grammar_advance_s``: the matchers
accepting emitted tokens; ``bench/grammar_cost.py`` reads both).

Requests with penalties, ``logit_bias`` or ``min_tokens`` carry their logits processors
(:mod:`runtime.engine.logits_processors`): after the grammar mask, their rows are processed
the same way in plain decoding and in verification — row k of a verified request as if its
drafts x_1..x_k had been generated — so verification stays lossless. Steps without such
requests never touch them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Callable

import torch

from runtime.config import EngineConfig, resolve_dtype, resolve_spec_method
from runtime.engine.detokenizer import Detokenizer
from runtime.engine.grammar import BitmaskBuffer, GrammarCache, RequestGrammar, mask_logits
from runtime.engine.logits_processors import RequestProcessors, apply_processors, check_params
from runtime.engine.logprobs import token_logprobs
from runtime.engine.prefix_cache import engine_prefix_cache
from runtime.engine.sampler import SamplingBatch, request_generator
from runtime.engine.scheduler import BatchScheduler, StepPlan
from runtime.engine.sequence import SeqStatus, SequenceState
from runtime.interface import (
    MAX_TOP_LOGPROBS,
    Event,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    GrammarError,
    TextDelta,
    TokenLogprob,
    clamp_max_tokens,
)
from runtime.kernels.cpu import gguf_cpu
from runtime.models.gguf_weights import use_kernel_threads
from runtime.models.llama import LlamaModel, SeqSpan, load_llama
from runtime.models.loader import MODEL_NAME, ensure_converted
from runtime.speculation import sps_profiler
from runtime.speculation.gate import SpecGate
from runtime.speculation.speculator import Speculator
from runtime.speculation.verifier import spec_round

log = logging.getLogger(__name__)

#: ``EngineConfig.dtype`` → what the target loads as; its keys are ``runtime.config.DTYPE_NAMES``
#: (kept equal by tests/runtime/test_config.py)
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "int8": torch.int8,  # opt-in weight-only int8 linears over fp32 activations (runtime.models.quant)
          "gguf": "gguf",  # the GGUF's own Q4_1/Q8_0 blocks over bf16 activations (runtime.models.gguf_weights)
          "gguf-a8": "gguf-a8"}  # opt-in: the same with int8 activations in the Q4_1 projections (W4A8)

EmitFn = Callable[[str, Event], None]


def load_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def check_positions(config: EngineConfig, model: LlamaModel, lookahead: int) -> None:
    """Raise ``ValueError`` unless ``config.max_context`` is within the model's context
    (``max_position_embeddings``) and every position the engine can write has a rotary row:
    the KV slot's last (``max_context + lookahead − 1``) plus, when speculating, the drafter's
    block of γ past it."""
    if config.max_context > model.cfg.max_position:
        raise ValueError(f"max_context {config.max_context} exceeds the model's context of "
                         f"{model.cfg.max_position} tokens")
    draft = config.num_speculative_tokens if config.spec_method != "none" else 0
    rows = model.rotary.cos.shape[0]
    if config.max_context + lookahead + draft > rows:
        raise ValueError(f"num_speculative_tokens {config.num_speculative_tokens} needs rotary positions up to "
                         f"{config.max_context + lookahead + draft - 1}; the tables have {rows}")


class LLMEngine:
    """Continuous-batching engine over the lean Llama target.

    Args:
        config: engine knobs.
        emit: called (in the engine thread) with ``(request_id, event)`` for every
            :class:`TextDelta` / :class:`Finished` / :class:`Failed`.
        model, tokenizer: injected for tests; loaded from the cache otherwise.
        clock: seconds for request deadlines (``time.monotonic``; tests inject a fake
            one so a deadline does not race a slow forward on a loaded machine).

    Raises:
        ValueError: unknown dtype.
    """

    def __init__(self, config: EngineConfig, emit: EmitFn, model: LlamaModel | None = None, tokenizer=None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if config.dtype == "auto":  # the default: gguf where its kernels run, else bf16 / fp32 by the CPU
            config = dataclasses.replace(config, dtype=resolve_dtype(config.dtype))
            log.info("dtype auto → %s", config.dtype)
        if config.spec_method == "auto":  # the server's default: hybrid where AMX makes verified rows cheap
            method = resolve_spec_method("auto", config.dtype)
            if method != "none" and not gguf_cpu.kernel_available():  # no compiler: dequantised weights, no AMX
                method = "none"
            config = dataclasses.replace(config, spec_method=method)
            log.info("spec_method auto → %s", config.spec_method)
        if config.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {config.dtype!r}; use one of {sorted(DTYPES)} or 'auto'")
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.emit = emit
        self.clock = clock
        model_dir = None
        if model is None or tokenizer is None:
            model_dir = ensure_converted()
        self.model = model if model is not None else load_llama(model_dir, DTYPES[config.dtype])
        use_kernel_threads(self.model, config.num_threads or os.cpu_count() or 1)  # gguf: see its docstring
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
        self.model_name = MODEL_NAME
        self.eos_token_id = self.model.cfg.eos_token_id
        self.lookahead = config.num_speculative_tokens + 1 if config.spec_method != "none" else 1
        check_positions(config, self.model, self.lookahead)
        self.cache = self.model.new_cache(config.max_batch_size, config.max_context + self.lookahead)
        self.scheduler = BatchScheduler(self.cache, config.max_step_tokens, config.prefill_chunk_tokens)
        self.speculator = (
            Speculator(config, self.model, config.max_batch_size, self.cache.max_len) if config.spec_method != "none" else None
        )
        # Automatic prefix caching (runtime/engine/prefix_cache.py); None when disabled.
        self.prefix_cache = self.scheduler.prefix_cache = engine_prefix_cache(config, self.cache, self.speculator)
        if self.speculator is not None:  # explicit or cached SPS table, else the fallback
            self.speculator.sps_table = sps_profiler.initial_sps_table(config, self.model, self.speculator)
            self.speculator.sps_table_greedy = sps_profiler.initial_sps_table(config, self.model, self.speculator, 0.0)
            if config.profile_on_start:  # cached SPS profiles, else profile now (paper §3.2.2)
                sps_profiler.ensure_profiled(config, self.model, self.speculator,
                                             lambda t: sps_profiler.make_round_fn(self.model, self.speculator, self.cache, t))
        # Speculate or decode plainly, per step, by measured speed (runtime/speculation/gate.py).
        # hybrid and dspark decide drafting per request inside their budget (Speculator._worth_drafting): no gate.
        self.gate = (SpecGate() if self.speculator is not None and config.spec_gate and not self.speculator.decides_drafting
                     else None)
        self.forward_steps = 0
        self.decode_steps = 0  # forwards with ≥ 1 decoding sequence (verification rounds)
        self.verify_tokens = 0  # Σ per round of B = Σ_r (1 + ℓ_r): anchors + verified drafts
        self.spec_steps = 0  # decode rounds that drafted (speculator present)
        self.gated_steps = 0  # plain decode rounds (the gate, or hybrid with nothing to verify); + spec_steps = decode_steps
        self.decode_rows = 0  # Σ per round of its decoding requests (request-rounds)
        self.zero_budget_rows = 0  # of those, request-rounds verified with ℓ_r = 0 (no draft token)
        self.decode_tokens = 0  # tokens those rounds produced (accepted + bonus, before stop/EOS cuts)
        self.grammar_mask_s = 0.0  # Σ over steps of the wall time spent filling and applying grammar masks
        self.grammar_advance_s = 0.0  # Σ of the time matchers spent accepting emitted tokens
        self._by_id: dict[str, SequenceState] = {}
        # response formats → compiled grammars (built on first use; compiled off this thread by AsyncEngine)
        self.grammars = GrammarCache(self.tokenizer, self.model.cfg.vocab_size, [self.eos_token_id])
        self._bitmask = BitmaskBuffer(self.model.cfg.vocab_size)  # the constrained rows' masks, reused

    # -- requests -----------------------------------------------------------
    def add_request(self, req: GenerationRequest, grammar=None) -> None:
        """Queue a request; invalid ones fail immediately with a :class:`Failed` event.

        ``grammar``: the compiled grammar of ``req.response_format`` when the caller compiled
        it already (:meth:`GrammarCache.compile_async`); otherwise it is compiled here, in the
        calling thread (an invalid one fails the request with code ``invalid_request``)."""
        n = len(req.prompt_token_ids)
        if n == 0 or n >= self.config.max_context:
            self.emit(req.request_id, Failed(f"prompt has {n} tokens; need 1..{self.config.max_context - 1}", "invalid_prompt"))
            return
        lp = req.sampling.logprobs
        if lp is not None and not 0 <= lp <= MAX_TOP_LOGPROBS:
            self.emit(req.request_id, Failed(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {lp}", "invalid_request"))
            return
        bad = check_params(req.sampling, self.model.cfg.vocab_size)
        if bad is not None:
            self.emit(req.request_id, Failed(bad, "invalid_request"))
            return
        matcher = None
        if req.response_format is not None:
            try:
                matcher = RequestGrammar(grammar if grammar is not None else self.grammars.compile(req.response_format))
            except GrammarError as exc:
                self.emit(req.request_id, Failed(exc.message, "invalid_request"))
                return
        max_tokens = clamp_max_tokens(n, self.config.max_context, req.sampling.max_tokens)
        now = time.monotonic()
        seq = SequenceState(
            request=req,
            max_tokens=max_tokens,
            generator=request_generator(req.sampling),
            deadline=self.clock() + (req.timeout_s or self.config.request_timeout_s),
            detok=Detokenizer(self.tokenizer, req.prompt_token_ids, req.sampling, self.eos_token_id, max_tokens),
            token_ids=list(req.prompt_token_ids),
            num_prompt=n,
            grammar=matcher,
            processors=RequestProcessors.of(req.sampling, req.prompt_token_ids, self.eos_token_id),
        )
        seq.timings.queued = now
        seq.timings.wall_queued = time.time()
        self._by_id[req.request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """Cancel a request (client went away): its slot and KV are freed now."""
        seq = self._by_id.get(request_id)
        if seq is not None:
            self._finish(seq, FinishReason.ABORT)

    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # -- the step -----------------------------------------------------------
    def step(self) -> None:
        """Run one engine step (one target forward). Failures fail only this step's requests."""
        self._expire_timeouts()
        plan = self.scheduler.schedule(decode_tokens_per_seq=self.lookahead)
        if plan.empty():
            return
        try:
            self._run(plan)
        except Exception as exc:  # noqa: BLE001 — isolate the failure to this step's requests
            log.exception("engine step failed")
            for seq in plan.decode + [s for s, _ in plan.prefill]:
                self._fail(seq, f"engine step failed: {type(exc).__name__}", "engine_error")

    def _run(self, plan: StepPlan) -> None:
        """Build ONE ragged forward: decode spans ``[anchor, x_1..x_ℓ]`` then prefill chunks."""
        t0 = time.perf_counter()
        spec = self.speculator
        # Decided before drafting, from past steps only (lossless: runtime/speculation/gate.py).
        speculate = spec is not None and bool(plan.decode) and (self.gate is None or self.gate.speculate(len(plan.decode)))
        sampling = SamplingBatch.of(plan.decode)  # the decode rows' sampling tensors, once (draft + verify)
        # None: nothing drafted (a plain step); hybrid verifies free n-gram drafts even on gated steps.
        proposal = None
        if spec is not None and plan.decode and (speculate or spec.free_drafts):
            proposal = spec.propose(plan.decode, sampling, use_drafter=speculate)
        ids: list[int] = []
        spans: list[SeqSpan] = []
        for i, seq in enumerate(plan.decode):
            drafts = proposal.tokens[i] if proposal is not None else []
            spans.append(SeqSpan(seq.slot, seq.num_cached, 1 + len(drafts)))
            ids.append(seq.last_token)
            ids.extend(drafts)
        num_verify_rows = len(ids)
        prefill_rows: list[int] = []  # last row of chunks that complete a prompt
        prefill_done: list[SequenceState] = []
        for seq, n in plan.prefill:
            if seq.timings.started is None:
                seq.timings.started = time.monotonic()
                if spec is not None:
                    # num_cached > 0: a prefix-cache hit; the others running will decode beside it
                    spec.start_sequence(seq.slot, seq.num_cached, seq, len(self.scheduler.running) - 1)
            spans.append(SeqSpan(seq.slot, seq.num_cached, n))
            ids.extend(seq.token_ids[seq.num_cached : seq.num_cached + n])
            if n == seq.prompt_remaining:
                prefill_rows.append(len(ids) - 1)
                prefill_done.append(seq)
        rows = list(range(num_verify_rows)) + prefill_rows
        taps = spec.tap_layers if spec is not None else ()
        out = self.model.forward(
            torch.tensor(ids), spans, self.cache, torch.tensor(rows, dtype=torch.long) if rows else None, taps
        )
        self.forward_steps += 1
        for span, seq in zip(spans[len(plan.decode) :], [s for s, _ in plan.prefill]):
            seq.num_cached = span.start + span.num_new
        if spec is not None and plan.prefill:
            spec.extend_context(
                out.taps[num_verify_rows:] if out.taps is not None else None,
                [s.slot for s, _ in plan.prefill],
                [n for _, n in plan.prefill],
            )
        for seq in prefill_done:  # its prompt's blocks serve later requests (prefix cache)
            self.scheduler.cache_prefix(seq)
        if plan.decode:
            self.decode_steps += 1
            self.verify_tokens += num_verify_rows
            if spec is not None:
                if proposal is not None:
                    self.spec_steps += 1
                else:
                    self.gated_steps += 1
            produced = self._verify(plan.decode, proposal, out, num_verify_rows, sampling)
            self.decode_rows += len(plan.decode)
            self.zero_budget_rows += (len(plan.decode) if proposal is None
                                      else sum(1 for ell in proposal.lengths if ell == 0))
            self.decode_tokens += produced
            if not plan.prefill:  # prefill chunks would blur the step's cost
                seconds = time.perf_counter() - t0
                if self.gate is not None:
                    self.gate.record(len(plan.decode), speculate, seconds, produced)
                if spec is not None:
                    spec.record_round(sampling, len(plan.decode), num_verify_rows, seconds)
        if prefill_done:
            logits = out.logits[num_verify_rows:]
            tokens = SamplingBatch.of(prefill_done).draw(self._processed(logits, prefill_done, None)).tolist()
            lps = self._logprobs(logits, prefill_done, [[t] for t in tokens], [[i] for i in range(len(tokens))])
            for seq, tok, lp in zip(prefill_done, tokens, lps):
                seq.status = SeqStatus.DECODE
                if self._advance_grammar(seq, [tok]):
                    self._append_tokens(seq, [tok], logprobs=lp)

    def _masked(self, logits: torch.Tensor, seqs: list[SequenceState], drafts: list[list[int]] | None,
                inplace: bool = False) -> torch.Tensor:
        """``logits`` with each constrained sequence's rows masked by its grammar (−inf where
        forbidden): one row per sequence (``drafts`` ``None``), or its ``1 + ℓ`` verification
        rows, row k masked for the prefix ``drafts[i][:k]``. The logits themselves when no
        sequence is constrained (logprobs keep reading the raw ones); with ``inplace`` (no
        one reads the raw logits afterwards) masked in place, else a fp32 copy.

        The bitmask is the engine's (reused every step), and only the rows whose mask forbids
        something are applied, with xgrammar's CPU kernel: a step costs the fills plus one pass
        over those rows (no allocation, no copy of ``[rows, V]`` unless ``inplace`` is off)."""
        if all(s.grammar is None for s in seqs):
            return logits
        t0 = time.perf_counter()
        bitmask = self._bitmask.rows(logits.shape[0])
        rows: list[int] = []
        masked: list[tuple[SequenceState, int]] = []
        row = 0
        for i, seq in enumerate(seqs):
            n = 1 + (len(drafts[i]) if drafts is not None else 0)
            if seq.grammar is not None:
                t = time.perf_counter()
                rows.extend(seq.grammar.fill_verification(drafts[i] if drafts is not None else (), bitmask, row))
                seq.mask_s += time.perf_counter() - t
                masked.append((seq, n))
            row += n
        t = time.perf_counter()
        out = mask_logits(logits, bitmask, rows, inplace)
        shared = time.perf_counter() - t  # the apply: shared by row count
        total = sum(n for _, n in masked)
        for seq, n in masked:
            seq.mask_s += shared * n / total
        self.grammar_mask_s += time.perf_counter() - t0
        return out

    def _processed(self, logits: torch.Tensor, seqs: list[SequenceState], drafts: list[list[int]] | None) -> torch.Tensor:
        """:meth:`_masked`, then each sequence's logits processors on its rows (row k of a
        verified sequence as if ``drafts[i][:k]`` had been generated). The logits themselves
        when no sequence is constrained or processed.

        ``logits`` is a slice of this step's forward output; after this only :meth:`_logprobs`
        reads it (the rows of sequences that asked for logprobs), so without such a sequence
        the grammar mask is written into it (through numpy) instead of a ``[rows, V]`` copy."""
        own = logits.dtype == torch.float32 and all(s.request.sampling.logprobs is None for s in seqs)
        masked = self._masked(logits, seqs, drafts, inplace=own)
        if all(s.processors is None for s in seqs):
            return masked
        # the forward's logits are inference tensors (no torch in-place op on them): processors copy
        return apply_processors(masked, [s.processors for s in seqs], [s.output_ids for s in seqs], drafts,
                                copy=masked is logits)

    def _advance_grammar(self, seq: SequenceState, tokens: list[int]) -> bool:
        """Advance ``seq``'s matcher over its emitted ``tokens``; fail the request (``False``)
        if the grammar refuses one, which would be an engine bug (every token is sampled
        under its mask)."""
        if seq.grammar is None:
            return True
        t0 = time.perf_counter()
        ok = seq.grammar.advance(tokens)
        self.grammar_advance_s += time.perf_counter() - t0
        if ok:
            return True
        self._fail(seq, "a generated token violates the response format's grammar", "engine_error")
        return False

    def _verify(self, seqs: list[SequenceState], proposal, out, num_rows: int, sampling: SamplingBatch) -> int:
        """Accept/reject drafts (standard speculative sampling), commit caches, emit.

        ``proposal`` ``None``: a plain decode round (no speculator, or the gate chose AR).
        With a speculator, such a round still counts in each request's
        :class:`~runtime.interface.SpecStats` as a round with 0 drafted / 0 verified /
        1 emitted, so ``emitted`` stays every token after the first and τ the tokens per
        target forward. Returns the tokens produced (before stop/EOS/max_tokens cuts)."""
        if proposal is None:  # autoregressive: every request verifies just its anchor (ℓ = 0)
            lengths, draft_probs = [0] * len(seqs), out.logits.new_zeros(0, out.logits.shape[-1])
            draft_tokens = torch.zeros(0, dtype=torch.long)
        else:
            lengths, draft_probs = proposal.lengths, proposal.probs
            draft_tokens = torch.tensor([t for ts in proposal.tokens for t in ts], dtype=torch.long)
        drafts = proposal.tokens if proposal is not None else [[] for _ in seqs]
        res = spec_round(
            self._processed(out.logits[:num_rows], seqs, drafts), draft_probs, draft_tokens, lengths,
            [s.num_cached for s in seqs], *sampling.tensors, sampling.generators,
            seeds=sampling.seeds, positions=sampling.positions, min_p=sampling.min_p,
        )  # fmt: skip
        for seq, keep in zip(seqs, res.keep_target):
            self.cache.truncate(seq.slot, keep)
            seq.num_cached = keep
        if self.speculator is not None:
            self.speculator.commit(seqs, out.taps[:num_rows] if out.taps is not None else None, res.commit_rows, res.commit_counts)
        accepted = res.verify.accepted.tolist()
        if proposal is not None:
            self.speculator.record_outcome(seqs, proposal, accepted)
        lps = self._logprobs(out.logits[:num_rows], seqs, res.tokens, res.token_rows)
        for i, (seq, ell, acc, toks, lp) in enumerate(zip(seqs, lengths, accepted, res.tokens, lps)):
            if not self._advance_grammar(seq, toks):
                continue
            count = None
            if self.speculator is not None:
                def count(kept, seq=seq, drafted=proposal.drafted[i] if proposal is not None else 0, ell=ell, acc=acc):
                    self._count_spec(seq, drafted, ell, min(acc, kept), kept, gated=proposal is None)
            self._append_tokens(seq, toks, count, lp)
        return sum(len(t) for t in res.tokens)

    def _logprobs(
        self, logits: torch.Tensor, seqs: list[SequenceState], tokens: list[list[int]], rows: list[list[int]]
    ) -> list[list[TokenLogprob] | None]:
        """Target logprobs of ``tokens[i]`` (produced by ``logits[rows[i]]``) for the
        sequences that asked; ``None`` for the others. One batched call, only their rows."""
        want = [i for i, s in enumerate(seqs) if s.request.sampling.logprobs is not None]
        out: list[list[TokenLogprob] | None] = [None] * len(seqs)
        if not want:
            return out
        flat_rows = [r for i in want for r in rows[i]]
        num_top = [seqs[i].request.sampling.logprobs for i in want for _ in rows[i]]
        entries = token_logprobs(logits[flat_rows], [t for i in want for t in tokens[i]], num_top)
        start = 0
        for i in want:
            n = len(rows[i])
            out[i] = entries[start : start + n]
            start += n
        return out

    def _count_spec(self, seq: SequenceState, drafted: int, verified: int, accepted: int, emitted: int,
                    gated: bool = False) -> None:
        """Per-request stats; tokens cut by stop/EOS/max_tokens are not counted.
        ``gated``: a plain decode round chosen by the speculation gate (still a round)."""
        st = seq.spec
        st.rounds += 1
        st.gated_rounds += gated
        st.drafted += drafted
        st.verified += verified
        st.accepted += accepted
        st.emitted += emitted
        if len(st.accepted_per_position) < self.speculator.gamma:
            st.accepted_per_position.extend([0] * (self.speculator.gamma - len(st.accepted_per_position)))
        for j in range(accepted):
            st.accepted_per_position[j] += 1

    # -- postprocess --------------------------------------------------------
    def _append_tokens(
        self, seq: SequenceState, new_tokens: list[int], on_kept=None, logprobs: list[TokenLogprob] | None = None
    ) -> int:
        """Feed accepted tokens through stop/EOS/max_tokens checks; emit; return #kept.

        ``on_kept(kept)`` runs before anything is emitted, so per-request stats it
        updates are complete in the :class:`Finished` event of a request ending here.
        ``logprobs`` (aligned with ``new_tokens``) are cut to the kept tokens too.
        """
        res = seq.detok.append(new_tokens)
        kept = res.num_tokens_kept
        if on_kept is not None:
            on_kept(kept)
        if kept:
            now = time.monotonic()
            if seq.timings.first_token is None:
                seq.timings.first_token = now
            seq.timings.last_token = now
            seq.num_completion += kept
            seq.token_ids.extend(res.token_ids_kept)
        if res.text or kept:
            lp = logprobs[:kept] if logprobs is not None else None
            self.emit(seq.request_id, TextDelta(res.text, kept, list(res.token_ids_kept), lp))
        if res.finish_reason is not None:
            self._finish(seq, res.finish_reason)
        return kept

    def _finish(self, seq: SequenceState, reason: FinishReason) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        if reason is not FinishReason.ABORT:
            tail = seq.detok.finish(reason).text
            if tail:
                self.emit(seq.request_id, TextDelta(tail, 0, []))
        self._release(seq)
        seq.timings.finished = time.monotonic()
        spec = seq.spec if self.config.spec_method != "none" else None
        self.emit(seq.request_id, Finished(reason, seq.num_prompt, seq.num_completion, seq.timings, spec,
                                           seq.num_prompt_cached, seq.mask_s if seq.grammar is not None else None))

    def _fail(self, seq: SequenceState, message: str, code: str) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        self._release(seq, keep_context=False)
        seq.timings.finished = time.monotonic()
        self.emit(seq.request_id, Failed(message, code, seq.num_prompt, seq.num_completion, seq.timings))

    def _release(self, seq: SequenceState, keep_context: bool = True) -> None:
        if self.speculator is not None and seq.slot >= 0:  # its queued draft context: commit or drop
            self.speculator.release(seq.slot, keep_context and self.prefix_cache is not None)
        self.scheduler.remove(seq)
        self._by_id.pop(seq.request_id, None)

    def _expire_timeouts(self) -> None:
        now = self.clock()
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            if now > seq.deadline:
                self._fail(seq, "request timed out", "timeout")
