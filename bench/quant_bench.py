"""Serving dtypes of the target vs fp32: top-1 agreement, KL and step time.

Agreement is teacher-forced over the fp32 model's greedy continuations of eval prompts
(first turns of mt-bench, gsm8k, humaneval in turn; chat template; up to ``--max-new``
tokens, stopping at EOS): at every continuation position both models see the same
prefix; agreement = fraction of positions whose argmax matches fp32's, KL = mean
KL(p_fp32 ‖ p_variant) in nats. Prompts are prefilled in one forward and continuations
fed in chunks of ``--chunk`` tokens (16 by default, so int8's matmuls take the few-row
kernel path decoding uses, ``runtime.models.quant.KERNEL_MAX_ROWS``; use ``--chunk 1``
for exactly the decode path, e.g. gguf's kernel rows ≤ 12). Also reported: how many
greedy continuations equal fp32's token for token, and where they first differ.

    PYTHONPATH=. .venv/bin/python bench/quant_bench.py [--variants int8 int8_fp32_head] \
        [--prompts 30] [--max-new 128] [--chunk 16] [--threads 1] [--batch 1 4 16] [--steps 16] [--repeats 5]

Prints JSON. Variants: ``int8`` (what ``dtype="int8"`` serves: int8 decoder projections
and LM head), ``int8_fp32_head`` (int8 projections, fp32 LM head), ``bfloat16`` and
``gguf`` (the GGUF's own Q4_1/Q8_0 blocks, ``runtime.models.gguf_weights``), ``gguf-a8`` (the same with
int8 activations in the Q4_1 projections). ms per decode step:
context 64, one new token per sequence and its logits, median over repeats with the
variants interleaved (the machine is shared); with ``--threads 1`` the ``cpu`` clock (thread
CPU time) is the one to compare on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from training.evaluate import first_turns
from runtime.models.llama import LlamaModel, SeqSpan, load_llama
from runtime.models.loader import ensure_converted
from runtime.models.quant import quantize_llama_

VARIANTS = {
    "int8": lambda mdir: load_llama(mdir, torch.int8),
    "int8_fp32_head": lambda mdir: quantize_llama_(load_llama(mdir, torch.float32), lm_head=False),
    "bfloat16": lambda mdir: load_llama(mdir, torch.bfloat16),
    "gguf": lambda mdir: load_llama(mdir, "gguf"),
    "gguf-a8": lambda mdir: load_llama(mdir, "gguf-a8"),
}


def eval_prompts(n: int) -> list[str]:
    """First turns: the first ⌈n/3⌉ of mt-bench, gsm8k and humaneval (as tests/runtime/speculation/test_spec_engine.py)."""
    out: list[str] = []
    for name in ("mt-bench", "gsm8k", "humaneval"):
        out += first_turns(name)[: (n + 2) // 3]  # the shipped data/eval
    return out[:n]


def chat_ids(tokenizer, text: str) -> list[int]:
    s = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(s, add_special_tokens=False)


def greedy(model: LlamaModel, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Batched greedy continuations (each ends at EOS or after ``max_new`` tokens)."""
    cache = model.new_cache(len(prompts), max(map(len, prompts)) + max_new + 1)
    slots = [cache.allocate() for _ in prompts]
    outs: list[list[int]] = []
    for slot, ids in zip(slots, prompts):
        out = model.forward(torch.tensor(ids), [SeqSpan(slot, 0, len(ids))], cache, torch.tensor([len(ids) - 1]))
        outs.append([int(out.logits[0].argmax())])
    eos = model.cfg.eos_token_id
    while True:
        live = [i for i, o in enumerate(outs) if o[-1] != eos and len(o) < max_new]
        if not live:
            return outs
        spans = [SeqSpan(slots[i], int(cache.lengths[slots[i]]), 1) for i in live]
        out = model.forward(torch.tensor([outs[i][-1] for i in live]), spans, cache, torch.arange(len(live)))
        for i, tok in zip(live, out.logits.argmax(-1).tolist()):
            outs[i].append(tok)


def teacher_forced_logits(model: LlamaModel, prompt: list[int], cont: list[int], chunk: int = 16) -> torch.Tensor:
    """fp32 logits ``[len(cont), vocab]``: row j predicts ``cont[j]`` from prompt + cont[:j]."""
    cache = model.new_cache(1, len(prompt) + len(cont) + 1)
    slot = cache.allocate()
    rows = [model.forward(torch.tensor(prompt), [SeqSpan(slot, 0, len(prompt))], cache,
                          torch.tensor([len(prompt) - 1])).logits]
    fed = cont[:-1]
    for a in range(0, len(fed), chunk):
        part = fed[a : a + chunk]
        rows.append(model.forward(torch.tensor(part), [SeqSpan(slot, len(prompt) + a, len(part))], cache,
                                  torch.arange(len(part))).logits)
    return torch.cat(rows)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for j, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return j
    return None if len(a) == len(b) else min(len(a), len(b))


