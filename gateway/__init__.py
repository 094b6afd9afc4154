"""Sparkgate gateway: OpenAI-compatible HTTP front end of the embedded engine.

Talks to the engine only through :mod:`runtime.interface` (``Backend``).
Entry points: :func:`gateway.main.create_app` and the ``sparkgate`` CLI
(:mod:`gateway.cli`).
"""
