"""Backend choice for the GPU kernels: Triton on CUDA, torch elsewhere.

:func:`backend_for` picks the backend of the verification kernel (called by
:func:`runtime.speculation.verifier.verify`, whose torch path is the kernel's
specification) and of :func:`markov_sample`, which takes the same arguments as
:func:`~runtime.kernels.gpu.reference.markov_sample_reference` and returns the same
result. The Triton path is used when the inputs are CUDA tensors and ``triton``
imports; otherwise (CPU engine, no triton) torch runs — for verification, its C++ twin
where the gguf extension is loaded (:func:`cpu_verify_path`). The environment variable
``SPARKGATE_KERNELS`` (read by :func:`kernels_mode` only) overrides: ``reference``
forces the torch path, ``triton`` forces Triton (an error if it cannot import; on
CPU tensors this only works under ``TRITON_INTERPRET=1``), ``auto`` (default) as above.

The fused Markov sampler implements temperature only. A request that uses top-k
or top-p (:func:`fused_markov_supported` is False) must be drafted through the
engine's non-fused path (Markov head + :func:`runtime.engine.sampler.warp_probs` per
step), since its p_d must be the warped distribution actually sampled from.
"""

from __future__ import annotations

import functools

import torch

from runtime.config import env
from runtime.kernels.gpu.reference import MarkovResult, markov_sample_reference

_ENV = "SPARKGATE_KERNELS"


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when ``triton`` and this package's Triton kernels import."""
    try:
        import runtime.kernels.gpu.triton_markov  # noqa: F401
        import runtime.kernels.gpu.triton_verify  # noqa: F401
    except Exception:  # ImportError, or a broken triton install
        return False
    return True


def kernels_mode() -> str:
    """``SPARKGATE_KERNELS``: ``"auto"`` (default, also when empty), ``"reference"`` or ``"triton"``.

    Raises:
        ValueError: any other value.
    """
    mode = env(_ENV).strip().lower() or "auto"
    if mode not in ("auto", "reference", "triton"):
        raise ValueError(f"{_ENV} must be auto, reference or triton, got {mode!r}")
    return mode


def kernel_path(t: torch.Tensor) -> bool:
    """Draft through the fused Markov sampler (:func:`markov_sample`) for inputs where
    ``t`` lives? Yes on CUDA, or when ``SPARKGATE_KERNELS`` is ``reference``/``triton``
    (so CPU tests exercise the path the GPU runs); ``auto`` on CPU keeps the drafter's
    plain torch path."""
    return t.is_cuda or kernels_mode() != "auto"


def backend_for(t: torch.Tensor) -> str:
    """``"triton"`` or ``"reference"`` for inputs living where ``t`` lives.

    Raises:
        ValueError: ``SPARKGATE_KERNELS`` is not auto/reference/triton.
        RuntimeError: ``SPARKGATE_KERNELS=triton`` but triton cannot be imported.
    """
    mode = kernels_mode()
    if mode == "reference":
        return "reference"
    if mode == "triton":
        if not triton_available():
            raise RuntimeError(f"{_ENV}=triton but triton (or the kernels) cannot be imported")
        return "triton"
    return "triton" if t.is_cuda and triton_available() else "reference"


def cpu_verify_path(t: torch.Tensor) -> bool:
    """Whether :func:`runtime.speculation.verifier.verify` runs its C++ twin
    (``torch.ops.sparkgate.verify_chain``, ``runtime/kernels/cpu/verify_chain.cpp``, the same
    tokens in one call instead of ~40 torch ops) for inputs where ``t`` lives: on CPU
    tensors, with ``SPARKGATE_KERNELS`` ``auto``, when the C++ extension is already loaded
    in this process (the ``gguf`` model loads it; this never builds it)."""
    if t.is_cuda or kernels_mode() != "auto":
        return False
    from runtime.kernels.cpu.gguf_cpu import kernel_loaded

    return kernel_loaded()


def fused_markov_supported(top_k: int = 0, top_p: float = 1.0) -> bool:
    """Whether a request's sampling params fit the fused Markov sampler (temperature only)."""
    return top_k <= 0 and top_p >= 1.0


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
    """Markov-head sequential sampling (contract: :func:`~runtime.kernels.gpu.reference.markov_sample_reference`)."""
    if backend_for(base_logits) == "triton":
        from runtime.kernels.gpu.triton_markov import markov_sample_triton

        return markov_sample_triton(base_logits, w1, w2, anchors, temperature, uniforms, return_probs=return_probs)
    return markov_sample_reference(base_logits, w1, w2, anchors, temperature, uniforms, return_probs=return_probs)


__all__ = ["triton_available", "kernels_mode", "kernel_path", "backend_for", "cpu_verify_path", "fused_markov_supported",
           "markov_sample"]
