"""The verifier through the fused-kernel contract (what runs on CUDA), exercised on CPU.

``SPARKGATE_KERNELS=reference`` routes :func:`runtime.dspark.verifier.verify` through
``runtime.kernels.verify_chain`` (the torch reference of the Triton kernel); on CUDA the
same call runs Triton. The statistical tests of the plain path are re-run here."""

from __future__ import annotations

import pytest
import torch

from runtime.dspark import verifier
from tests import test_dspark_verifier as plain


@pytest.fixture
def kernel_env(monkeypatch):
    monkeypatch.setenv("SPARKGATE_KERNELS", "reference")
    assert verifier.kernel_path(torch.zeros(1))


@pytest.mark.slow
def test_t1_joint_matches_target_through_kernels(kernel_env):
    plain.test_t1_joint_matches_target()


@pytest.mark.slow
def test_warped_joint_matches_through_kernels(kernel_env):
    plain.test_warped_joint_matches_warped_target()


@pytest.mark.slow
def test_pre_markov_bug_still_caught_through_kernels(kernel_env):
    plain.test_planted_bug_pre_markov_pd_is_caught()


def test_accept_decisions_equal_the_plain_path(monkeypatch):
    """Same generators → same acceptance uniforms → identical accepted counts."""
    g = torch.Generator().manual_seed(0)
    lens = [0, 3, 7, 2, 5]
    R, D, V = len(lens), sum(lens), 32
    p_t = torch.softmax(torch.randn(D + R, V, generator=g) * 2, -1)
    p_d = torch.softmax(torch.randn(D, V, generator=g) * 2, -1)
    toks = torch.multinomial(p_d, 1, generator=g).squeeze(-1)
    # make some drafts likely to be accepted
    p_t[: D + R] = 0.5 * p_t[: D + R] + 0.5 * torch.cat([p_d, p_d[:R]])

    def gens():
        return [torch.Generator().manual_seed(100 + r) for r in range(R)]

    monkeypatch.setenv("SPARKGATE_KERNELS", "auto")
    a = verifier.verify(p_t, p_d, toks, lens, gens())
    monkeypatch.setenv("SPARKGATE_KERNELS", "reference")
    b = verifier.verify(p_t, p_d, toks, lens, gens())
    assert a.accepted.tolist() == b.accepted.tolist()
    assert 0 < sum(a.accepted.tolist()) < D  # both accept and reject paths were exercised
    for r, (x, y) in enumerate(zip(a.accepted.tolist(), b.next_tokens.tolist())):
        assert 0 <= y < V
