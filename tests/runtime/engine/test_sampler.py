"""Tests for runtime/engine/sampler.py: warping exactness, reproducibility, sampling law."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from runtime.interface import SamplingParams
from runtime.engine.sampler import (
    NUCLEUS_CANDIDATES,
    SamplingBatch,
    gumbel_argmax,
    gumbel_noise,
    params_to_tensors,
    request_generator,
    sample,
    uniform,
    warp_probs,
)


def ref_warp_row(logits: list[float], temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Independent float64 reference: plain Python/numpy, one row, sorting by hand."""
    v = len(logits)
    if temperature == 0:
        out = np.zeros(v)
        best = max(range(v), key=lambda i: (logits[i], -i))
        out[best] = 1.0
        return out
    z = [x / temperature for x in logits]
    if 0 < top_k < v:
        kth = sorted(z, reverse=True)[top_k - 1]
        z = [x if x >= kth else -math.inf for x in z]
    m = max(z)
    e = np.array([math.exp(x - m) if x != -math.inf else 0.0 for x in z])
    probs = e / e.sum()
    if top_p < 1.0:
        order = sorted(range(v), key=lambda i: -probs[i])
        cum, last = 0.0, order[0]
        for i in order:
            cum += probs[i]
            last = i
            if cum >= top_p:
                break
        cutoff = probs[last]
        probs = np.where(probs >= cutoff, probs, 0.0)
        probs = probs / probs.sum()
    return probs


def warp_one(logits, t, k, p):
    x = torch.tensor([logits], dtype=torch.float32)
    return warp_probs(
        x,
        torch.tensor([t], dtype=torch.float32),
        torch.tensor([k], dtype=torch.int64),
        torch.tensor([p], dtype=torch.float32),
    )[0]


# ---------------------------------------------------------------- warp_probs


def test_greedy_is_argmax_with_lowest_index_on_ties():
    logits = torch.tensor([[0.1, 3.0, 3.0, -1.0], [5.0, 1.0, 2.0, 9.0]], dtype=torch.bfloat16)
    probs = warp_probs(logits, torch.zeros(2), torch.tensor([0, 2]), torch.tensor([1.0, 0.5]))
    assert probs.dtype == torch.float32
    expected = torch.zeros(2, 4)
    expected[0, 1] = 1.0  # tie between 1 and 2 → lowest index, like torch.argmax
    expected[1, 3] = 1.0
    assert torch.equal(probs, expected)
    assert torch.equal(probs.argmax(-1), logits.float().argmax(-1))


def test_temperature_scaling_matches_softmax():
    logits = [2.0, 1.0, 0.5, -1.0, 3.5]
    for t in (0.3, 1.0, 1.7):
        got = warp_one(logits, t, 0, 1.0).double().numpy()
        x = np.array(logits) / t
        want = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_top_k_mask_hand_checked():
    logits = [1.0, 5.0, 3.0, 4.0, 2.0]
    got = warp_one(logits, 1.0, 2, 1.0).double().numpy()
    # Only tokens 1 (logit 5) and 3 (logit 4) survive, in ratio e^5 : e^4.
    e5, e4 = math.exp(5), math.exp(4)
    want = np.array([0, e5 / (e5 + e4), 0, e4 / (e5 + e4), 0])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # -1 and 0 disable; k >= V is a no-op.
    full = warp_one(logits, 1.0, 0, 1.0)
    assert torch.allclose(warp_one(logits, 1.0, -1, 1.0), full)
    assert torch.allclose(warp_one(logits, 1.0, 5, 1.0), full)
    assert torch.allclose(warp_one(logits, 1.0, 99, 1.0), full)


def test_top_k_keeps_ties_at_boundary():
    got = warp_one([1.0, 3.0, 2.0, 3.0, 2.0], 1.0, 1, 1.0)
    assert got[1].item() == pytest.approx(0.5) and got[3].item() == pytest.approx(0.5)
    assert got[[0, 2, 4]].abs().sum().item() == 0.0


