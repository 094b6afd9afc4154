"""Where a target decode step's time goes on the CPU (torch profiler), per batch size.

Prefills ``--context`` random tokens into each of B slots, then times ``--steps`` decode
steps (one new token per sequence, LM head on every row) and profiles 10 more. Prints
one JSON document: ms per step, the effective weight bandwidth (bytes of the weights a
step must read / step time: a batch-1 decode step is a chain of matrix-vector products,
so this is the number to compare with the machine's memory bandwidth), and the top
operators by self CPU time with their share.

    .venv/bin/python bench/forward_profile.py [--batch 1 16] [--dtype auto] [--threads 2] [--compare]

``--compare`` also times each batch with the two step-time fixes of issue 6 switched off
(one-row linears through ``F.linear`` instead of ``torch.mv``; one SDPA call per decode
sequence instead of one grouped call), interleaved with the current code, and reports
both medians (``before_ms`` / ``after_ms``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.models.llama import SeqSpan, load_target  # noqa: E402
from runtime.models.loader import ensure_converted  # noqa: E402


def compare(step, cache, context: int, reps: int = 7, n: int = 5) -> dict:
    """Median ms per step before (F.linear, per-sequence decode attention) and after."""
    import statistics

    import torch.nn.functional as F

    import runtime.models.llama as llama

    fixed_linear, fixed_group = llama.linear, llama.MIN_DECODE_GROUP
    out: dict[str, list[float]] = {"before_ms": [], "after_ms": []}
    try:
        for _ in range(reps):
            for key, (lin, group) in (("before_ms", (lambda x, w, packed=None: F.linear(x, w), 10**9)),
                                      ("after_ms", (fixed_linear, fixed_group))):
                llama.linear, llama.MIN_DECODE_GROUP = lin, group
                start = list(cache.lengths)
                step()
                t0 = time.perf_counter()
                for _ in range(n):
                    step()
                out[key].append((time.perf_counter() - t0) / n * 1e3)
                cache.lengths[:] = start
    finally:
        llama.linear, llama.MIN_DECODE_GROUP = fixed_linear, fixed_group
    res = {k: round(statistics.median(v), 2) for k, v in out.items()}
    res["speedup"] = round(res["before_ms"] / res["after_ms"], 3)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--compare", action="store_true", help="A/B against the pre-fix forward")
    args = ap.parse_args()

    from torch.profiler import ProfilerActivity, profile

    model = load_target(ensure_converted(), args.dtype, args.threads)
    dtype = model.serving_dtype
    if dtype == "gguf":  # the Q4_1 / Q8_0 tiles the kernels read, plus the norms
        weight_bytes = sum(b.numel() for n, b in model.named_buffers() if n.endswith("tiles"))
        weight_bytes += sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)
    else:
        weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
        weight_bytes += model.lm_head_weight.numel() * model.lm_head_weight.element_size()  # tied: read by the head
    rows = []
    for B in args.batch:
        cache = model.new_cache(B, args.context + args.steps + 64)
        for s in range(B):
            model(torch.randint(0, model.cfg.vocab_size, (args.context,)), [SeqSpan(s, 0, args.context)], cache)

        def step() -> None:
            spans = [SeqSpan(s, cache.lengths[s], 1) for s in range(B)]
            model(torch.randint(0, model.cfg.vocab_size, (B,)), spans, cache, logits_rows=torch.arange(B))

        for _ in range(3):
            step()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        ms = (time.perf_counter() - t0) / args.steps * 1e3
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                step()
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in events)
        top = [{"op": e.key, "share": round(e.self_cpu_time_total / total, 3), "calls_per_step": e.count // 10,
                "ms_per_step": round(e.self_cpu_time_total / 10 / 1e3, 2)} for e in events[: args.top]]
        row = {"batch": B, "ms_per_step": round(ms, 2), "tokens_per_s": round(B / ms * 1e3, 1),
               "weight_gb_per_s": round(weight_bytes / (ms / 1e3) / 1e9, 2), "top_ops": top}
        if args.compare:
            row.update(compare(step, cache, args.context))
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("batch", "ms_per_step", "tokens_per_s")}), file=sys.stderr)
    print(json.dumps({"benchmark": "forward_profile", "dtype": dtype, "threads": args.threads,
                      "context": args.context, "weight_mb": round(weight_bytes / 2**20, 1), "cpu_count": os.cpu_count(),
                      "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
