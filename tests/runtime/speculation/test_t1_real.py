"""T = 1 losslessness of one speculative round on the REAL model with the random-init
DSpark drafter; the two planted verifier bugs are caught at the same N.

Setting (fp32, γ = 2, fixed verification of the whole block):

* Prompt ``"Step 1"`` (raw text, no chat template): its last token ("1") is the
  anchor x_0, the rest is prefilled once into the target KV cache and the drafter's
  context cache. The target's next-token distribution is spread (entropy ≈ 3.4 nats,
  ~35 tokens with ≥ 5 expected hits in 4096 draws).
* The random drafter (seed 3, unmodified init) tends to propose digits after "1", so
  its p_d overlaps p_t: Σ min(p_t, p_d) ≈ 0.2 at position 1 — the accept path is
  exercised (≈ 900 of 4096 rounds accept x_1) as well as the residual path, and both
  planted bugs shift the output by a lot (chi-square non-centrality ≫ 100).
  Position 2 overlaps much less (the drafter's slot-2 guess is rarely what follows a
  digit), so x_2 is accepted only a handful of times; position 2 mostly tests the
  residual at k = 2 (counts are printed).
* N = 4096 forks of that one prefilled sequence, one speculative round each, each
  fork with its own generator. The drafter's block forward depends only on the
  shared context and anchor, so it runs once; ``sample_block`` then draws x_1, x_2
  (Markov head) per fork, and :func:`spec_round` (the engine's verification entry
  point) verifies each fork. The target's verification rows come from the engine's
  ragged verification forward ``[x_0, x_1, x_2]`` on KV slots forked from the
  prefilled one, computed once per distinct value they depend on (row 0: shared;
  row 1: x_1; row 2: (x_1, x_2)) and only where verification reads them (see
  :func:`run_rounds` — exact, and checked equal to computing every fork's rows).
  The drafts are verified three ways (correct and the two planted bugs) from the same
  generator states, as three runs with the same seeds would be.

Checks (chi-square on the top tokens + an "other" bin, expected counts ≥ 5):

* position 1: y_1 over all N forks vs the target's p_t(·|prompt), from an independent
  plain forward (no forked cache);
* position 2: y_2 of the forks that accepted x_1 = v, given v, vs p_t(·|prompt, v) —
  exactly the target's conditional (after an accepted x_1 the second position is a
  fresh speculative step); groups v with ≥ 20 forks, cells pooled over groups
  (df = Σ_v (cells_v − 1)).

Correct verifier: p > 0.01 at T = 1 and at T = 1, top_p = 0.9. Planted bugs (T = 1):
residual drawn from p_t instead of norm(max(0, p_t − p_d)) (``residual_from_target``)
and verification against the pre-Markov p_d (the base logits U without the Markov
bias) while the drafts were sampled from the corrected one: p < 1e-4 at position 1.
Under the prefix scheduler (``test_t1_real_model_rounds_under_the_scheduler_match_target``):
the same rounds, but each fork's verified prefix ℓ ∈ {0, 1, 2} is chosen by
``schedule("dspark-sla", c, SPS, weights)`` from its own calibrated confidences, as the
engine's Speculator does; the SPS table is built so that ℓ = 2 is taken exactly when
a_2 = c_1·c_2(x_1) is above a threshold splitting the forks (observed ℓ = 1 / 2:
450 / 3646 at T = 1, 410 / 3686 at top_p 0.9; p1 = 0.46 / 0.70, p2 = 0.32 / 0.22).

Runtime: ≈ 55 s CPU time (one thread; ≈ 55 s wall on an idle 2-core box, ≈ 100 s with
the box's usual contention), dominated by sampling/warping 49152-way rows.
Observed (seeded, deterministic): T = 1: p1 = 0.75, p2 = 0.90, x_1 accepted 905/4096,
x_2 accepted 16; top_p 0.9: p1 = 0.43, p2 = 0.42, 725 and 2; bugs: p1 = 3e-105
(residual from p_t) and 7e-43 (pre-Markov p_d).
"""

from __future__ import annotations

