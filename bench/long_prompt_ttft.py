"""TTFT and prefill speed of long prompts (~1k, 2k, 4k, 8k tokens) through the in-process engine.

Agents send long prompts (tool schemas, histories). Each prompt is a chat history of user
turns taken in order from the repository's own prompts (``data/train/*.jsonl.gz``), the last
turn cut so the templated prompt has the requested number of tokens; every size and every
repeat starts at a different turn, so no two prompts share a prefix, and the prefix cache is
off (``prefix_cache_blocks=0``) — every token is prefilled. One request at a time, greedy,
``--max-tokens`` tokens. TTFT is the engine's own timing from the ``Finished`` event
(``first_token − queued``: scheduling, chunked prefill, first sample; no HTTP, no
tokenisation); prefill tok/s = prompt tokens / TTFT. A ~256-token request warms the engine up
first.

``--code DIR`` imports the engine from another checkout (e.g. main's) for an A/B on the same
machine; the prompts always come from this repository's data. ``--max-context`` defaults to
that checkout's ``EngineConfig.max_context``; sizes that do not fit it are skipped.

    PYTHONPATH=. .venv/bin/python bench/long_prompt_ttft.py [--sizes 1000 2000 4000 8000] [--repeats 1]

Prints JSON: per size the prompt tokens, TTFT (s) and prefill tok/s of every repeat, and the
median; with the machine's CPU model and the engine's settings.
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def turns() -> list[str]:
    """User turns of every ``data/train`` file, file by file, in order."""
    out = []
    for f in sorted((ROOT / "data" / "train").glob("*.jsonl.gz")):
        for line in gzip.decompress(f.read_bytes()).decode().split("\n"):  # not splitlines: U+2028 in text
            if line.strip():
                out += [m["content"] for m in json.loads(line)["messages"] if m["role"] == "user"]
    return out


def build_prompt(tokenizer, pool: list[str], start: int, target: int) -> tuple[list[int], int]:
    """Token ids of a chat history of ``pool[start:]`` user turns with ~``target`` tokens
    (the last turn cut to fit; within a few tokens of the target) and the next unused turn."""

    def ids(messages):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)

    messages: list[dict] = []
    i = start
    while True:
        turn = pool[i % len(pool)]
        i += 1
        trial = ids(messages + [{"role": "user", "content": turn}])
        if len(trial) <= target:
            messages.append({"role": "user", "content": turn})
            if len(trial) == target:
                return trial, i
            continue
        room = target - len(ids(messages + [{"role": "user", "content": ""}]))
        words = tokenizer.encode(turn, add_special_tokens=False)
        while room > 0:  # decode/encode may merge tokens differently: shrink until it fits
            cut = ids(messages + [{"role": "user", "content": tokenizer.decode(words[:room])}])
            if len(cut) <= target:
                return cut, i
            room -= len(cut) - target
        return ids(messages), i


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 2000, 4000, 8000], help="prompt tokens")
    ap.add_argument("--repeats", type=int, default=1, help="prompts per size (each distinct)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--max-context", type=int, default=None, help="default: the engine's EngineConfig default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--code", default=None, help="import runtime/ from this checkout instead of this one")
    ap.add_argument("--label", default=None, help="copied into the JSON (e.g. branch name)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(args.code).resolve() if args.code else ROOT))

    from runtime.config import EngineConfig
    from runtime.engine.llm_engine import LLMEngine
    from runtime.interface import Finished, GenerationRequest, SamplingParams

    max_context = args.max_context or EngineConfig.max_context
    events: dict[str, list] = {}
    t0 = time.monotonic()
    engine = LLMEngine(EngineConfig(dtype=args.dtype, max_context=max_context, prefix_cache_blocks=0,
                                    num_threads=args.threads),
                       lambda rid, ev: events.setdefault(rid, []).append(ev))
    load_s = time.monotonic() - t0
    tok = engine.tokenizer
    pool = turns()

    def run(rid: str, ids: list[int]) -> tuple[float, int]:
        engine.add_request(GenerationRequest(rid, ids, SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                                                      ignore_eos=True)))
        while engine.has_work():
            engine.step()
        fin = events[rid][-1]
        if not isinstance(fin, Finished):
            raise RuntimeError(f"{rid}: {fin}")
        return fin.timings.first_token - fin.timings.queued, len(ids)

    nxt = len(pool) // 2  # the warm-up and the measured prompts never share a turn
    warm, nxt = build_prompt(tok, pool, nxt, 256)
    run("warmup", warm)
    results, skipped = [], []
    for size in args.sizes:
        if size + args.max_tokens > max_context:
            skipped.append(size)
            continue
        runs = []
        for r in range(args.repeats):
            ids, nxt = build_prompt(tok, pool, nxt, size)
            ttft, n = run(f"s{size}r{r}", ids)
            runs.append({"prompt_tokens": n, "ttft_s": round(ttft, 3), "prefill_tokens_per_s": round(n / ttft, 1)})
        results.append({"size": size, "runs": runs,
                        "ttft_s_median": round(statistics.median(x["ttft_s"] for x in runs), 3),
                        "prefill_tokens_per_s_median": round(statistics.median(x["prefill_tokens_per_s"] for x in runs), 1)})
    print(json.dumps({
        "bench": "long_prompt_ttft", "label": args.label, "cpu": cpu_model(), "dtype": engine.config.dtype,
        "threads": args.threads, "max_context": max_context, "prefix_cache": "off",
        "prefill_chunk_tokens": engine.config.prefill_chunk_tokens, "max_tokens": args.max_tokens,
        "engine_load_s": round(load_s, 1), "results": results, "skipped_sizes": skipped,
    }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
