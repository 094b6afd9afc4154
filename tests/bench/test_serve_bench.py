"""Benchmark hygiene (issue 28 item 6) of ``bench/serve_bench.py``'s shared helpers and
``bench/llama_race.py``'s method strings: pure functions, no server."""

from __future__ import annotations

import gzip
import json
import sys

import pytest

from tests.support.hardening_util import load_bench

_path = list(sys.path)
sb = load_bench("serve_bench")
race = load_bench("llama_race")  # inserts bench/ into sys.path for its own imports
sys.path[:] = _path


def test_plan_prompts_gives_disjoint_blocks_in_pool_order():
    pool = [f"p{i}" for i in range(10)]
    plan = sb.plan_prompts(pool, 2, [("a", 3), ("b", 4)])
    assert plan.warmup == ["p0", "p1"]
    assert plan.blocks == {"a": ["p2", "p3", "p4"], "b": ["p5", "p6", "p7", "p8"]}


def test_plan_prompts_counts_a_repeated_text_once():
    """The pool's duplicate texts would otherwise land in two blocks (a prefix-cache hit)."""
    plan = sb.plan_prompts(["x", "y", "x", "z", "y", "w"], 1, [("a", 2), ("b", 1)])
    assert plan.warmup == ["x"] and plan.blocks == {"a": ["y", "z"], "b": ["w"]}
    with pytest.raises(ValueError, match="needs 5 distinct prompts .* the pool has 4"):
        sb.plan_prompts(["x", "y", "x", "z", "y", "w"], 1, [("a", 2), ("b", 2)])


@pytest.mark.parametrize("warmup, blocks, match", [
    (-1, [("a", 1)], ">= 0"),
    (0, [("a", 1), ("a", 1)], "repeated block keys"),
    (0, [("a", 2), ("b", -1)], ">= 0"),
])
def test_plan_prompts_rejects_bad_plans(warmup, blocks, match):
    with pytest.raises(ValueError, match=match):
        sb.plan_prompts(["p", "q", "r"], warmup, blocks)


@pytest.mark.parametrize("per_server", [False, True])
def test_interleaved_rounds_never_resend_a_prompt(per_server):
    """The frontier's default schedule on the shipped prompts: every (T, c, round) block —
    per server with ``per_server`` — is fresh, sized c × requests, and none is a warm-up."""
    levels = [(c, 2) for c in (1, 2, 4, 8, 16)]
    keys = sb.round_keys(levels, 3, (0.0, 1.0), n_servers=2, per_server_prompts=per_server)
    assert len(keys) == 2 * 5 * 3 * (2 if per_server else 1)
    plan = sb.plan_prompts(sb.prompt_pool(mix=True), 2, keys)
    used = plan.warmup + [p for b in plan.blocks.values() for p in b]
    assert len(used) == len(set(used)) == 2 + 62 * 3 * 2 * (2 if per_server else 1)
    assert {k: len(v) for k, v in plan.blocks.items()} == dict(keys)
    key = (1.0, 16, 2, 1) if per_server else (1.0, 16, 2)
    assert len(plan.blocks[key]) == 32


def test_legacy_levels_no_longer_share_prompts():
    """Before issue 28 every level sent prompts[: c × rounds] of the same list, so c = 4 re-sent
    c = 1's prompts to a server whose prefix cache held them."""
    plan = sb.plan_prompts(sb.prompt_pool(), 2, sb.round_keys([(1, 8), (4, 2), (16, 2)], 1))
    c1, c4, c16 = (set(plan.blocks[(0.0, c, 0)]) for c in (1, 4, 16))
    assert (len(c1), len(c4), len(c16)) == (8, 8, 32)
    assert not (c1 & c4 or c1 & c16 or c4 & c16 or set(plan.warmup) & (c1 | c4 | c16))
    assert plan.warmup == sb.prompt_pool()[:2]  # mt-bench first, as the tables before issue 28


def _write(dir_, task, turns):
    rows = "".join(json.dumps({"turns": [t, "second"]}) + "\n" for t in turns)
    (dir_ / f"{task}.jsonl.gz").write_bytes(gzip.compress(rows.encode()))


def test_prompt_pool_orders_tasks_in_turn_or_one_after_another(tmp_path):
    _write(tmp_path, "a", ["a0", "a1", "a2"])
    _write(tmp_path, "b", ["b0", "a1"])  # a text in two tasks counts once
    assert sb.prompt_pool(("a", "b"), tmp_path) == ["a0", "a1", "a2", "b0"]
    assert sb.prompt_pool(("a", "b"), tmp_path, mix=True) == ["a0", "b0", "a1", "a2"]
    with pytest.raises(FileNotFoundError):
        sb.prompt_pool(("a", "missing"), tmp_path)


@pytest.mark.parametrize("usage, finish, chunks, want", [
    ({"completion_tokens": 128}, "length", 40, (128, "usage")),  # several tokens per chunk (speculation)
    (None, "length", 127, (128, "length")),
    (None, "stop", 9, (9, "chunks")),
])
def test_tokens_are_counted_by_one_rule(usage, finish, chunks, want):
    assert sb.count_tokens(usage, finish, chunks, 128) == want


