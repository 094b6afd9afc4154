"""Teacher-forced target features for drafter training and evaluation (paper §3.1, §3.3).

The frozen target runs ONE ragged forward (:meth:`LlamaModel.forward`) over whole
token sequences (prompt + regenerated response) with ``tap_layers =
drafter.tap_layers``. That gives, for every position t:

* ``taps[t]`` — the residual stream after each tapped layer, fp32 ``[m, d]``:
  exactly what serving feeds :meth:`DSparkDrafter.extend_context` for a committed
  position (the drafter's context features);
* ``hidden[t]`` — the final-normed hidden state (target dtype) whose LM-head
  logits are the target's own next-token distribution p_t(· | x_{≤t}), i.e. the
  distribution of the token at t+1 (what verification compares drafts against).

Blocks. With the anchor at position p (token ``x_p``; its context is ``[0, p)``),
block slot j = 0..γ−1 (draft position k = j+1) predicts the token at ``p+k``; its
teacher distribution is p_t from ``hidden[p+k−1]`` and its Markov-head previous
token is x_{k−1} = ``tokens[p+k−1]`` (teacher forcing; x_0 = the anchor). A slot is
valid iff ``p+k ≤ L−1``.

Anchors are drawn in the response part only, ``p ∈ [prompt_len, L−2]`` — in
serving the first anchor is the first generated token at position ``prompt_len``
whose context is the whole prompt.

Everything returned is a normal (non-inference) tensor, so it can enter autograd
as a constant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from runtime.models.llama import LlamaModel, SeqSpan, load_llama
from runtime.models.loader import ensure_converted


@dataclass
class TeacherBatch:
    """Target features of N padded sequences.

    Attributes:
        tokens: int64 ``[N, L]`` ids (0-padded beyond ``lengths``).
        lengths: int64 ``[N]``.
        prompt_lens: int64 ``[N]``.
        taps: fp32 ``[N, L, m, d]`` tapped residual streams (0 in padding).
        hidden: ``[N, L, d]`` final-normed target hidden (target dtype; 0 in padding).
        lse: fp32 ``[N, L]`` logsumexp of the target's logits at each position, or ``None``
            (online features; p_t is then normalised from the full logits). Set by the
            feature cache (:mod:`training.feature_cache`), where ``hidden`` and ``lse``
            hold only the rows a block slot reads.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    prompt_lens: torch.Tensor
    taps: torch.Tensor
    hidden: torch.Tensor
    lse: torch.Tensor | None = None


def teacher_forward(
    target: LlamaModel,
    seqs: Sequence[torch.Tensor | np.ndarray | list[int]],
    prompt_lens: Sequence[int],
    tap_layers: Sequence[int],
) -> TeacherBatch:
    """One ragged target forward over ``seqs`` (each ≥ 1 token) → :class:`TeacherBatch`.

    Uses a private KV cache sized to the longest sequence (freed on return).
    """
    seqs = [torch.as_tensor(np.asarray(s), dtype=torch.long) for s in seqs]
    lens = [int(s.numel()) for s in seqs]
    N, L = len(seqs), max(lens)
    with torch.inference_mode():
        cache = target.new_cache(N, L)
        spans = [SeqSpan(cache.allocate(), 0, n) for n in lens]
        out = target.forward(torch.cat(seqs), spans, cache, None, list(tap_layers))
    del cache
    m, d = len(tap_layers), target.cfg.hidden_size
    taps = torch.zeros(N, L, m, d, dtype=torch.float32)
    hidden = torch.zeros(N, L, d, dtype=target.dtype)
    tokens = torch.zeros(N, L, dtype=torch.long)
    off = 0
    for i, n in enumerate(lens):
        taps[i, :n] = out.taps[off : off + n]
        hidden[i, :n] = out.hidden[off : off + n]
        tokens[i, :n] = seqs[i]
        off += n
    return TeacherBatch(tokens, torch.tensor(lens), torch.as_tensor(list(prompt_lens), dtype=torch.long), taps, hidden)


