"""Triton kernels: DSpark Markov-head sequential draft sampling (paper §3.1).

Same contract as :func:`runtime.kernels.gpu.reference.markov_sample_reference`:
for k = 1..γ, ``logits_k = U_k + W1[x_{k−1}]·W2`` (x_0 = anchor),
``p_k = softmax(logits_k / T)`` (greedy T = 0: one-hot argmax, ties → lowest
index), ``x_k`` = the exact integer inverse-CDF draw of p_k with ``u_k``
(reference module docstring).

Step k depends on x_{k−1}, which depends on a reduction over the whole vocabulary,
so a single program per row would have to stream W2 (r·V·4 bytes, 12.6 MB at
r = 64, V = 49152) once per row and step — ~B× more traffic than needed and only
B programs. Instead each step is three launches, each fused over its phase and
split over the vocabulary so the grid fills the GPU; no grid-wide barrier needed:

1. ``_markov_logits_kernel`` grid (⌈B/BM⌉, ⌈V/BLOCK_V⌉): gathers E = W1[x_{k−1}]
   for BM rows, computes ``(U_k + E·W2[:, chunk]) / T`` with one ``tl.dot`` (so each
   W2 tile is read once per BM rows; fp32 inputs at ``input_precision="tf32x3"`` by
   default, see below),
   writes the scaled logits into the p_d output (used as scratch), and per-chunk
   partials (max, Σexp(l − max), argmax).
2. ``_markov_normalize_kernel`` grid (B, ⌈V/CHUNK⌉): combines the partials into the
   row max m and Σ = Σ_c s_c·exp(m_c − m), writes p = exp(l − m)/Σ (or the one-hot
   at the argmax for greedy rows) and the chunk's int64 sum of quantised p.
3. ``_markov_draw_kernel`` grid (B,): from the chunk sums, the exact threshold and
   the chunk holding the token; an int64 cumsum inside that chunk gives the token
   (bit-identical to a full-row ``torch.cumsum`` of the same quantised p).

Precision of E·W2: ``"tf32x3"`` (three TF32 tensor-core products, ~fp32 accuracy)
is the default because on an H200 (Triton 3.6) it matched the fp32 torch reference
best: 0 token mismatches in 908 draws at B = 64, γ = 7, V = 49152, r = 64, max |Δp_d|
1.7e−7, 0.47 ms. ``"ieee"`` (CUDA-core FMA) ran 6.4 ms there and its chains diverged
from the reference twice in 908 draws (one step: max |Δp_d| 7.5e−7), so it is kept only
as an option (docs/benchmarks.md). The interpreter ignores the setting.

V is a compile-time constant (one compile per vocabulary size; it also avoids a
loop-bound bug of the Triton 3.6 interpreter with NumPy 2).

p_d agrees with torch's softmax to fp32 rounding (different summation order and
``exp``); tokens then agree except when u falls within that rounding of a CDF
boundary (reference module docstring). top-k / top-p are not supported:
:func:`runtime.kernels.dispatch.fused_markov_supported`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.gpu.reference import MarkovResult, check_markov_shapes
from runtime.kernels.gpu.triton_verify import cdf_threshold_scalar, quantize_block


@triton.jit
def _markov_logits_kernel(
    u_ptr,
    w1_ptr,
    w2_ptr,
    prev_ptr,
    prev_stride,
    temp_ptr,
    pd_ptr,
    emb_ptr,
    pmax_ptr,
    psum_ptr,
    pidx_ptr,
    k,
    B,
    G,
    V: tl.constexpr,
    R: tl.constexpr,
    NS1: tl.constexpr,
    BM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_b = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = (pid_b * BM + tl.arange(0, BM)).to(tl.int64)
    rmask = rows < B
    x_prev = tl.load(prev_ptr + rows * prev_stride, mask=rmask, other=0)
    rs = tl.arange(0, BLOCK_R)
    rsm = rs < R
    e = tl.load(w1_ptr + x_prev[:, None] * R + rs[None, :], mask=rmask[:, None] & rsm[None, :], other=0.0)
    slot = rows * G + k  # row of [B·γ, ·] views
    if pid_v == 0:
        tl.store(emb_ptr + slot[:, None] * R + rs[None, :], e, mask=rmask[:, None] & rsm[None, :])
    offs = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    vm = offs < V
    w2 = tl.load(w2_ptr + rs[:, None] * V + offs[None, :], mask=rsm[:, None] & vm[None, :], other=0.0)
    bias = tl.dot(e, w2, input_precision=PRECISION)
    m2 = rmask[:, None] & vm[None, :]
    base = tl.load(u_ptr + slot[:, None] * V + offs[None, :], mask=m2, other=0.0).to(tl.float32)
    t = tl.load(temp_ptr + rows, mask=rmask, other=1.0)
    t = tl.where(t > 0, t, 1.0)
    lg = (base + bias) / t[:, None]
    tl.store(pd_ptr + slot[:, None] * V + offs[None, :], lg, mask=m2)
    lm = tl.where(vm[None, :], lg, float("-inf"))
    cmax = tl.max(lm, axis=1)
    csum = tl.sum(tl.exp(lm - cmax[:, None]), axis=1)
    cidx = tl.argmax(lm, axis=1, tie_break_left=True).to(tl.int64) + pid_v * BLOCK_V
    part = rows * NS1 + pid_v
    tl.store(pmax_ptr + part, cmax, mask=rmask)
    tl.store(psum_ptr + part, csum, mask=rmask)
    tl.store(pidx_ptr + part, cidx, mask=rmask)


@triton.jit
def _row_stats(pmax_ptr, psum_ptr, pidx_ptr, b, V: tl.constexpr, NS1: tl.constexpr, NS1_BLOCK: tl.constexpr):
    """Combine a row's chunk partials: (max, Σexp(l − max), lowest argmax)."""
    cs = tl.arange(0, NS1_BLOCK)
    cm = cs < NS1
    pm = tl.load(pmax_ptr + b * NS1 + cs, mask=cm, other=float("-inf"))
    ps = tl.load(psum_ptr + b * NS1 + cs, mask=cm, other=0.0)
    pi = tl.load(pidx_ptr + b * NS1 + cs, mask=cm, other=V)
    m = tl.max(pm, axis=0)
    s = tl.sum(tl.where(cm, ps * tl.exp(pm - m), 0.0), axis=0)
    gidx = tl.min(tl.where(cm & (pm == m), pi, V), axis=0)
    return m, s, gidx


