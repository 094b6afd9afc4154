"""The DSpark drafter: parallel block backbone + Markov head + confidence head (paper §3.1).

Context features (DFlash-style). For every committed position t the target's
hidden states at layers ``cfg.target_layer_ids`` (m of them) are concatenated and
projected: ``f_t = RMSNorm(W_fc [h_t^{l_1}; …; h_t^{l_m}])``, W_fc ∈ R^{d×md}, no bias.
Every draft layer projects f_t to K and V with its own k/v projection (the k/v
rows of its fused ``qkv_proj``, shared with the block tokens) and RoPE at the
original position t; these are prepended to the block's own K/V. Because f_t does
not depend on the draft layers' outputs, each layer's context K/V can be cached
once per committed position: :class:`DraftContextCache`.

Block. With the anchor (last committed token, not yet processed by the target)
at position p, the block is ``[anchor, mask, …, mask]`` (γ slots, a learnable
mask embedding) at positions p, p+1, …, p+γ−1. Queries come only from the block;
every block query attends to the context positions ``0 … p−1`` (strictly before
the anchor — the anchor's own features need the target to process it first,
which happens in this round's verification) and to all γ block slots
(bidirectional). Slot j's final hidden h_j gives base logits U_j through the
target's (shared, frozen) LM head and predicts the token at position p+1+j, so
one forward proposes γ tokens. Embeddings, LM head and the rotary tables are the
target's; the drafter keeps a reference to the target and copies nothing.

Sampling (:func:`sample_block`) is left to right: x_0 = anchor, x_k ~
warp(U_k + B(x_{k−1})) for k = 1..γ (Markov head, :mod:`runtime.speculation.markov_head`),
and c_k = σ(wᵀ[h_k; W1[x_{k−1}]] / T_k) (:mod:`runtime.speculation.confidence_head`).

Serving invariant (see :func:`runtime.speculation.verifier.spec_round` for the full
round): for a decoding sequence, ``draft_cache.lengths[slot] ==
target_cache.lengths[slot] == p``, the anchor's position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from runtime.engine.kv_cache import KVCache
from runtime.engine.sampler import SamplingBatch, uniform, warp_probs
from runtime.kernels.dispatch import kernel_path, markov_sample
from runtime.models.llama import (
    DecoderLayer,
    LlamaModel,
    RMSNorm,
    Rotary,
)
from runtime.speculation.confidence_head import ConfidenceHead, calibrated_confidence
from runtime.speculation.config import DrafterConfig
from runtime.speculation.markov_head import MarkovHead, apply_markov, build_markov_head


class DraftContextCache(KVCache):
    """Per-slot projected context K/V of every draft layer (analogous to :class:`KVCache`).

    Layout per tensor: ``[num_layers, num_slots, num_kv_heads, max_len + block_size, head_dim]``.
    Entries ``[:lengths[slot]]`` are the RoPE'd K and the V of the committed context
    positions; ``[lengths[slot] : lengths[slot] + γ]`` is scratch where
    :meth:`DSparkDrafter.forward_block` writes the block's own K/V (so a block's
    attention is one contiguous view, no copy). Rolling back = :meth:`truncate`.
    Slot ids are the engine's (use the target KV cache's slot for the sequence): the
    :class:`KVCache` slot allocator is not used; :meth:`reset` starts a slot.

    Args:
        num_layers: draft layers.
        num_slots: max concurrent sequences.
        num_kv_heads, head_dim: the draft layers' attention geometry (= target's).
        max_len: max committed context positions per sequence.
        block_size: max γ (extra scratch per slot).
        dtype, device: storage (the drafter's dtype).
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, max_len: int,
                 block_size: int, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> None:
        super().__init__(num_layers, num_slots, num_kv_heads, head_dim, max_len + block_size, dtype, device)
        self.max_len = max_len
        self.block_size = block_size

    def reset(self, slot: int) -> None:
        """Start a new sequence in ``slot`` (length 0). If the previous one held more than
        ``keep_tokens`` positions, their pages past that go back to the OS (as :meth:`KVCache.free`)."""
        if self.lengths[slot] > self.keep_tokens:
            self.release(slot, self.keep_tokens)
        self.lengths[slot] = 0

    def append_plan(
        self, taps: torch.Tensor, num_taps: int, slots: Sequence[int], counts: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where committing ``counts[i]`` new context rows to ``slots[i]`` writes them.

        Args:
            taps: ``[T, num_taps, d]`` target taps of the rows, sequence after sequence.
            num_taps: m, the drafter's tap layers.
            slots, counts: per sequence, its slot and new rows (``Σ counts == T``; 0 allowed).

        Returns:
            ``(slot_idx, positions)``: int64 ``[T]`` on the cache's device; sequence i's rows
            get positions ``lengths[slot_i] + 0 … counts_i − 1``. Lengths are not changed
            (:meth:`advance` does that once the rows are written).

        Raises:
            ValueError: mismatched shapes or a slot overflowing ``max_len``.
        """
        if taps.dim() != 3 or taps.shape[1] != num_taps:
            raise ValueError(f"taps must be [T, {num_taps}, d], got {tuple(taps.shape)}")
        if len(slots) != len(counts) or sum(counts) != taps.shape[0]:
            raise ValueError(f"counts {list(counts)} do not cover the {taps.shape[0]} tap rows")
        pos, sl = [], []
        for s, n in zip(slots, counts):
            if self.lengths[s] + n > self.max_len:
                raise ValueError(f"draft context slot {s}: {self.lengths[s] + n} > max_len {self.max_len}")
            pos.extend(range(self.lengths[s], self.lengths[s] + n))
            sl.extend([s] * n)
        device = self.k.device
        return torch.tensor(sl, dtype=torch.long, device=device), torch.tensor(pos, dtype=torch.long, device=device)

    def advance(self, slots: Sequence[int], counts: Sequence[int]) -> None:
        """Mark ``counts[i]`` more context positions of ``slots[i]`` as committed."""
        for s, n in zip(slots, counts):
            self.lengths[s] += n


class DraftLayer(DecoderLayer):
    """One draft decoder layer: the target's design and parameters (RMSNorm → GQA+RoPE →
    RMSNorm → SwiGLU), with a block forward over the projected context K/V."""

    def context_kv(
        self, feats: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Context features ``[T, d]`` → RoPE'd K and V, each ``[T, KVH, D]``."""
        a = self.self_attn
        q_out, kv_out, _ = a.split
        k, v = F.linear(feats, a.qkv_proj.weight[q_out:]).split(kv_out, dim=-1)
        T = feats.shape[0]
        k = Rotary.apply(k.view(T, a.num_kv_heads, a.head_dim), cos, sin)
        return k, v.view(T, a.num_kv_heads, a.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        slot_idx: torch.Tensor,
        positions: torch.Tensor,
        blocks: Sequence[tuple[int, int]],
        gamma: int,
    ) -> torch.Tensor:
        """``x [B·γ, d]`` (blocks concatenated) → ``[B·γ, d]``.

        ``kc``/``vc`` are this layer's cache tensors ``[S, KVH, max_len+γmax, D]``;
        ``blocks`` lists ``(slot, p)`` per block. The block's K/V are written at
        ``[p, p+γ)`` and each block attends to ``[0, p+γ)`` without a mask.
        """
        a = self.self_attn
        q, k, v = a.project_qkv(self.input_layernorm(x), cos, sin)
        kc[slot_idx, :, positions] = k
        vc[slot_idx, :, positions] = v
        out = torch.empty_like(q)
        for i, (slot, p) in enumerate(blocks):
            rows = slice(i * gamma, (i + 1) * gamma)
            qi = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, γ, D]
            ki = kc[slot, :, : p + gamma].unsqueeze(0)  # [1, KVH, p+γ, D]
            vi = vc[slot, :, : p + gamma].unsqueeze(0)
            oi = F.scaled_dot_product_attention(qi, ki, vi, scale=a.scale, enable_gqa=True)
            out[rows] = oi[0].transpose(0, 1)
        x = x + a.o_proj(out.reshape(x.shape[0], -1))
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class DraftBlock:
    """Output of :meth:`DSparkDrafter.propose`.

    Attributes:
        base_logits: U, fp32 ``[B, γ, V]`` (before the Markov bias).
        hidden: h, final-normed backbone hidden ``[B, γ, d]`` (drafter dtype).
    """

    base_logits: torch.Tensor
    hidden: torch.Tensor


