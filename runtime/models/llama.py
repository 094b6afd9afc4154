"""A lean Llama-architecture model for the target (SmolLM2-135M-Instruct).

RMSNorm, rotary embeddings (rotate-half layout, as in HF Llama), grouped-query
attention over a slot KV cache (:mod:`runtime.engine.kv_cache`), SwiGLU MLP, tied LM head.

The forward is ONE flattened ragged pass over all scheduled tokens of all
sequences: the token dimension ``T = Σ_i n_i`` concatenates ``n_i`` new tokens of
sequence ``i`` (1 for a decode step, k+1 for speculative verification of k
drafts, a chunk for prefill). Projections/MLP run on the flat ``[T, d]`` tensor
with no padding; attention runs per sequence over a view of its cache slot
(``[:length + n_i]``, no copy), causal within the new tokens. New K/V are written
into the cache and the cached length advances by ``n_i``; rolling back rejected
drafts is :meth:`KVCache.truncate`. Hidden states of chosen layers are returned
for the DSpark drafter (paper §3.1: "context features").
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from runtime.engine.kv_cache import KVCache


@contextlib.contextmanager
def torch_threads(n: int):
    """Run the block with ``n`` torch intra-op threads, then restore the count (0: no change).

    With the gguf dtype torch runs on one thread between the kernels (their own pool does
    the parallel work, see ``LLMEngine``); eager work that is made of larger torch ops
    (prefill chunks, drafting) gets the threads back for its duration."""
    if n <= 0:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class LlamaConfig:
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    max_position: int = 8192
    tie_word_embeddings: bool = True
    bos_token_id: int = 1
    eos_token_id: int = 2

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlamaConfig":
        """Build from a transformers ``config.json`` dict (Llama family)."""
        rope = cfg.get("rope_parameters") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            max_position=cfg.get("max_position_embeddings", 8192),
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
            bos_token_id=cfg.get("bos_token_id", 1),
            eos_token_id=cfg.get("eos_token_id", 2),
        )


#: fp32 inputs of 2..SMALL_M_MAX rows go through ``W·Xᵀ`` (:func:`linear`)
SMALL_M_MAX = 32
#: Row counts that ``W·Xᵀ`` runs slower than a larger one, and the count to pad them to.
_FP32_PAD = {3: 4, 7: 8, **{m: 16 for m in range(10, 16)}, 19: 24, 21: 24, 22: 24, 23: 24,
             26: 32, 27: 32, 29: 32, 30: 32, 31: 32}
#: ``FP32_PADDED_ROWS[m]``: the rows ``W·Xᵀ`` computes for ``m`` fp32 input rows (m ≤ SMALL_M_MAX):
#: ``m`` itself, or more (zero rows appended) where that whole decode step is faster. Measured on
#: the Zen 3 EPYC (AVX2 only, MKL, 2 threads; bench/fp32_gemm.py --routes wxt padded, docs/benchmarks.md
#: "Pricing verified rows on the Zen 3 EPYC"): 3 → 4 rows 1.39×, 7 → 8 1.18×, 10–15 → 16 1.13–1.44×, 19–23 → 24
#: 1.14–1.25×, 27/31 → 32 1.30×; counts where padding measured 0.90–0.99× (5, 6, 9, 17, 20, …) stay.
FP32_PADDED_ROWS: tuple[int, ...] = tuple(_FP32_PAD.get(m, m) for m in range(SMALL_M_MAX + 1))


#: fp32 inputs of 2..PACKED_M_MAX rows multiply a weight MKL packed once (:func:`pack_fp32_weights_`)
PACKED_M_MAX = 24


def mkl_packing_available() -> bool:
    """Whether this torch build has MKL's packed-GEMM ops (``torch.ops.mkl._mkl_linear``)."""
    try:
        return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
    except (AttributeError, RuntimeError):
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """MKL's packed copy of an fp32 CPU weight ``[out, in]`` for :func:`linear` (at least the
    weight's size again in memory), or ``None`` where packing is unavailable or its product
    disagrees with ``F.linear`` beyond fp32 rounding on a probe (checked once per weight)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2 or not mkl_packing_available():
        return None
    w = weight.detach()
    packed = torch.ops.mkl._mkl_reorder_linear_weight(w, 4)
    probe = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0))
    got = torch.ops.mkl._mkl_linear(probe, packed, w, None, probe.shape[0])
    want = F.linear(probe, w)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
        return None
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias): ``[M, in] × [out, in] → [M, out]``, in ``x.dtype``.

    ``packed``: the weight as :func:`pack_weight` packed it, or ``None``.

    Three CPU routes that only remove time:

    * One row as ``torch.mv``. A batch-1 decode step is 121 matrix-vector products, and
      ``F.linear`` with a single row takes a slower route to the same GEMV (measured 2–4× per
      matrix in bf16 on an AMX Xeon, bench/forward_profile.py); the results are bitwise
      identical there (tests/runtime/models/test_llama.py). (On CPUs without AMX, e.g. an
      AMD EPYC with AVX512-BF16, a rare bf16 output differs in its last bits: the two
      kernels sum in different orders.)
    * fp32 with 2..:data:`SMALL_M_MAX` rows (batched decode steps, verification rows) as
      ``(W·Xᵀ)ᵀ``: the same GEMM with the weight as the left operand. On an AVX2-only AMD
      EPYC (2 threads, where ``dtype=auto`` serves fp32) ``F.linear`` with 2 rows took 1.8×
      the one-row step, as if every row read the weights again; through ``W·Xᵀ`` a whole
      decode step is 2.0× / 1.9× / 1.4× / 1.2× faster at batch 2 / 4 / 16 / 32
      (docs/benchmarks.md "fp32 small-batch GEMM"). MKL runs some row counts slower than the
      next larger one (7 rows 1.18× slower than 8, 15 rows 1.44× slower than 16): those are
      padded with zero rows (:data:`FP32_PADDED_ROWS`). The sums run in another order: outputs
      agree with ``F.linear`` to fp32 rounding, not bitwise. The result is made contiguous:
      a transposed view both slowed the ops after it and broke the grammar mask, which
      writes the logits' memory in row order (tests/runtime/speculation/test_spec_gateway.py).
    * fp32 with 2..:data:`PACKED_M_MAX` rows and a ``packed`` weight: MKL's ``sgemm_compute`` on a
      weight packed once at load time (an unpacked GEMM packs its operands on every call). On
      an Ice Lake Xeon (AVX-512 without BF16, 2 threads) a round of 2 / 4 / 8 verified rows
      took 72.8 / 75.5 / 78.1 ms through ``W·Xᵀ`` against 40.7 ms for one row; packed, a
      batched decode step is 1.3–1.5× faster at 2–8 rows and 1.05–1.14× at 10–24
      (bench/fp32_gemm.py --routes unpacked current, docs/benchmarks.md "Packed fp32 weights").
      Sums run in MKL's order: fp32 rounding, not bitwise.
    """
    if x.dim() == 2 and x.device.type == "cpu":
        m = x.shape[0]
        if m == 1:
            return torch.mv(weight, x[0]).unsqueeze(0)
        # (not under autograd: MKL's packed op has no derivative, a trained weight outdates its copy)
        if packed is not None and m <= PACKED_M_MAX and x.dtype == torch.float32 and not x.requires_grad:
            return torch.ops.mkl._mkl_linear(x.contiguous(), packed, weight, None, m)
        if x.dtype == torch.float32 and m <= SMALL_M_MAX:
            p = FP32_PADDED_ROWS[m]
            if p != m:  # a row count the GEMM runs slower than a larger one: zero rows appended
                x = torch.cat([x, x.new_zeros(p - m, x.shape[1])])
            return torch.mm(weight, x.t())[:, :m].t().contiguous()
    return F.linear(x, weight)


