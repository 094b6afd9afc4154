"""The C++ twin of the standard-mode verification (``runtime/kernels/cpu/verify_chain.cpp``,
:func:`runtime.speculation.verifier.verify_chain_cpu`) returns exactly
:func:`~runtime.speculation.verifier.verify_chain`'s tokens, and :func:`verify` takes it on
a CPU only where the extension is loaded and ``SPARKGATE_KERNELS`` is ``auto``.

It ships in the gguf extension (AVX512-BF16): run and required where the CPU can, skipped
elsewhere naming the missing flags (``tests/support/hygiene.py``)."""

from __future__ import annotations

import pytest
import torch

from runtime.kernels import dispatch
from runtime.kernels.cpu import gguf_cpu
from runtime.speculation import verifier

pytestmark = pytest.mark.usefixtures("gguf_kernel")


def _case(seed: int, V: int):
    """Random ragged rounds (0–4 drafts per request), drafts often accepted, the first
    target row one-hot."""
    g = torch.Generator().manual_seed(seed)
    R = int(torch.randint(1, 7, (1,), generator=g))
    lens = torch.randint(0, 5, (R,), generator=g)
    D = int(lens.sum())
    p_t = torch.softmax(torch.randn(D + R, V, generator=g) * 3, -1)
    p_d = torch.softmax(torch.randn(D, V, generator=g) * 3, -1)
    if D:
        p_t[:D] = 0.5 * p_t[:D] + 0.5 * p_d
        p_t[0] = torch.nn.functional.one_hot(torch.tensor(V // 2), V).float()
    toks = torch.multinomial(p_d, 1, generator=g).squeeze(-1) if D else torch.zeros(0, dtype=torch.long)
    return p_t, p_d, toks, lens, torch.rand(D, generator=g), torch.rand(R, generator=g)


@pytest.mark.parametrize("V", [2, 37, 49152])
def test_cpu_twin_returns_verify_chains_tokens(V):
    rejected = accepted = 0
    for seed in range(60 if V < 1000 else 12):
        args = _case(seed, V)
        want = verifier.verify_chain(*args)
        got = verifier.verify_chain_cpu(*args)
        assert torch.equal(got.accepted, want.accepted), seed
        assert torch.equal(got.next_tokens, want.next_tokens), seed
        assert got.tokens() == want.tokens()
        rejected += int((want.accepted < want.lengths).sum())
        accepted += int(want.accepted.sum())
    assert rejected > 0 and accepted > 0  # both the residual and the bonus draw ran


def test_cpu_twin_draws_the_exact_boundaries():
    """Uniforms at and around every CDF step of a small row: the integer threshold decides,
    as in the reference (no floating-point cumsum)."""
    w = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25]])
    us = [i / 16 for i in range(16)] + [0.25 - 2**-24, 0.75 - 2**-24, 1 - 2**-24, 0.0]
    for u in us:
        args = (w, torch.zeros(0, 5), torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                torch.zeros(0), torch.tensor([u]))
        assert verifier.verify_chain_cpu(*args).next_tokens.tolist() == verifier.verify_chain(*args).next_tokens.tolist()
    # an all-zero row is an input error: both clamp to the last token
    z = (torch.zeros(1, 5), torch.zeros(0, 5), torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.long),
         torch.zeros(0), torch.tensor([0.3]))
    assert verifier.verify_chain_cpu(*z).next_tokens.tolist() == [4] == verifier.verify_chain(*z).next_tokens.tolist()


def test_cpu_twin_falls_back_to_the_target_row_when_the_residual_has_no_mass():
    """A rejected draft whose residual max(0, p_t − p_d) is all zero (p_t ≤ p_d everywhere,
    round-off): both draw the extra token from p_t."""
    p_t = torch.tensor([[0.5, 0.4999999], [0.3, 0.7]])
    p_d = torch.tensor([[0.5, 0.5]])
    for u in (0.1, 0.6, 0.99):
        args = (p_t, p_d, torch.tensor([1]), torch.tensor([1]), torch.tensor([0.9999999]), torch.tensor([u]))
        want, got = verifier.verify_chain(*args), verifier.verify_chain_cpu(*args)
        assert want.accepted.tolist() == got.accepted.tolist() == [0]
        assert got.next_tokens.tolist() == want.next_tokens.tolist() == [0 if u < 0.5 else 1]


def test_cpu_twin_rejects_what_verify_chain_rejects():
    p_t, p_d, toks, lens, ua, us = _case(3, 11)
    with pytest.raises(ValueError, match="ragged layout"):
        verifier.verify_chain_cpu(p_t[1:], p_d, toks, lens, ua, us)
    bad = toks.clone()
    bad[0] = 11
    with pytest.raises(RuntimeError, match="out of range"):
        verifier.verify_chain_cpu(p_t, p_d, bad, lens, ua, us)


def test_verify_takes_the_cpu_twin_only_when_loaded_and_auto(monkeypatch):
    p_t, p_d, toks, lens, _, _ = _case(5, 64)
    calls = []
    real = verifier.verify_chain_cpu
    monkeypatch.setattr(verifier, "verify_chain_cpu", lambda *a: calls.append(1) or real(*a))
    monkeypatch.delenv("SPARKGATE_KERNELS", raising=False)
    gens = lambda: [torch.Generator().manual_seed(r) for r in range(lens.numel())]  # noqa: E731
    assert gguf_cpu.kernel_loaded() and dispatch.cpu_verify_path(p_t)
    fast = verifier.verify(p_t, p_d, toks, lens, gens())
    assert calls == [1]
    monkeypatch.setenv("SPARKGATE_KERNELS", "reference")
    assert not dispatch.cpu_verify_path(p_t)
    ref = verifier.verify(p_t, p_d, toks, lens, gens())
    assert calls == [1]  # the torch specification ran
    assert torch.equal(fast.accepted, ref.accepted) and torch.equal(fast.next_tokens, ref.next_tokens)
    monkeypatch.delenv("SPARKGATE_KERNELS")
    monkeypatch.setattr(gguf_cpu, "kernel_loaded", lambda: False)  # a CPU without the extension
    assert not dispatch.cpu_verify_path(p_t)
