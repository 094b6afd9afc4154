"""Benchmark + correctness check of the GPU verification kernels vs the torch reference.

Usage::

    PYTHONPATH=. python bench/kernels_bench.py [--out kernels.json] [--reps N]

On CUDA (with triton): checks Triton == reference (exact accept decisions and
tokens for chain verification; Markov tokens and p_d within 1e-5), then times
kernel and reference with ``triton.testing.do_bench`` (median) at the DSpark
serving shape: verification R = 64 requests × ℓ = 7 drafts × V = 49152;
Markov sampling B = 64 × γ = 7 × V = 49152, r = 64. On CPU it times the torch
reference only (median of ``--reps`` wall-clock runs) and says so in the JSON.
Prints one JSON object (also written to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from runtime.speculation.verifier import verify_chain
from runtime.kernels import dispatch
from runtime.kernels.gpu.reference import chain_offsets, markov_sample_reference


def chain_inputs(lengths: list[int], V: int, dev: str, seed: int, noise: float = 0.7):
    """Random ragged verification inputs (drafts drawn from p_draft ≈ p_target)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    lens = torch.tensor(lengths, dtype=torch.int64, device=dev)
    R, D = len(lengths), sum(lengths)
    base = torch.randn(D + R, V, generator=g, device=dev) * 2.0
    pt = torch.softmax(base, -1)
    t_off, _ = chain_offsets(lens)
    judged = torch.cat([torch.arange(o, o + n, device=dev) for o, n in zip(t_off.tolist(), lengths)])
    pd = torch.softmax(base[judged] + noise * torch.randn(D, V, generator=g, device=dev), -1)
    x = torch.multinomial(pd, 1, generator=g).squeeze(1) if D else torch.zeros(0, dtype=torch.int64, device=dev)
    return pt, pd, x, lens, torch.rand(D, generator=g, device=dev), torch.rand(R, generator=g, device=dev)


