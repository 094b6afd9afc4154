"""Verification-budget scheduler benchmark: policies × concurrency, Fig. 8 shape, SLA tiers.

Drives the embedded engine (:class:`runtime.engine.llm_engine.LLMEngine`) directly, in-process
and synchronously — no HTTP, so there is no load generator competing for the two
CPU cores and every timing is server-side (the engine's own monotonic timestamps).
Closed-loop clients: at concurrency c, c clients each submit a request, wait for it
to finish and immediately submit the next (``--requests-per-client`` each, capped at
``--max-requests-per-level`` requests per level: by default 2, 8 and 16 requests at
c = 1, 4, 16); a client "reacts" between two engine steps. Requests: first-turn prompts from
the shipped ``data/eval`` (``--eval-dir``; mt-bench, gsm8k, humaneval, round robin; chat template),
``--max-tokens`` completion tokens each with ``ignore_eos`` (every request decodes
the same length).

Per (drafter, policy, temperature, concurrency) it reports
  * per-user decode tok/s p50 and p10 (``runtime.interface.decode_tokens_per_s``:
    (completion − 1) / (t_last − t_first); the first token comes from prefill),
  * aggregate tok/s = completion tokens of the level / wall time of the level,
  * mean verification budget per request per round, 1 + ℓ_r (tokens the target
    verifies for one request in one round, its anchor included; paper Fig. 8), and ℓ_r,
  * acceptance (accepted / verified drafts) and τ (tokens per round, bonus included).

Sweep: greedy for all five policies (fixed, mtp1, threshold, dspark, dspark-sla) and
T = 1 for fixed and dspark, with the DSpark drafter (``--drafter``: the committed /
random-init default, or a checkpoint dir such as the trained candidate); plus the
autoregressive baseline and the prompt-lookup drafter (which always verifies its whole
block: ``fixed``). Mixed tenants (``--mixed``): at ``--mixed-concurrency`` clients, a
gold tier (``sla_target_tokens_per_s`` on the request) and a best-effort tier, dspark
vs dspark-sla; gold target = ``--gold-factor`` × dspark's per-user p50 at that
concurrency in the sweep (or ``--gold-target``).

The SPS table is the engine's own profile (``profile_on_start``: cached, else profiled
once at the first DSpark engine; its cost is reported). Prints one JSON document and
writes a PNG (``--png``, default docs/reports/scheduler_bench.png).

Usage:
    .venv/bin/python bench/scheduler_bench.py                  # full run (~10 min, 2 cores)
    .venv/bin/python bench/scheduler_bench.py --drafter runtime/speculation/checkpoints/candidate
    .venv/bin/python bench/scheduler_bench.py --quick          # smoke: c = 1, 4; 8 tokens
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from runtime.config import EngineConfig  # noqa: E402
from training.evaluate import EVAL_DIR, first_turns  # noqa: E402
from runtime.engine.llm_engine import DTYPES, LLMEngine, load_tokenizer  # noqa: E402
from runtime.interface import Failed, Finished, GenerationRequest, SamplingParams  # noqa: E402

POLICIES = ("fixed", "mtp1", "threshold", "dspark", "dspark-sla")


# ------------------------------------------------------------------ prompts
def load_prompts(tokenizer, n: int, max_prompt_tokens: int, eval_dir=EVAL_DIR) -> list[list[int]]:
    """n chat-templated first-turn prompts, round robin over three eval sets, each cut to
    its last ``max_prompt_tokens`` tokens."""
    sets = [first_turns(name, eval_dir) for name in ("mt-bench", "gsm8k", "humaneval")]
    out = []
    for i in range(n):
        text = sets[i % 3][i // 3]
        s = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        out.append(tokenizer.encode(s, add_special_tokens=False)[-max_prompt_tokens:])
    return out


# ------------------------------------------------------------ closed loop
@dataclass
class Client:
    """One closed-loop client: sends ``requests`` requests one after the other."""

    tier: str = "default"
    sla_target: float | None = None
    requests: int = 2
    sent: int = 0


@dataclass
class Collector:
    finished: list[tuple[str, object]] = field(default_factory=list)

    def __call__(self, rid: str, ev) -> None:
        if isinstance(ev, (Finished, Failed)):
            self.finished.append((rid, ev))


def drive(engine: LLMEngine, col: Collector, clients: list[Client], prompts: list[list[int]], *,
          max_tokens: int, temperature: float, seed: int) -> dict:  # fmt: skip
    """Run the closed loop to completion; per-request records and the level's wall time (s)."""
    owner: dict[str, tuple[int, float]] = {}
    records: list[dict] = []
    k = 0

    def submit(ci: int) -> None:
        nonlocal k
        c = clients[ci]
        rid = f"c{ci}-r{c.sent}"
        c.sent += 1
        sp = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=seed + k)
        engine.add_request(GenerationRequest(rid, prompts[k % len(prompts)], sp, sla_target_tokens_per_s=c.sla_target))
        owner[rid] = (ci, time.perf_counter())
        k += 1

    col.finished.clear()
    steps0, dsteps0, vtok0 = engine.forward_steps, getattr(engine, "decode_steps", 0), getattr(engine, "verify_tokens", 0)
    t0 = time.perf_counter()
    for ci in range(len(clients)):
        submit(ci)
    while engine.has_work():
        engine.step()
        for rid, ev in col.finished:
            ci, _ = owner[rid]
            if isinstance(ev, Failed):
                raise RuntimeError(f"{rid} failed: {ev.message}")
            sp = ev.spec
            records.append({
                "tier": clients[ci].tier,
                "completion_tokens": ev.completion_tokens,
                "decode_tokens_per_s": ev.decode_tokens_per_s,
                "ttft_s": (ev.timings.first_token - ev.timings.queued) if ev.timings.first_token else None,
                "rounds": sp.rounds if sp else 0, "verified": sp.verified if sp else 0,
                "accepted": sp.accepted if sp else 0, "emitted": sp.emitted if sp else 0,
            })  # fmt: skip
            if clients[ci].sent < clients[ci].requests:
                submit(ci)
        col.finished.clear()
    wall = time.perf_counter() - t0
    return {
        "records": records,
        "wall_s": wall,
        "forward_steps": engine.forward_steps - steps0,
        "decode_steps": getattr(engine, "decode_steps", 0) - dsteps0,
        "verify_tokens": getattr(engine, "verify_tokens", 0) - vtok0,
    }


