"""GPU verification kernels (Triton) with a bit-exact torch reference.

* :func:`verify_chain` — ragged chain speculative sampling (Leviathan et al. 2023).
* :func:`markov_sample` — DSpark Markov-head sequential draft sampling (paper §3.1).

Both dispatch to Triton on CUDA and to the torch reference on CPU
(:mod:`runtime.kernels.dispatch`). Importing this package never imports triton.
"""

from runtime.kernels.dispatch import backend_for, fused_markov_supported, markov_sample, triton_available, verify_chain
from runtime.kernels.reference import (
    MarkovResult,
    VerifyResult,
    inverse_cdf_draw,
    markov_sample_reference,
    verify_chain_reference,
)

__all__ = [
    "verify_chain",
    "markov_sample",
    "backend_for",
    "triton_available",
    "fused_markov_supported",
    "VerifyResult",
    "MarkovResult",
    "inverse_cdf_draw",
    "verify_chain_reference",
    "markov_sample_reference",
]
