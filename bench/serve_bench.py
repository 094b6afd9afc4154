"""Serving benchmark: per-user decode tok/s and TTFT at several concurrencies.

Starts a Sparkgate server (real model, SQLite in a temp dir) unless ``--base-url``
is given, drives closed-loop streaming clients (greedy, ``--max-tokens`` tokens,
``ignore_eos`` so every request decodes the same length) with first-turn prompts
from the shipped eval sets (``--tasks``, default mt-bench then gsm8k then humaneval, from
``--eval-dir``), and prints one JSON document. With ``--hf-baseline`` it also measures plain
transformers ``model.generate`` (batch 1, same dtype) in the same run.

Hygiene (issue 28 item 6), shared with ``bench/llama_race.py`` and ``bench/frontier.py``:

* **No prompt is sent twice to one server.** :func:`plan_prompts` cuts the prompt pool into
  the warm-up prompts and one disjoint block per concurrency level (per round, per
  temperature in the scripts that have them), so the server's prefix cache never serves a
  measured prompt from an earlier level. What disjoint prompts still share is the chat
  template's system prompt (one 16-token block) and HumanEval's fixed instruction line, the
  same for every server; ``--no-prefix-cache`` (``SPARKGATE_PREFIX_CACHE_BLOCKS=0``, an
  :class:`runtime.config.EngineConfig` field) removes even that.
* **One warm-up, the same for everyone**: ``--warmup`` requests of ``--warmup-tokens``
  tokens, one after another, right after the server is ready, on prompts that are never
  measured (before 2026-12 every level re-sent its first measured prompt as warm-up).
* **Tokens counted one way** (:func:`one_request`): the ``usage`` chunk's
  ``completion_tokens``; a server without usage → ``max_tokens`` when it finished with
  ``length``, else the number of content chunks (flagged ``tokens_from``).
* **HF baseline decode time excludes its prefill**: timed by a streamer from the first
  generated token to the last (it used to include the second ``generate``'s prefill).

Definitions (the project's one definition, ``runtime.interface.decode_tokens_per_s``):
per-request decode tok/s = (completion_tokens − 1) / (t_last_token − t_first_token);
per-user tok/s at a concurrency = median over that concurrency's requests;
aggregate tok/s = completion tokens / wall time of the whole level (warm-up excluded).

Usage:
    .venv/bin/python bench/serve_bench.py --concurrency 1 4 8 --hf-baseline
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training.evaluate import EVAL_DIR, first_turns  # noqa: E402
from runtime.interface import decode_tokens_per_s  # noqa: E402

#: The eval sets whose first turns make the prompt pool (80 + 1319 + 164 prompts shipped).
TASKS = ("mt-bench", "gsm8k", "humaneval")
#: Server environment that turns the automatic prefix cache off (an ``EngineConfig`` field).
PREFIX_CACHE_OFF = {"SPARKGATE_PREFIX_CACHE_BLOCKS": "0"}
MODEL = "SmolLM2-135M-Instruct"


# -- prompts ---------------------------------------------------------------------------------

def prompt_pool(tasks: Sequence[str] = TASKS, eval_dir: str | Path = EVAL_DIR, mix: bool = False) -> list[str]:
    """First user turns of ``tasks`` (files ``<task>.jsonl[.gz]`` in ``eval_dir``), each text once.

    ``mix=False``: task after task, each in file order (mt-bench's 80 are used first);
    ``mix=True``: one of each task in turn while every task has some left, so any
    contiguous slice of the pool mixes the tasks (then the rest of the longer tasks).

    Raises:
        FileNotFoundError: a task has no file in ``eval_dir``.
    """
    lists = [first_turns(t, eval_dir) for t in tasks]
    if mix:
        order = [lst[i] for i in range(max(map(len, lists), default=0)) for lst in lists if i < len(lst)]
    else:
        order = [p for lst in lists for p in lst]
    return list(dict.fromkeys(order))


@dataclass
class PromptPlan:
    """Warm-up prompts and one block of measured prompts per key; no text is in two places."""

    warmup: list[str]
    blocks: dict[Hashable, list[str]] = field(default_factory=dict)


def plan_prompts(pool: Sequence[str], warmup: int, blocks: Sequence[tuple[Hashable, int]]) -> PromptPlan:
    """Cut ``pool`` into ``warmup`` warm-up prompts, then one block of ``n`` prompts per
    ``(key, n)`` of ``blocks``, in that order; duplicate texts in ``pool`` count once, so
    the warm-up and the blocks are pairwise disjoint (no prefix-cache reuse between them
    beyond a common prefix of different texts).

    Keys name a measurement, e.g. ``(temperature, concurrency, round)``; callers give the
    same block to every server of one round (a paired comparison: each server has its own
    cache) or one block per server.

    Raises:
        ValueError: a negative count, a repeated key, or a pool with fewer distinct texts
            than ``warmup + Σ n`` (the message says how many are needed).
    """
    sizes = [warmup, *(n for _, n in blocks)]
    if any(n < 0 for n in sizes):
        raise ValueError(f"prompt counts must be >= 0, got {sizes}")
    keys = [k for k, _ in blocks]
    if len(set(keys)) != len(keys):
        raise ValueError(f"repeated block keys in {keys}")
    distinct = list(dict.fromkeys(pool))
    need = sum(sizes)
    if need > len(distinct):
        raise ValueError(f"the plan needs {need} distinct prompts ({warmup} warm-up + {need - warmup} measured), "
                         f"the pool has {len(distinct)}: fewer rounds/requests, or more --tasks")
    plan = PromptPlan(distinct[:warmup])
    at = warmup
    for key, n in blocks:
        plan.blocks[key] = distinct[at: at + n]
        at += n
    return plan


# -- HTTP clients ----------------------------------------------------------------------------

async def one_request(client: httpx.AsyncClient, prompt: str, max_tokens: int, extra: dict) -> dict:
    """One streamed chat completion, timed at its content chunks (``time.monotonic``, s).

    ``extra`` overrides body fields (``{"temperature": 1}``; a ``None`` value drops the
    field). ``completion_tokens``: the ``usage`` chunk's when the server sends one
    (``tokens_from`` ``"usage"``), else ``max_tokens`` when the request finished with
    ``length`` (``"length"``), else the number of content chunks (``"chunks"``) — one rule
    for every server, since a speculative server puts several tokens in one chunk.

    Raises:
        httpx.HTTPStatusError: a non-2xx answer.
    """
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    body = {k: v for k, v in body.items() if v is not None}  # extra may drop a field: {"ignore_eos": None}
    t0 = time.monotonic()
    t_first = t_last = None
    usage = finish = None
    chunks = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices", []):
                finish = ch.get("finish_reason") or finish
                if ch.get("delta", {}).get("content"):
                    chunks += 1
                    now = time.monotonic()
                    t_first = t_first or now
                    t_last = now
    n, source = count_tokens(usage, finish, chunks, max_tokens)
    return {
        "ttft_s": (t_first - t0) if t_first else None,
        "completion_tokens": n,
        "tokens_from": source,
        "decode_tokens_per_s": decode_tokens_per_s(n, t_first, t_last),
        "e2e_s": time.monotonic() - t0,
    }


def count_tokens(usage: dict | None, finish: str | None, chunks: int, max_tokens: int) -> tuple[int, str]:
    """``(completion tokens, source)`` by :func:`one_request`'s rule (also used in-process)."""
    if usage and usage.get("completion_tokens") is not None:
        return int(usage["completion_tokens"]), "usage"
    if finish == "length":
        return max_tokens, "length"
    return chunks, "chunks"


async def warm_up(base_url: str, key: str, prompts: Sequence[str], max_tokens: int, extra: dict,
                  model: str = MODEL) -> None:
    """The warm-up every server gets: ``prompts`` one after another, ``max_tokens`` each."""
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=600) as client:
        for p in prompts:
            await one_request(client, p, max_tokens, {"model": model, **extra})


