"""Drafting cost on the CPU: one DSpark draft round vs one target forward, per batch size.

For each batch size B (sequences with ``--context`` cached tokens each) it times, in the
serving dtype and thread count:

* ``target_decode_ms``: one target decode step (B tokens, LM head on B rows);
* ``target_verify_ms``: one target verification forward of B × (1 + γ) tokens;
* ``draft_backbone_ms``: the drafter's block forward (B × γ slots, context K/V cached);
* ``draft_lm_head_ms``: the shared LM head over the B × γ slot hidden states (49,152-way);
* ``draft_sample_ms``: Markov sampling left to right + confidence head (``sample_block``);
* the same draft round with γ' = 1 … γ slots (``propose(block_size=γ')``);
* on the fused ``gguf`` path, the engine's drafter (:class:`runtime.speculation.fast_drafter.FastDrafter`,
  the committed draft vocabulary): ``fused_draft_ms`` (backbone + LM head + Markov chain +
  confidences, as the engine calls it) and ``fused_context_ms`` (committing 2 positions'
  context K/V), next to ``eager_context_ms`` for the reference drafter.

The drafter is randomly initialised (its cost does not depend on its weights). Prints
one JSON document. Usage::

    .venv/bin/python bench/drafting_cost.py [--batch 1 4 16] [--dtype auto] [--threads 2]
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

from runtime.speculation.config import DrafterConfig  # noqa: E402
from runtime.speculation import fast_drafter  # noqa: E402
from runtime.speculation.drafter import DSparkDrafter  # noqa: E402
from runtime.models.llama import SeqSpan, load_target  # noqa: E402
from runtime.models.loader import ensure_converted  # noqa: E402
from runtime.engine.sampler import SamplingBatch  # noqa: E402
from runtime.speculation.speculator import DEFAULT_CHECKPOINT  # noqa: E402


def timed(fn, reps: int) -> float:
    """Median wall time of ``fn()`` in ms over ``reps`` calls (after 2 warm-up calls)."""
    for _ in range(2):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(out), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()

    target = load_target(ensure_converted(), args.dtype, args.threads)
    dtype = target.serving_dtype
    drafter = DSparkDrafter(target, DrafterConfig(block_size=args.gamma)).eval()
    fast = None
    if fast_drafter.available(drafter):
        fast = fast_drafter.FastDrafter(drafter, fast_drafter.load_draft_vocab(DEFAULT_CHECKPOINT, target.cfg.vocab_size))
    g = args.gamma
    rows = []
    for B in args.batch:
        cache = target.new_cache(B, args.context + 4 * g + 8)
        dcache = drafter.new_context_cache(B, args.context + 4 * g + 8)
        with torch.inference_mode():
            for s in range(B):
                ids = torch.randint(0, target.cfg.vocab_size, (args.context,))
                out = target(ids, [SeqSpan(s, 0, args.context)], cache, tap_layers=drafter.tap_layers)
                drafter.extend_context(dcache, out.taps, [s], [args.context])
        base = list(cache.lengths)
        slots = list(range(B))
        anchors = torch.randint(0, target.cfg.vocab_size, (B,))

        def forward(n: int) -> None:
            ids = torch.randint(0, target.cfg.vocab_size, (B * n,))
            target(ids, [SeqSpan(s, base[s], n) for s in slots], cache, torch.arange(B * n),
                   tap_layers=drafter.tap_layers)
            cache.lengths[:] = base  # roll back: every call sees the same context

        hidden = drafter.forward_block(drafter.block_inputs(anchors, g), slots, dcache)
        flat = hidden.reshape(B * g, -1)
        block = drafter.propose(anchors, slots, dcache)
        sampling = SamplingBatch(torch.zeros(B), torch.zeros(B, dtype=torch.long), torch.ones(B),
                                 [torch.Generator().manual_seed(s) for s in slots])
        with torch.inference_mode():
            row = {
                "batch": B,
                "target_decode_ms": timed(lambda: forward(1), args.reps),
                "target_verify_ms": timed(lambda: forward(1 + g), args.reps),
                "draft_backbone_ms": timed(lambda: drafter.forward_block(drafter.block_inputs(anchors, g), slots, dcache),
                                           args.reps),
                "draft_lm_head_ms": timed(lambda: target.lm_head(flat), args.reps),
                "draft_sample_ms": timed(lambda: drafter.sample_block(block, anchors, sampling), args.reps),
                "draft_round_ms_by_slots": {
                    k: timed(lambda k=k: drafter.sample_block(drafter.propose(anchors, slots, dcache, block_size=k),
                                                              anchors, sampling), args.reps)
                    for k in range(1, g + 1)
                },
            }
        row["draft_round_over_decode"] = round(row["draft_round_ms_by_slots"][g] / row["target_decode_ms"], 3)
        with torch.inference_mode():
            taps2 = out.taps[:2]
            row["eager_context_ms"] = timed(
                lambda: (drafter.extend_context(dcache, taps2, [0], [2]), dcache.truncate(0, base[0])), args.reps)
            if fast is not None:
                row["fused_draft_ms"] = timed(lambda: fast.draft(anchors, slots, dcache, g, sampling),
                                              args.reps)
                row["fused_context_ms"] = timed(
                    lambda: (fast.extend_context(dcache, taps2, [0], [2]), dcache.truncate(0, base[0])), args.reps)
                row["fused_draft_over_decode"] = round(row["fused_draft_ms"] / row["target_decode_ms"], 3)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    print(json.dumps({"benchmark": "drafting_cost", "dtype": dtype, "threads": args.threads,
                      "gamma": g, "context": args.context, "cpu_count": os.cpu_count(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