@triton.jit
def _markov_normalize_kernel(
    pd_ptr,
    temp_ptr,
    pmax_ptr,
    psum_ptr,
    pidx_ptr,
    qtot_ptr,
    k,
    G,
    V: tl.constexpr,
    NS1: tl.constexpr,
    NS1_BLOCK: tl.constexpr,
    NS2: tl.constexpr,
    CHUNK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    m, s, gidx = _row_stats(pmax_ptr, psum_ptr, pidx_ptr, b, V, NS1, NS1_BLOCK)
    greedy = tl.load(temp_ptr + b) <= 0
    offs = c * CHUNK + tl.arange(0, CHUNK)
    vm = offs < V
    ptr = pd_ptr + (b * G + k) * V + offs
    lg = tl.load(ptr, mask=vm, other=float("-inf"))
    p = tl.exp(lg - m) / s
    p = tl.where(greedy, (offs == gidx).to(tl.float32), p)
    tl.store(ptr, p, mask=vm)
    tl.store(qtot_ptr + b * NS2 + c, tl.sum(tl.where(vm, quantize_block(p), 0), axis=0))


@triton.jit
def _markov_draw_kernel(
    pd_ptr,
    temp_ptr,
    unif_ptr,
    pmax_ptr,
    psum_ptr,
    pidx_ptr,
    qtot_ptr,
    tok_ptr,
    k,
    G,
    V: tl.constexpr,
    NS1: tl.constexpr,
    NS1_BLOCK: tl.constexpr,
    NS2: tl.constexpr,
    NS2_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    cs = tl.arange(0, NS2_BLOCK)
    qt = tl.load(qtot_ptr + b * NS2 + cs, mask=cs < NS2, other=0)
    total = tl.sum(qt, axis=0)
    thr = cdf_threshold_scalar(tl.load(unif_ptr + b * G + k), total)
    cq = tl.cumsum(qt, axis=0)
    cstar = tl.sum(((cq <= thr) & (cs < NS2)).to(tl.int64), axis=0)  # chunk holding the token
    before = tl.sum(tl.where(cs < cstar, qt, 0), axis=0)
    offs = cstar * CHUNK + tl.arange(0, CHUNK)
    vm = offs < V
    p = tl.load(pd_ptr + (b * G + k) * V + offs, mask=vm, other=0.0)
    cum = before + tl.cumsum(quantize_block(p), axis=0)
    tok = cstar * CHUNK + tl.sum(((cum <= thr) & vm).to(tl.int64), axis=0)
    tok = tl.minimum(tok, V - 1)
    _, _, gidx = _row_stats(pmax_ptr, psum_ptr, pidx_ptr, b, V, NS1, NS1_BLOCK)
    greedy = tl.load(temp_ptr + b) <= 0
    tl.store(tok_ptr + b * G + k, tl.where(greedy, gidx, tok))


def markov_sample_triton(
    base_logits: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    anchors: torch.Tensor,
    temperature: torch.Tensor,
    uniforms: torch.Tensor,
    *,
    return_probs: bool = True,
    block_v: int = 128,
    chunk: int = 1024,
    precision: str = "tf32x3",
) -> MarkovResult:
    """Markov-head sequential draft sampling on the GPU (3 Triton launches per step).

    Args:
        base_logits: fp32 or bf16 ``[B, γ, V]`` parallel-backbone logits U.
        w1: fp32 ``[V, r]``; w2: fp32 ``[r, V]`` (other float dtypes are cast).
        anchors: int64 ``[B]``; temperature: fp32 ``[B]`` (≤ 0 = greedy);
        uniforms: fp32 ``[B, γ]`` — all on one device (CUDA, or CPU under
            ``TRITON_INTERPRET=1``).
        return_probs: return p_d (it is computed either way: it is the scratch).
        block_v: vocabulary tile of the logits kernel (power of two ≥ 16).
        chunk: vocabulary chunk of the normalise / draw kernels (power of two).
        precision: ``tl.dot`` input precision for E·W2: ``"tf32x3"`` (default;
            tensor cores at ~fp32 accuracy) or ``"ieee"`` (CUDA-core fp32 FMA;
            slower and, measured, less faithful — module docstring).

    Returns:
        :class:`~runtime.kernels.gpu.reference.MarkovResult`.

    Raises:
        ValueError: shapes (:func:`~runtime.kernels.gpu.reference.check_markov_shapes`).
    """
    B, G, V, r = check_markov_shapes(base_logits, w1, w2, anchors, temperature, uniforms)
    dev = base_logits.device
    U = base_logits if base_logits.dtype in (torch.float32, torch.bfloat16) else base_logits.float()
    U = U.contiguous()
    w1f = w1.to(dev, torch.float32).contiguous()
    w2f = w2.to(dev, torch.float32).contiguous()
    anc = anchors.to(dev, torch.int64).contiguous()
    temp = temperature.to(dev, torch.float32).contiguous()
    unif = uniforms.to(dev, torch.float32).contiguous()
    tokens = torch.empty(B, G, dtype=torch.int64, device=dev)
    pd = torch.empty(B, G, V, dtype=torch.float32, device=dev)
    emb = torch.empty(B, G, r, dtype=torch.float32, device=dev)
    if B == 0 or G == 0:
        return MarkovResult(tokens, pd if return_probs else None, emb)
    bm = min(64, max(16, triton.next_power_of_2(B)))
    block_r = max(16, triton.next_power_of_2(r))
    bv = max(16, min(block_v, triton.next_power_of_2(V)))
    ck = min(chunk, triton.next_power_of_2(V))
    ns1, ns2 = triton.cdiv(V, bv), triton.cdiv(V, ck)
    ns1_block, ns2_block = triton.next_power_of_2(ns1), triton.next_power_of_2(ns2)
    pmax = torch.empty(B, ns1, dtype=torch.float32, device=dev)
    psum = torch.empty(B, ns1, dtype=torch.float32, device=dev)
    pidx = torch.empty(B, ns1, dtype=torch.int64, device=dev)
    qtot = torch.empty(B, ns2, dtype=torch.int64, device=dev)
    for k in range(G):
        prev, prev_stride = (anc, 1) if k == 0 else (tokens[:, k - 1], G)
        _markov_logits_kernel[(triton.cdiv(B, bm), ns1)](
            U, w1f, w2f, prev, prev_stride, temp, pd, emb, pmax, psum, pidx, k, B, G,
            V=V, R=r, NS1=ns1, BM=bm, BLOCK_R=block_r, BLOCK_V=bv, PRECISION=precision,
        )  # fmt: skip
        _markov_normalize_kernel[(B, ns2)](
            pd, temp, pmax, psum, pidx, qtot, k, G,
            V=V, NS1=ns1, NS1_BLOCK=ns1_block, NS2=ns2, CHUNK=ck,
        )  # fmt: skip
        _markov_draw_kernel[(B,)](
            pd, temp, unif, pmax, psum, pidx, qtot, tokens, k, G,
            V=V, NS1=ns1, NS1_BLOCK=ns1_block, NS2=ns2, NS2_BLOCK=ns2_block, CHUNK=ck,
        )  # fmt: skip
    return MarkovResult(tokens=tokens, p_draft=pd if return_probs else None, prev_embeddings=emb)


__all__ = ["markov_sample_triton"]
