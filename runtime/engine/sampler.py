"""Batched token sampling: logits → warped distribution → one draw per row.

One code path serves plain decoding and speculative verification. Speculative
sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", §2.3; Chen et al. 2023) is only exact when the target
distribution p_t and the draft distribution p_d are the distributions actually
sampled from, so both go through the same :func:`warp_probs` with the same
per-row parameters, and acceptance tests draw their U(0, 1) from the request's
own generator via :func:`uniform`.

Semantics follow the OpenAI chat-completions parameters as interpreted by vLLM:

* ``temperature == 0`` → greedy: a one-hot row at ``torch.argmax`` (ties → lowest
  index). ``temperature > 0`` → ``softmax(logits / temperature)``.
* ``min_p`` (``0`` disables; vLLM's, applied after temperature and before top-k/top-p as
  vLLM v1 does): drop every token whose probability is below ``min_p`` times the most
  likely token's (Nguyen et al. 2024, "Min-p Sampling", arXiv:2407.01082), renormalise.
* ``top_k`` (``0`` or ``-1`` disables; ``≥ V`` is a no-op): keep every token whose
  scaled logit is ≥ the k-th largest one (ties at the boundary are all kept, as
  in HF ``TopKLogitsWarper``), renormalise.
* ``top_p`` (``1`` disables): applied after top-k, on the top-k-renormalised
  distribution (vLLM order). Keep the smallest set of most likely tokens whose
  mass is ≥ ``top_p`` (Holtzman et al. 2020, "The Curious Case of Neural Text
  Degeneration", §3.1); always ≥ 1 token. Tokens tied with the last one needed
  are kept too, so the result never depends on sort order. Renormalise.

The logits processors (penalties, ``logit_bias``, ``min_tokens``) act before all of this, on
the logits (:mod:`runtime.engine.logits_processors`). Everything is computed in fp32
whatever the logits dtype. Reproducibility: each
request owns a ``torch.Generator`` (:func:`request_generator`); a row's result
depends only on its own logits, parameters and generator, never on the rest of
the batch.

**Seeded requests** (``seed`` set, temperature > 0) draw no numbers from a stream:
the token at output position i is the Gumbel-max ``argmax_v(log p_i(v) + g_i(v))``
over the warped distribution p_i, with the noise g_i a pure function of (seed, i)
(:func:`gumbel_noise`, counter-based: a hash of seed, position and token id). That
is an exact draw from p_i (Gumbel 1954; the "Gumbel-max trick"), and because the
noise of position i does not depend on how many numbers earlier steps consumed,
speculative verification can accept a draft iff it equals this token
(:func:`runtime.speculation.verifier.verify_seeded`): the text is identical with
speculation on or off (Daliri et al. 2024, arXiv:2408.07978, "coupling").

Performance (2-core CPU, V = 49152, fp32; see ``tests/runtime/engine/test_sampler.py``
``test_warp_timing`` / the report): rows without top-k/top-p never sort
(one softmax); top-p rows find the nucleus among the 256 most likely tokens
with ``topk``, then among 4096, and fully sort only rows whose nucleus is larger.
"""

from __future__ import annotations

import functools
import secrets
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

from runtime.interface import SamplingParams

#: Candidate-set sizes tried in turn for the top-p nucleus before a row falls
#: back to a full sort (on 128 × 49152 fp32: ``topk(256)`` ~9 ms, ``topk(4096)``
#: ~35 ms, ``sort`` ~220 ms).
NUCLEUS_CANDIDATES = (256, 4096)

_SEED_MASK = (1 << 64) - 1
INT64_MAX = (1 << 63) - 1
_M31 = (1 << 31) - 1
_MIX = 0x45D9F3B  # < 2**27: a 31-bit value times it stays below 2**58 (no int64 overflow)


def _mix31(x: torch.Tensor) -> torch.Tensor:
    """A bijective 31-bit integer hash (xorshift-multiply, two rounds), elementwise and in
    place on int64 values in [0, 2**31); returns ``x``."""
    x ^= x >> 16
    x.mul_(_MIX).bitwise_and_(_M31)
    x ^= x >> 16
    x.mul_(_MIX).bitwise_and_(_M31)
    x ^= x >> 16
    return x


@functools.lru_cache(maxsize=8)
def _token_keys(vocab: int, device: str) -> torch.Tensor:
    """``[1, vocab]`` int64: the hashed token ids the row keys are mixed with."""
    return _mix31(torch.arange(vocab, dtype=torch.int64, device=device) ^ 0x1B873593)[None, :]


