"""The engine's served T = 1 path is lossless: seeded chi-square tests through
:class:`runtime.engine.llm_engine.LLMEngine` on the real model, with the power to catch a
subtle planted bug at the same N.

Setting (each configuration: one engine, module-scoped, dtype ``gguf`` — the served one,
row-invariant, so the engine's verification logits equal an independent forward's bit for
bit, which the tests check; T = 1, top-p/top-k off):

* ``dspark``: the committed DSpark drafter on the fused CPU path
  (:mod:`runtime.speculation.fast_drafter`), γ = 3, policy ``dspark-sla`` with SLA weights
  active (every other request carries an SLA target of 15 tok/s; the engine's clock is a
  step clock, 0.1 s per step, so each request's measured speed — and its weight, 1 to 3.7
  here — depends on the run only) and an SPS table with an affine round time (a draft is
  admitted or not depending on its survival and its weight: ℓ = 0…3 occur);
* ``prompt_lookup``: the n-gram drafter, γ = 1, policy ``fixed`` (it verifies whatever
  matched; with this model at T = 1 a second n-gram draft is accepted in ~3 % of the rounds
  that verify one, so
  slot 2 would cost a row per round for little: multi-slot rounds are DSpark's);
* ``hybrid``: per request an n-gram draft where one matches and its calibrated acceptance
  beats the request's DSpark record, else a fused DSpark block, γ = 3, ``dspark-sla`` with the
  SLA weights and table of ``dspark``; which requests DSpark drafts is pinned to "every one that
  prefers it" (the served choice also weighs measured drafting time, which would make the run
  depend on the machine). On the forced gate's plain steps it still verifies n-gram drafts.
  Observed: 1591 / 603 / 311 rounds with ℓ = 1 / 2 / 3, family p = 0.87 (the planted bug, run once
  while adding it, was caught: it is not re-run, see :data:`BUG_METHODS`).

All three: the speculation gate is forced (a counter) to speculate four decode steps, then run
one plain, …; 64 requests decode per step; every request has max_tokens 16 (15 tokens
from verification rounds, so many rounds per request). The prompt is one chat turn asking
for a poem with 123 common words, 161 tokens (16·k + 1: after a warm-up request the prefix
cache leaves one prompt token to prefill); with it the n-gram drafter matches at about half
the positions, and the replies of this 135M model at T = 1 are loose word salads — spread-
out distributions, where a wrong temperature shows. Unseeded requests (standard rejection
sampling, one generator per request, seeded deterministically by admission order) and 16
seeded ones (distinct seeds; Gumbel-coupled verification) share the batches. Everything
(generators, the PIT's uniforms, gate, clock) is deterministic, so the p-values below are
what every run gets.

Tests (p-values of one run; the correct run passes when their Bonferroni minimum · count
is > 0.01):

* ``token@k``, k = 1, 2, 3: the k-th generated token against the target's exact
  p_t(·|prompt, tokens 1..k−1), from an independent forward, per group of ≥ 10 requests
  that share tokens 1..k−1; cells: every token with expected count ≥ 5, the rest in one
  "other" cell (merged into the smallest cell when its expectation is below 5); pooled
  over groups (df = Σ (cells − 1)). Token 1 is sampled after prefill (no round); tokens 2
  and 3 come from the first rounds. The first tokens of this prompt are spread, so the
  groups hold 240 / 139 / 88 draws (DSpark) and 320 / 180 / 130 (prompt lookup), df 2–5:
  weak tests, kept because they need no assumption about which tokens to select.
* ``pit``: every later token, at every position 2…16, that a verified draft slot emitted
  (an accepted draft or the residual draw after a rejection; whether a slot is verified
  is decided before its draft is drawn — gate, scheduler, room — so selecting them keeps
  p_t) through the probability integral transform under its exact p_t (the engine's own
  verification row, checked equal to an independent forward for six requests):
  u = P(Y more likely than y) + U·P(Y as likely as y) is U(0, 1) iff y ~ p_t. Bins of u:
  [0, .5, .75, .9, .97, 1] (finer in the tail, where the tokens of a too-hot draw land),
  df 4. This is end to end: the token that reaches the client, under the target.
* ``pit_residual`` / ``pit_accepted``: the same tokens under the exact law of their path
  given the round so far, from the engine's own p_t and p_d: norm(max(0, p_t − p_d)) after
  a rejection, min(p_t, p_d)/Σ for an accepted draft.
* ``pit_seeded``: every token 2…16 of the seeded requests under p_t.

Power: the planted bug is :func:`residual_at_bug_temperature` — the residual after a
rejection drawn from max(0, p_t^(1/1.05)/Z − p_d) instead of max(0, p_t − p_d), patched into
:func:`runtime.speculation.verifier.residual` (the one function that weighs the extra
token's draw; bonus and plain draws are not touched). It moves the residual draw's law by
5 % in total variation (mean over the runs' rejections), mostly between head and tail, so
N is set by it. Its expected chi-square non-centrality λ, computed from the exact p_t and
p_d of the runs' rejections, is per unseeded request 0.13 (``pit_residual``) and 0.094
(``pit``) for DSpark, 0.089 and 0.083 for prompt lookup: N = 240 / 320 unseeded requests
give λ ≈ 31 / 29 for ``pit_residual``, P(p < 1e-3) ≈ 0.94 / 0.91, and λ ≈ 23 / 27 for
``pit``, P(p < 1e-3) ≈ 0.79 / 0.88, P(p < 0.01) ≈ 0.93 / 0.96. The token@k tests have no
power against it (it hides in the tail of a few hundred draws). The bug runs use the same
requests, generators and gate, without the seeded requests (they never draw a residual).

Observed p-values (correct → bugged):

===============  ===============  ================  ===============  ================
test             dspark           dspark + bug      prompt_lookup    prompt_lookup + bug
===============  ===============  ================  ===============  ================
token@1          0.43             0.43              0.90             0.90
token@2          0.046            0.60              0.86             0.86
token@3          0.99             0.81              0.76             0.20
pit              0.19             1.4e-3            0.81             7.6e-8
pit_residual     0.25             1.5e-6            0.91             2.8e-7
pit_accepted     0.18             0.40              0.97             0.58
pit_seeded       0.30             —                 0.21             —
Bonferroni       0.32             8.9e-6            1                4.6e-7
===============  ===============  ================  ===============  ================

The tests assert: correct run Bonferroni p > 0.01, every path exercised (accepted and
rejected drafts at slots 1–2, bonus and plain tokens, both gate modes, SLA weights ≥ 2 and
= 1), engine rows == independent rows; bugged run ``pit_residual`` p < 1e-3 and ``pit``
p < 0.01.

Accept / residual / bonus / plain tokens per output position and verified / accepted
drafts per slot are printed (``-s``). Also here: a gold request below its SLA target gets
more drafts verified than best-effort requests in the same batch, and its T = 0 text is
plain decoding's (:func:`test_gold_request_below_its_sla_target_gets_more_drafts_verified`).

Runtime (``time pytest -q`` of this file on the shared 2-core box, load average 1.6–3.6 from
other jobs): 161 s wall, 162 s CPU (user 150 + sys 12) — setup 30 s (mostly the gguf load),
the four runs 26–31 s each, judging < 1 s each, the SLA test 6.5 s. About 60 % of a run is
the target's forwards (~1.5 rows per token); at load ≈ 0.3 a DSpark engine of this kind
(33-token prompt, γ = 4) served 416 requests in 29 s (≈ 0.07 s per 15-token request), which
puts the file at ≈ 90–100 s on an idle 2-core machine. N, and so the time, is set by the power against the planted bug.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from scipy import stats

import runtime.engine.llm_engine as llm_engine
import runtime.engine.sequence as sequence
import runtime.speculation.speculator as speculator
import runtime.speculation.verifier as verifier
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.speculation.acceptance import AcceptanceTracker
from runtime.engine.sampler import request_generator
from runtime.interface import Finished, GenerationRequest, SamplingParams, TextDelta
from runtime.models.llama import SeqSpan
from runtime.speculation.sps import SpsTable
from tests.runtime.speculation.test_spec_engine import ForcedGate, chat_ids, sps_affine

pytestmark = pytest.mark.model

BATCH = 64  # engine slots: requests decoding together in one step
MIN_GROUP = 10  # token-level test: smallest group of requests sharing the conditioning prefix
MIN_EXPECTED = 5.0  # token-level test: a token gets its own cell when its expected count is ≥ this
PIT_EDGES = (0.0, 0.5, 0.75, 0.9, 0.97, 1.0)  # PIT tests: bins of u (finer where the tail tokens land)
BUG_TEMPERATURE = 1.05  # the planted bug: the residual drawn from p_t at this temperature
GEN_SEED = 7_000  # unseeded requests: generator seeds GEN_SEED, GEN_SEED + 1, … in admission order
PIT_SEED = 11  # the PIT's own uniforms
STEP_SECONDS = 0.1  # the injected clock: seconds per engine step
CHECKED = ("u0", "u1", "u2", "u3", "s0", "s1")  # requests whose verification logits are checked independently
REAL_RESIDUAL = verifier.residual  # the recorder's reference (the planted bug replaces the module's)

# The prompt of every setting: "Write a poem with these words: In The … take." — 123 common words
# and line starts, so the n-gram drafter finds a match for most tokens of a reply and the
# replies (a loose word salad at T = 1 from this 135M model) are spread-out distributions:
# 161 tokens with the chat template.
WORDS = ("In The I A As To And My the of and a to in is you that it he was for on are as with his they I at be this "
         "have from or one had by but not what all were we when your can said there use an each which she do how "
         "their if will up other about out many then them these so some her would make like him into time has look "
         "two more write go see number no way could people my than first water been call who oil its now find long "
         "down day did get come made may part heart light am old where eyes never sleep sky night moon only again "
         "here name take")
PROMPT = f"Write a poem with these words: {WORDS}."


def every_fifth_plain(k: int) -> bool:
    """Forced gate: speculate four steps, then one plain step, … (k-th decision, 1-based)."""
    return k % 5 != 0


@dataclass(frozen=True)
class Setting:
    """One engine configuration under test (all on the served ``gguf`` dtype, T = 1).

    Attributes:
        spec_method, spec_policy, gamma: the engine's (``num_speculative_tokens`` = gamma).
        prompt: the user turn (chat template applied; 16·k + 1 tokens, so a request
            prefills one token after the prefix cache), the same for every request.
        num_unseeded, num_seeded: requests without a seed (standard verification, one
            generator per request) and with distinct seeds (Gumbel-coupled verification).
        max_tokens: completion cap of every request.
        gate: the forced gate's decision for its k-th call.
        sla_target: tokens/s target of every other request (``None``: no SLA).
        sps: the SPS table the ``dspark`` policies schedule with (``None``: the engine's).
    """

    spec_method: str
    spec_policy: str
    gamma: int
    prompt: str
    num_unseeded: int
    num_seeded: int
    max_tokens: int
    gate: Callable[[int], bool]
    sla_target: float | None = None
    sps: SpsTable | None = None


# The configurations under test: one engine each, every test below is parametrized over them.
# To cover another spec_method (e.g. "hybrid": n-gram drafts where they match, else DSpark),
# add its Setting here; size its num_unseeded with the power numbers of the module docstring.
SETTINGS: dict[str, Setting] = {
    "dspark": Setting("dspark", "dspark-sla", 3, PROMPT, 240, 16, 16, every_fifth_plain, sla_target=15.0,
                      sps=sps_affine(1.0, 0.001)),
    "prompt_lookup": Setting("prompt_lookup", "fixed", 1, PROMPT, 320, 16, 16, every_fifth_plain),
    # n-gram drafts where they match (the word-list prompt makes many), else fused DSpark blocks;
    # the forced gate's plain steps still verify n-gram drafts (they cost no drafting)
    "hybrid": Setting("hybrid", "dspark-sla", 3, PROMPT, 240, 16, 16, every_fifth_plain, sla_target=15.0,
                      sps=sps_affine(1.0, 0.001)),
}
METHODS = list(SETTINGS)
# The planted residual bug (power) runs where the residual path differs in what feeds it: DSpark
# rows and one-hot n-gram rows. The hybrid mixes exactly those two rows through the same
# residual, so its bug run would show the same power again (~15 s of suite time).
BUG_METHODS = ["dspark", "prompt_lookup"]


# -- the engine's run, recorded ------------------------------------------------------


class StepClock:
    """Stand-in for the ``time`` module of the engine and of its sequences: ``monotonic()``
    advances :data:`STEP_SECONDS` per engine step, so each request's measured speed (and so
    its SLA weight) is a function of the run, not of the machine's load."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.perf_counter = time.perf_counter
        self.time = time.time

    def monotonic(self) -> float:
        return self.now


