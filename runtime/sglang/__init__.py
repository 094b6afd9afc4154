"""SGLang scale-out backend: stream completions from one or more SGLang 0.5.23 servers.

Modules:
    client:  :class:`SGLangBackend`, the :class:`runtime.interface.Backend` over SGLang's
             native ``/generate`` API (httpx, SSE streaming), and :class:`SGLangConfig`.
    router:  :class:`SGLangRouter`: :class:`runtime.upstream.router.UpstreamRouter` (health
             checks, least-loaded routing) plus SGLang's ``/v1/loads`` report.
    launch:  the ``sglang-launch`` wrapper (stdlib only): installs the SLA plugin into
             SGLang's Python environment and execs ``python -m sglang.launch_server``.
    plugin:  the SLA plugin that runs *inside* SGLang's scheduler processes (stdlib only).

Nothing is imported eagerly: ``launch`` and ``plugin`` must stay importable in
SGLang's own environment (no httpx/transformers/torch requirement), so the names below
are resolved lazily (PEP 562).
"""

from __future__ import annotations

import importlib

__all__ = ["SGLangBackend", "SGLangConfig", "SGLangRouter"]

_LAZY = {
    "SGLangBackend": "runtime.sglang.client",
    "SGLangConfig": "runtime.sglang.client",
    "SGLangRouter": "runtime.sglang.router",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'runtime.sglang' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
