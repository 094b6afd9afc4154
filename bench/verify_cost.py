"""What the sampling side of a round costs: ``spec_round`` with the C++ verification twin
(``runtime/kernels/cpu/verify_chain.cpp``) against the torch specification, in process.

Two measurements, the backends interleaved (``SPARKGATE_KERNELS`` is read per call: ``auto``
takes the C++ twin once the extension is loaded, ``reference`` the torch path):

* ``rounds``: ``spec_round`` alone per shape R×ℓ (R requests with ℓ drafts each, vocabulary
  49,152, fp32 logits, sampled drafts from a softmax), T = 1, ``--reps`` calls per backend per
  round, the median of the per-round medians; the tokens of both backends are compared on
  every call (``identical``).
* ``engine``: per ``--methods`` entry (``none``: plain decoding; ``hybrid``: the hybrid
  proposer under ``dspark-sla``, profiled at start as served) one engine decoding ``--tokens``
  tokens for batches of c fresh first turns (mt-bench, gsm8k, humaneval in turn, EOS ignored)
  at T = 1 on the served dtype; per batch both backends in turn (order alternating), decode
  tok/s of the batch (completion tokens / the time after the batch's first step), the median
  of the per-batch ratios C++ / torch.

Prints one JSON document.

    .venv/bin/python bench/verify_cost.py [--shapes 1x0 1x1 1x3 2x0 2x2 8x0 16x0] [--batches 6] \\
        [--concurrency 1 8] [--methods none hybrid]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.config import EngineConfig, cpu_flags  # noqa: E402
from runtime.engine.llm_engine import LLMEngine  # noqa: E402
from runtime.interface import GenerationRequest, SamplingParams  # noqa: E402
from runtime.kernels.cpu.gguf_cpu import kernel_available  # noqa: E402
from runtime.speculation.verifier import spec_round  # noqa: E402
from training.data import chat_ids  # noqa: E402
from training.evaluate import first_turns  # noqa: E402

BACKENDS = {"cpp": "auto", "torch": "reference"}
V = 49152


def use(backend: str) -> None:
    os.environ["SPARKGATE_KERNELS"] = BACKENDS[backend]


def round_inputs(R: int, ell: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    D = R * ell
    logits = torch.randn(D + R, V, generator=g) * 3
    p_d = torch.softmax(torch.randn(D, V, generator=g) * 3, -1)
    toks = torch.multinomial(p_d, 1, generator=g).squeeze(-1) if D else torch.zeros(0, dtype=torch.long)
    return logits, p_d, toks


def time_rounds(shapes: list[str], rounds: int, reps: int) -> dict:
    out = {}
    for shape in shapes:
        R, ell = (int(x) for x in shape.split("x"))
        logits, p_d, toks = round_inputs(R, ell, 0)
        params = (torch.ones(R), torch.zeros(R, dtype=torch.long), torch.ones(R))
        per: dict[str, list[float]] = {b: [] for b in BACKENDS}
        identical = True
        for r in range(rounds):
            tokens = {}
            for b in (list(BACKENDS) if r % 2 == 0 else list(BACKENDS)[::-1]):
                use(b)
                times = []
                for k in range(reps + 2):
                    gens = [torch.Generator().manual_seed(1000 * k + i) for i in range(R)]
                    t0 = time.perf_counter()
                    res = spec_round(logits, p_d, toks, [ell] * R, [0] * R, *params, gens)
                    if k >= 2:  # two warm-up calls
                        times.append(time.perf_counter() - t0)
                    tokens.setdefault(b, []).append(res.tokens)
                per[b].append(statistics.median(times))
            identical &= tokens["cpp"] == tokens["torch"]
        ms = {b: round(1e3 * statistics.median(v), 3) for b, v in per.items()}
        out[shape] = {"ms_cpp": ms["cpp"], "ms_torch": ms["torch"], "saved_ms": round(ms["torch"] - ms["cpp"], 3),
                      "identical": identical}
    return out


def ab_engine_rates(eng: LLMEngine, c: int, batches: int, switches: dict[str, Callable[[], None]],
                    tokens: int = 128, temperature: float = 1.0) -> dict[str, list[float]]:
    """Decode tok/s of ``eng`` per switch, interleaved: ``batches`` + 1 batches of ``c`` fresh first
    turns (mt-bench, gsm8k, humaneval in turn; EOS ignored, ``tokens`` each); per batch every
    switch in turn (order reversed on odd batches), each switch run before its share. Rate of a
    batch = completion tokens after its first step / the time they took; batch 0 warms up and is
    not returned. Returns ``{switch: [tok/s per batch]}``."""
    pool = [t for task in ("mt-bench", "gsm8k", "humaneval") for t in first_turns(task)]
    rates: dict[str, list[float]] = {name: [] for name in switches}
    for b in range(batches + 1):
        ids = [chat_ids(eng.tokenizer, t) for t in pool[b * c : (b + 1) * c]]
        for name in (list(switches) if b % 2 == 0 else list(switches)[::-1]):
            switches[name]()
            for i, x in enumerate(ids):
                eng.add_request(GenerationRequest(f"{name}-{b}-{i}", x, SamplingParams(
                    temperature=temperature, max_tokens=tokens, ignore_eos=True)))
            eng.step()  # prefill + first token
            t0 = time.perf_counter()
            while eng.has_work():
                eng.step()
            if b > 0:
                rates[name].append(c * (tokens - 1) / (time.perf_counter() - t0))
    return rates


def time_engine(method: str, concurrency: list[int], batches: int, tokens: int, dtype: str) -> dict:
    out = {}
    for c in concurrency:
        eng = LLMEngine(EngineConfig(dtype=dtype, spec_method=method, max_batch_size=c, prefix_cache_blocks=0,
                                     request_timeout_s=3600.0, profile_on_start=method != "none"),
                        lambda rid, ev: None)
        rates = ab_engine_rates(eng, c, batches, {b: (lambda b=b: use(b)) for b in BACKENDS}, tokens)
        ratios = [a / t for a, t in zip(rates["cpp"], rates["torch"])]
        out[f"c{c}"] = {"tok_s_cpp": round(statistics.median(rates["cpp"]), 1),
                        "tok_s_torch": round(statistics.median(rates["torch"]), 1),
                        "cpp_vs_torch": round(statistics.median(ratios), 3),
                        "cpp_vs_torch_batches": [round(x, 3) for x in ratios]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["1x0", "1x1", "1x3", "2x0", "2x2", "8x0", "16x0"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--methods", nargs="+", default=["none"], help="engines timed: none, hybrid, dspark, …")
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the spec_round timings (the engine uses 1)")
    args = ap.parse_args(argv)
    if not kernel_available():
        print(json.dumps({"error": "the C++ extension cannot be built on this CPU (needs AVX512-BF16)"}))
        return 1
    torch.set_num_threads(args.threads)
    doc = {"benchmark": "verify_cost", "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx"))),
           "rounds": time_rounds(args.shapes, args.rounds, args.reps)}
    doc["engine_t1"] = {m: time_engine(m, args.concurrency, args.batches, args.tokens, args.dtype)
                        for m in (args.methods if args.batches else [])}
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
