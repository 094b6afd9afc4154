"""``sparkgate profile``: profile (or show the cached) SPS table of the embedded engine.

The timing, keys, cache and start-up hook live in :mod:`runtime.speculation.sps_profiler`
(paper §3.2.2), which takes a round function; this module hands it an idle engine's own
(:func:`~runtime.speculation.sps_profiler.make_round_fn` over its model, speculator and
KV cache).

``python -m runtime.engine.profile`` (alias ``sparkgate profile``) prints the table as
JSON; ``--force`` re-profiles.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Sequence

from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.speculation import sps as sps_mod
from runtime.speculation import sps_profiler
from runtime.speculation.sps import SpsTable

log = logging.getLogger(__name__)


def profile_engine(engine: LLMEngine, temperature: float = 1.0, **options) -> SpsTable:
    """Profile ``engine`` now (must have a speculator and no running requests) with
    :func:`~runtime.speculation.sps_profiler.profile_table` over its own round function;
    ``options``: that function's ``context_lens``, ``repeats``, ``warmup``, ``save``.

    Raises:
        ValueError: the engine does not speculate, or has running requests.
    """
    spec = engine.speculator
    if spec is None:
        raise ValueError("engine has no speculator (spec_method 'none'): nothing to profile")
    if engine.has_work():
        raise ValueError("profile an idle engine (requests are running)")
    cfg = engine.config
    round_fn = sps_profiler.make_round_fn(engine.model, spec, engine.cache, temperature)
    key = sps_profiler.sps_cache_key(cfg, engine.model, spec, temperature)
    return sps_profiler.profile_table(
        round_fn, key, max_requests=cfg.max_batch_size, max_context=cfg.max_context, gamma=spec.gamma,
        temperature=temperature, **options
    )


# ---------------------------------------------------------------------- CLI
def format_table(table: SpsTable) -> str:
    """Human-readable SPS (rounds/s) and throughput B·SPS (tokens/s) per context."""
    lines = ["B:        " + " ".join(f"{b:>7d}" for b in table.buckets)]
    for c, row in zip(table.context_lens, table.values):
        lines.append(f"ctx {c:<5d} " + " ".join(f"{v:7.2f}" for v in row) + "   rounds/s")
        lines.append("          " + " ".join(f"{b * v:7.1f}" for b, v in zip(table.buckets, row)) + "   tokens/s")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m runtime.engine.profile`` (alias ``sparkgate profile``)."""
    ap = argparse.ArgumentParser(description="Profile (or show the cached) SPS table of the embedded engine.")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--spec-method", default="dspark", choices=["dspark", "parallel", "prompt_lookup", "hybrid"])
    ap.add_argument("--temperature", type=float, default=1.0, help="1: the table of sampled batches; 0: greedy ones")
    ap.add_argument("--gamma", type=int, default=7, help="num_speculative_tokens")
    ap.add_argument("--draft-checkpoint", default=None)
    ap.add_argument("--max-batch-size", type=int, default=16)
    ap.add_argument("--max-context", type=int, default=EngineConfig.max_context)
    ap.add_argument("--contexts", type=int, nargs="+", default=list(sps_profiler.DEFAULT_CONTEXT_LENS))
    ap.add_argument("--repeats", type=int, default=sps_profiler.DEFAULT_REPEATS)
    ap.add_argument("--warmup", type=int, default=sps_profiler.DEFAULT_WARMUP)
    ap.add_argument("--force", action="store_true", help="re-profile even if a cached table matches")
    ap.add_argument("--out", default=None, help="also write the table JSON here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = EngineConfig(
        dtype=args.dtype, num_threads=args.threads, spec_method=args.spec_method,
        num_speculative_tokens=args.gamma, draft_checkpoint=args.draft_checkpoint,
        max_batch_size=args.max_batch_size, max_context=args.max_context, profile_on_start=False,
    )  # fmt: skip
    engine = LLMEngine(cfg, lambda rid, ev: None)
    key = sps_profiler.sps_cache_key(cfg, engine.model, engine.speculator, args.temperature)
    cache = sps_profiler.sps_cache_dir()
    table = None if args.force else sps_mod.load_cached(key, cache)
    source = "cache"
    if table is None or tuple(table.context_lens) != tuple(sps_profiler.profile_context_lens(cfg.max_context, engine.speculator.gamma, args.contexts)):
        table = profile_engine(engine, args.temperature, context_lens=args.contexts, repeats=args.repeats,
                               warmup=args.warmup)
        source = "profiled"
    print(format_table(table), file=sys.stderr)
    print(f"source: {source}; cache: {sps_mod.cache_path(key, cache)}", file=sys.stderr)
    if args.out:
        table.save(args.out)
    print(json.dumps(table.to_dict(), indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
