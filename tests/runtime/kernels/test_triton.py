"""GPU kernels: Triton vs torch, and the torch side itself.

The verification kernel is compared, bit for bit, with the one verification module's
standard mode (:func:`runtime.speculation.verifier.verify_chain`); the Markov kernel with
:func:`runtime.kernels.gpu.reference.markov_sample_reference`.

The Triton kernels run on CUDA when a GPU is present, otherwise on CPU under
``TRITON_INTERPRET=1`` (set here before any kernel module is imported). Without
triton the kernel tests skip locally and FAIL under ``CI=true``.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from scipy import stats  # noqa: E402

from runtime.speculation.verifier import verify_chain  # noqa: E402
from runtime.kernels import dispatch  # noqa: E402
from runtime.kernels.gpu.reference import (  # noqa: E402
    QUANT_BITS,
    cdf_threshold,
    chain_offsets,
    inverse_cdf_draw,
    markov_sample_reference,
    quantize_weights,
)
from tests.conftest import require_or_skip  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def kernels():
    """The Triton entry points (interpreted on CPU)."""
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the environment
        require_or_skip(False, "triton (pip install triton; kernels run under TRITON_INTERPRET=1 on CPU)")
    from runtime.kernels.gpu import triton_markov, triton_verify

    if DEV == "cpu":
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(triton_verify._verify_chain_kernel, InterpretedFunction):
            pytest.fail("triton kernels were imported before TRITON_INTERPRET=1 was set; run this module alone")
    return triton_verify.verify_chain_triton, triton_markov.markov_sample_triton


# ---------------------------------------------------------------- helpers


def _chain_case(lengths, V, gen, noise=0.7, sharp=2.0):
    """Random ragged verification inputs; drafts drawn from p_draft, which is close to p_target."""
    lens = torch.tensor(lengths, dtype=torch.int64)
    R, D = len(lengths), int(lens.sum())
    T = D + R
    base = torch.randn(T, V, generator=gen) * sharp
    pt = torch.softmax(base, -1)
    t_off, d_off = chain_offsets(lens)
    judged = torch.cat([torch.arange(o, o + n) for o, n in zip(t_off.tolist(), lengths)] + [torch.zeros(0, dtype=torch.long)])
    pd = torch.softmax(base[judged] + noise * torch.randn(D, V, generator=gen), -1)
    x = torch.multinomial(pd, 1, generator=gen).squeeze(1) if D else torch.zeros(0, dtype=torch.long)
    ua = torch.rand(D, generator=gen)
    us = torch.rand(R, generator=gen)
    return [t.to(DEV) for t in (pt, pd, x, lens, ua, us)]


# ---------------------------------------------------------------- exact draw


def test_inverse_cdf_draw_hand_cases():
    w = torch.tensor([[0.25, 0.25, 0.5], [0.25, 0.25, 0.5], [0.25, 0.25, 0.5], [0.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    u = torch.tensor([0.0, 0.5, 0.4999, 0.0, 1.0 - 2**-24])
    # total = 2**40; u = 0.5 → t = 2**39 = cum_1 → first cum > t is index 2.
    assert inverse_cdf_draw(w, u).tolist() == [0, 2, 1, 1, 1]
    # Unnormalised weights give the same draw as their normalised version when
    # quantisation is exact (powers of two).
    assert inverse_cdf_draw(w[:3] * 0.5, u[:3]).tolist() == [0, 2, 1]
    # All-zero row: clamped to V − 1 (documented input error).
    assert inverse_cdf_draw(torch.zeros(1, 4), torch.tensor([0.3])).tolist() == [3]


def test_inverse_cdf_draw_is_the_count_of_cdf_entries_at_or_below_the_threshold():
    """The draw's binary search equals step 4's definition #{i : Σ_{j≤i} q_j ≤ t} (clamped to
    V − 1), on rows with runs of zero weights (equal CDF entries), an all-zero row and
    boundary uniforms."""
    g = torch.Generator().manual_seed(5)
    w = torch.rand(64, 300, generator=g) * (torch.rand(64, 300, generator=g) < 0.3)
    w[0] = 0.0
    u = torch.cat([torch.rand(60, generator=g), torch.tensor([0.0, 0.5, 1 - 2**-24, 0.999])])
    cum = quantize_weights(w).cumsum(-1)
    want = (cum <= cdf_threshold(u, cum[:, -1]).unsqueeze(-1)).sum(-1).clamp(max=299)
    got = inverse_cdf_draw(w, u)
    assert torch.equal(got, want) and got[0] == 299 and len(set(got.tolist())) > 30


def test_quantize_and_threshold_exact():
    w = torch.tensor([-1.0, 0.0, 2.0**-41, 2.0**-40, 0.3, 1.0, 7.0])
    q = quantize_weights(w).tolist()
    assert q[:4] == [0, 0, 0, 1] and q[5:] == [1 << QUANT_BITS, 1 << QUANT_BITS]
    assert q[4] == int(torch.tensor(0.3).item() * 2**40)
    g = torch.Generator().manual_seed(3)
    total = torch.randint(0, 1 << 62, (2000,), generator=g)
    u = torch.rand(2000, generator=g)
    got = cdf_threshold(u, total).tolist()
    for ui, ti, gi in zip(u.tolist(), total.tolist(), got):
        uq = int(ui * 2**24)
        assert gi == (uq * ti) >> 24  # exact big-int floor
        assert gi < ti or ti == 0


def test_draw_never_picks_zero_weight_and_matches_probabilities():
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([0.1, 0.0, 0.6, 0.0, 0.3])
    n = 30000
    tok = inverse_cdf_draw(p.expand(n, -1), torch.rand(n, generator=g))
    counts = torch.bincount(tok, minlength=5)
    assert counts[1] == 0 and counts[3] == 0
    w = p[[0, 2, 4]].double()
    assert stats.chisquare(counts[[0, 2, 4]].double().numpy(), (w / w.sum() * n).numpy()).pvalue > 0.01


# ---------------------------------------------------------------- verify: reference semantics


def test_verify_reference_hand_case():
    # request 0: ℓ=2, request 1: ℓ=1, request 2: ℓ=0
    pt = torch.tensor(
        [
            [0.5, 0.5, 0.0, 0.0],  # judges r0 draft 0 (x=1): p_d(1)=0 → accept (p_t>0)
            [0.0, 0.0, 1.0, 0.0],  # judges r0 draft 1 (x=3): p_t(3)=0 → reject; residual = [0,0,1,0]-pd
            [0.1, 0.2, 0.3, 0.4],  # r0 bonus (unused)
            [0.25, 0.25, 0.25, 0.25],  # judges r1 draft 0 (x=0): p_t == p_d → accept
            [0.0, 0.0, 0.0, 1.0],  # r1 bonus → token 3
            [0.0, 1.0, 0.0, 0.0],  # r2 (ℓ=0): bonus → token 1
        ]
    )
    pd = torch.tensor([[0.5, 0.0, 0.5, 0.0], [0.0, 0.5, 0.0, 0.5], [0.25, 0.25, 0.25, 0.25]])
    x = torch.tensor([1, 3, 0])
    res = verify_chain(pt, pd, x, torch.tensor([2, 1, 0]), torch.tensor([0.9, 0.1, 0.999]), torch.tensor([0.7, 0.5, 0.2]))
    assert res.accepted.tolist() == [1, 1, 0]
    assert res.num_emitted.tolist() == [2, 2, 1]
    assert res.tokens() == [[1, 2], [0, 3], [1]]


def test_verify_reference_zero_residual_falls_back_to_target():
    # p_t == p_d, drafted token has p_t = p_d = 0 → rejected; residual mass 0 → draw from p_t.
    p = torch.tensor([[0.0, 0.5, 0.5]])
    pt = torch.cat([p, torch.tensor([[1.0, 0.0, 0.0]])])
    for u, want in ((0.1, 1), (0.9, 2)):
        res = verify_chain(pt, p, torch.tensor([0]), torch.tensor([1]), torch.tensor([0.0]), torch.tensor([u]))
        assert res.accepted.tolist() == [0] and res.next_tokens.tolist() == [want]


def test_verify_reference_greedy_one_hot():
    g = torch.Generator().manual_seed(5)
    V, lengths = 16, [3, 0, 4, 2]
    lens = torch.tensor(lengths)
    R, D = len(lengths), sum(lengths)
    tgt_argmax = torch.randint(0, V, (D + R,), generator=g)
    pt = torch.nn.functional.one_hot(tgt_argmax, V).float()
    t_off, d_off = chain_offsets(lens)
    judged = torch.cat([torch.arange(o, o + n) for o, n in zip(t_off.tolist(), lengths)])
    # drafts agree with the target's argmax except at chosen positions
    x = tgt_argmax[judged].clone()
    x[[1, 4]] = (x[[1, 4]] + 1) % V  # r0 mismatches at k=1, r2 at k=1
    pd = torch.nn.functional.one_hot(x, V).float()
    res = verify_chain(pt, pd, x, lens, torch.rand(D, generator=g), torch.rand(R, generator=g))
    assert res.accepted.tolist() == [1, 0, 1, 2]
    want = [x[d_off[r] : d_off[r] + a].tolist() + [tgt_argmax[t_off[r] + a].item()] for r, a in enumerate(res.accepted.tolist())]
    assert res.tokens() == want


def test_verify_reference_chi_square_matches_target():
    """Output distribution == p_target at every emitted position (Leviathan et al. 2023, Thm 1)."""
    g = torch.Generator().manual_seed(11)
    V, L, N = 6, 3, 20000
    pt_rows = torch.tensor(
        [
            [0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
            [0.05, 0.05, 0.10, 0.40, 0.00, 0.40],
            [0.00, 0.50, 0.20, 0.10, 0.10, 0.10],
            [0.20, 0.20, 0.00, 0.20, 0.20, 0.20],  # bonus
        ]
    )
    pd_rows = torch.tensor(
        [
            [0.10, 0.40, 0.20, 0.00, 0.10, 0.20],
            [0.30, 0.05, 0.05, 0.30, 0.20, 0.10],
            [0.20, 0.30, 0.30, 0.10, 0.10, 0.00],
        ]
    )
    pt = pt_rows.repeat(N, 1)
    pd = pd_rows.repeat(N, 1)
    x = torch.multinomial(pd_rows, N, replacement=True, generator=g).t().reshape(-1)
    lens = torch.full((N,), L, dtype=torch.int64)
    res = verify_chain(pt, pd, x, lens, torch.rand(N * L, generator=g), torch.rand(N, generator=g), max_len=L)
    acc = res.accepted
    out = torch.cat([x.view(N, L), torch.zeros(N, 1, dtype=torch.long)], 1)  # emitted token at each position
    out[torch.arange(N), acc] = res.next_tokens
    for k in range(L + 1):
        sel = acc >= k if k < L else acc == L
        toks = out[sel, k]
        counts = torch.bincount(toks, minlength=V).double()
        support = pt_rows[k] > 0
        assert counts[~support].sum() == 0, f"position {k} emitted a token with p_t = 0"
        w = pt_rows[k][support].double()
        expected = w / w.sum() * counts[support].sum()
        p = stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue
        assert p > 0.01, f"position {k}: chi-square p = {p:.4g} (n = {int(counts.sum())})"
    # Acceptance of the first draft: P = Σ min(p_t, p_d) (binomial z-test).
    a1 = torch.minimum(pt_rows[0], pd_rows[0]).sum().item()
    frac = (acc >= 1).double().mean().item()
    assert abs(frac - a1) < 4 * (a1 * (1 - a1) / N) ** 0.5


def test_verify_reference_shape_errors():
    pt, pd, x = torch.rand(3, 4), torch.rand(1, 4), torch.tensor([0])
    with pytest.raises(ValueError):
        verify_chain(pt, pd, x, torch.tensor([1, 1]), torch.rand(1), torch.rand(2))
    with pytest.raises(ValueError):  # sum(lengths) = 2 != D = 1 (with R = 1 rows mismatch)
        verify_chain(torch.rand(2, 4), pd, x, torch.tensor([2]), torch.rand(1), torch.rand(1))


# ---------------------------------------------------------------- Markov: reference semantics


def test_markov_reference_greedy_and_sampled_chain():
    g = torch.Generator().manual_seed(7)
    B, G, V, r = 3, 4, 32, 4
    U = torch.randn(B, G, V, generator=g) * 3
    w1, w2 = torch.randn(V, r, generator=g), torch.randn(r, V, generator=g)
    anc = torch.randint(0, V, (B,), generator=g)
    temp = torch.tensor([0.0, 0.8, 0.0])
    u = torch.rand(B, G, generator=g)
    res = markov_sample_reference(U, w1, w2, anc, temp, u)
    for b in range(B):
        prev = anc[b].item()
        for k in range(G):
            lg = U[b, k] + w1[prev] @ w2
            assert torch.equal(res.prev_embeddings[b, k], w1[prev])
            if temp[b] == 0:
                want = int(lg.argmax())
                assert torch.equal(res.p_draft[b, k], torch.nn.functional.one_hot(torch.tensor(want), V).float())
            else:
                p = torch.softmax(lg / temp[b], -1)
                torch.testing.assert_close(res.p_draft[b, k], p, atol=1e-6, rtol=0)
                want = int(inverse_cdf_draw(res.p_draft[b, k : k + 1], u[b, k : k + 1]))
            assert res.tokens[b, k].item() == want
            prev = want
    assert markov_sample_reference(U, w1, w2, anc, temp, u, return_probs=False).p_draft is None


def test_markov_reference_shape_errors():
    with pytest.raises(ValueError):
        markov_sample_reference(torch.zeros(2, 3, 8), torch.zeros(8, 2), torch.zeros(2, 7), torch.zeros(2, dtype=torch.long), torch.ones(2), torch.rand(2, 3))


# ---------------------------------------------------------------- Triton vs reference


@pytest.mark.parametrize("V,block_v", [(64, None), (200, 64), (256, 128)])
def test_triton_verify_matches_reference(kernels, V, block_v):
    verify_triton, _ = kernels
    g = torch.Generator().manual_seed(V)
    n_acc_seen = set()
    for trial in range(4):
        args = _chain_case([0, 1, 3, 7, 2], V, g)
        ref = verify_chain(*args)
        acc, nxt = verify_triton(*args, block_v=block_v)
        assert torch.equal(acc, ref.accepted), (trial, acc, ref.accepted)
        mism = int((nxt != ref.next_tokens).sum())
        assert mism == 0, f"{mism} token mismatches (trial {trial})"
        n_acc_seen.update(ref.accepted.tolist())
    assert len(n_acc_seen) >= 3  # both accept and reject paths exercised


def test_triton_verify_edge_cases(kernels):
    verify_triton, _ = kernels
    # zero-residual fallback + p_d(x) = 0 acceptance + an ℓ = 0 request, in one batch
    pt = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [0.2, 0.3, 0.5]])
    pd = torch.tensor([[0.0, 0.5, 0.5], [0.0, 0.0, 1.0]])
    x = torch.tensor([0, 1])  # r0: p_t=p_d=0 → reject, fallback; r1: p_d(1)=0, p_t(1)=.5 → accept
    args = [t.to(DEV) for t in (pt, pd, x, torch.tensor([1, 1, 0], dtype=torch.int32), torch.tensor([0.3, 0.99]), torch.tensor([0.9, 0.5, 0.1]))]
    ref, (acc, nxt) = verify_chain(*args), verify_triton(*args)
    assert ref.tokens() == [[2], [1, 2], [0]]
    assert torch.equal(nxt, ref.next_tokens) and torch.equal(acc, ref.accepted)
    # no drafts at all
    g = torch.Generator().manual_seed(2)
    args = _chain_case([0, 0, 0], 50, g)
    ref, (acc, nxt) = verify_chain(*args, max_len=2), verify_triton(*args, max_len=2)
    assert torch.equal(nxt, ref.next_tokens) and acc.tolist() == ref.accepted.tolist() == [0, 0, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_markov_matches_reference(kernels, dtype):
    _, markov_triton = kernels
    g = torch.Generator().manual_seed(13)
    B, G, V, r = 3, 4, 128, 8
    mism = 0
    for trial in range(3):
        U = (torch.randn(B, G, V, generator=g) * 2).to(dtype).to(DEV)
        w1 = (torch.randn(V, r, generator=g) * 0.5).to(DEV)
        w2 = (torch.randn(r, V, generator=g) * 0.5).to(DEV)
        anc = torch.randint(0, V, (B,), generator=g).to(DEV)
        temp = torch.tensor([0.0, 0.7, 1.3], device=DEV)
        u = torch.rand(B, G, generator=g).to(DEV)
        ref = markov_sample_reference(U, w1, w2, anc, temp, u)
        out = markov_triton(U, w1, w2, anc, temp, u, block_v=32, chunk=32)
        mism += int((out.tokens != ref.tokens).sum())
        torch.testing.assert_close(out.p_draft, ref.p_draft, atol=1e-5, rtol=0)
        torch.testing.assert_close(out.prev_embeddings, ref.prev_embeddings, atol=0, rtol=0)
        assert torch.equal(out.p_draft[0], torch.nn.functional.one_hot(out.tokens[0], V).float())  # greedy row
    assert mism == 0, f"{mism} token mismatches (fp32 softmax rounding at a CDF boundary)"


# ---------------------------------------------------------------- dispatch


def test_dispatch_backend(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.delenv("SPARKGATE_KERNELS", raising=False)
    assert dispatch.backend_for(cpu) == "reference"
    assert not dispatch.kernel_path(cpu)
    monkeypatch.setenv("SPARKGATE_KERNELS", "reference")
    assert dispatch.backend_for(cpu) == "reference" and dispatch.kernel_path(cpu)
    monkeypatch.setenv("SPARKGATE_KERNELS", "cuda-please")
    with pytest.raises(ValueError):
        dispatch.backend_for(cpu)
    assert dispatch.fused_markov_supported(0, 1.0)
    assert not dispatch.fused_markov_supported(50, 1.0) and not dispatch.fused_markov_supported(0, 0.9)
