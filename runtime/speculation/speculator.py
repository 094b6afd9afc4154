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
``draft_cache.lengths[slot] == target_cache.lengths[slot] == p`` where p is the
anchor's position — the anchor is committed but not yet processed by the target.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from runtime.config import EngineConfig
from runtime.engine.sampler import SamplingBatch
from runtime.engine.sequence import SequenceState
from runtime.models.llama import LlamaModel
from runtime.speculation.budget import schedule
from runtime.speculation.prompt_lookup import one_hot_probs, propose_ngram
from runtime.speculation.sla import sla_weight
from runtime.speculation.sps import SpsTable, fallback_table

log = logging.getLogger(__name__)

SPEC_METHODS = ("none", "dspark", "parallel", "prompt_lookup")
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
    """

    lengths: list[int]
    drafted: list[int]
    tokens: list[list[int]]
    probs: torch.Tensor | None
    gamma: int


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
        if self.method in ("dspark", "parallel"):
            self.drafter, path = self._load_drafter(config, target)
            self.dcache = self.drafter.new_context_cache(num_slots, max_len)
            if config.draft_fused:
                from runtime.speculation import fast_drafter

                if fast_drafter.available(self.drafter):
                    self.fast = fast_drafter.FastDrafter(
                        self.drafter, fast_drafter.load_draft_vocab(path, self.vocab_size))
            self.gamma = min(config.num_speculative_tokens, self.drafter.block_size)
        else:
            self.gamma = config.num_speculative_tokens
        # The parallel-only ablation and prompt lookup have no calibrated confidence
        # worth scheduling on: they verify their whole block.
        self.policy = config.spec_policy if self.method == "dspark" else "fixed"
        self.sps_table = sps_table if sps_table is not None else fallback_table()

    @staticmethod
    def _load_drafter(config: EngineConfig, target: LlamaModel):
        """(drafter, its checkpoint directory or ``None`` when randomly initialised)."""
        from runtime.speculation.checkpoint import load_drafter
        from runtime.speculation.config import DrafterConfig
        from runtime.speculation.drafter import DSparkDrafter

        rank0 = config.spec_method == "parallel"
        # Committed: the DSpark drafter (Markov rank 64) and its rank-0 ablation.
        path = Path(config.draft_checkpoint) if config.draft_checkpoint else (PARALLEL_CHECKPOINT if rank0 else DEFAULT_CHECKPOINT)
        if (path / "config.json").exists():
            drafter = load_drafter(path, target)
            if rank0 != (drafter.cfg.markov_rank == 0):
                raise ValueError(f"checkpoint {path} has markov_rank {drafter.cfg.markov_rank}; spec_method {config.spec_method}")
            log.info("loaded drafter %s", path)
            return drafter, path
        log.warning("no drafter checkpoint at %s: using a RANDOMLY initialised drafter (lossless, low acceptance)", path)
        cfg = DrafterConfig(block_size=max(config.num_speculative_tokens, 1), markov_rank=0 if rank0 else 64, init_seed=config.seed)
        return DSparkDrafter(target, cfg), None

    # -- target-forward needs ------------------------------------------------------
    @property
    def tap_layers(self) -> list[int]:
        """Target layers whose hidden states the drafter needs from every forward."""
        return self.drafter.tap_layers if self.drafter is not None else []

    def start_sequence(self, slot: int, num_restored: int = 0) -> None:
        """A sequence starts prefilling in ``slot``. Its first ``num_restored`` positions
        came from the prefix cache (:mod:`runtime.engine.prefix_cache`), which restores the
        draft context of those positions together with the target KV.

        Raises:
            RuntimeError: the draft context does not hold exactly ``num_restored`` positions.
        """
        if self.dcache is None:
            return
        if num_restored == 0:
            self.dcache.reset(slot)
        elif self.dcache.lengths[slot] != num_restored:
            raise RuntimeError(f"slot {slot}: draft context has {self.dcache.lengths[slot]} positions, "
                               f"the target {num_restored} restored")

    def extend_context(self, taps: torch.Tensor | None, slots: Sequence[int], counts: Sequence[int]) -> None:
        """Commit target taps ``[Σ counts, m, d]`` of newly cached positions."""
        if self.drafter is not None and taps is not None and sum(counts) > 0:
            (self.fast or self.drafter).extend_context(self.dcache, taps, slots, counts)

    # -- propose -------------------------------------------------------------------
    def propose(self, seqs: list[SequenceState], sampling: SamplingBatch) -> Proposal:
        """Draft γ tokens for each decoding sequence (``sampling``: their rows) and pick ℓ_r (paper Alg. 1)."""
        if self.drafter is None:
            return self._propose_ngram(seqs)
        anchors = torch.tensor([s.last_token for s in seqs], dtype=torch.long)
        ds = self.draft(anchors, [s.slot for s in seqs], sampling)
        weights = [sla_weight(s.request.sla_target_tokens_per_s, s.measured_tokens_per_s()) for s in seqs]
        ctx = sum(s.num_cached for s in seqs) / max(len(seqs), 1)
        plan = schedule(self.policy, ds.confidence, self.sps_table, weights=weights, context_len=ctx)
        lengths = [min(l, self._room(s)) for l, s in zip(plan.lengths, seqs)]
        tokens = [ds.tokens[i, :l].tolist() for i, l in enumerate(lengths)]
        # Greedy rounds are verified from the target's argmax alone (spec_round): no p_d rows.
        probs = None if sampling.greedy else ds.dense_probs(lengths)
        return Proposal(lengths, [self.gamma] * len(seqs), tokens, probs, self.gamma)

    def draft(self, anchors: torch.Tensor, slots: Sequence[int], sampling: SamplingBatch):
        """γ draft tokens per sequence with confidences: the fused CPU drafter
        (:class:`runtime.speculation.fast_drafter.FastDrafter`) where it runs, else the reference
        :class:`~runtime.speculation.drafter.DSparkDrafter`. Returns an object with ``tokens``
        int64 ``[B, γ]``, ``confidence`` fp32 ``[B, γ]`` and ``dense_probs(lengths)``."""
        if self.fast is not None:
            return self.fast.draft(anchors, slots, self.dcache, self.gamma, sampling)
        blk = self.drafter.propose(anchors, slots, self.dcache, block_size=self.gamma)
        return self.drafter.sample_block(blk, anchors, sampling)

    def _propose_ngram(self, seqs: list[SequenceState]) -> Proposal:
        tokens, drafted = [], []
        for s in seqs:
            prop = propose_ngram(s.token_ids, self.gamma)
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

    # -- commit --------------------------------------------------------------------
    def commit(self, seqs: list[SequenceState], verify_taps: torch.Tensor | None, commit_rows: torch.Tensor, commit_counts: list[int]) -> None:
        """Append the anchor + accepted drafts' taps to the draft context (Alg.: commit)."""
        if self.drafter is not None and verify_taps is not None:
            self.extend_context(verify_taps[commit_rows], [s.slot for s in seqs], commit_counts)