@dataclass
class Token:
    """One emitted token of a verification round.

    Attributes:
        how: ``accepted`` draft, ``residual`` (drawn after a rejection), ``bonus`` (every
            verified draft accepted) or ``plain`` (ℓ = 0: a gated step, nothing admitted,
            or no n-gram match).
        u: PIT value under the target row p_t (tokens of verified slots and of seeded
            requests; ``None`` otherwise).
        u_path: PIT value under the exact distribution of its path given what was drawn
            before it: norm(max(0, p_t − p_d)) for ``residual``, min(p_t, p_d)/Σ for
            ``accepted``; ``None`` otherwise.
    """

    token: int
    how: str
    u: float | None
    u_path: float | None


@dataclass
class Run:
    """What one batch of requests produced.

    Attributes:
        tokens: request id → emitted completion tokens.
        seeded: request ids with a seed.
        records: (request id, output position) → :class:`Token` (output positions are
            0-based here; position 0 is sampled after prefill, not in a round).
        verified, accepted: per draft slot k (0-based), drafts verified / accepted.
        lengths: Counter of ℓ_r over speculative rounds.
        weights: Counter of SLA weights (rounded) the scheduler was given.
        logits: (request id, position) → verification logits row (requests of :data:`CHECKED`).
        spec_steps, gated_steps: decode steps that drafted / that the forced gate ran plainly.
        proposers: Counter of verified drafts (ℓ_r > 0) by proposer, ``dspark`` / ``ngram``
            (``hybrid`` only), split by whether the forced gate allowed drafting that step.
        seconds, cpu_seconds: the run's wall and process CPU time.
    """

    tokens: dict[str, list[int]] = field(default_factory=dict)
    seeded: set[str] = field(default_factory=set)
    records: dict[tuple[str, int], Token] = field(default_factory=dict)
    verified: Counter = field(default_factory=Counter)
    accepted: Counter = field(default_factory=Counter)
    lengths: Counter = field(default_factory=Counter)
    weights: Counter = field(default_factory=Counter)
    logits: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    spec_steps: int = 0
    gated_steps: int = 0
    proposers: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    cpu_seconds: float = 0.0