def sample_anchors(
    prompt_lens: torch.Tensor, lengths: torch.Tensor, num_anchors: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random distinct anchor positions per sequence in ``[prompt_len, L−2]``.

    Args:
        prompt_lens, lengths: int64 ``[N]``.
        num_anchors: A, anchors per sequence (fewer where the response is shorter).
        generator: torch RNG.

    Returns:
        ``(anchors, valid)``: int64 ``[N, A]`` positions sorted ascending (invalid
        entries hold ``min(prompt_len, L−1)``, an index inside the sequence), bool ``[N, A]``.
    """
    N = prompt_lens.numel()
    anchors = torch.zeros(N, num_anchors, dtype=torch.long)
    valid = torch.zeros(N, num_anchors, dtype=torch.bool)
    for i in range(N):
        lo, hi = int(prompt_lens[i]), int(lengths[i]) - 2  # inclusive range
        anchors[i] = min(lo, int(lengths[i]) - 1)  # a prompt cut at max_len leaves no response
        n = hi - lo + 1
        if n <= 0:
            continue
        take = min(n, num_anchors)
        pick = torch.randperm(n, generator=generator)[:take].sort().values + lo
        anchors[i, :take] = pick
        valid[i, :take] = True
    return anchors, valid


def all_anchors(prompt_len: int, length: int) -> torch.Tensor:
    """Every anchor position ``[prompt_len, L−2]`` of one sequence (evaluation), int64."""
    return torch.arange(prompt_len, max(length - 1, prompt_len))


@dataclass
class BlockTargets:
    """Teacher-forced block targets for anchors ``[N, A]`` and γ slots.

    Attributes:
        anchor_tokens: int64 ``[N, A]`` x_0.
        prev_tokens: int64 ``[N, A, γ]`` x_{k−1} (teacher forced).
        target_tokens: int64 ``[N, A, γ]`` x_k = tokens[p+k] (0 where invalid).
        valid: bool ``[N, A, γ]`` (anchor valid and p+k ≤ L−1).
        hidden_rows: ``[N, A, γ, d]`` target hidden at p+k−1 (for p_t; 0 where invalid).
        lse_rows: fp32 ``[N, A, γ]`` the target's logsumexp at p+k−1, or ``None`` (online).
    """

    anchor_tokens: torch.Tensor
    prev_tokens: torch.Tensor
    target_tokens: torch.Tensor
    valid: torch.Tensor
    hidden_rows: torch.Tensor
    lse_rows: torch.Tensor | None = None


def block_targets(tb: TeacherBatch, anchors: torch.Tensor, anchor_valid: torch.Tensor, gamma: int) -> BlockTargets:
    """Gather x_0, x_{k−1}, x_k and the p_t hidden rows for every block slot (module docstring)."""
    N, A = anchors.shape
    L = tb.tokens.shape[1]
    k = torch.arange(1, gamma + 1)
    tpos = anchors[:, :, None] + k  # [N, A, γ] position of x_k
    valid = anchor_valid[:, :, None] & (tpos <= (tb.lengths[:, None, None] - 1))
    tpos_c = tpos.clamp(max=L - 1)
    rows = torch.arange(N)[:, None, None]
    target_tokens = torch.where(valid, tb.tokens[rows, tpos_c], 0)
    prev_tokens = tb.tokens[rows, (tpos - 1).clamp(max=L - 1)]
    hidden_rows = tb.hidden[rows, (tpos - 1).clamp(max=L - 1)] * valid[..., None].to(tb.hidden.dtype)
    lse_rows = None if tb.lse is None else tb.lse[rows, (tpos - 1).clamp(max=L - 1)] * valid
    anchor_tokens = tb.tokens[torch.arange(N)[:, None], anchors]
    return BlockTargets(anchor_tokens, prev_tokens, target_tokens, valid, hidden_rows, lse_rows)


class TeacherHead:
    """The target's LM head for p_t in training, in fp32, optionally over a draft vocabulary.

    ``log_probs(h, lse)`` = ``h·W[D]ᵀ − lse`` when the logsumexp is known (feature cache):
    only the |D| columns are computed, normalised over all V. Without ``lse`` the full
    logits are computed and log-softmaxed, then restricted to D.
    """

    def __init__(self, target: LlamaModel, vocab: torch.Tensor | None = None) -> None:
        self.weight = target.lm_head_weight.detach().float()
        self.vocab = vocab
        self.weight_d = self.weight if vocab is None else self.weight[vocab].contiguous()

    def log_probs(self, hidden_rows: torch.Tensor, lse_rows: torch.Tensor | None = None) -> torch.Tensor:
        """log p_t at T = 1: fp32 ``[R, V]``, or ``[R, |D|]`` (columns = the vocabulary's ids).

        Args:
            hidden_rows: ``[R, d]`` final-normed target hidden states.
            lse_rows: fp32 ``[R]`` their full-vocabulary logsumexp, or ``None``.
        """
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            h = hidden_rows.float()
            if lse_rows is not None:
                return torch.nn.functional.linear(h, self.weight_d) - lse_rows.float()[:, None]
            lp = torch.log_softmax(torch.nn.functional.linear(h, self.weight), dim=-1)
            return lp if self.vocab is None else lp[:, self.vocab]


def target_log_probs(target: LlamaModel, hidden_rows: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p_t from hidden rows ``[..., d]`` via the shared LM head → fp32 ``[..., V]``."""
    with torch.no_grad():
        shape = hidden_rows.shape[:-1]
        logits = target.lm_head(hidden_rows.reshape(-1, hidden_rows.shape[-1]).to(target.dtype))
        return torch.log_softmax(logits / temperature, dim=-1).view(*shape, -1)


def build_target(threads: int = 2, dtype: torch.dtype = torch.bfloat16) -> LlamaModel:
    """The frozen target from the model cache (bf16 = as served), with ``threads`` torch threads."""
    torch.set_num_threads(threads)
    return load_llama(ensure_converted(), dtype)
