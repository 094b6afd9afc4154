"""τ evaluation: DeepSpec prompt selection, the T=0 round walk, and simulated τ == the
engine's live speculative τ (real target, fp32, T=0, fixed policy) for DSpark and prompt lookup."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from runtime.speculation.checkpoint import save_drafter
from runtime.speculation.config import DrafterConfig
from runtime.speculation.drafter import DSparkDrafter
from training.evaluate import (
    TASK_CAPS,
    BlockStats,
    DrafterMethod,
    PromptLookupMethod,
    evaluate,
    expected_tau,
    first_turns,
    live_tau,
    load_eval_prompts,
    run_engine,
    task_file,
    walk_rounds,
    write_report,
)
from training.features import teacher_forward

MAX_NEW = 32


def test_deepspec_prompt_selection():
    shipped = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")  # alpaca is fetched (data/README.md)
    ps = load_eval_prompts(tasks=shipped)
    counts = {t: sum(p.task == t for p in ps) for t in shipped}
    assert counts == {"gsm8k": 500, "math500": 500, "humaneval": 164, "mbpp": 256, "mt-bench": 80}
    rows = first_turns("gsm8k")
    assert len(rows) == 1319
    random.Random(980406).shuffle(rows)
    assert [p.text for p in ps if p.task == "gsm8k"][:3] == rows[:3]
    assert [p.text for p in ps if p.task == "mt-bench"] == first_turns("mt-bench")  # 80 ≤ cap: file order kept
    # default: every task with a file (the five shipped, plus alpaca once fetched)
    assert {p.task for p in load_eval_prompts()} == {t for t in TASK_CAPS if task_file(t)} >= set(shipped)
    assert len(load_eval_prompts(tasks=["mbpp", "gsm8k"], max_samples=2)) == 4


def test_walk_rounds_bookkeeping():
    g = 4
    # prompt n=10, completion M=12 → positions 10..21 (e=21); anchors 10..20
    match = np.zeros((11, g), dtype=bool)
    match[0] = [True, True, False, True]  # round 1 at p=10: a=2, emit 3 → p=13
    match[3] = [True, True, True, True]  # round 2 at p=13: a=4, emit 5 → p=18
    match[8] = [True, True, True, True]  # round 3 at p=18: ℓ=min(4, 256−9−1)=4, but e−p=3 → emit 3 → done
    st = walk_rounds(BlockStats(match, np.full(11, g)), 10, 12, 256, g)
    assert (st.rounds, st.emitted, st.accepted) == (3, 11, 2 + 4 + 3)
    assert st.emitted == 12 - 1  # all completion tokens but the prefill's first
    # max_tokens = 12 → room at p=18 is 12 − 9 − 1 = 2 drafts
    st2 = walk_rounds(BlockStats(match, np.full(11, g)), 10, 12, 12, g)
    assert (st2.rounds, st2.emitted, st2.accepted) == (3, 11, 2 + 4 + 2)
    assert st.acc_at_least == [3, 3, 2, 2] and st.offered == [3, 3, 3, 2]
    assert expected_tau(np.array([[1.0, 0.5, 0.5], [0.0, 1.0, 1.0]])) == (1 + 1 + 0.5 + 0.25 + 1, 2)


# -- simulated vs live ------------------------------------------------------------------------

def _chat(tokenizer, text):
    s = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(s, add_special_tokens=False)


@pytest.fixture(scope="module")
def setup(target_fp32, tokenizer):
    prompts = load_eval_prompts(tasks=["mt-bench", "gsm8k", "humaneval"], max_samples=1)
    ids = [_chat(tokenizer, p.text) for p in prompts]
    ar = run_engine(target_fp32, tokenizer, ids, temperature=0.0, max_new_tokens=MAX_NEW)
    # A drafter whose Markov head encodes bigrams of the greedy outputs (rank 64, bias 30):
    # drafts then follow the target for a while and get rejected elsewhere → mixed accept lengths.
    dr = DSparkDrafter(target_fp32, DrafterConfig(markov_rank=64, init_seed=5))
    pairs = {}
    for g in ar:
        for a, b in zip(g.tokens, g.tokens[1:]):
            if a not in pairs and len(pairs) < 64 and (a * 7919) % 3:  # leave some tokens unmapped
                pairs[a] = b
    with torch.no_grad():
        dr.markov.w1.weight.zero_()
        dr.markov.w2.weight.zero_()
        for i, (a, b) in enumerate(pairs.items()):
            dr.markov.w1.weight[a, i] = 1.0
            dr.markov.w2.weight[b, i] = 30.0
    return prompts, ids, ar, dr


@pytest.mark.model
def test_t0_simulated_tau_equals_live_speculative_decoding(setup, target_fp32, tokenizer, tmp_path):
    prompts, ids, ar, dr = setup
    ck = save_drafter(dr, tmp_path / "bigram")
    dspark = DrafterMethod("dspark", dr)
    lookup = PromptLookupMethod(7)
    for method, kw in ((dspark, {"spec_method": "dspark", "draft_checkpoint": str(ck)}),
                       (lookup, {"spec_method": "prompt_lookup"})):
        live = run_engine(target_fp32, tokenizer, ids, temperature=0.0, max_new_tokens=MAX_NEW, spec_policy="fixed",
                          num_speculative_tokens=7, **kw)  # fmt: skip
        tot_acc = 0
        for pid, g_ar, g_live in zip(ids, ar, live):
            assert g_live.tokens == g_ar.tokens  # lossless at T=0
            seq = torch.tensor(pid + g_ar.tokens)
            tb = teacher_forward(target_fp32, [seq], [len(pid)], dr.tap_layers)
            bs = method.greedy_blocks(seq, tb.taps[0], len(pid))
            sim = walk_rounds(bs, len(pid), len(g_ar.tokens), MAX_NEW, 7)
            lazy = walk_rounds(method.round_rows(seq, tb.taps[0], len(pid)), len(pid), len(g_ar.tokens), MAX_NEW, 7)
            assert (lazy.rounds, lazy.emitted, lazy.accepted, lazy.acc_at_least) == (
                sim.rounds, sim.emitted, sim.accepted, sim.acc_at_least)
            sp = g_live.spec
            assert (sim.rounds, sim.emitted, sim.accepted) == (sp["rounds"], sp["emitted"], sp["accepted"]), method.name
            assert sim.acc_at_least == sp["accepted_per_position"]
            tot_acc += sim.accepted
        assert tot_acc >= 5, method.name  # the comparison is not vacuous (drafts do get accepted)


@pytest.mark.model
def test_draft_vocab_restricts_the_simulated_drafts(setup, target_fp32):
    """``DrafterMethod(vocab=...)`` drafts only inside the draft vocabulary (as the served
    fused drafter): with the output's own tokens every unrestricted match survives (the
    true token is then the argmax inside the vocabulary too); without them none can match."""
    prompts, ids, ar, dr = setup
    seq, n = torch.tensor(ids[0] + ar[0].tokens), len(ids[0])
    taps = teacher_forward(target_fp32, [seq], [n], dr.tap_layers).taps[0]
    own = torch.tensor(sorted(set(ar[0].tokens)))
    rest = torch.ones(target_fp32.cfg.vocab_size, dtype=torch.bool)
    rest[own] = False
    full = DrafterMethod("dspark", dr).greedy_blocks(seq, taps, n).match
    inside = DrafterMethod("dv", dr, vocab=own).greedy_blocks(seq, taps, n).match
    outside = DrafterMethod("dv", dr, vocab=rest.nonzero().squeeze(-1)).greedy_blocks(seq, taps, n).match
    assert full.sum() > 0 and (inside >= full).all() and not outside.any()
    al = DrafterMethod("dv", dr, vocab=rest.nonzero().squeeze(-1)).expected_acceptance(
        seq, taps, teacher_forward(target_fp32, [seq], [n], dr.tap_layers).hidden[0], n, target_fp32)
    assert np.isfinite(al).all() and (al >= 0).all()


@pytest.mark.model
def test_t1_expected_acceptance_and_report(setup, target_fp32, tokenizer, tmp_path):
    prompts, ids, ar, dr = setup
    # A drafter equal to the target (p_d = p_t) would have α ≡ 1; the random backbone with a
    # bigram bias is far from it, and prompt lookup's α is p_t(draft).
    # Prompt lookup proposes 4 tokens, the drafter 7: the report pads the shorter rows.
    res = evaluate(target_fp32, tokenizer, [DrafterMethod("dspark", dr), PromptLookupMethod(4)], prompts[:2],
                   max_new_tokens=24, temperatures=(0.0, 1.0), progress=False)  # fmt: skip
    assert {r["task"] for r in res["rows"]} == {"mt-bench", "gsm8k"}
    assert res["summary"]["dspark"]["tau_t0_macro"] > 1.2  # the bigram drafter gets blocks accepted
    for r in res["rows"]:
        g = 7 if r["method"] == "dspark" else 4
        assert 1.0 <= r["tau_t0"] <= 1.0 + g
        assert 1.0 <= r["tau_t1"] <= 1.0 + g
        assert len(r["pos_acc_t1"]) == g and all(0.0 <= x <= 1.0 for x in r["pos_acc_t1"])
    write_report(res, tmp_path / "r.md", tmp_path / "r")
    md = (tmp_path / "r.md").read_text()
    assert "| dspark |" in md and "| prompt-lookup |" in md
    pos_rows = [ln for ln in md.split("Position-wise")[1].split("![")[0].splitlines() if ln.startswith("|")]
    assert pos_rows[0] == "| method | T | " + " | ".join(f"k={k}" for k in range(1, 8)) + " |"
    assert len(pos_rows) == 2 + 4 and all(r.count("|") == 10 for r in pos_rows), pos_rows
    assert all(r.endswith("| – | – | – |") for r in pos_rows if r.startswith("| prompt-lookup |"))
    assert (tmp_path / "r-tau.png").stat().st_size > 1000 and (tmp_path / "r-position.png").stat().st_size > 1000


@pytest.mark.model
def test_live_t1_tau_cross_checks_the_expected_t1_tau(setup, target_fp32, tokenizer, tmp_path):
    """``eval --live-t1``: τ of live T = 1 speculative decoding (fixed policy) per task, for the
    bigram drafter and prompt lookup, lands near the expected T = 1 τ computed along another
    sample of the target; the report gets a cross-check table."""
    prompts, ids, ar, dr = setup
    ck = save_drafter(dr, tmp_path / "bigram")
    sel = prompts[:2]
    res = evaluate(target_fp32, tokenizer, [DrafterMethod("dspark", dr), PromptLookupMethod(7)], sel,
                   max_new_tokens=MAX_NEW, temperatures=(1.0,), progress=False)  # fmt: skip
    live = {"dspark": live_tau(target_fp32, tokenizer, sel, "dspark", str(ck), max_new_tokens=MAX_NEW),
            "prompt-lookup": live_tau(target_fp32, tokenizer, sel, "prompt_lookup", max_new_tokens=MAX_NEW)}
    for row in res["rows"]:
        got, want = live[row["method"]][row["task"]], row["tau_t1"]
        print(row["method"], row["task"], "live", got, "expected", round(want, 3))
        assert 1.0 <= got <= 8.0 and abs(got - want) < 0.6, (row, got)
    # Only T = 1 was run: no T = 0 numbers (not zeros) in the rows, the summary or the report.
    assert all(r["tau_t0"] is None and r["pos_acc_t0"] is None and r["samples"] == 1 for r in res["rows"])
    assert res["summary"]["dspark"]["tau_t0_macro"] is None and res["summary"]["dspark"]["tau_t1_macro"] >= 1.0
    res["live_t1"] = {"prompts_per_task": 1, "tau": live}
    write_report(res, tmp_path / "r.md", tmp_path / "r")
    md = (tmp_path / "r.md").read_text()
    assert "T=1 cross-check" in md and "0.00" not in md


@pytest.mark.model
def test_calibrate_writes_sts_temperatures(setup, target_fp32, tokenizer, tmp_path):
    from runtime.speculation.checkpoint import load_drafter
    from training.data import Sample, write_shard
    from training.evaluate import calibrate_sts

    prompts, ids, ar, dr = setup
    write_shard(tmp_path / "data", 0, [Sample(f"h:{i}", "chat", pid, len(pid), "length", True) for i, pid in enumerate(ids)]
                + [Sample("t:0", "chat", ids[0] + [1, 2], len(ids[0]), "stop", False)])  # fmt: skip
    ck = save_drafter(dr, tmp_path / "ck")
    rep = calibrate_sts(ck, tmp_path / "data", max_samples=8, max_new_tokens=MAX_NEW, target=target_fp32,
                        tokenizer=tokenizer, progress=False, completions=[g.tokens for g in ar])  # fmt: skip
    assert rep["heldout_prompts"] == 3 and rep["anchors"] == sum(len(g.tokens) - 1 for g in ar)
    temps = load_drafter(ck, target_fp32).cfg.sts_temperatures
    assert temps == pytest.approx(rep["temperatures"], abs=1e-4) and len(temps) == 7 and all(t > 0 for t in temps)
    assert rep["n_valid"][0] == rep["anchors"]
    k1 = rep["ece_after"][0], rep["ece_before"][0]
    assert k1[0] <= k1[1] + 1e-9  # the fit never makes position 1 worse than T = 1
    on_disk = json.loads((ck / "calibration.json").read_text())
    assert on_disk["temperatures"] == rep["temperatures"] and "checkpoint" not in on_disk  # no machine path


@pytest.mark.model
def test_calibrate_t1_labels_are_the_expected_survival(setup, target_fp32, tokenizer, tmp_path):
    """``calibrate --labels t1``: the label of position k is Π_{i≤k} α_i of the same teacher-forced
    blocks the T = 1 τ uses, so the mean label sum per anchor is that τ − 1; z_k from those blocks."""
    from training.data import Sample, write_shard
    from training.evaluate import calibrate_sts, slot_valid

    prompts, ids, ar, dr = setup
    write_shard(tmp_path / "data", 0, [Sample(f"h:{i}", "chat", pid, len(pid), "length", True) for i, pid in enumerate(ids)])
    ck = save_drafter(dr, tmp_path / "ck")
    comps = [g.tokens for g in ar]
    rep = calibrate_sts(ck, tmp_path / "data", max_samples=8, max_new_tokens=MAX_NEW, target=target_fp32,
                        tokenizer=tokenizer, progress=False, completions=comps, labels="t1", write=False)  # fmt: skip
    method, tau_sum, anchors, valid0 = DrafterMethod("dspark", dr), 0.0, 0, 0
    for pid, comp in zip(ids, comps):
        seq = torch.tensor(pid + comp)
        tb = teacher_forward(target_fp32, [seq], [len(pid)], dr.tap_layers)
        al = method.expected_acceptance(seq, tb.taps[0], tb.hidden[0], len(pid), target_fp32)
        s, k = expected_tau(al)
        tau_sum, anchors = tau_sum + s, anchors + k
        valid0 += int(slot_valid(len(pid), seq.numel(), 7)[:, 0].sum())
    assert rep["anchors"] == anchors and rep["n_valid"][0] == valid0
    assert rep["mean_accepted_per_anchor"] == pytest.approx(tau_sum / anchors - 1.0, abs=2e-4)
    assert rep["labels"].startswith("T=1")
    assert rep["ece_after"][0] <= rep["ece_before"][0] + 1e-9
    with pytest.raises(ValueError, match="labels"):
        calibrate_sts(ck, tmp_path / "data", target=target_fp32, tokenizer=tokenizer, labels="t2", completions=comps)
