"""Backends that stream from remote servers, and the OpenAI-compatible one.

Modules (nothing is imported here):
    router:    :class:`UpstreamRouter`: health checks, ejection and rejoin, least-outstanding
               routing over several servers (the SGLang backend's router extends it).
    assembler: :class:`StreamAssembler`: stream chunks → text deltas, stop strings held back
               and cut (shared with the SGLang backend).
    http:      error bodies, ``Retry-After`` and busy statuses of upstream answers.
    config:    :class:`UpstreamConfig`, the ``SPARKGATE_UPSTREAM_*`` settings.
    payload:   the ``/v1/completions`` body of a request (token-id prompt, sampling fields).
    chunks:    one ``/v1/completions`` stream chunk, parsed (text, finish, usage, logprobs).
    client:    :class:`OpenAIUpstreamBackend`, the :class:`runtime.interface.Backend` over
               OpenAI-compatible servers (vLLM, SGLang, llama-server).
"""
