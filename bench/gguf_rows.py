"""What one forward's projections cost per row count on each kernel path (AMX / VDPBF16PS).

Usage::

    PYTHONPATH=. python bench/gguf_rows.py [--rows 1 2 4 8 16] [--reps 15] [--save out.pt | --compare out.pt]

Runs :func:`runtime.kernels.cpu.gguf_cpu.gguf_linear` over the shipped GGUF's own weights — the
30 layers' Q4_1 projections (qkv, o, gate+up, down: distinct weights per layer, so they stream
from memory as in a decode step) and the Q8_0 LM head — on M random bf16 rows, with AMX on and
off (``set_amx``; only where the CPU has AMX), interleaved. Prints one JSON object: per path and
M the median wall ms of one pass over all of them (min of ``--reps`` inner repeats per round,
median over rounds) and a SHA-256 of every output's bytes.

``--engine C [C ...]``: also the in-process engine (AR, T = 0, 128 tokens with EOS ignored, ``C``
fresh eval first turns a batch) with AMX switched per batch, order alternating: decode tok/s
per path — what the kernel paths mean for a served step.

``--save`` writes the outputs, ``--compare`` checks a rebuilt kernel against them bit for bit
(exits 1 on a difference): a kernel change that claims identical results proves it here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.config import AMX_FLAGS, cpu_flags  # noqa: E402
from runtime.kernels.cpu import gguf_cpu  # noqa: E402
from runtime.models.gguf_weights import read_blocks  # noqa: E402
from runtime.models.loader import find_gguf  # noqa: E402

PROJ = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def model_tiles() -> list[tuple[int, int, int, torch.Tensor]]:
    """(qtype, N, K, tiles) of every projection of every layer, then the LM head."""
    blocks = read_blocks(find_gguf())
    out = []
    names = [f"blk.{i}.{p}.weight" for i in range(30) for p in PROJ] + ["token_embd.weight"]
    for name in names:
        qtype, b = blocks[name]
        n = b.shape[0]
        k = b.shape[1] // gguf_cpu.BLOCK_BYTES[qtype] * gguf_cpu.QK
        out.append((qtype, n, k, gguf_cpu.repack(b, qtype, n, k)))
    return out


def one_pass(tiles, xs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    return [torch.ops.sparkgate.gguf_linear(xs[k], t, q, n, k, torch.float32) for q, n, k, t in tiles]


def engine_paths(concurrency: list[int], paths: list[str], batches: int = 7) -> dict:
    """Decode tok/s of the AR engine per kernel path, T = 0 (batch 0 warms up: ``batches`` − 1 timed)."""
    from bench.verify_cost import ab_engine_rates
    from runtime.config import EngineConfig
    from runtime.engine.llm_engine import LLMEngine

    out = {}
    for c in concurrency:
        eng = LLMEngine(EngineConfig(dtype="gguf", spec_method="none", max_batch_size=c, prefix_cache_blocks=0,
                                     request_timeout_s=3600.0), lambda rid, ev: None)
        switches = {p: (lambda p=p: torch.ops.sparkgate.set_amx(p == "amx")) for p in paths}
        rates = ab_engine_rates(eng, c, batches - 1, switches, temperature=0.0)
        out[f"c{c}"] = {p: round(statistics.median(v), 1) for p, v in rates.items()}
        if len(paths) == 2:
            out[f"c{c}"]["amx_vs_vdpbf16ps_batches"] = [round(a / b, 3) for a, b in zip(*rates.values())]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--engine", type=int, nargs="*", default=[], metavar="C", help="also the AR engine at these batch sizes")
    ap.add_argument("--save", type=Path, default=None)
    ap.add_argument("--compare", type=Path, default=None)
    args = ap.parse_args(argv)
    if not gguf_cpu.kernel_available():
        print(json.dumps({"error": "the gguf kernel does not run on this CPU"}))
        return 1
    tiles = model_tiles()
    paths = ["amx", "vdpbf16ps"] if AMX_FLAGS <= cpu_flags() else ["vdpbf16ps"]
    g = torch.Generator().manual_seed(0)
    ks = sorted({k for _, _, k, _ in tiles})
    inputs = {m: {k: torch.randn(m, k, generator=g).bfloat16() for k in ks} for m in args.rows}
    ms: dict[str, dict[int, list[float]]] = {p: {m: [] for m in args.rows} for p in paths}
    outputs: dict[str, dict[int, list[torch.Tensor]]] = {p: {} for p in paths}
    for r in range(args.rounds):
        for p in (paths if r % 2 == 0 else paths[::-1]):
            torch.ops.sparkgate.set_amx(p == "amx")
            for m in args.rows:
                best = float("inf")
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    ys = one_pass(tiles, inputs[m])
                    best = min(best, time.perf_counter() - t0)
                ms[p][m].append(best * 1e3)
                outputs[p][m] = ys
    if args.engine:
        engine = engine_paths(args.engine, paths)
    torch.ops.sparkgate.set_amx(gguf_cpu.USE_AMX and AMX_FLAGS <= cpu_flags())
    digest = {p: {m: hashlib.sha256(b"".join(y.numpy().tobytes() for y in outputs[p][m])).hexdigest()[:16]
                  for m in args.rows} for p in paths}
    report = {
        "benchmark": "gguf_rows",
        "what": "one pass of gguf_linear over the GGUF's 30 layers of Q4_1 projections + the Q8_0 LM head, M bf16 rows",
        "cpu_flags": sorted(cpu_flags() & {"avx512_bf16", "amx_bf16", "amx_tile"}),
        "ms_median": {p: {m: round(statistics.median(v), 3) for m, v in ms[p].items()} for p in paths},
        "ms_rounds": {p: {m: [round(x, 3) for x in v] for m, v in ms[p].items()} for p in paths},
        "sha256": digest,
    }
    if args.engine:
        report["engine_decode_tok_s"] = engine
    if args.save:
        torch.save(outputs, args.save)
    if args.compare:
        ref = torch.load(args.compare)
        same = {p: {m: all(torch.equal(a, b) for a, b in zip(ref[p][m], outputs[p][m]))
                    for m in args.rows if m in ref.get(p, {})} for p in paths}
        report["identical_to_saved"] = same
    print(json.dumps(report))
    return 0 if not args.compare or all(all(v.values()) for v in report["identical_to_saved"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
