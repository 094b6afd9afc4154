"""The DSpark drafter on the fused CPU path: what the engine drafts with when the target is served in ``gguf``.

:class:`~runtime.speculation.drafter.DSparkDrafter` is the reference: plain torch modules,
used for training, evaluation and on every other dtype/device. In the engine it runs
as ~150 small torch ops per round on one thread, which cost more than a decode step of
the fused target (docs/benchmarks.md, "Drafting cost"). :class:`FastDrafter` computes
the same draft with three changes, each measured there:

1. **Backbone in one C++ call.** The draft layers run in
   ``torch.classes.sparkgate.FusedModel`` (``runtime/kernels/cpu/fused_layer.cpp``), the
   target's own fused layer code, with ``forward_block_`` giving every slot of a block
   the keys ``[0, p+γ)`` (bidirectional inside the block) and ``context_`` writing the
   context K/V of newly committed positions. The drafter's bf16 projections (and the
   context projection W_fc) are quantised once to Q8_0 (:func:`quantize_q8_0`, GGML's reference rounding) for the tile
   kernel; above ``kernel_max_rows`` rows the bf16 weights are used as they are.
2. **Draft vocabulary** (FR-Spec, Zhao et al. 2025; EAGLE-3 does the same): the base logits
   U_k are computed only for the ``N`` most frequent tokens of the drafter's training
   responses (``draft_vocab.json`` in the checkpoint; 8,192 ids cover 95.0 % of the
   held-out response tokens, 16,384 cover 97.7 %), so the LM head reads N rows instead of 49,152.
3. **Markov chain over the draft vocabulary.** Slot k's logits are
   ``U_k + W1[x_{k−1}]·W2`` (paper §3.1) with W2's columns cut to the same N tokens: one
   ``[B, r] × [r, N]`` product per step instead of ``[r, V]``. Over those N tokens the
   draft is the reference drafter's: greedy rows take the same argmax (ties broken by
   draft-vocabulary order), sampled rows draw from the row's warp of the logits restricted
   to the draft vocabulary (temperature, then top-k / top-p among those N tokens). (Evaluating the
   bias only on each slot's top-64 base logits would be cheaper still, but it changed
   8 % of the greedy drafts of the committed drafter: its bias is large, which is what
   the Markov head is for.)

Why this stays lossless: speculative sampling is exact for ANY draft distribution p_d,
as long as the verifier is given the p_d the token was actually drawn from. Here p_d is
the restricted distribution (zero outside the candidates), which is what
:meth:`FastDraft.dense_probs` hands to verification. Only the acceptance rate can move;
docs/drafter.md measures it against the reference drafter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from runtime.engine.sampler import SamplingBatch, warp_probs
from runtime.kernels.cpu import gguf_cpu
from runtime.models.gguf_weights import GgufLinear, kernel_max_rows
from runtime.speculation.confidence_head import calibrated_confidence
from runtime.speculation.drafter import DraftContextCache, DSparkDrafter

#: File in a checkpoint directory listing the draft vocabulary (token ids, most frequent first).
DRAFT_VOCAB_FILE = "draft_vocab.json"


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """GGML Q8_0 rows of a weight (``quantize_row_q8_0_ref``).

    Per block of 32 weights: ``d = max|w| / 127``, ``q = round(w / d)`` (int8), stored as
    fp16 d then the 32 q — 34 bytes.

    Args:
        w: float ``[n, k]``, ``k`` a multiple of 32.

    Returns:
        uint8 ``[n, k/32 · 34]``, the layout :func:`runtime.kernels.cpu.gguf_cpu.repack` takes.

    Raises:
        ValueError: ``k`` not a multiple of 32.
    """
    n, k = w.shape
    if k % gguf_cpu.QK:
        raise ValueError(f"Q8_0 needs rows of a multiple of 32 weights, got {k}")
    b = w.detach().float().reshape(n, k // gguf_cpu.QK, gguf_cpu.QK)
    d = b.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(b * inv[..., None]).clamp(-127, 127).to(torch.int8)
    dh = d.to(torch.float16).contiguous().view(torch.uint8).reshape(n, k // gguf_cpu.QK, 2)
    return torch.cat([dh, q.view(torch.uint8)], dim=-1).reshape(n, -1).contiguous()


def q8_linear(weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> GgufLinear:
    """A :class:`GgufLinear` over the Q8_0 quantisation of a float ``[out, in]`` weight
    (the weight itself stays its dense copy)."""
    n, k = weight.shape
    return GgufLinear(quantize_q8_0(weight), gguf_cpu.Q8_0, n, k, dense=weight.detach().contiguous(), out_dtype=out_dtype,
                      max_rows=kernel_max_rows())


def load_draft_vocab(checkpoint: str | Path | None, vocab_size: int) -> torch.Tensor | None:
    """The draft vocabulary of a checkpoint: int64 ``[N]`` token ids, or ``None`` (all tokens).

    Raises:
        ValueError: ids out of range, repeated, or N not a multiple of 16 (the tile height).
    """
    if checkpoint is None or not (Path(checkpoint) / DRAFT_VOCAB_FILE).exists():
        return None
    ids = torch.tensor(json.loads((Path(checkpoint) / DRAFT_VOCAB_FILE).read_text())["token_ids"], dtype=torch.long)
    if ids.numel() % 16 or ids.numel() == 0:
        raise ValueError(f"draft vocabulary of {ids.numel()} ids: need a positive multiple of 16")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or ids.unique().numel() != ids.numel():
        raise ValueError("draft vocabulary ids must be distinct token ids of the target")
    return ids


def build_draft_vocab(data, size: int, vocab_size: int) -> dict:
    """The ``size`` most frequent response tokens of the training split (FR-Spec's ranking).

    Args:
        data: :class:`training.data.DrafterData` (response tokens only are counted).
        size: N, a positive multiple of 16.
        vocab_size: V of the target.

    Returns:
        ``{"token_ids": [...] (most frequent first; ties by id), "size", "heldout_coverage"}``,
        coverage = fraction of held-out response tokens inside the vocabulary.

    Raises:
        ValueError: ``size`` not a positive multiple of 16 or larger than V.
    """
    import numpy as np

    if size <= 0 or size % 16 or size > vocab_size:
        raise ValueError(f"draft vocabulary size must be a positive multiple of 16 <= {vocab_size}, got {size}")

    def counts(split: str) -> np.ndarray:
        c = np.zeros(vocab_size, dtype=np.int64)
        for i in data.indices(split):
            c += np.bincount(data.sequence(i)[data.prompt_lens[i]:].astype(np.int64), minlength=vocab_size)
        return c

    train, held = counts("train"), counts("heldout")
    ids = np.argsort(-train, kind="stable")[:size]
    cov = float(held[ids].sum() / max(held.sum(), 1))
    return {"token_ids": ids.tolist(), "size": size, "heldout_coverage": round(cov, 4)}


@dataclass
class FastDraft:
    """One drafted block per sequence (:meth:`FastDrafter.draft`).

    Attributes:
        tokens: int64 ``[B, γ]`` draft tokens x_1..x_γ (target token ids).
        greedy: bool ``[B]``, rows drafted at temperature 0 (p_d one-hot on the token).
        vocab: int64 ``[N]`` the draft vocabulary (target token ids).
        probs: fp32 ``[B, γ, N]`` p_d over the draft vocabulary for the sampled rows
            (``None`` when every row is greedy; greedy rows' entries are unused).
        confidence: fp32 ``[B, γ]`` calibrated c_k (STS).
        confidence_logits: fp32 ``[B, γ]`` raw confidence logits.
        vocab_size: V of the target (width of :meth:`dense_probs`).
    """

    tokens: torch.Tensor
    greedy: torch.Tensor
    vocab: torch.Tensor
    probs: torch.Tensor | None
    confidence: torch.Tensor
    confidence_logits: torch.Tensor
    vocab_size: int

    def dense_probs(self, lengths: Sequence[int]) -> torch.Tensor:
        """p_d rows of the first ``lengths[i]`` slots of each sequence, fp32 ``[Σ ℓ, V]``
        (zero outside the draft vocabulary): what verification takes."""
        bi = torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)], dtype=torch.long)
        ki = torch.tensor([k for n in lengths for k in range(n)], dtype=torch.long)
        out = torch.zeros(bi.numel(), self.vocab_size, dtype=torch.float32)
        if bi.numel() == 0:
            return out
        if self.probs is not None:
            out[:, self.vocab] = self.probs[bi, ki]
        g = self.greedy[bi]
        if bool(g.any()):
            rows = g.nonzero().squeeze(-1)
            out[rows] = 0.0
            out[rows, self.tokens[bi[rows], ki[rows]]] = 1.0
        return out


class FastDrafter:
    """A :class:`DSparkDrafter` compiled onto the fused CPU path (module docstring).

    It shares the drafter's parameters (not copied, except the Q8_0 tiles and the
    draft-vocabulary slices) and its :class:`DraftContextCache`; the target must be on
    the ``gguf`` path (:func:`available`).

    Args:
        drafter: the reference drafter (DSpark or the rank-0 ablation).
        draft_vocab: int64 ``[N]`` token ids (N a multiple of 16) or ``None`` (all V).

    Raises:
        RuntimeError: the target is not on the fused gguf path.
    """

    kind = "fused"  # the SPS profile's drafter id (sps_profiler.drafter_id)

    def __init__(self, drafter: DSparkDrafter, draft_vocab: torch.Tensor | None = None) -> None:
        target = drafter.target
        if not available(drafter):
            raise RuntimeError("FastDrafter needs a target on the fused gguf path (dtype gguf, AVX512-BF16 kernel)")
        self.drafter = drafter
        self.vocab_size = target.cfg.vocab_size
        a0 = drafter.layers[0].self_attn
        self.fm = torch.classes.sparkgate.FusedModel(
            drafter.layers[0].input_layernorm.eps, gguf_cpu.Q8_0, a0.num_heads, a0.num_kv_heads, kernel_max_rows(),
            target.rotary.cos, target.rotary.sin,
        )  # fmt: skip
        self._keep = []  # the tiles and fp32 norms FusedModel references
        for layer in drafter.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projs = [q8_linear(m.weight) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            ln = [layer.input_layernorm.weight.detach().float().contiguous(),
                  layer.post_attention_layernorm.weight.detach().float().contiguous()]
            args = [t for p in projs for t in (p.tiles, p.dense)]
            self.fm.add_layer(*ln, *args)
            self._keep.append((projs, ln))
        self.fc = q8_linear(drafter.fc.weight)  # the context projection W_fc, also over Q8_0 tiles
        self.vocab = draft_vocab if draft_vocab is not None else torch.arange(self.vocab_size)
        head_blocks = target.lm_head_quant.blocks()[self.vocab]  # GGML rows: a row subset is a valid tensor
        self.head = GgufLinear(head_blocks, target.lm_head_quant.qtype, self.vocab.numel(), target.cfg.hidden_size,
                               dense=target.lm_head_weight[self.vocab].contiguous(), out_dtype=torch.float32,
                               max_rows=kernel_max_rows())
        self.w2_sub_t = markov_columns(drafter, self.vocab)  # fp32 [r, N] (None: rank 0)

    # -- context --------------------------------------------------------------
    @torch.inference_mode()
    def extend_context(self, cache: DraftContextCache, taps: torch.Tensor, slots: Sequence[int], counts: Sequence[int]) -> None:
        """Same contract as :meth:`DSparkDrafter.extend_context` (taps fp32 ``[T, m, d]``)."""
        d = self.drafter
        slot_idx, positions = cache.append_plan(taps, len(d.cfg.target_layer_ids), slots, counts)
        if taps.shape[0] > 0:
            T = taps.shape[0]
            feats = d.hidden_norm(self.fc(taps.reshape(T, -1).to(d.dtype))).contiguous()  # = d.context_features
            self.fm.context_(feats, cache.k, cache.v, slot_idx, positions)
        cache.advance(slots, counts)

    # -- draft ----------------------------------------------------------------
    @torch.inference_mode()
    def draft(
        self,
        anchors: torch.Tensor,
        slots: Sequence[int],
        cache: DraftContextCache,
        gamma: int,
        sampling: SamplingBatch,
    ) -> FastDraft:
        """Draft γ tokens per sequence: backbone, draft-vocabulary LM head, Markov chain, confidences.

        Args:
            anchors: int64 ``[B]``, each sequence's anchor (at position ``cache.lengths[slot]``).
            slots: B slots.
            cache: the drafter's context cache (its committed part is not modified).
            gamma: γ ≤ the checkpoint's block size.
            sampling: B rows of sampling parameters, as for the target (one draw per sampled slot).

        Returns:
            :class:`FastDraft`.

        Raises:
            ValueError: γ out of range.
        """
        d = self.drafter
        if not 1 <= gamma <= min(d.cfg.block_size, cache.block_size):
            raise ValueError(f"block_size {gamma} not in [1, {d.cfg.block_size}]")
        B = anchors.shape[0]
        dim = d.target.cfg.hidden_size
        pos, sl, lens = [], [], []
        for s in slots:
            p = cache.lengths[s]
            pos.extend(range(p, p + gamma))
            sl.extend([s] * gamma)
            lens.extend([p + gamma] * gamma)
        x = d.block_inputs(anchors, gamma).float().reshape(B * gamma, dim).contiguous()  # the residual stream, fp32
        self.fm.forward_block_(x, cache.k, cache.v, torch.tensor(sl, dtype=torch.long),
                               torch.tensor(pos, dtype=torch.long), torch.tensor(lens, dtype=torch.long))
        hidden = d.norm(x).to(d.dtype)  # [B·γ, d]
        base = self.head(hidden).view(B, gamma, self.vocab.numel())  # U over the draft vocabulary, fp32
        return sample_over_vocab(d, self.vocab, self.w2_sub_t, base, hidden.view(B, gamma, dim), anchors.long(), sampling)


def markov_columns(drafter: DSparkDrafter, vocab: torch.Tensor) -> torch.Tensor | None:
    """W2's columns of the draft vocabulary, transposed: fp32 ``[r, N]`` (``None``: rank 0)."""
    mk = drafter.markov
    return None if mk is None else mk.w2.weight.detach()[vocab].t().contiguous()


def sample_over_vocab(drafter: DSparkDrafter, vocab: torch.Tensor, w2_sub_t: torch.Tensor | None, base: torch.Tensor,
                      hidden: torch.Tensor, anchors: torch.Tensor, sampling: SamplingBatch) -> FastDraft:
    """x_k ~ warp(U_k + W1[x_{k−1}]·W2) left to right over the draft vocabulary (paper §3.1;
    the module docstring's items 2–3). Shared by :class:`FastDrafter` and
    :class:`runtime.speculation.vocab_drafter.VocabDrafter`.

    Args:
        drafter: the reference drafter (its Markov and confidence heads, STS temperatures).
        vocab: int64 ``[N]`` draft-vocabulary token ids.
        w2_sub_t: :func:`markov_columns` of ``vocab`` (``None`` for rank 0).
        base: U over the draft vocabulary, fp32 ``[B, γ, N]``.
        hidden: backbone hidden ``[B, γ, d]`` (drafter dtype).
        anchors: int64 ``[B]`` x_0.
        sampling: B rows of sampling parameters (one draw per sampled slot).

    Returns:
        :class:`FastDraft`.
    """
    B, gamma, N = base.shape
    mk = drafter.markov
    tokens = torch.empty(B, gamma, dtype=torch.long)
    probs = None if sampling.greedy else torch.empty(B, gamma, N, dtype=torch.float32)
    prev = anchors
    embs = []
    for k in range(gamma):
        logits = base[:, k]
        if mk is not None:
            e = mk.prev_embedding(prev)  # W1[x_{k−1}], fp32 [B, r]
            embs.append(e)
            if mk.gate is not None:
                e = torch.sigmoid(mk.gate(torch.cat([hidden[:, k].float(), e], -1))) * e
            logits = torch.addmm(logits, e, w2_sub_t)  # U_k + W1[x_{k−1}]·W2
        if sampling.greedy:
            idx = logits.argmax(-1)
        else:
            probs[:, k] = warp_probs(logits, *sampling.tensors)
            idx = sampling.sample_rows(probs[:, k], offset=k, token_ids=vocab)
        prev = vocab[idx]
        tokens[:, k] = prev
    emb = torch.stack(embs, dim=1) if mk is not None else None  # W1[x_0..x_{γ−1}]
    conf_logits = drafter.confidence(hidden, emb)
    return FastDraft(tokens, sampling.temperature <= 0, vocab, probs,
                     calibrated_confidence(conf_logits, drafter.sts_tensor()), conf_logits,
                     drafter.target.cfg.vocab_size)


def available(drafter: DSparkDrafter) -> bool:
    """Whether :class:`FastDrafter` can run this drafter: its target is on the fused gguf
    path (``weights_format == "gguf"`` with the C++ kernel built) and on the CPU."""
    t = drafter.target
    return (
        getattr(t, "weights_format", None) == "gguf"
        and getattr(t, "fused_forward", None) is not None
        and t.lm_head_quant is not None
        and drafter.fc.weight.device.type == "cpu"
        and gguf_cpu.kernel_available()
    )


__all__ = ["FastDrafter", "FastDraft", "build_draft_vocab", "quantize_q8_0", "q8_linear", "load_draft_vocab", "available",
           "markov_columns", "sample_over_vocab", "DRAFT_VOCAB_FILE"]