@dataclass
class DraftSample:
    """Output of :func:`sample_block`.

    Attributes:
        tokens: int64 ``[B, γ]`` draft tokens x_1..x_γ.
        probs: fp32 ``[B, γ, V]`` — p_d, the warped Markov-corrected distributions the
            tokens were drawn from (what verification must use).
        confidence: fp32 ``[B, γ]`` calibrated c_k = σ(logit_k / T_k).
        confidence_logits: fp32 ``[B, γ]`` raw pre-sigmoid logits (STS fitting input).
    """

    tokens: torch.Tensor
    probs: torch.Tensor
    confidence: torch.Tensor
    confidence_logits: torch.Tensor

    def dense_probs(self, lengths: Sequence[int]) -> torch.Tensor:
        """p_d rows of the first ``lengths[i]`` slots of each sequence, fp32 ``[Σ ℓ, V]``."""
        if not lengths:
            return self.probs.new_zeros(0, self.probs.shape[-1])
        return torch.cat([self.probs[i, :n] for i, n in enumerate(lengths)])


@torch.inference_mode()
def sample_block(
    markov: MarkovHead | None,
    confidence: ConfidenceHead,
    base_logits: torch.Tensor,
    hidden: torch.Tensor,
    anchors: torch.Tensor,
    sampling: SamplingBatch,
    sts_temperatures: torch.Tensor | None = None,
) -> DraftSample:
    """Draw a block left to right through the Markov head (paper §3.1).

    For k = 1..γ: ``p_d,k = warp_probs(U_k + B(x_{k−1}, h_k))`` with the row's
    temperature / top-k / top-p (:func:`runtime.engine.sampler.warp_probs`; temperature 0 →
    one-hot argmax), ``x_k = sample(p_d,k)`` from the row's generator (one draw per
    slot, none for one-hot rows) — or, for a seeded row, the Gumbel-max draw with the noise
    the target uses at that output position (:meth:`SamplingBatch.sample_rows`); x_0 = the anchor. Confidence logits use
    ``[h_k; W1[x_{k−1}]]`` (h_k alone when ``markov is None``).

    Args:
        markov: the Markov head, or ``None`` (rank 0: slots independent).
        confidence: the confidence head.
        base_logits: U, ``[B, γ, V]`` (any float dtype).
        hidden: h, ``[B, γ, d]``.
        anchors: int64 ``[B]`` x_0.
        sampling: the rows' sampling parameters and randomness, exactly as for the target's rows.
        sts_temperatures: fp32 ``[≥γ]`` STS temperatures or ``None``.

    Returns:
        :class:`DraftSample`.
    """
    B, gamma, _ = base_logits.shape
    temperature, top_k, top_p = sampling.tensors
    if _fused_markov_ok(markov, base_logits, top_k, top_p) and not sampling.seeded_rows:
        return _sample_block_fused(markov, confidence, base_logits, hidden, anchors, temperature, sampling.generators,
                                   sts_temperatures)
    prev = anchors.long()
    tokens = []
    probs = torch.empty(base_logits.shape, dtype=torch.float32, device=base_logits.device)
    greedy = bool((temperature <= 0).all())
    if greedy:
        probs.zero_()
    for k in range(gamma):
        logits_k = apply_markov(markov, base_logits[:, k], prev, hidden[:, k])
        if greedy:  # the same one-hot warp_probs gives and the token sample() draws from it, without the copies
            prev = logits_k.argmax(-1)
            probs[:, k].scatter_(-1, prev[:, None], 1.0)
        else:
            probs[:, k] = warp_probs(logits_k, temperature, top_k, top_p)
            prev = sampling.sample_rows(probs[:, k], offset=k)
        tokens.append(prev)
    tok = torch.stack(tokens, dim=1)
    prev_all = torch.cat([anchors.long()[:, None], tok[:, :-1]], dim=1)  # x_0..x_{γ−1}
    emb = markov.prev_embedding(prev_all) if markov is not None else None
    conf_logits = confidence(hidden, emb)
    return DraftSample(
        tokens=tok,
        probs=probs,
        confidence=calibrated_confidence(conf_logits, sts_temperatures),
        confidence_logits=conf_logits,
    )


