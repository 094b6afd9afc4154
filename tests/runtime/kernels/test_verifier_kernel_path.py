""":func:`runtime.speculation.verifier.verify` (the standard mode with generators) on both backends.

On CPU it is :func:`~runtime.speculation.verifier.verify_chain` on uniforms drawn from the
requests' generators in the documented order; with ``SPARKGATE_KERNELS=triton`` (what
CUDA runs by default) the same call runs the Triton kernel — interpreted on CPU under
``TRITON_INTERPRET=1``, set here before any kernel module is imported — and must give
identical results. Without triton that test skips locally and FAILS under ``CI=true``.
The statistical tests of the rule are in ``tests/runtime/speculation/test_verifier.py``."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from runtime.speculation import verifier  # noqa: E402
from runtime.kernels import dispatch  # noqa: E402
from runtime.engine.sampler import uniform  # noqa: E402
from tests.conftest import require_or_skip  # noqa: E402

LENS = [0, 3, 7, 2, 5]


def _case(seed: int, V: int = 32):
    """Ragged inputs for LENS in which some drafts are accepted and some rejected;
    with seed 0, request 0 (ℓ = 0) has a one-hot row (a peaked target: its token is certain)."""
    g = torch.Generator().manual_seed(seed)
    R, D = len(LENS), sum(LENS)
    p_t = torch.softmax(torch.randn(D + R, V, generator=g) * 2, -1)
    p_d = torch.softmax(torch.randn(D, V, generator=g) * 2, -1)
    toks = torch.multinomial(p_d, 1, generator=g).squeeze(-1)
    p_t = 0.5 * p_t + 0.5 * torch.cat([p_d, p_d[:R]])  # overlap: drafts are often accepted
    if seed == 0:
        p_t[0] = torch.nn.functional.one_hot(torch.tensor(7), V).float()
    return p_t, p_d, toks


def _gens(seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(100 * seed + r) for r in range(len(LENS))]


def test_verify_is_verify_chain_on_the_generators_uniforms(monkeypatch):
    """Per request: ℓ_r acceptance uniforms, then one for the extra token (also for
    ℓ_r = 0 and one-hot rows), so a request's output depends on its own generator only."""
    monkeypatch.delenv("SPARKGATE_KERNELS", raising=False)
    p_t, p_d, toks = _case(0)
    gens, drawn = _gens(), _gens()
    got = verifier.verify(p_t, p_d, toks, LENS, gens)
    draws = [uniform(g, n + 1) for g, n in zip(drawn, LENS)]
    assert all(torch.equal(g.get_state(), h.get_state()) for g, h in zip(gens, drawn))
    u_accept, u_sample = torch.cat([u[:-1] for u in draws]), torch.stack([u[-1] for u in draws])
    want = verifier.verify_chain(p_t, p_d, toks, torch.tensor(LENS), u_accept, u_sample)
    assert torch.equal(got.accepted, want.accepted) and torch.equal(got.next_tokens, want.next_tokens)
    assert 0 < int(got.accepted.sum()) < sum(LENS)  # both accept and reject paths ran


def test_verify_through_the_triton_kernel_equals_torch(monkeypatch):
    """Same generators → the same tokens on the GPU's path as on the CPU engine's, round
    after round (both consume the same randomness, also for request 0's one-hot row in
    round 0, which decides its draws in rounds 1 and 2)."""
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the environment
        require_or_skip(False, "triton (pip install triton; the kernel runs under TRITON_INTERPRET=1 on CPU)")
    seen = set()
    gens_tri, gens_cpu = _gens(), _gens()
    for seed in range(3):  # three rounds of the same five requests
        p_t, p_d, toks = _case(seed)
        monkeypatch.setenv("SPARKGATE_KERNELS", "triton")
        assert dispatch.backend_for(p_t) == "triton"
        tri = verifier.verify(p_t, p_d, toks, LENS, gens_tri)
        monkeypatch.delenv("SPARKGATE_KERNELS")  # the CPU engine's default path
        ref = verifier.verify(p_t, p_d, toks, LENS, gens_cpu)
        assert torch.equal(tri.accepted, ref.accepted) and torch.equal(tri.next_tokens, ref.next_tokens)
        assert tri.tokens() == ref.tokens() and (seed > 0 or ref.next_tokens[0] == 7)
        seen.update(ref.accepted.tolist())
    assert len(seen) >= 3
