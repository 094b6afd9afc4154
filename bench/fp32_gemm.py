"""fp32 decode steps with 2..SMALL_M_MAX rows through ``runtime.models.llama.linear``'s routes,
interleaved in one process on the same KV cache:

* ``f_linear``: ``F.linear`` (the route before ``W·Xᵀ``);
* ``wxt``: ``(W·Xᵀ)ᵀ`` on exactly the B rows;
* ``padded``: ``(W·Xᵀ)ᵀ`` on B rows padded with zero rows to the next of ``--pad-sizes``
  (how ``FP32_PADDED_ROWS`` was chosen);
* ``unpacked``: ``linear`` as committed but without the MKL-packed weights (``W·Xᵀ`` padded to
  ``FP32_PADDED_ROWS``: the route before packing);
* ``current``: ``linear`` as committed (packed weights for 2..``PACKED_M_MAX`` rows where MKL packs).

Per batch size B: B slots prefilled with ``--context`` random tokens, then ``--rounds`` rounds
that each time 4 decode steps (one new token per slot, LM head on every row) with every route
in turn (order rotating per round); the cache is rewound after each timing. Prints one JSON
line per B: median ms per step of each route and each route's speed-up over the first.

    PYTHONPATH=. .venv/bin/python bench/fp32_gemm.py [--batch 1 2 4 5 8 16 32] [--threads 2]
    PYTHONPATH=. .venv/bin/python bench/fp32_gemm.py --routes wxt padded --batch $(seq 2 32)
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


def f_linear(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
    """The route before ``W·Xᵀ``: one row as ``torch.mv``, more through ``F.linear``."""
    if x.dim() == 2 and x.shape[0] == 1 and x.device.type == "cpu":
        return torch.mv(w, x[0]).unsqueeze(0)
    return F.linear(x, w)


def padding(sizes: list[int]) -> tuple[int, ...]:
    """``FP32_PADDED_ROWS`` that pads every row count to the next of ``sizes`` (itself if none)."""
    return tuple(next((p for p in sorted(sizes) if p >= m), m) for m in range(llama.SMALL_M_MAX + 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 5, 8, 16, 32])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--routes", nargs="+", default=["f_linear", "wxt"],
                    choices=["f_linear", "wxt", "padded", "unpacked", "current"])
    ap.add_argument("--pad-sizes", type=int, nargs="+", default=[2, 4, 8, 16, 24, 32])
    args = ap.parse_args()
    model = load_target(ensure_converted(), "float32", args.threads)
    current, committed = llama.linear, llama.FP32_PADDED_ROWS
    pads = {"f_linear": committed, "wxt": tuple(range(llama.SMALL_M_MAX + 1)), "padded": padding(args.pad_sizes),
            "unpacked": committed, "current": committed}

    def unpacked(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
        return current(x, w, None)

    funcs = {"f_linear": f_linear, "wxt": unpacked, "padded": unpacked, "unpacked": unpacked, "current": current}
    for B in args.batch:
        cache = model.new_cache(B, args.context + 64)
        for s in range(B):
            model(torch.randint(0, model.cfg.vocab_size, (args.context,)), [SeqSpan(s, 0, args.context)], cache)

        def step() -> None:
            spans = [SeqSpan(s, cache.lengths[s], 1) for s in range(B)]
            model(torch.randint(0, model.cfg.vocab_size, (B,)), spans, cache, logits_rows=torch.arange(B))

        ms: dict[str, list[float]] = {k: [] for k in args.routes}
        try:
            for r in range(args.rounds):
                k = r % len(args.routes)
                for key in args.routes[k:] + args.routes[:k]:
                    llama.linear, llama.FP32_PADDED_ROWS = funcs[key], pads[key]
                    start = list(cache.lengths)
                    step()
                    t0 = time.perf_counter()
                    for _ in range(4):
                        step()
                    ms[key].append((time.perf_counter() - t0) / 4 * 1e3)
                    cache.lengths[:] = start
        finally:
            llama.linear, llama.FP32_PADDED_ROWS = current, committed
        med = {k: statistics.median(v) for k, v in ms.items()}
        first = args.routes[0]
        row = {"batch": B, **{f"{k}_ms": round(v, 1) for k, v in med.items()}}
        row.update({f"{k}_speedup": round(med[first] / v, 3) for k, v in med.items() if k != first})
        if "padded" in med:
            row["padded_to"] = pads["padded"][B] if B <= llama.SMALL_M_MAX else B
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
