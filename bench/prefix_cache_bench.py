"""TTFT with and without automatic prefix caching (runtime/engine/prefix_cache.py).

Two workloads through the in-process engine, one request at a time (concurrency 1,
greedy), each run once with the prefix cache off (``prefix_cache_blocks=0``) and once on
(the default pool):

* ``shared_system_prompt``: N chat requests whose ~600-token system prompt is the same
  and whose user turns differ (mt-bench first turns).
* ``multi_turn``: one conversation (default system prompt) whose every turn resends the
  whole history — previous user turns and the model's own replies.

TTFT is the engine's own timing from the ``Finished`` event: ``first_token − queued``
(seconds), so no HTTP or tokenisation is included. The first request of each workload
is reported apart (it always misses); p50 is over the rest.

    PYTHONPATH=. .venv/bin/python bench/prefix_cache_bench.py [--requests 8] [--turns 6]

Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from runtime.config import EngineConfig
from training.data import read_jsonl
from training.evaluate import task_file
from runtime.engine.llm_engine import LLMEngine, load_tokenizer
from runtime.interface import Finished, GenerationRequest, SamplingParams, TextDelta
from runtime.models.llama import load_target
from runtime.models.loader import ensure_converted

POLICY = [
    "Greet the customer by name when it is known and keep a friendly, professional tone.",
    "Never promise a delivery date that the warehouse system has not confirmed.",
    "Refunds are allowed within thirty days of delivery when the item is unused and in its box.",
    "Opened electronics can be exchanged for the same model only, never refunded.",
    "Escalate any complaint about a safety issue to a human supervisor immediately.",
    "Do not share another customer's order details, even if asked by a family member.",
    "Quote prices only from the current catalogue and say that prices include VAT.",
    "If the customer is angry, acknowledge the problem before you propose a solution.",
    "Offer free shipping on orders above fifty euros within the European Union.",
    "Explain warranty terms plainly: two years for defects, not for accidental damage.",
]


def mt_bench() -> list[list[str]]:
    return [row["turns"] for row in read_jsonl(task_file("mt-bench"))]  # the shipped data/eval


def long_system_prompt(tokenizer, target_tokens: int) -> str:
    lines, i = ["You are the support assistant of Northwind Electronics. Follow these rules:"], 0
    while len(tokenizer.encode("\n".join(lines), add_special_tokens=False)) < target_tokens:
        lines.append(f"Rule {i + 1}: {POLICY[i % len(POLICY)]}")
        i += 1
    return "\n".join(lines)


class Bench:
    def __init__(self, model, tokenizer, dtype: str, prefix_cache_blocks: int | None):
        self.events: dict[str, list] = {}
        kw = {} if prefix_cache_blocks is None else {"prefix_cache_blocks": prefix_cache_blocks}
        cfg = EngineConfig(dtype=dtype, max_batch_size=4, max_context=2048, **kw)
        self.engine = LLMEngine(cfg, lambda rid, ev: self.events.setdefault(rid, []).append(ev),
                                model=model, tokenizer=tokenizer)
        self.tokenizer = tokenizer
        self.n = 0

    def ids(self, messages) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def ask(self, messages, max_tokens: int) -> tuple[float, list[int], int]:
        """→ (TTFT seconds, completion tokens, prompt tokens)."""
        rid = f"r{self.n}"
        self.n += 1
        ids = self.ids(messages)
        self.engine.add_request(GenerationRequest(rid, ids, SamplingParams(temperature=0, max_tokens=max_tokens)))
        while self.engine.has_work():
            self.engine.step()
        fin = self.events[rid][-1]
        assert isinstance(fin, Finished), fin
        toks = [t for e in self.events[rid] if isinstance(e, TextDelta) for t in e.token_ids]
        return fin.timings.first_token - fin.timings.queued, toks, len(ids)

    def counters(self) -> dict:
        pc = self.engine.prefix_cache
        if pc is None:
            return {"enabled": False}
        return {"enabled": True, "prefix_cache_queries": pc.queries, "prefix_cache_hits": pc.hits,
                "hit_rate": round(pc.hit_rate, 3), "evictions": pc.evictions, "pool_blocks": pc.num_blocks,
                "block_size": pc.block_size, "pool_mib": round(pc.nbytes() / 2**20, 1)}


def summarize(ttfts: list[float], prompt_lens: list[int]) -> dict:
    return {"first_request_ttft_ms": round(ttfts[0] * 1e3, 1),
            "ttft_p50_ms": round(statistics.median(ttfts[1:]) * 1e3, 1),
            "ttft_ms": [round(t * 1e3, 1) for t in ttfts], "prompt_tokens": prompt_lens}


def shared_system(model, tokenizer, dtype, blocks, system, questions, max_tokens) -> dict:
    b = Bench(model, tokenizer, dtype, blocks)
    b.ask([{"role": "user", "content": "Hello!"}], 4)  # warm-up (default system prompt, no overlap)
    ttfts, lens = [], []
    for q in questions:
        t, _, n = b.ask([{"role": "system", "content": system}, {"role": "user", "content": q}], max_tokens)
        ttfts.append(t)
        lens.append(n)
    return {**summarize(ttfts, lens), "prefix_cache": b.counters()}


def multi_turn(model, tokenizer, dtype, blocks, turns, max_tokens) -> tuple[dict, list[list[int]]]:
    b = Bench(model, tokenizer, dtype, blocks)
    b.ask([{"role": "user", "content": "Hello!"}], 4)  # warm-up: the default system prompt is cached ("on")
    messages, ttfts, lens, replies = [], [], [], []
    for user in turns:
        messages.append({"role": "user", "content": user})
        t, toks, n = b.ask(messages, max_tokens)
        ttfts.append(t)
        lens.append(n)
        replies.append(toks)
        messages.append({"role": "assistant", "content": tokenizer.decode(toks, skip_special_tokens=True)})
    return {**summarize(ttfts, lens), "prefix_cache": b.counters()}, replies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--system-tokens", type=int, default=600)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=16, help="completion tokens per shared-prompt request")
    ap.add_argument("--turn-tokens", type=int, default=64, help="completion tokens per conversation turn")
    a = ap.parse_args()
    mdir = ensure_converted()
    model = load_target(mdir, a.dtype)  # the engine below applies its thread setup
    dtype = model.serving_dtype
    tokenizer = load_tokenizer(mdir)
    bench = mt_bench()
    system = long_system_prompt(tokenizer, a.system_tokens)
    questions = [t[0] for t in bench[: a.requests]]
    turns = [t for pair in bench[a.requests : a.requests + (a.turns + 1) // 2] for t in pair][: a.turns]
    t0 = time.monotonic()
    out: dict = {"dtype": dtype, "threads": torch.get_num_threads(), "loadavg_start": os.getloadavg()[0],
                 "system_prompt_tokens": len(tokenizer.encode(system, add_special_tokens=False)),
                 "shared_system_prompt": {}, "multi_turn": {}}
    replies = {}
    for name, blocks in (("off", 0), ("on", None)):
        out["shared_system_prompt"][name] = shared_system(model, tokenizer, dtype, blocks, system, questions, a.max_tokens)
        out["multi_turn"][name], replies[name] = multi_turn(model, tokenizer, dtype, blocks, turns, a.turn_tokens)
    for w in ("shared_system_prompt", "multi_turn"):
        off, on = out[w]["off"]["ttft_p50_ms"], out[w]["on"]["ttft_p50_ms"]
        out[w]["ttft_p50_speedup"] = round(off / on, 2)
    out["multi_turn"]["same_replies_on_and_off"] = replies["on"] == replies["off"]
    out["loadavg_end"] = os.getloadavg()[0]
    out["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