def quality(ref: LlamaModel, variants: dict[str, LlamaModel], prompts: list[list[int]], max_new: int,
            chunk: int = 16) -> dict:
    conts = greedy(ref, prompts, max_new)
    stats = {k: {"agree": 0, "kl": 0.0, "gaps": []} for k in variants}
    positions = 0
    for prompt, cont in zip(prompts, conts):
        lr = teacher_forced_logits(ref, prompt, cont, chunk)
        positions += lr.shape[0]
        lp_ref = lr.log_softmax(-1)
        top2 = lr.topk(2, dim=-1).values
        for k, m in variants.items():
            lq = teacher_forced_logits(m, prompt, cont, chunk)
            same = lq.argmax(-1) == lr.argmax(-1)
            stats[k]["agree"] += int(same.sum())
            stats[k]["kl"] += float((lp_ref.exp() * (lp_ref - lq.log_softmax(-1))).sum())
            stats[k]["gaps"] += (top2[~same, 0] - top2[~same, 1]).tolist()
    out = {"positions": positions, "ref_tokens_mean": round(positions / len(prompts), 1)}
    for k, m in variants.items():
        s = stats[k]
        g = greedy(m, prompts, max_new)
        div = [first_divergence(a, b) for a, b in zip(conts, g)]
        div_at = [d if d is not None else len(c) for d, c in zip(div, conts)]
        out[k] = {
            "top1_agreement": round(s["agree"] / positions, 4),
            "mean_kl_nats": round(s["kl"] / positions, 5),
            "disagreements": positions - s["agree"],
            "fp32_top2_gap_at_disagreements_p50": round(statistics.median(s["gaps"]), 3) if s["gaps"] else None,
            "greedy_identical": f"{sum(d is None for d in div)}/{len(div)}",
            "greedy_first_divergence_p50": statistics.median(div_at),
        }
    return out


def step_ms(models: dict[str, LlamaModel], batches: list[int], steps: int, repeats: int, context: int = 64) -> dict:
    """ms per decode step (with each sequence's logits) per model and batch size, median
    over ``repeats``: ``wall`` (perf_counter) and ``cpu`` (this thread's CPU time — with one
    torch thread all compute runs here, so it excludes time lost to other processes)."""
    res: dict[str, dict] = {"wall": {k: {} for k in models}, "cpu": {k: {} for k in models}}
    g = torch.Generator().manual_seed(0)
    for b in batches:
        times: dict[str, dict[str, list[float]]] = {c: {k: [] for k in models} for c in res}
        for _ in range(repeats):
            for k, m in models.items():
                cache = m.new_cache(b, context + steps + 2)
                slots = [cache.allocate() for _ in range(b)]
                prompt = torch.randint(100, 1000, (b * context,), generator=g)
                m.forward(prompt, [SeqSpan(s, 0, context) for s in slots], cache)
                m.forward(torch.randint(100, 1000, (b,), generator=g), [SeqSpan(s, context, 1) for s in slots], cache,
                          torch.arange(b))  # warm-up step
                t, c = time.perf_counter(), time.thread_time()
                for i in range(steps):
                    spans = [SeqSpan(s, context + 1 + i, 1) for s in slots]
                    m.forward(torch.randint(100, 1000, (b,), generator=g), spans, cache, torch.arange(b))
                times["cpu"][k].append((time.thread_time() - c) / steps * 1e3)
                times["wall"][k].append((time.perf_counter() - t) / steps * 1e3)
        for clock in res:
            for k in models:
                res[clock][k][f"batch{b}"] = round(statistics.median(times[clock][k]), 1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["int8", "int8_fp32_head"])
    ap.add_argument("--prompts", type=int, default=30)
    ap.add_argument("--chunk", type=int, default=16, help="continuation tokens per teacher-forced forward")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-quality", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoTokenizer

    mdir = ensure_converted()
    tok = AutoTokenizer.from_pretrained(str(mdir))
    ref = load_llama(mdir, torch.float32)
    variants = {name: VARIANTS[name](mdir) for name in a.variants}
    out: dict = {"threads": a.threads, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                 "torch": torch.__version__}
    if not a.skip_quality:
        prompts = [chat_ids(tok, p) for p in eval_prompts(a.prompts)]
        t = time.perf_counter()
        out["quality"] = {"prompts": len(prompts), "max_new": a.max_new, "chunk": a.chunk,
                          **quality(ref, variants, prompts, a.max_new, a.chunk)}
        out["quality"]["seconds"] = round(time.perf_counter() - t, 1)
    out["ms_per_step"] = step_ms({"float32": ref, **variants}, a.batch, a.steps, a.repeats)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
