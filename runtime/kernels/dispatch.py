"""Backend choice for the verification kernels: Triton on CUDA, torch reference elsewhere.

:func:`verify_chain` and :func:`markov_sample` take the same arguments as the
reference functions (:mod:`runtime.kernels.reference`) and return the same
results. The Triton path is used when the inputs are CUDA tensors and ``triton``
imports; otherwise (CPU engine, no triton) the torch reference runs. The
environment variable ``SPARKGATE_KERNELS`` overrides: ``reference`` forces the
torch path, ``triton`` forces Triton (an error if it cannot import; on CPU tensors
this only works under ``TRITON_INTERPRET=1``), ``auto`` (default) as above.

The fused Markov sampler implements temperature only. A request that uses top-k
or top-p (:func:`fused_markov_supported` is False) must be drafted through the
engine's non-fused path (Markov head + :func:`runtime.sampler.warp_probs` per
step), since its p_d must be the warped distribution actually sampled from.
"""

from __future__ import annotations

import functools

import torch

from runtime.config import env
from runtime.kernels.reference import MarkovResult, VerifyResult, markov_sample_reference, verify_chain_reference

_ENV = "SPARKGATE_KERNELS"


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when ``triton`` and this package's Triton kernels import."""
    try:
        import runtime.kernels.triton_markov  # noqa: F401
        import runtime.kernels.triton_verify  # noqa: F401
    except Exception:  # ImportError, or a broken triton install
        return False
    return True


def backend_for(t: torch.Tensor) -> str:
    """``"triton"`` or ``"reference"`` for inputs living where ``t`` lives.

    Raises:
        ValueError: ``SPARKGATE_KERNELS`` is not auto/reference/triton.
        RuntimeError: ``SPARKGATE_KERNELS=triton`` but triton cannot be imported.
    """
    mode = env(_ENV).lower()
    if mode not in ("auto", "reference", "triton"):
        raise ValueError(f"{_ENV} must be auto, reference or triton, got {mode!r}")
    if mode == "reference":
        return "reference"
    if mode == "triton":
        if not triton_available():
            raise RuntimeError(f"{_ENV}=triton but triton (or the kernels) cannot be imported")
        return "triton"
    return "triton" if t.is_cuda and triton_available() else "reference"


def fused_markov_supported(top_k: int = 0, top_p: float = 1.0) -> bool:
    """Whether a request's sampling params fit the fused Markov sampler (temperature only)."""
    return top_k <= 0 and top_p >= 1.0


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
    """Ragged chain speculative sampling (contract: :func:`~runtime.kernels.reference.verify_chain_reference`)."""
    if backend_for(p_target) == "triton":
        from runtime.kernels.triton_verify import verify_chain_triton

        return verify_chain_triton(p_target, p_draft, draft_tokens, lengths, u_accept, u_sample, max_len=max_len)
    return verify_chain_reference(p_target, p_draft, draft_tokens, lengths, u_accept, u_sample, max_len=max_len)


def markov_sample(
    base_logits: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    anchors: torch.Tensor,
    temperature: torch.Tensor,
    uniforms: torch.Tensor,
    *,
    return_probs: bool = True,
) -> MarkovResult:
    """Markov-head sequential sampling (contract: :func:`~runtime.kernels.reference.markov_sample_reference`)."""
    if backend_for(base_logits) == "triton":
        from runtime.kernels.triton_markov import markov_sample_triton

        return markov_sample_triton(base_logits, w1, w2, anchors, temperature, uniforms, return_probs=return_probs)
    return markov_sample_reference(base_logits, w1, w2, anchors, temperature, uniforms, return_probs=return_probs)


__all__ = ["triton_available", "backend_for", "fused_markov_supported", "verify_chain", "markov_sample"]
