"""Speculative verification: the one implementation of the acceptance rule (torch).

Rule (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", Alg. 1 / §2.3; Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling", Alg. 2). DSpark (arXiv:2607.05147) keeps this rule
as it is: its prefix scheduler (§3.2.2, Alg. 1) only chooses ℓ_r, and its p_d is the
Markov-corrected draft distribution (§3.1) the drafts were sampled from.
Per request r with ℓ_r ≥ 0 draft tokens x_1..x_ℓ drawn from p_d,1..p_d,ℓ: left to
right, x_k is accepted with probability min(1, p_t,k(x_k) / p_d,k(x_k)); at the first
rejection k one token is drawn from norm(max(0, p_t,k − p_d,k)) and the round ends;
if all ℓ_r are accepted the "bonus" token is drawn from p_t,ℓ+1. The a_r accepted
drafts plus that one token are distributed exactly as a_r + 1 tokens sampled from
the target. ℓ_r = 0 is plain decoding (one token from p_t) through the same rule.

Modes, side by side:

* **standard** — :func:`verify_chain`, a pure function of pre-drawn uniforms: the
  specification that the Triton kernel (``runtime/kernels/gpu/triton_verify.py``)
  matches bit for bit; :func:`verify` draws those uniforms from each request's
  generator and runs the kernel on CUDA, :func:`verify_chain` elsewhere.
* **greedy** — :func:`verify_greedy` (every request at temperature 0): one-hot p_t
  makes the rule "accept iff x_k == argmax p_t,k" and the extra token the argmax,
  decided from the logits alone; it also serves plain greedy decoding (ℓ = 0).
* **seeded** — :func:`verify_seeded` (requests with a ``seed`` and temperature > 0):
  the target's token at output position i is the Gumbel-max draw
  ``argmax_v(log p_t,i(v) + g(seed, i, v))`` (:func:`runtime.engine.sampler.gumbel_argmax`,
  noise keyed by (seed, position) alone), so a draft is accepted iff it equals that
  token and the extra token is the draw at the first mismatch — greedy verification
  on perturbed scores. Exact in distribution, and the text does not depend on ℓ_r:
  plain decoding (ℓ = 0) emits the same tokens. Acceptance is P(x_k = the target's
  draw), ≥ (1−δ)/(1+δ) when the drafter draws with the same noise, against 1−δ for
  rejection sampling (δ = total variation; Daliri et al. 2024, arXiv:2408.07978).
* **penalised** (``logit_bias``, ``min_tokens``, repetition/frequency/presence penalties) —
  not a mode either: the engine passes ``target_logits`` already processed per row, row k
  of a request as if its drafts x_1..x_k had been generated
  (:mod:`runtime.engine.logits_processors`), so every mode verifies against the processed
  target and stays lossless with a drafter that ignores the penalties.
* **grammar-masked** — not a mode of its own: for a constrained request the engine
  passes ``target_logits`` already masked (−inf outside its grammar; row k of a request
  masked for the draft prefix x_<k+1, :mod:`runtime.engine.grammar`), so every mode above
  runs on the constrained distribution: standard mode's p_t is 0 outside the mask (a
  disallowed draft is always rejected, the residual never draws one), greedy and seeded
  modes take their argmax among allowed tokens.

Ragged row layout (no padding), requests in order r = 0..R−1, with
``t_off[r] = Σ_{s<r} (ℓ_s + 1)`` and ``d_off[r] = Σ_{s<r} ℓ_s``
(:func:`runtime.kernels.gpu.reference.chain_offsets`):

* ``p_target`` ``[Σ (ℓ_r + 1), V]``: row ``t_off[r] + k`` (k = 0..ℓ_r) is the
  target's warped distribution of the token *after* verification input k of request
  r, where input 0 is the anchor and input k ≥ 1 is draft x_k. So row
  ``t_off[r] + k`` (k < ℓ_r) judges draft x_{k+1}, and row ``t_off[r] + ℓ_r`` is the
  bonus distribution. This is exactly the logits of the verification forward's
  input rows, warped with the request's params.
* ``p_draft`` ``[Σ ℓ_r, V]`` and ``draft_tokens`` ``[Σ ℓ_r]``: row ``d_off[r] + k``
  is x_{k+1} of request r and the distribution it was drawn from. Note
  ``t_off[r] + k == d_off[r] + k + r``.

The extra token is drawn by the exact integer inverse-CDF draw of
:mod:`runtime.kernels.gpu.reference` (bit-identical in torch and Triton).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from runtime.engine.sampler import gumbel_scores, seeded_rows, uniform, warp_probs
from runtime.kernels.dispatch import backend_for, cpu_verify_path
from runtime.kernels.gpu.reference import (
    chain_offsets,
    check_chain_shapes,
    inverse_cdf_draw,
    quantize_weights,
)


@dataclass
class VerifyResult:
    """Outcome of one verification (every mode) for R requests.

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


