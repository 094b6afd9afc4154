"""What a round in which every request verifies nothing (ℓ = 0) costs against a plain decode step.

Issue 28 item 4: with a speculator present, a round whose budget gives every request ℓ = 0
must cost ≤ 1.05× a decode step of an engine without one. Two engines share one loaded
target, each decoding the same ``--batch`` requests (EOS suppressed, prompts of ~300 tokens);
their steps are **interleaved** (plain, speculative, plain, …) and each ``engine.step()`` is
timed; the figure is the ratio of the medians over ``--rounds`` (≥ 200) steps of each.

The speculative engine's rounds are forced to ℓ = 0 the way the engine reaches it in service:

* ``dspark`` and ``hybrid``: the budget's pre-draft choice (``Speculator._worth_drafting``)
  runs and drafts nobody — every request's expected yield of a draft is pinned to 0 accepted
  tokens — so no drafting; ``hybrid`` also runs its n-gram lookup, which finds nothing (the round
  verifies only the anchors). The target's taps for the drafter's context are queued (lazy
  commit) and, for ``dspark``, committed at 64 queued positions as in service;
* ``prompt_lookup``: its speculation gate decides "plain".
Prints one JSON document.

    .venv/bin/python bench/round_overhead.py [--rounds 240] [--batch 1] [--method dspark] [--temperature 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.config import EngineConfig, resolve_dtype  # noqa: E402
from runtime.engine.llm_engine import LLMEngine  # noqa: E402
from runtime.interface import GenerationRequest, SamplingParams  # noqa: E402
from training.evaluate import first_turns  # noqa: E402


class PlainGate:
    """The speculation gate pinned to "plain" (measurements ignored)."""

    def speculate(self, num_seqs: int) -> bool:
        return False

    def record(self, *args) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=240)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--method", default="dspark", choices=["dspark", "hybrid", "prompt_lookup"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    args = ap.parse_args(argv)
    dtype = resolve_dtype(args.dtype)
    common = dict(dtype=dtype, max_batch_size=args.batch, max_context=2048, request_timeout_s=3600.0,
                  prefix_cache_blocks=0)
    plain = LLMEngine(EngineConfig(**common), lambda rid, ev: None)
    spec = LLMEngine(EngineConfig(**common, spec_method=args.method, spec_gate=True), lambda rid, ev: None,
                     model=plain.model, tokenizer=plain.tokenizer)
    sp = spec.speculator
    if args.method == "prompt_lookup":
        spec.gate = PlainGate()
    else:
        assert spec.gate is None and sp.decides_drafting
        sp._draft_yield = lambda seq: (0.0, 1.0)  # no DSpark draft can pay: the budget drafts nobody
    if args.method == "hybrid":
        sp._ngram = lambda seq: ([], 0)  # no continuation found: the round verifies the anchors only
    tok = plain.tokenizer
    texts = first_turns("mt-bench")
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t * 3}], add_generation_prompt=True,
                                              tokenize=False), add_special_tokens=False)[:300] for t in texts[: args.batch]]
    need = args.rounds + 16
    for eng in (plain, spec):
        for i, p in enumerate(ids):
            eng.add_request(GenerationRequest(str(i), p, SamplingParams(temperature=args.temperature, max_tokens=need,
                                                                        ignore_eos=True)))
        while any(s.status.name != "DECODE" for s in eng.scheduler.running) or eng.scheduler.waiting:
            eng.step()  # prefill (not timed)
        for _ in range(8):
            eng.step()  # warm-up
    times = {"plain": [], "spec": []}
    for k in range(args.rounds):
        for name, eng in (("plain", plain), ("spec", spec)) if k % 2 == 0 else (("spec", spec), ("plain", plain)):
            t = time.perf_counter()
            eng.step()
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    assert spec.spec_steps == 0, "a forced-plain round drafted"
    print(json.dumps({"method": args.method, "dtype": dtype, "batch": args.batch, "rounds": args.rounds,
                      "temperature": args.temperature,
                      "plain_step_ms_p50": round(med["plain"], 3), "l0_round_ms_p50": round(med["spec"], 3),
                      "ratio": round(med["spec"] / med["plain"], 4),
                      "plain_step_ms_mean": round(statistics.fmean(times["plain"]) * 1e3, 3),
                      "l0_round_ms_mean": round(statistics.fmean(times["spec"]) * 1e3, 3)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