def test_top_p_mask_hand_checked():
    # probs = [0.1, 0.5, 0.05, 0.3, 0.05]
    base = [0.1, 0.5, 0.05, 0.3, 0.05]
    logits = [math.log(p) for p in base]
    cases = {
        0.45: {1},  # 0.5 already ≥ 0.45
        0.7: {1, 3},  # 0.5 + 0.3 = 0.8
        0.85: {0, 1, 3},  # 0.9
        0.93: {0, 1, 2, 3, 4},  # 0.95 needs one of the tied 0.05s → both kept
    }
    for top_p, keep in cases.items():
        got = warp_one(logits, 1.0, 0, top_p).double().numpy()
        mass = sum(base[i] for i in keep)
        want = np.array([base[i] / mass if i in keep else 0.0 for i in range(5)])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=f"top_p={top_p}")


def test_top_p_always_keeps_one_token():
    logits = [0.2, 0.1, 0.3, 0.25]
    got = warp_one(logits, 1.0, 0, 1e-6)
    assert torch.equal(got, torch.tensor([0.0, 0.0, 1.0, 0.0]))


def test_top_k_then_top_p_order():
    # After top_k=3 on probs ∝ [0.4, 0.3, 0.2, 0.1]: renormalised [4/9, 3/9, 2/9];
    # top_p=0.7 on that → {0, 1} (7/9 ≥ 0.7) whereas on the raw distribution 0.4+0.3=0.7
    # would be borderline; the renormalised order is what vLLM applies.
    logits = [math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]
    got = warp_one(logits, 1.0, 3, 0.75).double().numpy()
    np.testing.assert_allclose(got, [4 / 7, 3 / 7, 0, 0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got, ref_warp_row(logits, 1.0, 3, 0.75), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("vocab,scale", [(50, 2.0), (1000, 4.0), (6000, 0.05)])
def test_random_rows_match_reference(vocab, scale):
    """Mixed per-row params; vocab 6000 with flat logits exercises every nucleus tier."""
    gen = torch.Generator().manual_seed(vocab)
    settings = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 10, 1.0), (1.0, 5, 0.6), (0.5, 0, 0.5), (1.0, 0, 0.99), (2.0, 300, 0.95)]
    logits = torch.randn(len(settings), vocab, generator=gen) * scale
    t, k, p = (torch.tensor(c, dtype=d) for c, d in zip(zip(*settings), (torch.float32, torch.int64, torch.float32)))
    got = warp_probs(logits, t, k, p)
    for i, (ti, ki, pi) in enumerate(settings):
        want = ref_warp_row(logits[i].tolist(), ti, ki, pi)
        np.testing.assert_allclose(got[i].double().numpy(), want, rtol=1e-4, atol=1e-6, err_msg=f"row {i}: {settings[i]}")
        assert (got[i] > 0).sum().item() == (want > 0).sum()
    if vocab == 6000:  # nucleus sizes that need the second candidate tier / the full sort
        assert NUCLEUS_CANDIDATES[0] < (got[5] > 0).sum().item() <= NUCLEUS_CANDIDATES[1]
        assert (got[6] > 0).sum().item() > NUCLEUS_CANDIDATES[1]


def test_rows_are_independent_of_batch():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 4000, generator=gen) * 3
    t = torch.tensor([0.8, 0.0, 1.0, 1.2, 0.9, 1.0])
    k = torch.tensor([0, 0, 40, 0, 7, 0])
    p = torch.tensor([1.0, 1.0, 0.9, 0.8, 1.0, 0.95])
    batch = warp_probs(logits, t, k, p)
    for i in range(6):
        alone = warp_probs(logits[i : i + 1], t[i : i + 1], k[i : i + 1], p[i : i + 1])
        assert torch.equal(batch[i], alone[0]), i
    assert torch.allclose(batch.sum(-1), torch.ones(6), atol=1e-5)


