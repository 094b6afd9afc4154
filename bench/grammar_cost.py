"""What structured outputs cost: decode speed, τ and grammar-mask time with and without a schema,
speculation off and on (issue 29, "Speed").

In process, one loaded target shared by one engine per method (``--methods``: ``none`` = plain
decoding, ``hybrid`` and ``dspark`` as served: budget policy ``dspark-sla``, the gate where the
method has one), prefix cache off, temperature 0, ``--max-tokens`` (128) with EOS allowed.

1. **Ranking.** Every schema of the response-format test set (:data:`tests.support.json_schemas.
   SCHEMAS`, the 55 of ``tests/gateway/openai/test_response_format.py``) is generated once at
   c = 1 with plain decoding from its own prompt, ``--rank-repeats`` times; its cost is the
   engine's mask time per generated token (``Finished.grammar_mask_s`` / completion tokens),
   the least over the repeats. The **median** schema
   (rank ⌊n/2⌋ by that cost) and the **worst** one are measured below.
2. **Measurement.** For c = 1 and c = ``--concurrency`` (16): every (method, format) pair —
   format ``free`` (the median schema's prompt, no response format), ``median``, ``worst``:
   c copies of that schema's prompt (at T = 0 the c replies are the same text); at c > 1 also
   ``worst16``: the c costliest schemas of the ranking, one request each (c grammars, c texts)
   — runs one batch, ``--repeats`` times, **interleaved** (every pair once per repeat, order
   rotated per repeat). ``METHOD@xgr``: the same engine with the apply this bench replaced (a
   fp32 copy of the logits, xgrammar's bit-by-bit CPU kernel), as a baseline. Per batch:

   * decode tok/s per user: ``(completion − 1) / (last token − first token)`` per request,
     the median over the batch; aggregate: completion tokens / wall of the batch;
   * τ: emitted tokens per round, bonus included (Σ ``SpecStats.emitted`` / Σ ``rounds``);
   * ``mask_share``: over the engine steps in which every request decodes (no prefill in
     them), the engine's grammar time (``LLMEngine.grammar_mask_s``: filling the bitmasks,
     under speculation every verification row, and applying them; plus
     ``grammar_advance_s``: matchers accepting the emitted tokens) / the steps' wall time;
   * ``mask_ms_per_token``: as in the records (Σ ``grammar_mask_s`` / Σ completion tokens).

   Reported per cell: every repeat and the medians. The bars of issue 29: ``mask_share`` ≤ 10 %
   at c = 1 and ≤ 15 % at c = 16 with speculation, for the median and the worst schema.

Prints one JSON document.

    .venv/bin/python bench/grammar_cost.py [--repeats 5] [--concurrency 16] [--methods none hybrid dspark]
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
from runtime.engine import llm_engine  # noqa: E402
from runtime.engine.llm_engine import LLMEngine  # noqa: E402
from runtime.engine.sequence import SeqStatus  # noqa: E402
from runtime.interface import Finished, GenerationRequest, ResponseFormat, SamplingParams  # noqa: E402
from tests.support.json_schemas import SCHEMAS  # noqa: E402


def engine_config(method: str, dtype: str, batch: int) -> EngineConfig:
    method = method.removesuffix("@xgr")
    return EngineConfig(dtype=dtype, spec_method=method, max_batch_size=batch, request_timeout_s=3600.0,
                        prefix_cache_blocks=0, profile_on_start=method != "none")


def xgrammar_mask_logits(logits, bitmask, rows, inplace=False):
    """The apply before this bench's change, for the ``METHOD@xgr`` baselines: a fp32 copy of
    every row, then xgrammar's CPU kernel (``apply_token_bitmask_inplace``) on ``rows``."""
    import xgrammar as xgr

    out = logits.float().clone()
    if rows:
        xgr.apply_token_bitmask_inplace(out, bitmask, vocab_size=out.shape[-1], indices=list(rows))
    return out


class Runner:
    """One engine; :meth:`batch` runs c requests to completion and returns the batch's numbers."""

    def __init__(self, cfg: EngineConfig, model=None, tokenizer=None, legacy_apply: bool = False) -> None:
        self.events: list = []
        self.legacy_apply = legacy_apply
        self.engine = LLMEngine(cfg, lambda rid, ev: self.events.append(ev), model=model, tokenizer=tokenizer)

    def _grammar_s(self) -> float:
        return self.engine.grammar_mask_s + self.engine.grammar_advance_s

    def batch(self, reqs: list[tuple[list[int], dict | None]], max_tokens: int) -> dict:
        """``reqs``: (prompt ids, schema or ``None``) per request, all added at once."""
        self.events = []
        eng = self.engine
        c = len(reqs)
        for i, (ids, schema) in enumerate(reqs):
            fmt = ResponseFormat("json_schema", schema, True) if schema is not None else None
            eng.add_request(GenerationRequest(str(i), ids, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                                              response_format=fmt, return_spec_stats=True))
        step_s = grammar_s = 0.0
        steps = 0
        current = llm_engine.mask_logits
        if self.legacy_apply:
            llm_engine.mask_logits = xgrammar_mask_logits
        t0 = time.perf_counter()
        while eng.has_work():
            decoding = not eng.scheduler.waiting and all(s.status is SeqStatus.DECODE for s in eng.scheduler.running)
            g, t = self._grammar_s(), time.perf_counter()
            eng.step()
            if decoding:
                step_s += time.perf_counter() - t
                grammar_s += self._grammar_s() - g
                steps += 1
        wall = time.perf_counter() - t0
        llm_engine.mask_logits = current
        fins = [e for e in self.events if isinstance(e, Finished)]
        assert len(fins) == c, self.events[-1]
        tokens = sum(f.completion_tokens for f in fins)
        users = [(f.completion_tokens - 1) / (f.timings.last_token - f.timings.first_token) for f in fins
                 if f.completion_tokens > 1 and f.timings.last_token > f.timings.first_token]
        out = {"tokens_per_request": statistics.median(f.completion_tokens for f in fins),
               "per_user_tok_s": statistics.median(users), "aggregate_tok_s": tokens / wall,
               "decode_steps": steps, "step_ms": 1e3 * step_s / max(steps, 1),
               "mask_share": grammar_s / step_s if step_s else 0.0}
        if any(schema is not None for _, schema in reqs):
            out["mask_ms_per_token"] = 1e3 * sum(f.grammar_mask_s for f in fins) / max(tokens, 1)
        specs = [f.spec for f in fins if f.spec is not None]
        if specs:
            out["tau"] = sum(s.emitted for s in specs) / max(sum(s.rounds for s in specs), 1)
        return out


