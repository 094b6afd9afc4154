"""GPU kernels (Triton) with bit-exact torch counterparts.

* ``triton_verify`` — ragged chain speculative sampling (Leviathan et al. 2023); its
  torch specification is :func:`runtime.dspark.verifier.verify_chain`, which also
  dispatches to it.
* :func:`markov_sample` — DSpark Markov-head sequential draft sampling (paper §3.1).

Triton runs on CUDA, torch on CPU (:mod:`runtime.kernels.dispatch`). Importing this
package never imports triton.
"""

from runtime.kernels.dispatch import backend_for, fused_markov_supported, markov_sample, triton_available
from runtime.kernels.reference import MarkovResult, inverse_cdf_draw, markov_sample_reference

__all__ = [
    "markov_sample",
    "backend_for",
    "triton_available",
    "fused_markov_supported",
    "MarkovResult",
    "inverse_cdf_draw",
    "markov_sample_reference",
]