def _fused_markov_ok(markov, base_logits, top_k, top_p) -> bool:
    """The fused Markov sampler (``runtime.kernels``) applies: vanilla head, temperature
    only (no row uses top-k/top-p), and the kernel path is on (CUDA, or forced by
    ``SPARKGATE_KERNELS`` — see :func:`runtime.kernels.dispatch.kernel_path`)."""
    return (
        markov is not None
        and markov.variant == "vanilla"
        and kernel_path(base_logits)
        and bool((top_k <= 0).all())
        and bool((top_p >= 1.0).all())
    )


def _sample_block_fused(markov, confidence, base_logits, hidden, anchors, temperature, generators, sts) -> DraftSample:
    """:func:`sample_block` through ``runtime.kernels.markov_sample`` (Triton on CUDA).

    Random numbers: γ uniforms per request (one per slot, also for greedy rows)."""
    B, gamma, _ = base_logits.shape
    device = base_logits.device
    u = torch.stack([uniform(g, gamma, device=device) for g in generators]) if B else base_logits.new_zeros(0, gamma)
    res = markov_sample(
        base_logits, markov.w1.weight, markov.w2.weight.t(), anchors.long(), temperature.float().to(device), u
    )
    conf_logits = confidence(hidden, res.prev_embeddings)
    return DraftSample(
        tokens=res.tokens,
        probs=res.p_draft,
        confidence=calibrated_confidence(conf_logits, sts),
        confidence_logits=conf_logits,
    )


