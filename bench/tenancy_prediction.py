"""Prediction error of SLA admission's speed model against the real engine.

Runs the real gateway (embedded engine, real model, in-process over ASGI) with one
tenant in a tier with a tokens/s target, sends waves of ``n`` concurrent streaming
requests (n = 1, 2, 4, 8 by default, each ``--tokens`` long, ``--reps`` waves per n)
and compares, per request, the tok/s the admission controller predicted when it
admitted the request (``request_records.predicted_tokens_per_s``) with the measured
decode tok/s (``decode_tokens_per_s``, the project's one definition). Prints a
Markdown table (signed error = predicted/measured − 1) and writes JSON with ``--out``.
"fitted model at n" is the speed model as fitted at the end, evaluated at the wave's
real concurrency (admission-time predictions only know the batch at admission).

Usage::

    PYTHONPATH=. python bench/tenancy_prediction.py [--dtype float32] [--spec none]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

from gateway.core.config import Settings
from gateway.crud import records as crud_records
from gateway.db.migrate import upgrade_async
from gateway.main import create_app

ADMIN = "bench-admin"


async def stream(client: httpx.AsyncClient, key: str, tokens: int, i: int) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "stream": True, "max_tokens": tokens, "ignore_eos": True,
            "temperature": 0, "messages": [{"role": "user", "content": f"Tell me about the number {i}."}]}
    r = await client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    r.raise_for_status()


async def main(args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp())
    url = f"sqlite+aiosqlite:///{tmp}/bench.db"
    await upgrade_async(url)
    settings = Settings(_env_file=None, database_url=url, admin_token=ADMIN, dtype=args.dtype,
                        spec_method=args.spec, max_batch_size=16, max_context=1024)
    app = create_app(settings)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with app.router.lifespan_context(app):
        await app.state.backend_start
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench", timeout=600) as c:
            await c.post("/admin/v1/tiers", json={"name": "gold", "min_tokens_per_s": 1, "priority": 1}, headers=admin)
            await c.post("/admin/v1/tenants", json={"name": "bench", "tier": "gold"}, headers=admin)
            key = (await c.post("/admin/v1/keys", json={"tenant": "bench", "user": "u"}, headers=admin)).json()["key"]
            await stream(c, key, 8, -1)  # warm-up (not measured below: n = 0 group)
            for n in args.concurrency:
                for _ in range(args.reps):
                    await asyncio.gather(*(stream(c, key, args.tokens, i) for i in range(n)))
            await app.state.records.flush()
            async with app.state.sessionmaker() as s:
                rows, _ = await crud_records.query_records(s, tenant="bench", limit=10_000)
            model = app.state.admission.model
            fitted = {n: model.predict(n) for n in args.concurrency}
            step_samples = {n: round(v, 4) for n, v in sorted(model._per_n().items())}
    rows = sorted(rows, key=lambda r: r.queued_at)[1:]  # drop the warm-up
    out, i = [], 0
    for n in args.concurrency:
        group = rows[i : i + n * args.reps]
        i += n * args.reps
        pairs = [(r.predicted_tokens_per_s, r.decode_tokens_per_s) for r in group
                 if r.predicted_tokens_per_s and r.decode_tokens_per_s]
        errs = [p / m - 1 for p, m in pairs]
        measured = statistics.median(m for _, m in pairs)
        out.append({"concurrency": n, "requests": len(pairs), "fitted_model": fitted[n],
                    "fitted_error": fitted[n] / measured - 1,
                    "predicted_median": statistics.median(p for p, _ in pairs),
                    "measured_median": statistics.median(m for _, m in pairs),
                    "signed_error_median": statistics.median(errs),
                    "abs_error_mean": statistics.fmean(abs(e) for e in errs)})
    return {"dtype": args.dtype, "spec": args.spec, "tokens": args.tokens, "reps": args.reps, "rows": out,
            "step_seconds_by_batch": step_samples}


def table(result: dict) -> str:
    lines = ["| concurrent | requests | measured tok/s (median) | predicted at admission (median) | "
             "signed error (median) | mean abs error | fitted model at n | its error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['concurrency']} | {r['requests']} | {r['measured_median']:.1f} | "
                     f"{r['predicted_median']:.1f} | {r['signed_error_median']:+.1%} | {r['abs_error_mean']:.1%} | "
                     f"{r['fitted_model']:.1f} | {r['fitted_error']:+.1%} |")
    lines.append(f"\nmedian seconds per decode step by batch size: {result['step_seconds_by_batch']}")
    return "\n".join(lines)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--spec", default="none", help="engine spec_method (none, dspark, parallel, prompt_lookup)")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    res = asyncio.run(main(a))
    print(table(res))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    sys.exit(0)
