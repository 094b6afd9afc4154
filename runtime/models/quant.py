"""Weight-only int8 for the target's linear layers (opt-in serving dtype ``"int8"``).

Per-output-channel symmetric int8: row ``n`` of a weight ``W [N, K]`` is stored as
``q[n] = round(W[n] / s[n])`` clamped to ±127, with ``s[n] = max|W[n]| / 127``; the
product is ``x @ W.T ≈ (x @ q.T) · s``. Only the weights shrink (4× vs fp32); norms,
rotary tables, the embedding, the KV cache and the residual stream stay fp32.

Kernel choice (measured on an AVX2-only 2-core EPYC, ``docs/benchmarks.md``):
``torch._weight_int8pack_mm`` with **bf16** activations is the fast path for few rows
(its fp32/fp16-activation variants are 10–20× slower on AVX2); it computes each row
as a GEMV, so above :data:`KERNEL_MAX_ROWS` rows (prefill chunks, large verification
forwards) dequantising the weight once and running an fp32 GEMM is faster.

This changes the target distribution (top-1 agreement vs fp32 is reported by
``bench/quant_bench.py``), so it is never the default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: Rows (tokens) up to which the int8 kernel runs; more → dequantise + fp32 GEMM.
#: Crossover measured between 32 (int8 kernel 5% faster) and 64 (dequant 17% faster).
KERNEL_MAX_ROWS = 32

_HAS_KERNEL = hasattr(torch, "_weight_int8pack_mm")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8 of a float ``weight [N, K]``.

    Returns ``(q, scales)``: ``q`` int8 ``[N, K]`` in ``[-127, 127]``, ``scales`` bf16
    ``[N]`` (the kernel's scale dtype). Each scale is rounded *up* to a bf16 value before
    quantising against it, so bf16 storage adds no error and nothing clips: per element
    ``|W - q·s| ≤ s/2`` with ``s ≤ max|W[n]|/127 · (1 + 2⁻⁷)``. An all-zero row gets scale 1.
    """
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    w = weight.detach().float()
    s = w.abs().amax(dim=1) / 127.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    sb = s.to(torch.bfloat16)
    sb = torch.where(sb.float() < s, torch.nextafter(sb, torch.full_like(sb, float("inf"))), sb)
    q = torch.round(w / sb.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), sb


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [N, K]`` int8, ``scales [N]`` → the weight ``[N, K]`` in ``dtype``."""
    return q.to(dtype) * scales.to(dtype)[:, None]


class Int8Linear(nn.Module):
    """Bias-free linear layer with a weight-only int8 weight.

    Buffers: ``weight`` int8 ``[out, in]``, ``scales`` bf16 ``[out]``. ``forward`` takes
    ``x [..., in]`` in any float dtype and returns ``[..., out]`` in ``x.dtype``.

    ``keep_float=True`` keeps a reference to the float ``weight`` (not a copy; not in the
    state dict) and uses it instead of dequantising above :data:`KERNEL_MAX_ROWS` rows —
    for the LM head, whose fp32 weight is the tied embedding and stays loaded anyway.
    """

    def __init__(self, weight: torch.Tensor, keep_float: bool = False) -> None:
        super().__init__()
        q, s = quantize_int8(weight)
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight", q)
        self.register_buffer("scales", s)
        self.__dict__["float_weight"] = weight.detach() if keep_float else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        if linear.bias is not None:
            raise ValueError("Int8Linear has no bias")
        return cls(linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if _HAS_KERNEL and x2.shape[0] <= KERNEL_MAX_ROWS:
            xb = x2.to(torch.bfloat16).contiguous()
            y = torch._weight_int8pack_mm(xb, self.weight, self.scales.to(torch.bfloat16))
        elif self.float_weight is not None:
            y = F.linear(x2.to(self.float_weight.dtype), self.float_weight)
        else:
            dt = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
            y = F.linear(x2.to(dt), dequantize_int8(self.weight, self.scales, dt))
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def quantize_llama_(model, lm_head: bool = True):
    """Replace every decoder-layer projection (fused qkv, o, fused gate/up, down) of a
    :class:`runtime.models.llama.LlamaModel` with :class:`Int8Linear`, in place.

    ``lm_head=True`` also adds an int8 copy of the LM head (``model.lm_head_quant``), used
    for forwards of up to :data:`KERNEL_MAX_ROWS` logit rows; the fp32 ``lm_head_weight``
    (tied to the embedding) is kept for embedding lookups, drafter training and forwards
    with more logit rows. The model must be fp32 (activations stay fp32). Returns ``model``.

    Raises:
        ValueError: the model is not fp32.
    """
    if model.dtype != torch.float32:
        raise ValueError(f"int8 weights run over fp32 activations; got a {model.dtype} model")
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = Int8Linear.from_linear(attn.qkv_proj)
        attn.o_proj = Int8Linear.from_linear(attn.o_proj)
        mlp.gate_up_proj = Int8Linear.from_linear(mlp.gate_up_proj)
        mlp.down_proj = Int8Linear.from_linear(mlp.down_proj)
    model.lm_head_quant = Int8Linear(model.lm_head_weight, keep_float=True) if lm_head else None
    model.weights_format = "int8"
    return model