def _chain(lens: torch.Tensor, max_l: int) -> tuple[torch.Tensor, ...]:
    """Index grids of the ragged layout for int64 ``lens`` ``[R]``: ``(t_off, d_off)``
    ``[R]`` and, for draft k < max_l of request r, ``t_rows``/``d_rows`` ``[R, max_l]``
    (the target row judging it and its draft row; 0 where k ≥ ℓ_r, so every index is
    in range) and ``valid`` ``[R, max_l]`` (k < ℓ_r)."""
    t_off, d_off = chain_offsets(lens)
    k = torch.arange(max_l, device=lens.device)
    valid = k < lens.unsqueeze(1)
    return t_off, d_off, torch.where(valid, t_off[:, None] + k, 0), torch.where(valid, d_off[:, None] + k, 0), valid


def _accepted_length(accept: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """int64 ``[R]``: the number of leading accepted drafts (ℓ_r when none is rejected)."""
    return (accept | ~valid).to(torch.int64).cumprod(1).sum(1).minimum(valid.sum(1))


def residual(p_t: torch.Tensor, p_d: torch.Tensor) -> torch.Tensor:
    """Weights of the extra token's draw: max(0, p_t − p_d), left unnormalised (the
    draw normalises). A row whose residual has zero quantised mass (p_t ≤ p_d
    everywhere: round-off, or a rejected token with p_t(x) = p_d(x) = 0) falls back to
    p_t. Bonus rows pass p_d = 0, so their weights are p_t.

    Args:
        p_t, p_d: fp32 ``[R, V]``.

    Returns:
        fp32 ``[R, V]``.
    """
    res = (p_t - p_d).clamp_min(0.0)
    return torch.where(quantize_weights(res).sum(1, keepdim=True) > 0, res, p_t)


def verify_chain(
    p_target: torch.Tensor,
    p_draft: torch.Tensor,
    draft_tokens: torch.Tensor,
    lengths: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
    *,
    max_len: int | None = None,
) -> VerifyResult:
    """Standard mode on pre-drawn uniforms, vectorised over requests (layout: module docstring).

    Draft k with token x is accepted iff ``u_accept · p_d(x) < p_t(x)`` in fp32 (a
    division-free u < p_t/p_d: probability min(1, p_t/p_d)); p_d(x) = 0 accepts iff
    p_t(x) > 0, p_t(x) = 0 always rejects. The extra token is the exact inverse-CDF
    draw (:func:`runtime.kernels.gpu.reference.inverse_cdf_draw`) with ``u_sample[r]`` of
    :func:`residual` at the first rejection, or of the bonus row.

    Args:
        p_target: fp32 ``[Σ(ℓ_r+1), V]`` target probabilities.
        p_draft: fp32 ``[Σℓ_r, V]`` the distributions the drafts were drawn from.
        draft_tokens: int64 ``[Σℓ_r]`` in [0, V).
        lengths: int32/int64 ``[R]`` ℓ_r ≥ 0.
        u_accept: fp32 ``[Σℓ_r]`` uniforms in [0, 1).
        u_sample: fp32 ``[R]`` uniforms in [0, 1).
        max_len: max ℓ_r if known (skips a host sync; must be ≥ the true max).

    Returns:
        :class:`VerifyResult` on p_target's device (``draft_tokens`` as given).

    Raises:
        ValueError: see :func:`runtime.kernels.gpu.reference.check_chain_shapes`.
    """
    max_l = check_chain_shapes(p_target, p_draft, draft_tokens, lengths, u_accept, u_sample, max_len)
    dev = p_target.device
    lens = lengths.to(dev, torch.int64)
    t_off, d_off, t_rows, d_rows, valid = _chain(lens, max_l)
    p_target, p_draft = p_target.float(), p_draft.float()
    n_acc = torch.zeros_like(lens)
    pd_row = None
    if p_draft.shape[0] > 0:
        pd_row = p_target.new_zeros(lens.numel(), p_target.shape[1])  # bonus rows: the residual is p_t
        x = draft_tokens.to(dev, torch.int64)[d_rows]
        accept = u_accept.to(dev, torch.float32)[d_rows] * p_draft[d_rows, x] < p_target[t_rows, x]
        n_acc = _accepted_length(accept, valid)
        rejected = (n_acc < lens).unsqueeze(1)
        pd_row = torch.where(rejected, p_draft[torch.where(rejected[:, 0], d_off + n_acc, 0)], pd_row)
    rows = p_target[t_off + n_acc]
    # No drafts (plain decoding): every row is a bonus row, whose residual is p_t itself.
    weights = residual(rows, pd_row) if pd_row is not None else rows
    next_tokens = inverse_cdf_draw(weights, u_sample.to(dev, torch.float32))
    return VerifyResult(accepted=n_acc, next_tokens=next_tokens, draft_tokens=draft_tokens, lengths=lens)


def verify(
    p_target: torch.Tensor,
    p_draft: torch.Tensor,
    draft_tokens: torch.Tensor,
    lengths: Sequence[int] | torch.Tensor,
    generators: Sequence[torch.Generator],
) -> VerifyResult:
    """Standard mode with per-request generators: :func:`verify_chain` (Triton on CUDA, its
    C++ twin :func:`verify_chain_cpu` on a CPU that has loaded the extension).

    Random numbers per request, in order: ℓ_r acceptance uniforms, then one uniform
    for the extra token (always drawn, also for one-hot rows), all from
    :func:`runtime.engine.sampler.uniform` before the rule runs. The backend (Triton kernel,
    C++ or torch) is :func:`runtime.kernels.dispatch.backend_for`'s and
    :func:`~runtime.kernels.dispatch.cpu_verify_path`'s; all return the same tokens.

    Args:
        p_target: fp32 ``[Σ(ℓ_r+1), V]`` target distributions (after the request's
            temperature/top-k/top-p warping, :func:`runtime.engine.sampler.warp_probs`).
        p_draft: fp32 ``[Σ ℓ_r, V]`` the distributions the drafts were actually drawn
            from (DSpark: warped Markov-corrected, §3.1, :attr:`DraftSample.probs`).
        draft_tokens: int64 ``[Σ ℓ_r]``.
        lengths: ℓ_r per request (0 allowed: plain decoding step for that request).
        generators: one per request.

    Returns:
        :class:`VerifyResult` on p_target's device.

    Raises:
        ValueError: shapes inconsistent with ``lengths``, or not one generator per request.
    """
    dev = p_target.device
    lens = torch.as_tensor(lengths, dtype=torch.long).cpu()
    if len(generators) != lens.numel():
        raise ValueError(f"{lens.numel()} requests but {len(generators)} generators")
    req = [r for r, n in enumerate(lens.tolist()) for _ in range(n)]  # each draft's request
    u_accept = uniform([generators[r] for r in req], device=dev)
    args = (p_target, p_draft, draft_tokens.to(dev).long(), lens.to(dev), u_accept, uniform(list(generators), device=dev))
    if backend_for(p_target) == "triton":
        from runtime.kernels.gpu.triton_verify import verify_chain_triton

        return VerifyResult(*verify_chain_triton(*args), draft_tokens=draft_tokens, lengths=args[3])
    if cpu_verify_path(p_target):
        return verify_chain_cpu(*args)
    return verify_chain(*args)


def verify_chain_cpu(
    p_target: torch.Tensor,
    p_draft: torch.Tensor,
    draft_tokens: torch.Tensor,
    lengths: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
) -> VerifyResult:
    """:func:`verify_chain` in one C++ call (``torch.ops.sparkgate.verify_chain``,
    ``runtime/kernels/cpu/verify_chain.cpp``): the same arguments and exactly the same
    tokens — every step is an fp32 elementwise result or an exact int64 sum — without its
    ~40 torch ops per round. CPU tensors; needs the loaded extension
    (:func:`runtime.kernels.cpu.gguf_cpu.kernel_loaded`).

    Raises:
        ValueError: as :func:`verify_chain` (:func:`check_chain_shapes`).
        RuntimeError: a draft token outside [0, V)."""
    check_chain_shapes(p_target, p_draft, draft_tokens, lengths, u_accept, u_sample, None)
    lens = lengths.to(torch.int64)
    accepted, next_tokens = torch.ops.sparkgate.verify_chain(
        p_target.float().contiguous(), p_draft.float().contiguous(), draft_tokens.to(torch.int64),
        lens, u_accept.to(torch.float32), u_sample.to(torch.float32))
    return VerifyResult(accepted=accepted, next_tokens=next_tokens, draft_tokens=draft_tokens, lengths=lens)


def verify_greedy(
    target_logits: torch.Tensor, draft_tokens: torch.Tensor, lengths: Sequence[int] | torch.Tensor
) -> VerifyResult:
    """Greedy mode (every request at temperature 0), from the logits.

    With one-hot p_t (:func:`runtime.engine.sampler.warp_probs`: the argmax, lowest index on
    ties) the acceptance test ``u·p_d(x) < p_t(x)`` passes iff x is that argmax, whatever
    p_d is (p_d(x) > 0 since x was drawn from it, and u < 1), and the residual
    ``norm(max(0, p_t − p_d))`` after a rejection is p_t again. So a_r = the length of
    the longest draft prefix equal to the argmax chain and the extra token is the argmax
    of row ``t_off[r] + a_r``: the standard mode's result without the ``[rows, V]``
    distributions. It draws no random numbers (a greedy request's output never depends
    on its generator).

    Args:
        target_logits: ``[Σ(ℓ_r+1), V]`` verification logits, any float dtype (ragged
            layout: module docstring).
        draft_tokens: int64 ``[Σ ℓ_r]``.
        lengths: ℓ_r per request.

    Returns:
        :class:`VerifyResult` on the logits' device.

    Raises:
        ValueError: row counts inconsistent with ``lengths``.
    """
    dev = target_logits.device
    lens = torch.as_tensor(lengths, dtype=torch.long).cpu()
    R, D = lens.numel(), int(lens.sum())
    if target_logits.shape[0] != D + R or draft_tokens.shape[0] != D:
        raise ValueError(f"rows: target {target_logits.shape[0]} (want {D + R}), drafts {draft_tokens.shape[0]} (want {D})")
    best = target_logits.argmax(-1)
    if D == 0:  # a plain round: every row is its request's bonus row
        return VerifyResult(accepted=torch.zeros(R, dtype=torch.long, device=dev), next_tokens=best,
                            draft_tokens=draft_tokens, lengths=lens.to(dev))
    t_off, _, t_rows, d_rows, valid = _chain(lens.to(dev), int(lens.max()))
    n_acc = _accepted_length(draft_tokens.to(dev, torch.int64)[d_rows] == best[t_rows], valid)
    return VerifyResult(accepted=n_acc, next_tokens=best[t_off + n_acc], draft_tokens=draft_tokens, lengths=lens.to(dev))


def verify_seeded(
    p_target: torch.Tensor,
    draft_tokens: torch.Tensor,
    lengths: Sequence[int] | torch.Tensor,
    seeds: Sequence[int],
    positions: Sequence[int],
) -> VerifyResult:
    """Seeded mode: :func:`verify_greedy` on the scores ``log p_t + g(seed_r, i)``.

    Args:
        p_target: fp32 ``[Σ(ℓ_r+1), V]`` warped target distributions (ragged layout).
        draft_tokens: int64 ``[Σ ℓ_r]``.
        lengths: ℓ_r per request.
        seeds: the request seeds; positions: the output position of each request's
            row 0 (row k decides output position ``positions[r] + k``).

    Returns:
        :class:`VerifyResult`; draws no random numbers from any generator.
    """
    lens = torch.as_tensor(lengths, dtype=torch.long).cpu()
    rep = (lens + 1).tolist()
    row_seeds = [x for x, n in zip(seeds, rep) for _ in range(n)]
    row_pos = [int(q) + k for q, n in zip(positions, rep) for k in range(n)]
    return verify_greedy(gumbel_scores(p_target, row_seeds, row_pos), draft_tokens, lens)


def _subset(lens: torch.Tensor, keep: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Verification rows and draft rows (ragged layout) of the requests ``keep``."""
    R = lens.numel()
    req_t = torch.repeat_interleave(torch.arange(R), lens + 1)
    req_d = torch.repeat_interleave(torch.arange(R), lens)
    mask = torch.zeros(R, dtype=torch.bool)
    mask[keep] = True
    return mask[req_t].nonzero().squeeze(-1), mask[req_d].nonzero().squeeze(-1)


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
    *,
    seeds: Sequence[int | None] | None = None,
    positions: Sequence[int] | None = None,
    min_p: torch.Tensor | None = None,
) -> RoundResult:
    """Verify one speculative round for a batch (pure: mutates no cache).

    Engine protocol for decoding request r (anchor x_0 at position p_r =
    ``target_cache.lengths[slot] == draft_cache.lengths[slot]``):

    1. Draft: ``blk = drafter.propose(anchors, slots, draft_cache)``;
       ``ds = drafter.sample_block(blk, anchors, sampling)`` (``sampling``: the step's
       :class:`runtime.engine.sampler.SamplingBatch`, one row per request). The scheduler picks ℓ_r ≤ γ from ``ds.confidence``.
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

    The mode (module docstring) is chosen here: when every request is greedy
    (temperature ≤ 0) the round is decided by :func:`verify_greedy` on the logits'
    argmax — the same outcome as the standard mode on the one-hot rows, without
    building ``[rows, V]`` distributions, and ``draft_probs`` may be ``None``;
    otherwise the standard mode (:func:`verify`) on the warped rows, except for the
    requests with a seed and temperature > 0, which take the seeded mode
    (:func:`verify_seeded`; their rows need no draft distribution).

    Args:
        target_logits: fp32 ``[Σ(ℓ_r+1), V]`` verification rows, requests in order.
        draft_probs: fp32 ``[Σ ℓ_r, V]`` (``None`` allowed when every request is greedy);
            draft_tokens: int64 ``[Σ ℓ_r]``.
        lengths: ℓ_r; starts: p_r (anchor positions).
        temperature, top_k, top_p: per-request ``[R]`` sampling parameters.
        generators: per-request generators.
        seeds: per-request seed or ``None``; positions: per request, the output
            position of the token its row 0 decides (both needed for seeded requests).
        min_p: per-request ``[R]`` min-p (``None``: none uses it).

    Returns:
        :class:`RoundResult`.
    """
    lens = torch.as_tensor(list(lengths), dtype=torch.long)
    rep = lens + 1
    seeded = seeded_rows(seeds, temperature)
    if bool((temperature <= 0).all()):
        res = verify_greedy(target_logits, draft_tokens, lens)
    else:
        if draft_probs is None and len(seeded) < temperature.numel():
            raise ValueError("draft_probs is required unless every request is greedy or seeded")
        def per_row(t: torch.Tensor | None) -> torch.Tensor | None:  # a request's parameters on each of its rows
            return t if t is None or not any(lengths) else t.repeat_interleave(rep.to(t.device))

        p_target = warp_probs(target_logits, per_row(temperature), per_row(top_k), per_row(top_p), min_p=per_row(min_p))
        if not seeded:
            res = verify(p_target, draft_probs, draft_tokens, lens, generators)
        else:
            res = _verify_mixed(p_target, draft_probs, draft_tokens, lens, generators, seeded, seeds, positions)
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


def _verify_mixed(p_target, draft_probs, draft_tokens, lens, generators, seeded, seeds, positions) -> VerifyResult:
    """Seeded requests by :func:`verify_seeded`, the others by :func:`verify`, merged."""
    R = lens.numel()
    taken = set(seeded)
    rest = [r for r in range(R) if r not in taken]
    accepted = torch.zeros(R, dtype=torch.long, device=p_target.device)
    next_tokens = torch.zeros(R, dtype=torch.long, device=p_target.device)
    for group, run in ((seeded, "seeded"), (rest, "standard")):
        if not group:
            continue
        t_rows, d_rows = _subset(lens, group)
        sub_lens = lens[group]
        if run == "seeded":
            res = verify_seeded(p_target[t_rows], draft_tokens[d_rows], sub_lens, [seeds[r] for r in group],
                                [positions[r] for r in group])
        else:
            res = verify(p_target[t_rows], draft_probs[d_rows], draft_tokens[d_rows], sub_lens,
                         [generators[r] for r in group])
        idx = torch.tensor(group, dtype=torch.long, device=p_target.device)
        accepted[idx], next_tokens[idx] = res.accepted, res.next_tokens
    return VerifyResult(accepted=accepted, next_tokens=next_tokens, draft_tokens=draft_tokens, lengths=lens.to(p_target.device))