class DSparkDrafter(nn.Module):
    """DSpark drafter bound to a target model (see the module docstring).

    The target is referenced, not registered as a submodule: its weights are neither
    copied nor part of :meth:`state_dict`. The backbone (``fc``, norms, layers, mask
    embedding) lives in the target's dtype/device; the Markov and confidence heads
    are fp32. Random initialisation is deterministic in ``cfg.init_seed`` and does
    not touch the global RNG. Do not call ``.to(dtype)`` on it (heads must stay fp32).

    Args:
        target: the target :class:`LlamaModel`.
        cfg: drafter config (validated against the target).

    Raises:
        ValueError: invalid config.
    """

    def __init__(self, target: LlamaModel, cfg: DrafterConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or DrafterConfig()
        tcfg = target.cfg
        cfg.validate(tcfg.num_layers)
        self.cfg = cfg
        self.__dict__["target"] = target  # shared and frozen; not a submodule
        d, m = tcfg.hidden_size, len(cfg.target_layer_ids)
        device = target.embed_tokens.weight.device
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.init_seed)
            self.fc = nn.Linear(m * d, d, bias=False)
            self.hidden_norm = RMSNorm(d, tcfg.rms_norm_eps)
            self.layers = nn.ModuleList(DraftLayer(tcfg, i) for i in range(cfg.num_layers))
            self.norm = RMSNorm(d, tcfg.rms_norm_eps)
            emb_std = float(target.embed_tokens.weight.float().std())
            self.mask_embedding = nn.Parameter(torch.randn(d) * emb_std)
            self.markov = build_markov_head(tcfg.vocab_size, cfg.markov_rank, d, cfg.markov_variant)
            self.confidence = ConfidenceHead(d, cfg.markov_rank)
        for mod in (self.fc, self.hidden_norm, self.layers, self.norm):
            mod.to(device=device, dtype=target.dtype)
        self.mask_embedding.data = self.mask_embedding.data.to(device=device, dtype=target.dtype)
        if self.markov is not None:
            self.markov.to(device)
        self.confidence.to(device)
        self.eval().requires_grad_(False)

    # -- accessors ------------------------------------------------------------
    @property
    def target(self) -> LlamaModel:
        return self.__dict__["target"]

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def tap_layers(self) -> list[int]:
        """Target layers to request as taps in every target forward."""
        return list(self.cfg.target_layer_ids)

    def sts_tensor(self) -> torch.Tensor | None:
        """STS temperatures as fp32 ``[γ]`` (``None`` if uncalibrated)."""
        t = self.cfg.sts_temperatures
        return None if t is None else torch.tensor(t, dtype=torch.float32, device=self.fc.weight.device)

    def new_context_cache(self, num_slots: int, max_len: int) -> DraftContextCache:
        """A :class:`DraftContextCache` for ``num_slots`` sequences of ≤ ``max_len`` tokens."""
        a = self.layers[0].self_attn
        return DraftContextCache(
            len(self.layers), num_slots, a.num_kv_heads, a.head_dim, max_len, self.cfg.block_size,
            self.dtype, self.fc.weight.device,
        )  # fmt: skip

    # -- context ---------------------------------------------------------------
    def context_features(self, taps: torch.Tensor) -> torch.Tensor:
        """Target taps ``[T, m, d]`` → context features ``[T, d]`` (RMSNorm(W_fc · concat))."""
        T = taps.shape[0]
        return self.hidden_norm(self.fc(taps.reshape(T, -1).to(self.dtype)))

    @torch.inference_mode()
    def extend_context(
        self, cache: DraftContextCache, taps: torch.Tensor, slots: Sequence[int], counts: Sequence[int]
    ) -> None:
        """Commit context positions: append their projected K/V and advance lengths.

        Args:
            cache: the drafter's context cache.
            taps: ``[T, m, d]`` target taps (layers ``tap_layers``, as returned by
                ``LlamaModel.forward(..., tap_layers=drafter.tap_layers).taps``) of
                the newly committed tokens, sequence after sequence.
            slots: the sequences' slots.
            counts: tokens committed per sequence (``Σ counts == T``; 0 allowed).
                Sequence i's rows get positions ``lengths[slot_i] + 0 … counts_i − 1``.

        Raises:
            ValueError: mismatched shapes or a slot overflowing ``cache.max_len``.
        """
        slot_idx, positions = cache.append_plan(taps, len(self.cfg.target_layer_ids), slots, counts)
        if taps.shape[0] > 0:
            feats = self.context_features(taps)
            cos, sin = self.target.rotary.tables(positions, self.dtype)
            for i, layer in enumerate(self.layers):
                k, v = layer.context_kv(feats, cos, sin)
                cache.k[i][slot_idx, :, positions] = k
                cache.v[i][slot_idx, :, positions] = v
        cache.advance(slots, counts)

    # -- block forward -----------------------------------------------------------
    @torch.inference_mode()
    def forward_block(
        self, block_embeds: torch.Tensor, slots: Sequence[int], cache: DraftContextCache
    ) -> torch.Tensor:
        """The backbone on given block input embeddings (lower level of :meth:`propose`).

        Args:
            block_embeds: ``[B, γ, d]`` slot inputs (normally anchor embedding + masks).
            slots: B slots; block i sits at positions ``p_i … p_i+γ−1`` with
                ``p_i = cache.lengths[slots[i]]`` and sees context ``[0, p_i)``.
            cache: context cache (its committed part is not modified).

        Returns:
            final-normed hidden ``[B, γ, d]`` (drafter dtype).

        Raises:
            ValueError: γ larger than the cache's block scratch.
        """
        B, gamma, d = block_embeds.shape
        if gamma > cache.block_size:
            raise ValueError(f"block of {gamma} slots > cache block_size {cache.block_size}")
        device = cache.k.device
        blocks = [(s, cache.lengths[s]) for s in slots]
        positions = torch.cat([torch.arange(p, p + gamma) for _, p in blocks]).to(device)
        slot_idx = torch.tensor(slots, dtype=torch.long).repeat_interleave(gamma).to(device)
        cos, sin = self.target.rotary.tables(positions, self.dtype)
        x = block_embeds.reshape(B * gamma, d).to(self.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.k[i], cache.v[i], slot_idx, positions, blocks, gamma)
        return self.norm(x).view(B, gamma, d)

    def block_inputs(self, anchors: torch.Tensor, gamma: int) -> torch.Tensor:
        """``[anchor, mask, …, mask]`` embeddings ``[B, γ, d]``."""
        B = anchors.shape[0]
        x = self.mask_embedding.expand(B, gamma, -1).clone()
        x[:, 0] = self.target.embed_tokens(anchors.long()).to(self.dtype)
        return x

    @torch.inference_mode()
    def propose(
        self,
        anchors: torch.Tensor,
        slots: Sequence[int],
        cache: DraftContextCache,
        block_size: int | None = None,
    ) -> DraftBlock:
        """One batched draft forward: base logits and hidden states for γ slots.

        Args:
            anchors: int64 ``[B]``, each sequence's anchor (last committed token, at
                position ``cache.lengths[slot]``).
            slots: B slots (ragged contexts: each block attends only to its own
                ``[0, p_i)`` context, no padding).
            cache: the drafter's context cache.
            block_size: γ' ≤ ``cfg.block_size`` slots (default ``cfg.block_size``).

        Returns:
            :class:`DraftBlock` (U fp32 ``[B, γ', V]``, h ``[B, γ', d]``).

        Raises:
            ValueError: γ' out of range.
        """
        gamma = self.cfg.block_size if block_size is None else block_size
        if not 1 <= gamma <= self.cfg.block_size:
            raise ValueError(f"block_size {gamma} not in [1, {self.cfg.block_size}] (checkpoint γ)")
        hidden = self.forward_block(self.block_inputs(anchors, gamma), slots, cache)
        B, _, d = hidden.shape
        logits = self.target.lm_head(hidden.reshape(B * gamma, d)).view(B, gamma, -1)
        return DraftBlock(base_logits=logits, hidden=hidden)

    def sample_block(self, block: DraftBlock, anchors: torch.Tensor, sampling: SamplingBatch) -> DraftSample:
        """:func:`sample_block` with this drafter's heads and STS temperatures (``sampling``: one row per anchor)."""
        return sample_block(self.markov, self.confidence, block.base_logits, block.hidden, anchors, sampling,
                            self.sts_tensor())
