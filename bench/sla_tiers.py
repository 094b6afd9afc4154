"""Can an SLA tier buy speed? Gold vs bronze tenants under ``dspark`` and ``dspark-sla``
(issue 28 item 8; the prediction is docs/scheduler.md §6).

In-process and synchronous (``bench/scheduler_bench.py``'s closed loop: no HTTP client
competing for the two cores; the engine's own timestamps). For every concurrency c of
``--concurrency`` and every one of ``--rounds`` rounds, three engines on one shared model
run the same block of prompts (a fresh block per round, so no engine sees a prompt twice
and the prefix cache never helps), AR first, then the two policies in alternating order
(every engine first decodes one discarded batch of c requests: warm-up at that batch size):

* ``AR`` — plain decoding, c best-effort clients: its per-user p50 sets the round's gold
  target, ``--gold-factor`` × that p50 (tok/s);
* ``dspark`` and ``dspark-sla`` — ``--method`` speculation (the served default proposer,
  ``hybrid``, unless told otherwise) with ``--gold`` gold clients carrying that target
  (``sla_target_tokens_per_s``) and c − gold best-effort clients without one, the gold
  clients spread evenly over the submission order. Both policies
  admit and batch identically (same clients, same prompts, same max batch); only the
  verification budget differs (``dspark`` weighs every request 1, ``dspark-sla`` by tier).

Per round and engine: per-user decode tok/s p50 per tier, the gold requests meeting their
target, aggregate tok/s, drafts verified per request-round per tier. Summary per c and
policy: medians over rounds of gold p50 / AR p50, gold met fraction, best-effort p50 / AR
p50 and aggregate / AR aggregate (each ratio taken within its round), and ``gold_p10_vs_ar``:
the 10th percentile over all gold requests of their speed / their round's AR p50 — the
highest gold target (as a multiple of AR) the policy honours for 90 % of gold requests.

Usage (about 6 minutes at the defaults on 2 cores; ``--dtype bfloat16`` for the bf16 path)::

    .venv/bin/python bench/sla_tiers.py > docs/reports/sla-tiers.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from runtime.config import EngineConfig, resolve_dtype  # noqa: E402
from runtime.engine.llm_engine import DTYPES, LLMEngine, load_tokenizer  # noqa: E402
from scheduler_bench import Client, Collector, drive, load_prompts, log, summarise  # noqa: E402

POLICIES = ("dspark", "dspark-sla")


def run_level(engine: LLMEngine, col: Collector, clients: list[Client], prompts: list[list[int]], args,
              seed: int) -> dict:
    """One closed-loop run; per-tier summaries plus the whole level's aggregate."""
    res = drive(engine, col, clients, prompts, max_tokens=args.max_tokens, temperature=args.temperature, seed=seed)
    out = {"all": summarise(res["records"], res["wall_s"])}
    for tier in ("gold", "best-effort"):
        recs = [r for r in res["records"] if r["tier"] == tier]
        if recs:
            out[tier] = summarise(recs)
            out[tier]["tok_s"] = [round(r["decode_tokens_per_s"] or 0.0, 2) for r in recs]
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--gold", type=int, default=4, help="gold clients at every concurrency")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests-per-client", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--gold-factor", type=float, default=1.15)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--method", default="hybrid", help="speculation method of the two speculative engines")
    ap.add_argument("--dtype", default="auto", help="the served default: gguf where its kernels run")
    args = ap.parse_args()
    args.dtype = resolve_dtype(args.dtype)

    from runtime.models.llama import load_llama
    from runtime.models.loader import ensure_converted

    model_dir = ensure_converted()
    model = load_llama(model_dir, DTYPES[args.dtype])
    tokenizer = load_tokenizer(model_dir)
    per_round = max(args.concurrency) * args.requests_per_client
    pool = load_prompts(tokenizer, per_round * args.rounds * len(args.concurrency) + 4, args.max_prompt_tokens)
    warm_prompt, pool = pool[:4], pool[4:]

    engines = {}
    for name, method, policy in (("AR", "none", "dspark"), *((p, args.method, p) for p in POLICIES)):
        cfg = EngineConfig(dtype=args.dtype, max_batch_size=max(args.concurrency), max_context=1024,
                           spec_method=method, spec_policy=policy, profile_on_start=method != "none", seed=0)
        col = Collector()
        t0 = time.perf_counter()
        engine = LLMEngine(cfg, col, model=model, tokenizer=tokenizer)
        drive(engine, col, [Client(requests=2)], warm_prompt, max_tokens=8, temperature=args.temperature, seed=10**6)
        log(f"{name}: ready in {time.perf_counter() - t0:.1f} s")
        engines[name] = (engine, col)

    levels, block = [], 0
    for c in args.concurrency:
        # warm every engine at this batch size once (first-call allocations at new shapes), discarded
        for name, (engine, col) in engines.items():
            drive(engine, col, [Client(requests=1) for _ in range(c)], warm_prompt, max_tokens=args.max_tokens,
                  temperature=args.temperature, seed=10**6)
        # gold clients spread evenly over the submission order (c = 8: 0, 2, 4, 6): the first
        # requests admitted decode beside the others' prefill chunks, so a tier made of the
        # first clients would be slower than the all-request AR p50 for that reason alone
        gold_slots = {i * c // args.gold for i in range(args.gold)}
        rounds = []
        for r in range(args.rounds):
            prompts = pool[block * per_round : (block + 1) * per_round]
            block += 1
            # AR first (it sets the round's target), then the policies in an order alternating by round
            order = list(POLICIES) if r % 2 == 0 else list(reversed(POLICIES))
            runs = {}
            ar_engine, ar_col = engines["AR"]
            runs["AR"] = run_level(ar_engine, ar_col, [Client("best-effort", None, args.requests_per_client)
                                                       for _ in range(c)], prompts, args, seed=1000 * c + r)
            target = round(args.gold_factor * runs["AR"]["all"]["per_user_tok_s_p50"], 2)
            for name in order:
                clients = [Client("gold", target, args.requests_per_client) if i in gold_slots
                           else Client("best-effort", None, args.requests_per_client) for i in range(c)]
                engine, col = engines[name]
                runs[name] = run_level(engine, col, clients, prompts, args, seed=1000 * c + r)
                gold = runs[name]["gold"]
                gold["met_fraction"] = round(sum(t >= target for t in gold["tok_s"]) / len(gold["tok_s"]), 3)
            ar = runs["AR"]["all"]
            row = {"round": r, "gold_target_tok_s": target, "ar_p50": ar["per_user_tok_s_p50"],
                   "ar_aggregate": ar["aggregate_tok_s"], "runs": runs}
            for name in POLICIES:
                x = runs[name]
                row[name] = {
                    "gold_vs_ar": ratio(x["gold"]["per_user_tok_s_p50"], ar["per_user_tok_s_p50"]),
                    "best_effort_vs_ar": ratio(x["best-effort"]["per_user_tok_s_p50"], ar["per_user_tok_s_p50"]),
                    "aggregate_vs_ar": ratio(x["all"]["aggregate_tok_s"], ar["aggregate_tok_s"]),
                    "gold_met_fraction": x["gold"]["met_fraction"],
                    "gold_drafts_verified": x["gold"]["drafts_verified_per_request"],
                    "best_effort_drafts_verified": x["best-effort"]["drafts_verified_per_request"],
                }
                log(f"c={c} round {r} {name:10s} gold {row[name]['gold_vs_ar']}x AR (met "
                    f"{row[name]['gold_met_fraction']:.0%}, {row[name]['gold_drafts_verified']} drafts/round) "
                    f"bronze {row[name]['best_effort_vs_ar']}x ({row[name]['best_effort_drafts_verified']}) "
                    f"aggregate {row[name]['aggregate_vs_ar']}x")
            rounds.append(row)
        summary = {}
        for name in POLICIES:
            gold_tps = [t for row in rounds for t in row["runs"][name]["gold"]["tok_s"]]
            met = sum(t >= row["gold_target_tok_s"] for row in rounds for t in row["runs"][name]["gold"]["tok_s"])
            summary[name] = {k: median([row[name][k] for row in rounds])
                             for k in ("gold_vs_ar", "best_effort_vs_ar", "aggregate_vs_ar",
                                       "gold_drafts_verified", "best_effort_drafts_verified")}
            summary[name]["gold_met_fraction_all_requests"] = round(met / len(gold_tps), 3)
            # the target this policy honours for 90 % of gold requests: their 10th percentile, each
            # request's speed over its own round's AR p50
            ratios = sorted(t / row["ar_p50"] for row in rounds for t in row["runs"][name]["gold"]["tok_s"])
            summary[name]["gold_p10_vs_ar"] = round(ratios[len(ratios) // 10], 3)
        levels.append({"concurrency": c, "gold": args.gold, "summary": summary, "rounds": rounds})
        gc.collect()

    from frontier import cpu_description  # the CPU line of the other reports

    print(json.dumps({"settings": vars(args), "cpu": cpu_description(), "levels": levels}, indent=1))


if __name__ == "__main__":
    main()
