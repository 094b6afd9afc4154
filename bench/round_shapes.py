"""Verification rounds of served shapes: ``requests`` requests × ``drafts`` drafts each.

Times :class:`runtime.speculation.sps_profiler.EngineRoundFn` rounds (the target's ragged
verification forward, ``spec_round`` and the drafter-context commit; the SPS profile's own
round, drafting excluded) for every (requests, drafts) cell, all cells interleaved in shuffled
passes, on an idle engine in the serving dtype. With ``--ab-padding`` each cell is timed with
fp32 rows unpadded and with ``runtime.models.llama.FP32_PADDED_ROWS`` (alternating order; where the
fp32 weights are MKL-packed, 2..``PACKED_M_MAX`` rows take the packed route and are never padded).
Prints one JSON line per cell: median ms (and the speed-up of padding).

    PYTHONPATH=. .venv/bin/python bench/round_shapes.py --requests 1 2 4 --drafts 0 1 2 3 4 6 7 \\
        --passes 15 --temperature 0 --ab-padding
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import runtime.models.llama as llama  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from runtime.engine.llm_engine import LLMEngine  # noqa: E402
from runtime.speculation import sps_profiler  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--drafts", type=int, nargs="+", default=[0, 1, 2, 4, 7])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--passes", type=int, default=9)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--spec-method", default="hybrid")
    ap.add_argument("--ab-padding", action="store_true", help="time each cell unpadded and padded (fp32)")
    args = ap.parse_args()
    cfg = EngineConfig(dtype=args.dtype, spec_method=args.spec_method, max_batch_size=max(args.requests),
                       profile_on_start=False)
    engine = LLMEngine(cfg, lambda rid, ev: None)
    fn = sps_profiler.make_round_fn(engine.model, engine.speculator, engine.cache, args.temperature)
    committed = llama.FP32_PADDED_ROWS
    unpadded = tuple(range(llama.SMALL_M_MAX + 1))
    modes = {"plain": unpadded, "padded": committed} if args.ab_padding else {"as_is": committed}
    cells = [(r, d) for r in args.requests for d in args.drafts]

    def run(r: int, d: int, mode: str) -> float:
        llama.FP32_PADDED_ROWS = modes[mode]
        try:
            return fn.time_round([d] * r, args.context)
        finally:
            llama.FP32_PADDED_ROWS = committed

    t0 = time.perf_counter()  # warm up: the first rounds after start-up run slow
    while time.perf_counter() - t0 < 3.0:
        run(*min(cells), next(iter(modes)))
        run(*max(cells), next(iter(modes)))
    times: dict[tuple[int, int, str], list[float]] = {(r, d, m): [] for r, d in cells for m in modes}
    order = random.Random(0)
    for p in range(args.passes):
        order.shuffle(cells)
        for r, d in cells:
            for m in list(modes) if p % 2 else list(modes)[::-1]:
                times[(r, d, m)].append(run(r, d, m))
    for r, d in sorted(cells):
        med = {m: statistics.median(times[(r, d, m)]) * 1e3 for m in modes}
        row = {"requests": r, "drafts": d, "rows": r * (1 + d), "dtype": str(engine.model.serving_dtype),
               "temperature": args.temperature, **{f"{m}_ms": round(v, 1) for m, v in med.items()}}
        if args.ab_padding:
            row["speedup"] = round(med["plain"] / med["padded"], 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