def _row_keys(parts: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """31-bit key per row from its seed ``parts`` ``[N, 3]`` (bits 0–30, 31–61, 62–63) and
    output position; ``stream`` selects an independent family of keys."""
    k = _mix31(parts[:, 0] ^ stream)
    k = _mix31(k ^ parts[:, 1])
    k = _mix31(k ^ parts[:, 2])
    return _mix31(k ^ positions)[:, None]


def gumbel_noise(
    seeds: Sequence[int], positions: Sequence[int], vocab: int | torch.Tensor, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """Standard Gumbel noise ``g[i, v] = −log(−log u)`` keyed by (seed_i, position_i, v) alone.

    Counter-based: u takes 53 bits from two 31-bit hashes of (seed, position, token id),
    u ∈ (0, 1) strictly; vectorised over rows and vocabulary, no generator state, so the
    noise of a position never depends on what was drawn before it.

    Args:
        seeds: per row, the request's seed (any int; reduced mod 2**64 as
            :func:`request_generator` does).
        positions: per row, the output position (0 = the first completion token),
            ``0 ≤ position < 2**31``.
        vocab: V (the noise of token ids 0..V−1), or an int64 tensor of token ids (their
            noise, e.g. a drafter's sub-vocabulary: the same values as at those columns).
        device: where to compute.

    Returns:
        float64 ``[len(seeds), V or len(vocab)]``.

    Raises:
        ValueError: a position outside ``[0, 2**31)`` or ``len(seeds) != len(positions)``.
    """
    if len(seeds) != len(positions):
        raise ValueError(f"{len(seeds)} seeds but {len(positions)} positions")
    if any(not 0 <= int(q) <= _M31 for q in positions):
        raise ValueError("positions must lie in [0, 2**31)")
    u64 = [int(x) & _SEED_MASK for x in seeds]
    parts = torch.tensor([[x & _M31, (x >> 31) & _M31, x >> 62] for x in u64], dtype=torch.int64, device=device)
    pos = torch.tensor([int(q) for q in positions], dtype=torch.int64, device=device)
    if isinstance(vocab, torch.Tensor):
        token = _mix31(vocab.to(device=device, dtype=torch.int64) ^ 0x1B873593)[None, :]
    else:
        token = _token_keys(vocab, str(device))
    hi = _mix31(_row_keys(parts.view(-1, 3), pos, 0x2545F491) ^ token)  # [N, V], 31 bits
    lo = _mix31(_row_keys(parts.view(-1, 3), pos, 0x68E31DA4) ^ token)
    hi <<= 22
    hi |= lo >> 9  # 31 + 22 = 53 bits
    u = hi.double().add_(0.5).mul_(2.0**-53)  # (0, 1) strictly
    return u.log_().neg_().log_().neg_()  # −log(−log u)


def seeded_rows(seeds: Sequence[int | None] | None, temperature: torch.Tensor) -> list[int]:
    """Rows decided by the seeded Gumbel-max draw: a seed and temperature > 0."""
    if seeds is None:
        return []
    return [i for i, (x, t) in enumerate(zip(seeds, temperature.tolist())) if x is not None and t > 0]


def gumbel_scores(
    probs: torch.Tensor, seeds: Sequence[int], positions: Sequence[int], token_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """``log probs[i, v] + g(seed_i, position_i, v)`` (float64, −inf where probs is 0): the
    scores whose argmax is the seeded draw. ``token_ids``: the token id of each column when
    ``probs`` covers a sub-vocabulary."""
    noise = gumbel_noise(seeds, positions, probs.shape[-1] if token_ids is None else token_ids, probs.device)
    return probs.double().log() + noise


def gumbel_argmax(
    probs: torch.Tensor, seeds: Sequence[int], positions: Sequence[int], token_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """The seeded draw: ``argmax`` of :func:`gumbel_scores` per row (lowest index on ties); an
    exact sample of each row of ``probs`` [N, V] (fp32, rows of :func:`warp_probs`);
    zero-probability tokens are never drawn. Returns int64 [N] column indices."""
    if probs.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=probs.device)
    return gumbel_scores(probs, seeds, positions, token_ids).argmax(-1)


def request_generator(params: SamplingParams, device: str | torch.device = "cpu") -> torch.Generator:
    """Per-request randomness: the ``torch.Generator`` a request owns. Every random number
    it ever consumes (sampling and speculative acceptance) comes from it, in order, so
    the output is reproducible regardless of batch composition. Seeded with
    ``params.seed`` reduced mod 2**64, or a fresh random seed when ``params.seed is None``
    (``initial_seed()`` tells the seed used; log it to replay)."""
    seed = secrets.randbits(63) if params.seed is None else int(params.seed) & _SEED_MASK
    return torch.Generator(device=device).manual_seed(seed)


def params_to_tensors(
    params: Sequence[SamplingParams], device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row parameter tensors for :func:`warp_probs`.

    Args:
        params: one :class:`SamplingParams` per row (repeat a request's params for
            each of its rows, e.g. the γ+1 verification rows of a speculative round).
        device: where to put the tensors.

    Returns:
        ``(temperature [N] fp32, top_k [N] int64, top_p [N] fp32)``; ``top_k`` ≤ 0
        is normalised to 0 (disabled), one beyond int64 to int64's max (≥ V: disabled
        too), so a client's ``top_k: 2**70`` cannot fail the step of the whole batch.

    Raises:
        ValueError: negative temperature or ``top_p`` outside (0, 1].
    """
    temps, ks, ps = [], [], []
    for p in params:
        if p.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {p.temperature}")
        if not 0.0 < p.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p.top_p}")
        temps.append(float(p.temperature))
        ks.append(min(max(int(p.top_k), 0), INT64_MAX))
        ps.append(float(p.top_p))
    return (
        torch.tensor(temps, dtype=torch.float32, device=device),
        torch.tensor(ks, dtype=torch.int64, device=device),
        torch.tensor(ps, dtype=torch.float32, device=device),
    )


@dataclass
class SamplingBatch:
    """A step's per-row sampling parameters as tensors: the engine builds ONE per step
    (:meth:`of`) and hands it to the drafter, the sampler and verification
    (``*batch.tensors`` where a function takes plain tensors, as :func:`warp_probs`).

    Attributes:
        temperature, top_k, top_p: ``[N]`` tensors from :func:`params_to_tensors`.
        generators: N per-request generators; row i draws from ``generators[i]``.
        seeds: per row, the request's ``seed`` (``None``: unseeded); ``None``: no row seeded.
        positions: per row, the output position of the next token (0 = the first
            completion token): where a seeded row's noise is keyed (:func:`gumbel_noise`).
        min_p: ``[N]`` fp32 (0 = off); ``None``: no row uses min-p. Not in :attr:`tensors`:
            the drafters sample without it (their p_d is what they sample from, which is all
            verification needs); :meth:`draw` and verification apply it.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    generators: list[torch.Generator]
    seeds: list[int | None] | None = None
    positions: list[int] | None = None
    min_p: torch.Tensor | None = None

    @classmethod
    def of(cls, seqs: Sequence) -> "SamplingBatch":
        """From sequences (``runtime.engine.sequence.SequenceState``: ``request.sampling``, ``generator``,
        ``num_generated``), in order. Raises ``ValueError`` as :func:`params_to_tensors`."""
        params = [s.request.sampling for s in seqs]
        seeds = [p.seed for p in params]
        min_p = [p.min_p for p in params]
        return cls(*params_to_tensors(params), [s.generator for s in seqs],
                   seeds if any(x is not None for x in seeds) else None, [s.num_generated for s in seqs],
                   torch.tensor(min_p, dtype=torch.float32) if any(min_p) else None)

    def select(self, rows: Sequence[int]) -> "SamplingBatch":
        """The sub-batch of ``rows`` (in that order): the same parameters, generators, seeds and positions."""
        if len(rows) == len(self.generators) and list(rows) == list(range(len(rows))):
            return self
        idx = torch.tensor(list(rows), dtype=torch.long)
        seeds = [self.seeds[i] for i in rows] if self.seeds is not None else None
        min_p = self.min_p[idx] if self.min_p is not None else None
        return SamplingBatch(self.temperature[idx], self.top_k[idx], self.top_p[idx], [self.generators[i] for i in rows],
                             seeds if seeds is not None and any(x is not None for x in seeds) else None,
                             [self.positions[i] for i in rows] if self.positions is not None else None,
                             min_p if min_p is not None and bool((min_p > 0).any()) else None)

    @cached_property
    def seeded_rows(self) -> list[int]:
        """Rows decided by the seeded Gumbel-max draw (:func:`seeded_rows`)."""
        return seeded_rows(self.seeds, self.temperature)

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(temperature, top_k, top_p)``, the order :func:`warp_probs` takes them in."""
        return self.temperature, self.top_k, self.top_p

    @cached_property
    def greedy(self) -> bool:
        """Every row at temperature 0 (decided by argmax; no draft distributions needed)."""
        return bool((self.temperature <= 0).all())

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        """One token per row of ``logits`` ``[N, V]``: :meth:`sample_rows` of :func:`warp_probs`."""
        return self.sample_rows(warp_probs(logits, *self.tensors, min_p=self.min_p))

    def sample_rows(self, probs: torch.Tensor, offset: int = 0, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One column index per row of ``probs`` ``[N, V']``: seeded rows by :func:`gumbel_argmax`
        at output position ``positions[i] + offset`` (a drafter's slot k drafts the token of
        position + k with the noise the target will use there), the others by :func:`sample`
        from their generators. ``token_ids``: the token id of each column (a sub-vocabulary)."""
        seeded = self.seeded_rows
        if not seeded:
            return sample(probs, self.generators)
        tokens = probs.argmax(-1)
        rows = torch.tensor(seeded, dtype=torch.long)
        tokens[rows] = gumbel_argmax(probs[rows], [self.seeds[i] for i in seeded],
                                     [self.positions[i] + offset for i in seeded], token_ids)
        taken = set(seeded)
        others = [i for i in range(len(self.generators)) if i not in taken]
        if others:
            tokens[others] = sample(probs[others], [self.generators[i] for i in others])
        return tokens


def _top_k_mask(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Mask (−inf) tokens below each row's k-th largest logit; k ≤ 0 or ≥ V: no-op.

    ``logits`` [M, V] fp32, ``top_k`` [M] int64. Returns a new [M, V] tensor.
    """
    vocab = logits.shape[-1]
    active = (top_k > 0) & (top_k < vocab)
    if not bool(active.any()):
        return logits
    kmax = int(top_k[active].max())
    top_vals = logits.topk(kmax, dim=-1).values  # [M, kmax], descending
    idx = (top_k.clamp(1, kmax) - 1).unsqueeze(-1)
    kth = top_vals.gather(-1, idx)
    kth = torch.where(active.unsqueeze(-1), kth, torch.full_like(kth, float("-inf")))
    return logits.masked_fill(logits < kth, float("-inf"))


def _nucleus_cutoff(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Smallest probability that belongs to each row's top-p nucleus.

    ``probs`` [M, V] fp32 (rows sum to 1), ``top_p`` [M] fp32. Returns [M] fp32:
    the probability of the last token (in descending order) needed for the
    cumulative mass to reach ``top_p``. Searches the ``NUCLEUS_CANDIDATES[0]``
    most likely tokens with ``topk``, then the next tier for the rows whose
    candidates hold less than ``top_p``, and fully sorts only what is left.
    """
    vocab = probs.shape[-1]
    cutoff = torch.empty(probs.shape[0], dtype=probs.dtype, device=probs.device)
    rows = torch.arange(probs.shape[0], device=probs.device)
    for k in (*NUCLEUS_CANDIDATES, vocab):
        k = min(k, vocab)
        sub = probs[rows] if len(rows) < probs.shape[0] else probs
        vals = sub.sort(dim=-1, descending=True).values if k == vocab else sub.topk(k, dim=-1).values
        cum = vals.cumsum(-1)
        # Index of the first token whose inclusive cumulative mass reaches top_p.
        needed = (cum < top_p[rows].unsqueeze(-1)).sum(-1, keepdim=True)
        cutoff[rows] = vals.gather(-1, needed.clamp(max=k - 1)).squeeze(-1)
        missing = needed.squeeze(-1) >= k
        if k == vocab or not bool(missing.any()):
            break
        rows = rows[missing]
    return cutoff


def warp_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """The distribution each row is actually sampled from.

    Args:
        logits: [N, V], any float dtype (computed in fp32).
        temperature: [N] fp32; 0 → greedy one-hot at ``argmax`` (lowest index on ties).
        top_k: [N] int64; ≤ 0 or ≥ V disables.
        top_p: [N] fp32 in (0, 1]; 1 disables. Applied after top-k.
        min_p: [N] fp32 in [0, 1] (0 disables), or ``None`` (no row uses it). Applied
            after temperature, before top-k.

    Returns:
        [N, V] fp32 on ``logits.device``; each row sums to 1 (exactly one 1.0 for
        greedy rows). See the module docstring for the exact semantics.

    Raises:
        ValueError: on shape mismatches.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got {tuple(logits.shape)}")
    n, vocab = logits.shape
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        if t is not None and t.shape != (n,):
            raise ValueError(f"{name} must be [{n}], got {tuple(t.shape)}")
    logits = logits.float()
    greedy = temperature <= 0
    if bool(greedy.all()):  # all greedy: no row gather (a [N, V] copy)
        out = torch.zeros((n, vocab), dtype=torch.float32, device=logits.device)
        return out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    sampled = ~greedy
    filt = sampled & (((top_k > 0) & (top_k < vocab)) | (top_p < 1.0))
    if min_p is not None:
        filt = filt | (sampled & (min_p > 0))

    plain = sampled & ~filt
    if bool(plain.all()):  # every row sampled, no filter (T > 0 alone): no [N, V] zeros + row copy
        return torch.softmax(logits / temperature.unsqueeze(-1), dim=-1)
    out = torch.zeros((n, vocab), dtype=torch.float32, device=logits.device)
    if bool(greedy.any()):
        g_rows = greedy.nonzero().squeeze(-1)
        out[g_rows, logits[g_rows].argmax(-1)] = 1.0
    if bool(plain.any()):
        rows = plain.nonzero().squeeze(-1)
        out[rows] = torch.softmax(logits[rows] / temperature[rows].unsqueeze(-1), dim=-1)

    if bool(filt.any()):
        rows = filt.nonzero().squeeze(-1)
        scaled = logits[rows] / temperature[rows].unsqueeze(-1)
        if min_p is not None:  # p(v) < min_p · max p  ⇔  scaled(v) < max scaled + log(min_p)
            floor = scaled.max(-1, keepdim=True).values + min_p[rows].log().unsqueeze(-1)
            scaled = scaled.masked_fill(scaled < floor, float("-inf"))
        probs = torch.softmax(_top_k_mask(scaled, top_k[rows]), dim=-1)
        p = top_p[rows]
        nuc = p < 1.0
        if bool(nuc.any()):
            nrows = nuc.nonzero().squeeze(-1)
            sub = probs[nrows]
            cutoff = _nucleus_cutoff(sub, p[nrows])
            sub = sub.masked_fill(sub < cutoff.unsqueeze(-1), 0.0)
            probs[nrows] = sub / sub.sum(-1, keepdim=True)
        out[rows] = probs
    return out


def _as_generators(generators: torch.Generator | Sequence[torch.Generator], n: int | None) -> list[torch.Generator]:
    if isinstance(generators, torch.Generator):
        return [generators] * (1 if n is None else n)
    gens = list(generators)
    if n is not None and n != len(gens):
        raise ValueError(f"n={n} but {len(gens)} generators given")
    return gens


def uniform(
    generators: torch.Generator | Sequence[torch.Generator],
    n: int | None = None,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """U[0, 1) draws for speculative acceptance tests, one per row.

    Args:
        generators: one generator per row (row i draws from ``generators[i]``, in
            row order, so rows of the same request consume its stream in order);
            or a single generator, from which ``n`` values are drawn in order.
        n: number of values; defaults to ``len(generators)`` (must match if given).
        device: device of the returned tensor.

    Returns:
        [n] fp32.
    """
    gens = _as_generators(generators, n)
    vals = [torch.rand((), generator=g, device=g.device).item() for g in gens]
    return torch.tensor(vals, dtype=torch.float32, device=device)


def sample(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row from ``probs`` (inverse-CDF with one uniform per row).

    Args:
        probs: [N, V] fp32, rows summing to ~1 (output of :func:`warp_probs` or a
            speculative residual distribution ``norm(max(0, p_t − p_d))``).
        generators: N generators, row i draws from ``generators[i]``; rows that
            share a generator draw in row order.

    Returns:
        [N] int64 token ids on ``probs.device``. A row whose largest probability is
        exactly 1 (the one-hot rows greedy warping produces) returns its argmax and
        consumes **no** randomness; every other row consumes exactly one
        ``torch.rand`` from its generator. Zero-probability tokens are never drawn.

    Raises:
        ValueError: when ``len(generators) != N``.
    """
    n, vocab = probs.shape
    if len(generators) != n:
        raise ValueError(f"{n} rows but {len(generators)} generators")
    probs = probs.float()
    top_p, top_i = probs.max(-1)
    det = top_p >= 1.0
    tokens = top_i.clone()
    if bool(det.all()):
        return tokens
    rows = (~det).nonzero().squeeze(-1)
    u = uniform([generators[i] for i in rows.tolist()], device=probs.device)
    cdf = probs[rows].cumsum(-1)
    total = cdf[:, -1]
    # u < 1, but u * total may round up to total; keep the target strictly below it.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total))).unsqueeze(-1)
    # First index whose cumulative mass exceeds the target (never a zero-prob token).
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=vocab - 1)
    tokens[rows] = drawn
    return tokens
