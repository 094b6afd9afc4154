"""Speculative decoding: DSpark (arXiv:2607.05147) and the prompt-lookup baseline.

``speculator`` (what the engine calls), ``drafter`` / ``fast_drafter`` (backbone, §3.1),
``markov_head``, ``confidence_head``, ``sts`` (§3.2.1), ``sps`` / ``sps_profiler`` (SPS
table, §3.2.2), ``budget`` (Alg. 1: the verification-budget scheduler), ``sla`` (tier
weights), ``gate``, ``prompt_lookup``, ``verifier`` (lossless verification). Never
imports the engine loop; empty on purpose.
"""
