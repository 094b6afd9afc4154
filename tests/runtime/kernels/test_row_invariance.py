"""Row invariance of the served ``gguf`` path (issue 27): a row's result does not depend on
the other rows of its forward.

The contract (docs/benchmarks.md, "Row invariance"): row r of an M-row call is bit for bit
the 1-row call of that row, for every M, on both kernel paths (AVX512-BF16, and AMX where
the CPU has it). At the model level that makes a token's logits and K/V independent of the
verification width (1 + ℓ rows vs one decode step per token), of prefill chunking and the
prefix cache (a prefix computed in an earlier forward), and of whatever other sequences
share the forward. Every test compares with ``torch.equal`` (no tolerance).

Kernel tests follow ``tests/support/hygiene.py``: required where the CPU has the
instructions, skipped (naming the missing flags) elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from runtime.config import AMX_FLAGS
from runtime.kernels.cpu import gguf_cpu
from runtime.kernels.cpu.gguf_cpu import Q4_1, Q4_1_A8, Q8_0, STORED, dequantize
from runtime.models.gguf_weights import GgufLinear
from tests.runtime.kernels.test_gguf_kernel import random_blocks
from tests.support.hygiene import require_cpu_kernel

#: The target's projection shapes (SmolLM2-135M: d 576, 9 + 2·3 heads of 64, MLP 1536) and a
#: slice of its Q8_0 LM head (the drafter's heads are Q8_0 too).
SHAPES = [(Q4_1, 960, 576), (Q4_1, 576, 576), (Q4_1, 3072, 576), (Q4_1, 576, 1536), (Q8_0, 4096, 576),
          (Q4_1_A8, 960, 576), (Q4_1_A8, 576, 1536)]  # + the int8-activation variant (gguf-a8)
MAX_M = 64


@pytest.fixture(params=["avx512", "amx"])
def kernel_path(request, gguf_kernel):
    """The kernel path under test: ``avx512`` (VDPBF16PS, AMX off) or ``amx`` (the tile
    unit, for every row count). Restores the served setting."""
    if request.param == "amx":
        require_cpu_kernel("the gguf kernel's AMX path", AMX_FLAGS, gguf_cpu.kernel_available)
    served = torch.ops.sparkgate.amx_enabled()
    torch.ops.sparkgate.set_amx(request.param == "amx")
    yield request.param
    torch.ops.sparkgate.set_amx(served)


def differing_rows(y: torch.Tensor, ref: torch.Tensor) -> list[int]:
    return (y != ref).any(-1).nonzero().flatten().tolist()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype,n,k", SHAPES)
def test_kernel_row_of_an_m_row_call_is_the_one_row_call(kernel_path, qtype, n, k, out_dtype):
    """For every M in 1..64, each row of ``gguf_linear(x[M rows])`` equals the 1-row call
    of that row bit for bit (rows taken from the start and from the end of x, so a row
    sits at every offset of the kernel's row blocks)."""
    blocks = random_blocks(STORED[qtype], n, k, seed=n + k)
    tiles = gguf_cpu.repack(blocks, STORED[qtype], n, k)
    x = (torch.randn(MAX_M, k, generator=torch.Generator().manual_seed(k)) * 3).to(torch.bfloat16)
    single = torch.cat([gguf_cpu.gguf_linear(x[r : r + 1], tiles, qtype, n, k, out_dtype) for r in range(MAX_M)])
    assert single.abs().max() > 0
    for m in range(1, MAX_M + 1):
        head = gguf_cpu.gguf_linear(x[:m], tiles, qtype, n, k, out_dtype)
        assert not differing_rows(head, single[:m]), (kernel_path, m, differing_rows(head, single[:m]))
        tail = gguf_cpu.gguf_linear(x[MAX_M - m :], tiles, qtype, n, k, out_dtype)
        assert not differing_rows(tail, single[MAX_M - m :]), (kernel_path, m, differing_rows(tail, single[MAX_M - m :]))


@pytest.mark.parametrize("rows", [13, 65, 300])
def test_gguf_linear_module_is_row_invariant_beyond_the_kernel_row_blocks(kernel_path, rows):
    """``GgufLinear`` (what the LM head and the eager layers call) keeps the contract for any
    number of rows: no switch to another GEMM above some row count."""
    n, k = 576, 1536
    blocks = random_blocks(Q4_1, n, k, seed=5)
    lin = GgufLinear(blocks, Q4_1, n, k, dense=dequantize(blocks, Q4_1, n, k).to(torch.bfloat16),
                     out_dtype=torch.float32)
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3).to(torch.bfloat16)
    single = torch.cat([lin(x[r : r + 1]) for r in range(rows)])
    assert not differing_rows(lin(x), single), differing_rows(lin(x), single)


