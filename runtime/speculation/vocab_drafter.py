"""The DSpark drafter with the draft vocabulary on a torch backbone: what the engine drafts
with when the target is NOT on the fused ``gguf`` path (fp32 on AVX2-only CPUs, bf16, int8).

:class:`~runtime.speculation.fast_drafter.FastDrafter` drafts over the checkpoint's draft
vocabulary (FR-Spec: the N = 8,192 most frequent response tokens) but needs the fused C++
kernel (AVX512-BF16). Everywhere else the engine used the reference
:class:`~runtime.speculation.drafter.DSparkDrafter`, whose LM head and Markov chain run over
all V = 49,152 tokens. On the AVX2-only EPYC (fp32, 2 threads, batch 1, γ = 4) that is
20.6 ms a block, of which 8.1 ms is the full LM head and 6.3 ms the Markov chain over V,
against a 55–60 ms decode step — docs/benchmarks.md, "Draft vocabulary on the torch path".

:class:`VocabDrafter` keeps the reference backbone (``DSparkDrafter.forward_block``, context
via ``DSparkDrafter.extend_context``) and draws exactly as :class:`FastDrafter` does
(:func:`~runtime.speculation.fast_drafter.sample_over_vocab`): U_k over the draft vocabulary
(the LM head's N rows, in the target's dtype), the Markov bias over W2's N columns, the
row's warp restricted to those N tokens. Lossless for the reason FastDrafter is: the verifier
is given the p_d each token was drawn from (zero outside the draft vocabulary,
:meth:`~runtime.speculation.fast_drafter.FastDraft.dense_probs`); only acceptance can move.
"""

from __future__ import annotations

from typing import Sequence

import torch

from runtime.engine.sampler import SamplingBatch
from runtime.models.llama import linear, pack_linears_, pack_weight
from runtime.speculation.drafter import DraftContextCache, DSparkDrafter
from runtime.speculation.fast_drafter import FastDraft, markov_columns, sample_over_vocab


class VocabDrafter:
    """A :class:`DSparkDrafter` drafting over a draft vocabulary (module docstring).

    Shares the drafter's parameters and its :class:`DraftContextCache`; copies only the LM
    head's N rows (``[N, d]``, target dtype) and W2's N columns (fp32 ``[r, N]``).

    Args:
        drafter: the reference drafter (DSpark or the rank-0 ablation), on any device.
        draft_vocab: int64 ``[N]`` distinct target token ids
            (:func:`runtime.speculation.fast_drafter.load_draft_vocab`).
    """

    kind = "vocab"  # the SPS profile's drafter id (sps_profiler.drafter_id): this path costs its own

    def __init__(self, drafter: DSparkDrafter, draft_vocab: torch.Tensor) -> None:
        self.drafter = drafter
        device = drafter.fc.weight.device
        self.vocab = draft_vocab.to(device)
        self.head = drafter.target.lm_head_weight.detach()[self.vocab].contiguous()  # [N, d], target dtype
        self.w2_sub_t = markov_columns(drafter, self.vocab)
        # fp32 on the CPU: the backbone's projections and the head multiply MKL-packed copies
        # (llama.linear: a 4-row GEMM re-packed its weights every call); None elsewhere
        pack_linears_(drafter)
        self.head_packed = pack_weight(self.head)

    def extend_context(self, cache: DraftContextCache, taps: torch.Tensor, slots: Sequence[int], counts: Sequence[int]) -> None:
        """:meth:`DSparkDrafter.extend_context` (the context does not depend on the vocabulary)."""
        self.drafter.extend_context(cache, taps, slots, counts)

    @torch.inference_mode()
    def draft(self, anchors: torch.Tensor, slots: Sequence[int], cache: DraftContextCache, gamma: int,
              sampling: SamplingBatch) -> FastDraft:
        """Draft γ tokens per sequence: the reference backbone, the draft-vocabulary LM head,
        the Markov chain and confidences — same contract as :meth:`FastDrafter.draft`.

        Raises:
            ValueError: γ out of range (:meth:`DSparkDrafter.forward_block`).
        """
        d = self.drafter
        if not 1 <= gamma <= d.cfg.block_size:
            raise ValueError(f"block_size {gamma} not in [1, {d.cfg.block_size}]")
        hidden = d.forward_block(d.block_inputs(anchors, gamma), slots, cache)  # [B, γ, d]
        B, _, dim = hidden.shape
        base = linear(hidden.reshape(B * gamma, dim), self.head, self.head_packed).float().view(B, gamma, -1)  # U over the N tokens
        return sample_over_vocab(d, self.vocab, self.w2_sub_t, base, hidden, anchors.long(), sampling)
