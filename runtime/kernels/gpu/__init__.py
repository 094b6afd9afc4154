"""GPU kernels (Triton): ragged chain verification (``triton_verify``; its torch
specification is :func:`runtime.speculation.verifier.verify_chain`) and Markov-head draft
sampling (``triton_markov``; torch reference in ``reference``)."""