async def run_level(base_url: str, key: str, prompts: list[str], concurrency: int, rounds: int, max_tokens: int,
                    extra: dict, model: str = MODEL, warmup_prompts: Sequence[str] = (),
                    warmup_tokens: int = 8) -> dict:
    """``concurrency`` closed-loop clients send ``prompts[: concurrency * rounds]`` (each once);
    :func:`level_summary` of the results. ``warmup_prompts`` are sent first, one after
    another, outside the timing (callers warm a server once, with :func:`warm_up`).

    Raises:
        ValueError: fewer than ``concurrency * rounds`` prompts.
    """
    n = concurrency * rounds
    if len(prompts) < n:
        raise ValueError(f"level c={concurrency} needs {n} prompts, got {len(prompts)}")
    if warmup_prompts:
        await warm_up(base_url, key, warmup_prompts, warmup_tokens, extra, model)
    results: list[dict] = []
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=600) as client:
        queue = list(prompts[:n])
        t0 = time.monotonic()

        async def worker():
            while queue:
                p = queue.pop(0)
                results.append(await one_request(client, p, max_tokens, {"model": model, **extra}))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.monotonic() - t0
    return level_summary(results, concurrency, wall)


def level_summary(results: list[dict], concurrency: int, wall: float) -> dict:
    """One concurrency level's numbers from per-request results (``ttft_s``,
    ``completion_tokens``, ``decode_tokens_per_s``, optional ``tokens_from`` and ``e2e_s``)
    and the level's wall time (seconds).

    ``aggregate_tokens_per_s`` = completion tokens / wall: the level's makespan, so it also
    charges the tail in which clients that are done wait for the last one.
    ``closed_loop_tokens_per_s`` (when every result has ``e2e_s``) = c · Σ tokens / Σ e2e —
    the response-time law X = N / R of a closed loop of N = c clients without think time:
    the throughput while all c clients are busy, without that tail. The two agree when
    requests take equally long; a method whose requests vary more (speculation accepts
    more on some prompts than others) loses ~σ/√(π·n) of makespan at c = 2 with n requests
    per client and a relative spread σ of one request's time, which only the first one
    charges to it."""
    tps = [r["decode_tokens_per_s"] for r in results if r["decode_tokens_per_s"]]
    ttft = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    tokens = sum(r["completion_tokens"] for r in results)
    e2e = [r.get("e2e_s") for r in results]
    closed = (round(concurrency * tokens / sum(e2e), 2)
              if results and all(x is not None and x > 0 for x in e2e) else None)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "per_user_tokens_per_s_p50": round(statistics.median(tps), 2) if tps else None,
        "per_user_tokens_per_s_p10": round(sorted(tps)[len(tps) // 10], 2) if tps else None,
        "aggregate_tokens_per_s": round(tokens / wall, 2),
        "closed_loop_tokens_per_s": closed,
        "ttft_s_p50": round(statistics.median(ttft), 4) if ttft else None,
        "completion_tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_from": sorted({r.get("tokens_from", "engine") for r in results}),
    }


# -- interleaved rounds ----------------------------------------------------------------------

@dataclass
class Served:
    """A started server under test: its address, key, request fields and process."""

    name: str
    base: str
    key: str
    extra: dict = field(default_factory=dict)  # body fields for this server (llama.cpp's EOS bias)
    proc: subprocess.Popen | None = None
    env: dict = field(default_factory=dict)
    model: str = MODEL

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def measure(server: Served, prompts: list[str], concurrency: int, per_client: int, max_tokens: int,
            extra: dict | None = None) -> dict:
    """One level on one server (no warm-up): :func:`run_level` with the server's own fields
    under ``extra`` (e.g. ``{"temperature": 1}``)."""
    body = {**(extra or {}), **server.extra}
    return asyncio.run(run_level(server.base, server.key, prompts, concurrency, per_client, max_tokens, body,
                                 server.model))


def interleaved(servers: Sequence[Served], levels: Sequence[tuple[int, int]], rounds: int, plan: PromptPlan,
                max_tokens: int, temperatures: Sequence[float] = (0.0,), per_server_prompts: bool = False,
                log=None, first_index: int = 0) -> list[dict]:
    """Rounds A, B, C, A, B, C, … (``rounds`` times) at each temperature and each
    ``(concurrency, requests per client)`` of ``levels``, one server at a time; every
    server must be up and warmed. Round ``r`` at ``(T, c)`` sends every server the block
    ``plan.blocks[(T, c, r)]`` (``per_server_prompts``: ``(T, c, r, i)`` for the i-th
    server, counted from ``first_index``) — see :func:`round_keys`. Returns one row per (T, c, r, server):
    :func:`level_summary` plus ``server``, ``round``, ``temperature``."""
    rows = []
    for t in temperatures:
        for c, per_client in levels:
            for r in range(rounds):
                for i, s in enumerate(servers):
                    key = (t, c, r, first_index + i) if per_server_prompts else (t, c, r)
                    row = measure(s, plan.blocks[key], c, per_client, max_tokens, {"temperature": t})
                    rows.append({"server": s.name, "temperature": t, "round": r, **row})
                    if log:
                        log(f"T={t} c={c} round {r} {s.name}: {row['per_user_tokens_per_s_p50']} tok/s per user, "
                            f"{row['aggregate_tokens_per_s']} aggregate")
    return rows


def round_keys(levels: Sequence[tuple[int, int]], rounds: int, temperatures: Sequence[float] = (0.0,),
               n_servers: int = 1, per_server_prompts: bool = False) -> list[tuple[Hashable, int]]:
    """The ``(key, prompts)`` blocks :func:`interleaved` reads, for :func:`plan_prompts`."""
    out = []
    for t in temperatures:
        for c, per_client in levels:
            for r in range(rounds):
                if per_server_prompts:
                    out += [((t, c, r, i), c * per_client) for i in range(n_servers)]
                else:
                    out.append(((t, c, r), c * per_client))
    return out


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def summarize_rounds(rows: list[dict], baseline: str | None) -> list[dict]:
    """Per (server, temperature, concurrency): medians over rounds of per-user p50,
    aggregate and TTFT, and — when ``baseline`` (a server name of this run) is given —
    the median over rounds of the per-round ratios to that server measured in the same
    round (``per_user_vs_baseline``, ``aggregate_vs_baseline``, ``closed_loop_vs_baseline``
    when the rounds have it; every round's ratio in
    ``..._rounds``). A ratio is never taken against a server of another run."""
    base = {(r["temperature"], r["concurrency"], r["round"]): r for r in rows if r["server"] == baseline}
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["server"], r["temperature"], r["concurrency"]), []).append(r)
    out = []
    for (server, t, c), rs in groups.items():
        item = {
            "server": server, "temperature": t, "concurrency": c, "rounds": len(rs),
            "requests": sum(r["requests"] for r in rs),
            "per_user_tokens_per_s_p50": _median([r["per_user_tokens_per_s_p50"] for r in rs]),
            "aggregate_tokens_per_s": _median([r["aggregate_tokens_per_s"] for r in rs]),
            "closed_loop_tokens_per_s": _median([r.get("closed_loop_tokens_per_s") for r in rs]),
            "ttft_s_p50": _median([r["ttft_s_p50"] for r in rs]),
        }
        if baseline is not None and any((t, c, r["round"]) in base for r in rs):
            for metric, name in (("per_user_tokens_per_s_p50", "per_user"), ("aggregate_tokens_per_s", "aggregate"),
                                 ("closed_loop_tokens_per_s", "closed_loop")):
                ratios = []
                for r in rs:
                    b = base.get((t, c, r["round"]))
                    if b and b.get(metric) and r.get(metric) is not None:
                        ratios.append(round(r[metric] / b[metric], 4))
                item[f"{name}_vs_baseline"] = _median(ratios)
                item[f"{name}_vs_baseline_rounds"] = ratios
        out.append(item)
    return out


