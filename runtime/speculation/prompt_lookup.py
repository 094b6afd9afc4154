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

import json
from pathlib import Path
from typing import Sequence

import torch

#: Per-(match length n, position k) acceptance of n-gram drafts, measured by
#: ``python -m training.cli calibrate-ngram`` (:func:`runtime.speculation.prompt_lookup.ngram_survival`).
CALIBRATION_FILE = Path(__file__).resolve().parent / "checkpoints" / "ngram_calibration.json"


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


class NgramIndex:
    """Incremental prompt-lookup index of one growing token sequence: the same proposals as
    :func:`propose_ngram` (most recent earlier occurrence of the longest matching suffix
    n-gram), in O(max_ngram) dict operations per new token instead of a scan of the history.

    For each n it maps an n-gram to the most recent start i whose n-gram has a known
    continuation (i + n < len(tokens)), which is exactly the candidate set of the scan.

    Args:
        max_ngram, min_ngram: n-gram sizes tried, longest first (as :func:`propose_ngram`).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        self._last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_ngram, max_ngram + 1)}

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append tokens (the sequence's next ids, in order)."""
        toks = self.tokens
        for t in new_tokens:
            toks.append(int(t))
            end = len(toks) - 1  # the n-grams ending just before the new token now have a continuation
            for n, table in self._last.items():
                if end >= n:
                    table[tuple(toks[end - n : end])] = end - n

    def sync(self, tokens: Sequence[int]) -> None:
        """Index the tokens of ``tokens`` beyond the ones seen (it must extend them)."""
        if len(tokens) > len(self.tokens):
            self.extend(tokens[len(self.tokens):])

    def propose(self, gamma: int) -> tuple[list[int], int]:
        """(up to γ draft tokens, the matched n-gram length n); ``([], 0)`` when nothing matches."""
        toks = self.tokens
        L = len(toks)
        if gamma <= 0:
            return [], 0
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            i = self._last[n].get(tuple(toks[L - n :]))
            if i is not None:
                return toks[i + n : i + n + gamma], n
        return [], 0


def ngram_survival(path: str | Path = CALIBRATION_FILE) -> dict[int, list[float]]:
    """Calibrated per-position acceptance c_{n,k} of n-gram drafts: ``{n: [c_1, c_2, …]}``,
    c_k = P(x_k accepted | x_1..x_{k−1} accepted, match length n), measured at T = 0 on the
    drafter's training responses (``training.ngram``). These are the confidences the
    verification budget (:mod:`runtime.speculation.budget`) ranks n-gram drafts by.

    Raises:
        FileNotFoundError: the calibration file is missing.
        ValueError: it holds a value outside [0, 1].
    """
    raw = json.loads(Path(path).read_text())["survival"]
    out = {int(n): [float(c) for c in cs] for n, cs in raw.items()}
    for n, cs in out.items():
        if any(not 0.0 <= c <= 1.0 for c in cs):
            raise ValueError(f"n-gram calibration for n={n} has a value outside [0, 1]: {cs}")
    return out


def one_hot_probs(proposal: Sequence[int], vocab_size: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """One-hot draft distributions fp32 ``[len(proposal), V]`` for the verifier."""
    p = torch.zeros(len(proposal), vocab_size, dtype=torch.float32, device=device)
    if proposal:
        p[torch.arange(len(proposal)), torch.tensor(list(proposal), dtype=torch.long)] = 1.0
    return p
