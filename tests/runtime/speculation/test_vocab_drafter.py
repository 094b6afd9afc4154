"""The draft-vocabulary drafter on the torch backbone (runtime/speculation/vocab_drafter.py)
against the reference drafter, on the real fp32 target with the committed drafter — it runs
on every CPU (no kernel needed), and it is what the engine drafts with off the gguf path.

With the whole vocabulary as its "draft vocabulary" it must BE the reference drafter (the
shared sampler, the sliced LM head and W2 columns change nothing); with the committed
8,192-token vocabulary, p_d is the reference's distribution restricted to it and greedy
drafts are the restricted argmax. The engine-level T = 0 equality with AR runs through it in
every fp32 speculative test (tests/runtime/speculation/test_spec_engine.py and others).
"""

from __future__ import annotations

import pytest
import torch

from runtime.config import EngineConfig
from runtime.engine.sampler import SamplingBatch
from runtime.models.llama import SeqSpan
from runtime.speculation.fast_drafter import load_draft_vocab
from runtime.speculation.vocab_drafter import VocabDrafter

pytestmark = pytest.mark.model

V = 49152


@pytest.fixture(scope="module")
def setup(target_fp32, tokenizer):
    """(drafter, context cache holding 64 positions of a greedy reply, token ids)."""
    from runtime.speculation.checkpoint import load_drafter
    from runtime.speculation.speculator import DEFAULT_CHECKPOINT

    drafter = load_drafter(DEFAULT_CHECKPOINT, target_fp32)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Explain how a hash map works in Python."}],
                                         add_generation_prompt=True, tokenize=False)
    seq = tokenizer.encode(text, add_special_tokens=False)
    cache = target_fp32.new_cache(1, 256)
    s = cache.allocate()
    out = target_fp32.forward(torch.tensor(seq), [SeqSpan(s, 0, len(seq))], cache, torch.tensor([len(seq) - 1]),
                              drafter.tap_layers)
    taps = [out.taps]
    for _ in range(40):  # a greedy continuation: the drafter's context
        seq.append(int(out.logits[-1].argmax()))
        out = target_fp32.forward(torch.tensor(seq[-1:]), [SeqSpan(s, len(seq) - 1, 1)], cache, torch.tensor([0]),
                                  drafter.tap_layers)
        taps.append(out.taps)
    ctx = drafter.new_context_cache(1, 256)
    drafter.extend_context(ctx, torch.cat(taps)[:-1], [0], [len(seq) - 1])  # the last token is the first anchor
    return drafter, ctx, seq


def _sampling(temperature: float, seed: int = 0) -> SamplingBatch:
    return SamplingBatch(torch.full((1,), float(temperature)), torch.zeros(1, dtype=torch.long), torch.ones(1),
                         [torch.Generator().manual_seed(seed)])


def test_with_the_whole_vocabulary_it_is_the_reference_drafter(setup):
    """vocab = all V tokens: tokens (T = 0) equal the reference's at every anchor, and the
    confidences and T = 1 p_d rows equal them to fp32 rounding."""
    drafter, ctx, seq = setup
    full = VocabDrafter(drafter, torch.arange(V))
    g = drafter.block_size
    n = ctx.lengths[0]
    for back in range(12):  # anchors seq[p] with contexts [0, p)
        p = n - back
        ctx.truncate(0, p)
        a = torch.tensor([seq[p]])
        ref = drafter.sample_block(drafter.propose(a, [0], ctx, block_size=g), a, _sampling(0))
        got = full.draft(a, [0], ctx, g, _sampling(0))
        assert torch.equal(got.tokens, ref.tokens), (p, got.tokens, ref.tokens)
        assert torch.allclose(got.confidence, ref.confidence, atol=1e-5)
        assert ctx.lengths == [p]  # drafting never commits
    ref = drafter.sample_block(drafter.propose(a, [0], ctx, block_size=g), a, _sampling(1.0, seed=5))
    got = full.draft(a, [0], ctx, g, _sampling(1.0, seed=5))
    assert torch.equal(got.tokens, ref.tokens)  # the same draws from the same distributions
    assert (got.dense_probs([g]) - ref.dense_probs([g])).abs().max() < 1e-5


def test_an_fp32_vocab_drafter_multiplies_packed_weights(setup):
    """Off the gguf path in fp32 the draft head and every backbone projection carry MKL-packed
    copies (llama.linear's packed route: a draft block is 4+ rows), where this torch packs."""
    from runtime.models.llama import Linear, mkl_packing_available

    drafter, _, _ = setup
    vd = VocabDrafter(drafter, torch.arange(0, V, 6))
    linears = [m for m in drafter.modules() if isinstance(m, Linear)]
    assert linears and vd.head.dtype == torch.float32
    packed = mkl_packing_available()
    assert all((m.packed is not None) == packed for m in linears) and (vd.head_packed is not None) == packed


def test_the_draft_vocabulary_restricts_p_d_and_the_greedy_argmax(setup):
    """The committed 8,192-token vocabulary: p_d zero outside it and summing to 1, slot 1's
    p_d the reference's softmax renormalised over it, greedy x_1 its argmax there."""
    from runtime.speculation.speculator import DEFAULT_CHECKPOINT

    drafter, ctx, seq = setup
    vocab = load_draft_vocab(DEFAULT_CHECKPOINT, V)
    vd = VocabDrafter(drafter, vocab)
    g = drafter.block_size
    p = ctx.lengths[0] - 3
    ctx.truncate(0, p)
    a = torch.tensor([seq[p]])
    blk = drafter.propose(a, [0], ctx, block_size=g)
    corrected = drafter.markov.corrected_logits(blk.base_logits[:, 0], a)[0]  # U_1 + W1[x_0]·W2 over all V
    greedy = vd.draft(a, [0], ctx, g, _sampling(0))
    assert int(greedy.tokens[0, 0]) == int(vocab[corrected[vocab].argmax()])
    assert all(int(t) in set(vocab.tolist()) for t in greedy.tokens[0])
    sampled = vd.draft(a, [0], ctx, g, _sampling(1.0, seed=3))
    probs = sampled.dense_probs([g])
    outside = torch.ones(V, dtype=torch.bool)
    outside[vocab] = False
    assert probs[:, outside].abs().max() == 0
    assert torch.allclose(probs.sum(-1), torch.ones(g), atol=1e-5)
    assert (probs[torch.arange(g), sampled.tokens[0]] > 0).all()  # each token drawn from its row
    restricted = torch.softmax(corrected[vocab], -1)
    assert (restricted - probs[0, vocab]).abs().max() < 1e-5


def test_the_engine_drafts_over_the_draft_vocabulary_off_the_gguf_path(target_fp32, tokenizer):
    """fp32 target: the speculator drafts with VocabDrafter (its own SPS-profile id);
    ``draft_fused=False`` keeps the reference full-vocabulary drafter."""
    from runtime.engine.llm_engine import LLMEngine
    from runtime.speculation.sps_profiler import drafter_id

    def speculator(**kw):
        cfg = EngineConfig(dtype="float32", max_batch_size=1, max_context=256, spec_method="dspark", **kw)
        return LLMEngine(cfg, lambda rid, ev: None, model=target_fp32, tokenizer=tokenizer).speculator

    sp = speculator()
    assert isinstance(sp.fast, VocabDrafter) and sp.fast.vocab.numel() == 8192
    assert drafter_id(sp).endswith(":vocab:N8192")
    ref = speculator(draft_fused=False)
    assert ref.fast is None and ":vocab" not in drafter_id(ref)
