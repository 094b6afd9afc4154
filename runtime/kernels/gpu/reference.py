"""Torch side of the GPU kernels: the exact draw, the ragged layout, the Markov reference.

Kernel and torch are pure functions of pre-drawn uniforms, so they can be compared
token for token:

* ragged chain speculative sampling — its torch implementation (and so the
  reference of ``triton_verify``) is the one verification module,
  :func:`runtime.speculation.verifier.verify_chain`; this module holds the layout helpers
  (:func:`chain_offsets`, :func:`check_chain_shapes`) both share.
* :func:`markov_sample_reference` — DSpark's Markov-head left-to-right draft
  sampling (paper §3.1, "Markov head"): logits_k = U_k + W1[x_{k−1}]·W2, x_0 = anchor.

Exact inverse-CDF draw (shared by every kernel in this package)
---------------------------------------------------------------
A floating-point cumulative sum depends on summation order, and a GPU scan adds
in a different order than ``torch.cumsum``. To make "the same draw" well defined
the weights are first quantised to integers and summed in int64, where addition
is exact and order-independent:

1. ``q_i = trunc(clamp(w_i, 0, 1) · 2**QUANT_BITS)`` (int64; ``QUANT_BITS = 40``).
   The fp32 product by a power of two is exact, so q_i is a deterministic function
   of the fp32 weight. Weights below 2**−40 (≈ 9.1e−13) get weight 0 and are never
   drawn — the same order of loss as an fp32 cumsum, which cannot resolve them
   either. Weights are probabilities: values > 1 are clipped to 1.
2. ``total = Σ q_i`` (exact; < 2**62 for V ≤ 2**22).
3. The uniform is quantised to ``u_q = clamp(trunc(u · 2**24), 0, 2**24 − 1)``
   (exact for fp32 u; torch.rand's fp32 uniforms are multiples of 2**−24), and the
   threshold is ``t = floor(u_q · total / 2**24)`` computed exactly in int64 as
   ``(total >> 24)·u_q + (((total & (2**24−1))·u_q) >> 24)``.
4. The token is the smallest i with ``Σ_{j≤i} q_j > t``, i.e.
   ``#{i : cumsum_i ≤ t}``. Since t < total it always has q_i > 0. If total = 0
   (an all-zero row: an input error) the result is clamped to V − 1.

Hence "exact" means bit-identical: given the same fp32 weights and fp32 uniform,
kernel and reference return the same token; there is no ambiguous CDF boundary.
The draw's probabilities equal q_i / total up to 2**−24 (the uniform's
resolution). Where the *weights* are themselves computed (the Markov kernel's
softmax) they agree with torch only to fp32 rounding (~1e−7 relative), so tokens
can differ when u lands within that distance of a CDF boundary (probability
~1e−7 per draw); the tests count such cases and require none on their data.

Inputs must be finite; NaN weights give unspecified tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

#: Fixed-point bits of the quantised CDF weights (see module docstring).
QUANT_BITS = 40
#: Fixed-point bits of the quantised uniform.
UNIFORM_BITS = 24
#: Largest vocabulary for which Σ q_i cannot overflow int64 (2**22 · 2**40 = 2**62).
MAX_VOCAB = 1 << 22

_QSCALE = float(1 << QUANT_BITS)
_USCALE = float(1 << UNIFORM_BITS)
_UMASK = (1 << UNIFORM_BITS) - 1


class MarkovResult(NamedTuple):
    """Output of the Markov-head sequential sampler (reference and kernel alike).

    Attributes:
        tokens: int64 ``[B, γ]`` draft tokens x_1..x_γ.
        p_draft: fp32 ``[B, γ, V]`` the distributions the tokens were drawn from
            (one-hot for greedy rows), or ``None`` when not requested.
        prev_embeddings: fp32 ``[B, γ, r]``: W1[x_{k−1}] used at step k (x_0 = anchor),
            the confidence head's second input.
    """

    tokens: torch.Tensor
    p_draft: torch.Tensor | None
    prev_embeddings: torch.Tensor


def quantize_weights(w: torch.Tensor) -> torch.Tensor:
    """Fixed-point CDF weights: fp32 ``[..., V]`` → int64 ``trunc(clamp(w, 0, 1)·2**40)``."""
    return (w.float().clamp(0.0, 1.0) * _QSCALE).to(torch.int64)


def cdf_threshold(u: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Exact integer threshold ``floor(u_q · total / 2**24)``.

    Args:
        u: fp32 ``[N]`` uniforms in [0, 1) (clamped).
        total: int64 ``[N]`` quantised row totals (< 2**63).

    Returns:
        int64 ``[N]``; ``< total`` whenever total > 0.
    """
    uq = (u.float() * _USCALE).to(torch.int64).clamp(0, _UMASK)
    return (total >> UNIFORM_BITS) * uq + (((total & _UMASK) * uq) >> UNIFORM_BITS)


