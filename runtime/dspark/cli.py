"""Command-line entry points of the drafter pipeline: ``regen``, ``train``, ``calibrate``, ``eval``.

    python -m runtime.dspark.cli regen     [--num-prompts 5500] [--limit N] ...
    python -m runtime.dspark.cli train     --out runtime/dspark/checkpoints/candidate [--minutes 20] ...
    python -m runtime.dspark.cli calibrate --checkpoint DIR
    python -m runtime.dspark.cli eval      --checkpoint DIR [--max-samples 20] ...

:func:`build_parser` / :func:`main` are what ``sparkgate train-drafter`` etc. hook
into (``main(argv)`` returns an exit code). Long runs belong under ``nice -n 19``.
See docs/drafter.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _add_regen(sub) -> None:
    from runtime.dspark.data import DEFAULT_OUT, RegenConfig

    d = RegenConfig()
    p = sub.add_parser("regen", help="regenerate training responses with the target (resumable)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="data dir (shards + manifest)")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="length of the balanced prompt order")
    p.add_argument("--limit", type=int, default=None, help="stop after N new prompts (throughput runs)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--max-batch-size", type=int, default=d.max_batch_size)
    p.add_argument("--shard-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-progress", action="store_true")


def _run_regen(a) -> int:
    from runtime.dspark.data import RegenConfig, regenerate, summarize

    cfg = RegenConfig(
        num_prompts=a.num_prompts, seed=a.seed, temperature=a.temperature, top_p=a.top_p,
        max_new_tokens=a.max_new_tokens, max_batch_size=a.max_batch_size,
    )  # fmt: skip
    st = regenerate(cfg, a.out, shard_size=a.shard_size, limit=a.limit, num_threads=a.threads,
                    progress=not a.no_progress)
    print(json.dumps({
        "new_prompts": st.new_prompts, "new_response_tokens": st.new_tokens, "seconds": round(st.seconds, 1),
        "tokens_per_s": round(st.tokens_per_s, 1),
        "tokens_per_cpu_s": round(st.tokens_per_cpu_s, 1), "prompts_done": st.prompts_done,
        "skipped": st.skipped_long, "failed": st.failed, "summary": summarize(a.out),
    }, indent=2))  # fmt: skip
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dspark", description="DSpark drafter pipeline (docs/drafter.md)")
    sub = p.add_subparsers(dest="cmd", required=True)
    _add_regen(sub)
    return p


RUNNERS = {"regen": _run_regen}


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return RUNNERS[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
