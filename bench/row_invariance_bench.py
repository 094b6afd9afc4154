"""What row-invariant arithmetic costs on the served ``gguf`` path: decode tok/s at c = 1 and
c = 16, TTFT of a ~500-token prompt, and verification-sized forwards, this tree vs another.

Row invariance (docs/benchmarks.md, "Row invariance"): a token's logits and K/V do not depend
on the verification width, prefill chunking, the prefix cache or the other sequences in its
forward. It costs what the per-row arithmetic costs where the old path took a faster,
row-dependent route (a 4-chain 1-row kernel, dense bf16 GEMMs above 12 rows, ATen SDPA above
64 rows). To measure that, give ``--baseline`` a checkout of the commit before (e.g. ``git
archive main | tar -x -C /tmp/main``): each repeat runs one child process per tree, the trees
interleaved, so load changes on a shared machine hit both alike.

One child (``--child``, the tree given by its working directory and PYTHONPATH): an in-process
:class:`LLMEngine` (``dtype="gguf"``, AR, greedy, ``ignore_eos``, prefix cache off so every
prompt is prefilled, ``--threads`` kernel threads) measures

* ``ttft_ms``: the engine's ``first_token − queued`` of ``--prompts`` distinct prompts of
  ``--prompt-tokens`` tokens, one at a time (chunked by the engine's
  ``prefill_chunk_tokens``, 256), median;
* ``decode_tok_s_c1`` / ``decode_tok_s_c16``: per-request decode speed
  (:func:`runtime.interface.decode_tokens_per_s`, ``--decode-tokens`` tokens) with 1 and 16
  requests running together (short prompts), median over the requests;
* ``verify_ms``: one target forward of 1 + ℓ = 8 rows for 1 and for 16 sequences (the
  verification shapes of DSpark), logits of every row, median of 10.

    PYTHONPATH=. .venv/bin/python bench/row_invariance_bench.py --baseline /tmp/main [--repeats 3]

Prints JSON: per tree (``baseline``, ``this``) the median over repeats of each figure and
every repeat's value, and ``cost_pct`` per figure: how much more time this tree takes per
token, to the first token or per forward (positive = slower). Without ``--baseline`` only
this tree.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORDS = ("river mountain lantern harbour copper orchard violin meadow glacier quarry falcon "
         "canyon ember tundra lagoon saffron marble compass thistle beacon").split()


def prompt_ids(tokenizer, n_tokens: int, seed: int) -> list[int]:
    """A distinct prompt of exactly ``n_tokens`` token ids (word salad, seeded)."""
    import random

    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(n_tokens))
    return tokenizer.encode(text, add_special_tokens=False)[:n_tokens]


def child(a) -> dict:
    import torch

    from runtime.config import EngineConfig
    from runtime.engine.llm_engine import LLMEngine, load_tokenizer
    from runtime.interface import Finished, GenerationRequest, SamplingParams
    from runtime.models.llama import SeqSpan
    from runtime.models.loader import ensure_converted

    mdir = ensure_converted()
    tokenizer = load_tokenizer(mdir)
    events: dict[str, list] = {}
    cfg = EngineConfig(dtype="gguf", max_batch_size=16, max_context=1024, num_threads=a.threads,
                       prefix_cache_blocks=0, spec_method="none")
    engine = LLMEngine(cfg, lambda rid, ev: events.setdefault(rid, []).append(ev), tokenizer=tokenizer)
    n = 0

    def run(prompts: list[list[int]], max_tokens: int) -> list[Finished]:
        nonlocal n
        rids = []
        for ids in prompts:
            rid = f"r{n}"
            n += 1
            rids.append(rid)
            engine.add_request(GenerationRequest(rid, ids, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                          ignore_eos=True)))
        while engine.has_work():
            engine.step()
        fins = [events[r][-1] for r in rids]
        assert all(isinstance(f, Finished) for f in fins), fins
        return fins

    run([prompt_ids(tokenizer, 64, 999)], 8)  # warm-up
    out: dict = {"threads": a.threads, "loadavg_start": os.getloadavg()[0]}
    ttft = []
    for i in range(a.prompts):
        fin = run([prompt_ids(tokenizer, a.prompt_tokens, 1000 + i)], 2)[0]
        ttft.append((fin.timings.first_token - fin.timings.queued) * 1e3)
    out["ttft_ms"] = statistics.median(ttft)
    for c in (1, 16):
        fins = run([prompt_ids(tokenizer, 32, 2000 + c * 100 + i) for i in range(c)], a.decode_tokens)
        out[f"decode_tok_s_c{c}"] = statistics.median(f.decode_tokens_per_s for f in fins)
    model = engine.model
    for seqs in (1, 16):
        cache = model.new_cache(seqs, 256)
        slots = [cache.allocate() for _ in range(seqs)]
        g = torch.Generator().manual_seed(seqs)
        model.forward(torch.randint(100, 1000, (seqs * 100,), generator=g), [SeqSpan(s, 0, 100) for s in slots], cache, None)
        times = []
        for _ in range(10):
            ids = torch.randint(100, 1000, (seqs * 8,), generator=g)
            t = time.perf_counter()
            model.forward(ids, [SeqSpan(s, 100, 8) for s in slots], cache, torch.arange(seqs * 8))
            times.append((time.perf_counter() - t) * 1e3)
            for s in slots:
                cache.truncate(s, 100)
        out[f"verify_ms_{seqs}x8"] = statistics.median(times)
    out["loadavg_end"] = os.getloadavg()[0]
    return out


FIGURES = ("decode_tok_s_c1", "decode_tok_s_c16", "ttft_ms", "verify_ms_1x8", "verify_ms_16x8")
HIGHER_IS_BETTER = {"decode_tok_s_c1", "decode_tok_s_c16"}


def run_child(tree: Path, a) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--threads", str(a.threads),
           "--prompts", str(a.prompts), "--prompt-tokens", str(a.prompt_tokens), "--decode-tokens", str(a.decode_tokens)]
    res = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"child in {tree} failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", type=Path, default=None, help="a checkout to compare with (e.g. main)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=3, help="TTFT prompts per repeat")
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a)))
        return
    trees = {"this": ROOT}
    if a.baseline is not None:
        trees = {"baseline": a.baseline.resolve(), "this": ROOT}
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    t0 = time.monotonic()
    for _ in range(a.repeats):
        for name, tree in trees.items():
            runs[name].append(run_child(tree, a))
    out: dict = {"threads": a.threads, "prompt_tokens": a.prompt_tokens, "decode_tokens": a.decode_tokens,
                 "repeats": a.repeats, "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    for name, rs in runs.items():
        out[name] = {f: round(statistics.median(r[f] for r in rs), 2) for f in FIGURES}
        out[name]["runs"] = {f: [round(r[f], 2) for r in rs] for f in FIGURES}
        out[name]["loadavg"] = [round(r["loadavg_start"], 2) for r in rs]
    if "baseline" in runs:
        cost = {}
        for f in FIGURES:
            b, t = out["baseline"][f], out["this"][f]
            cost[f] = round(100 * ((b / t - 1) if f in HIGHER_IS_BETTER else (t / b - 1)), 1)
        out["cost_pct"] = cost
    out["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
