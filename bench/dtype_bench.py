"""Target decode-step time per serving dtype (fp32 vs bf16) at a few batch sizes.

Why: bf16 halves the bytes read per step, but only CPUs with native bf16 matmuls
(AVX512-BF16 / AMX) profit; on AVX2-only CPUs oneDNN emulates bf16 and a step gets
slower. ``dtype="auto"`` (runtime.config.resolve_dtype) picks by the CPU flags; this
script measures what that choice is worth on the machine at hand.

    PYTHONPATH=. .venv/bin/python bench/dtype_bench.py [--threads 1] [--batch 1 16] [--steps 12]

Prints JSON: CPU flags seen, what ``auto`` resolves to, and ms per decode step (context
64 + steps, one new token per sequence, one ragged forward over the batch).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from runtime.config import cpu_has_native_bf16, resolve_dtype
from runtime.models.llama import SeqSpan, load_llama
from runtime.models.loader import ensure_converted


def step_ms(model, batch: int, steps: int, context: int = 64) -> float:
    cache = model.new_cache(batch, context + steps + 1)
    slots = [cache.allocate() for _ in range(batch)]
    g = torch.Generator().manual_seed(0)
    model.forward(torch.randint(100, 1000, (batch * context,), generator=g),
                  [SeqSpan(s, 0, context) for s in slots], cache, None)
    t = time.perf_counter()
    for i in range(steps):
        model.forward(torch.randint(100, 1000, (batch,), generator=g),
                      [SeqSpan(s, context + i, 1) for s in slots], cache, None)
    return (time.perf_counter() - t) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    mdir = ensure_converted()
    out = {"native_bf16": cpu_has_native_bf16(), "auto": resolve_dtype("auto"), "threads": a.threads,
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "ms_per_step": {}}
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model = load_llama(mdir, dt)
        for b in a.batch:
            out["ms_per_step"][f"{name}/batch{b}"] = round(step_ms(model, b, a.steps), 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
