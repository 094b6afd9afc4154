"""Prompt-lookup (n-gram) drafter: the model-free baseline (Saxena 2023, "Prompt
Lookup Decoding"; vLLM's ``ngram`` speculator).

Find the most recent earlier occurrence of the sequence's last n tokens in
prompt + output, trying n = ``max_ngram`` down to ``min_ngram`` (longest match
wins), and propose the tokens that followed it (up to γ). The proposal is
deterministic, so its draft distribution is one-hot; with the standard verifier
(:func:`runtime.speculation.verifier.verify`) that is lossless at any temperature:
x is accepted with probability p_t(x), and a rejection resamples from
norm(max(0, p_t − onehot(x))) = p_t without x.
"""

from __future__ import annotations

from typing import Sequence

import torch


def propose_ngram(tokens: Sequence[int], gamma: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Draft continuation of ``tokens`` by n-gram lookup.

    Args:
        tokens: prompt + generated token ids so far (the last one is the anchor).
        gamma: max tokens to propose.
        max_ngram, min_ngram: n-gram sizes to try, longest first.

    Returns:
        Up to ``gamma`` token ids following the most recent earlier occurrence of the
        longest matching suffix n-gram; ``[]`` when nothing matches (or gamma ≤ 0).
        The continuation may run into the suffix itself (repeating patterns).
    """
    toks = list(tokens)
    L = len(toks)
    if gamma <= 0:
        return []
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = toks[L - n :]
        # Most recent start i < L − n whose n-gram equals the suffix.
        for i in range(L - n - 1, -1, -1):
            if toks[i : i + n] == suffix:
                return toks[i + n : i + n + gamma]
    return []


def one_hot_probs(proposal: Sequence[int], vocab_size: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """One-hot draft distributions fp32 ``[len(proposal), V]`` for the verifier."""
    p = torch.zeros(len(proposal), vocab_size, dtype=torch.float32, device=device)
    if proposal:
        p[torch.arange(len(proposal)), torch.tensor(list(proposal), dtype=torch.long)] = 1.0
    return p