def test_fast_path_never_sorts(monkeypatch):
    def boom(*a, **kw):
        raise AssertionError("sorted on the fast path")

    monkeypatch.setattr(torch.Tensor, "sort", boom)
    monkeypatch.setattr(torch.Tensor, "topk", boom)
    logits = torch.randn(4, 1000)
    probs = warp_probs(logits, torch.tensor([0.0, 1.0, 0.5, 2.0]), torch.tensor([0, 0, -1, 1000]), torch.ones(4))
    assert torch.allclose(probs[1], torch.softmax(logits[1], -1))
    assert torch.allclose(probs[2], torch.softmax(logits[2] / 0.5, -1))


def test_shape_errors():
    with pytest.raises(ValueError):
        warp_probs(torch.randn(2, 5), torch.ones(3), torch.zeros(2, dtype=torch.int64), torch.ones(2))


# ---------------------------------------------------------------- params / state


def test_params_to_tensors():
    t, k, p = params_to_tensors([SamplingParams(temperature=0.0, top_k=-1), SamplingParams(temperature=0.7, top_k=20, top_p=0.9)])
    assert t.dtype == torch.float32 and k.dtype == torch.int64 and p.dtype == torch.float32
    assert t.tolist() == pytest.approx([0.0, 0.7])
    assert k.tolist() == [0, 20]
    assert p.tolist() == pytest.approx([1.0, 0.9])
    with pytest.raises(ValueError):
        params_to_tensors([SamplingParams(top_p=0.0)])
    with pytest.raises(ValueError):
        params_to_tensors([SamplingParams(temperature=-1.0)])


def test_params_to_tensors_top_k_beyond_int64_is_disabled_not_an_error():
    """``top_k: 2**70`` reached the engine (the API bounds it only below) and failed the
    step of every request in the batch (found by bench/fuzz.py)."""
    t, k, p = params_to_tensors([SamplingParams(top_k=2**70), SamplingParams(top_k=5)])
    assert k.tolist() == [2**63 - 1, 5]
    probs = warp_probs(torch.randn(2, 50), t, k, p)
    assert (probs[0] > 0).sum() == 50 and (probs[1] > 0).sum() == 5  # ≥ V: nothing cut


def test_sampling_state_seeding():
    a = request_generator(SamplingParams(seed=42))
    b = request_generator(SamplingParams(seed=42))
    assert a.initial_seed() == 42
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))
    neg = request_generator(SamplingParams(seed=-1))
    assert neg.initial_seed() == (1 << 64) - 1
    r1 = request_generator(SamplingParams())
    r2 = request_generator(SamplingParams())
    assert r1.initial_seed() != r2.initial_seed()


def test_sampling_batch_of_sequences():
    """The engine's one conversion per step: rows in sequence order, each request's own generator."""
    params = [SamplingParams(temperature=0.0, top_k=-1), SamplingParams(temperature=0.7, top_k=20, top_p=0.9)]
    seqs = [SimpleNamespace(request=SimpleNamespace(sampling=p), generator=torch.Generator().manual_seed(i),
                            num_generated=3) for i, p in enumerate(params)]
    batch = SamplingBatch.of(seqs)
    assert all(torch.equal(a, b) for a, b in zip(batch.tensors, params_to_tensors(params)))
    assert batch.generators == [s.generator for s in seqs] and not batch.greedy
    assert batch.seeds is None and batch.positions == [3, 3] and batch.seeded_rows == []
    assert SamplingBatch.of(seqs[:1]).greedy
    logits = torch.randn(2, 100, generator=torch.Generator().manual_seed(5))
    want = sample(warp_probs(logits, *params_to_tensors(params)), [torch.Generator().manual_seed(i) for i in range(2)])
    assert batch.draw(logits).tolist() == want.tolist()


# ---------------------------------------------------------------- sample / uniform


def _step_logits(step: int, vocab: int) -> torch.Tensor:
    """Deterministic pseudo-logits for a simulated request's decode step."""
    return torch.randn(vocab, generator=torch.Generator().manual_seed(1000 + step)) * 2


