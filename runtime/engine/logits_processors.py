"""Logits processors: ``min_tokens``, ``logit_bias`` and the repetition, frequency and
presence penalties, applied to a request's target logits before temperature, ``min_p``,
top-k and top-p (:func:`runtime.engine.sampler.warp_probs`).

Order and semantics are vLLM's (``vllm/v1/sample/sampler.py``: the non-argmax-invariant
processors — min tokens, then logit bias — then ``apply_penalties``: repetition,
frequency, presence), with OpenAI's definition of the last two (API reference, "Chat",
``frequency_penalty``): for a row whose output so far holds token j c_j times,

* ``min_tokens``: while fewer than ``min_tokens`` completion tokens precede the row, EOS
  (unless ``ignore_eos``) and every ``stop_token_ids`` entry get −inf — unless that would
  leave the row no finite logit at all (a grammar that allows only EOS), then the row is
  left as it was: the grammar wins;
* ``logit_bias``: ``logit[j] += bias[j]``;
* ``repetition_penalty`` r (vLLM/HF ``RepetitionPenaltyLogitsProcessor``): for every j in
  the prompt or the output, ``logit[j] / r`` when it is > 0, ``logit[j] · r`` otherwise
  (capped at ``MAX_LOGIT``, so a tiny r cannot make +inf);
* ``frequency_penalty`` f and ``presence_penalty`` p: ``logit[j] −= c_j · f + [c_j > 0] · p``.

**Per verified position.** These depend on the tokens generated before the row. In a
speculative round request r's verification rows 0..ℓ judge output positions g..g+ℓ
(g = tokens generated so far), so row k is processed as if drafts x_1..x_k had been
generated: its counts are over the output and the draft prefix, its ``min_tokens`` test
at position g + k — exactly the logits plain decoding would process at that position. So
standard verification (accept with min(1, p_t'/p_d), residual max(0, p_t' − p_d)) against
the processed target p_t' is lossless whatever the drafter's p_d was (the drafter need
not know about penalties), and T = 0 is the argmax of the processed logits: speculative
text = plain text. Like grammar masks (:mod:`runtime.engine.grammar`), which are per row too.

Cost: nothing for requests without these parameters (the engine checks
:attr:`runtime.interface.SamplingParams.uses_logits_processors` once per request). For the
others, per step, a few small tensor ops over the vocabulary of interest (the tokens of the
output and drafts, plus the prompt's for the repetition penalty), never a pass over V·rows
except for the rows ``min_tokens`` suppresses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from runtime.interface import SamplingParams

MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: [−100, 100]
MAX_PENALTY = 2.0  # OpenAI's range for presence/frequency penalties: [−2, 2]
MAX_LOGIT = 1e30  # a penalised logit is capped here (finite: softmax stays defined)


def check_params(params: SamplingParams, vocab_size: int) -> str | None:
    """Why ``params`` cannot be served (a message for the client), or ``None``.

    Checks the ranges of the processors' parameters and ``min_p``: penalties in [−2, 2],
    ``repetition_penalty`` > 0, ``logit_bias`` ids in [0, ``vocab_size``) with biases in
    [−100, 100], ``stop_token_ids`` in [0, ``vocab_size``), ``min_tokens`` ≥ 0,
    ``min_p`` in [0, 1]; all finite. The gateway refuses these with a 400 first; the engine
    checks again so a bad value can never fail a step of the whole batch.
    """
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(params, name)
        if not (math.isfinite(v) and -MAX_PENALTY <= v <= MAX_PENALTY):
            return f"{name} must be in [-2, 2], got {v}"
    if not (math.isfinite(params.repetition_penalty) and params.repetition_penalty > 0):
        return f"repetition_penalty must be > 0, got {params.repetition_penalty}"
    if not (math.isfinite(params.min_p) and 0.0 <= params.min_p <= 1.0):
        return f"min_p must be in [0, 1], got {params.min_p}"
    if params.min_tokens < 0:
        return f"min_tokens must be >= 0, got {params.min_tokens}"
    for tid, bias in params.logit_bias:
        if not 0 <= int(tid) < vocab_size:
            return f"logit_bias token id {tid} is not in [0, {vocab_size})"
        if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            return f"logit_bias of token {tid} must be in [-100, 100], got {bias}"
    for tid in params.stop_token_ids:
        if not 0 <= int(tid) < vocab_size:
            return f"stop token id {tid} is not in [0, {vocab_size})"
    return None


@dataclass
class RequestProcessors:
    """One request's logits processors, built once when it is added (:meth:`of`).

    Attributes:
        min_tokens: see the module docstring; ``stop_ids`` int64 ``[s]`` are the tokens it
            suppresses (``None``: none).
        bias_ids, bias_values: int64 ``[b]`` / fp32 ``[b]`` (``None``: no ``logit_bias``).
        repetition, frequency, presence: the penalties (1, 0, 0 = off).
        prompt_ids: int64, the prompt's distinct token ids (only with a repetition penalty).
    """

    min_tokens: int = 0
    stop_ids: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    prompt_ids: torch.Tensor | None = None

    @classmethod
    def of(cls, params: SamplingParams, prompt_token_ids: Sequence[int], eos_token_id: int) -> RequestProcessors | None:
        """The processors of a request, or ``None`` when it uses none (the fast path).
        ``params`` must have passed :func:`check_params`."""
        if not params.uses_logits_processors:
            return None
        stops = sorted({int(t) for t in params.stop_token_ids} | ({int(eos_token_id)} if not params.ignore_eos else set()))
        bias = dict((int(t), float(b)) for t, b in params.logit_bias)  # a repeated id: the last bias wins
        rep = float(params.repetition_penalty)
        return cls(
            min_tokens=int(params.min_tokens),
            stop_ids=torch.tensor(stops, dtype=torch.long) if params.min_tokens > 0 and stops else None,
            bias_ids=torch.tensor(list(bias), dtype=torch.long) if bias else None,
            bias_values=torch.tensor(list(bias.values()), dtype=torch.float32) if bias else None,
            repetition=rep,
            frequency=float(params.frequency_penalty),
            presence=float(params.presence_penalty),
            prompt_ids=torch.tensor(sorted(set(map(int, prompt_token_ids))), dtype=torch.long) if rep != 1.0 else None,
        )

    @property
    def penalises(self) -> bool:
        return self.repetition != 1.0 or self.frequency != 0.0 or self.presence != 0.0

    def apply(self, logits: torch.Tensor, output: Sequence[int], drafts: Sequence[int] = ()) -> None:
        """Process the request's rows in place.

        Args:
            logits: fp32 ``[1 + len(drafts), V]``, a view of the step's (processed) logits:
                row k decides output position ``len(output) + k``.
            output: the completion tokens generated so far (the anchor included).
            drafts: the draft tokens x_1..x_ℓ verified in this round (row k is processed
                with x_1..x_k appended to ``output``); empty for a plain step.
        """
        n = logits.shape[0]
        if n != 1 + len(drafts):
            raise ValueError(f"{n} rows for {len(drafts)} drafts")
        g = len(output)
        if self.stop_ids is not None and g < self.min_tokens:
            self._suppress_stops(logits[: min(n, self.min_tokens - g)])
        if self.bias_ids is not None:
            logits.index_add_(1, self.bias_ids, self.bias_values.expand(n, -1))
        if self.penalises and (g or drafts or self.prompt_ids is not None):
            self._penalise(logits, output, drafts)

    def _suppress_stops(self, rows: torch.Tensor) -> None:
        saved = rows[:, self.stop_ids].clone()
        rows.index_fill_(1, self.stop_ids, float("-inf"))
        dead = ~torch.isfinite(rows).any(-1)
        if bool(dead.any()):  # nothing left but the stop tokens (a grammar): let it end
            for r in dead.nonzero().squeeze(-1).tolist():
                rows[r, self.stop_ids] = saved[r]

    def _penalise(self, logits: torch.Tensor, output: Sequence[int], drafts: Sequence[int]) -> None:
        n, g = logits.shape[0], len(output)
        hist = torch.tensor([*output, *drafts], dtype=torch.long)
        ids = hist if self.prompt_ids is None else torch.cat([self.prompt_ids, hist])
        vocab = torch.unique(ids)  # sorted: the tokens whose logits change
        pos = torch.searchsorted(vocab, hist)
        counts = torch.zeros(n, vocab.numel(), dtype=torch.float32)
        counts[:, :] = torch.bincount(pos[:g], minlength=vocab.numel()).float()
        if n > 1:  # row k also counts drafts x_1..x_k
            step = torch.zeros_like(counts)
            step[torch.arange(1, n), pos[g:]] = 1.0
            counts += step.cumsum(0)
        vals = logits[:, vocab]
        if self.repetition != 1.0:
            seen = (counts > 0) | torch.isin(vocab, self.prompt_ids)[None, :]
            r = self.repetition
            vals = torch.where(seen, torch.where(vals > 0, vals / r, vals * r), vals).clamp_(max=MAX_LOGIT)
        if self.frequency:
            vals = vals - self.frequency * counts
        if self.presence:
            vals = vals - self.presence * (counts > 0).float()
        logits[:, vocab] = vals


def apply_processors(
    logits: torch.Tensor,
    processors: Sequence[RequestProcessors | None],
    outputs: Sequence[Sequence[int]],
    drafts: Sequence[Sequence[int]] | None = None,
    copy: bool = True,
) -> torch.Tensor:
    """``logits`` with every request's processors applied to its rows (module docstring).

    Args:
        logits: ``[Σ (1 + ℓ_r), V]`` (any float dtype): request r's ``1 + ℓ_r`` rows in
            order, ℓ_r = ``len(drafts[r])`` (0 when ``drafts`` is ``None``).
        processors: per request, its :class:`RequestProcessors` or ``None``.
        outputs: per request, its completion tokens so far.
        drafts: per request, the verified draft tokens (``None``: one row each).
        copy: ``False``: ``logits`` is a fp32 tensor of the caller's own (e.g. already
            grammar-masked), processed in place.

    Returns:
        ``logits`` itself when no request has processors, else a fp32 copy (with ``copy``)
        with their rows processed; the raw logits are never modified (logprobs read them).
    """
    if all(p is None for p in processors):
        return logits
    out = logits.to(torch.float32, copy=True) if copy else logits.float()
    row = 0
    for i, proc in enumerate(processors):
        d = drafts[i] if drafts is not None else ()
        n = 1 + len(d)
        if proc is not None:
            proc.apply(out[row : row + n], outputs[i], d)
        row += n
    if row != out.shape[0]:
        raise ValueError(f"{out.shape[0]} rows, expected {row}")
    return out