import ctypes
from contextlib import nullcontext
from dataclasses import dataclass

import pytest
import torch
from scipy import stats

from runtime.speculation.config import DrafterConfig
from runtime.speculation.drafter import DraftBlock, DSparkDrafter
from runtime.speculation.verifier import spec_round
from runtime.models.llama import SeqSpan
from runtime.engine.sampler import SamplingBatch, warp_probs
from tests.runtime.speculation.test_verifier import residual_from_target

pytestmark = pytest.mark.model

PROMPT = "Step 1"
DRAFT_SEED = 3
GAMMA = 2
N = 4096
CHUNK = 256  # forks per batch (CHUNK·3 rows × 49152 fp32 ≈ 150 MB)
MIN_GROUP = 20  # position 2: smallest conditioning group (forks with the same accepted x_1)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


@dataclass
class Fork:
    model: object
    drafter: DSparkDrafter
    ids: list[int]  # prompt tokens; the last one is the anchor
    cache: object  # target KV cache, slot 0 = prompt[:-1]
    block: DraftBlock  # the drafter's block for the anchor, [1, γ, ...]
    ref_logits: dict  # continuation tuple → reference logits [V] (independent forwards)
    pair_logits: dict  # (x1, x2) → verification logits [3, V] (forked-cache forwards)

    @property
    def p(self) -> int:
        return len(self.ids) - 1

    @property
    def anchor(self) -> int:
        return self.ids[-1]


@pytest.fixture(scope="module")
def fork(target_fp32, tokenizer) -> Fork:
    ids = tokenizer.encode(PROMPT)
    assert tokenizer.decode(ids[-1:]) == "1"
    drafter = DSparkDrafter(target_fp32, DrafterConfig(block_size=GAMMA, markov_rank=64, init_seed=DRAFT_SEED))
    p = len(ids) - 1
    cache = target_fp32.new_cache(1, p + GAMMA + 1)
    slot = cache.allocate()
    out = target_fp32.forward(torch.tensor(ids[:-1]), [SeqSpan(slot, 0, p)], cache, None, drafter.tap_layers)
    dcache = drafter.new_context_cache(1, p + GAMMA + 1)
    drafter.extend_context(dcache, out.taps, [slot], [p])
    block = drafter.propose(torch.tensor([ids[-1]]), [slot], dcache, GAMMA)
    f = Fork(target_fp32, drafter, ids, cache, block, {}, {})
    # Row 1 of the x_1 values that can be accepted (the overlap of p_t and p_d,1), in one
    # batch up front instead of one forward per new value (time only; exactness is unaffected).
    pd1 = torch.softmax(drafter.markov.corrected_logits(block.base_logits[:, 0], torch.tensor([f.anchor]))[0], -1)
    likely = torch.minimum(torch.softmax(reference_logits(f, ()), -1), pd1).topk(32).indices.tolist()
    verification_logits(f, [(x1, x1) for x1 in likely])
    return f


