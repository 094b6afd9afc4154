"""Speculation on vs off, text for text, and what seeded sampling costs it.

Part 1 (``--t0-prompts``, default 100 × ``--t0-max-tokens`` 128 over the six eval sets): at
temperature 0 DSpark's text must equal plain decoding's (row-invariant arithmetic, issue 27);
reports how many are equal. Part 2: accepted length τ at temperature 1, seeded
(Gumbel-max coupling: a draft is accepted iff it equals the target's seeded draw) vs
unseeded (standard rejection sampling), same prompts, same drafter, every draft verified.

Theory (Daliri et al. 2024, arXiv:2408.07978): per position, coupling accepts with
probability ≥ (1−δ)/(1+δ) when the drafter draws with the same noise, rejection sampling
with 1−δ (δ = total variation between draft and target); at T = 0 both are the argmax.
Also checks that every seeded text equals plain decoding's. Prints one JSON document.

    .venv/bin/python bench/seeded_tau.py [--prompts 12] [--max-tokens 64] [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from runtime.config import EngineConfig, resolve_dtype  # noqa: E402
from runtime.engine.llm_engine import LLMEngine  # noqa: E402
from runtime.interface import Finished, GenerationRequest, SamplingParams, TextDelta  # noqa: E402
from training.evaluate import first_turns  # noqa: E402

TASKS = ("mt-bench", "gsm8k", "humaneval", "mbpp", "math500", "alpaca")


def prompts(n: int) -> list[str]:
    """``n`` first turns, spread evenly over the eval sets present (alpaca is fetched
    separately: data/README.md)."""
    sets = []
    for task in TASKS:
        try:
            sets.append(first_turns(task))
        except (OSError, ValueError):
            continue
    per = -(-n // len(sets))
    return [t for turns in sets for t in turns[:per]][:n]


def run(cfg: EngineConfig, texts: list[str], seeded: bool, max_tokens: int, engine=None, temperature: float = 1.0) -> dict:
    done: dict[str, Finished] = {}
    out: dict[str, str] = {}

    def emit(rid, ev):
        if isinstance(ev, TextDelta):
            out[rid] = out.get(rid, "") + ev.text
        elif isinstance(ev, Finished):
            done[rid] = ev

    if engine is None:
        engine = LLMEngine(cfg, emit)
    else:
        engine.emit = emit
    tok = engine.tokenizer
    t0 = time.perf_counter()
    for i, text in enumerate(texts):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False), add_special_tokens=False)
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=1000 + i if seeded else None)
        engine.add_request(GenerationRequest(str(i), ids, params, return_spec_stats=True))
        while engine.has_work():  # one request at a time (c = 1)
            engine.step()
    wall = time.perf_counter() - t0
    stats = [done[k].spec for k in sorted(done, key=int) if done[k].spec is not None]
    rounds = sum(s.rounds for s in stats)
    emitted = sum(s.emitted for s in stats)
    verified = sum(s.verified for s in stats)
    accepted = sum(s.accepted for s in stats)
    tokens = sum(done[k].completion_tokens for k in done)
    return {"texts": [out.get(str(i), "") for i in range(len(texts))], "rounds": rounds,
            "tau": emitted / rounds if rounds else None, "acceptance_rate": accepted / verified if verified else None,
            "completion_tokens": tokens, "tokens_per_s": tokens / wall, "engine": engine}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--t0-prompts", type=int, default=100, help="0 skips part 1")
    ap.add_argument("--t0-max-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    texts = prompts(args.prompts)
    spec = EngineConfig(dtype=args.dtype, spec_method="dspark", spec_policy="fixed", spec_gate=False,
                        num_speculative_tokens=args.gamma, max_batch_size=1, request_timeout_s=3600.0)
    plain = EngineConfig(dtype=args.dtype, max_batch_size=1, request_timeout_s=3600.0)
    res = {"prompts": len(texts), "max_tokens": args.max_tokens, "gamma": args.gamma,
           "dtype": resolve_dtype(args.dtype), "torch_threads": torch.get_num_threads()}
    warm = run(spec, texts[:1], seeded=False, max_tokens=8)  # kernel build, first-call costs
    un = run(spec, texts, seeded=False, max_tokens=args.max_tokens, engine=warm["engine"])
    se = run(spec, texts, seeded=True, max_tokens=args.max_tokens, engine=un.pop("engine"))
    se.pop("engine")
    ar = run(plain, texts, seeded=True, max_tokens=args.max_tokens)
    ar.pop("engine")
    res["unseeded_rejection_sampling"] = {k: v for k, v in un.items() if k != "texts"}
    res["seeded_gumbel_coupling"] = {k: v for k, v in se.items() if k != "texts"}
    res["plain_seeded"] = {k: v for k, v in ar.items() if k != "texts"}
    res["seeded_texts_equal_plain"] = sum(a == b for a, b in zip(se["texts"], ar["texts"]))
    if args.t0_prompts:
        t0 = prompts(args.t0_prompts)
        a = run(plain, t0, seeded=False, max_tokens=args.t0_max_tokens, temperature=0.0)
        b = run(spec, t0, seeded=False, max_tokens=args.t0_max_tokens, temperature=0.0)
        res["t0"] = {"prompts": len(t0), "max_tokens": args.t0_max_tokens,
                     "spec_texts_equal_plain": sum(x == y for x, y in zip(a["texts"], b["texts"])),
                     "plain_tokens_per_s": a["tokens_per_s"], "spec_tokens_per_s": b["tokens_per_s"], "spec_tau": b["tau"]}
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
