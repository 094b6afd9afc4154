"""Speculation gate: per engine step, speculate or decode plainly — decided by measurement.

Used for ``parallel`` and ``prompt_lookup`` (``EngineConfig.spec_gate``). ``dspark`` and
``hybrid`` make this decision inside their verification budget instead, per request
(``Speculator._worth_drafting``: the budget's ℓ = 0 case on each request's measured yield
of a draft, issue 28 item 3), and run no gate.

Why
---
The verification-budget scheduler (:mod:`runtime.speculation.budget`, paper Alg. 1) picks
each request's ℓ_r *after* the drafter has run, so it can never save the drafting cost:
with ℓ_r = 0 for everyone a step still pays for a draft block. On a small CPU that cost
(~2.5 ms per round at batch 1, ~20 ms at batch 16 here) plus the extra verified tokens can
outweigh what the drafter's accepted length τ buys, and speculation is then slower than
autoregressive (AR) decoding. The gate decides *before* drafting whether a step speculates
(draft + verify as usual) or runs a plain AR step for the decoding batch (no drafting,
ℓ_r = 0 for every request; the engine still commits the target's taps to the drafter's
context so later drafting stays correct).

How
---
Per batch-size bucket (powers of two of the number of decoding sequences: 1, 2, 4, 8,
16, …; a batch of 3 falls in bucket 4), :class:`SpecGate` keeps moving averages of the
seconds per step and the tokens emitted per request per step (τ, bonus included; 1 for
an AR step), separately for speculative and AR steps. It speculates iff the estimated
per-request token rate τ_spec / t_spec beats AR's 1 / t_ar by at least ``margin``
(default 2 %; ties go to AR, the simpler and cheaper path). While a bucket lacks
``warmup`` measurements of a mode it runs that mode (speculation first); afterwards every
``probe_every``-th decision of the bucket runs the currently losing mode once, so both
estimates follow changes in load and in acceptance on the current prompt mix. The probe
schedule is a deterministic counter, not a random draw.

The averages are exponential with weight ``max(alpha, 1/n)`` for the n-th sample (a
plain mean until n reaches 1/alpha), so an unusual first measurement — a cold drafter
call, a burst of load — is averaged out within a few samples instead of lingering.

Losslessness
------------
Speculative sampling reproduces the target distribution when every verification length
ℓ_r is a *stopping time* of request r's draft (the argument in the module docstring of
:mod:`runtime.speculation.budget`): {ℓ_r ≥ k} may depend on anything except the draft
tokens x_{r,k}, x_{r,k+1}, … themselves. The gate's decision is a function only of the
number of decoding sequences and of measurements of *past* steps (wall times, emitted
token counts); it is taken before anything is drafted in this step. So "ℓ_r = 0 for all
r" on a gated step is decided independently of every draft (it is a constant stopping
time), and on a speculative step the scheduler's own stopping-time argument applies
unchanged. Either way each emitted token is distributed as the target's; at T = 0 the
output equals AR decoding token for token (exactly in fp32). What the gate does change
is *which* random numbers a seeded request consumes (drafting draws from the request's
generator), and that choice depends on timing — as ``dspark-sla``'s measured-speed
weights already do — so seeded T > 0 replies under speculation are equal in
distribution, not bit-for-bit repeatable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["SpecGate", "bucket_of"]


def bucket_of(num_seqs: int) -> int:
    """The power-of-two bucket of ``num_seqs`` decoding sequences: the smallest 2^k ≥ it."""
    return 1 << max(0, num_seqs - 1).bit_length()


@dataclass
class _Ema:
    """Moving averages of one mode in one bucket."""

    n: int = 0  # samples folded in
    seconds: float = 0.0  # per step
    tokens: float = 0.0  # per request per step (τ, bonus included)

    def add(self, seconds: float, tokens: float, alpha: float) -> None:
        self.n += 1
        a = max(alpha, 1.0 / self.n)
        self.seconds += a * (seconds - self.seconds)
        self.tokens += a * (tokens - self.tokens)

    @property
    def rate(self) -> float:
        """Tokens per second per request."""
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


@dataclass
class _Bucket:
    spec: _Ema = field(default_factory=_Ema)
    ar: _Ema = field(default_factory=_Ema)
    decisions: int = 0


class SpecGate:
    """Decides per engine step whether to speculate (see the module docstring).

    Args:
        probe_every: every this many decisions in a bucket, run the losing mode once.
        margin: speculation must be this much faster (relative) than AR to be chosen.
        alpha: weight of a new sample in the moving averages (after the first 1/alpha).
        warmup: measurements of each mode a bucket collects before it compares them.

    Raises:
        ValueError: ``probe_every`` < 2, ``warmup`` < 1 or ``alpha`` outside (0, 1].
    """

    def __init__(self, probe_every: int = 16, margin: float = 0.02, alpha: float = 0.1, warmup: int = 2) -> None:
        if probe_every < 2 or warmup < 1 or not 0 < alpha <= 1:
            raise ValueError(f"need probe_every >= 2, warmup >= 1, 0 < alpha <= 1; got {probe_every}, {warmup}, {alpha}")
        self.probe_every = probe_every
        self.margin = margin
        self.alpha = alpha
        self.warmup = warmup
        self.buckets: dict[int, _Bucket] = {}

    def speculate(self, num_seqs: int) -> bool:
        """Whether the next step with ``num_seqs`` decoding sequences should speculate.

        Uses only past measurements (never this step's drafts): see "Losslessness"."""
        b = self.buckets.setdefault(bucket_of(num_seqs), _Bucket())
        b.decisions += 1
        if b.spec.n < self.warmup:
            return True
        if b.ar.n < self.warmup:
            return False
        winner = self.spec_wins(b)
        return (not winner) if b.decisions % self.probe_every == 0 else winner

    def spec_wins(self, b: _Bucket) -> bool:
        return b.spec.rate >= (1.0 + self.margin) * b.ar.rate

    def record(self, num_seqs: int, speculative: bool, seconds: float, tokens: float) -> None:
        """Fold in one measured step: ``num_seqs`` decoding sequences, wall ``seconds``,
        ``tokens`` emitted over all of them (before stop strings / EOS / max_tokens cut)."""
        if num_seqs <= 0 or seconds <= 0:
            return
        b = self.buckets.setdefault(bucket_of(num_seqs), _Bucket())
        (b.spec if speculative else b.ar).add(seconds, tokens / num_seqs, self.alpha)

    def snapshot(self) -> dict[str, dict]:
        """Per bucket: samples, ms per step and τ of each mode, and the current winner."""
        out = {}
        for k, b in sorted(self.buckets.items()):
            out[str(k)] = {
                "spec": {"n": b.spec.n, "ms": round(b.spec.seconds * 1e3, 3), "tau": round(b.spec.tokens, 3)},
                "ar": {"n": b.ar.n, "ms": round(b.ar.seconds * 1e3, 3), "tau": round(b.ar.tokens, 3)},
                "speculating": self.spec_wins(b) if b.spec.n and b.ar.n else None,
            }
        return out
