"""``bench/proposers.py``'s steady-state window (pure function, no engine)."""

from __future__ import annotations

import sys

from runtime.interface import Finished, RequestTimings, TextDelta
from tests.support.hardening_util import load_bench

_path = list(sys.path)
proposers = load_bench("proposers")
sys.path[:] = _path


def delta(n: int) -> TextDelta:
    return TextDelta("x" * n, n)


def fin() -> Finished:
    return Finished("length", 10, 8, RequestTimings())


def test_steady_rate_counts_only_tokens_while_every_request_decodes():
    # a decodes from t = 1, b from t = 2 (the window opens); a finishes at t = 4 (it closes);
    # b's tail after t = 4 and everything up to t = 2 are outside it
    stamped = [(1.0, "a", delta(1)), (1.5, "a", delta(3)), (2.0, "b", delta(1)), (3.0, "a", delta(2)),
               (3.0, "b", delta(1)), (4.0, "a", delta(4)), (4.0, "a", fin()), (5.0, "b", delta(5)),
               (6.0, "b", fin())]
    assert proposers.steady_rate(stamped) == (2 + 1 + 4) / (4.0 - 2.0)


def test_steady_rate_is_none_without_an_overlap():
    stamped = [(1.0, "a", delta(2)), (2.0, "a", fin()), (3.0, "b", delta(2)), (4.0, "b", fin())]
    assert proposers.steady_rate(stamped) is None
    assert proposers.steady_rate([]) is None


def test_an_empty_delta_does_not_open_the_window():
    """Held-back text released at the end has num_tokens 0: not a first token."""
    stamped = [(1.0, "a", delta(1)), (1.2, "b", TextDelta("", 0)), (2.0, "b", delta(1)), (3.0, "a", delta(3)),
               (3.0, "a", fin()), (4.0, "b", fin())]
    assert proposers.steady_rate(stamped) == 3 / (3.0 - 2.0)
