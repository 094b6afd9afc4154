"""Golden T=0 outputs of the engine, to re-check behaviour across refactors (issue 26).

For 20 fixed prompts (chat, maths, code; stored in the golden file itself) and each decoding
method — plain decoding and the speculative ones with a deterministic verification budget
(``fixed`` policy, the speculation gate off, the committed SPS table) — the golden file holds
the fp32 greedy token ids and the per-request speculation stats. fp32 is bit-stable
(README, "Reproducibility"), so any difference is a behaviour change.

Record (only when a change is meant to alter outputs or stats, and say so in the commit)::

    .venv/bin/python -m tests.support.golden --write

``tests/runtime/test_golden_outputs.py`` compares a fresh run with the file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from training.data import chat_ids

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "data" / "golden_t0.json"
SPS_TABLE = ROOT / "tests" / "data" / "sps_table.json"
MAX_TOKENS = 40

# (method, policy): plain decoding, both committed drafters, prompt lookup, and the
# SLA-aware budget over the committed SPS table (deterministic: no timings are read).
METHODS = [("none", "fixed"), ("prompt_lookup", "fixed"), ("dspark", "fixed"), ("parallel", "fixed"),
           ("dspark", "dspark-sla")]

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for staying focused while studying.",
    "Explain what a hash table is in two sentences.",
    "Tom has 3 apples and buys 5 more. He eats 2. How many apples does he have?",
    "What is 17 times 23? Show your steps.",
    "Write a Python function that returns the factorial of n.",
    "Write a Python function that checks whether a string is a palindrome.",
    "List the planets of the solar system in order from the Sun.",
    "Translate 'good morning, how are you?' into French.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "What are the main differences between TCP and UDP?",
    "A train travels 60 km in 45 minutes. What is its average speed in km/h?",
    "Write a short email asking a colleague to move a meeting to Friday.",
    "Explain photosynthesis to a ten-year-old.",
    "Write a SQL query that counts the rows of a table named users.",
    "What is the derivative of x^3 + 2x?",
    "Name five fruits that are red.",
    "Write a JavaScript function that reverses an array.",
    "Why is the sky blue?",
]


def run_method(model, tokenizer, method: str, policy: str) -> dict[str, dict]:
    """Greedy outputs of all prompts in one batch: ``{index: {"tokens": [...], "spec": {...}|None}}``."""
    from runtime.config import EngineConfig
    from runtime.engine.llm_engine import LLMEngine
    from runtime.interface import Finished, GenerationRequest, SamplingParams, TextDelta

    events: dict[str, list] = {}
    cfg = EngineConfig(dtype="float32", max_batch_size=len(PROMPTS), max_context=1024, spec_method=method,
                       spec_policy=policy, spec_gate=False, sps_table_path=str(SPS_TABLE),
                       request_timeout_s=3600.0)  # a loaded 2-core CPU must not time the batch out
    engine = LLMEngine(cfg, lambda rid, ev: events.setdefault(rid, []).append(ev), model=model, tokenizer=tokenizer)
    if engine.speculator is not None:
        engine.speculator.live_cost = None  # the budget reads the committed table, never this machine's timings
    for i, text in enumerate(PROMPTS):
        engine.add_request(GenerationRequest(str(i), chat_ids(tokenizer, text),
                                             SamplingParams(temperature=0, max_tokens=MAX_TOKENS)))
    while engine.has_work():
        engine.step()
    out = {}
    for rid, evs in events.items():
        final = evs[-1]
        assert isinstance(final, Finished), final
        spec = final.spec
        out[rid] = {
            "tokens": [t for e in evs if isinstance(e, TextDelta) for t in e.token_ids],
            "finish_reason": str(final.finish_reason),
            "spec": None if spec is None else {
                "rounds": spec.rounds, "drafted": spec.drafted, "verified": spec.verified,
                "accepted": spec.accepted, "emitted": spec.emitted,
                "accepted_per_position": list(spec.accepted_per_position)},
        }
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def record(model, tokenizer) -> dict:
    return {"max_tokens": MAX_TOKENS, "prompts": PROMPTS,
            "methods": {f"{m}/{p}": run_method(model, tokenizer, m, p) for m, p in METHODS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"write {GOLDEN.relative_to(ROOT)}")
    args = ap.parse_args()
    import torch
    from transformers import AutoTokenizer

    from runtime.models.llama import load_llama
    from runtime.models.loader import ensure_converted

    torch.set_num_threads(2)
    model_dir = ensure_converted()
    got = record(load_llama(model_dir, torch.float32), AutoTokenizer.from_pretrained(str(model_dir)))
    if args.write:
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
        print(f"wrote {GOLDEN.relative_to(ROOT)}")
    else:
        print(json.dumps({k: sum(len(v["tokens"]) for v in r.values()) for k, r in got["methods"].items()}))


if __name__ == "__main__":
    main()