# -- in-process baseline ---------------------------------------------------------------------

def hf_baseline(prompts: list[str], max_tokens: int, dtype: str, warmup_prompts: Sequence[str] = (),
                warmup_tokens: int = 8) -> dict:
    """transformers ``model.generate`` (eager, batch 1, greedy), one prompt after another.

    Timed by a streamer at every generated token: TTFT = call → first token; decode tok/s =
    (tokens − 1) / (first token → last token), so the prefill is not in the decode time.
    ``warmup_prompts`` run first, untimed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    from runtime.models.loader import ensure_converted

    class Clock(BaseStreamer):
        """generate() puts the prompt first, then each new token: times[1:] are the tokens'."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.monotonic())

        def end(self) -> None:
            pass

    path = ensure_converted()
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()

    def run(p: str, n: int) -> tuple[float, float | None, int]:
        text = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        clock = Clock()
        with torch.inference_mode():
            t0 = time.monotonic()
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, streamer=clock)
        gen = out.shape[1] - ids.shape[1]
        return clock.times[1] - t0, decode_tokens_per_s(gen, clock.times[1], clock.times[-1]), gen

    for p in warmup_prompts:
        run(p, warmup_tokens)
    rows = [run(p, max_tokens) for p in prompts]
    speeds = [s for _, s, _ in rows if s]
    return {
        "engine": "transformers model.generate (eager, batch 1)",
        "dtype": dtype,
        "requests": len(rows),
        "per_user_tokens_per_s_p50": round(statistics.median(speeds), 2) if speeds else None,
        "ttft_s_p50": round(statistics.median(t for t, _, _ in rows), 4),
    }


