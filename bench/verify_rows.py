"""What a verification forward costs per row count: target forward ms for B sequences × n new
tokens each (n = 1: a decode step; n = 1 + ℓ: a speculative round's verification), per
serving dtype, the dtypes interleaved.

Each of the B sequences has ``--context`` cached tokens; a timed forward feeds n random tokens
to each, computes the logits of every row (as verification does) and rolls the cache back, so
every call sees the same context. For every round the shapes run in turn and, within a shape,
the dtypes in turn (the machine's state drifts; interleaving keeps the comparison paired);
the figure per (dtype, shape) is the median over rounds of the median of ``--reps`` calls.
Prints one JSON document: ms per shape and dtype, ms per row, and each extra row's cost over
a decode step of the same batch.

    .venv/bin/python bench/verify_rows.py [--dtypes gguf gguf-a8] [--shapes 1x1 1x2 1x5 16x1] \\
        [--context 256] [--rounds 5] [--reps 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.config import cpu_flags  # noqa: E402
from runtime.models.llama import SeqSpan, load_target  # noqa: E402
from runtime.models.loader import ensure_converted  # noqa: E402

DEFAULT_SHAPES = ["1x1", "1x2", "1x3", "1x5", "1x8", "4x1", "4x5", "8x1", "16x1", "16x2"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["gguf"])
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="BxN: B sequences, N new tokens each")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    B_max = max(b for b, _ in shapes)
    n_max = max(n for _, n in shapes)
    gen = torch.Generator().manual_seed(0)
    models, caches = {}, {}
    prompts = [torch.randint(0, 49152, (args.context,), generator=gen) for _ in range(B_max)]
    with torch.inference_mode():
        for name in args.dtypes:
            m = models[name] = load_target(ensure_converted(), name, args.threads)
            cache = caches[name] = m.new_cache(B_max, args.context + n_max + 8)
            for s in range(B_max):
                m(prompts[s], [SeqSpan(s, 0, args.context)], cache)
    times: dict[tuple[str, int, int], list[float]] = {}

    def forward(name: str, B: int, n: int) -> None:
        m, cache = models[name], caches[name]
        ids = torch.randint(0, 49152, (B * n,), generator=gen)
        m(ids, [SeqSpan(s, args.context, n) for s in range(B)], cache, torch.arange(B * n))
        for s in range(B):
            cache.lengths[s] = args.context

    with torch.inference_mode():
        for _ in range(args.rounds):
            for B, n in shapes:
                for name in args.dtypes:
                    forward(name, B, n)  # warm
                    ts = []
                    for _ in range(args.reps):
                        t0 = time.perf_counter()
                        forward(name, B, n)
                        ts.append(time.perf_counter() - t0)
                    times.setdefault((name, B, n), []).append(statistics.median(ts) * 1e3)
    rows = []
    for B, n in shapes:
        row = {"batch": B, "tokens_per_seq": n, "rows": B * n}
        for name in args.dtypes:
            ms = statistics.median(times[(name, B, n)])
            row[f"{name}_ms"] = round(ms, 3)
            row[f"{name}_ms_rounds"] = [round(t, 3) for t in times[(name, B, n)]]
            if (name, B, 1) in times and n > 1:  # one extra row's cost, as a fraction of this batch's decode step
                step = statistics.median(times[(name, B, 1)])
                row[f"{name}_extra_row_over_step"] = round((ms - step) / (B * (n - 1)) / step, 3)
        rows.append(row)
    print(json.dumps({"benchmark": "verify_rows", "context": args.context, "threads": args.threads,
                      "rounds": args.rounds, "reps": args.reps, "dtypes": args.dtypes,
                      "cpu_flags": sorted(cpu_flags() & {"avx512_bf16", "avx512_vnni", "amx_bf16", "avx2"}),
                      "cpu_count": os.cpu_count(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