def inverse_cdf_draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The package's exact inverse-CDF draw (module docstring, steps 1–4).

    Args:
        weights: fp32 ``[N, V]`` non-negative weights (need not be normalised).
        u: fp32 ``[N]`` uniforms in [0, 1).

    Returns:
        int64 ``[N]`` token ids: smallest i with Σ_{j≤i} q_j > floor(u_q·Σq/2**24).

    Raises:
        ValueError: V > :data:`MAX_VOCAB`.
    """
    if weights.shape[-1] > MAX_VOCAB:
        raise ValueError(f"vocab {weights.shape[-1]} > {MAX_VOCAB}: the int64 CDF could overflow")
    q = quantize_weights(weights)
    cum = q.cumsum(-1)
    thr = cdf_threshold(u, cum[:, -1])
    # #{i : cum_i ≤ t}: cum is non-decreasing, so a binary search (right side) counts it
    # (the compare-and-sum over V it replaces cost ~20× more on a 49,152-token CPU row)
    idx = torch.searchsorted(cum, thr.unsqueeze(-1), right=True).squeeze(-1)
    return idx.clamp(max=weights.shape[-1] - 1)


def chain_offsets(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row offsets of the ragged layout.

    Args:
        lengths: int ``[R]`` ℓ_r ≥ 0.

    Returns:
        ``(t_off, d_off)`` int64 ``[R]``: ``t_off[r] = Σ_{s<r}(ℓ_s + 1)`` (first
        p_target row of request r) and ``d_off[r] = Σ_{s<r} ℓ_s`` (first p_draft row).
    """
    lens = lengths.to(torch.int64)
    d_off = torch.cumsum(lens, 0) - lens
    t_off = d_off + torch.arange(lens.numel(), device=lens.device)
    return t_off, d_off


def check_chain_shapes(p_target, p_draft, draft_tokens, lengths, u_accept, u_sample, max_len: int | None) -> int:
    """Validate the ragged layout of the chain verification's tensors (the arguments of
    :func:`runtime.speculation.verifier.verify_chain`, same names, types and shapes); returns
    max_ℓ (one host sync unless ``max_len`` given).

    Raises:
        ValueError: wrong ranks, row counts inconsistent with ``lengths``, V too
            large, or ``max_len`` < the true max ℓ.
    """
    if p_target.dim() != 2 or p_draft.dim() != 2 or p_draft.shape[1] != p_target.shape[1]:
        raise ValueError(f"p_target {tuple(p_target.shape)} / p_draft {tuple(p_draft.shape)} must be [*, V]")
    if p_target.shape[1] > MAX_VOCAB:
        raise ValueError(f"vocab {p_target.shape[1]} > {MAX_VOCAB}")
    R = lengths.numel()
    D = p_draft.shape[0]
    if p_target.shape[0] != D + R or draft_tokens.numel() != D or u_accept.numel() != D or u_sample.numel() != R:
        raise ValueError(
            f"ragged layout mismatch: R={R}, p_target rows {p_target.shape[0]} (want D+R), p_draft rows {D}, "
            f"draft_tokens {draft_tokens.numel()}, u_accept {u_accept.numel()} (want D), u_sample {u_sample.numel()} (want R)"
        )
    if max_len is None:
        if R == 0:
            return 0
        mx, tot = torch.stack([lengths.max(), lengths.sum()]).tolist()
        if tot != D:
            raise ValueError(f"sum(lengths) = {tot} but p_draft has {D} rows")
        if min(lengths.tolist()) < 0:
            raise ValueError("lengths must be >= 0")
        return int(mx)
    return int(max_len)