def residual_at_bug_temperature(p_t: torch.Tensor, p_d: torch.Tensor) -> torch.Tensor:
    """The planted bug in :func:`runtime.speculation.verifier.residual`: after a rejection
    (rows with a draft distribution) the extra token is drawn from
    max(0, p_t^(1/T') / Z − p_d), T' = :data:`BUG_TEMPERATURE`; bonus rows (p_d = 0) keep p_t.
    Acceptance, drafts and bonus tokens are untouched."""
    hot = torch.softmax(p_t.log() / BUG_TEMPERATURE, -1)  # zero where p_t is zero
    rejected = p_d.sum(-1, keepdim=True) > 0
    return REAL_RESIDUAL(torch.where(rejected, hot, p_t), p_d)


def pit(p: torch.Tensor, y: torch.Tensor, g: torch.Generator) -> list[float]:
    """u = P(Y more likely than y) + U·P(Y as likely as y) per row of ``p`` [n, V], ``y`` [n]:
    U(0, 1) exactly when y ~ p (ties at y's probability are spread by U)."""
    if p.shape[0] == 0:
        return []
    py = p.gather(1, y[:, None])
    above = torch.where(p > py, p, 0.0).sum(1, dtype=torch.float64)
    tie = (p == py).sum(1) * py[:, 0].double()
    return (above + torch.rand(len(y), generator=g, dtype=torch.float64) * tie).clamp(0.0, 1.0).tolist()