def chat_ids(tok, prompt: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                              tokenize=False), add_special_tokens=False)


def rank(runner: Runner, tok, max_tokens: int, repeats: int) -> list[dict]:
    """Every schema ``repeats`` times, plain decoding at c = 1: mask ms per token (the least
    over the repeats, the least disturbed by other load), cheapest first."""
    runs: dict[str, list[dict]] = {}
    for _ in range(repeats):
        for name, prompt, schema in SCHEMAS:
            runs.setdefault(name, []).append(runner.batch([(chat_ids(tok, prompt), schema)], max_tokens))
    rows = [{"name": name, "mask_ms_per_token": round(min(r["mask_ms_per_token"] for r in rs), 4),
             "tokens": rs[0]["tokens_per_request"], "mask_share": round(min(r["mask_share"] for r in rs), 4)}
            for name, rs in runs.items()]
    return sorted(rows, key=lambda r: r["mask_ms_per_token"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=["none", "hybrid", "dspark"],
                    help="none / hybrid / dspark; METHOD@xgr: the same with the former apply (a copy of the "
                         "logits, xgrammar's CPU kernel), constrained formats only")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rank-repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--schemas", nargs=2, metavar=("MEDIAN", "WORST"), help="skip the ranking: these two names")
    args = ap.parse_args(argv)
    dtype = resolve_dtype(args.dtype)
    batch = max(args.concurrency, 1)
    first = Runner(engine_config(args.methods[0], dtype, batch), legacy_apply=args.methods[0].endswith("@xgr"))
    runners = {args.methods[0]: first}
    for m in args.methods[1:]:
        runners[m] = Runner(engine_config(m, dtype, batch), model=first.engine.model, tokenizer=first.engine.tokenizer,
                            legacy_apply=m.endswith("@xgr"))
    tok = first.engine.tokenizer
    by_name = {name: (prompt, schema) for name, prompt, schema in SCHEMAS}
    for r in runners.values():  # warm-up: kernel builds, grammar compiles, first-call costs
        r.batch([(chat_ids(tok, "Hello!"), SCHEMAS[0][2])], 8)
    plain = next((r for m, r in runners.items() if m == "none"), first)
    t_start = time.time()
    ranking = None
    if args.schemas:
        picked = {"median": args.schemas[0], "worst": args.schemas[1]}
    else:
        ranking = rank(plain, tok, args.max_tokens, args.rank_repeats)
        picked = {"median": ranking[len(ranking) // 2]["name"], "worst": ranking[-1]["name"]}
    median, worst = by_name[picked["median"]], by_name[picked["worst"]]
    results: dict[int, dict[str, list[dict]]] = {}
    for c in (1, args.concurrency) if args.concurrency > 1 else (1,):
        formats = {"free": [(median[0], None)] * c, "median": [median] * c, "worst": [worst] * c}
        if c > 1 and ranking is not None:  # c different schemas, the costliest c of the ranking
            formats[f"worst{c}"] = [by_name[r["name"]] for r in ranking[-c:]]
        formats = {f: [(chat_ids(tok, prompt), schema) for prompt, schema in reqs] for f, reqs in formats.items()}
        cells = [(m, f) for m in args.methods for f in formats if not (m.endswith("@xgr") and f == "free")]
        res = results[c] = {f"{m}/{f}": [] for m, f in cells}
        for rep in range(args.repeats):
            for m, f in cells[rep % len(cells):] + cells[: rep % len(cells)]:
                res[f"{m}/{f}"].append(runners[m].batch(formats[f], args.max_tokens))
    out = {"dtype": dtype, "max_tokens": args.max_tokens, "repeats": args.repeats, "schemas": picked,
           "worst_c": [r["name"] for r in ranking[-args.concurrency:]] if ranking and args.concurrency > 1 else None,
           "wall_s": round(time.time() - t_start, 1), "ranking": ranking, "concurrency": {}}
    for c, res in results.items():
        table = out["concurrency"][str(c)] = {}
        for cell, reps in res.items():
            keys = [k for k in reps[0] if k not in ("decode_steps",)]
            table[cell] = {
                **{f"{k}_p50": round(statistics.median(r[k] for r in reps), 4) for k in keys},
                "mask_share_range": [round(min(r["mask_share"] for r in reps), 4),
                                     round(max(r["mask_share"] for r in reps), 4)],
                "repeats": [{k: round(v, 4) for k, v in r.items()} for r in reps],
            }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
