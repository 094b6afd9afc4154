"""Triton kernel: ragged chain speculative sampling (Leviathan et al. 2023, Alg. 1).

Same contract, bit for bit, as the standard mode of the one verification module,
:func:`runtime.speculation.verifier.verify_chain` (read it and the verifier's module docstring
for the layout and the accept / residual / bonus rules, and
:mod:`runtime.kernels.gpu.reference` for the exact integer inverse-CDF draw).

One program per request r:

1. Accept decisions for all ℓ_r drafts at once (a ``BLOCK_K``-wide vector): gather
   p_t(x_k), p_d(x_k), compare ``u·p_d < p_t`` in fp32 — the same single rounded
   product and comparison as torch, so decisions are identical. The accepted length
   is the index of the first rejection (ℓ_r if none).
2. Pass 1 over V (``BLOCK_V`` chunks): int64 sums of the quantised residual
   max(0, p_t − p_d) and of the quantised p_t (fallback when the residual has zero
   mass). For the bonus row p_d is masked to 0, so the residual *is* p_t.
3. Pass 2 over V: the running int64 cumsum; the token is ``#{i : cum_i ≤ t}``.
   Integer addition is exact, so the blocked scan equals ``torch.cumsum``.

Cost: 2 reads of two V-rows per request (~0.8 MB at V = 49152); the grid is R
programs, so small R under-fills the GPU. H200, R = 64, ℓ = 7, V = 49152: 0.089 ms
vs 0.72 ms for the torch reference (docs/benchmarks.md). V is a compile-time
constant (one compile per vocabulary size).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.gpu.reference import chain_offsets, check_chain_shapes


@triton.jit
def quantize_block(w):
    """fp32 block → int64 trunc(clamp(w, 0, 1) · 2**40) (reference.quantize_weights)."""
    w = tl.minimum(tl.maximum(w, 0.0), 1.0)
    return (w * 1099511627776.0).to(tl.int64)


@triton.jit
def cdf_threshold_scalar(u, total):
    """Scalar floor(u_q · total / 2**24) in exact int64 (reference.cdf_threshold)."""
    uq = (u * 16777216.0).to(tl.int64)
    uq = tl.minimum(tl.maximum(uq, 0), 16777215)
    return (total >> 24) * uq + (((total & 16777215) * uq) >> 24)


@triton.jit
def _verify_chain_kernel(
    pt_ptr,
    pd_ptr,
    draft_ptr,
    len_ptr,
    toff_ptr,
    doff_ptr,
    ua_ptr,
    us_ptr,
    next_ptr,
    nacc_ptr,
    stride_t,
    stride_d,
    V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    r = tl.program_id(0)
    L = tl.load(len_ptr + r).to(tl.int64)
    t0 = tl.load(toff_ptr + r)
    d0 = tl.load(doff_ptr + r)
    ks = tl.arange(0, BLOCK_K).to(tl.int64)
    kmask = ks < L
    x = tl.load(draft_ptr + d0 + ks, mask=kmask, other=0)
    pt_x = tl.load(pt_ptr + (t0 + ks) * stride_t + x, mask=kmask, other=0.0)
    pd_x = tl.load(pd_ptr + (d0 + ks) * stride_d + x, mask=kmask, other=0.0)
    u = tl.load(ua_ptr + d0 + ks, mask=kmask, other=0.0)
    reject = (u * pd_x >= pt_x) & kmask
    j = tl.min(tl.where(reject, ks, L), axis=0)  # accepted length

    has_pd = j < L
    t_row = pt_ptr + (t0 + j) * stride_t
    d_row = pd_ptr + (d0 + j) * stride_d
    vs = tl.arange(0, BLOCK_V)
    tot_res = tl.zeros([], dtype=tl.int64)
    tot_pt = tl.zeros([], dtype=tl.int64)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + vs
        vm = offs < V
        pt = tl.load(t_row + offs, mask=vm, other=0.0)
        pd = tl.load(d_row + offs, mask=vm & has_pd, other=0.0)
        tot_res += tl.sum(quantize_block(pt - pd), axis=0)
        tot_pt += tl.sum(quantize_block(pt), axis=0)
    use_res = tot_res > 0
    total = tl.where(use_res, tot_res, tot_pt)
    thr = cdf_threshold_scalar(tl.load(us_ptr + r), total)
    count = tl.zeros([], dtype=tl.int64)
    carry = tl.zeros([], dtype=tl.int64)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + vs
        vm = offs < V
        pt = tl.load(t_row + offs, mask=vm, other=0.0)
        pd = tl.load(d_row + offs, mask=vm & has_pd & use_res, other=0.0)
        q = quantize_block(pt - pd)
        cum = carry + tl.cumsum(q, axis=0)
        count += tl.sum(((cum <= thr) & vm).to(tl.int64), axis=0)
        carry += tl.sum(q, axis=0)
    tl.store(next_ptr + r, tl.minimum(count, V - 1))
    tl.store(nacc_ptr + r, j)


def verify_chain_triton(
    p_target: torch.Tensor,
    p_draft: torch.Tensor,
    draft_tokens: torch.Tensor,
    lengths: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
    *,
    max_len: int | None = None,
    block_v: int | None = None,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged chain speculative sampling on the GPU (Triton; bit-identical to
    :func:`runtime.speculation.verifier.verify_chain`).

    Args:
        p_target: fp32 ``[Σ(ℓ_r+1), V]``; p_draft: fp32 ``[Σℓ_r, V]``;
        draft_tokens: int64 ``[Σℓ_r]``; lengths: int32/int64 ``[R]``;
        u_accept: fp32 ``[Σℓ_r]``; u_sample: fp32 ``[R]`` — all on one device
            (CUDA, or CPU under ``TRITON_INTERPRET=1``).
        max_len: max ℓ_r if known (skips one host sync).
        block_v: vocabulary chunk per loop step (power of two; default
            min(8192, next_pow2(V)), the fastest of 1024–8192 on an H200).
        num_warps: Triton warps per program.

    Returns:
        ``(accepted, next_tokens)`` int64 ``[R]`` each: the fields of
        :class:`runtime.speculation.verifier.VerifyResult` (which
        :func:`runtime.speculation.verifier.verify` wraps them in).

    Raises:
        ValueError: layout errors (:func:`~runtime.kernels.gpu.reference.check_chain_shapes`).
    """
    max_l = check_chain_shapes(p_target, p_draft, draft_tokens, lengths, u_accept, u_sample, max_len)
    dev = p_target.device
    R, V = lengths.numel(), p_target.shape[1]
    lens = lengths.to(dev, torch.int64)
    t_off, d_off = chain_offsets(lens)
    pt = p_target.float().contiguous()
    pd = p_draft.float().contiguous()
    if pd.shape[0] == 0:  # keep a valid pointer; never read (all loads masked)
        pd = torch.zeros(1, V, dtype=torch.float32, device=dev)
    drafts = draft_tokens.to(dev, torch.int64).contiguous()
    if drafts.numel() == 0:
        drafts = torch.zeros(1, dtype=torch.int64, device=dev)
    ua = u_accept.to(dev, torch.float32).contiguous()
    if ua.numel() == 0:
        ua = torch.zeros(1, dtype=torch.float32, device=dev)
    us = u_sample.to(dev, torch.float32).contiguous()
    nxt = torch.empty(R, dtype=torch.int64, device=dev)
    n_acc = torch.empty(R, dtype=torch.int64, device=dev)
    if R == 0:
        return n_acc, nxt
    bv = block_v or min(8192, triton.next_power_of_2(V))
    bk = triton.next_power_of_2(max_l + 1)
    _verify_chain_kernel[(R,)](
        pt, pd, drafts, lens, t_off, d_off, ua, us, nxt, n_acc, pt.stride(0), pd.stride(0),
        V=V, BLOCK_K=bk, BLOCK_V=bv, num_warps=num_warps,
    )  # fmt: skip
    return n_acc, nxt


__all__ = ["verify_chain_triton", "quantize_block", "cdf_threshold_scalar"]