# -- the real model -------------------------------------------------------------------

TEXT = ("The capital of France is Paris. The capital of Germany is Berlin. Rivers: the Seine, the Rhine, "
        "the Danube and the Po. def fibonacci(n):\n    if n < 2:\n        return n\n")


@pytest.fixture(scope="module")
def gguf_target(model_dir, gguf_kernel):
    from runtime.models.llama import load_llama

    model = load_llama(model_dir, "gguf")
    assert model.fused_forward is not None
    return model


@pytest.fixture(scope="module")
def prompt(tokenizer) -> torch.Tensor:
    ids = tokenizer(TEXT * 4)["input_ids"]
    assert len(ids) > 130  # more than two 64-row fused forwards
    return torch.tensor(ids[:130])


def run_chunks(model, ids: torch.Tensor, cuts: list[int], other: torch.Tensor | None = None):
    """Feed ``ids`` to a fresh slot in forwards split at ``cuts``; every forward asks for
    the logits of all its rows. With ``other``, every forward also carries a second
    sequence's next tokens (4 per forward: a verification-sized span) before ours.
    Returns (logits of our rows [len(ids), V], our slot's K/V [layers, 2, KVH, len, D])."""
    from runtime.models.llama import SeqSpan

    cache = model.new_cache(2, 256)
    slot, other_slot = cache.allocate(), cache.allocate()
    bounds = [0, *cuts, len(ids)]
    logits = []
    for a, b in zip(bounds, bounds[1:]):
        spans, toks, ours = [], [], 0
        if other is not None:
            start = cache.lengths[other_slot]
            toks.append(other[start : start + 4])
            spans.append(SeqSpan(other_slot, start, 4))
            ours = 4
        toks.append(ids[a:b])
        spans.append(SeqSpan(slot, a, b - a))
        out = model.forward(torch.cat(toks), spans, cache, torch.arange(ours + b - a))
        logits.append(out.logits[ours:])
    n = len(ids)
    kv = torch.stack([cache.k[:, slot, :, :n], cache.v[:, slot, :, :n]], 1)
    return torch.cat(logits), kv


@pytest.mark.model
def test_prefill_chunking_and_prefix_reuse_do_not_change_a_row(gguf_target, prompt):
    """The prompt in one forward (130 rows), in 64-row pieces, as a cached prefix + the
    rest, and token by token: every row's logits and every K/V entry bit for bit equal."""
    one, kv_one = run_chunks(gguf_target, prompt, [])
    for cuts in ([64, 128], [16, 17, 100], [129], list(range(100, 130))):
        logits, kv = run_chunks(gguf_target, prompt, cuts)
        assert torch.equal(kv, kv_one), cuts
        assert not differing_rows(logits, one), (cuts, differing_rows(logits, one))


@pytest.mark.model
def test_verification_rows_equal_decode_steps(gguf_target, prompt):
    """After a 100-token prefix, 1 + ℓ verification rows in one forward (ℓ = 1..7) give the
    logits and K/V of the same tokens decoded one per forward."""
    prefix, rest = prompt[:100], prompt[100:108]
    steps, kv_steps = run_chunks(gguf_target, torch.cat([prefix, rest]), [100 + i for i in range(1, 8)])
    for width in range(2, 9):
        ver, kv = run_chunks(gguf_target, torch.cat([prefix, rest[:width]]), [100])
        assert torch.equal(kv, kv_steps[..., : 100 + width, :]), width
        assert not differing_rows(ver[100:], steps[100 : 100 + width]), (width, differing_rows(ver[100:], steps[100 : 100 + width]))


@pytest.mark.model
def test_rows_do_not_depend_on_other_sequences_in_the_forward(gguf_target, prompt, tokenizer):
    """Batch composition: our rows' logits and K/V are the same whether our chunks run alone
    or share each forward with another sequence's 4-token span (which also pushes a
    64-row chunk of ours past 64 rows)."""
    other = torch.tensor(tokenizer("Once upon a time, in a small village by the sea, " * 8)["input_ids"][:64])
    for cuts in ([64, 128], [100, 101, 102]):
        alone, kv_alone = run_chunks(gguf_target, prompt, cuts)
        shared, kv_shared = run_chunks(gguf_target, prompt, cuts, other=other)
        assert torch.equal(kv_shared, kv_alone), cuts
        assert not differing_rows(shared, alone), (cuts, differing_rows(shared, alone))