def check_markov_shapes(
    base_logits: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    anchors: torch.Tensor,
    temperature: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[int, int, int, int]:
    """Validate the Markov sampler's inputs; returns ``(B, γ, V, r)``.

    Raises:
        ValueError: on any shape mismatch or V > :data:`MAX_VOCAB`.
    """
    if base_logits.dim() != 3:
        raise ValueError(f"base_logits must be [B, γ, V], got {tuple(base_logits.shape)}")
    B, G, V = base_logits.shape
    if w1.dim() != 2 or w1.shape[0] != V:
        raise ValueError(f"W1 must be [V={V}, r], got {tuple(w1.shape)}")
    r = w1.shape[1]
    if tuple(w2.shape) != (r, V):
        raise ValueError(f"W2 must be [r={r}, V={V}], got {tuple(w2.shape)}")
    if anchors.shape != (B,) or temperature.shape != (B,) or uniforms.shape != (B, G):
        raise ValueError(
            f"anchors {tuple(anchors.shape)} / temperature {tuple(temperature.shape)} must be [{B}], "
            f"uniforms {tuple(uniforms.shape)} must be [{B}, {G}]"
        )
    if V > MAX_VOCAB:
        raise ValueError(f"vocab {V} > {MAX_VOCAB}")
    return B, G, V, r


def markov_sample_reference(
    base_logits: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    anchors: torch.Tensor,
    temperature: torch.Tensor,
    uniforms: torch.Tensor,
    *,
    return_probs: bool = True,
) -> MarkovResult:
    """Markov-head sequential draft sampling (DSpark §3.1, vanilla head; torch reference).

    For k = 1..γ: ``logits_k = float(U_k) + W1[x_{k−1}] @ W2`` (x_0 = anchor);
    temperature T_b > 0: ``p_k = softmax(logits_k / T_b)`` and x_k is the exact
    inverse-CDF draw (module docstring) of p_k with ``uniforms[b, k−1]``;
    T_b ≤ 0 (greedy): p_k is one-hot at ``argmax logits_k`` (ties → lowest index)
    and the uniform is unused. Temperature only; top-k/top-p are not supported here
    (the engine drafts such requests through its non-fused path,
    :func:`runtime.kernels.dispatch.fused_markov_supported`).

    Args:
        base_logits: fp32 or bf16 ``[B, γ, V]`` parallel-backbone logits U.
        w1: fp32 ``[V, r]``; w2: fp32 ``[r, V]``.
        anchors: int64 ``[B]`` x_0 in [0, V).
        temperature: fp32 ``[B]`` (0 = greedy).
        uniforms: fp32 ``[B, γ]`` in [0, 1).
        return_probs: also return p_d ``[B, γ, V]``.

    Returns:
        :class:`MarkovResult`.

    Raises:
        ValueError: see :func:`check_markov_shapes`.
    """
    B, G, V, r = check_markov_shapes(base_logits, w1, w2, anchors, temperature, uniforms)
    dev = base_logits.device
    w1f, w2f = w1.float(), w2.float()
    temp = temperature.to(dev, torch.float32)
    greedy = temp <= 0
    t_eff = torch.where(greedy, torch.ones_like(temp), temp).unsqueeze(1)
    u_all = uniforms.to(dev, torch.float32)
    x = anchors.to(dev, torch.int64)
    tokens = torch.empty(B, G, dtype=torch.int64, device=dev)
    embs = torch.empty(B, G, r, dtype=torch.float32, device=dev)
    probs = torch.empty(B, G, V, dtype=torch.float32, device=dev) if return_probs else None
    for k in range(G):
        e = w1f[x]
        logits = base_logits[:, k].float() + e @ w2f
        p = torch.softmax(logits / t_eff, dim=-1)
        am = logits.argmax(-1)
        p = torch.where(greedy.unsqueeze(1), torch.nn.functional.one_hot(am, V).float(), p)
        x = torch.where(greedy, am, inverse_cdf_draw(p, u_all[:, k]))
        tokens[:, k] = x
        embs[:, k] = e
        if probs is not None:
            probs[:, k] = p
    return MarkovResult(tokens=tokens, p_draft=probs, prev_embeddings=embs)


__all__ = [
    "QUANT_BITS",
    "UNIFORM_BITS",
    "MAX_VOCAB",
    "MarkovResult",
    "quantize_weights",
    "cdf_threshold",
    "inverse_cdf_draw",
    "chain_offsets",
    "check_chain_shapes",
    "check_markov_shapes",
    "markov_sample_reference",
]
