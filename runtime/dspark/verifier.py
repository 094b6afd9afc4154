"""Lossless speculative sampling over a ragged batch (Leviathan et al. 2023, Alg. 1;
Chen et al. 2023; DSpark notes "Speculative decoding recap").

Per request r with ℓ_r ≥ 0 verified draft tokens x_1..x_ℓ (drawn from p_d,1..p_d,ℓ):
left to right, x_k is accepted with probability min(1, p_t,k(x_k) / p_d,k(x_k))
(one U(0,1) per draft position from the request's generator, all ℓ_r drawn up
front); at the first rejection k a token is drawn from norm(max(0, p_t,k − p_d,k))
and the round ends; if all ℓ_r are accepted the "bonus" token is drawn from
p_t,ℓ+1. The emitted tokens (a_r accepted drafts + that one token) are
distributed exactly as a_r + 1 tokens sampled from the target. Greedy
(temperature 0: one-hot p_t and p_d) reduces to "accept iff x_k == argmax p_t,k",
and the emitted text equals greedy autoregressive decoding.

Ragged row layout (no padding), requests in order r = 0..R−1, with
``t_off[r] = Σ_{s<r} (ℓ_s + 1)`` and ``d_off[r] = Σ_{s<r} ℓ_s``:

* ``p_target`` ``[Σ (ℓ_r + 1), V]``: row ``t_off[r] + k`` (k = 0..ℓ_r) is the
  target's warped distribution of the token *after* verification input k of request
  r, where input 0 is the anchor and input k ≥ 1 is draft x_k. So row
  ``t_off[r] + k`` (k < ℓ_r) judges draft x_{k+1}, and row ``t_off[r] + ℓ_r`` is the
  bonus distribution. This is exactly the logits of the verification forward's
  input rows, warped with the request's params.
* ``p_draft`` ``[Σ ℓ_r, V]`` and ``draft_tokens`` ``[Σ ℓ_r]``: row ``d_off[r] + k``
  is x_{k+1} of request r and the distribution it was drawn from. Note
  ``t_off[r] + k == d_off[r] + k + r``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from runtime.config import env
from runtime.sampler import sample, uniform, warp_probs


@dataclass
class VerifyResult:
    """Outcome of :func:`verify` for R requests.

    Attributes:
        accepted: int64 ``[R]``, a_r ∈ [0, ℓ_r] accepted draft tokens.
        next_tokens: int64 ``[R]``, the one extra token (residual resample, or the
            bonus when a_r == ℓ_r) — the new anchor.
        draft_tokens: the ``draft_tokens`` input (flat ``[Σ ℓ_r]``).
        lengths: int64 ``[R]``, ℓ_r.
    """

    accepted: torch.Tensor
    next_tokens: torch.Tensor
    draft_tokens: torch.Tensor
    lengths: torch.Tensor

    @property
    def num_emitted(self) -> torch.Tensor:
        """int64 ``[R]``: a_r + 1 (τ of this round, bonus included)."""
        return self.accepted + 1

    def tokens(self) -> list[list[int]]:
        """Emitted tokens per request: accepted drafts then the extra token."""
        d_off = torch.cumsum(self.lengths, 0) - self.lengths
        drafts = self.draft_tokens.tolist()
        out = []
        for off, a, nxt in zip(d_off.tolist(), self.accepted.tolist(), self.next_tokens.tolist()):
            out.append(drafts[off : off + a] + [nxt])
        return out


def verify(
    p_target: torch.Tensor,
    p_draft: torch.Tensor,
    draft_tokens: torch.Tensor,
    lengths: Sequence[int] | torch.Tensor,
    generators: Sequence[torch.Generator],
    *,
    residual_from: str = "residual",
) -> VerifyResult:
    """Speculative sampling for a ragged batch (layout: module docstring).

    Args:
        p_target: fp32 ``[Σ(ℓ_r+1), V]`` target distributions (after the request's
            temperature/top-k/top-p warping, :func:`runtime.sampler.warp_probs`).
        p_draft: fp32 ``[Σ ℓ_r, V]`` the distributions the drafts were actually drawn
            from (DSpark: warped Markov-corrected, :attr:`DraftSample.probs`).
        draft_tokens: int64 ``[Σ ℓ_r]``.
        lengths: ℓ_r per request (0 allowed: plain decoding step for that request).
        generators: one per request. Consumption per request, in order: ℓ_r
            uniforms (:func:`runtime.sampler.uniform`), then one draw for the extra
            token (:func:`runtime.sampler.sample`; none if that row is one-hot).
        residual_from: ``"residual"`` (correct). ``"target"`` is a TEST-ONLY planted
            bug (resample from p_t instead of norm(max(0, p_t − p_d))).

    Returns:
        :class:`VerifyResult`.

    Raises:
        ValueError: shapes inconsistent with ``lengths``.
    """
    device = p_target.device
    lens = torch.as_tensor(lengths, dtype=torch.long).cpu()
    R, D = lens.numel(), int(lens.sum())
    if p_target.shape[0] != D + R or p_draft.shape[0] != D or draft_tokens.shape[0] != D:
        raise ValueError(
            f"rows: p_target {p_target.shape[0]} (want {D + R}), p_draft {p_draft.shape[0]} and "
            f"draft_tokens {draft_tokens.shape[0]} (want {D})"
        )
    if len(generators) != R:
        raise ValueError(f"{R} requests but {len(generators)} generators")
    if residual_from not in ("residual", "target"):
        raise ValueError(f"residual_from must be 'residual' or 'target', got {residual_from!r}")
    if residual_from == "residual" and kernel_path(p_target):
        return _verify_with_kernels(p_target, p_draft, draft_tokens, lens, generators)
    d_off = torch.cumsum(lens, 0) - lens
    accepted = lens.clone()
    if D > 0:
        req = torch.repeat_interleave(torch.arange(R), lens)  # request of each draft row
        pos = torch.arange(D) - d_off[req]  # k of each draft row (0-based)
        u = uniform([generators[r] for r in req.tolist()], device=device)
        rows = torch.arange(D, device=device)
        tok = draft_tokens.to(device).long()
        pt_x = p_target[rows + req.to(device), tok]
        pd_x = p_draft[rows, tok]
        # Accept with prob min(1, pt/pd)  ⇔  u·pd < pt  (u ∈ [0, 1)); division-free.
        rejected = (u * pd_x >= pt_x).cpu()
        accepted.scatter_reduce_(0, req[rejected], pos[rejected], reduce="amin")
    t_rows = (d_off + torch.arange(R) + accepted).to(device)
    q = p_target[t_rows].clone()
    rej = accepted < lens
    if residual_from == "residual" and bool(rej.any()):
        ri = rej.nonzero().squeeze(-1)
        resid = (q[ri.to(device)] - p_draft[(d_off[ri] + accepted[ri]).to(device)]).clamp_(min=0.0)
        mass = resid.sum(-1, keepdim=True)
        # Mathematically mass > 0 after a rejection; guard against fp round-off.
        q[ri.to(device)] = torch.where(mass > 0, resid / mass.clamp_min(1e-30), q[ri.to(device)])
    next_tokens = sample(q, list(generators))
    return VerifyResult(
        accepted=accepted.to(device),
        next_tokens=next_tokens,
        draft_tokens=draft_tokens,
        lengths=lens.to(device),
    )


def verify_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor, lengths: torch.Tensor) -> VerifyResult:
    """:func:`verify` for greedy targets (every request at temperature 0), from the logits.

    With one-hot p_t (:func:`runtime.sampler.warp_probs`: the argmax, lowest index on
    ties) the acceptance test ``u·p_d(x) < p_t(x)`` passes iff x is that argmax, whatever
    p_d is (p_d(x) > 0 since x was drawn from it, and u < 1), and the residual
    ``norm(max(0, p_t − p_d))`` after a rejection is p_t again. So a_r = the length of
    the longest draft prefix equal to the argmax chain and the extra token is the argmax
    of row ``t_off[r] + a_r``: exactly :func:`verify`'s result, without the ``[rows, V]``
    distributions. It draws no random numbers (a greedy request's output never depends
    on its generator).

    Args:
        target_logits: ``[Σ(ℓ_r+1), V]`` verification logits (ragged layout: module docstring).
        draft_tokens: int64 ``[Σ ℓ_r]``.
        lengths: int64 ``[R]`` ℓ_r.

    Returns:
        :class:`VerifyResult`.

    Raises:
        ValueError: row counts inconsistent with ``lengths``.
    """
    lens = lengths.tolist()
    D = sum(lens)
    if target_logits.shape[0] != D + len(lens) or draft_tokens.shape[0] != D:
        raise ValueError(f"rows: target {target_logits.shape[0]} (want {D + len(lens)}), drafts {draft_tokens.shape[0]} (want {D})")
    best = target_logits.argmax(-1).tolist()
    drafts = draft_tokens.tolist()
    accepted, nxt = [], []
    t = d = 0
    for n in lens:
        a = 0
        while a < n and drafts[d + a] == best[t + a]:
            a += 1
        accepted.append(a)
        nxt.append(best[t + a])
        t += n + 1
        d += n
    device = target_logits.device
    return VerifyResult(
        accepted=torch.tensor(accepted, dtype=torch.long, device=device),
        next_tokens=torch.tensor(nxt, dtype=torch.long, device=device),
        draft_tokens=draft_tokens,
        lengths=lengths.to(device),
    )


def kernel_path(p_target: torch.Tensor) -> bool:
    """Use the fused verification kernels (:mod:`runtime.kernels`)?

    Yes on CUDA (Triton there, paper-equivalent semantics), or when
    ``SPARKGATE_KERNELS`` is set to ``reference``/``triton`` explicitly (so CPU tests
    exercise the exact path the GPU runs). ``auto`` on CPU keeps the plain torch path.
    """
    return p_target.is_cuda or env("SPARKGATE_KERNELS").lower() in ("reference", "triton")


def _verify_with_kernels(p_target, p_draft, draft_tokens, lens, generators) -> VerifyResult:
    """Same contract as :func:`verify`, through ``runtime.kernels.verify_chain``.

    Random numbers per request, in order: ℓ_r acceptance uniforms, then one uniform
    for the residual/bonus inverse-CDF draw (always drawn, also for one-hot rows).
    """
    from runtime.kernels.dispatch import verify_chain

    device = p_target.device
    R = lens.numel()
    req = torch.repeat_interleave(torch.arange(R), lens)
    u_accept = (
        uniform([generators[r] for r in req.tolist()], device=device)
        if req.numel()
        else torch.zeros(0, dtype=torch.float32, device=device)
    )
    u_sample = uniform(list(generators), device=device)
    res = verify_chain(p_target, p_draft, draft_tokens.to(device).long(), lens.to(device), u_accept, u_sample)
    acc = res.num_accepted.long()
    nxt = res.output_tokens[torch.arange(R, device=device), acc]
    return VerifyResult(accepted=acc, next_tokens=nxt, draft_tokens=draft_tokens, lengths=lens.to(device))


@dataclass
class RoundResult:
    """One speculative round's outcome for R decoding requests (see :func:`spec_round`).

    Attributes:
        verify: the :class:`VerifyResult` (accepted a_r, next token, …).
        tokens: emitted tokens per request (a_r drafts + next token).
        keep_target: target KV length to truncate each request to: ``p_r + a_r + 1``.
        commit_rows: int64 ``[Σ(a_r+1)]`` row indices into the verification rows
            (anchor + accepted drafts of each request) whose taps are the new
            drafter context; pass ``taps[commit_rows]`` with ``commit_counts``.
        commit_counts: ``a_r + 1`` per request.
        token_rows: per request, the verification row (index into
            ``target_logits``) whose target distribution produced each emitted
            token: ``t_off[r] + k`` for its k-th token (k = 0 is the anchor's row).
            The same rows as ``commit_rows``; the engine reads logprobs there.
    """

    verify: VerifyResult
    tokens: list[list[int]]
    keep_target: list[int]
    commit_rows: torch.Tensor
    commit_counts: list[int]
    token_rows: list[list[int]]


def spec_round(
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    lengths: Sequence[int],
    starts: Sequence[int],
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generators: Sequence[torch.Generator],
) -> RoundResult:
    """Verify one speculative round for a batch (pure: mutates no cache).

    Engine protocol for decoding request r (anchor x_0 at position p_r =
    ``target_cache.lengths[slot] == draft_cache.lengths[slot]``):

    1. Draft: ``blk = drafter.propose(anchors, slots, draft_cache)``;
       ``ds = drafter.sample_block(blk, anchors, T, top_k, top_p, gens)`` (per-request
       params ``[B]``). The scheduler picks ℓ_r ≤ γ from ``ds.confidence``.
    2. Target forward (may share the ragged batch with prefill chunks): request r
       feeds ``[x_0, x_1..x_ℓ_r]`` as ``SeqSpan(slot, p_r, ℓ_r+1)``; request logits
       for all those rows and ``tap_layers=drafter.tap_layers`` (taps of every row,
       prefill rows included).
    3. ``res = spec_round(logits of those rows (span order), ds.probs[r, :ℓ_r] and
       ds.tokens[r, :ℓ_r] flattened, lengths=ℓ, starts=p, per-request params, gens)``.
    4. Commit: ``target_cache.truncate(slot, res.keep_target[r])`` (drops the K/V of
       rejected drafts); ``drafter.extend_context(draft_cache, taps_r[res.commit_rows],
       slots, res.commit_counts)`` where ``taps_r`` are the taps of the verification
       rows in the same order (the anchor and accepted drafts — exactly the positions
       p_r..p_r+a_r now committed in the target cache). Append ``res.tokens[r]`` to the
       sequence (then apply EOS / stop / max_tokens cuts); the last emitted token is
       the new anchor at position ``p_r + a_r + 1`` = both caches' new length.
       Prefill: after the final prompt chunk, extend the draft context with all prompt
       rows' taps; the sampled first token is the first anchor. A request with ℓ_r = 0
       is plain decoding through the same path.

    When every request is greedy (temperature ≤ 0) the round is decided by
    :func:`verify_greedy` on the logits' argmax: the same outcome as :func:`verify` on
    the one-hot rows, without building ``[rows, V]`` distributions, and ``draft_probs``
    may be ``None``.

    Args:
        target_logits: fp32 ``[Σ(ℓ_r+1), V]`` verification rows, requests in order.
        draft_probs: fp32 ``[Σ ℓ_r, V]`` (``None`` allowed when every request is greedy);
            draft_tokens: int64 ``[Σ ℓ_r]``.
        lengths: ℓ_r; starts: p_r (anchor positions).
        temperature, top_k, top_p: per-request ``[R]`` sampling parameters.
        generators: per-request generators.

    Returns:
        :class:`RoundResult`.
    """
    lens = torch.as_tensor(list(lengths), dtype=torch.long)
    rep = lens + 1
    if bool((temperature <= 0).all()):
        res = verify_greedy(target_logits, draft_tokens, lens)
    else:
        if draft_probs is None:
            raise ValueError("draft_probs is required unless every request is greedy")
        p_target = warp_probs(
            target_logits,
            temperature.repeat_interleave(rep.to(temperature.device)),
            top_k.repeat_interleave(rep.to(top_k.device)),
            top_p.repeat_interleave(rep.to(top_p.device)),
        )
        res = verify(p_target, draft_probs, draft_tokens, lens, generators)
    acc = res.accepted.cpu()
    t_off = torch.cumsum(rep, 0) - rep
    counts = (acc + 1).tolist()
    token_rows = [list(range(o, o + c)) for o, c in zip(t_off.tolist(), counts)]
    return RoundResult(
        verify=res,
        tokens=res.tokens(),
        keep_target=[p + c for p, c in zip(starts, counts)],
        commit_rows=torch.tensor([r for rows in token_rows for r in rows], dtype=torch.long),
        commit_counts=counts,
        token_rows=token_rows,
    )
