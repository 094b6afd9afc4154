"""The confidence head: per-position survival estimate c_k (paper §3.1, §3.2.1).

    c_k = σ(wᵀ [h_k ; W1[x_{k−1}]] + b)

a single linear layer over the backbone hidden h_k and the Markov head's
previous-token embedding (just h_k when the Markov head is disabled, rank 0). It
estimates the probability that draft token x_k is accepted given x_1..x_{k−1} were;
the scheduler multiplies them into prefix survival a_{r,j} = Π_{i≤j} c_{r,i}
(§3.2.2). Trained with BCE against c*_k = 1 − ½‖p_d,k − p_t,k‖₁ (§3.3).

Sequential Temperature Scaling (§3.2.1) calibrates it after training:
c_k = σ(logit_k / T_k) with per-position temperatures from the checkpoint.
Everything here is fp32.
"""

from __future__ import annotations

import torch
from torch import nn


class ConfidenceHead(nn.Module):
    """Linear(d + r → 1), fp32.

    Args:
        hidden_size: d.
        markov_rank: r (0 → the input is h_k alone).
    """

    def __init__(self, hidden_size: int, markov_rank: int) -> None:
        super().__init__()
        self.markov_rank = markov_rank
        self.proj = nn.Linear(hidden_size + markov_rank, 1, dtype=torch.float32)

    def forward(self, hidden: torch.Tensor, prev_embedding: torch.Tensor | None) -> torch.Tensor:
        """Pre-sigmoid confidence logits.

        Args:
            hidden: ``[..., d]`` backbone hidden h_k (any float dtype).
            prev_embedding: ``[..., r]`` W1[x_{k−1}] (fp32), or ``None`` iff r = 0.

        Returns:
            fp32 ``[...]``.

        Raises:
            ValueError: ``prev_embedding`` presence disagrees with ``markov_rank``.
        """
        if (prev_embedding is None) != (self.markov_rank == 0):
            raise ValueError("prev_embedding must be given iff markov_rank > 0")
        x = hidden.float()
        if prev_embedding is not None:
            x = torch.cat([x, prev_embedding.float()], dim=-1)
        return self.proj(x).squeeze(-1)


def calibrated_confidence(logits: torch.Tensor, temperatures: torch.Tensor | None) -> torch.Tensor:
    """STS: c_k = σ(logit_k / T_k).

    Args:
        logits: fp32 ``[B, γ']`` confidence logits of slots 1..γ' (γ' ≤ γ).
        temperatures: fp32 ``[γ]`` (T_1..T_γ) or ``None`` (all 1).

    Returns:
        fp32 ``[B, γ']`` in (0, 1).
    """
    if temperatures is None:
        return torch.sigmoid(logits.float())
    return torch.sigmoid(logits.float() / temperatures[: logits.shape[-1]].to(logits.device, torch.float32))