def _decode(requests: list[tuple[SamplingParams, int]], steps: int, vocab: int = 3000) -> list[list[int]]:
    """Simulate ``steps`` batched decode steps; request r's logits depend on (r's tag, step)."""
    batch = SamplingBatch(*params_to_tensors([p for p, _ in requests]), [request_generator(p) for p, _ in requests])
    out: list[list[int]] = [[] for _ in requests]
    for s in range(steps):
        logits = torch.stack([_step_logits(s * 31 + tag, vocab) for _, tag in requests])
        toks = batch.draw(logits)
        for i, tok in enumerate(toks.tolist()):
            out[i].append(tok)
    return out


def test_seeded_request_reproducible_regardless_of_batch():
    target = (SamplingParams(temperature=0.9, top_p=0.95, seed=1234), 0)
    alone = _decode([target], 25)[0]
    others = [
        (SamplingParams(temperature=0.0), 1),
        (SamplingParams(temperature=1.0, top_k=5), 2),
        (SamplingParams(temperature=1.0), 3),
        (SamplingParams(temperature=0.5, top_p=0.5, seed=7), 4),
        (SamplingParams(temperature=1.2, top_k=50, top_p=0.9), 5),
        (SamplingParams(temperature=0.0, top_p=0.3), 6),
        (SamplingParams(temperature=1.0, seed=99), 7),
    ]
    batch = _decode(others[:3] + [target] + others[3:], 25)
    assert batch[3] == alone
    other_seed = _decode([(SamplingParams(temperature=0.9, top_p=0.95, seed=4321), 0)], 25)[0]
    assert other_seed != alone  # the seed actually matters


def test_greedy_rows_consume_no_randomness():
    g = torch.Generator().manual_seed(5)
    before = g.get_state()
    logits = torch.randn(3, 100)
    probs = warp_probs(logits, torch.zeros(3), torch.zeros(3, dtype=torch.int64), torch.ones(3))
    assert torch.equal(sample(probs, [g, g, g]), logits.argmax(-1))
    assert torch.equal(g.get_state(), before)
    probs = warp_probs(logits, torch.ones(3), torch.zeros(3, dtype=torch.int64), torch.ones(3))
    sample(probs, [g, g, g])
    ref = torch.Generator().manual_seed(5)
    torch.rand(3, generator=ref)  # three rows → exactly three draws
    assert torch.equal(g.get_state(), ref.get_state())


def test_shared_generator_draws_in_row_order():
    probs = torch.full((4, 10), 0.1)
    g = torch.Generator().manual_seed(11)
    toks = sample(probs, [g] * 4)
    ref = torch.Generator().manual_seed(11)
    u = torch.rand(4, generator=ref)
    # Uniform rows: inverse CDF = floor(10 u).
    assert toks.tolist() == [min(int(x * 10), 9) for x in u.tolist()]


def test_uniform_per_row_generators():
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    u = uniform(gens)
    want = [torch.rand((), generator=torch.Generator().manual_seed(s)).item() for s in (1, 2, 3)]
    assert u.dtype == torch.float32 and u.tolist() == want
    single = uniform(torch.Generator().manual_seed(9), 4)
    assert single.tolist() == torch.rand(4, generator=torch.Generator().manual_seed(9)).tolist()
    with pytest.raises(ValueError):
        uniform(gens, 2)


def test_sample_matches_distribution_chi_square():
    n = 40000
    probs_row = torch.tensor([0.3, 0.02, 0.0, 0.18, 0.1, 0.25, 0.0, 0.15])
    g = torch.Generator().manual_seed(2024)
    toks = sample(probs_row.expand(n, -1).contiguous(), [g] * n)
    counts = torch.bincount(toks, minlength=8).double().numpy()
    assert counts[2] == 0 and counts[6] == 0  # zero-probability tokens never drawn
    pr = probs_row.double().numpy()
    nz = pr > 0
    stat = chisquare(counts[nz], pr[nz] / pr[nz].sum() * n)
    assert stat.pvalue > 0.01, stat