def warp1(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    return warp_probs(logits[None], torch.ones(1), torch.zeros(1, dtype=torch.long), torch.full((1,), top_p))[0]


def reference_logits(f: Fork, cont: tuple[int, ...]) -> torch.Tensor:
    """Target logits [V] after prompt + cont, from a plain forward (fresh cache, no fork)."""
    if cont not in f.ref_logits:
        ids = f.ids + list(cont)
        cache = f.model.new_cache(1, len(ids))
        s = cache.allocate()
        out = f.model.forward(torch.tensor(ids), [SeqSpan(s, 0, len(ids))], cache, torch.tensor([len(ids) - 1]))
        f.ref_logits[cont] = out.logits[0]
    return f.ref_logits[cont]


def verification_logits(f: Fork, pairs: list[tuple[int, int]]) -> None:
    """Fill ``f.pair_logits`` for new (x1, x2): the engine's ragged verification forward
    ``[x0, x1, x2]`` per pair, on KV slots forked from the prefilled one."""
    todo = sorted(set(pairs) - f.pair_logits.keys())
    for i in range(0, len(todo), 64):
        chunk = todo[i : i + 64]
        k = len(chunk)
        cache = f.model.new_cache(k, f.p + GAMMA + 1)
        cache.k[:, :k, :, : f.p] = f.cache.k[:, 0:1, :, : f.p]
        cache.v[:, :k, :, : f.p] = f.cache.v[:, 0:1, :, : f.p]
        spans = []
        for s in range(k):
            cache.allocate()
            cache.lengths[s] = f.p
            spans.append(SeqSpan(s, f.p, 1 + GAMMA))
        ids = torch.tensor([[f.anchor, x1, x2] for x1, x2 in chunk]).reshape(-1)
        out = f.model.forward(ids, spans, cache, torch.arange(ids.numel()))
        for j, pair in enumerate(chunk):
            f.pair_logits[pair] = out.logits[3 * j : 3 * j + 3]


def fork_logits(f: Fork, pairs: list[tuple[int, int]], real: int) -> torch.Tensor:
    """Verification logits ``[3·len(pairs), V]`` of forks with drafts ``pairs``.

    Rows ``[0, real)`` are the fork's real rows; later ones hold row 0 as a placeholder
    (see :func:`run_rounds` for why that is exact). Row 0 (after the anchor) is the same
    for every fork and row 1 (after x1) depends only on x1 (causal attention), so they
    are taken from any computed pair sharing them; row 2 needs the fork's own pair.
    """
    if not f.pair_logits:
        verification_logits(f, [pairs[0]])
    if real >= 2:
        have = {x1 for x1, _ in f.pair_logits}
        verification_logits(f, list({x1: (x1, x2) for x1, x2 in pairs if x1 not in have}.values()))
    if real >= 3:
        verification_logits(f, pairs)
    row1 = {x1: rows[1] for (x1, _), rows in f.pair_logits.items()}
    row0 = next(iter(f.pair_logits.values()))[0]
    out = row0.expand(len(pairs), GAMMA + 1, -1)
    if real == 1:
        return out.reshape(-1, row0.shape[-1])  # a view: no copy
    out = out.clone()
    for i, (x1, x2) in enumerate(pairs):
        if real >= 2:
            out[i, 1] = row1[x1]
        if real >= 3:
            out[i, 2] = f.pair_logits[(x1, x2)][2]
    return out.reshape(-1, row0.shape[-1])


@dataclass
class RoundStats:
    y1: torch.Tensor  # [N] first output token
    x1_accepted: torch.Tensor  # [N] bool
    y2: torch.Tensor  # [N] second output token (valid where x1_accepted)
    accepted: torch.Tensor  # [N] a ∈ {0, 1, 2}
    alpha1: float  # Σ min(p_t, p_d) at position 1 (acceptance probability of x_1)
    lengths: torch.Tensor  # [N] verified prefix length ℓ of each fork


VARIANTS = (None, "residual_from_target", "pre_markov_pd")


def run_rounds(f: Fork, top_p: float, variants=(None,), n: int = N, seed: int = 0, plan=None) -> dict:
    """One speculative round (γ = 2) for each of n forks; first two output tokens.

    ``plan``: ``None`` verifies the whole block (ℓ = γ = 2); otherwise a callable
    ``(confidence [γ] fp32) -> ℓ`` run per fork after drafting, before verification
    (the engine's scheduler: it sees the fork's confidences, never the target).

    Every fork's drafts are sampled once and then verified by each of ``variants``:
    ``None`` (the real verifier), ``"residual_from_target"`` (planted bug:
    :func:`tests.runtime.speculation.test_verifier.residual_from_target`) or ``"pre_markov_pd"``
    (planted bug: verify against warp(U), the base logits without the Markov bias,
    while the drafts were sampled from U + B(x_{k−1})). Each variant starts from the
    same generator states (after drafting), as separate engine runs with the same
    seeds would.

    Exactness of the lazily computed target rows: fork i's outcome depends only on its
    own rows, drafts, p_d and generator (verification is row-wise, one generator per
    fork), and row k ≥ 1 (the target after x_k) is read only if x_1..x_k were all
    accepted. So every fork is first verified with row 0 in all three rows (final for
    the forks that reject x_1); the forks that accepted x_1 are re-verified from the
    same generator state with their real row 1 (final unless x_2 was accepted too);
    those are re-verified with real rows 1 and 2. Each fork consumes exactly the
    randomness it would in one engine round. (Checked: computing every fork's real
    rows up front gives identical outputs — just 10× slower.)

    Returns:
        ``{variant: RoundStats}``.
    """
    V = f.model.cfg.vocab_size
    out = {v: ([], [], []) for v in variants}
    lengths_seen: list[int] = []
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        gens = [torch.Generator().manual_seed(1_000_003 * seed + start + i) for i in range(m)]
        temp, top_k, tp = torch.ones(m), torch.zeros(m, dtype=torch.long), torch.full((m,), top_p)
        blk = DraftBlock(f.block.base_logits.expand(m, -1, -1), f.block.hidden.expand(m, -1, -1))
        anchors = torch.full((m,), f.anchor, dtype=torch.long)
        ds = f.drafter.sample_block(blk, anchors, SamplingBatch(temp, top_k, tp, gens))
        states = [g.get_state() for g in gens]  # after drafting: where verification starts
        pairs = list(zip(ds.tokens[:, 0].tolist(), ds.tokens[:, 1].tolist()))
        ells = [GAMMA] * m if plan is None else [plan(ds.confidence[i]) for i in range(m)]
        lengths_seen += ells
        for variant in variants:
            p_d = ds.probs
            if variant == "pre_markov_pd":
                rep = lambda t: t.repeat_interleave(GAMMA)  # noqa: E731
                p_d = warp_probs(blk.base_logits.reshape(m * GAMMA, V), rep(temp), rep(top_k), rep(tp)).view(m, GAMMA, V)
            bug = variant == "residual_from_target"
            tokens: list[list[int]] = [[] for _ in range(m)]
            accepted = [0] * m
            todo = list(range(m))
            for real in (1, 2, 3):  # rows [0, real) are the fork's real ones
                if not todo:
                    break
                for i in todo:
                    gens[i].set_state(states[i])
                idx = torch.tensor(todo, dtype=torch.long)
                rows = fork_logits(f, [pairs[i] for i in todo], real).view(len(todo), GAMMA + 1, V)
                if all(ells[i] == GAMMA for i in todo):
                    t_rows, d_rows, d_toks = rows.reshape(-1, V), p_d[idx].reshape(-1, V), ds.tokens[idx].reshape(-1)
                else:  # ragged prefixes ℓ_i: rows [0, 1 + ℓ_i) of fork i, drafts [0, ℓ_i)
                    t_rows = torch.cat([rows[j, : 1 + ells[i]] for j, i in enumerate(todo)])
                    d_rows = torch.cat([p_d[i, : ells[i]] for i in todo])
                    d_toks = torch.cat([ds.tokens[i, : ells[i]] for i in todo])
                with residual_from_target() if bug else nullcontext():
                    res = spec_round(
                        t_rows, d_rows, d_toks, [ells[i] for i in todo], [f.p] * len(todo),
                        temp[idx], top_k[idx], tp[idx], [gens[i] for i in todo],
                    )  # fmt: skip
                nxt = []
                for i, a, t in zip(todo, res.verify.accepted.tolist(), res.tokens):
                    tokens[i], accepted[i] = t, a
                    if a >= real:  # read a placeholder row: redo with one more real row
                        nxt.append(i)
                todo = nxt
            assert not todo
            y1, y2, acc = out[variant]
            y1 += [t[0] for t in tokens]
            y2 += [t[1] if len(t) > 1 else -1 for t in tokens]
            acc += accepted
    alpha1 = float(torch.minimum(warp1(reference_logits(f, ()), top_p), ds.probs[0, 0]).sum())  # p_d,1 is shared
    result = {}
    for variant, (y1, y2, acc) in out.items():
        a = torch.tensor(acc)
        result[variant] = RoundStats(torch.tensor(y1), a >= 1, torch.tensor(y2), a, alpha1,
                                     torch.tensor(lengths_seen))
    return result


@pytest.fixture(scope="module")
def cpu_tuning():
    """Time only (results are unaffected): one torch thread — on the shared 2-core box
    these small memory-bound ops run 2–3× faster than with two spinning OpenMP threads
    under contention — and glibc malloc keeping freed memory (M_MMAP_THRESHOLD /
    M_TRIM_THRESHOLD), so the ~50–150 MB [rows, 49152] temporaries are not re-faulted
    from the kernel on every allocation (system time 5.5 s → 0.3 s per 1024 forks).
    Both restored afterwards (the malloc thresholds to glibc's 128 KiB defaults)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    libc = None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
        libc.mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1)
    except (OSError, AttributeError):  # not glibc: just slower
        libc = None
    yield
    torch.set_num_threads(n)
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)
        libc.mallopt(M_TRIM_THRESHOLD, 128 * 1024)
        libc.malloc_trim(0)


@pytest.fixture(scope="module")
def rounds(fork, cpu_tuning) -> dict:
    """{top_p: {variant: RoundStats}}: T = 1 with all variants, T = 1 + top_p 0.9 correct only."""
    return {1.0: run_rounds(fork, 1.0, VARIANTS), 0.9: run_rounds(fork, 0.9, (None,))}


def chi2_cells(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Chi-square statistic and df of one multinomial sample: cells with expected ≥ 5
    plus one "other" cell (merged into the smallest cell if its expectation is < 5)."""
    n = float(counts.sum())
    exp = probs.double() * n
    obs = counts.double()
    big = exp >= 5
    o = torch.cat([obs[big], obs[~big].sum()[None]])
    e = torch.cat([exp[big], exp[~big].sum()[None]])
    if e[-1] < 5:
        i = int(e[:-1].argmin())
        o[i] += o[-1]
        e[i] += e[-1]
        o, e = o[:-1], e[:-1]
    return float(((o - e) ** 2 / e.clamp_min(1e-300)).sum()), len(e) - 1


def position_pvalues(f: Fork, st: RoundStats, top_p: float) -> tuple[float, float, dict]:
    """(p at position 1, p at position 2, info) — see the module docstring."""
    V = f.model.cfg.vocab_size
    stat1, df1 = chi2_cells(torch.bincount(st.y1, minlength=V), warp1(reference_logits(f, ()), top_p))
    p1 = float(stats.chi2.sf(stat1, df1))
    stat2, df2, groups = 0.0, 0, {}
    x1 = st.y1[st.x1_accepted]
    y2 = st.y2[st.x1_accepted]
    for v, cnt in zip(*torch.unique(x1, return_counts=True)):
        if int(cnt) < MIN_GROUP:
            continue
        q = warp1(reference_logits(f, (int(v),)), top_p)
        s, d = chi2_cells(torch.bincount(y2[x1 == v], minlength=V), q)
        stat2, df2 = stat2 + s, df2 + d
        groups[int(v)] = int(cnt)
    p2 = float(stats.chi2.sf(stat2, df2)) if df2 > 0 else float("nan")
    info = dict(
        df1=df1, df2=df2, groups=groups, alpha1=round(st.alpha1, 4),
        x1_accepted=int(st.x1_accepted.sum()), x2_accepted=int((st.accepted == 2).sum()),
        distinct_pairs=len(f.pair_logits),
    )  # fmt: skip
    return p1, p2, info


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_t1_real_model_rounds_match_target(fork, rounds, top_p):
    st = rounds[top_p][None]
    p1, p2, info = position_pvalues(fork, st, top_p)
    print(f"T=1 top_p={top_p}: p1={p1:.4g} p2={p2:.4g} {info}")
    # the setting is powerful: x_1 overlaps the target, both accept and residual paths run
    assert info["x1_accepted"] > 0.05 * N and N - info["x1_accepted"] > 0.5 * N
    assert info["df1"] >= 10 and info["df2"] >= 5 and sum(info["groups"].values()) >= 0.05 * N
    if top_p == 1.0:
        assert st.alpha1 > 0.15
        assert info["x2_accepted"] > 0  # the accept path at position 2 runs too
    assert p1 > 0.01, info
    assert p2 > 0.01, info


@pytest.mark.parametrize("bug", ["residual_from_target", "pre_markov_pd"])
def test_t1_real_model_planted_bugs_are_caught(fork, rounds, bug):
    st = rounds[1.0][bug]
    p1, p2, info = position_pvalues(fork, st, 1.0)
    print(f"bug {bug}: p1={p1:.3g} p2={p2:.3g} {info}")
    assert p1 < 1e-4, info


# ---------------------------------------------------------------- under the scheduler
def scheduler_plan(fork, top_p: float) -> tuple:
    """A ``dspark-sla`` plan (the engine's call: ``schedule(policy, confidences, sps,
    weights=...)``, weight from a tier target the fork misses) over an SPS table made so
    that ℓ = 1 always pays and ℓ = 2 pays exactly when a_2 = c_1·c_2 exceeds a threshold
    that splits a pilot sample most evenly: c_2 depends on x_1 through W1[x_1], so ℓ
    depends on the drafted token — the case paper Appendix A is about (the decision must
    not look at the target). Returns (plan, threshold)."""
    from runtime.speculation.budget import schedule
    from runtime.speculation.sla import sla_weight
    from runtime.speculation.sps import SpsTable

    m = 512
    gens = [torch.Generator().manual_seed(7_000_000 + i) for i in range(m)]
    blk = DraftBlock(fork.block.base_logits.expand(m, -1, -1), fork.block.hidden.expand(m, -1, -1))
    ds = fork.drafter.sample_block(blk, torch.full((m,), fork.anchor, dtype=torch.long), SamplingBatch(
        torch.ones(m), torch.zeros(m, dtype=torch.long), torch.full((m,), top_p), gens))
    a = torch.cumprod(ds.confidence.double(), -1)
    assert torch.allclose(a[:, 0], a[0, 0])  # c_1 sees the shared anchor only
    a1 = float(a[0, 0])
    values, counts = torch.unique(a[:, 1], return_counts=True)  # ascending
    below = torch.cumsum(counts, 0)[:-1]
    best = int(torch.minimum(below, m - below).argmax())
    thr = float(values[best] + values[best + 1]) / 2
    table = SpsTable([1, 2, 3], [0], [[1.0, 1.0, (1 + a1) / (1 + a1 + thr)]], enforce_throughput=False)
    weight = sla_weight(20.0, 5.0)  # a gold tier's 20 tok/s target, 5 measured: weight > 1
    assert weight > 1

    def plan(conf: torch.Tensor) -> int:
        return schedule("dspark-sla", conf[None], table, weights=[weight], context_len=fork.p).lengths[0]

    return plan, thr


@pytest.mark.parametrize("top_p", [1.0])  # top_p 0.9 (30 s here) is covered without the scheduler above
def test_t1_real_model_rounds_under_the_scheduler_match_target(fork, cpu_tuning, top_p):
    """End to end at T = 1 with the verification length chosen per fork by the prefix
    scheduler (Alg. 1 with SLA weights) from the drafter's real confidences: y_1 and
    y_2 | accepted x_1 still follow the target (p > 0.01), with both ℓ = 1 and ℓ = 2
    taken often."""
    plan, thr = scheduler_plan(fork, top_p)
    st = run_rounds(fork, top_p, (None,), seed=11, plan=plan)[None]
    p1, p2, info = position_pvalues(fork, st, top_p)
    counts = torch.bincount(st.lengths, minlength=GAMMA + 1).tolist()
    print(f"scheduler T=1 top_p={top_p}: a2 threshold={thr:.4f} ℓ counts={counts} p1={p1:.4g} p2={p2:.4g} {info}")
    assert counts[0] == 0 and min(counts[1], counts[2]) > 0.1 * N, counts  # ℓ really varies with x_1
    assert info["x1_accepted"] > 0.05 * N and info["df1"] >= 10 and info["df2"] >= 5
    assert p1 > 0.01, info
    assert p2 > 0.01, info
