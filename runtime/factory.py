"""Build the configured backend. The gateway calls only this (and the interface)."""

from __future__ import annotations

from runtime.config import EngineConfig
from runtime.interface import Backend


def create_backend(config) -> Backend:
    """An (unstarted) backend; ``await backend.start()`` loads/connects it.

    ``EngineConfig`` → the embedded engine (:class:`runtime.engine.async_engine.AsyncEngine`);
    ``runtime.sglang.client.SGLangConfig`` → the SGLang client backend;
    ``runtime.upstream.config.UpstreamConfig`` → the OpenAI-compatible upstream backend.

    Raises:
        TypeError: an unknown config type.
    """
    if isinstance(config, EngineConfig):
        from runtime.engine.async_engine import AsyncEngine

        return AsyncEngine(config)
    from runtime.upstream.config import UpstreamConfig

    if isinstance(config, UpstreamConfig):
        from runtime.upstream.client import OpenAIUpstreamBackend

        return OpenAIUpstreamBackend(config)
    from runtime.sglang.client import SGLangBackend, SGLangConfig

    if isinstance(config, SGLangConfig):
        return SGLangBackend(config)
    raise TypeError(f"unknown backend config {type(config).__name__}")
