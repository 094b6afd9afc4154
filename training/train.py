"""Training of the DSpark drafter: batched block forward, loss, and the training loop (paper §3.3).

Forward (:func:`block_forward`). The serving path (``extend_context`` into a
:class:`DraftContextCache`, then ``forward_block`` per block) runs one attention
per block under ``inference_mode``. Training uses the SAME modules (``fc``,
``hidden_norm``, every :class:`DraftLayer`'s norms / ``qkv_proj`` / ``o_proj`` /
MLP, ``norm``, ``mask_embedding``, the target's embeddings, LM head and rotary
tables) in one batched, differentiable pass: context K/V of all L positions of a
sequence (``DraftLayer.context_kv`` at RoPE positions 0..L−1), the A blocks of the
sequence as A·γ queries at positions p_a..p_a+γ−1, and a boolean mask that lets
block a see context ``[0, p_a)`` and its own γ slots (bidirectional) — exactly the
keys ``forward_block`` attends to. ``tests/training/test_train.py`` checks it equals
the serving forward.

Loss (:func:`dspark_loss`, DeepSpec ``loss.py``; weights 0.1 / 0.9 / 1.0)::

    L = 0.1·CE + 0.9·L1 + 1.0·BCE,   each a w-weighted mean over valid block slots
    CE  = −log p_d,k(x_k)                      x_k = the regenerated sequence's token
    L1  = ‖p_d,k − p_t,k‖₁                     (full L1 = 2·TV, as DeepSpec; ∈ [0, 2])
    BCE = BCE(σ(z_k), α_k),  α_k = clamp(1 − ½‖p_d,k − p_t,k‖₁, 0, 1) (stop-grad)
    w_k = exp(−(k−1)/γ)                        (the paper's decay; k = 1..γ)

p_d,k = softmax(U_k + B(x_{k−1})) at temperature 1 with the Markov head teacher-
forced on the sequence's own previous token x_{k−1} (x_0 = the anchor); p_t,k is
the frozen target's next-token distribution at the same position (T = 1), from its
final hidden state through the shared LM head (:mod:`training.features`).
The confidence logit z_k uses ``[h_k ; W1[x_{k−1}]]`` with the same x_{k−1}.

Loop (:func:`train`). One frozen target in bf16 (as served) gives the teacher
features and p_t and is the drafter's shared embedding / LM head; the drafter's
trainable weights are fp32 master weights (:func:`fp32_backbone`; the LM-head matmul
runs in bf16, mixed precision) and the checkpoint loader casts them to the serving
dtype. AdamW with
linear warmup and cosine decay to ``min_lr_ratio``, gradient accumulation, grad-norm
clipping, periodic checkpoints (:func:`runtime.speculation.checkpoint.save_drafter` +
``train_state.pt``), resume, validation on held-out sequences, a JSONL log and a
learning-curve PNG.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from runtime.speculation.config import DrafterConfig
from runtime.speculation.drafter import DSparkDrafter
from runtime.speculation.markov_head import apply_markov
from training.data import DEFAULT_OUT, REPO_ROOT, repo_relative
from training.features import (
    BlockTargets,
    TeacherBatch,
    TeacherHead,
    block_targets,
    build_target,
    sample_anchors,
    teacher_forward,
)

LOSS_WEIGHTS = {"ce": 0.1, "l1": 0.9, "bce": 1.0}


# -- forward ---------------------------------------------------------------------------

def block_forward(
    drafter: DSparkDrafter, taps: torch.Tensor, anchors: torch.Tensor, anchor_tokens: torch.Tensor, gamma: int | None = None
) -> torch.Tensor:
    """Batched, differentiable drafter backbone over many blocks (module docstring).

    Args:
        drafter: the drafter (its own dtype; gradients flow to its parameters).
        taps: ``[N, L, m, d]`` target taps of N sequences (any float dtype; rows
            beyond a sequence's length are never attended by a valid block).
        anchors: int64 ``[N, A]`` anchor positions p (block a sees context ``[0, p_a)``).
        anchor_tokens: int64 ``[N, A]`` the anchors' token ids.
        gamma: slots per block (default ``drafter.block_size``).

    Returns:
        final-normed hidden ``[N, A, γ, d]`` (drafter dtype) — equal to
        ``forward_block`` on a context cache holding taps ``[0, p_a)``.
    """
    gamma = gamma or drafter.block_size
    N, L, m, d = taps.shape
    A = anchors.shape[1]
    dt = drafter.dtype
    rot = drafter.target.rotary
    feats = drafter.context_features(taps.reshape(N * L, m, d))  # [N·L, d]
    cos_c, sin_c = rot.tables(torch.arange(L).repeat(N), dt)
    bpos = (anchors[:, :, None] + torch.arange(gamma)).reshape(-1)  # [N·A·γ]
    cos_b, sin_b = rot.tables(bpos, dt)
    x = drafter.block_inputs(anchor_tokens.reshape(-1), gamma).reshape(N * A * gamma, d)
    # mask [N, 1, A·γ, L + A·γ]: context keys j < p_a, block keys of the same block.
    ctx_ok = torch.arange(L)[None, None, :] < anchors[:, :, None]  # [N, A, L]
    ctx_ok = ctx_ok[:, :, None, :].expand(N, A, gamma, L).reshape(N, A * gamma, L)
    blk = torch.arange(A).repeat_interleave(gamma)
    blk_ok = (blk[:, None] == blk[None, :]).expand(N, A * gamma, A * gamma)
    mask = torch.cat([ctx_ok, blk_ok], dim=-1)[:, None]
    for layer in drafter.layers:
        a = layer.self_attn
        kc, vc = layer.context_kv(feats, cos_c, sin_c)  # [N·L, KVH, D]
        q, k, v = a.project_qkv(layer.input_layernorm(x), cos_b, sin_b)
        K = torch.cat([kc.view(N, L, a.num_kv_heads, a.head_dim), k.view(N, A * gamma, a.num_kv_heads, a.head_dim)], 1)
        V = torch.cat([vc.view(N, L, a.num_kv_heads, a.head_dim), v.view(N, A * gamma, a.num_kv_heads, a.head_dim)], 1)
        qh = q.view(N, A * gamma, a.num_heads, a.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(qh, K.transpose(1, 2), V.transpose(1, 2), attn_mask=mask, scale=a.scale,
                                           enable_gqa=True)  # fmt: skip
        x = x + a.o_proj(o.transpose(1, 2).reshape(N * A * gamma, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x).view(N, A, gamma, d)


# -- loss --------------------------------------------------------------------------------

def position_weights(gamma: int) -> torch.Tensor:
    """w_k = exp(−(k−1)/γ), k = 1..γ (paper §3.3), fp32 ``[γ]``."""
    return torch.exp(-torch.arange(gamma, dtype=torch.float32) / gamma)


@dataclass
class LossOut:
    """Loss terms of one micro-batch (all weighted means over valid slots).

    Attributes:
        total: 0.1·ce + 0.9·l1 + 1.0·bce (differentiable).
        ce, l1, bce: the terms (floats).
        accept: unweighted mean α_k (expected per-slot acceptance at T = 1).
        accept_pos: per-position sums of α_k and counts, ``[γ]`` each (floats).
        tau_prob: Σ over blocks of 1 + Σ_k Π_{i≤k} α_i (DeepSpec's expected τ, T=1),
            and the number of blocks.
        num_slots: valid slots.
    """

    total: torch.Tensor
    ce: float
    l1: float
    bce: float
    accept: float
    accept_pos: tuple[list[float], list[float]]
    tau_prob: tuple[float, int]
    num_slots: int


def draft_log_probs(
    drafter: DSparkDrafter, hidden: torch.Tensor, prev_tokens: torch.Tensor, vocab: torch.Tensor | None = None
) -> torch.Tensor:
    """log p_d: Markov-corrected draft log-probabilities at T = 1, fp32 ``[R, V]`` (``[R, N]`` with a vocab).

    Args:
        hidden: ``[R, d]`` backbone hidden h_k.
        prev_tokens: int64 ``[R]`` x_{k−1}.
        vocab: int64 ``[N]`` draft vocabulary (FR-Spec style, as the fused drafter serves it:
            base logits and Markov bias only over these ids, p_d = 0 elsewhere), or ``None``
            (all V). Column i of the result is token ``vocab[i]``.
    """
    head = drafter.target.lm_head_weight
    U = F.linear(hidden.to(drafter.target.dtype), head if vocab is None else head[vocab]).float()
    return torch.log_softmax(apply_markov(drafter.markov, U, prev_tokens, hidden, vocab), dim=-1)


def confidence_logits(drafter: DSparkDrafter, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
    """z_k = wᵀ[h_k; W1[x_{k−1}]] + b: fp32 ``[...]``."""
    emb = drafter.markov.prev_embedding(prev_tokens) if drafter.markov is not None else None
    return drafter.confidence(hidden, emb)


def dspark_loss(
    drafter: DSparkDrafter,
    hidden: torch.Tensor,
    bt: BlockTargets,
    logp_t: torch.Tensor,
    weights: dict | None = None,
    vocab: torch.Tensor | None = None,
    teacher_in_vocab: bool = False,
) -> LossOut:
    """The DSpark training loss (module docstring) for blocks ``[N, A, γ]``.

    Args:
        hidden: ``[N, A, γ, d]`` from :func:`block_forward`.
        bt: the blocks' teacher-forced targets.
        logp_t: fp32 ``[R, V]`` target log-probs of the R valid slots (``bt.valid``
            order, :func:`training.features.target_log_probs`).
        weights: loss weights (default :data:`LOSS_WEIGHTS`).
        vocab: int64 ``[N]`` draft vocabulary, or ``None`` (all V). With a vocabulary p_d is
            0 outside it, so ``‖p_d − p_t‖₁ = Σ_{v∈D} |p_d(v) − p_t(v)| + p_t(V∖D)`` — exactly
            the served restricted drafter's distance — and CE is averaged over the slots whose
            token x_k lies in D (−log 0 elsewhere).
        teacher_in_vocab: ``logp_t`` holds only the columns of ``vocab`` (``[R, |D|]``, still
            normalised over all V: :meth:`training.features.TeacherHead.log_probs` with a
            cached logsumexp).
    """
    w = weights or LOSS_WEIGHTS
    N, A, gamma, d = hidden.shape
    valid = bt.valid
    pos = torch.arange(gamma).expand(N, A, gamma)[valid]
    wk = position_weights(gamma)[pos]
    wsum = wk.sum().clamp_min(1e-9)
    h = hidden[valid]
    prev = bt.prev_tokens[valid]
    logp_d = draft_log_probs(drafter, h, prev, vocab)
    tgt = bt.target_tokens[valid]
    if vocab is None:
        ce = -logp_d.gather(-1, tgt[:, None]).squeeze(-1)
        l1 = (logp_d.exp() - logp_t.exp()).abs().sum(-1)
        wce, wce_sum = wk, wsum
    else:
        col = torch.full((drafter.target.cfg.vocab_size,), -1, dtype=torch.long)
        col[vocab] = torch.arange(vocab.numel())
        tcol = col[tgt]
        inside = tcol >= 0
        ce = -logp_d.gather(-1, tcol.clamp_min(0)[:, None]).squeeze(-1) * inside
        pt_d = logp_t.exp() if teacher_in_vocab else logp_t[:, vocab].exp()
        l1 = (logp_d.exp() - pt_d).abs().sum(-1) + (1.0 - pt_d.sum(-1)).clamp_min(0.0)
        wce = wk * inside
        wce_sum = wce.sum().clamp_min(1e-9)
    alpha = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
    z = confidence_logits(drafter, h, prev)
    bce = F.binary_cross_entropy_with_logits(z, alpha, reduction="none")
    ce_m, l1_m, bce_m = (wce * ce).sum() / wce_sum, (wk * l1).sum() / wsum, (wk * bce).sum() / wsum
    total = w["ce"] * ce_m + w["l1"] * l1_m + w["bce"] * bce_m
    with torch.no_grad():
        a_full = torch.zeros(N, A, gamma)
        a_full[valid] = alpha
        acc_sum = a_full.sum((0, 1)).tolist()
        cnt = valid.sum((0, 1)).float().tolist()
        blocks = valid[:, :, 0]
        tau = (1.0 + a_full.cumprod(-1).sum(-1))[blocks]
    return LossOut(
        total=total, ce=float(ce_m.detach()), l1=float(l1_m.detach()), bce=float(bce_m.detach()),
        accept=float(alpha.mean()) if alpha.numel() else 0.0,
        accept_pos=(acc_sum, cnt), tau_prob=(float(tau.sum()), int(blocks.sum())), num_slots=int(valid.sum()),
    )  # fmt: skip


# -- one micro-batch ---------------------------------------------------------------------

def micro_batch_loss(
    drafter: DSparkDrafter,
    teacher,
    seqs: list[np.ndarray],
    prompt_lens: list[int],
    num_anchors: int,
    gen: torch.Generator,
    tb: TeacherBatch | None = None,
    vocab: torch.Tensor | None = None,
    head: TeacherHead | None = None,
    compute_dtype: str = "float32",
) -> tuple[LossOut, TeacherBatch]:
    """Teacher features → random anchors → block forward → loss, for a few sequences.

    Args:
        teacher: the frozen target used for features and p_t (bf16 as served).
        seqs, prompt_lens: token ids and prompt lengths.
        num_anchors: anchors per sequence.
        gen: RNG for the anchors.
        tb: precomputed teacher features (skips the target forward), e.g. from the
            feature cache (:meth:`training.feature_cache.FeatureCache.batch`).
        vocab: draft vocabulary for :func:`dspark_loss` (``None``: all V).
        head: the fp32 teacher head for p_t (default: built from ``teacher`` and ``vocab``;
            pass one to reuse its weight copies across micro-batches).
        compute_dtype: ``"bfloat16"`` runs the drafter's forward (and so its backward) under
            CPU autocast — bf16 matmuls over the fp32 master weights; p_t stays fp32.
    """
    gamma = drafter.block_size
    if tb is None:
        tb = teacher_forward(teacher, seqs, prompt_lens, drafter.tap_layers)
    head = head if head is not None else TeacherHead(teacher, vocab)
    anchors, ok = sample_anchors(tb.prompt_lens, tb.lengths, num_anchors, gen)
    bt = block_targets(tb, anchors, ok, gamma)
    lse = None if bt.lse_rows is None else bt.lse_rows[bt.valid]
    logp_t = head.log_probs(bt.hidden_rows[bt.valid], lse)
    if compute_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"compute_dtype must be float32 or bfloat16, got {compute_dtype!r}")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute_dtype == "bfloat16"):
        hidden = block_forward(drafter, tb.taps, anchors, bt.anchor_tokens, gamma)
        lo = dspark_loss(drafter, hidden, bt, logp_t, vocab=vocab, teacher_in_vocab=vocab is not None)
    return lo, tb


# -- training loop ------------------------------------------------------------------------

@dataclass
class TrainConfig:
    """Training run settings (stored in ``train_state.pt`` / ``train_config.json``, there
    with repository-relative paths and without ``out``: :meth:`record`).

    Attributes:
        data_dir: regenerated data (:mod:`training.data`).
        out: checkpoint dir (config.json + model.safetensors + train_state.pt +
            train_log.jsonl + learning_curve.png).
        drafter: architecture (:class:`DrafterConfig` fields).
        seqs_per_micro: sequences per teacher forward / micro-batch.
        anchors_per_seq: A, random anchors (blocks) per sequence.
        accum: micro-batches per optimizer step.
        max_len: sequences are cut to this many tokens (prompt + response).
        lr, min_lr_ratio, warmup_frac, weight_decay, betas, grad_clip: AdamW + schedule
            (DeepSpec: lr 6e-4, 4 % warmup).
        steps: optimizer steps of the whole schedule (the LR schedule's length).
        max_minutes: stop (and save) after this wall time even if steps remain.
        save_every, val_every: in optimizer steps.
        val_seqs: held-out sequences in the fixed validation batch.
        zero_init_markov_w2: start with W2 = 0 (the Markov bias starts at 0 instead
            of random noise on the logits).
        threads: torch threads (1: on the shared 2-core box two threads cost ~2× the
            CPU time per step, OpenMP spin-waits under contention).
        seed: data order, anchors, init.
        init: warm start from this drafter checkpoint (its architecture and weights; a fresh
            optimizer and LR schedule; its STS temperatures are dropped, recalibrate after).
            Ignored when resuming ``out``.
        draft_vocab: a checkpoint dir holding ``draft_vocab.json``: train the drafter over
            that vocabulary as the fused drafter serves it (:func:`dspark_loss`; ~6× less
            LM-head work per slot at 8,192 of 49,152 ids); copied into ``out``.
        teacher_dtype: ``"bfloat16"`` or ``"float32"``, the frozen target's dtype (teacher and
            the drafter's shared embedding / LM head; with ``feature_cache`` only the latter:
            the teacher ran when the cache was built, and p_t is always fp32). bf16 is ~2.5× faster on AMX CPUs; on
            AVX512-BF16 CPUs without AMX fp32 matmuls are faster (measured 102 vs 67 GFLOPS
            for the LM head on one core) and fp32 is also closer to the served gguf target.
        feature_cache: a teacher-feature cache dir (:mod:`training.feature_cache`,
            built by ``build-features`` for the same data, tap layers and ``max_len``): the
            target forward and the full-vocabulary p_t are read instead of computed (~4×
            faster steps). Must hold every training and validation sequence.
        compute_dtype: the drafter's matmul dtype: ``"float32"``, or ``"bfloat16"`` (CPU
            autocast over the fp32 master weights; faster where the CPU multiplies bf16 natively
            — time a step both ways on a new CPU).
    """

    data_dir: str = str(DEFAULT_OUT)
    out: str = str(REPO_ROOT / "runtime" / "speculation" / "checkpoints" / "candidate")
    drafter: dict = field(default_factory=lambda: DrafterConfig().to_dict())
    seqs_per_micro: int = 4
    anchors_per_seq: int = 24
    accum: int = 4
    max_len: int = 768
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_frac: float = 0.04
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    steps: int = 400
    max_minutes: float | None = None
    save_every: int = 50
    val_every: int = 25
    val_seqs: int = 8
    zero_init_markov_w2: bool = True
    threads: int = 1
    seed: int = 0
    init: str | None = None
    draft_vocab: str | None = None
    teacher_dtype: str = "bfloat16"
    feature_cache: str | None = None
    compute_dtype: str = "float32"

    def record(self) -> dict:
        """The settings as ``train_config.json`` holds them: paths repository-relative
        (:func:`training.data.repo_relative`), ``out`` left out (the file sits in it)."""
        d = {k: v for k, v in asdict(self).items() if k != "out"}
        return d | {k: repo_relative(d[k]) for k in ("data_dir", "init", "draft_vocab", "feature_cache") if d[k]}


def init_drafter(target, cfg: TrainConfig) -> DSparkDrafter:
    """A fresh drafter for training: the architecture's random init
    (``DrafterConfig.init_seed``), fp32 backbone (:func:`fp32_backbone`), then W2 = 0 if
    ``cfg.zero_init_markov_w2``."""
    drafter = fp32_backbone(DSparkDrafter(target, DrafterConfig.from_dict(dict(cfg.drafter))))
    if cfg.zero_init_markov_w2 and drafter.markov is not None:
        drafter.markov.w2.weight.data.zero_()
    return drafter


def fp32_backbone(drafter: DSparkDrafter) -> DSparkDrafter:
    """Keep the backbone's master weights in fp32 while the drafter stays bound to a bf16
    target (mixed precision: the frozen embeddings / LM head matmuls run in bf16, ~2.5× faster
    on AVX512-BF16 CPUs; everything trainable and every norm / attention runs in fp32)."""
    for mod in (drafter.fc, drafter.hidden_norm, drafter.layers, drafter.norm):
        mod.float()
    drafter.mask_embedding.data = drafter.mask_embedding.data.float()
    return drafter


def load_for_training(path: str | Path, target) -> DSparkDrafter:
    """Load a checkpoint to continue training, without rounding the fp32 master weights."""
    from safetensors.torch import load_file

    from runtime.speculation.checkpoint import read_config

    drafter = fp32_backbone(DSparkDrafter(target, read_config(path)))
    sd = load_file(str(Path(path) / "model.safetensors"))
    own = drafter.state_dict()
    if set(sd) != set(own):
        raise ValueError(f"{path}: weights do not match the drafter config")
    for k, v in own.items():
        v.copy_(sd[k].to(v.dtype))
    return drafter


def lr_at(cfg: TrainConfig, step: int, elapsed_s: float | None = None) -> float:
    """Linear warmup to ``lr`` then cosine to ``lr·min_lr_ratio`` over ``cfg.steps``.

    With a time budget (``cfg.max_minutes``) and ``elapsed_s`` given, the cosine runs on
    whichever is further along, steps or wall time, so a run stopped by the clock still
    ends at the low LR instead of being cut mid-schedule.
    """
    warm = max(1, int(round(cfg.warmup_frac * cfg.steps)))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = min(1.0, (step - warm) / max(1, cfg.steps - warm))
    if cfg.max_minutes and elapsed_s is not None:
        t = max(t, min(1.0, elapsed_s / (cfg.max_minutes * 60.0)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def trainable_parameters(drafter: DSparkDrafter) -> list[torch.nn.Parameter]:
    """The drafter's own parameters (the target is not a submodule, so never included)."""
    return [p for p in drafter.parameters()]


def _cut(seq: np.ndarray, plen: int, max_len: int) -> tuple[np.ndarray, int]:
    """Truncate to max_len tokens (response first to go; the prompt kept whole if it fits)."""
    return seq[:max_len], min(plen, max_len)


def plot_curve(log_path: Path, png: Path) -> None:
    """Learning curve (train loss / val loss / val expected τ vs. step) from ``train_log.jsonl``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in log_path.read_text().splitlines() if x.strip()]
    tr = [r for r in rows if r["kind"] == "train"]
    va = [r for r in rows if r["kind"] == "val"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    if tr:
        ax[0].plot([r["step"] for r in tr], [r["loss"] for r in tr], label="train loss", alpha=0.7)
    if va:
        ax[0].plot([r["step"] for r in va], [r["loss"] for r in va], "o-", label="held-out loss")
        ax[1].plot([r["step"] for r in va], [r["tau_prob"] for r in va], "o-", label="held-out E[τ] (T=1)")
        ax[1].plot([r["step"] for r in va], [r["accept"] for r in va], "s-", label="held-out mean α_k")
    ax[0].set_xlabel("optimizer step")
    ax[0].set_ylabel("0.1·CE + 0.9·L1 + BCE")
    ax[1].set_xlabel("optimizer step")
    for a in ax:
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend()
    fig.suptitle(f"DSpark drafter training ({log_path.parent.name})")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def train(cfg: TrainConfig, target=None, data=None, resume: bool = True, progress: bool = True) -> dict:
    """Train (or resume) a drafter; returns a summary dict (see docs/drafter.md).

    Args:
        cfg: run settings.
        target: the frozen target: teacher features / p_t, and the drafter's shared
            embeddings / LM head (default: bf16 from the cache, as served).
        data: a :class:`training.data.DrafterData` (default: ``cfg.data_dir``).
        resume: continue from ``cfg.out/train_state.pt`` if present.
        progress: tqdm bar.
    """
    from runtime.speculation.checkpoint import save_drafter
    from training.data import load_data

    torch.set_num_threads(cfg.threads)
    target = target if target is not None else build_target(cfg.threads, getattr(torch, cfg.teacher_dtype))
    teacher = target
    data = data if data is not None else load_data(cfg.data_dir)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    state_path, log_path = out / "train_state.pt", out / "train_log.jsonl"

    step, t_used = 0, 0.0
    rng = np.random.default_rng(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    if resume and state_path.exists():
        drafter = load_for_training(out, target)
        st = torch.load(state_path, weights_only=False)
        step, t_used = st["step"], st["seconds"]
        rng.bit_generator.state = st["np_rng"]
        gen.set_state(st["torch_rng"])
    elif cfg.init:
        drafter = load_for_training(cfg.init, target)
        drafter.cfg.sts_temperatures = None  # fitted for the old weights; recalibrate after training
        cfg.drafter = drafter.cfg.to_dict()
        log_path.write_text("")
        st = None
    else:
        drafter = init_drafter(target, cfg)
        log_path.write_text("")
        st = None
    vocab = None
    if cfg.draft_vocab:
        from runtime.speculation.fast_drafter import DRAFT_VOCAB_FILE, load_draft_vocab

        vocab = load_draft_vocab(cfg.draft_vocab, target.cfg.vocab_size)
        if vocab is None:
            raise ValueError(f"{cfg.draft_vocab}: no {DRAFT_VOCAB_FILE}")
        src = Path(cfg.draft_vocab) / DRAFT_VOCAB_FILE
        if src.resolve() != (out / DRAFT_VOCAB_FILE).resolve():
            (out / DRAFT_VOCAB_FILE).write_bytes(src.read_bytes())
    drafter.train().requires_grad_(True)
    params = trainable_parameters(drafter)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    if st is not None:
        opt.load_state_dict(st["optim"])
    (out / "train_config.json").write_text(json.dumps(cfg.record(), indent=2) + "\n")

    train_idx = data.indices("train")
    val_idx = data.indices("heldout")[: cfg.val_seqs]
    if len(train_idx) == 0:
        raise ValueError("no training sequences")
    cache = None
    if cfg.feature_cache:
        from training.feature_cache import FeatureCache

        cache = FeatureCache.open(cfg.feature_cache, data)
        cache.check(data, drafter.tap_layers, cfg.max_len)
        missing = cache.missing(np.concatenate([train_idx, val_idx]))
        if len(missing):
            raise ValueError(f"{cfg.feature_cache}: {len(missing)} training/validation sequences are not in the "
                             "feature cache yet (finish `build-features` first)")
    head = TeacherHead(teacher, vocab)

    def batch_of(rows):
        seqs, plens = [], []
        for i in rows:
            s, p = _cut(data.sequence(int(i)), int(data.prompt_lens[i]), cfg.max_len)
            seqs.append(s)
            plens.append(p)
        return seqs, plens

    def teacher_batch(rows, seqs, plens) -> TeacherBatch:
        if cache is not None:
            return cache.batch(rows, seqs)
        return teacher_forward(teacher, seqs, plens, drafter.tap_layers)

    val_tb = None

    def validate() -> dict:
        nonlocal val_tb
        if len(val_idx) == 0:
            return {}
        drafter.eval()
        vgen = torch.Generator().manual_seed(12345)
        seqs, plens = batch_of(val_idx)
        if val_tb is None:
            val_tb = teacher_batch(val_idx, seqs, plens)
        with torch.no_grad():
            lo, _ = micro_batch_loss(drafter, teacher, seqs, plens, cfg.anchors_per_seq, vgen, tb=val_tb,
                                     vocab=vocab, head=head, compute_dtype=cfg.compute_dtype)
        drafter.train()
        return {"loss": float(lo.total), "ce": lo.ce, "l1": lo.l1, "bce": lo.bce, "accept": lo.accept,
                "tau_prob": lo.tau_prob[0] / max(lo.tau_prob[1], 1)}

    def save() -> None:
        drafter.eval()
        save_drafter(drafter, out)
        torch.save({"step": step, "seconds": t_used, "optim": opt.state_dict(), "np_rng": rng.bit_generator.state,
                    "torch_rng": gen.get_state(), "config": asdict(cfg)}, state_path)
        drafter.train()
        plot_curve(log_path, out / "learning_curve.png")

    def log(row: dict) -> None:
        with log_path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=step, desc="train", unit="step", dynamic_ncols=True)
    t_start = time.monotonic() - t_used
    toks_total = blocks_total = 0
    first = last = None
    if step == 0 and st is None:
        v = validate()
        if v:
            log({"kind": "val", "step": 0, **v})
            first = v
    def one_step() -> None:
        nonlocal step, t_used, toks_total, blocks_total, last
        t0 = time.monotonic()
        lr = lr_at(cfg, step, time.monotonic() - t_start)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        agg = {"loss": 0.0, "ce": 0.0, "l1": 0.0, "bce": 0.0, "accept": 0.0}
        tau_s = tau_n = ntok = nslots = 0
        for _ in range(cfg.accum):
            rows = rng.choice(train_idx, size=min(cfg.seqs_per_micro, len(train_idx)), replace=False)
            seqs, plens = batch_of(rows)
            tb = teacher_batch(rows, seqs, plens)
            lo, tb = micro_batch_loss(drafter, teacher, seqs, plens, cfg.anchors_per_seq, gen, tb=tb, vocab=vocab,
                                      head=head, compute_dtype=cfg.compute_dtype)
            (lo.total / cfg.accum).backward()
            for k in ("ce", "l1", "bce", "accept"):
                agg[k] += getattr(lo, k) / cfg.accum
            agg["loss"] += float(lo.total.detach()) / cfg.accum
            tau_s += lo.tau_prob[0]
            tau_n += lo.tau_prob[1]
            ntok += int(tb.lengths.sum())
            nslots += lo.num_slots
        gnorm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
        opt.step()
        step += 1
        dt = time.monotonic() - t0
        toks_total += ntok
        blocks_total += tau_n
        t_used = time.monotonic() - t_start
        log({"kind": "train", "step": step, **{k: round(v, 5) for k, v in agg.items()},
             "tau_prob": round(tau_s / max(tau_n, 1), 4), "lr": lr, "grad_norm": round(gnorm, 4),
             "tokens": ntok, "slots": nslots, "seconds": round(dt, 2), "tokens_per_s": round(ntok / dt, 1),
             "elapsed_s": round(t_used, 1)})  # fmt: skip
        if bar is not None:
            bar.set_postfix(loss=f"{agg['loss']:.3f}", acc=f"{agg['accept']:.3f}", tok_s=f"{ntok / dt:.0f}")
            bar.update(1)
        if cfg.val_every and step % cfg.val_every == 0:
            v = validate()
            if v:
                log({"kind": "val", "step": step, **v})
                last = v
        if cfg.save_every and step % cfg.save_every == 0:
            save()

    try:
        while step < cfg.steps:
            if cfg.max_minutes is not None and (time.monotonic() - t_start) > cfg.max_minutes * 60:
                break
            one_step()
    except KeyboardInterrupt:  # Ctrl-C / SIGTERM (the CLI maps it): keep what was learnt
        pass
    if bar is not None:
        bar.close()
    opt.zero_grad(set_to_none=True)
    if not (cfg.val_every and step % cfg.val_every == 0 and last is not None):  # not validated at this step yet
        v = validate()
        if v:
            log({"kind": "val", "step": step, **v})
            last = v
    t_used = time.monotonic() - t_start
    save()
    drafter.eval().requires_grad_(False)
    return {"steps": step, "seconds": round(t_used, 1), "tokens": toks_total, "blocks": blocks_total,
            "tokens_per_s": round(toks_total / max(t_used, 1e-9), 1), "val_first": first, "val_last": last,
            "out": str(out), "drafter": drafter}
