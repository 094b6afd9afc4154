"""Proposers side by side, in process at c = 1: first-position acceptance a₁, accepted length τ
and decode speed per eval task for plain decoding, prompt lookup, DSpark and the hybrid.

Every configuration is one :class:`~runtime.engine.llm_engine.LLMEngine` sharing the same
loaded target; prompts are sent one at a time (c = 1) and **interleaved**: prompt i goes to
every configuration in turn (order rotated per prompt) before prompt i+1, so drifts of the
machine hit all of them alike. Per request: decode tok/s = (completion tokens − 1) / (last
token − first token) (``runtime.interface.decode_tokens_per_s``'s definition); per task and
configuration the median over requests and its ratio to plain decoding on the same prompts.

Configurations (``--configs``; ``METHOD[:POLICY][+gate][+ref]``, ``+ref``: the reference full-vocabulary
drafter):

* ``none`` — plain decoding (the baseline).
* ``prompt_lookup:fixed``, ``dspark:fixed``, ``hybrid:fixed`` — every draft verified: a₁ and τ
  of the proposer itself (τ = emitted tokens per round, bonus included; a₁ = accepted first
  drafts / rounds that verified a draft).
* ``dspark:dspark-sla+gate``, ``hybrid:dspark-sla+gate`` — as served: the budget (Alg. 1 on
  the SPS table) and ``spec_gate`` on — for ``dspark`` the budget's pre-draft choice of the
  requests worth drafting (``hybrid`` makes it with the flag or without), for the others the
  speculation gate.

Temperature 0 (``--temperature``), ``--max-tokens`` (128) tokens with EOS allowed, the served
dtype. At T = 0 every configuration's text must equal plain decoding's (checked, reported as
``texts_equal``). ``--concurrency c`` > 1: batches of c fresh prompts at once (EOS ignored),
aggregate (tokens / wall) and per-user tok/s per config, interleaved per batch, and the
steady-state rate while all c requests decode (:func:`steady_rate`: without the batch's tail).
Prints one JSON document.

    .venv/bin/python bench/proposers.py [--per-task 8] [--tasks mt-bench gsm8k humaneval]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.config import EngineConfig, resolve_dtype  # noqa: E402
from runtime.engine.llm_engine import LLMEngine  # noqa: E402
from runtime.interface import Finished, GenerationRequest, SamplingParams, TextDelta  # noqa: E402
from training.evaluate import first_turns  # noqa: E402

DEFAULT_CONFIGS = ("none", "prompt_lookup:fixed", "dspark:fixed", "hybrid:fixed", "dspark:dspark-sla+gate",
                   "hybrid:dspark-sla+gate")


def engine_config(name: str, dtype: str, gamma: int, batch: int = 1) -> EngineConfig:
    """``METHOD[:POLICY][+gate][+ref]`` → an engine config (prefix cache off: every prompt is new).
    ``+gate``: ``spec_gate`` on (``dspark``: the budget decides before drafting; ``parallel``,
    ``prompt_lookup``: the speculation gate); ``+ref``: the reference full-vocabulary drafter
    (``draft_fused=False``) instead of the draft-vocabulary one.

    Raises:
        ValueError: an unknown ``+`` flag."""
    head, *flags = name.split("+")
    if set(flags) - {"gate", "ref"}:
        raise ValueError(f"unknown flag in {name!r}: only +gate and +ref")
    method, _, policy = head.partition(":")
    return EngineConfig(dtype=dtype, spec_method=method, spec_policy=policy or "dspark-sla", spec_gate="gate" in flags,
                        draft_fused="ref" not in flags, num_speculative_tokens=gamma, max_batch_size=batch,
                        request_timeout_s=3600.0, prefix_cache_blocks=0, profile_on_start=method != "none")


class Runner:
    """One engine; :meth:`generate` runs one request to completion and returns its numbers."""

    def __init__(self, cfg: EngineConfig, model=None, tokenizer=None, temperature: float = 0.0) -> None:
        self.events: list = []
        self.stamped: list[tuple[float, str, object]] = []  # (perf_counter, request id, event)
        self.temperature = temperature
        self.engine = LLMEngine(cfg, self._on_event, model=model, tokenizer=tokenizer)

    def _on_event(self, rid: str, ev) -> None:
        self.events.append(ev)
        self.stamped.append((time.perf_counter(), rid, ev))

    def generate_batch(self, prompts: list[list[int]], max_tokens: int) -> dict:
        """All ``prompts`` at once (c = len(prompts)): aggregate tok/s = completion tokens / wall,
        per-user tok/s per request; the engine's decode rounds and verified rows.

        ``steady_tok_s``: tokens emitted while all c requests were decoding (from the last
        first token to the first finish) per second of that window — the throughput of a
        closed loop at concurrency c without the batch's prefill and its tail. The tail
        matters for speculation: when one request's drafts pay and another's do not, the
        fast one finishes first and the slow one decodes alone, so tokens / wall charges the
        batch's makespan to the method (AR's requests finish together)."""
        self.events, self.stamped = [], []
        eng = self.engine
        steps0, rows0 = eng.decode_steps, eng.verify_tokens
        for i, ids in enumerate(prompts):
            eng.add_request(GenerationRequest(str(i), ids, SamplingParams(temperature=self.temperature,
                                                                          max_tokens=max_tokens, ignore_eos=True)))
        t0 = time.perf_counter()
        while eng.has_work():
            eng.step()
        wall = time.perf_counter() - t0
        fins = [e for e in self.events if isinstance(e, Finished)]
        tokens = sum(f.completion_tokens for f in fins)
        users = [(f.completion_tokens - 1) / (f.timings.last_token - f.timings.first_token) for f in fins]
        return {"aggregate_tok_s": tokens / wall, "per_user_p50": statistics.median(users),
                "steady_tok_s": steady_rate(self.stamped),
                "rounds": eng.decode_steps - steps0, "rows": eng.verify_tokens - rows0}

    def generate(self, ids: list[int], max_tokens: int) -> dict:
        self.events = []
        eng = self.engine
        eng.add_request(GenerationRequest("r", ids, SamplingParams(temperature=self.temperature, max_tokens=max_tokens),
                                          return_spec_stats=True))
        while eng.has_work():
            eng.step()
        fin = next(e for e in self.events if isinstance(e, Finished))
        t = fin.timings
        n = fin.completion_tokens
        st = fin.spec
        out = {"text": "".join(e.text for e in self.events if isinstance(e, TextDelta)), "tokens": n,
               "tok_s": (n - 1) / (t.last_token - t.first_token) if n > 1 and t.last_token > t.first_token else None}
        if st is not None:
            drafted_rounds = st.rounds - st.gated_rounds
            out.update(rounds=st.rounds, emitted=st.emitted, verified=st.verified, accepted=st.accepted,
                       first_accepted=(st.accepted_per_position or [0])[0], gated_rounds=st.gated_rounds,
                       drafted_rounds=drafted_rounds)
        return out


def steady_rate(stamped: list[tuple[float, str, object]]) -> float | None:
    """Tokens per second while every request of a batch was decoding.

    ``stamped``: ``(time s, request id, event)`` in emission order. The window runs from the
    last request's first token (exclusive) to the first :class:`Finished` (inclusive); the
    tokens of the :class:`TextDelta` events inside it are counted. ``None`` when the window is
    empty (a request finished before another started decoding)."""
    firsts: dict[str, float] = {}
    for t, rid, ev in stamped:
        if isinstance(ev, TextDelta) and ev.num_tokens:
            firsts.setdefault(rid, t)
    ends = [t for t, _, ev in stamped if isinstance(ev, Finished)]
    if not firsts or not ends:
        return None
    start, end = max(firsts.values()), min(ends)
    if end <= start:
        return None
    return sum(ev.num_tokens for t, _, ev in stamped if isinstance(ev, TextDelta) and start < t <= end) / (end - start)


def summarise(rows: list[dict], base: list[dict]) -> dict:
    speeds = [r["tok_s"] for r in rows if r["tok_s"]]
    res = {"requests": len(rows), "tok_s_p50": round(statistics.median(speeds), 1) if speeds else None,
           "texts_equal": sum(a["text"] == b["text"] for a, b in zip(rows, base))}
    ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(rows, base) if a["tok_s"] and b["tok_s"]]
    if ratios:
        res["vs_plain_p50"] = round(statistics.median(ratios), 3)
    if "rounds" in rows[0]:
        rounds = sum(r["rounds"] for r in rows)
        verified_rounds = sum(r["drafted_rounds"] for r in rows)
        res.update(tau=round(sum(r["emitted"] for r in rows) / max(rounds, 1), 3),
                   a1=round(sum(r["first_accepted"] for r in rows) / max(verified_rounds, 1), 3),
                   acceptance=round(sum(r["accepted"] for r in rows) / max(sum(r["verified"] for r in rows), 1), 3),
                   plain_round_share=round(sum(r["gated_rounds"] for r in rows) / max(rounds, 1), 3))
    return res


def concurrent(args, configs: list[str], runners: dict, tok) -> int:
    """``--concurrency`` c > 1: per batch of c fresh prompts (from ``--tasks`` in turn), every
    config in rotated order; per config the median over batches and the per-batch ratio to plain."""
    pool = [t for task in args.tasks for t in first_turns(task)]
    rows: dict[str, list[dict]] = {c: [] for c in configs}
    for b in range(args.batches):
        texts = pool[b * args.concurrency : (b + 1) * args.concurrency]
        ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False) for t in texts]
        for c in configs[b % len(configs):] + configs[: b % len(configs)]:
            rows[c].append(runners[c].generate_batch(ids, args.max_tokens))
    out = {"concurrency": args.concurrency, "temperature": args.temperature, "batches": args.batches, "max_tokens": args.max_tokens, "configs": {}}
    for c in configs:
        r = rows[c]
        steady = [x["steady_tok_s"] for x in r if x["steady_tok_s"]]  # None: no window in that batch
        out["configs"][c] = {
            "aggregate_tok_s_p50": round(statistics.median(x["aggregate_tok_s"] for x in r), 1),
            "per_user_p50": round(statistics.median(x["per_user_p50"] for x in r), 1),
            "aggregate_vs_plain": [round(x["aggregate_tok_s"] / y["aggregate_tok_s"], 3) for x, y in zip(r, rows["none"])],
            "steady_tok_s_p50": round(statistics.median(steady), 1) if steady else None,
            "steady_vs_plain": [round(x["steady_tok_s"] / y["steady_tok_s"], 3) if x["steady_tok_s"] and y["steady_tok_s"]
                                else None for x, y in zip(r, rows["none"])],
            "rows_per_round": round(sum(x["rows"] for x in r) / max(sum(x["rounds"] for x in r), 1), 2),
        }
    print(json.dumps(out, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", nargs="+", default=["mt-bench", "gsm8k", "humaneval", "mbpp", "math500"])
    ap.add_argument("--per-task", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: texts differ, texts_equal is not a check")
    ap.add_argument("--concurrency", type=int, default=1,
                    help="> 1: batches of this many prompts at once (EOS ignored), aggregate and per-user tok/s")
    ap.add_argument("--batches", type=int, default=3, help="with --concurrency: interleaved batches per config")
    args = ap.parse_args(argv)
    dtype = resolve_dtype(args.dtype)
    configs = ["none"] + [c for c in args.configs if c != "none"]
    first = Runner(engine_config(configs[0], dtype, args.gamma, args.concurrency), temperature=args.temperature)
    runners = {configs[0]: first}
    for c in configs[1:]:
        runners[c] = Runner(engine_config(c, dtype, args.gamma, args.concurrency), model=first.engine.model, tokenizer=first.engine.tokenizer,
                            temperature=args.temperature)
    tok = first.engine.tokenizer
    for r in runners.values():  # warm-up: kernel builds, first-call costs (prompt not measured)
        r.generate(tok.encode("Hello!", add_special_tokens=False), 8)
    if args.concurrency > 1:
        return concurrent(args, configs, runners, tok)
    results: dict[str, dict[str, list[dict]]] = {c: {} for c in configs}
    t0 = time.time()
    for task in args.tasks:
        turns = first_turns(task)[: args.per_task]
        for i, text in enumerate(turns):
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     tokenize=False), add_special_tokens=False)
            order = configs[i % len(configs):] + configs[: i % len(configs)]
            for c in order:
                results[c].setdefault(task, []).append(runners[c].generate(ids, args.max_tokens))
    out = {"dtype": dtype, "gamma": args.gamma, "temperature": args.temperature, "max_tokens": args.max_tokens, "per_task": args.per_task,
           "wall_s": round(time.time() - t0, 1), "tasks": {}}
    for task in args.tasks:
        base = results["none"][task]
        out["tasks"][task] = {c: summarise(results[c][task], base) for c in configs}
    allrows = {c: [r for t in args.tasks for r in results[c][t]] for c in configs}
    out["all"] = {c: summarise(allrows[c], allrows["none"]) for c in configs}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
