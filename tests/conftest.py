"""Shared fixtures. The real model is loaded once per session (fp32 for exactness)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_or_skip(ok: bool, what: str) -> None:
    """Skip locally when a system dependency is missing; fail under CI=true."""
    if ok:
        return
    if IN_CI:
        pytest.fail(f"{what} is required under CI=true but is missing")
    pytest.skip(f"{what} is missing (install it, or run .ci/run)")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from runtime.models.loader import ensure_converted

    return ensure_converted()


@pytest.fixture(scope="session")
def target_fp32(model_dir):
    import torch

    from runtime.models.llama import load_llama

    return load_llama(model_dir, torch.float32)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