def _row(server, c, r, per_user, agg, t=0.0):
    return {"server": server, "temperature": t, "concurrency": c, "round": r, "requests": c,
            "per_user_tokens_per_s_p50": per_user, "aggregate_tokens_per_s": agg, "ttft_s_p50": 0.1}


def test_ratios_are_per_round_against_the_same_runs_baseline():
    rows = [_row("AR", 1, 0, 100.0, 90.0), _row("S", 1, 0, 50.0, 45.0),
            _row("AR", 1, 1, 200.0, 180.0), _row("S", 1, 1, 220.0, 198.0),
            _row("AR", 1, 2, 100.0, 90.0), _row("S", 1, 2, 120.0, 99.0)]
    by = {s["server"]: s for s in sb.summarize_rounds(rows, "AR")}
    s = by["S"]
    assert s["per_user_vs_baseline_rounds"] == [0.5, 1.1, 1.2]
    assert s["per_user_vs_baseline"] == 1.1  # median of ratios, not ratio of medians (120 / 100)
    assert s["aggregate_vs_baseline_rounds"] == [0.5, 1.1, 1.1]
    assert s["per_user_tokens_per_s_p50"] == 120.0 and s["rounds"] == 3 and s["requests"] == 3
    assert by["AR"]["per_user_vs_baseline"] == 1.0
    # no AR in the run: no ratio at all
    assert not any("vs_baseline" in k for s in sb.summarize_rounds(rows, None) for k in s)
    assert not any("vs_baseline" in k for s in sb.summarize_rounds(rows, "llama (another run)") for k in s)


def _req(tokens, e2e):
    return {"completion_tokens": tokens, "e2e_s": e2e, "ttft_s": 0.1, "decode_tokens_per_s": tokens / e2e}


def test_closed_loop_throughput_leaves_out_the_tail_that_the_makespan_charges():
    """Two clients, two requests each: A's take 1 s, B's 2 s; B's client ends 2 s after A's."""
    results = [_req(100, 1.0), _req(100, 1.0), _req(100, 2.0), _req(100, 2.0)]
    s = sb.level_summary(results, 2, wall=4.0)
    assert s["aggregate_tokens_per_s"] == 100.0  # 400 tokens over the 4 s makespan
    assert s["closed_loop_tokens_per_s"] == round(2 * 400 / 6.0, 2)  # X = N / R: R = 1.5 s per request
    # equal request times: the two agree
    even = sb.level_summary([_req(100, 1.5)] * 4, 2, wall=3.0)
    assert even["closed_loop_tokens_per_s"] == even["aggregate_tokens_per_s"] == round(400 / 3.0, 2)
    # a result without e2e (an in-process caller): no closed-loop figure, and no ratio from it
    assert sb.level_summary([{"completion_tokens": 8, "ttft_s": None, "decode_tokens_per_s": None}], 1, 1.0)[
        "closed_loop_tokens_per_s"] is None


def test_closed_loop_ratio_is_per_round_too():
    rows = [{**_row("AR", 2, r, 100.0, 90.0), "closed_loop_tokens_per_s": 100.0} for r in range(3)]
    rows += [{**_row("S", 2, r, 100.0, 90.0), "closed_loop_tokens_per_s": x} for r, x in enumerate((90.0, 110.0, 105.0))]
    by = {s["server"]: s for s in sb.summarize_rounds(rows, "AR")}
    assert by["S"]["closed_loop_vs_baseline_rounds"] == [0.9, 1.1, 1.05]
    assert by["S"]["closed_loop_vs_baseline"] == 1.05 and by["S"]["closed_loop_tokens_per_s"] == 105.0


@pytest.mark.parametrize("spec, env", [
    ("none", {"SPARKGATE_SPEC_METHOD": "none"}),
    ("dspark", {"SPARKGATE_SPEC_METHOD": "dspark"}),
    ("mtp1", {"SPARKGATE_SPEC_METHOD": "dspark", "SPARKGATE_SPEC_POLICY": "mtp1"}),
    ("dspark-sla-nogate", {"SPARKGATE_SPEC_METHOD": "dspark", "SPARKGATE_SPEC_POLICY": "dspark-sla",
                           "SPARKGATE_SPEC_GATE": "false"}),
    ("dspark/dspark", {"SPARKGATE_SPEC_METHOD": "dspark", "SPARKGATE_SPEC_POLICY": "dspark"}),
    ("prompt_lookup/fixed", {"SPARKGATE_SPEC_METHOD": "prompt_lookup", "SPARKGATE_SPEC_POLICY": "fixed"}),
    ("dspark-eager", {"SPARKGATE_SPEC_METHOD": "dspark", "SPARKGATE_DRAFT_FUSED": "false"}),
    ("hybrid", {"SPARKGATE_SPEC_METHOD": "hybrid"}),
])
def test_method_strings_map_to_server_env(spec, env):
    assert race.method_env(spec, "gguf")[1] == {"SPARKGATE_DTYPE": "gguf", **env}


def test_method_string_errors():
    with pytest.raises(ValueError, match="no verification policy"):
        race.method_env("none/fixed", "auto")
    with pytest.raises(ValueError, match="no method"):
        race.method_env("/fixed", "auto")