# -- servers ---------------------------------------------------------------------------------

def start_server(port: int, env_extra: dict) -> tuple[subprocess.Popen, str, str]:
    """A ``uvicorn gateway.main:create_app`` on 127.0.0.1:``port`` with a fresh SQLite
    database and one API key, ``env_extra`` on top of this environment; waits for ``/readyz``.

    Returns:
        ``(process, base URL, API key)``.

    Raises:
        RuntimeError: not ready within 300 s (the process is killed).
    """
    tmp = Path(tempfile.mkdtemp(prefix="sparkgate-bench-"))
    env = {**os.environ, "SPARKGATE_DATABASE_URL": f"sqlite+aiosqlite:///{tmp}/bench.db", "SPARKGATE_PORT": str(port), **env_extra}
    py = sys.executable
    subprocess.run([py, "-m", "gateway.cli", "db", "upgrade"], env=env, check=True, cwd=ROOT)
    out = subprocess.run(
        [py, "-m", "gateway.cli", "keys", "create", "--tenant", "bench"], env=env, check=True, cwd=ROOT, capture_output=True, text=True
    ).stdout
    key = next(w for w in out.split() if w.startswith("sk-"))
    proc = subprocess.Popen(
        [py, "-m", "uvicorn", "gateway.main:create_app", "--factory", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        env=env, cwd=ROOT,
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                return proc, base, key
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become ready")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url")
    ap.add_argument("--key")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--rounds", type=int, default=2, help="requests per client at each level")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--spec-method", default=None, help="server's SPARKGATE_SPEC_METHOD when started here")
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="start the server with the prefix cache off (SPARKGATE_PREFIX_CACHE_BLOCKS=0)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up requests (never measured prompts)")
    ap.add_argument("--warmup-tokens", type=int, default=16)
    ap.add_argument("--hf-baseline", action="store_true")
    ap.add_argument("--hf-requests", type=int, default=4)
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), help="eval sets whose first turns are the prompts")
    ap.add_argument("--eval-dir", default=str(EVAL_DIR), help="holds <task>.jsonl.gz (or .jsonl)")
    args = ap.parse_args()

    blocks = [(c, c * args.rounds) for c in args.concurrency] + ([("hf", args.hf_requests)] if args.hf_baseline else [])
    plan = plan_prompts(prompt_pool(args.tasks, args.eval_dir), args.warmup, blocks)
    proc = None
    env_extra = {"SPARKGATE_DTYPE": args.dtype}
    if args.spec_method:
        env_extra["SPARKGATE_SPEC_METHOD"] = args.spec_method
    if args.no_prefix_cache:
        env_extra.update(PREFIX_CACHE_OFF)
    if args.base_url:
        base, key = args.base_url, args.key
    else:
        proc, base, key = start_server(args.port, env_extra)
    try:
        asyncio.run(warm_up(base, key, plan.warmup, args.warmup_tokens, {}))
        levels = [asyncio.run(run_level(base, key, plan.blocks[c], c, args.rounds, args.max_tokens, {}))
                  for c in args.concurrency]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    report = {
        "benchmark": "serve",
        "model": MODEL,
        "dtype": args.dtype,
        "spec_method": args.spec_method or "server default",
        "prefix_cache": "off" if args.no_prefix_cache else "server default",
        "max_tokens": args.max_tokens,
        "prompts": f"first turns of {', '.join(args.tasks)}; disjoint per level; {args.warmup} warm-up requests of "
                   f"{args.warmup_tokens} tokens on other prompts",
        "cpu_count": os.cpu_count(),
        "sparkgate": levels,
    }
    if args.hf_baseline:
        report["hf_generate"] = hf_baseline(plan.blocks["hf"], args.max_tokens, args.dtype, plan.warmup,
                                            args.warmup_tokens)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
