"""fp32 decode steps with 2..SMALL_M_MAX rows: ``runtime.models.llama.linear``'s ``W·Xᵀ`` route
against ``F.linear`` (the route before it), interleaved in one process on the same KV cache.

Per batch size B: B slots prefilled with ``--context`` random tokens, then 9 rounds that each
time 4 decode steps (one new token per slot, LM head on every row) with one route and then the
other (order alternating per round); the cache is rewound after each timing. Prints one JSON
line per B: median ms per step of each route and their ratio.

    PYTHONPATH=. .venv/bin/python bench/fp32_gemm.py [--batch 1 2 4 5 8 16 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import runtime.models.llama as llama  # noqa: E402
from runtime.models.llama import SeqSpan, load_target  # noqa: E402
from runtime.models.loader import ensure_converted  # noqa: E402


def f_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The route before ``W·Xᵀ``: one row as ``torch.mv``, more through ``F.linear``."""
    if x.dim() == 2 and x.shape[0] == 1 and x.device.type == "cpu":
        return torch.mv(w, x[0]).unsqueeze(0)
    return F.linear(x, w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 5, 8, 16, 32])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    model = load_target(ensure_converted(), "float32", args.threads)
    current = llama.linear
    for B in args.batch:
        cache = model.new_cache(B, args.context + 64)
        for s in range(B):
            model(torch.randint(0, model.cfg.vocab_size, (args.context,)), [SeqSpan(s, 0, args.context)], cache)

        def step() -> None:
            spans = [SeqSpan(s, cache.lengths[s], 1) for s in range(B)]
            model(torch.randint(0, model.cfg.vocab_size, (B,)), spans, cache, logits_rows=torch.arange(B))

        ms: dict[str, list[float]] = {"f_linear": [], "wxt": []}
        try:
            for r in range(args.rounds):
                routes = [("f_linear", f_linear), ("wxt", current)]
                for key, route in routes if r % 2 else routes[::-1]:
                    llama.linear = route
                    start = list(cache.lengths)
                    step()
                    t0 = time.perf_counter()
                    for _ in range(4):
                        step()
                    ms[key].append((time.perf_counter() - t0) / 4 * 1e3)
                    cache.lengths[:] = start
        finally:
            llama.linear = current
        a, b = statistics.median(ms["f_linear"]), statistics.median(ms["wxt"])
        print(json.dumps({"batch": B, "f_linear_ms": round(a, 1), "wxt_ms": round(b, 1), "speedup": round(a / b, 3)}),
              flush=True)


if __name__ == "__main__":
    main()
