"""Golden T=0 fp32 outputs and speculation stats (``tests/support/golden.py``): a refactor that
changes what the engine emits, or how many drafts it verifies and accepts, fails here."""

from __future__ import annotations

import json

import pytest

from tests.support.golden import GOLDEN, METHODS, PROMPTS, run_method

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def golden() -> dict:
    data = json.loads(GOLDEN.read_text())
    assert data["prompts"] == PROMPTS, "prompts changed: re-record with `python -m tests.support.golden --write`"
    plain = data["methods"]["none/fixed"]
    for name, runs in data["methods"].items():  # a re-recorded file must still be lossless at T=0
        assert {k: r["tokens"] for k, r in runs.items()} == {k: r["tokens"] for k, r in plain.items()}, name
    return data


@pytest.mark.parametrize("method,policy", METHODS)
def test_outputs_and_stats_equal_the_golden_file(target_fp32, tokenizer, golden, method, policy):
    got = run_method(target_fp32, tokenizer, method, policy)
    want = golden["methods"][f"{method}/{policy}"]
    assert len(got) == len(PROMPTS)
    for rid, w in want.items():
        assert got[rid]["tokens"] == w["tokens"], f"prompt {rid} ({PROMPTS[int(rid)]!r}): text changed"
        assert got[rid] == w, f"prompt {rid}: finish reason or speculation stats changed"
    if method != "none":  # the speculative runs must really speculate, or the check is vacuous
        assert sum(w["spec"]["accepted"] for w in want.values()) > 0
