"""Offline drafter work: training data generation (``data``), the target's teacher
features and their disk cache (``features``, ``feature_cache``), training (``train``),
evaluation of τ on the DeepSpec sets (``evaluate``) and the CLI (``cli``).

Imports the runtime; the runtime never imports this package.
"""
