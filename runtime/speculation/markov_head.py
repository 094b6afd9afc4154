"""The Markov head: a low-rank previous-token bias on the parallel draft logits (paper §3.1).

The parallel backbone gives base logits U_k for every slot of the block at once;
the Markov head makes drafting semi-autoregressive by adding a bias that depends on
the previously sampled draft token x_{k−1} (x_0 = the anchor)::

    vanilla:  logits_k = U_k + W1[x_{k−1}] · W2
    gated:    logits_k = U_k + (σ(G [h_k ; W1[x_{k−1}]]) ⊙ W1[x_{k−1}]) · W2

with W1 ∈ R^{V×r} (an embedding lookup), W2 ∈ R^{r×V}, G ∈ R^{r×(d+r)} (+ bias).
The gated form follows DeepSpec's ``GatedMarkovHead`` (the paper's "gated" variant:
the previous-token embedding gated by the backbone hidden state h_k). Both are
stateless, so teacher-forced training and left-to-right sampling share
:meth:`MarkovHead.corrected_logits`. Parameters are kept and computed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.speculation.config import MARKOV_VARIANTS


class MarkovHead(nn.Module):
    """Previous-token bias B(x_{k−1}, ·) of rank r.

    Args:
        vocab_size: V.
        rank: r ≥ 1.
        hidden_size: d of the backbone hidden h_k (used by the gated variant).
        variant: ``"vanilla"`` or ``"gated"``.

    Raises:
        ValueError: rank < 1 or unknown variant.
    """

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, variant: str = "vanilla") -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"MarkovHead needs rank >= 1, got {rank}")
        if variant not in MARKOV_VARIANTS:
            raise ValueError(f"unknown markov variant {variant!r}")
        self.rank = rank
        self.variant = variant
        self.w1 = nn.Embedding(vocab_size, rank, dtype=torch.float32)
        self.w2 = nn.Linear(rank, vocab_size, bias=False, dtype=torch.float32)
        self.gate = nn.Linear(hidden_size + rank, rank, dtype=torch.float32) if variant == "gated" else None

    def prev_embedding(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """W1[x_{k−1}]: int64 ``[...]`` → fp32 ``[..., r]``."""
        return self.w1(prev_tokens.long())

    def bias(
        self, prev_tokens: torch.Tensor, hidden: torch.Tensor | None = None, vocab: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The additive bias for each slot.

        Args:
            prev_tokens: int64 ``[...]``, x_{k−1} of each slot.
            hidden: ``[..., d]`` backbone hidden h_k (any float dtype); required by
                the gated variant, ignored by vanilla.
            vocab: int64 ``[N]`` token ids: the bias of those columns only (a draft
                vocabulary), or ``None`` (all V).

        Returns:
            fp32 ``[..., V]`` (``[..., N]`` with ``vocab``).
        """
        e = self.prev_embedding(prev_tokens)
        if self.gate is not None:
            if hidden is None:
                raise ValueError("the gated Markov head needs the backbone hidden states")
            e = torch.sigmoid(self.gate(torch.cat([hidden.float(), e], dim=-1))) * e
        return self.w2(e) if vocab is None else F.linear(e, self.w2.weight[vocab])

    def corrected_logits(
        self,
        base_logits: torch.Tensor,
        prev_tokens: torch.Tensor,
        hidden: torch.Tensor | None = None,
        vocab: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """U_k + B(x_{k−1}, ·): ``[..., V]`` (any float) → fp32 ``[..., V]``; with ``vocab``
        the base logits and the result are over those N ids (``[..., N]``)."""
        return base_logits.float() + self.bias(prev_tokens, hidden, vocab)


def build_markov_head(vocab_size: int, rank: int, hidden_size: int, variant: str) -> MarkovHead | None:
    """The configured head, or ``None`` for rank 0 (parallel-only ablation)."""
    if rank == 0:
        return None
    return MarkovHead(vocab_size, rank, hidden_size, variant)


def apply_markov(
    head: MarkovHead | None,
    base_logits: torch.Tensor,
    prev_tokens: torch.Tensor,
    hidden: torch.Tensor | None,
    vocab: torch.Tensor | None = None,
) -> torch.Tensor:
    """Corrected logits, or the base logits in fp32 when there is no head (``vocab``: as
    :meth:`MarkovHead.corrected_logits`)."""
    if head is None:
        return base_logits.float()
    return head.corrected_logits(base_logits, prev_tokens, hidden, vocab)


__all__ = ["MarkovHead", "build_markov_head", "apply_markov"]