def pct(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]) of a non-empty list, else None."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))]


def summarise(records: list[dict], wall: float | None = None) -> dict:
    tps = [r["decode_tokens_per_s"] for r in records if r["decode_tokens_per_s"]]
    rounds = sum(r["rounds"] for r in records)
    verified = sum(r["verified"] for r in records)
    out = {
        "requests": len(records),
        "per_user_tok_s_p50": round(statistics.median(tps), 2) if tps else None,
        "per_user_tok_s_p10": round(pct(tps, 0.10), 2) if tps else None,
        "budget_per_request": round(1 + verified / rounds, 3) if rounds else 1.0,
        "drafts_verified_per_request": round(verified / rounds, 3) if rounds else 0.0,
        "acceptance": round(sum(r["accepted"] for r in records) / verified, 4) if verified else None,
        "tau": round(sum(r["emitted"] for r in records) / rounds, 3) if rounds else None,
        "ttft_s_p50": round(pct([r["ttft_s"] for r in records], 0.5), 4) if records else None,
    }
    if wall is not None:
        out["aggregate_tok_s"] = round(sum(r["completion_tokens"] for r in records) / wall, 2)
        out["wall_s"] = round(wall, 2)
    return out


# ------------------------------------------------------------------ engines
class Bench:
    def __init__(self, args) -> None:
        from runtime.models.llama import load_llama
        from runtime.models.loader import ensure_converted

        self.args = args
        if args.threads > 0:
            torch.set_num_threads(args.threads)
        model_dir = ensure_converted()
        self.model = load_llama(model_dir, DTYPES[args.dtype])
        self.tokenizer = load_tokenizer(model_dir)
        n = max(args.concurrency + [args.mixed_concurrency]) * args.requests_per_client + 4
        self.prompts = load_prompts(self.tokenizer, n, args.max_prompt_tokens, args.eval_dir)
        self.sps_table = None
        self.sps_profile_s = None

    def engine(self, method: str, policy: str, drafter: str | None) -> tuple[LLMEngine, Collector]:
        col = Collector()
        cfg = EngineConfig(
            dtype=self.args.dtype, max_batch_size=max(self.args.concurrency + [self.args.mixed_concurrency]),
            max_context=1024, spec_method=method, spec_policy=policy, num_speculative_tokens=self.args.gamma,
            draft_checkpoint=drafter, num_threads=self.args.threads, profile_on_start=method == "dspark", seed=0,
            spec_gate=self.args.spec_gate,
        )  # fmt: skip
        t0 = time.perf_counter()
        engine = LLMEngine(cfg, col, model=self.model, tokenizer=self.tokenizer)
        if method == "dspark" and self.sps_table is None:
            self.sps_table = engine.speculator.sps_table.to_dict()
            self.sps_profile_s = round(time.perf_counter() - t0, 1)
        # warm-up: one short request (first-call allocations, kernel selection)
        drive(engine, col, [Client(requests=1)], self.prompts, max_tokens=4, temperature=0.0, seed=10**6)
        return engine, col

    def sweep_config(self, method: str, policy: str, temperature: float, drafter: str | None, label: str) -> dict:
        engine, col = self.engine(method, policy, drafter)
        levels = []
        for c in self.args.concurrency:
            per_client = max(1, min(self.args.requests_per_client, self.args.max_requests_per_level // c))
            clients = [Client(requests=per_client) for _ in range(c)]
            res = drive(engine, col, clients, self.prompts, max_tokens=self.args.max_tokens, temperature=temperature, seed=c * 1000)
            s = summarise(res["records"], res["wall_s"])
            s["concurrency"] = c
            s["mean_B_per_round"] = round(res["verify_tokens"] / res["decode_steps"], 2) if res["decode_steps"] else None
            levels.append(s)
            log(f"{label:28s} T={temperature:g} c={c:<3d} p50 {s['per_user_tok_s_p50']} agg {s['aggregate_tok_s']} "
                f"budget {s['budget_per_request']} acc {s['acceptance']} wall {s['wall_s']}s")  # fmt: skip
        del engine
        gc.collect()
        return {"drafter": label, "spec_method": method, "policy": policy, "temperature": temperature, "levels": levels}

    def mixed(self, policy: str, drafter: str | None, gold_target: float) -> dict:
        a = self.args
        engine, col = self.engine("dspark", policy, drafter)
        clients = [Client("gold", gold_target, a.requests_per_client) for _ in range(a.gold_clients)]
        clients += [Client("best-effort", None, a.requests_per_client) for _ in range(a.mixed_concurrency - a.gold_clients)]
        res = drive(engine, col, clients, self.prompts, max_tokens=a.max_tokens, temperature=0.0, seed=777)
        out = {"policy": policy, "all": summarise(res["records"], res["wall_s"])}
        for tier in ("gold", "best-effort"):
            recs = [r for r in res["records"] if r["tier"] == tier]
            out[tier] = summarise(recs)
            if tier == "gold":
                tps = [r["decode_tokens_per_s"] or 0.0 for r in recs]
                out[tier]["met_fraction"] = round(sum(t >= gold_target for t in tps) / len(tps), 3)
        log(f"mixed {policy:10s} gold p50 {out['gold']['per_user_tok_s_p50']} (target {gold_target:.2f}, budget "
            f"{out['gold']['budget_per_request']}) best-effort p50 {out['best-effort']['per_user_tok_s_p50']} "
            f"(budget {out['best-effort']['budget_per_request']}) agg {out['all']['aggregate_tok_s']}")  # fmt: skip
        del engine
        gc.collect()
        return out


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def level(sweep: list[dict], drafter: str, policy: str, temperature: float, c: int) -> dict | None:
    for cfg in sweep:
        if cfg["drafter"] == drafter and cfg["policy"] == policy and cfg["temperature"] == temperature:
            for lv in cfg["levels"]:
                if lv["concurrency"] == c:
                    return lv
    return None


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = report["sweep"]
    drafters = [d for d in dict.fromkeys(c["drafter"] for c in sweep if c["spec_method"] == "dspark")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    marks = {"fixed": "s", "mtp1": "v", "threshold": "^", "dspark": "o", "dspark-sla": "D"}
    colors = {"fixed": "C0", "mtp1": "C1", "threshold": "C2", "dspark": "C3", "dspark-sla": "C4"}
    for di, d in enumerate(drafters):
        ls = ("-", "--", "-.")[di % 3]
        for cfg in sweep:
            if cfg["drafter"] != d or cfg["temperature"] != 0.0:
                continue
            xs = [lv["concurrency"] for lv in cfg["levels"]]
            kw = dict(marker=marks.get(cfg["policy"], "x"), color=colors.get(cfg["policy"]), label=f"{cfg['policy']} ({d})")
            small = cfg["policy"] == "dspark-sla"  # usually on top of dspark: draw it smaller
            kw.update(markersize=4 if small else 6, alpha=0.8)
            axes[0].plot(xs, [lv["budget_per_request"] for lv in cfg["levels"]], ls, **kw)
            axes[1].plot(xs, [lv["aggregate_tok_s"] for lv in cfg["levels"]], ls, **kw)
    for cfg, col in zip([c for c in sweep if c["spec_method"] in ("none", "prompt_lookup") and c["temperature"] == 0.0], ("k", "C5")):
        xs = [lv["concurrency"] for lv in cfg["levels"]]
        axes[1].plot(xs, [lv["aggregate_tok_s"] for lv in cfg["levels"]], ":", marker="x", color=col, label=cfg["drafter"])
        if cfg["spec_method"] == "prompt_lookup":
            axes[0].plot(xs, [lv["budget_per_request"] for lv in cfg["levels"]], ":", marker="x", color=col, label="prompt_lookup (fixed)")
    axes[0].set(xscale="log", xlabel="concurrency (closed-loop clients)", ylabel="verification budget / request / round (1 + ℓ)",
                title="Verification budget vs load (cf. paper Fig. 8)")  # fmt: skip
    axes[1].set(xscale="log", xlabel="concurrency", ylabel="aggregate tok/s", title="Aggregate throughput (greedy)")
    for ax in axes:
        ax.set_xticks(report["settings"]["concurrency"], [str(c) for c in report["settings"]["concurrency"]])
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    fig.suptitle(f"SmolLM2-135M, {report['settings']['dtype']}, {report['settings']['threads']} threads, "
                 f"γ={report['settings']['gamma']}, {report['settings']['max_tokens']} tokens/request", fontsize=9)  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-requests-per-level", type=int, default=16,
                    help="cap: requests per client = min(--requests-per-client, this // concurrency), ≥ 1")  # fmt: skip
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--eval-dir", default=str(EVAL_DIR), help="holds mt-bench, gsm8k, humaneval (.jsonl.gz / .jsonl)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--drafter", action="append", default=None,
                    help="DSpark checkpoint dir (repeatable); 'default' = committed/random-init drafter")  # fmt: skip
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--spec-gate", action=argparse.BooleanOptionalAction, default=False,
                    help="speculation gate (runtime/speculation/gate.py); off: every round drafts, so the policies are compared")
    ap.add_argument("--no-t1", action="store_true", help="skip the T=1 runs")
    ap.add_argument("--no-baselines", action="store_true", help="skip autoregressive and prompt-lookup runs")
    ap.add_argument("--mixed", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--mixed-concurrency", type=int, default=16)
    ap.add_argument("--gold-clients", type=int, default=4)
    ap.add_argument("--gold-factor", type=float, default=1.2)
    ap.add_argument("--gold-target", type=float, default=None, help="tok/s; overrides --gold-factor")
    ap.add_argument("--png", default=str(ROOT / "docs" / "reports" / "scheduler_bench.png"))
    ap.add_argument("--quick", action="store_true", help="smoke run: c = 1 4, 8 tokens, 1 request/client")
    ap.add_argument("--replot", default=None, help="only redraw --png from a saved JSON report")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.png))
        return
    if args.quick:
        args.concurrency, args.max_tokens, args.requests_per_client, args.mixed_concurrency = [1, 4], 8, 1, 4
        args.gold_clients = 1
    drafters = args.drafter or ["default"]
    cand = ROOT / "runtime" / "speculation" / "checkpoints" / "candidate"
    if args.drafter is None and (cand / "config.json").exists():
        drafters.append(str(cand))
    t_start = time.perf_counter()
    bench = Bench(args)
    sweep: list[dict] = []
    for d in drafters:
        path = None if d == "default" else d
        label = "dspark-default" if d == "default" else f"dspark:{Path(d).name}"
        for pol in args.policies:
            sweep.append(bench.sweep_config("dspark", pol, 0.0, path, label))
        if not args.no_t1:
            for pol in ("fixed", "dspark"):
                if pol in args.policies:
                    sweep.append(bench.sweep_config("dspark", pol, 1.0, path, label))
    if not args.no_baselines:
        sweep.append(bench.sweep_config("none", "fixed", 0.0, None, "autoregressive"))
        sweep.append(bench.sweep_config("prompt_lookup", "fixed", 0.0, None, "prompt_lookup"))
        if not args.no_t1:
            sweep.append(bench.sweep_config("prompt_lookup", "fixed", 1.0, None, "prompt_lookup"))
    mixed = []
    if args.mixed:
        for d in drafters:
            path = None if d == "default" else d
            label = "dspark-default" if d == "default" else f"dspark:{Path(d).name}"
            ref = level(sweep, label, "dspark", 0.0, args.mixed_concurrency)
            target = args.gold_target or round(args.gold_factor * (ref["per_user_tok_s_p50"] if ref else 10.0), 2)
            runs = {pol: bench.mixed(pol, path, target) for pol in ("dspark", "dspark-sla")}
            g0, g1 = runs["dspark"]["gold"], runs["dspark-sla"]["gold"]
            a0, a1 = runs["dspark"]["all"]["aggregate_tok_s"], runs["dspark-sla"]["all"]["aggregate_tok_s"]
            mixed.append({
                "drafter": label, "concurrency": args.mixed_concurrency, "gold_clients": args.gold_clients,
                "gold_target_tok_s": target, "runs": runs,
                "gold_p50_dspark": g0["per_user_tok_s_p50"], "gold_p50_dspark_sla": g1["per_user_tok_s_p50"],
                "aim_gold_met_under_sla_missed_under_dspark": bool(
                    (g1["per_user_tok_s_p50"] or 0) >= target > (g0["per_user_tok_s_p50"] or 0)),
                "aggregate_ratio_sla_over_dspark": round(a1 / a0, 3) if a0 else None,
                "aim_aggregate_within_10pct": bool(a0 and a1 >= 0.9 * a0),
            })  # fmt: skip
    aims = {}
    for d in dict.fromkeys(c["drafter"] for c in sweep if c["spec_method"] == "dspark"):
        hi, lo = max(args.concurrency), min(args.concurrency)
        r_hi = [level(sweep, d, p, 0.0, hi) for p in ("dspark", "fixed")]
        r_lo = [level(sweep, d, p, 0.0, lo) for p in ("dspark", "fixed")]
        if all(r_hi) and all(r_lo):
            x_hi = r_hi[0]["aggregate_tok_s"] / r_hi[1]["aggregate_tok_s"]
            x_lo = r_lo[0]["aggregate_tok_s"] / r_lo[1]["aggregate_tok_s"]
            aims[d] = {
                f"dspark_over_fixed_aggregate_c{hi}": round(x_hi, 3), f"aim_ge_1.2_at_c{hi}": x_hi >= 1.2,
                f"dspark_over_fixed_aggregate_c{lo}": round(x_lo, 3), f"aim_ge_1.0_at_c{lo}": x_lo >= 1.0,
            }  # fmt: skip
    report = {
        "benchmark": "scheduler",
        "model": "SmolLM2-135M-Instruct",
        "driver": "in-process LLMEngine, synchronous closed loop, server-side timings (no HTTP)",
        "settings": {
            "dtype": args.dtype, "threads": torch.get_num_threads(), "gamma": args.gamma,
            "max_tokens": args.max_tokens, "requests_per_client": args.requests_per_client,
            "max_requests_per_level": args.max_requests_per_level,
            "requests_per_level": {c: c * max(1, min(args.requests_per_client, args.max_requests_per_level // c))
                                   for c in args.concurrency},
            "concurrency": args.concurrency, "prompts": "mt-bench/gsm8k/humaneval first turns, chat template",
            "ignore_eos": True, "cpu_count": os.cpu_count(), "load_avg_at_start": os.getloadavg(),
        },  # fmt: skip
        "sps_table": bench.sps_table,
        "sps_startup_s": bench.sps_profile_s,
        "sweep": sweep,
        "mixed_tenants": mixed,
        "aims": aims,
        "total_runtime_s": round(time.perf_counter() - t_start, 1),
    }
    report["settings"]["load_avg_at_end"] = os.getloadavg()
    if args.png:
        plot(report, Path(args.png))
        report["png"] = str(Path(args.png).resolve().relative_to(ROOT)) if Path(args.png).resolve().is_relative_to(ROOT) else args.png
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