class Recorder:
    """Hooks on the engine's verification (``spec_round`` as the engine calls it): every
    emitted token's provenance and PIT values, drafts verified/accepted per slot, ℓ."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.seqs = None
        self.g = torch.Generator().manual_seed(PIT_SEED)
        self.real_spec_round = llm_engine.spec_round
        self.real_schedule = speculator.schedule

    def emit(self, rid: str, ev) -> None:
        if isinstance(ev, TextDelta):
            self.run.tokens.setdefault(rid, []).extend(ev.token_ids)
        elif not isinstance(ev, Finished):
            raise AssertionError(f"{rid}: {ev}")

    def wrap_verify(self, verify, gate=None):
        def wrapped(seqs, proposal, *args, **kwargs):
            self.seqs = seqs
            if proposal is not None and proposal.from_drafter is not None:  # hybrid: who drafted what
                step = "gate off" if gate is not None and not gate.last else "gate on"
                for mine, ell in zip(proposal.from_drafter, proposal.lengths):
                    if ell:
                        self.run.proposers[("dspark" if mine else "ngram", step)] += 1
            return verify(seqs, proposal, *args, **kwargs)

        return wrapped

    def schedule(self, policy, confidences, sps=None, *, weights=None, **kw):
        self.run.weights.update(round(w, 1) for w in weights or [])
        return self.real_schedule(policy, confidences, sps, weights=weights, **kw)

    def spec_round(self, target_logits, draft_probs, draft_tokens, lengths, starts, temperature, top_k, top_p,
                   generators, *, seeds=None, positions=None, min_p=None):
        res = self.real_spec_round(target_logits, draft_probs, draft_tokens, lengths, starts, temperature, top_k, top_p,
                                   generators, seeds=seeds, positions=positions, min_p=min_p)
        assert bool((temperature == 1).all() & (top_k == 0).all() & (top_p == 1).all())  # p_t = softmax(logits)
        assert min_p is None or not bool((min_p > 0).any())
        # the tokens the tests read: every verified slot that emitted one, every token of a seeded request
        accepted = res.verify.accepted.tolist()
        path, d_rows, residual, wanted = [], [], [], []
        first = d_off = 0
        for seq, ell, a in zip(self.seqs, lengths, accepted):
            if seq.request.sampling.seed is not None:
                wanted.extend(range(first, first + a + 1))
            for k in range(min(a + 1, ell)):
                path.append(first + k)
                d_rows.append(d_off + k)
                residual.append(k == a)
            first, d_off = first + a + 1, d_off + ell
        rows = [r for rr in res.token_rows for r in rr]
        y = torch.tensor([t for ts in res.tokens for t in ts])
        wanted = sorted(set(wanted) | set(path))
        p = torch.softmax(target_logits[[rows[i] for i in wanted]].float(), -1)
        u = dict(zip(wanted, pit(p, y[wanted], self.g)))
        u_path = {}
        if path:
            at = {i: n for n, i in enumerate(wanted)}
            p_t, p_d = p[[at[i] for i in path]], draft_probs[d_rows]
            law = torch.where(torch.tensor(residual)[:, None], REAL_RESIDUAL(p_t, p_d), torch.minimum(p_t, p_d))
            u_path = dict(zip(path, pit(law / law.sum(1, keepdim=True), y[path], self.g)))
        j = 0
        for seq, ell, a, toks, trows, q in zip(self.seqs, lengths, accepted, res.tokens, res.token_rows, positions):
            rid = seq.request_id
            for k in range(ell):
                self.run.verified[k] += 1
                self.run.accepted[k] += k < a
            if ell:
                self.run.lengths[ell] += 1
            for k, (tok, row) in enumerate(zip(toks, trows)):
                how = "accepted" if k < a else "plain" if ell == 0 else "residual" if a < ell else "bonus"
                self.run.records[(rid, q + k)] = Token(tok, how, u.get(j), u_path.get(j))
                if rid in CHECKED:
                    self.run.logits[(rid, q + k)] = target_logits[row].clone()
                j += 1
        return res


def requests_of(setting: Setting, prompt: list[int], seeded: bool = True) -> list[GenerationRequest]:
    """Unseeded requests (an SLA target on every other one) with the seeded ones (if
    ``seeded``) spread among them, so both kinds share every batch."""
    sp = SamplingParams(temperature=1.0, max_tokens=setting.max_tokens)
    reqs = [GenerationRequest(f"u{i}", prompt, sp, sla_target_tokens_per_s=setting.sla_target if i % 2 == 0 else None)
            for i in range(setting.num_unseeded)]
    every = max(1, setting.num_unseeded // max(1, setting.num_seeded))
    for i in range(setting.num_seeded if seeded else 0):
        params = SamplingParams(temperature=1.0, max_tokens=setting.max_tokens, seed=1_000_003 * (i + 1))
        reqs.insert(i * (every + 1), GenerationRequest(f"s{i}", prompt, params,
                                                       sla_target_tokens_per_s=setting.sla_target if i % 2 else None))
    return reqs


def run_engine(engine: LLMEngine, setting: Setting, prompt: list[int], bug: bool) -> Run:
    """All requests of ``setting`` through ``engine`` (admitted at once, :data:`BATCH`
    decode together), with deterministic generators, the forced gate and the step clock."""
    run = Run()
    rec = Recorder(run)
    clock = StepClock()
    gens = itertools.count(GEN_SEED)

    def generator(params, device="cpu"):
        if params.seed is not None:
            return request_generator(params, device)
        return torch.Generator(device=device).manual_seed(next(gens))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llm_engine, "request_generator", generator)
        mp.setattr(llm_engine, "spec_round", rec.spec_round)
        mp.setattr(llm_engine, "time", clock)
        mp.setattr(sequence, "time", clock)
        mp.setattr(speculator, "schedule", rec.schedule)
        gate = ForcedGate(setting.gate)
        mp.setattr(engine, "_verify", rec.wrap_verify(engine._verify, gate))
        mp.setattr(engine, "emit", rec.emit)
        mp.setattr(engine, "gate", gate)
        if setting.spec_method == "hybrid":  # which requests DSpark drafts: from past rounds, not from timings
            mp.setattr(engine.speculator, "_worth_drafting", lambda seqs, rnd, wanted: wanted)
        if bug:  # planted in the torch specification; its C++ twin (same tokens) is off meanwhile
            mp.setattr(verifier, "residual", residual_at_bug_temperature)
            mp.setattr(verifier, "cpu_verify_path", lambda t: False)
        t0, c0 = time.perf_counter(), time.process_time()
        spec0, gated0 = engine.spec_steps, engine.gated_steps
        for req in requests_of(setting, prompt, seeded=not bug):  # the bug cannot touch seeded requests
            if req.sampling.seed is not None:
                run.seeded.add(req.request_id)
            engine.add_request(req)
        while engine.has_work():
            engine.step()
            clock.now += STEP_SECONDS
        run.seconds, run.cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        run.spec_steps, run.gated_steps = engine.spec_steps - spec0, engine.gated_steps - gated0
    assert len(run.tokens) == setting.num_unseeded + len(run.seeded)
    # keep what the requests emitted (EOS ends a request inside a round)
    run.records = {(rid, q): t for (rid, q), t in run.records.items() if q < len(run.tokens[rid])}
    run.logits = {(rid, q): row for (rid, q), row in run.logits.items() if q < len(run.tokens[rid])}
    assert all(run.tokens[rid][q] == t.token for (rid, q), t in run.records.items())
    assert len(run.records) == sum(len(t) - 1 for t in run.tokens.values())
    return run


# -- the target's exact distributions --------------------------------------------------


def continuation_logits(model, prompt: list[int], conts) -> dict[tuple[int, ...], torch.Tensor]:
    """Target logits after ``prompt + c[:j]`` for j = 0..len(c), fp32 ``[len(c) + 1, V]`` per
    continuation ``c``: plain forwards of ``[prompt[-1], *c]`` on fresh KV slots holding
    ``prompt[:-1]`` (computed once), independent of the engine and its caches."""
    p = len(prompt) - 1
    base = model.new_cache(1, p)
    model.forward(torch.tensor(prompt[:-1]), [SeqSpan(base.allocate(), 0, p)], base, None)
    out: dict[tuple[int, ...], torch.Tensor] = {}
    todo = sorted(set(conts))
    for i in range(0, len(todo), 32):
        chunk = todo[i : i + 32]
        cache = model.new_cache(len(chunk), p + max(len(c) for c in chunk) + 1)
        cache.k[:, :, :, :p] = base.k[:, 0:1, :, :p]
        cache.v[:, :, :, :p] = base.v[:, 0:1, :, :p]
        spans = []
        for s, c in enumerate(chunk):
            cache.allocate()
            cache.lengths[s] = p
            spans.append(SeqSpan(s, p, len(c) + 1))
        ids = torch.tensor([t for c in chunk for t in (prompt[-1], *c)])
        logits = model.forward(ids, spans, cache, torch.arange(ids.numel())).logits
        start = 0
        for c in chunk:
            out[c] = logits[start : start + len(c) + 1]
            start += len(c) + 1
    return out


def chi2_tokens(observed: Counter, p: torch.Tensor, n: int) -> tuple[float, int]:
    """Pearson chi-square of token counts (n draws) against ``p`` [V]: one cell per token
    with expected count ≥ :data:`MIN_EXPECTED`, every other token in one "other" cell
    (merged into the smallest cell when its own expectation is below that). (stat, df)."""
    exp = p.double() * n
    keep = sorted((exp >= MIN_EXPECTED).nonzero().squeeze(-1).tolist(), key=lambda t: -float(exp[t]))
    e = [float(exp[t]) for t in keep]
    o = [observed.get(t, 0) for t in keep]
    if n - sum(e) >= MIN_EXPECTED:
        e.append(n - sum(e))
        o.append(n - sum(o))
    elif e:
        e[-1] += n - sum(e)
        o[-1] += n - sum(o)
    if len(e) < 2:
        return 0.0, 0
    return sum((oi - ei) ** 2 / ei for oi, ei in zip(o, e)), len(e) - 1


def pit_test(us: list[float]) -> tuple[float, list[int]]:
    """Chi-square of PIT values against U(0, 1) in the bins :data:`PIT_EDGES`: (p, counts)."""
    edges = torch.tensor(PIT_EDGES, dtype=torch.float64)
    counts = torch.bincount(torch.bucketize(torch.tensor(us, dtype=torch.float64), edges[1:-1], right=True),
                            minlength=len(edges) - 1).tolist()
    expected = [(b - a) * len(us) for a, b in zip(PIT_EDGES, PIT_EDGES[1:])]
    return float(stats.chisquare(counts, expected).pvalue), counts


@dataclass
class Verdict:
    """p-values of one run (module docstring), with what they were computed from."""

    token: dict[int, tuple[float, float, int, int, int]]  # 1-based position → (p, stat, df, groups, draws)
    pit: dict[str, tuple[float, list[int]]]  # test name → (p, bin counts)
    logits_max_diff: float  # engine verification rows vs independent forwards (CHECKED requests)

    @property
    def pvalues(self) -> dict[str, float]:
        token = {f"token@{k}": v[0] for k, v in self.token.items() if v[2] > 0}  # df 0: no test
        return {**token, **{k: v[0] for k, v in self.pit.items()}}

    @property
    def family_p(self) -> float:
        """Bonferroni over every p-value of the run."""
        ps = self.pvalues.values()
        return min(1.0, min(ps) * len(ps))


def judge(model, prompt: list[int], run: Run, positions=(1, 2, 3)) -> Verdict:
    """The tests of one run (unseeded requests unless named "seeded"):

    * ``token@k``: tokens at output position k (1-based) against p_t(·|prompt, tokens
      before), per group of ≥ :data:`MIN_GROUP` requests sharing those tokens, pooled;
    * ``pit``: every token at positions ≥ 2 that came from a verified draft slot
      (accepted or residual: whether a slot is verified is decided before its draft is
      drawn, so this selection keeps p_t), PIT under p_t;
    * ``pit_residual`` / ``pit_accepted``: the same tokens under their path's exact law;
    * ``pit_seeded``: every token at positions ≥ 2 of the seeded requests, under p_t.
    """
    unseeded = [rid for rid in run.tokens if rid not in run.seeded]
    groups = {}
    for pos in positions:
        by = defaultdict(list)
        for rid in unseeded:
            if len(run.tokens[rid]) >= pos:
                by[tuple(run.tokens[rid][: pos - 1])].append(rid)
        groups[pos] = {k: v for k, v in by.items() if len(v) >= MIN_GROUP}
    checked = {rid: tuple(run.tokens[rid][:-1]) for rid in CHECKED if rid in run.tokens}
    logits = continuation_logits(model, prompt, [k for g in groups.values() for k in g] + list(checked.values()))
    token = {}
    for pos, g in groups.items():
        stat = df = draws = 0
        for prefix, rids in g.items():
            p = torch.softmax(logits[prefix][-1].float(), -1)
            s, d = chi2_tokens(Counter(run.tokens[r][pos - 1] for r in rids), p, len(rids))
            stat, df, draws = stat + s, df + d, draws + len(rids)
        token[pos] = (float(stats.chi2.sf(stat, df)) if df else 1.0, stat, df, len(g), draws)
    diff = max((logits[checked[rid]][q] - row).abs().max().item() for (rid, q), row in run.logits.items())
    mine = [t for (rid, _), t in run.records.items() if rid not in run.seeded]
    pits = {
        "pit": pit_test([t.u for t in mine if t.how in ("accepted", "residual")]),
        "pit_residual": pit_test([t.u_path for t in mine if t.how == "residual"]),
        "pit_accepted": pit_test([t.u_path for t in mine if t.how == "accepted"]),
    }
    if run.seeded:
        pits["pit_seeded"] = pit_test([t.u for (rid, _), t in run.records.items() if rid in run.seeded])
    return Verdict(token, pits, diff)


def report(name: str, run: Run, v: Verdict) -> str:
    how = defaultdict(Counter)
    for (rid, pos), t in run.records.items():
        if rid not in run.seeded:
            how[pos + 1][t.how] += 1
    lines = [f"{name}: {len(run.tokens)} requests ({len(run.seeded)} seeded), {len(run.records)} tokens from rounds, "
             f"{run.seconds:.1f} s wall, {run.cpu_seconds:.1f} s CPU",
             "  output position: accepted / residual / bonus / plain (unseeded requests)"]
    for pos in sorted(how):
        c = how[pos]
        lines.append(f"    {pos:2d}: {c['accepted']:4d} / {c['residual']:4d} / {c['bonus']:4d} / {c['plain']:4d}")
    lines.append("  draft slot: verified / accepted: "
                 + ", ".join(f"{k + 1}: {run.verified[k]}/{run.accepted[k]}" for k in sorted(run.verified)))
    lines.append(f"  ℓ of the speculative rounds: {dict(sorted(run.lengths.items()))}; decode steps: "
                 f"{run.spec_steps} speculative, {run.gated_steps} plain (forced gate)")
    if run.weights:
        lines.append(f"  SLA weights given to the scheduler: {dict(sorted(run.weights.items()))}")
    for pos, (p, stat, df, ng, n) in v.token.items():
        lines.append(f"  token@{pos}: {ng} groups, {n} draws, chi2 {stat:.1f}, df {df}, p = {p:.3g}")
    for name_, (p, counts) in v.pit.items():
        lines.append(f"  {name_}: {sum(counts)} tokens, bins {counts}, p = {p:.3g}")
    lines.append(f"  family p (Bonferroni) = {v.family_p:.3g}; engine vs independent logits: max |diff| "
                 f"{v.logits_max_diff:.2g}")
    return "\n".join(lines)


# -- fixtures ------------------------------------------------------------------------------


def warm_up(engine: LLMEngine, prompt: list[int]) -> None:
    """One greedy token of the prompt: its full blocks enter the prefix cache, so every
    request of a run prefills one token (the prompts have 16·k + 1 tokens)."""
    engine.add_request(GenerationRequest("warm-up", prompt, SamplingParams(temperature=0.0, max_tokens=1)))
    while engine.has_work():
        engine.step()
    assert engine.prefix_cache.num_cached_blocks >= (len(prompt) - 1) // 16


@pytest.fixture(scope="module")
def gguf_model(target_gguf, gguf_kernel):
    return target_gguf


@pytest.fixture(scope="module")
def runs(gguf_model, tokenizer):
    """name → (prompt ids, correct Run, bugged Run or None outside :data:`BUG_METHODS`): one engine per setting, built and run
    on first use, the correct run first (the order fixes every random number)."""
    done = {}

    def get(name: str):
        if name not in done:
            s = SETTINGS[name]
            prompt = chat_ids(tokenizer, s.prompt)
            assert len(prompt) % 16 == 1, len(prompt)
            engine = LLMEngine(
                EngineConfig(dtype="gguf", max_batch_size=BATCH, max_context=len(prompt) + s.max_tokens + 8,
                             request_timeout_s=3600.0, spec_method=s.spec_method, spec_policy=s.spec_policy,
                             num_speculative_tokens=s.gamma, spec_gate=True),
                lambda rid, ev: None, model=gguf_model, tokenizer=tokenizer,
            )  # fmt: skip
            assert engine.speculator.fast is not None or s.spec_method != "dspark"  # the served, fused drafter
            if s.sps is not None:
                engine.speculator.sps_table = s.sps
            engine.speculator.live_cost = None  # the drafting volume (the test's power) must not follow timings
            engine.speculator.predraft = False  # dspark: the forced gate below is the whole choice to draft
            if name in BUG_METHODS:  # nor the acceptance it learns: the planted bug needs its residual draws
                engine.speculator.learned = AcceptanceTracker(prior=1e12)
            warm_up(engine, prompt)
            done[name] = (prompt, run_engine(engine, s, prompt, False),
                          run_engine(engine, s, prompt, True) if name in BUG_METHODS else None)
        return done[name]

    return get


# -- tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", METHODS)
def test_engine_output_is_the_target_distribution(gguf_model, runs, name):
    prompt, run, _ = runs(name)
    v = judge(gguf_model, prompt, run)
    print("\n" + report(name, run, v))
    # every path is exercised (drafts accepted and rejected at slots 1 and 2), and both gate modes
    mine = Counter(t.how for (rid, _), t in run.records.items() if rid not in run.seeded)
    assert mine["accepted"] >= 100 and mine["residual"] >= 1000 and mine["bonus"] >= 20 and mine["plain"] >= 200, mine
    for k in range(min(SETTINGS[name].gamma, 2)):
        assert run.accepted[k] >= 20 and run.verified[k] - run.accepted[k] >= 100, (k, run.verified, run.accepted)
    if SETTINGS[name].spec_method == "hybrid":
        # both proposers verified drafts; the forced gate's plain steps drafted no DSpark block but
        # still verified n-gram drafts (so no step of the hybrid is a plain one)
        p = run.proposers
        assert p[("dspark", "gate on")] >= 100 and p[("ngram", "gate on")] >= 100 and p[("ngram", "gate off")] >= 20, p
        assert p[("dspark", "gate off")] == 0, p
    else:
        assert run.spec_steps >= 3 * run.gated_steps > 0
    if SETTINGS[name].sla_target is not None:  # SLA weights reached the scheduler
        assert sum(n for w, n in run.weights.items() if w >= 2.0) >= 500 and run.weights[1.0] >= 500
    assert v.logits_max_diff == 0.0  # gguf is row-invariant: the engine's rows are the target's exactly
    assert v.family_p > 0.01, v.pvalues


@pytest.mark.parametrize("name", BUG_METHODS)
def test_planted_residual_bug_is_caught(gguf_model, runs, name):
    prompt, _, run = runs(name)
    v = judge(gguf_model, prompt, run)
    print("\n" + report(name + " with the residual at T = 1.05", run, v))
    assert v.pit["pit_residual"][0] < 1e-3, v.pvalues  # the path that went wrong
    assert v.pit["pit"][0] < 0.01, v.pvalues  # and what reaches the client


# -- the SLA weight in the scheduler ------------------------------------------------------

GOLD_TARGET = 100.0  # tokens/s: the step clock gives a request 1/STEP_SECONDS = 10 tok/s per token per round


def sla_run(model, tokenizer, prompt: list[int], gold_target: float | None, spec_method: str = "dspark"):
    """Eight T = 0 requests on one prompt, "gold" first (SLA target ``gold_target``), the
    others best effort; ``dspark-sla`` on every step (gate off), the step clock injected.
    Returns (texts, SpecStats, the weights :func:`sla_weight` gave the gold request)."""
    texts, spec, gold_weights = {}, {}, []
    engine = LLMEngine(
        EngineConfig(dtype="gguf", max_batch_size=8, max_context=len(prompt) + 40, request_timeout_s=3600.0,
                     spec_method=spec_method, spec_policy="dspark-sla", num_speculative_tokens=4, spec_gate=False),
        lambda rid, ev: texts.__setitem__(rid, texts.get(rid, "") + ev.text) if isinstance(ev, TextDelta)
        else spec.__setitem__(rid, ev.spec),
        model=model, tokenizer=tokenizer,
    )  # fmt: skip
    if engine.speculator is not None:
        engine.speculator.sps_table = sps_affine(1.0, 0.06)
        engine.speculator.live_cost = None  # round times are the StepClock's, not this machine's
    clock = StepClock()
    real_weight = speculator.sla_weight

    def weight(target, measured, **kw):
        w = real_weight(target, measured, **kw)
        if target is not None:
            gold_weights.append(w)
        return w

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llm_engine, "time", clock)
        mp.setattr(sequence, "time", clock)
        mp.setattr(speculator, "sla_weight", weight)
        for i in range(8):
            engine.add_request(GenerationRequest("gold" if i == 0 else f"be{i}", prompt,
                                                 SamplingParams(temperature=0.0, max_tokens=32),
                                                 sla_target_tokens_per_s=gold_target if i == 0 else None))
        while engine.has_work():
            engine.step()
            clock.now += STEP_SECONDS
    return texts, spec, gold_weights


def test_gold_request_below_its_sla_target_gets_more_drafts_verified(gguf_model, tokenizer):
    """A gold request below its SLA target, in one batch with seven best-effort requests on
    the same prompt at T = 0 (so every request drafts the same tokens with the same
    confidences): under ``dspark-sla`` it verifies more drafts per round than each of them,
    only because of its weight (the same batch without the target verifies like the
    others), and every text is plain decoding's."""
    prompt = chat_ids(tokenizer, "Explain how rain forms.")
    plain, _, _ = sla_run(gguf_model, tokenizer, prompt, None, spec_method="none")
    texts, spec, weights = sla_run(gguf_model, tokenizer, prompt, GOLD_TARGET)
    ctrl_texts, ctrl, ctrl_weights = sla_run(gguf_model, tokenizer, prompt, None)
    per_round = {k: st.verified / st.rounds for k, st in spec.items()}
    ctrl_per_round = {k: st.verified / st.rounds for k, st in ctrl.items()}
    print(f"\ngold weights {[round(w, 2) for w in weights]}\nverified per round: {per_round}\n"
          f"control (no target): {ctrl_per_round}")
    assert texts == ctrl_texts == plain and len(set(plain.values())) == 1 and len(plain["gold"]) > 50
    # how the weight reaches the scheduler: unknown speed (< 2 tokens) → 1, then the
    # measured deficit on the step clock (≤ 10 tok/s per token a round, target 100) → > 3
    assert weights[0] == 1.0 and min(weights[1:]) > 3.0 and not ctrl_weights
    best_effort = [v for k, v in per_round.items() if k != "gold"]
    assert per_round["gold"] >= 1.5 * max(best_effort), per_round
    # without the target the gold request is one of the crowd
    assert max(ctrl_per_round.values()) - min(ctrl_per_round.values()) < 0.2 * max(ctrl_per_round.values())
