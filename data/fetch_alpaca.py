"""Rebuild ``data/eval/alpaca.jsonl.gz`` (the DeepSpec alpaca eval prompts), which is not committed.

Alpaca is CC BY-NC 4.0 (non-commercial) and the copy this file is rebuilt from
(open-chinese/alpaca-chinese-dataset) carries no licence file, so it is not redistributed
with this MIT repository; see ``data/README.md``. This script downloads the 53 source parts
at the pinned commit, applies DeepSpec's ``format_alpaca``, shuffles with
``random.Random(980406)``, keeps the first 500 rows (what DeepSpec's evaluator uses) and
refuses to write unless the result's sha256 equals the one in ``data/SHA256SUMS``.

    python data/fetch_alpaca.py            # → data/eval/alpaca.jsonl.gz (~50 MB downloaded)
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMMIT = "7ae6bb212fa9ca487469537e12f35f8386e8eea0"
BASE_URL = f"https://raw.githubusercontent.com/open-chinese/alpaca-chinese-dataset/{COMMIT}/data"
PARTS = 53  # alpaca_chinese_part_{0..52}.json, 52,002 rows in the original Alpaca order
KEEP, SEED = 500, 980406


def expected_sha256(name: str = "eval/alpaca.jsonl") -> str:
    """The recorded sha256 of the uncompressed file (``data/SHA256SUMS``)."""
    sums = dict(reversed(line.split()) for line in (HERE / "SHA256SUMS").read_text().splitlines() if line.strip())
    return sums[name]


def build(base_url: str = BASE_URL) -> bytes:
    """The 500-row ``{"turns": [prompt]}`` JSONL, as DeepSpec's evaluator selects it."""
    rows = []
    for i in range(PARTS):
        with urllib.request.urlopen(f"{base_url}/alpaca_chinese_part_{i}.json") as r:
            rows += json.load(r)
    texts = [r["en_instruction"] + (f"\n\nInput:\n{r['en_input']}" if r["en_input"] else "") for r in rows]
    random.Random(SEED).shuffle(texts)
    return "".join(json.dumps({"turns": [t]}, ensure_ascii=False) + "\n" for t in texts[:KEEP]).encode()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(HERE / "eval" / "alpaca.jsonl.gz"))
    ap.add_argument("--base-url", default=BASE_URL, help="where the parts are (a file:// URL for a local copy)")
    a = ap.parse_args(argv)
    raw = build(a.base_url)
    got, want = hashlib.sha256(raw).hexdigest(), expected_sha256()
    if got != want:
        raise SystemExit(f"sha256 {got} != {want} (data/SHA256SUMS): not written")
    Path(a.out).write_bytes(gzip.compress(raw, mtime=0))
    print(f"{a.out}: {KEEP} rows, sha256 {got}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
