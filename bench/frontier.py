"""Frontier: per-user vs aggregate decode tok/s over concurrency, one line per method
(issue 28 item 9; the DSpark paper's Fig. 1 and 8).

One Sparkgate server per method (``--methods``, the strings of ``bench/llama_race.py``:
``METHOD[/POLICY][-eager][-nogate][@DIR]``, e.g. ``none``, ``dspark`` (the served default
policy, ``dspark-sla``), ``dspark/dspark`` (Alg. 1 with w ≡ 1), ``dspark-sla``, ``fixed``,
``mtp1``, ``threshold``, ``prompt_lookup``, ``hybrid`` — an unknown method is passed to
``SPARKGATE_SPEC_METHOD`` as is), all started once at the beginning, each on its own port,
one after another, and warmed identically (``--warmup`` requests of ``--warmup-tokens``
tokens on prompts never measured). Then, for every ``--temperature`` and every concurrency
c of ``--concurrency``, ``--interleave`` rounds go A, B, C, A, B, C, …: one server at a time
(the machine's cores are not shared between servers; the idle ones sit in their 50 ms idle
wait), c closed-loop streaming clients (``bench/serve_bench.py``) sending ``c × --requests``
requests of ``--max-tokens`` tokens with EOS ignored. Each round has a fresh block of
prompts, first turns of mt-bench, gsm8k and humaneval taken in turn (``--tasks``), the same
block for every server in the round (a paired comparison; ``--per-method-prompts`` gives
each its own), so no server sees a prompt twice (``--no-prefix-cache`` also turns the
prefix cache off: ``SPARKGATE_PREFIX_CACHE_BLOCKS=0``).

Per round and server: per-user tok/s = median over requests of (completion tokens − 1) /
(last token − first token), completion tokens from the ``usage`` chunk; aggregate tok/s =
completion tokens / the round's wall time. Per method, temperature and c: the medians over
rounds, and — when ``none`` is among the methods — the median of the per-round ratios to AR
measured in the same round (every ratio is listed too).

Prints one JSON document with every round; ``--png`` draws per-user (y) against aggregate
(x), one line per method through c = 1 … 16, one panel per temperature, with the CPU model
and its kernel-relevant flags (``runtime.config.cpu_flags``) in the title.

Usage (minutes per method and temperature on 2 cores)::

    .venv/bin/python bench/frontier.py --methods none mtp1 fixed threshold dspark prompt_lookup \\
        --interleave 3 --png docs/reports/frontier.png > docs/reports/frontier.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from training.evaluate import EVAL_DIR  # noqa: E402
from serve_bench import MODEL, TASKS, interleaved, plan_prompts, prompt_pool, round_keys, summarize_rounds  # noqa: E402
from llama_race import baseline_name, log, method_env, start_sparkgate, warmed  # noqa: E402

#: Flags named in the title when the CPU has them: the kernels' ISA and its neighbours.
TITLE_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
               "amx_tile", "amx_bf16", "amx_int8", "bf16", "asimd", "sve")


def cpu_description(cpuinfo: str | None = None) -> dict:
    """``{"model": CPU model name or None, "flags": TITLE_FLAGS it has, "count": os.cpu_count()}``
    from ``/proc/cpuinfo`` (``cpuinfo``: its text, for tests)."""
    from runtime.config import cpu_flags

    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            cpuinfo = ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                  if line.startswith("model name")), None)
    have = cpu_flags(cpuinfo)
    return {"model": model, "flags": [f for f in TITLE_FLAGS if f in have], "count": os.cpu_count()}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = report["temperatures"]
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4.6), squeeze=False)
    for ax, t in zip(axes[0], temps):
        for m in report["methods"]:
            pts = sorted((s for s in report["summary"] if s["server"] == m["name"] and s["temperature"] == t),
                         key=lambda s: s["concurrency"])
            pts = [s for s in pts if s["per_user_tokens_per_s_p50"] is not None]
            line, = ax.plot([s["aggregate_tokens_per_s"] for s in pts], [s["per_user_tokens_per_s_p50"] for s in pts],
                            marker="o", label=m["method"])
            for s in pts:
                ax.annotate(f"{s['concurrency']}", (s["aggregate_tokens_per_s"], s["per_user_tokens_per_s_p50"]),
                            textcoords="offset points", xytext=(3, 3), fontsize=7, color=line.get_color())
            rounds = [r for r in report["rounds"] if r["server"] == m["name"] and r["temperature"] == t]
            ax.scatter([r["aggregate_tokens_per_s"] for r in rounds],
                       [r["per_user_tokens_per_s_p50"] or 0 for r in rounds], s=6, alpha=0.3, color=line.get_color())
        ax.set_xlabel("aggregate tok/s")
        ax.set_ylabel("per-user decode tok/s (p50)")
        ax.set_title(f"temperature {t:g}; labels: concurrency")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    cpu = report["cpu"]
    fig.suptitle(f"{MODEL}, {report['max_tokens']} tokens, median of {report['rounds_per_point']} interleaved rounds\n"
                 f"{cpu['model'] or 'CPU'} × {cpu['count']}; flags: {' '.join(cpu['flags']) or 'none of note'}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["none", "mtp1", "fixed", "threshold", "dspark", "prompt_lookup"],
                    help="method strings as in bench/llama_race.py (none, dspark, dspark-sla, fixed, mtp1, threshold, "
                         "prompt_lookup, hybrid, dspark/dspark, …)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--requests", type=int, default=2, help="requests per client in a round (c × this per round)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--interleave", type=int, default=3, metavar="R", help="rounds per method at each (T, c)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up requests per server (never measured prompts)")
    ap.add_argument("--warmup-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--no-prefix-cache", action="store_true", help="servers with SPARKGATE_PREFIX_CACHE_BLOCKS=0")
    ap.add_argument("--per-method-prompts", action="store_true",
                    help="each method its own prompts in a round (default: the same block for all, paired)")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), help="eval sets whose first turns are the prompts")
    ap.add_argument("--eval-dir", default=str(EVAL_DIR))
    ap.add_argument("--png", type=Path, default=None)
    args = ap.parse_args()
    if args.interleave < 1 or args.requests < 1:
        ap.error("--interleave and --requests must be >= 1")

    for spec in args.methods:
        method_env(spec, args.dtype)  # a bad method string fails before any server starts
    levels = [(c, args.requests) for c in args.concurrency]
    plan = plan_prompts(prompt_pool(args.tasks, args.eval_dir, mix=True), args.warmup,
                        round_keys(levels, args.interleave, args.temperature, len(args.methods),
                                   args.per_method_prompts))
    servers = []
    with contextlib.ExitStack() as stack:
        for spec in args.methods:
            servers.append(warmed(stack, start_sparkgate(spec, args.dtype, args.no_prefix_cache), servers,
                                  plan.warmup, args.warmup_tokens))
        rows = interleaved(servers, levels, args.interleave, plan, args.max_tokens, args.temperature,
                           args.per_method_prompts, log)
    base = baseline_name(servers)
    report = {
        "benchmark": "frontier",
        "model": MODEL,
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "temperatures": args.temperature,
        "concurrency": args.concurrency,
        "requests_per_client": args.requests,
        "rounds_per_point": args.interleave,
        "prompts": f"first turns of {', '.join(args.tasks)} in turn; a fresh block per (temperature, c, round)"
                   f"{', per method' if args.per_method_prompts else ', the same for every method'}; "
                   f"{args.warmup} warm-up requests of {args.warmup_tokens} tokens per server on other prompts",
        "prefix_cache": "off" if args.no_prefix_cache else "server default (on)",
        "cpu": cpu_description(),
        "baseline": base,
        "methods": [{"method": spec, "name": s.name, "env": s.env} for spec, s in zip(args.methods, servers)],
        "summary": summarize_rounds(rows, base),
        "rounds": rows,
    }
    if args.png:
        plot(report, args.png)
        report["png"] = str(args.png)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
