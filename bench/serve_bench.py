"""Serving benchmark: per-user decode tok/s and TTFT at several concurrencies.

Starts a Sparkgate server (real model, SQLite in a temp dir) unless ``--base-url``
is given, drives closed-loop streaming clients (greedy, ``--max-tokens`` tokens,
``ignore_eos`` so every request decodes the same length) with first-turn prompts
from the shipped ``data/eval/mt-bench.jsonl.gz`` (``--eval-dir``), and prints one JSON document.
With ``--hf-baseline`` it also measures plain transformers ``model.generate``
(batch 1, same prompts, same dtype) in the same run.

Definitions (the project's one definition, ``runtime.interface.decode_tokens_per_s``):
per-request decode tok/s = (completion_tokens − 1) / (t_last_token − t_first_token);
per-user tok/s at a concurrency = median over that concurrency's requests;
aggregate tok/s = completion tokens / wall time of the whole round.

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
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training.evaluate import EVAL_DIR, first_turns  # noqa: E402
from runtime.interface import decode_tokens_per_s  # noqa: E402


async def one_request(client: httpx.AsyncClient, prompt: str, max_tokens: int, extra: dict) -> dict:
    body = {
        "model": "SmolLM2-135M-Instruct",
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
    usage = None
    chunks = 0  # content chunks: the token count when a server sends no usage
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
                if ch.get("delta", {}).get("content"):
                    chunks += 1
                    now = time.monotonic()
                    t_first = t_first or now
                    t_last = now
    n = usage["completion_tokens"] if usage else chunks
    return {
        "ttft_s": (t_first - t0) if t_first else None,
        "completion_tokens": n,
        "decode_tokens_per_s": decode_tokens_per_s(n, t_first, t_last),
        "e2e_s": time.monotonic() - t0,
    }


async def run_level(base_url: str, key: str, prompts: list[str], concurrency: int, rounds: int, max_tokens: int,
                    extra: dict, model: str = "SmolLM2-135M-Instruct") -> dict:
    headers = {"Authorization": f"Bearer {key}"}
    results: list[dict] = []
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=600) as client:
        # one warm-up request
        await one_request(client, prompts[0], 8, {"model": model, **extra})
        queue = list(prompts[: concurrency * rounds])
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
    ``completion_tokens``, ``decode_tokens_per_s``) and the level's wall time (seconds)."""
    tps = [r["decode_tokens_per_s"] for r in results if r["decode_tokens_per_s"]]
    ttft = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    tokens = sum(r["completion_tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "per_user_tokens_per_s_p50": round(statistics.median(tps), 2) if tps else None,
        "per_user_tokens_per_s_p10": round(sorted(tps)[len(tps) // 10], 2) if tps else None,
        "aggregate_tokens_per_s": round(tokens / wall, 2),
        "ttft_s_p50": round(statistics.median(ttft), 4) if ttft else None,
    }


def hf_baseline(prompts: list[str], max_tokens: int, dtype: str, n: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runtime.models.loader import ensure_converted

    path = ensure_converted()
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
    speeds, ttfts = [], []
    for p in prompts[:n]:
        text = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            t0 = time.monotonic()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            t1 = time.monotonic()
            out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
            t2 = time.monotonic()
        gen = out.shape[1] - ids.shape[1]
        ttfts.append(t1 - t0)
        # decode time excludes the prefill + first token (measured separately above)
        speeds.append((gen - 1) / max(t2 - t0 - (t1 - t0), 1e-9))
    return {
        "engine": "transformers model.generate (eager, batch 1)",
        "dtype": dtype,
        "requests": len(speeds),
        "per_user_tokens_per_s_p50": round(statistics.median(speeds), 2),
        "ttft_s_p50": round(statistics.median(ttfts), 4),
    }


def start_server(port: int, env_extra: dict) -> tuple[subprocess.Popen, str, str]:
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
    ap.add_argument("--hf-baseline", action="store_true")
    ap.add_argument("--hf-requests", type=int, default=4)
    ap.add_argument("--eval-dir", default=str(EVAL_DIR), help="holds mt-bench.jsonl.gz (or .jsonl)")
    args = ap.parse_args()

    prompts = first_turns("mt-bench", args.eval_dir)[:80]
    proc = None
    env_extra = {"SPARKGATE_DTYPE": args.dtype}
    if args.spec_method:
        env_extra["SPARKGATE_SPEC_METHOD"] = args.spec_method
    if args.base_url:
        base, key = args.base_url, args.key
    else:
        proc, base, key = start_server(args.port, env_extra)
    try:
        levels = [asyncio.run(run_level(base, key, prompts, c, args.rounds, args.max_tokens, {})) for c in args.concurrency]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    report = {
        "benchmark": "serve",
        "model": "SmolLM2-135M-Instruct",
        "dtype": args.dtype,
        "spec_method": args.spec_method or "server default",
        "max_tokens": args.max_tokens,
        "prompts": "mt-bench first turns",
        "cpu_count": os.cpu_count(),
        "sparkgate": levels,
    }
    if args.hf_baseline:
        report["hf_generate"] = hf_baseline(prompts, args.max_tokens, args.dtype, args.hf_requests)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