def test_sample_warped_distribution_chi_square():
    """Draws from a top-k/top-p warped row follow it, and never leave its support."""
    n = 30000
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(8)) * 2
    probs = warp_probs(logits, torch.tensor([0.8]), torch.tensor([12]), torch.tensor([0.9]))[0]
    support = (probs > 0).nonzero().squeeze(-1)
    assert 1 < len(support) <= 12
    gens = [torch.Generator().manual_seed(i) for i in range(n)]  # one request per row
    toks = sample(probs.expand(n, -1).contiguous(), gens)
    counts = torch.bincount(toks, minlength=500).double()
    assert counts.sum().item() == counts[support].sum().item()
    ps = probs[support].double().numpy()
    stat = chisquare(counts[support].numpy(), ps / ps.sum() * n)
    assert stat.pvalue > 0.01, stat


# ---------------------------------------------------------------- seeded (Gumbel-max) sampling


def test_gumbel_noise_is_keyed_by_seed_position_and_token_alone():
    g = gumbel_noise([5, 5, 6, 2**64 + 5, -1], [0, 1, 0, 0, 0], 4000)
    assert g.shape == (5, 4000) and g.dtype == torch.float64 and bool(torch.isfinite(g).all())
    assert torch.equal(g[3], g[0])  # seeds are taken mod 2**64, as request_generator does
    assert torch.equal(g[4], gumbel_noise([2**64 - 1], [0], 4000)[0])
    assert not torch.equal(g[0], g[1]) and not torch.equal(g[0], g[2])
    # a row never depends on the other rows, on the vocabulary size or on what came before
    assert torch.equal(gumbel_noise([5], [1], 100)[0], g[1, :100])
    # standard Gumbel: mean = Euler–Mascheroni γ, variance π²/6 (20,000 values)
    assert abs(g.mean().item() - 0.5772) < 0.03 and abs(g.var().item() - math.pi**2 / 6) < 0.06
    with pytest.raises(ValueError):
        gumbel_noise([1], [-1], 10)
    with pytest.raises(ValueError):
        gumbel_noise([1, 2], [0], 10)


@pytest.mark.parametrize("vary", ["seed", "position"])
def test_seeded_draw_follows_the_warped_distribution_chi_square(vary):
    """5,000 seeded draws of one top-k/top-p warped row (over seeds at one position, or
    over positions for one seed) follow it, and never leave its support."""
    n = 5000
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(3)) * 2
    probs = warp_probs(logits, torch.tensor([0.9]), torch.tensor([20]), torch.tensor([0.95]))[0]
    seeds = list(range(n)) if vary == "seed" else [12345] * n
    positions = [7] * n if vary == "seed" else list(range(n))
    toks = gumbel_argmax(probs.expand(n, -1).contiguous(), seeds, positions)
    counts = torch.bincount(toks, minlength=300).double()
    support = probs > 0
    assert counts[~support].sum() == 0
    pr = probs[support].double().numpy()
    stat = chisquare(counts[support].numpy(), pr / pr.sum() * n)
    assert stat.pvalue > 0.001, stat


def test_seeded_rows_draw_by_gumbel_max_and_the_others_from_their_generators():
    params = [SamplingParams(temperature=1.0, seed=11), SamplingParams(temperature=0.8),
              SamplingParams(temperature=0.0, seed=12)]
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    batch = SamplingBatch(*params_to_tensors(params), gens, [11, None, 12], [4, 9, 2])
    assert batch.seeded_rows == [0]  # a greedy row stays greedy whatever its seed
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(1))
    before = gens[0].get_state()
    toks = batch.draw(logits).tolist()
    probs = warp_probs(logits, *params_to_tensors(params))
    assert toks[0] == gumbel_argmax(probs[:1], [11], [4]).item()
    assert torch.equal(gens[0].get_state(), before)  # the seeded row used no generator
    assert toks[1] == sample(probs[1:2], [torch.Generator().manual_seed(1)]).item()
    assert toks[2] == int(logits[2].argmax())
