"""The ``gguf`` serving dtype: the C++ kernel over GGML blocks (``runtime/kernels/gguf_cpu``)
and the model that uses it (``runtime/models/gguf_weights``).

The kernel needs AVX512-BF16: where the CPU has it the kernel tests are required, on other
CPUs they skip naming the missing flags (``tests/support/hygiene.py``: the machine, not CI, decides)
and the model falls back to its bf16 copy, which
``test_gguf_linear_falls_back_to_dense_without_the_kernel`` covers everywhere."""

from __future__ import annotations

import pytest
import torch

from runtime.kernels.cpu import gguf_cpu
from runtime.config import cpu_supports_kernel
from runtime.kernels.cpu.gguf_cpu import Q4_1, Q8_0, dequantize, reference_linear
from runtime.models import gguf_weights
from runtime.models.gguf_weights import GgufLinear, unpermute_rows

needs_kernel = pytest.mark.usefixtures("gguf_kernel")


def random_blocks(qtype: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Random GGML rows: fp16 scales of realistic size, every nibble / int8 value."""
    g = torch.Generator().manual_seed(seed)
    G = k // 32
    d = (torch.rand(n, G, 1, generator=g) * 0.02 + 1e-4).half().view(torch.uint8).reshape(n, G, 2)
    if qtype == Q4_1:
        m = (-torch.rand(n, G, 1, generator=g) * 0.1).half().view(torch.uint8).reshape(n, G, 2)
        qs = torch.randint(0, 256, (n, G, 16), dtype=torch.uint8, generator=g)
        return torch.cat([d, m, qs], -1).reshape(n, -1).contiguous()
    qs = torch.randint(-128, 128, (n, G, 32), dtype=torch.int8, generator=g).view(torch.uint8)
    return torch.cat([d, qs], -1).reshape(n, -1).contiguous()


def test_dequantize_follows_the_ggml_block_layout():
    # One Q4_1 block by hand: d = 0.5, m = -1, bytes j = (j+1) << 4 | j: low nibbles are
    # elements 0..15 (= j), high nibbles elements 16..31 (= j + 1 mod 16).
    head = torch.tensor([0.5, -1.0], dtype=torch.float16).view(torch.uint8)
    qs = torch.tensor([((j + 1) % 16) << 4 | j for j in range(16)], dtype=torch.uint8)
    w = dequantize(torch.cat([head, qs])[None], Q4_1, 1, 32)[0]
    expect = [0.5 * j - 1 for j in range(16)] + [0.5 * ((j + 1) % 16) - 1 for j in range(16)]
    assert w.tolist() == expect
    # Q8_0: d = 0.25, q = -128..-97
    head = torch.tensor([0.25], dtype=torch.float16).view(torch.uint8)
    qs = torch.arange(-128, -96, dtype=torch.int8).view(torch.uint8)
    assert dequantize(torch.cat([head, qs])[None], Q8_0, 1, 32)[0].tolist() == [0.25 * q for q in range(-128, -96)]


def test_unpermute_rows_inverts_llama_cpp_permutation():
    n_head, rows = 3, 12
    w = torch.arange(rows * 5).reshape(rows, 5)
    # llama.cpp's convert_hf_to_gguf.py: reshape(n_head, 2, dim, ...).swapaxes(1, 2)
    permuted = w.reshape(n_head, 2, rows // n_head // 2, 5).transpose(1, 2).reshape(rows, 5)
    assert torch.equal(unpermute_rows(permuted, n_head), w)


@needs_kernel
@pytest.mark.parametrize("qtype,n,k", [(Q4_1, 960, 576), (Q4_1, 576, 1536), (Q4_1, 48, 64), (Q8_0, 4096, 576)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 16, 17, 40])
def test_kernel_equals_exact_reference(qtype, n, k, rows):
    blocks = random_blocks(qtype, n, k, seed=rows)
    tiles = gguf_cpu.repack(blocks, qtype, n, k)
    assert torch.equal(gguf_cpu.unpack(tiles, qtype, n, k), blocks)  # a pure reordering
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    y = gguf_cpu.gguf_linear(x, tiles, qtype, n, k, torch.float32)
    ref = reference_linear(x, blocks, qtype, n, k)  # fp32 with the exact weights
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    # Same products, other summation order: only fp32 rounding (measured ≤ 7e-7 relative).
    assert (y - ref).abs().max() <= 4e-6 * ref.abs().max()
    yb = gguf_cpu.gguf_linear(x, tiles, qtype, n, k, torch.bfloat16)
    assert yb.dtype == torch.bfloat16 and torch.equal(yb, y.to(torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (48, 64)])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13, 17])
def test_int8_activation_kernel_equals_the_quantised_reference(n, k, rows):
    """``Q4_1_A8`` (``dtype="gguf-a8"``): the exact Q4_1 weights times the activations as
    :func:`~runtime.kernels.cpu.gguf_cpu.quantize_a8` quantises them (per row and 32-group,
    nearest even), up to fp32 rounding — and really quantised: it differs from the bf16 path
    by far more than rounding."""
    blocks = random_blocks(Q4_1, n, k, seed=rows + 7)
    tiles = gguf_cpu.repack(blocks, Q4_1, n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3
    x[0, :32] = 0.0  # an all-zero group (scale 0)
    y = gguf_cpu.gguf_linear(x, tiles, gguf_cpu.Q4_1_A8, n, k, torch.float32)
    ref = gguf_cpu.reference_linear_a8(x, blocks, n, k)
    scale = ref.abs().max()
    assert (y.double() - ref).abs().max() <= 4e-6 * scale  # measured ≤ 3e-7 relative
    exact_x = reference_linear(x, blocks, Q4_1, n, k)
    assert (y - exact_x).abs().max() > 1e-4 * scale  # int8 activations: ~0.5 % relative error
    assert ((y - exact_x).norm() / exact_x.norm()) < 0.02


def test_gguf_a8_without_the_kernel_is_a_clear_error(monkeypatch, model_dir):
    """No dense fallback for int8 activations: where the kernel does not run, loading
    ``gguf-a8`` fails naming the dtype and what it needs."""
    from runtime.models.gguf_weights import attach_gguf_
    from runtime.models.llama import load_llama

    monkeypatch.setattr(gguf_cpu, "kernel_available", lambda: False)
    with pytest.raises(ValueError, match="'gguf-a8'.*AVX512-BF16 and AVX512-VNNI"):
        attach_gguf_(load_llama(model_dir, torch.bfloat16), "never-read.gguf", int8_activations=True)


@needs_kernel
def test_kernel_rejects_mismatched_shapes():
    tiles = gguf_cpu.repack(random_blocks(Q4_1, 16, 64), Q4_1, 16, 64)
    with pytest.raises(RuntimeError, match="x must be"):
        gguf_cpu.gguf_linear(torch.randn(1, 32), tiles, Q4_1, 16, 64)
    with pytest.raises(RuntimeError, match="tiles must be"):
        gguf_cpu.gguf_linear(torch.randn(1, 64), tiles, Q8_0, 16, 64)
    with pytest.raises(ValueError, match="16 output rows"):
        gguf_cpu.repack(random_blocks(Q4_1, 8, 64), Q4_1, 8, 64)


def test_gguf_linear_falls_back_to_dense_without_the_kernel(monkeypatch):
    blocks = random_blocks(Q4_1, 16, 64)
    dense = dequantize(blocks, Q4_1, 16, 64).to(torch.bfloat16)
    lin = GgufLinear(blocks, Q4_1, 16, 64, dense=dense)
    monkeypatch.setattr(gguf_cpu, "kernel_available", lambda: False)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, dense))
    with pytest.raises(ValueError, match="do not hold"):
        GgufLinear(blocks, Q4_1, 16, 96, dense=dense)


@needs_kernel
def test_gguf_linear_uses_the_kernel_for_every_row_count_unless_given_max_rows():
    blocks = random_blocks(Q4_1, 32, 64)
    exact = dequantize(blocks, Q4_1, 32, 64)
    # A dense copy that differs visibly from the blocks tells the two paths apart.
    plus_one = (exact + 1).to(torch.bfloat16)
    x = torch.randn(100, 64)
    ref = x.to(torch.bfloat16).float() @ exact.T
    lin = GgufLinear(blocks, Q4_1, 32, 64, dense=plus_one, out_dtype=torch.float32)
    assert lin.max_rows is None
    torch.testing.assert_close(lin(x), ref, rtol=1e-5, atol=1e-5)  # 100 rows: still the blocks
    # The fused drafter's Q8_0 copies pass max_rows: above it, the dense copy (a bf16 GEMM).
    rows = gguf_weights.kernel_max_rows()
    assert rows >= 12
    capped = GgufLinear(blocks, Q4_1, 32, 64, dense=plus_one, out_dtype=torch.float32, max_rows=rows)
    torch.testing.assert_close(capped(x[:rows]), ref[:rows], rtol=1e-5, atol=1e-5)
    many = capped(x[: rows + 1])
    torch.testing.assert_close(many, torch.nn.functional.linear(x[: rows + 1].to(torch.bfloat16), plus_one).float(),
                               rtol=0, atol=0)
    assert (many - ref[: rows + 1]).abs().max() > 1.0


@pytest.mark.model
def test_gguf_blocks_dequantize_to_the_cached_fp32_weights(target_fp32, model_dir):
    from runtime.models.llama import load_llama

    model = load_llama(model_dir, "gguf")
    for lg, lf in zip(model.layers, target_fp32.layers):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            lin, w = lg.get_submodule(name), lf.get_submodule(name).weight
            assert isinstance(lin, GgufLinear) and lin.qtype == Q4_1
            # Bit for bit what transformers' GGUF loader made of the file (q/k rows unpermuted).
            assert torch.equal(dequantize(lin.blocks(), Q4_1, lin.out_features, lin.in_features), w), name
    head = model.lm_head_quant
    assert head.qtype == Q8_0 and torch.equal(dequantize(head.blocks(), Q8_0, *target_fp32.lm_head_weight.shape),
                                              target_fp32.lm_head_weight)


@needs_kernel
@pytest.mark.model
def test_gguf_model_is_closer_to_fp32_than_bf16(target_fp32, model_dir, tokenizer):
    """Exact weights + bf16 activations vs rounded weights + bf16 activations, on the
    decode path (one token per forward, the kernel's regime), against fp32."""
    import torch.nn.functional as F

    from runtime.models.llama import SeqSpan, load_llama

    text = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
    ids = tokenizer(text)["input_ids"]
    models = {"fp32": target_fp32, "bf16": load_llama(model_dir, torch.bfloat16), "gguf": load_llama(model_dir, "gguf")}
    logits = {}
    for name, m in models.items():
        cache = m.new_cache(1, 128)
        slot = cache.allocate()
        rows = []
        for t, tok in enumerate(ids):
            rows.append(m.forward(torch.tensor([tok]), [SeqSpan(slot, t, 1)], cache, torch.tensor([0])).logits[0])
        logits[name] = torch.stack(rows)
    ref = F.log_softmax(logits["fp32"], -1)

    def kl(name):
        return (ref.exp() * (ref - F.log_softmax(logits[name], -1))).sum(-1).mean().item()

    assert kl("gguf") < kl("bf16"), (kl("gguf"), kl("bf16"))
    assert (logits["gguf"].argmax(-1) == logits["fp32"].argmax(-1)).float().mean() >= 0.95


def tiny_gguf_model(seed: int = 0):
    """A 2-layer random Llama (d 256, 4 heads of 64, 2 kv heads) with GGUF-style Q4_1 projections,
    a Q8_0 head and the fused layer switched on — what ``attach_gguf_`` builds, without the file."""
    from runtime.models.gguf_weights import QuantEmbedding, fused_forward_
    from runtime.models.llama import LlamaConfig, LlamaModel, Rotary

    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=256, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64, max_position=512)  # head_dim 64: the AMX attention path
    torch.manual_seed(seed)
    model = LlamaModel(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position)  # fp32 tables, as load_llama has them

    def gguf(lin, qtype=Q4_1, out_dtype=None, s=0):
        n, k = lin.weight.shape if hasattr(lin, "weight") else lin.shape
        blocks = random_blocks(qtype, n, k, seed=seed * 100 + s)
        return GgufLinear(blocks, qtype, n, k, dense=dequantize(blocks, qtype, n, k).to(torch.bfloat16), out_dtype=out_dtype)

    for i, layer in enumerate(model.layers):
        layer.act_dtype = torch.bfloat16
        layer.input_layernorm.weight = torch.nn.Parameter(torch.rand(256) + 0.5, requires_grad=False)
        layer.post_attention_layernorm.weight = torch.nn.Parameter(torch.rand(256) + 0.5, requires_grad=False)
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj, attn.o_proj = gguf(attn.qkv_proj, s=4 * i), gguf(attn.o_proj, s=4 * i + 1)
        mlp.gate_up_proj, mlp.down_proj = gguf(mlp.gate_up_proj, s=4 * i + 2), gguf(mlp.down_proj, s=4 * i + 3)
    model.norm.weight = torch.nn.Parameter(torch.rand(256) + 0.5, requires_grad=False)
    head_blocks = random_blocks(Q8_0, 256, 256, seed=seed + 7)
    model.lm_head_quant = GgufLinear(head_blocks, Q8_0, 256, 256, dense=dequantize(head_blocks, Q8_0, 256, 256).to(torch.bfloat16),
                                     out_dtype=torch.float32)
    model.embed_quant = QuantEmbedding(head_blocks, Q8_0, 256)
    model.fused_forward = fused_forward_
    return model


def fp32_reference(model):
    """The same tiny model with every weight exact in fp32 (dense, dequantised blocks) and
    fp32 activations / KV cache: what both bf16-activation paths approximate."""
    import copy

    from runtime.models.llama import Linear

    ref = copy.deepcopy(model)
    ref.fused_forward, ref.lm_head_quant, ref.embed_quant = None, None, None
    ref.embed_tokens.weight = torch.nn.Parameter(model.embed_quant(torch.arange(256)), requires_grad=False)
    ref.lm_head_weight = ref.embed_tokens.weight
    for layer in ref.layers:
        layer.act_dtype = torch.float32
        for parent, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                             (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            g = getattr(parent, name)
            lin = Linear(g.in_features, g.out_features)
            lin.weight = torch.nn.Parameter(dequantize(g.blocks(), g.qtype, g.out_features, g.in_features), requires_grad=False)
            setattr(parent, name, lin)
    return ref


@needs_kernel
def test_fused_layer_is_as_close_to_fp32_as_the_eager_layer_on_a_ragged_batch():
    """Decode, verification-sized and prefill-sized spans in one forward (contexts of 1–41
    keys: the AMX attention's blocks of 16 keys and the tails): the fused C++ layer's
    logits, taps and every K/V it writes are as close to the exact fp32 model as the eager
    bf16-activation layer's, and agree with them."""
    from runtime.models.llama import SeqSpan

    model = tiny_gguf_model()
    ref_model = fp32_reference(model)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in (37, 9, 1)]
    new = [torch.randint(0, 256, (n,), generator=g) for n in (1, 4, 7)]
    results = {}
    for name, m, fused in (("eager", model, False), ("fused", model, True), ("fp32", ref_model, False)):
        saved = m.fused_forward
        m.fused_forward = saved if fused else None
        cache = m.new_cache(4, 64)
        slots = [cache.allocate() for _ in prompts]
        spans = [SeqSpan(s, 0, len(p)) for s, p in zip(slots, prompts)]
        m.forward(torch.cat(prompts), spans, cache, None)
        spans = [SeqSpan(s, len(p), len(n)) for s, p, n in zip(slots, prompts, new)]
        out = m.forward(torch.cat(new), spans, cache, torch.arange(12), tap_layers=(0,))
        m.fused_forward = saved
        lens = [38, 13, 8]
        assert cache.lengths == lens + [0]
        kv = torch.cat([torch.cat([cache.k[:, s, :, :L], cache.v[:, s, :, :L]], -2).float().flatten() for s, L in zip(slots, lens)])
        results[name] = (out.logits, out.taps, kv)
    ref = results["fp32"]
    for i, what in enumerate(("logits", "taps", "K/V")):
        err = {k: (results[k][i] - ref[i]).abs().max().item() for k in ("eager", "fused")}
        scale = ref[i].abs().max().item()
        assert err["fused"] <= 1.5 * err["eager"] + 1e-3 * scale, (what, err, scale)
        assert err["fused"] < 0.05 * scale, (what, err, scale)
    assert (results["fused"][0].argmax(-1) == results["eager"][0].argmax(-1)).float().mean() >= 0.9


@needs_kernel
def test_fused_forward_rejects_bad_positions_slots_and_taps():
    from runtime.models.gguf_weights import fused_forward_

    model = tiny_gguf_model()
    cache = model.new_cache(2, 8)
    x = torch.randn(1, 256)
    with pytest.raises(RuntimeError, match="out of range"):
        fused_forward_(model, x, cache, torch.tensor([0]), torch.tensor([8]))
    with pytest.raises(RuntimeError, match="bad slot"):
        fused_forward_(model, x, cache, torch.tensor([2]), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="bad tap"):
        fused_forward_(model, x, cache, torch.tensor([0]), torch.tensor([0]), [2])
    taps = fused_forward_(model, x, cache, torch.tensor([0]), torch.tensor([0]), [1, 0])
    assert taps.shape == (1, 2, 256) and torch.equal(taps[:, 0], x)  # layer 1 is the last: x in place
    assert not torch.equal(taps[:, 1], x)


@pytest.mark.model
def test_engine_serves_gguf_greedy(model_dir, tokenizer):
    """``EngineConfig(dtype="gguf")``: the engine's greedy tokens are the gguf model's own
    one-token-at-a-time argmax continuation (fused layer where the kernel runs)."""
    from runtime.config import EngineConfig
    from runtime.engine.llm_engine import LLMEngine
    from tests.support.engine_checks import assert_engine_greedy_is_model_argmax

    events: dict[str, list] = {}
    engine = LLMEngine(EngineConfig(dtype="gguf", max_batch_size=2, max_context=256),
                       lambda rid, ev: events.setdefault(rid, []).append(ev), tokenizer=tokenizer)
    m = engine.model
    assert isinstance(m.layers[0].mlp.down_proj, GgufLinear) and m.lm_head_quant is not None
    assert (m.fused_forward is not None) == cpu_supports_kernel()
    prompts = ["The capital of France is Paris. The capital of Germany is", "def fibonacci(n):\n    if n < 2:\n"]
    assert_engine_greedy_is_model_argmax(engine, events, [tokenizer(p)["input_ids"] for p in prompts])