class Linear(nn.Linear):
    """Bias-free ``nn.Linear`` whose forward is :func:`linear`."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        #: the weight packed for MKL (:func:`pack_weight`), set by :func:`pack_fp32_weights_`; not state
        self.packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.packed)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · w, computed in fp32, returned in x.dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


#: Rotary positions past the model's context (``max_position``): with speculation the KV
#: slots are ``max_context + γ + 1`` long and the drafter's block sits γ further, so a
#: sequence that fills the context still verifies and drafts at positions ≥ ``max_position``.
#: The tables are built for ``max_position + ROTARY_HEADROOM`` rows (the engine checks γ fits).
ROTARY_HEADROOM = 64


class Rotary(nn.Module):
    """Rotary position embedding tables (rotate-half layout).

    ``cos``/``sin`` are ``[max_position, head_dim]`` fp32 buffers; :meth:`apply`
    takes ``x [T, heads, head_dim]`` and integer ``positions [T]``.
    """

    def __init__(self, head_dim: int, theta: float, max_position: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for ``positions [T]`` → each ``[T, 1, head_dim]`` in ``dtype``."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


@dataclass
class SeqSpan:
    """One sequence's part of a ragged forward.

    Attributes:
        slot: its KV-cache slot.
        start: cached length before this forward (= position of the first new token).
        num_new: number of new tokens ``n_i`` (≥ 1).
    """

    slot: int
    start: int
    num_new: int


class Attention(nn.Module):
    """GQA self-attention with fused QKV projection, reading/writing a :class:`KVCache`."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_out = cfg.num_heads * cfg.head_dim
        kv_out = cfg.num_kv_heads * cfg.head_dim
        self.split = (q_out, kv_out, kv_out)
        self.qkv_proj = Linear(cfg.hidden_size, q_out + 2 * kv_out)
        self.o_proj = Linear(q_out, cfg.hidden_size)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    def project_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[T, d]`` → rotated q ``[T, H, D]``, rotated k and v ``[T, KVH, D]``."""
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        T = x.shape[0]
        q = Rotary.apply(q.view(T, self.num_heads, self.head_dim), cos, sin)
        k = Rotary.apply(k.view(T, self.num_kv_heads, self.head_dim), cos, sin)
        return q, k, v.view(T, self.num_kv_heads, self.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        plan: "AttentionPlan",
        slot_idx: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        q, k, v = self.project_qkv(x, cos, sin)
        kc, vc = cache.k[self.layer_idx], cache.v[self.layer_idx]  # [S, KVH, L, D]
        kc[slot_idx, :, positions] = k
        vc[slot_idx, :, positions] = v
        out = torch.empty_like(q)
        g = plan.decode
        if g is not None:  # all single-token spans: one SDPA over a view of their slot range
            qg = q.new_zeros((g.hi - g.lo, self.num_heads, 1, self.head_dim))
            qg[g.slot_offsets] = q[g.rows].unsqueeze(2)
            og = F.scaled_dot_product_attention(qg, kc[g.lo : g.hi, :, : g.length], vc[g.lo : g.hi, :, : g.length],
                                                attn_mask=g.mask, scale=self.scale, enable_gqa=True)
            out[g.rows] = og[g.slot_offsets, :, 0]
        for span, offset, mask in plan.per_sequence:
            n = span.num_new
            end = span.start + n
            qi = q[offset : offset + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            ki = kc[span.slot, :, :end].unsqueeze(0)  # [1, KVH, end, D]
            vi = vc[span.slot, :, :end].unsqueeze(0)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=self.scale, enable_gqa=True)
            out[offset : offset + n] = oi[0].transpose(0, 1)
        return self.o_proj(out.reshape(x.shape[0], -1))


@dataclass
class DecodeGroup:
    """Single-token spans attended together: one SDPA call over ``cache[lo:hi, :, :length]``.

    Attributes:
        rows: int64 ``[G]``, the spans' rows in the flat token dimension.
        slot_offsets: int64 ``[G]``, their slots minus ``lo``.
        lo, hi: the slot range ``[lo, hi)`` viewed (no copy; slots in it that are not in
            the group attend to key 0 only and their outputs are dropped).
        length: keys ``[0, length)`` = the longest span's context + 1.
        mask: bool ``[hi − lo, 1, 1, length]``, True = attend (keys ``< start + 1`` per slot).
    """

    rows: torch.Tensor
    slot_offsets: torch.Tensor
    lo: int
    hi: int
    length: int
    mask: torch.Tensor


@dataclass
class AttentionPlan:
    """How one ragged forward's attention is computed (built once, used by every layer).

    Attributes:
        decode: the single-token spans batched into one call (``None`` if fewer than
            ``MIN_DECODE_GROUP`` or their slot range is too sparse).
        per_sequence: ``(span, first row, causal mask or None)`` for every other span.
    """

    decode: DecodeGroup | None
    per_sequence: list[tuple[SeqSpan, int, torch.Tensor | None]]


MIN_DECODE_GROUP = 2


def attention_plan(spans: Sequence[SeqSpan], device: torch.device) -> AttentionPlan:
    """Batch the single-token (decode) spans into one attention call when it pays.

    A decode step of B sequences would otherwise make B small SDPA calls per layer
    (480 at batch 16: ~27 % of the step, bench/forward_profile.py). The group is used
    when ≥ ``MIN_DECODE_GROUP`` spans have one new token and their slot range holds at
    most twice as many slots as spans (the view then wastes at most half its rows).
    """
    offsets, off = [], 0
    for s in spans:
        offsets.append(off)
        off += s.num_new
    single = [i for i, s in enumerate(spans) if s.num_new == 1]
    group = None
    if len(single) >= MIN_DECODE_GROUP:
        slots = [spans[i].slot for i in single]
        lo, hi = min(slots), max(slots) + 1
        if hi - lo <= 2 * len(single):
            length = max(spans[i].start + 1 for i in single)
            ends = torch.ones(hi - lo, dtype=torch.long)  # slots outside the group: key 0 only
            for i in single:
                ends[spans[i].slot - lo] = spans[i].start + 1
            mask = (torch.arange(length)[None, :] < ends[:, None]).view(hi - lo, 1, 1, length)
            group = DecodeGroup(
                rows=torch.tensor([offsets[i] for i in single], dtype=torch.long, device=device),
                slot_offsets=torch.tensor([s - lo for s in slots], dtype=torch.long, device=device),
                lo=lo, hi=hi, length=length, mask=mask.to(device),
            )  # fmt: skip
    grouped = set(single) if group is not None else set()
    masks = LlamaModel.causal_masks(spans, device)
    per_seq = [(s, offsets[i], masks[i]) for i, s in enumerate(spans) if i not in grouped]
    return AttentionPlan(decode=group, per_sequence=per_seq)


class MLP(nn.Module):
    """SwiGLU with fused gate/up projection: down(silu(gate(x)) · up(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        # dtype of the sublayers' inputs; None → that of the norms (the model dtype; int8
        # layers keep fp32 activations). The gguf dtype has fp32 norms over bf16 activations.
        self.act_dtype: torch.dtype | None = None

    def forward(self, x, cos, sin, cache, plan, slot_idx, positions) -> torch.Tensor:
        """``x``: the fp32 residual stream ``[T, d]``; sublayers run in :attr:`act_dtype`."""
        dt = self.act_dtype or self.input_layernorm.weight.dtype
        x = x + self.self_attn(self.input_layernorm(x).to(dt), cos, sin, cache, plan, slot_idx, positions).float()
        return x + self.mlp(self.post_attention_layernorm(x).to(dt)).float()


@dataclass
class ForwardOutput:
    """Result of :meth:`LlamaModel.forward`.

    Attributes:
        logits: fp32 ``[R, vocab]`` for the requested rows (``logits_rows``), or
            ``None`` if no rows were requested.
        taps: ``[T, len(tap_layers), hidden]`` fp32 (the residual stream) — the output of
            each tapped decoder layer (= transformers' ``hidden_states[i + 1]``),
            or ``None`` if no taps were requested.
        hidden: final normed hidden states ``[T, hidden]`` (model dtype).
    """

    logits: torch.Tensor | None
    taps: torch.Tensor | None
    hidden: torch.Tensor


class LlamaModel(nn.Module):
    """The target model. See the module docstring for the ragged-forward contract."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position + ROTARY_HEADROOM)
        if cfg.tie_word_embeddings:
            self.lm_head_weight = self.embed_tokens.weight
        else:
            self.lm_head_weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        # A quantised copy of the head, if any: Int8Linear (runtime.models.quant, dtype int8)
        # or the GGUF's Q8_0 rows (runtime.models.gguf_weights, dtype gguf).
        self.lm_head_quant: nn.Module | None = None
        # the fp32 LM head packed for MKL (pack_fp32_weights_), else None
        self.lm_head_packed: torch.Tensor | None = None
        # What the weights are, when the parameter dtype does not say it: "int8"
        # (runtime.models.quant) or "gguf" (runtime.models.gguf_weights); None → the dtype.
        self.weights_format: str | None = None
        self.activations_int8 = False  # gguf-a8: Q4_1 projections over int8 activations
        # dtype gguf (runtime.models.gguf_weights): exact fp32 embedding rows, and the fused
        # C++ decoder layers, used for every forward (row-invariant arithmetic).
        self.embed_quant: nn.Module | None = None
        self.fused_forward = None
        # > 0: torch intra-op threads for forwards that take the eager path (set by the
        # engine when the fused path runs with torch at 1 thread; see LLMEngine).
        self.eager_threads = 0

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def serving_dtype(self) -> str:
        """The engine's dtype name for this model: ``"gguf"``, ``"gguf-a8"``, ``"int8"``, ``"bfloat16"``, …"""
        if self.activations_int8:
            return "gguf-a8"
        return self.weights_format or str(self.dtype).replace("torch.", "")

    def new_cache(self, num_slots: int, max_len: int, device: str | torch.device = "cpu") -> KVCache:
        c = self.cfg
        return KVCache(c.num_layers, num_slots, c.num_kv_heads, c.head_dim, max_len, self.dtype, device)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden ``[R, d]`` → fp32 logits ``[R, vocab]``."""
        if self.lm_head_quant is not None:
            return self.lm_head_quant(hidden).float()
        return linear(hidden, self.lm_head_weight, self.lm_head_packed).float()

    @staticmethod
    def causal_masks(spans: Sequence[SeqSpan], device: torch.device) -> list[torch.Tensor | None]:
        """Per-sequence boolean masks ``[n_i, start_i + n_i]`` (True = attend).

        New token t (position start+t) sees cached keys and new keys ≤ itself.
        A single new token sees everything, so its mask is ``None``.
        """
        masks: list[torch.Tensor | None] = []
        for s in spans:
            if s.num_new == 1:
                masks.append(None)
                continue
            q_pos = torch.arange(s.start, s.start + s.num_new, device=device)[:, None]
            k_pos = torch.arange(s.start + s.num_new, device=device)[None, :]
            masks.append(k_pos <= q_pos)
        return masks

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        spans: Sequence[SeqSpan],
        cache: KVCache,
        logits_rows: torch.Tensor | None = None,
        tap_layers: Sequence[int] = (),
    ) -> ForwardOutput:
        """One ragged forward over all new tokens of all sequences.

        Args:
            input_ids: int64 ``[T]``, the new tokens of every span concatenated in order.
            spans: one :class:`SeqSpan` per sequence; ``Σ num_new == T`` and each
                ``start`` must equal ``cache.lengths[slot]``.
            cache: the KV cache; K/V of the new tokens are written and each
                sequence's length advances by ``num_new``.
            logits_rows: int64 row indices into ``[0, T)`` whose logits are needed
                (e.g. each span's last token for decode, all rows for verification);
                ``None`` → no LM head at all.
            tap_layers: decoder-layer indices whose outputs to return (DSpark features).

        Raises:
            ValueError: a span's ``start`` disagrees with the cache or overflows it.
        """
        device = input_ids.device
        for s in spans:
            if s.start != cache.lengths[s.slot]:
                raise ValueError(f"span start {s.start} != cached length {cache.lengths[s.slot]} (slot {s.slot})")
            if s.start + s.num_new > cache.max_len:
                raise ValueError(f"slot {s.slot}: {s.start + s.num_new} tokens exceed the cache ({cache.max_len})")
        positions = torch.cat([torch.arange(s.start, s.start + s.num_new) for s in spans]).to(device)
        slot_idx = torch.cat([torch.full((s.num_new,), s.slot, dtype=torch.long) for s in spans]).to(device)

        # The residual stream is kept in fp32 (only matmul inputs are cast to the serving
        # dtype): in bf16 this keeps verification forwards (1+ℓ tokens) and single-token
        # decode numerically much closer, at negligible cost for elementwise ops.
        embed = self.embed_quant if self.embed_quant is not None else self.embed_tokens
        x = embed(input_ids).float().contiguous()
        taps: list[torch.Tensor] = []
        tap_set = {i: j for j, i in enumerate(tap_layers)}
        tap_tensor = None
        if self.fused_forward is not None:
            # every layer in one C++ call, x updated in place
            tap_tensor = self.fused_forward(self, x, cache, slot_idx, positions, tap_layers)
        else:
            plan = attention_plan(spans, device)
            cos, sin = self.rotary.tables(positions, self.dtype)
            with torch_threads(self.eager_threads):
                for i, layer in enumerate(self.layers):
                    x = layer(x, cos, sin, cache, plan, slot_idx, positions)
                    if i in tap_set:
                        taps.append(x)
        for s in spans:
            cache.lengths[s.slot] = s.start + s.num_new

        hidden = self.norm(x).to(self.dtype)
        logits = self.lm_head(hidden[logits_rows]) if logits_rows is not None else None
        if tap_tensor is None and tap_layers:
            tap_tensor = torch.stack([taps[tap_set[i]] for i in tap_layers], dim=1)
        elif not tap_layers:
            tap_tensor = None
        return ForwardOutput(logits=logits, taps=tap_tensor, hidden=hidden)


def load_target(model_dir: str | Path, dtype: str = "auto", threads: int = 0) -> LlamaModel:
    """Load the target by serving-dtype name, as the engine does: ``"auto"`` (resolved by
    the CPU, :func:`runtime.config.resolve_dtype`), ``"gguf"``, ``"gguf-a8"``, ``"bfloat16"``, ``"float32"``
    or ``"int8"``. ``threads > 0`` also applies the engine's thread setup
    (:func:`runtime.models.gguf_weights.use_kernel_threads`) for benchmarks.

    Raises:
        ValueError: an unknown dtype name.
    """
    from runtime.config import resolve_dtype

    name = resolve_dtype(dtype)
    by_name = {"gguf": "gguf", "gguf-a8": "gguf-a8", "bfloat16": torch.bfloat16, "float32": torch.float32,
               "int8": torch.int8}
    if name not in by_name:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(by_name)} or 'auto'")
    model = load_llama(model_dir, by_name[name])
    if threads > 0:
        torch.set_num_threads(threads)
        from runtime.models.gguf_weights import use_kernel_threads

        use_kernel_threads(model, threads)
    return model


def _fuse_hf_state_dict(sd: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Map transformers Llama weight names onto ours (fused qkv and gate/up)."""
    out: dict[str, torch.Tensor] = {}
    out["embed_tokens.weight"] = sd["model.embed_tokens.weight"]
    out["norm.weight"] = sd["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        out["lm_head_weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[f"layers.{i}.input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        out[f"layers.{i}.post_attention_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
        out[f"layers.{i}.self_attn.qkv_proj.weight"] = torch.cat(
            [sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"], sd[p + "self_attn.v_proj.weight"]]
        )
        out[f"layers.{i}.self_attn.o_proj.weight"] = sd[p + "self_attn.o_proj.weight"]
        out[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
            [sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]
        )
        out[f"layers.{i}.mlp.down_proj.weight"] = sd[p + "mlp.down_proj.weight"]
    return out


def load_llama(model_dir: str | Path, dtype: torch.dtype | str = torch.bfloat16, *, pack: bool = True) -> LlamaModel:
    """Load a transformers-format Llama dir (``config.json`` + ``model.safetensors``).

    ``dtype=torch.float32`` with ``pack``: the projections and LM head also get MKL-packed
    copies for multi-row products (:func:`pack_fp32_weights_`; +680 MB RSS for the 135M model,
    whose fp32 weights are 540 MB).

    ``dtype=torch.int8``: weight-only int8 decoder projections and LM head over fp32
    activations (:func:`runtime.models.quant.quantize_llama_`; changes the outputs).
    ``dtype="gguf"``: a bf16 model whose projections and LM head multiply by the served
    GGUF's own Q4_1 / Q8_0 blocks (:func:`runtime.models.gguf_weights.attach_gguf_`);
    ``"gguf-a8"``: the same over int8 activations in the Q4_1 projections (changes the outputs).
    Takes ~0.2 s for the 135M model from the safetensors cache (int8: ~1 s more).
    """
    if dtype in ("gguf", "gguf-a8"):
        from runtime.models.gguf_weights import attach_gguf_
        from runtime.models.loader import find_gguf

        return attach_gguf_(load_llama(model_dir, torch.bfloat16), find_gguf(), int8_activations=dtype == "gguf-a8")
    if dtype == torch.int8:
        from runtime.models.quant import quantize_llama_

        return quantize_llama_(load_llama(model_dir, torch.float32, pack=False))
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    cfg = LlamaConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    sd = load_file(str(model_dir / "model.safetensors"))
    with torch.device("meta"):
        model = LlamaModel(cfg)
    fused = _fuse_hf_state_dict(sd, cfg)
    model.load_state_dict({k: v.to(dtype) for k, v in fused.items()}, strict=False, assign=True)
    # Non-persistent buffers (rotary tables) must be rebuilt off the meta device.
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position + ROTARY_HEADROOM)
    if cfg.tie_word_embeddings:
        model.lm_head_weight = model.embed_tokens.weight
    model.eval().requires_grad_(False)
    if pack and model.dtype == torch.float32:
        pack_fp32_weights_(model)
    return model


def pack_fp32_weights_(model: LlamaModel) -> int:
    """Give every :class:`Linear` of an fp32 CPU ``model`` and its LM head an MKL-packed copy
    of its weight (:func:`pack_weight`, used by :func:`linear` for 2..:data:`PACKED_M_MAX`
    rows). Call it again after changing the weights: a packed copy does not follow them.

    Returns:
        The number of weights packed (0 where MKL packing is unavailable or the model is not fp32).
    """
    model.lm_head_packed = pack_weight(model.lm_head_weight) if model.lm_head_quant is None else None
    return pack_linears_(model) + (model.lm_head_packed is not None)


def pack_linears_(module: nn.Module) -> int:
    """Pack the weight of every :class:`Linear` inside ``module`` (:func:`pack_weight`; the
    drafter's layers too). Returns how many were packed."""
    n = 0
    for mod in module.modules():
        if isinstance(mod, Linear):
            mod.packed = pack_weight(mod.weight)
            n += mod.packed is not None
    return n
