"""The draft side of speculative decoding, as the engine drives it.

One :class:`Speculator` owns the draft model (DSpark drafter, its rank-0
parallel-only ablation, or the prompt-lookup n-gram baseline), the drafter's
context cache and the verification-budget policy (paper Alg. 1 + SLA weights,
:mod:`runtime.speculation.budget`). Per engine step it

1. :meth:`propose` s a block of γ draft tokens for every decoding sequence and
   decides how many of them (ℓ_r) the target verifies, and
2. after the target's ONE ragged verification forward, :meth:`commit` s the
   outcome of :func:`runtime.speculation.verifier.spec_round` to the drafter's
   context cache (anchor + accepted drafts; rejected ones are never committed).

Invariant while a sequence decodes (see ``spec_round``'s docstring):
``draft_cache.lengths[slot] + queued(slot) == target_cache.lengths[slot] == p`` where p is
the anchor's position — the anchor is committed but not yet processed by the target, and
``queued`` counts the positions whose taps wait for the slot's next draft (lazy commit,
:meth:`Speculator.commit`); right before drafting a slot they are committed, so the drafter
always sees the whole context.

``hybrid`` (issue: DSpark on by default) proposes per sequence either the prompt-lookup
n-gram continuation (free to draft; :class:`runtime.speculation.prompt_lookup.NgramIndex`,
match lengths 1..5) or a DSpark block, chosen before anything is drafted: the n-gram when
its calibrated first-position acceptance c_{n,1} (:func:`~runtime.speculation.prompt_lookup.ngram_survival`)
is at least the request's DSpark first-position acceptance so far, else DSpark. Both kinds
of draft enter ONE verification budget (Alg. 1) with their calibrated survival probabilities.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from runtime.config import SPEC_METHODS, EngineConfig
from runtime.engine.sampler import SamplingBatch
from runtime.engine.sequence import SequenceState
from runtime.models.llama import LlamaModel
from runtime.speculation.acceptance import AcceptanceTracker
from runtime.speculation.live_cost import LiveRoundCost
from runtime.speculation.budget import greedy_lengths, schedule
from runtime.speculation.prompt_lookup import NgramIndex, ngram_survival, one_hot_probs
from runtime.speculation.sla import sla_weight
from runtime.speculation.sps import SpsTable, fallback_table

log = logging.getLogger(__name__)

#: a slot's queued draft-context positions that force a flush (:meth:`Speculator.commit`);
#: ``hybrid`` abandons the slot's drafter context instead (no DSpark draft for that long)
LAZY_COMMIT_MAX = 64
#: n-gram sizes the hybrid proposer tries (longest first); its calibration has a row per n
HYBRID_MAX_NGRAM = 5
#: pseudo-rounds of the drafter's prior in a request's estimates (first-position acceptance, yield of a draft)
A1_PRIOR_WEIGHT = 4
#: pseudo-rounds at the calibrated rate in a request's n-gram acceptance scale (hybrid)
NGRAM_PRIOR_WEIGHT = 2.0
#: the committed drafter's first-position acceptance at T = 0 on prompts it never saw
#: (docs/drafter.md, eval protocol: 0.35–0.45 by task): a request's estimate before its own rounds
DRAFTER_A1_PRIOR = 0.4
#: weight of a new measurement in the moving average of drafting seconds per request
DRAFT_COST_ALPHA = 0.1
#: what a DSpark-drafted round yields before a request has drafted rounds of its own, per sampling
#: mode (greedy?): (accepted drafts, verified drafts) per drafted round under the budget. Measured with
#: the committed drafter at c = 1, every round drafted (``bench/proposers.py --configs none
#: dspark:dspark-sla``, mt-bench/gsm8k/humaneval first turns, 2026-12-07, EPYC AVX512-BF16):
#: T = 0 τ 1.429 with 39.7 % of verified drafts accepted, T = 1 τ 1.368 with 30.1 %.
DRAFT_YIELD_PRIOR = {True: (0.43, 1.08), False: (0.37, 1.22)}
DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "checkpoints" / "default"
#: the rank-0 (parallel-only) ablation, trained beside the default on the same data and budget
PARALLEL_CHECKPOINT = DEFAULT_CHECKPOINT.parent / "parallel"


@dataclass
class Proposal:
    """Draft tokens chosen for verification this step.

    Attributes:
        lengths: ℓ_r per decoding sequence (0 → plain decode of the anchor).
        drafted: draft tokens proposed per sequence (γ, or fewer for prompt lookup).
        tokens: per sequence, its ℓ_r draft tokens x_1..x_ℓ.
        probs: fp32 ``[Σ ℓ_r, V]`` p_d rows of those tokens (requests in order);
            ``None`` when every request is greedy (verified from the argmax alone).
        gamma: drafted block size γ this step.
        from_drafter: per sequence, whether its draft came from the DSpark drafter (``hybrid``:
            the others are n-gram drafts); ``None`` for the single-proposer methods.
        match_lengths: per sequence, the n-gram match length n of its n-gram draft (0: none or DSpark).
        conf: per sequence, the conditional survival probabilities c_1.. of its draft as
            calibrated offline, before :class:`~runtime.speculation.acceptance.AcceptanceTracker`
            scaled them (what the tracker learns against); ``None`` for the unscheduled methods.
    """

    lengths: list[int]
    drafted: list[int]
    tokens: list[list[int]]
    probs: torch.Tensor | None
    gamma: int
    from_drafter: list[bool] | None = None
    match_lengths: list[int] | None = None
    conf: list[list[float]] | None = None


@dataclass
class _Round:
    """One round's shared inputs to the drafting choice and the budget (:meth:`Speculator._round`).

    Attributes:
        sampling: the decoding rows' sampling parameters.
        weights: SLA weight w_r per request (sla.py; 1 for every request outside ``dspark-sla``).
        context_len: mean cached tokens per request (the SPS table's context axis).
        table: the SPS table for this round's sampling mode.
        ngrams: per request, (n-gram draft, match length n); empty drafts outside ``hybrid``.
        ngram_c1: per request, the calibrated first-position acceptance of that draft (0.0: none).
    """

    sampling: SamplingBatch
    weights: list[float]
    context_len: float
    table: SpsTable
    ngrams: list[tuple[list[int], int]]
    ngram_c1: list[float]


def raises_rate(tokens: float, gain: float, t_now: float, t_next: float) -> bool:
    """Whether one more verified row (expected ``gain`` accepted tokens, the round taking
    ``t_next`` instead of ``t_now`` seconds) raises expected tokens per second above
    ``tokens / t_now``: the greedy step of Alg. 1 (paper §4), used by every ℓ = 0 decision."""
    return (tokens + gain) / t_next > tokens / t_now


def rows_of(counts: Sequence[int], keep: Sequence[int]) -> list[int]:
    """Row indices of the groups ``keep`` (ascending) in rows laid out group after group,
    ``counts[i]`` rows for group i."""
    offsets = [0, *itertools.accumulate(counts)]
    return [r for i in keep for r in range(offsets[i], offsets[i + 1])]


class Speculator:
    """Draft model + context cache + verification-budget policy.

    Args:
        config: engine config (``spec_method``, ``spec_policy``, ``draft_checkpoint``,
            ``num_speculative_tokens`` = γ served).
        target: the target model (the drafter shares its embeddings and LM head).
        num_slots, max_len: geometry of the target KV cache (slot ids are shared).
        sps_table: SPS table for the ``dspark`` policies; ``None`` →
            :func:`runtime.speculation.sps.fallback_table` (the engine installs an
            explicit or cached one: :func:`runtime.speculation.sps_profiler.initial_sps_table`).

    Raises:
        ValueError: unknown ``spec_method``/``spec_policy``.
    """

    def __init__(self, config: EngineConfig, target: LlamaModel, num_slots: int, max_len: int, sps_table: SpsTable | None = None) -> None:
        if config.spec_method not in SPEC_METHODS or config.spec_method == "none":
            raise ValueError(f"spec_method must be one of {SPEC_METHODS[1:]}, got {config.spec_method!r}")
        from runtime.speculation.budget import POLICIES

        if config.spec_policy not in POLICIES:
            raise ValueError(f"spec_policy must be one of {POLICIES}, got {config.spec_policy!r}")
        self.method = config.spec_method
        self.vocab_size = target.cfg.vocab_size
        self.drafter = None
        self.fast = None
        self.dcache = None
        if self.method in ("dspark", "parallel", "hybrid"):
            self.drafter, path = self._load_drafter(config, target)
            self.dcache = self.drafter.new_context_cache(num_slots, max_len)
            if config.draft_fused:
                from runtime.speculation import fast_drafter
                from runtime.speculation.vocab_drafter import VocabDrafter

                vocab = fast_drafter.load_draft_vocab(path, self.vocab_size)
                if fast_drafter.available(self.drafter):
                    self.fast = fast_drafter.FastDrafter(self.drafter, vocab)
                elif vocab is not None and self.drafter.fc.weight.device.type == "cpu":
                    # off the fused path (fp32 on AVX2, bf16, int8): the draft vocabulary on the
                    # torch backbone (vocab_drafter.py; CUDA keeps the reference + Triton sampler)
                    self.fast = VocabDrafter(self.drafter, vocab)
            self.gamma = min(config.num_speculative_tokens, self.drafter.block_size)
        else:
            self.gamma = config.num_speculative_tokens
        # The parallel-only ablation and prompt lookup have no calibrated confidence
        # worth scheduling on: they verify their whole block.
        self.policy = config.spec_policy if self.method in ("dspark", "hybrid") else "fixed"
        self.predraft = bool(config.spec_gate)  # dspark: the budget decides before drafting (decides_drafting)
        self.sps_table = sps_table if sps_table is not None else fallback_table()
        #: the SPS table of all-greedy batches (a verified row costs less without warping); None: ``sps_table``
        self.sps_table_greedy: SpsTable | None = None
        # hybrid: calibrated n-gram survival per match length, and the drafter's prior a_1
        self.max_ngram = HYBRID_MAX_NGRAM if self.method == "hybrid" else 3
        self.ngram_conf = ngram_survival() if self.method == "hybrid" else {}
        if self.method == "hybrid" and sorted(self.ngram_conf) != list(range(1, self.max_ngram + 1)):
            raise ValueError(f"n-gram calibration covers n={sorted(self.ngram_conf)}, hybrid needs 1..{self.max_ngram}")
        self.a1_prior = DRAFTER_A1_PRIOR
        #: drafting seconds per drafted request, a moving average of measured drafts (0 until the first)
        self.draft_seconds = 0.0
        self._drafts_timed = 0
        self._pending: dict[int, list[torch.Tensor]] = {}  # slot -> taps queued for the draft context
        self._queued: dict[int, int] = {}  # slot -> positions in _pending
        self._ngram_index: dict[int, NgramIndex] = {}
        self._a1_counts: dict[int, tuple[int, int]] = {}  # slot -> (rounds with x_1 accepted, drafted rounds)
        #: slot -> (DSpark-drafted rounds, drafts accepted, drafts verified) in them
        self._yield_counts: dict[int, tuple[int, int, int]] = {}
        self._ngram_counts: dict[int, tuple[float, float]] = {}  # slot -> (n-gram x_1 accepted, Σ calibrated c_1)
        #: hybrid: slots whose drafter context was abandoned (n-gram drafts only until they are freed)
        self._no_context: set[int] = set()
        #: realised vs calibrated acceptance over the engine's verified rounds (acceptance.py)
        self.learned = AcceptanceTracker()
        #: measured round times that correct the SPS table's marginal row cost (live_cost.py);
        #: ``None``: schedule on the table alone (tests that fix a table to fix the drafting volume)
        self.live_cost: LiveRoundCost | None = LiveRoundCost()
        self._round_draft_s = 0.0  # drafting seconds (context flush + draft) of the current round

    @staticmethod
    def _load_drafter(config: EngineConfig, target: LlamaModel):
        """(drafter, its checkpoint directory).

        Raises:
            ValueError: no checkpoint at the path (explicit or committed), or one of the wrong kind.
        """
        from runtime.speculation.checkpoint import load_drafter

        rank0 = config.spec_method == "parallel"
        # Committed: the DSpark drafter (Markov rank 64) and its rank-0 ablation.
        path = Path(config.draft_checkpoint) if config.draft_checkpoint else (PARALLEL_CHECKPOINT if rank0 else DEFAULT_CHECKPOINT)
        if (path / "config.json").exists():
            drafter = load_drafter(path, target)
            if rank0 != (drafter.cfg.markov_rank == 0):
                raise ValueError(f"checkpoint {path} has markov_rank {drafter.cfg.markov_rank}; spec_method {config.spec_method}")
            log.info("loaded drafter %s", path)
            return drafter, path
        if config.draft_checkpoint:
            raise ValueError(f"draft_checkpoint (SPARKGATE_DRAFT_CHECKPOINT) {str(path)!r} holds no config.json: "
                             "not a drafter checkpoint")
        raise ValueError(f"the committed drafter checkpoint {str(path)!r} is missing (spec_method "
                         f"{config.spec_method!r}); restore it from git or set SPARKGATE_DRAFT_CHECKPOINT")

    @property
    def free_drafts(self) -> bool:
        """``hybrid``: it verifies drafts that cost no drafting (n-gram continuations) and decides
        per request, inside its budget, whether a DSpark draft pays (:meth:`_worth_drafting`);
        the engine runs no speculation gate for it."""
        return self.method == "hybrid"

    @property
    def decides_drafting(self) -> bool:
        """Whether the speculator decides per request, before drafting, whether a DSpark draft
        pays (:meth:`_worth_drafting`, the verification budget's ℓ = 0 case): ``hybrid``
        always, ``dspark`` when ``spec_gate`` is on. The engine then runs no speculation gate
        (issue 28 item 3: the gate is the budget's ℓ = 0 case, not a second, timing-driven
        decision); ``parallel`` and ``prompt_lookup`` have no calibrated acceptance to decide
        on and keep :class:`~runtime.speculation.gate.SpecGate`."""
        return self.method == "hybrid" or (self.method == "dspark" and self.predraft)

    @property
    def context_optional(self) -> bool:
        """``hybrid`` serves a request without drafter context (n-gram drafts only), so the
        prefix cache may hold target blocks whose drafter context was never computed
        (:class:`runtime.engine.prefix_cache.PrefixCache`, ``optional`` stores)."""
        return self.method == "hybrid"

    def _context_pays(self, seq: SequenceState, batch: int) -> bool:
        """Whether the budget could draft ``seq`` with DSpark beside ``batch`` other decoding
        requests: :meth:`_worth_drafting`'s test for one request of weight 1 with the prior
        yield of a drafted round (:data:`DRAFT_YIELD_PRIOR`) — what it will be judged on until
        it has DSpark rounds of its own. Requests with an SLA target keep
        their context (their weight may exceed 1). Past rounds only: lossless."""
        if seq.request.sla_target_tokens_per_s is not None:
            return True
        greedy = self._greedy(seq)
        B, ctx = batch + 1, float(seq.num_prompt)
        table = self._table(greedy, "greedy" if greedy else "sampled", B, ctx)
        gain, rows = DRAFT_YIELD_PRIOR[greedy]
        return raises_rate(B, gain, table.round_seconds(B, ctx), table.round_seconds(B + rows, ctx) + self.draft_seconds)

    def has_context(self, slot: int) -> bool:
        """Whether ``slot``'s drafter context is kept (``False``: abandoned, :meth:`commit`)."""
        return self.dcache is not None and slot not in self._no_context

    def queued(self, slot: int) -> int:
        """Positions of ``slot`` whose taps wait for the draft context (lazy commit)."""
        return self._queued.get(slot, 0)

    # -- target-forward needs ------------------------------------------------------
    @property
    def tap_layers(self) -> list[int]:
        """Target layers whose hidden states the drafter needs from every forward."""
        return self.drafter.tap_layers if self.drafter is not None else []

    def start_sequence(self, slot: int, num_restored: int = 0, seq: SequenceState | None = None,
                       batch: int = 0) -> None:
        """A sequence starts prefilling in ``slot``. Its first ``num_restored`` positions
        came from the prefix cache (:mod:`runtime.engine.prefix_cache`), which restores the
        draft context of those positions together with the target KV.

        ``hybrid`` with ``seq`` given: when a DSpark draft of a request like it would not pay
        beside ``batch`` decoding requests (:meth:`_context_pays`), the request gets no drafter
        context at all — its prompt's context is never computed — and drafts n-grams only.

        Raises:
            RuntimeError: the draft context does not hold exactly ``num_restored`` positions.
        """
        self._pending.pop(slot, None)
        self._queued.pop(slot, None)
        self._ngram_index.pop(slot, None)
        self._a1_counts.pop(slot, None)
        self._yield_counts.pop(slot, None)
        self._ngram_counts.pop(slot, None)
        self._no_context.discard(slot)
        if self.dcache is None:
            return
        if seq is not None and self.context_optional and not self._context_pays(seq, batch):
            self._no_context.add(slot)
            self.dcache.lengths[slot] = min(self.dcache.lengths[slot], num_restored)
        elif num_restored == 0:
            self.dcache.reset(slot)
        elif self.dcache.lengths[slot] < num_restored and self.context_optional:
            self._no_context.add(slot)  # cached by a request that had abandoned its drafter context
        elif self.dcache.lengths[slot] != num_restored:
            raise RuntimeError(f"slot {slot}: draft context has {self.dcache.lengths[slot]} positions, "
                               f"the target {num_restored} restored")

    def extend_context(self, taps: torch.Tensor | None, slots: Sequence[int], counts: Sequence[int]) -> None:
        """Commit target taps ``[Σ counts, m, d]`` of newly cached positions (slots whose
        drafter context was abandoned are skipped)."""
        if self._no_context and taps is not None and any(s in self._no_context for s in slots):
            keep = [i for i, s in enumerate(slots) if s not in self._no_context]
            taps = taps[torch.tensor(rows_of(counts, keep), dtype=torch.long)]
            slots, counts = [slots[i] for i in keep], [counts[i] for i in keep]
        if self.drafter is not None and taps is not None and sum(counts) > 0:
            (self.fast or self.drafter).extend_context(self.dcache, taps, slots, counts)

    # -- propose -------------------------------------------------------------------
    def propose(self, seqs: list[SequenceState], sampling: SamplingBatch, use_drafter: bool = True) -> Proposal | None:
        """Draft for each decoding sequence (``sampling``: their rows) and pick ℓ_r (paper Alg. 1).

        ``use_drafter`` ``False`` (the speculation gate's plain step): no drafting at all for
        ``dspark``/``parallel``/``prompt_lookup``; ``hybrid`` still verifies the n-gram drafts its
        budget admits (they cost no drafting). Returns ``None`` for a plain decode step: nothing
        was drafted, or (``hybrid``) no DSpark draft and no n-gram draft the budget would verify
        (:meth:`_ngram_admitted`)."""
        self._round_draft_s = 0.0  # this round's drafting, subtracted from its measured time (record_round)
        if self.method == "prompt_lookup":
            return self._propose_ngram(seqs) if use_drafter else None
        if self.method != "hybrid":
            if not use_drafter:
                return None
            rnd, drafted = self._round(seqs, sampling), list(range(len(seqs)))
            if self.decides_drafting:  # dspark: only the requests whose draft is expected to pay
                drafted = self._worth_drafting(seqs, rnd, drafted)
                if not drafted:
                    return None
            return self._propose_blocks(seqs, rnd, drafted)
        rnd = self._round(seqs, sampling, [self._ngram(s) for s in seqs])
        # Which proposer each sequence uses is decided before anything is drafted, from past
        # tokens and past rounds only (so every ℓ_r stays a stopping time: budget.py).
        wanted = [i for i, (toks, _) in enumerate(rnd.ngrams)
                  if use_drafter and seqs[i].slot not in self._no_context
                  and (not toks or rnd.ngram_c1[i] < self._dspark_a1(seqs[i]))]
        use = self._worth_drafting(seqs, rnd, wanted)
        if not use and not self._ngram_admitted(rnd):
            return None
        return self._propose_blocks(seqs, rnd, use)

    def _ngram_admitted(self, rnd: "_Round") -> bool:
        """Whether the verification budget would verify any n-gram draft of a round without
        DSpark drafts. ``dspark`` / ``dspark-sla``: Alg. 1 itself
        (:func:`runtime.speculation.budget.greedy_lengths`) on each request's first n-gram token
        alone — ℓ_r ≥ 1 exactly when that token is admitted, and the greedy looks at a later
        token only after admitting its first — so when it admits none the schedule gives every
        request ℓ = 0 and the round is a plain one (no proposal, no p_d rows: it costs what an
        AR step costs). Other policies: any n-gram draft exists. Reads only past tokens and
        calibrations (a constant stopping time, budget.py)."""
        firsts = [[c1] if toks else [] for (toks, _), c1 in zip(rnd.ngrams, rnd.ngram_c1)]
        if not any(firsts) or self.policy not in ("dspark", "dspark-sla"):
            return any(firsts)
        return any(greedy_lengths(firsts, rnd.weights, lambda B: float(rnd.table.sps(B, rnd.context_len))))

    def _round(self, seqs: list[SequenceState], sampling: SamplingBatch,
               ngrams: list[tuple[list[int], int]] | None = None) -> "_Round":
        """What one round's choices share, computed once: SLA weights (``dspark-sla``; 1 for
        every request under the other policies, which ignore tiers in the budget and so in the
        choice to draft too), mean context, the SPS table for this sampling mode (greedy rounds
        verify cheaper: sps_profiler.py) and each request's n-gram draft with its calibrated
        first-position acceptance."""
        ngrams = ngrams if ngrams is not None else [([], 0)] * len(seqs)
        context_len = sum(s.num_cached for s in seqs) / max(len(seqs), 1)
        weights = ([sla_weight(s.request.sla_target_tokens_per_s, s.measured_tokens_per_s()) for s in seqs]
                   if self.policy == "dspark-sla" else [1.0] * len(seqs))
        return _Round(
            sampling=sampling,
            weights=weights,
            context_len=context_len,
            table=self._table(sampling.greedy, self.round_mode(sampling), len(seqs), context_len),
            ngrams=ngrams,
            ngram_c1=[self._ngram_c1(s, n) if toks else 0.0 for s, (toks, n) in zip(seqs, ngrams)],
        )

    def _table(self, greedy: bool, mode: str, requests: int, context_len: float):
        """The SPS table of a round of ``requests`` requests: the greedy profile for an all-greedy
        batch (when profiled), else the sampled one, corrected by :attr:`live_cost` for ``mode``."""
        table = self.sps_table_greedy if greedy and self.sps_table_greedy is not None else self.sps_table
        return self.live_cost.corrected(table, mode, requests, context_len) if self.live_cost is not None else table

    def _worth_drafting(self, seqs, rnd: "_Round", wanted: list[int]) -> list[int]:
        """The requests of ``wanted`` whose DSpark draft is expected to pay for itself: the
        verification budget's ℓ = 0 case decided BEFORE drafting (issue 28 item 3).

        Alg. 1's greedy on each request's *estimated* yield of a draft (:meth:`_draft_yield`:
        ĝ_r drafts accepted over ℓ̂_r verified per drafted round, from its own past drafted
        rounds and a measured prior) over the round time ``1/SPS(B) + n·d`` (B verified rows, n
        drafted requests, d the measured drafting seconds per request, :attr:`draft_seconds`):
        a request is drafted while adding it (value w_r·ĝ_r, ℓ̂_r more rows, one more draft)
        raises expected tokens per second; the scan stops at the first that does not. The
        yield is what drafts returned *after* the budget chose ℓ from their confidences, so it
        prices a draft as served — a confident block verified long, a doubtful one not at all
        (its first position alone undervalues it: at c = 1, T = 0 on gguf the prior 0.4 of one
        row never paid, while drafting every round ran 1.10× AR). n-gram rows enter with their
        calibrated c₁ and no drafting cost. Uses only past rounds and past tokens, never this
        round's drafts: the choice is a constant stopping time of every draft (budget.py,
        Appendix A)."""
        if not wanted:
            return []
        table, ctx, weights = rnd.table, rnd.context_len, rnd.weights
        W = math.fsum(weights)
        B = len(seqs)
        for i, (toks, _) in enumerate(rnd.ngrams):  # free n-gram first rows the budget would take anyway
            if toks and i not in wanted:
                v = weights[i] * rnd.ngram_c1[i]
                if raises_rate(W, v, 1.0 / table.sps(B, ctx), 1.0 / table.sps(B + 1, ctx)):
                    W, B = W + v, B + 1
        t_round = 1.0 / table.sps(B, ctx)
        chosen = []
        yields = [(weights[i] * gain, rows, i) for i in wanted for gain, rows in [self._draft_yield(seqs[i])]]
        for v, rows, i in sorted(yields, reverse=True):
            t_next = 1.0 / table.sps(B + rows, ctx) + (len(chosen) + 1) * self.draft_seconds
            if not raises_rate(W, v, t_round + len(chosen) * self.draft_seconds, t_next):
                break
            chosen.append(i)
            W, B = W + v, B + rows
            t_round = 1.0 / table.sps(B, ctx)
        return sorted(chosen)

    def _propose_blocks(self, seqs, rnd: "_Round", drafted_rows: list[int]) -> Proposal:
        """DSpark-draft ``drafted_rows``; the other rows propose their n-gram draft (may be empty);
        one verification budget over all of them."""
        picked = set(drafted_rows)
        ds = None
        if drafted_rows:
            sub = [seqs[i] for i in drafted_rows]
            t0 = time.perf_counter()
            self.flush([s.slot for s in sub])  # the drafter reads the whole committed context
            anchors = torch.tensor([s.last_token for s in sub], dtype=torch.long)
            ds = self.draft(anchors, [s.slot for s in sub], rnd.sampling.select(drafted_rows))
            self._round_draft_s = time.perf_counter() - t0
            per_seq = self._round_draft_s / len(sub)  # measured, for later rounds' choices only
            self._drafts_timed += 1  # a plain mean until 1/α samples, then exponential (as the gate's averages)
            self.draft_seconds += max(DRAFT_COST_ALPHA, 1.0 / self._drafts_timed) * (per_seq - self.draft_seconds)
        raw: list[list[float]] = []  # calibrated offline (what the tracker learns against)
        conf: list[list[float]] = []  # scaled by the tracker's factors: what the budget ranks
        where = {i: j for j, i in enumerate(drafted_rows)}
        dconf = ds.confidence.tolist() if ds is not None else []
        for i, s in enumerate(seqs):
            g = self._greedy(s)
            if i in picked:
                raw.append(dconf[where[i]])
                conf.append(self.learned.scaled(("dspark", 0, False, g), ("dspark", 0, True, g), raw[-1]))
            else:
                toks, n = rnd.ngrams[i]
                raw.append(self.ngram_conf[n][: len(toks)] if toks else [])
                # c_1 already holds the tracker's and the request's own factors (_ngram_c1)
                conf.append([rnd.ngram_c1[i]] + self.learned.scaled(("ngram", n, True, g), ("ngram", n, True, g), raw[-1][1:])
                            if toks else [])
        plan = schedule(self.policy, conf, rnd.table, weights=rnd.weights, context_len=rnd.context_len)
        lengths = [min(l, self._room(s)) for l, s in zip(plan.lengths, seqs)]
        tokens, drafted = [], []
        for i, l in enumerate(lengths):
            if i in picked:
                tokens.append(ds.tokens[where[i], :l].tolist())
                drafted.append(self.gamma)
            else:
                tokens.append(rnd.ngrams[i][0][:l])
                drafted.append(len(rnd.ngrams[i][0]))
        # Greedy rounds are verified from the target's argmax alone (spec_round): no p_d rows.
        probs = None if rnd.sampling.greedy else self._draft_probs(ds, drafted_rows, tokens, lengths)
        return Proposal(lengths, drafted, tokens, probs, self.gamma, [i in picked for i in range(len(seqs))],
                        [0 if i in picked else rnd.ngrams[i][1] for i in range(len(seqs))], raw)

    @staticmethod
    def round_mode(sampling: SamplingBatch) -> str:
        """The round-cost class of a batch: ``"greedy"`` (every row argmax), ``"seeded"`` (a
        seeded sampled row: Gumbel noise per verified row) or ``"sampled"``."""
        if sampling.greedy:
            return "greedy"
        return "seeded" if sampling.seeded_rows else "sampled"

    def record_round(self, sampling: SamplingBatch, requests: int, rows: int, seconds: float) -> None:
        """A decode round without prefill took ``seconds`` (its whole step) for ``requests``
        requests and ``rows`` verified rows: fold it, minus its drafting, into :attr:`live_cost`."""
        if self.live_cost is not None:
            self.live_cost.record(self.round_mode(sampling), requests, rows, seconds - self._round_draft_s)
        self._round_draft_s = 0.0

    def _draft_probs(self, ds, drafted_rows: list[int], tokens: list[list[int]], lengths: list[int]) -> torch.Tensor:
        """p_d rows fp32 ``[Σ ℓ_r, V]`` in request order: the drafter's for drafted rows, one-hot for n-gram rows."""
        dense = ds.dense_probs([lengths[i] for i in drafted_rows]) if ds is not None else None
        parts, start, offsets = [], 0, {}
        for i in drafted_rows:  # row offset of each drafted request inside ``dense``
            offsets[i] = start
            start += lengths[i]
        for i, l in enumerate(lengths):
            if l == 0:
                continue
            if i in offsets:
                parts.append(dense[offsets[i] : offsets[i] + l])
            else:
                parts.append(one_hot_probs(tokens[i], self.vocab_size))
        return torch.cat(parts) if parts else torch.zeros(0, self.vocab_size)

    def _ngram(self, seq: SequenceState) -> tuple[list[int], int]:
        """(n-gram draft, match length) of ``seq`` from its incremental index."""
        idx = self._ngram_index.get(seq.slot)
        if idx is None or len(idx.tokens) > len(seq.token_ids):
            idx = self._ngram_index[seq.slot] = NgramIndex(max_ngram=self.max_ngram)
        idx.sync(seq.token_ids)
        return idx.propose(self.gamma)

    @staticmethod
    def _greedy(seq: SequenceState) -> bool:
        return seq.request.sampling.temperature <= 0

    def _dspark_a1(self, seq: SequenceState) -> float:
        """The request's first-position DSpark acceptance so far (past rounds only), shrunk
        with :data:`A1_PRIOR_WEIGHT` pseudo-rounds towards the engine's: the drafter's prior
        :data:`DRAFTER_A1_PRIOR` scaled by what the engine's recent drafted rounds of the same
        sampling mode realised (:attr:`learned`)."""
        prior = min(1.0, self.a1_prior * self.learned.factor(("dspark-a1", self._greedy(seq))))
        hits, rounds = self._a1_counts.get(seq.slot, (0, 0))
        return (hits + A1_PRIOR_WEIGHT * prior) / (rounds + A1_PRIOR_WEIGHT)

    def _draft_yield(self, seq: SequenceState) -> tuple[float, float]:
        """(ĝ, ℓ̂): drafts accepted and drafts verified per DSpark-drafted round of ``seq`` so
        far (past rounds only; a round the budget gave ℓ = 0 counts as (0, 0)), shrunk with
        :data:`A1_PRIOR_WEIGHT` pseudo-rounds towards :data:`DRAFT_YIELD_PRIOR` of its sampling
        mode. Every request starts from that prior, not from what other requests realised: a
        pooled estimate dragged down by a few chat requests would stop drafting for the code and
        maths ones after them, for good (nothing drafted, nothing measured). A request whose own
        drafts do not pay stops being drafted after a few rounds and is not drafted again."""
        gain, rows = DRAFT_YIELD_PRIOR[self._greedy(seq)]
        n, acc, ver = self._yield_counts.get(seq.slot, (0, 0, 0))
        return (acc + A1_PRIOR_WEIGHT * gain) / (n + A1_PRIOR_WEIGHT), (ver + A1_PRIOR_WEIGHT * rows) / (n + A1_PRIOR_WEIGHT)

    def _record_yield(self, slot: int, accepted: int, verified: int) -> None:
        """One DSpark-drafted round of ``slot``: ``verified`` drafts verified, ``accepted`` of them accepted."""
        n, acc, ver = self._yield_counts.get(slot, (0, 0, 0))
        self._yield_counts[slot] = (n + 1, acc + accepted, ver + verified)

    def _ngram_c1(self, seq: SequenceState, n: int) -> float:
        """First-position acceptance of an n-gram draft of match length n: the offline
        calibration, scaled by what the engine's recent n-gram drafts of that length and
        sampling mode realised (:attr:`learned`), then by how the request's own n-gram drafts
        fared against that so far (past rounds only; :data:`NGRAM_PRIOR_WEIGHT` pseudo-rounds
        at the engine's rate)."""
        c1 = self._ngram_engine_c1(n, self._greedy(seq))
        hits, expected = self._ngram_counts.get(seq.slot, (0.0, 0.0))
        factor = (hits + NGRAM_PRIOR_WEIGHT) / (expected + NGRAM_PRIOR_WEIGHT)
        return min(1.0, c1 * factor)

    def _ngram_engine_c1(self, n: int, greedy: bool) -> float:
        """The offline c_{n,1} scaled by the engine's recent realised rate (no request's own record)."""
        return min(1.0, self.ngram_conf[n][0] * self.learned.factor(("ngram", n, False, greedy)))

    def record_outcome(self, seqs: list[SequenceState], proposal: "Proposal", accepted: Sequence[int]) -> None:
        """Fold a verified round into the engine's :attr:`learned` factors (every verified draft
        position: accepted or not, against its offline conditional c_k), the yield of each
        DSpark-drafted round (:meth:`_draft_yield`) and, for ``hybrid``'s choice, each request's
        record of its proposers: DSpark first-position hits per drafted round, n-gram
        first-position hits vs the c_1 the budget was given."""
        if proposal.from_drafter is None or proposal.conf is None:
            return
        for s, mine, ell, acc, n, raw in zip(seqs, proposal.from_drafter, proposal.lengths, accepted,
                                             proposal.match_lengths, proposal.conf):
            g = self._greedy(s)
            if mine:  # what the draft returned as served, ℓ = 0 included (its drafting was paid)
                self._record_yield(s.slot, acc, ell)
            if ell == 0:
                continue
            kind = "dspark" if mine else "ngram"
            c1 = 0.0 if mine else self._ngram_engine_c1(n, g)  # what this round's c_1 was scaled from
            for k in range(min(acc + 1, ell)):  # positions reached: 1..acc accepted, acc+1 rejected
                self.learned.add((kind, n, k > 0, g), k < acc, raw[k])
            if mine:
                self.learned.add(("dspark-a1", g), acc > 0, self.a1_prior)
                hits, rounds = self._a1_counts.get(s.slot, (0, 0))
                self._a1_counts[s.slot] = (hits + (acc > 0), rounds + 1)
            else:
                hits, expected = self._ngram_counts.get(s.slot, (0.0, 0.0))
                self._ngram_counts[s.slot] = (hits + (acc > 0), expected + c1)

    def draft(self, anchors: torch.Tensor, slots: Sequence[int], sampling: SamplingBatch):
        """γ draft tokens per sequence with confidences: over the draft vocabulary — the fused CPU
        drafter (:class:`runtime.speculation.fast_drafter.FastDrafter`) where it runs, else on the
        torch backbone (:class:`runtime.speculation.vocab_drafter.VocabDrafter`, CPU) — or the
        reference :class:`~runtime.speculation.drafter.DSparkDrafter` (no draft vocabulary, CUDA,
        ``draft_fused`` off). Returns an object with ``tokens``
        int64 ``[B, γ]``, ``confidence`` fp32 ``[B, γ]`` and ``dense_probs(lengths)``."""
        if self.fast is not None:
            return self.fast.draft(anchors, slots, self.dcache, self.gamma, sampling)
        blk = self.drafter.propose(anchors, slots, self.dcache, block_size=self.gamma)
        return self.drafter.sample_block(blk, anchors, sampling)

    def _propose_ngram(self, seqs: list[SequenceState]) -> Proposal:
        tokens, drafted = [], []
        for s in seqs:
            prop, _ = self._ngram(s)
            drafted.append(len(prop))
            tokens.append(prop[: self._room(s)])
        lengths = [len(t) for t in tokens]
        flat = [t for ts in tokens for t in ts]
        return Proposal(lengths, drafted, tokens, one_hot_probs(flat, self.vocab_size), self.gamma)

    @staticmethod
    def _room(seq: SequenceState) -> int:
        """Drafts worth verifying: never more than the tokens the request may still emit − 1.

        Depends only on state fixed before the step, so it keeps ℓ_r a stopping time.
        """
        return max(0, seq.max_tokens - seq.num_completion - 1)

    # -- commit (lazy) ------------------------------------------------------------
    def commit(self, seqs: list[SequenceState], verify_taps: torch.Tensor | None, commit_rows: torch.Tensor, commit_counts: list[int]) -> None:
        """Queue the anchor + accepted drafts' taps for the draft context (Alg.: commit).

        Lazily: a decode round's taps wait per slot until that slot is drafted next
        (:meth:`flush` in :meth:`propose`), so rounds that draft nothing do not run the
        drafter's context projection at all, and a flush commits many positions in one call;
        a slot holding :data:`LAZY_COMMIT_MAX` positions is flushed at once (bounded memory) —
        except under ``hybrid``, which abandons that slot's drafter context instead: it was
        not DSpark-drafted for that many positions (its n-gram drafts or no draft paid
        better), so the request goes on with n-gram drafts only and costs no drafter work
        (at batch 16 the context costs ~2 % of a round). Decided from past rounds only."""
        if self.drafter is None or verify_taps is None:
            return
        kept = [(s, n) for s, n in zip(seqs, commit_counts) if n and s.slot not in self._no_context]
        if not kept:
            return
        if any(s.slot in self._no_context for s in seqs):  # gather only the rows of slots that keep a context
            commit_rows = commit_rows[rows_of(commit_counts, [i for i, s in enumerate(seqs)
                                                              if s.slot not in self._no_context])]
        # Queued in the drafter's dtype: both drafters cast the taps to it first (exact, half the memory).
        taps = verify_taps[commit_rows].to(self.drafter.dtype)
        start, full = 0, []
        for s, n in kept:
            self._pending.setdefault(s.slot, []).append(taps[start : start + n])
            start += n
            self._queued[s.slot] = q = self._queued.get(s.slot, 0) + n
            if q >= LAZY_COMMIT_MAX:
                full.append(s.slot)
        if full and self.context_optional:
            for slot in full:
                self._abandon(slot)
        elif full:
            self.flush(full)

    def _abandon(self, slot: int) -> None:
        """Drop ``slot``'s queued taps and stop keeping its drafter context (hybrid)."""
        self._pending.pop(slot, None)
        self._queued.pop(slot, None)
        self._no_context.add(slot)

    def flush(self, slots: Sequence[int]) -> None:
        """Commit the queued taps of ``slots`` to the draft context, in one drafter call."""
        slots = [s for s in slots if self._pending.get(s)]
        if not slots:
            return
        chunks = [torch.cat(self._pending.pop(s)) for s in slots]
        for s in slots:
            self._queued.pop(s, None)
        self.extend_context(torch.cat(chunks), slots, [c.shape[0] for c in chunks])

    def release(self, slot: int, keep_context: bool) -> None:
        """A sequence leaves ``slot``: commit its queued taps when its context is kept (the
        prefix cache stores only positions valid in every store), else drop them."""
        if keep_context and slot not in self._no_context:
            self.flush([slot])
        self._no_context.discard(slot)
        self._pending.pop(slot, None)
        self._queued.pop(slot, None)
        self._ngram_index.pop(slot, None)
        self._a1_counts.pop(slot, None)
        self._yield_counts.pop(slot, None)
        self._ngram_counts.pop(slot, None)