def markov_inputs(B: int, G: int, V: int, r: int, dev: str, seed: int, dtype=torch.float32):
    """Random Markov-sampler inputs; temperatures cycle greedy / 0.7 / 1.0."""
    g = torch.Generator(device=dev).manual_seed(seed)
    U = (torch.randn(B, G, V, generator=g, device=dev) * 2.0).to(dtype)
    w1 = torch.randn(V, r, generator=g, device=dev) * 0.1
    w2 = torch.randn(r, V, generator=g, device=dev) * 0.1
    anc = torch.randint(0, V, (B,), generator=g, device=dev)
    temp = torch.tensor([0.0, 0.7, 1.0], device=dev).repeat(B // 3 + 1)[:B]
    u = torch.rand(B, G, generator=g, device=dev)
    return U, w1, w2, anc, temp, u


VERIFY_CASES = [([0, 1, 3, 7, 2], 256, 0.7), ([7] * 64, 49152, 0.3), ([i % 8 for i in range(64)], 49152, 1.0), ([0] * 8, 1000, 0.5)]
MARKOV_CASES = [(3, 4, 128, 8, torch.float32), (64, 7, 49152, 64, torch.float32), (64, 7, 49152, 64, torch.bfloat16)]
SMOKE_VERIFY_CASES = [([0, 1, 3, 7, 2], 256, 0.7), ([0] * 3, 100, 0.5)]
SMOKE_MARKOV_CASES = [(3, 4, 128, 8, torch.float32), (5, 3, 300, 16, torch.bfloat16)]


def check_verify(verify_triton, dev: str, cases=VERIFY_CASES) -> dict:
    """Exact agreement of the Triton verify kernel with the torch verifier
    (:func:`runtime.speculation.verifier.verify_chain`) on several shapes."""
    out, total_tok, mism, acc_mism = [], 0, 0, 0
    for i, (lengths, V, noise) in enumerate(cases):
        for seed in range(3):
            args = chain_inputs(lengths, V, dev, seed=100 * i + seed, noise=noise)
            ref, (acc, nxt) = verify_chain(*args), verify_triton(*args)
            acc_mism += int((ref.accepted != acc).sum())
            mism += int((ref.next_tokens != nxt).sum())
            total_tok += nxt.numel()
        out.append({"lengths": f"{len(lengths)} reqs, max {max(lengths)}", "V": V, "mean_accepted": float(ref.accepted.float().mean())})
    return {"cases": out, "accept_mismatches": acc_mism, "token_mismatches": mism, "tokens_compared": total_tok, "ok": acc_mism == 0 and mism == 0}


def check_markov(markov_triton, dev: str, cases=MARKOV_CASES, **kw) -> dict:
    """Markov kernel vs reference: token mismatches and max |Δp_d| (tolerance 1e-5)."""
    rows, mism, total, max_dp, emb_exact = [], 0, 0, 0.0, True
    for i, (B, G, V, r, dtype) in enumerate(cases):
        args = markov_inputs(B, G, V, r, dev, seed=7 + i, dtype=dtype)
        ref, got = markov_sample_reference(*args), markov_triton(*args, **kw)
        m = int((ref.tokens != got.tokens).sum())
        dp = float((ref.p_draft - got.p_draft).abs().max())
        mism, total, max_dp = mism + m, total + ref.tokens.numel(), max(max_dp, dp)
        emb_exact &= bool(torch.equal(ref.prev_embeddings, got.prev_embeddings))
        rows.append({"B": B, "gamma": G, "V": V, "r": r, "dtype": str(dtype).split(".")[-1], "token_mismatches": m, "max_abs_dp": dp})
    return {"cases": rows, "token_mismatches": mism, "tokens_compared": total, "max_abs_dp": max_dp, "embeddings_exact": emb_exact, "ok": mism == 0 and max_dp <= 1e-5 and emb_exact}


def optional(fn, *args, **kw):
    """Run an optional variant; an exception becomes {"error": ...} instead of aborting the bench."""
    try:
        return fn(*args, **kw)
    except Exception as exc:  # pragma: no cover - diagnostic only
        return {"error": repr(exc)[:300]}


def gpu_time_ms(fn) -> float:
    """Median milliseconds of ``fn`` via triton.testing.do_bench."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def graph_time_ms(fn) -> float | None:
    """Median ms of ``fn`` replayed as a CUDA graph (launch overhead removed); None if capture fails."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return gpu_time_ms(graph.replay)
    except Exception as exc:  # pragma: no cover - diagnostic only
        print(f"graph capture failed: {exc!r}", file=sys.stderr)
        return None


def cpu_time_ms(fn, reps: int) -> float:
    """Median wall-clock milliseconds of ``fn`` over ``reps`` runs (after one warm-up)."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--reps", type=int, default=5, help="CPU timing repetitions")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes; on CPU with TRITON_INTERPRET=1 also runs the kernel path (tests this script)",
    )
    ap.add_argument("--sweep", action="store_true", help="on CUDA also time block-size variants")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    if a.smoke:
        R, L, V, B, G, r = 8, 3, 512, 6, 3, 16
        vcases, mcases = SMOKE_VERIFY_CASES, SMOKE_MARKOV_CASES
    else:
        R, L, V, B, G, r = 64, 7, 49152, 64, 7, 64
        vcases, mcases = VERIFY_CASES, MARKOV_CASES
    res: dict = {
        "device": torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "shapes": {"verify": {"R": R, "ell": L, "V": V}, "markov": {"B": B, "gamma": G, "V": V, "r": r}},
    }
    vargs = chain_inputs([L] * R, V, dev, seed=1)
    margs = markov_inputs(B, G, V, r, dev, seed=2)
    margs_bf16 = markov_inputs(B, G, V, r, dev, seed=2, dtype=torch.bfloat16)
    ref_v = lambda: verify_chain(*vargs, max_len=L)  # noqa: E731
    ref_m = lambda: markov_sample_reference(*margs)  # noqa: E731
    if (cuda or (a.smoke and interp)) and dispatch.triton_available():
        import triton

        from runtime.kernels.gpu.triton_markov import markov_sample_triton
        from runtime.kernels.gpu.triton_verify import verify_chain_triton

        timer = gpu_time_ms if cuda else (lambda fn: cpu_time_ms(fn, a.reps))
        graph = graph_time_ms if cuda else (lambda fn: None)
        torch.backends.cuda.matmul.allow_tf32 = False
        res["mode"] = "cuda: Triton kernels vs torch reference" if cuda else "cpu smoke: Triton interpreter vs torch reference"
        res["triton"] = triton.__version__
        res["dispatch_backend"] = dispatch.backend_for(vargs[0])
        res["check_verify"] = check_verify(verify_chain_triton, dev, vcases)
        res["check_markov"] = check_markov(markov_sample_triton, dev, mcases)
        if cuda:
            res["check_markov_ieee"] = optional(check_markov, markov_sample_triton, dev, mcases, precision="ieee")
            one = [(64, 1, 49152, 64, torch.float32)]  # one step: no cascade after a mismatch
            res["check_markov_ieee_1step"] = optional(check_markov, markov_sample_triton, dev, one, precision="ieee")
        kv = lambda: verify_chain_triton(*vargs, max_len=L)  # noqa: E731
        km = lambda: markov_sample_triton(*margs)  # noqa: E731
        km3 = lambda: markov_sample_triton(*margs, precision="ieee")  # noqa: E731
        t = {
            "verify_triton_ms": timer(kv),
            "verify_reference_ms": timer(ref_v),
            "markov_triton_ms": timer(km),
            "markov_triton_ieee_ms": optional(timer, km3) if cuda else None,
            "markov_triton_bf16U_ms": timer(lambda: markov_sample_triton(*margs_bf16)),
            "markov_reference_ms": timer(ref_m),
            "markov_reference_bf16U_ms": timer(lambda: markov_sample_reference(*margs_bf16)),
            "verify_triton_graph_ms": graph(kv),
            "verify_reference_graph_ms": graph(ref_v),
            "markov_triton_graph_ms": graph(km),
            "markov_reference_graph_ms": graph(ref_m),
        }
        if cuda and a.sweep:  # tunables: eager for verify (1 launch), graph replay for Markov (3γ launches)
            t["sweep_verify_ms"] = {
                f"block_v={bv},warps={nw}": optional(timer, lambda bv=bv, nw=nw: verify_chain_triton(*vargs, max_len=L, block_v=bv, num_warps=nw))
                for bv in (1024, 2048, 4096, 8192)
                for nw in (4, 8)
            }
            t["sweep_markov_graph_ms"] = {
                f"block_v={bv},chunk={ck}": graph(lambda bv=bv, ck=ck: markov_sample_triton(*margs, block_v=bv, chunk=ck))
                for bv, ck in ((64, 1024), (128, 1024), (256, 1024), (128, 512), (128, 2048), (128, 4096))
            }
        t["verify_speedup"] = t["verify_reference_ms"] / t["verify_triton_ms"]
        t["markov_speedup"] = t["markov_reference_ms"] / t["markov_triton_ms"]
        # Minimum traffic: verify reads 2 V-rows per request twice (2 passes); Markov reads U
        # and W2 once per step, writes p_d once (actual traffic is ~3x p_d: scratch logits).
        t["verify_GBps_2pass"] = R * 2 * 2 * V * 4 / (t["verify_triton_ms"] * 1e6)
        t["markov_GBps_min"] = (B * G * V * 8 + G * r * V * 4) / (t["markov_triton_ms"] * 1e6)
        res["timing"] = t
        res["ok"] = res["check_verify"]["ok"] and res["check_markov"]["ok"]
    else:
        why = "no CUDA" if not cuda else "no triton"
        res["mode"] = f"cpu: torch reference timing only ({why}); Triton kernels not timed"
        res["timing"] = {"verify_reference_ms": cpu_time_ms(ref_v, a.reps), "markov_reference_ms": cpu_time_ms(ref_m, a.reps), "reps": a.reps}
        res["ok"] = True
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text + "\n")
    if not res["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
