"""Build the configured backend. The gateway calls only this (and the interface)."""

from __future__ import annotations

from runtime.config import EngineConfig
from runtime.interface import Backend


def create_backend(config: EngineConfig) -> Backend:
    """Return an (unstarted) backend for ``config``; ``await backend.start()`` loads it."""
    from runtime.async_engine import AsyncEngine

    return AsyncEngine(config)
