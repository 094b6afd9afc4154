"""Acceptance-length (τ) evaluation of drafters, DeepSpec protocol (paper §4, Table 1).

Prompts. ``data/eval/<task>.jsonl.gz`` (shipped; provenance, licences and the
alpaca fetch command in ``data/README.md``) or a plain ``<task>.jsonl`` in another
``eval_dir``, first turn only; a file with
more rows than its cap (:data:`TASK_CAPS`) is shuffled with
``random.Random(980406).shuffle`` and cut to the cap; ``max_samples`` keeps the
first N per task after that. Chat template applied as the gateway does;
``max_new_tokens`` = 256.

T = 0, exact, no live speculative decoding. The target's greedy output y is
generated once (embedded engine, no speculation). At T = 0 the live rounds are a
deterministic function of y: a round with anchor at position p drafts
d_1..d_ℓ (the drafter's greedy Markov chain from x_0 = y_p, on context features
of y_{<p}), accepts the longest prefix with d_k = y_{p+k}, and emits a+1 tokens
(accepted + the target's token), so the next anchor is at p + a + 1. Because a
draft position is only compared when every earlier draft equalled y, the
Markov head's previous token at compared positions is y itself, and the blocks can
be computed teacher-forced from ONE target forward over prompt + y
(:mod:`training.features`) with :func:`training.train.block_forward`
(tested equal to the serving forward). The walk copies the engine's bookkeeping:
ℓ = min(γ, max_tokens − emitted − 1) (``Speculator._room``), tokens after EOS or
beyond max_tokens are not counted, τ = emitted / rounds (bonus included), pooled
over all rounds of a task. ``tests/training/test_evaluate.py`` checks it equals the
engine's live τ (spec_method dspark / prompt_lookup, fixed policy, T = 0).

T = 1, expected. Along a T = 1 sample of the target (seeded), for EVERY anchor
position p of the response: α_k = 1 − ½‖p_d,k − p_t,k‖₁ (the exact acceptance
probability of position k given the prefix was accepted, with p_d teacher-forced
on y's previous token, as in training), E[τ | p] = 1 + Σ_{k≤γ} Π_{i≤k} α_i, averaged
over anchors (DeepSpec's ``tau_probabilistic``). For prompt lookup p_d is one-hot
on its proposal, so α_k = p_t,k(d_k) (and 0 past the proposal's end); its
teacher forcing is approximate when an earlier proposal token differs from y.

Position-wise conditional acceptance: T = 0 — #rounds with a ≥ k over #rounds
with a ≥ k−1 and ℓ ≥ k; T = 1 — mean α_k over anchors.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from runtime.speculation.markov_head import apply_markov
from runtime.speculation.prompt_lookup import propose_ngram
from training.data import DATA_DIR, read_jsonl
from training.features import all_anchors, target_log_probs, teacher_forward

EVAL_DIR = DATA_DIR / "eval"
TASK_CAPS = {"gsm8k": 500, "math500": 500, "humaneval": 164, "mbpp": 256, "mt-bench": 80, "alpaca": 500}
SHUFFLE_SEED = 980406
EOS = 2


# -- prompts --------------------------------------------------------------------------------

@dataclass
class EvalPrompt:
    task: str
    index: int  # row index after DeepSpec's shuffle/cut
    text: str


def task_file(task: str, eval_dir: str | Path = EVAL_DIR) -> Path | None:
    """``<task>.jsonl.gz`` or else ``<task>.jsonl`` in ``eval_dir``; ``None`` if neither exists."""
    return next((p for p in (Path(eval_dir, f"{task}.jsonl.gz"), Path(eval_dir, f"{task}.jsonl")) if p.exists()), None)


def first_turns(task: str, eval_dir: str | Path = EVAL_DIR) -> list[str]:
    """First user turns of a task's file, in file order (no cap, no shuffle).

    Raises:
        FileNotFoundError: no file for ``task`` (alpaca is not shipped: data/README.md).
    """
    path = task_file(task, eval_dir)
    if path is None:
        raise FileNotFoundError(f"no {task}.jsonl.gz or {task}.jsonl in {eval_dir} (see data/README.md)")
    return [row["turns"][0] for row in read_jsonl(path)]


def load_eval_prompts(
    eval_dir: str | Path = EVAL_DIR, tasks: Sequence[str] | None = None, max_samples: int | None = None
) -> list[EvalPrompt]:
    """First turns of each task (default: those with a file in ``eval_dir``) after DeepSpec's
    cap/shuffle, then the first ``max_samples``."""
    out: list[EvalPrompt] = []
    for task in tasks or [t for t in TASK_CAPS if task_file(t, eval_dir)]:
        rows = first_turns(task, eval_dir)
        if len(rows) > TASK_CAPS[task]:
            random.Random(SHUFFLE_SEED).shuffle(rows)
            rows = rows[: TASK_CAPS[task]]
        if max_samples is not None:
            rows = rows[:max_samples]
        out += [EvalPrompt(task, i, t) for i, t in enumerate(rows)]
    return out


# -- engine runs ---------------------------------------------------------------------------

@dataclass
class Generation:
    tokens: list[int]  # completion ids (EOS included when it ended the request)
    finish: str
    spec: dict | None = None  # SpecStats.to_dict() when speculating


def run_engine(
    model, tokenizer, prompts: Sequence[list[int]], *, temperature: float = 0.0, max_new_tokens: int = 256,
    seed: int = 0, max_batch_size: int = 16, progress: Callable[[int], None] | None = None, **engine_kw,
) -> list[Generation]:
    """Run the embedded engine synchronously over ``prompts`` (continuous batching).

    ``engine_kw`` go to :class:`EngineConfig` (e.g. ``spec_method``, ``spec_policy``,
    ``draft_checkpoint``, ``num_speculative_tokens``). dtype follows ``model``. The
    speculation gate is off unless ``spec_gate=True`` is passed: this measures the drafter
    (τ per round), so every round must draft, whatever the timing says.
    """
    from runtime.config import EngineConfig
    from runtime.engine.llm_engine import LLMEngine
    from runtime.interface import Finished, GenerationRequest, SamplingParams, TextDelta
    from runtime.models.llama import torch_threads

    res: dict[str, Generation] = {}
    spec_objs: dict[str, object] = {}

    def emit(rid, ev):
        g = res.setdefault(rid, Generation([], ""))
        if isinstance(ev, TextDelta):
            g.tokens.extend(ev.token_ids)
        elif isinstance(ev, Finished):
            g.finish = ev.finish_reason.value
            # The engine counts a request's final round AFTER emitting Finished (same
            # SpecStats object), so read the stats once the run is over.
            spec_objs[rid] = ev.spec
            if progress:
                progress(1)
        else:
            g.finish = "failed"
            if progress:
                progress(1)

    dtype = model.serving_dtype
    max_ctx = max(len(p) for p in prompts) + max_new_tokens + 16
    threads = torch.get_num_threads()
    cfg = EngineConfig(**{"dtype": dtype, "max_batch_size": max_batch_size, "max_context": max_ctx,
                          "max_waiting": 10**6, "request_timeout_s": 1e9, "num_threads": threads, "spec_gate": False,
                          **engine_kw})
    with torch_threads(threads):  # the gguf engine sets torch to 1 thread (use_kernel_threads): restored after
        engine = LLMEngine(cfg, emit, model=model, tokenizer=tokenizer)
        for i, ids in enumerate(prompts):
            sp = SamplingParams(temperature=temperature, max_tokens=max_new_tokens, seed=seed + i)
            engine.add_request(GenerationRequest(str(i), list(ids), sp))
        while engine.has_work():
            engine.step()
    for rid, sp in spec_objs.items():
        res[rid].spec = sp.to_dict() if sp is not None else None
    return [res[str(i)] for i in range(len(prompts))]


# -- draft methods ------------------------------------------------------------------------------

@dataclass
class BlockStats:
    """Per-anchor outputs for one sequence (anchors p = n … e−1, A of them).

    Attributes:
        match: bool ``[A, γ]`` greedy draft d_k == y_{p+k} (False past the end).
        proposed: int ``[A]`` draft tokens available (γ; prompt lookup: its proposal length).
        conf_logits: fp32 ``[A, γ]`` confidence logits with the drafter's own
            previous tokens (serving), or ``None``.
    """

    match: np.ndarray
    proposed: np.ndarray
    conf_logits: np.ndarray | None = None


class DrafterMethod:
    """A DSpark drafter (any Markov rank) evaluated through the batched block forward.

    ``vocab`` (int64 ``[N]`` token ids): draft only from this draft vocabulary, as the
    served fused drafter does (:mod:`runtime.speculation.fast_drafter`): base logits outside it
    are −∞, so the greedy argmax and the T = 1 p_d are the drafter's restricted to it."""

    def __init__(self, name: str, drafter, chunk: int = 32, vocab: torch.Tensor | None = None) -> None:
        self.name, self.drafter, self.chunk = name, drafter, chunk
        self.gamma = drafter.block_size
        self.outside = None
        if vocab is not None:
            self.outside = torch.ones(drafter.target.cfg.vocab_size, dtype=torch.bool)
            self.outside[vocab] = False

    @property
    def tap_layers(self) -> list[int]:
        return self.drafter.tap_layers

    def _hidden(self, taps: torch.Tensor, anchors: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        from training.train import block_forward

        out = []
        for c in range(0, anchors.numel(), self.chunk):
            a = anchors[c : c + self.chunk]
            with torch.no_grad():
                out.append(block_forward(self.drafter, taps[None], a[None], tokens[a][None], self.gamma)[0])
        return torch.cat(out) if out else torch.zeros(0, self.gamma, self.drafter.target.cfg.hidden_size)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        t = self.drafter.target
        U = t.lm_head(h.reshape(-1, h.shape[-1]).to(t.dtype)).view(*h.shape[:-1], -1)
        return U if self.outside is None else U.masked_fill(self.outside, float("-inf"))

    def greedy_blocks(self, tokens: torch.Tensor, taps: torch.Tensor, n: int, want_conf: bool = False,
                      anchors: torch.Tensor | None = None) -> BlockStats:
        """T = 0 drafts at every anchor (or the given ones): the serving Markov chain from x_0 = y_p."""
        L = tokens.numel()
        anchors = all_anchors(n, L) if anchors is None else anchors
        A, g = anchors.numel(), self.gamma
        match = np.zeros((A, g), dtype=bool)
        conf = np.zeros((A, g), dtype=np.float32) if want_conf else None
        h_all = self._hidden(taps, anchors, tokens)
        for c in range(0, A, self.chunk):
            a = anchors[c : c + self.chunk]
            m, z = self._greedy(tokens, a, h_all[c : c + self.chunk], L, want_conf)
            match[c : c + len(a)] = m
            if want_conf:
                conf[c : c + len(a)] = z
        return BlockStats(match, np.full(A, g), conf)

    def round_rows(self, tokens: torch.Tensor, taps: torch.Tensor, n: int) -> Callable[[int], tuple[np.ndarray, int]]:
        """Lazy T = 0 rows for :func:`walk_rounds`: the backbone runs batched over every anchor
        (cheap), the LM head + Markov chain only at the anchors the rounds visit."""
        L = tokens.numel()
        anchors = all_anchors(n, L)
        h_all = self._hidden(taps, anchors, tokens)
        g = self.gamma

        def row(i: int) -> tuple[np.ndarray, int]:
            match, _ = self._greedy(tokens, anchors[i : i + 1], h_all[i : i + 1], L, want_conf=False)
            return match[0], g

        return row

    def _greedy(self, tokens, a, h, L, want_conf):
        dr, g = self.drafter, self.gamma
        with torch.no_grad():
            U = self._logits(h)
            prev = tokens[a]
            drafts, prevs = [], []
            for k in range(g):
                prevs.append(prev)
                prev = apply_markov(dr.markov, U[:, k], prev, h[:, k]).argmax(-1)
                drafts.append(prev)
            d = torch.stack(drafts, 1)
            pos = a[:, None] + torch.arange(1, g + 1)
            truth = tokens[pos.clamp(max=L - 1)]
            match = ((d == truth) & (pos <= L - 1)).numpy()
            conf = None
            if want_conf:
                p = torch.stack(prevs, 1)
                emb = dr.markov.prev_embedding(p) if dr.markov is not None else None
                conf = dr.confidence(h, emb).numpy()
        return match, conf

    def expected_acceptance(self, tokens: torch.Tensor, taps: torch.Tensor, hidden_t: torch.Tensor, n: int,
                            target, conf_out: np.ndarray | None = None) -> np.ndarray:
        """T = 1: α ``[A, γ]`` = 1 − ½‖p_d − p_t‖₁ at every anchor (teacher forced; 0 past the end).

        ``conf_out`` (fp32 ``[A, γ]``), when given, receives the confidence logits z_k of the
        same teacher-forced blocks (previous tokens = the sequence's own, as in training)."""
        L = tokens.numel()
        anchors = all_anchors(n, L)
        A, g = anchors.numel(), self.gamma
        alpha = np.zeros((A, g), dtype=np.float32)
        dr = self.drafter
        h_all = self._hidden(taps, anchors, tokens)
        for c in range(0, A, self.chunk):
            a = anchors[c : c + self.chunk]
            h = h_all[c : c + self.chunk]
            pos = a[:, None] + torch.arange(1, g + 1)
            ok = pos <= L - 1
            pc = pos.clamp(max=L - 1)
            with torch.no_grad():
                U = self._logits(h)
                prev = tokens[pc - 1]  # teacher forced x_{k−1}
                pd = torch.softmax(apply_markov(dr.markov, U, prev, h), -1)
                pt = target_log_probs(target, hidden_t[pc - 1]).exp()
                al = (1 - 0.5 * (pd - pt).abs().sum(-1)).clamp(0, 1) * ok
                if conf_out is not None:
                    emb = dr.markov.prev_embedding(prev) if dr.markov is not None else None
                    conf_out[c : c + len(a)] = dr.confidence(h, emb).numpy()
            alpha[c : c + len(a)] = al.numpy()
        return alpha


class PromptLookupMethod:
    """The n-gram baseline (:mod:`runtime.speculation.prompt_lookup`), γ tokens per round."""

    tap_layers: list[int] = []

    def __init__(self, gamma: int = 7, name: str = "prompt-lookup") -> None:
        self.name, self.gamma = name, gamma

    def greedy_blocks(self, tokens: torch.Tensor, taps, n: int, want_conf: bool = False, anchors=None) -> BlockStats:
        toks = tokens.tolist()
        L = len(toks)
        anchors = all_anchors(n, L) if anchors is None else anchors
        A, g = anchors.numel(), self.gamma
        match = np.zeros((A, g), dtype=bool)
        proposed = np.zeros(A, dtype=np.int64)
        for i, p in enumerate(anchors.tolist()):
            prop = propose_ngram(toks[: p + 1], g)
            proposed[i] = len(prop)
            for k, t in enumerate(prop):
                if p + 1 + k > L - 1 or toks[p + 1 + k] != t:
                    break
                match[i, k] = True
        return BlockStats(match, proposed)

    def round_rows(self, tokens: torch.Tensor, taps, n: int) -> Callable[[int], tuple[np.ndarray, int]]:
        """Lazy T = 0 rows for :func:`walk_rounds` (the proposal at the visited anchors only)."""
        toks = tokens.tolist()
        L = len(toks)

        def row(i: int) -> tuple[np.ndarray, int]:
            p = n + i
            prop = propose_ngram(toks[: p + 1], self.gamma)
            m = np.zeros(self.gamma, dtype=bool)
            for k, t in enumerate(prop):
                if p + 1 + k > L - 1 or toks[p + 1 + k] != t:
                    break
                m[k] = True
            return m, len(prop)

        return row

    def expected_acceptance(self, tokens: torch.Tensor, taps, hidden_t: torch.Tensor, n: int, target) -> np.ndarray:
        toks = tokens.tolist()
        L = len(toks)
        anchors = all_anchors(n, L)
        alpha = np.zeros((anchors.numel(), self.gamma), dtype=np.float32)
        rows, cols, pos, tok = [], [], [], []
        for i, p in enumerate(anchors.tolist()):
            for k, t in enumerate(propose_ngram(toks[: p + 1], self.gamma)):
                if p + 1 + k > L - 1:
                    break
                rows.append(i), cols.append(k), pos.append(p + k), tok.append(t)
        if rows:
            lp = target_log_probs(target, hidden_t[torch.tensor(pos)])
            alpha[rows, cols] = lp.gather(-1, torch.tensor(tok)[:, None])[:, 0].exp().numpy()
        return alpha


# -- round walk -----------------------------------------------------------------------------

@dataclass
class RoundStats:
    rounds: int = 0
    emitted: int = 0
    accepted: int = 0
    gamma: int = 7
    acc_at_least: list[int] = field(default_factory=list)  # rounds with a ≥ k (k = 1..γ)
    offered: list[int] = field(default_factory=list)  # rounds with a ≥ k−1 and ℓ ≥ k

    def __post_init__(self):
        self.acc_at_least = self.acc_at_least or [0] * self.gamma
        self.offered = self.offered or [0] * self.gamma

    @property
    def tau(self) -> float:
        return self.emitted / self.rounds if self.rounds else 0.0

    def add(self, o: "RoundStats") -> None:
        self.rounds += o.rounds
        self.emitted += o.emitted
        self.accepted += o.accepted
        for k in range(self.gamma):
            self.acc_at_least[k] += o.acc_at_least[k]
            self.offered[k] += o.offered[k]

    def position_acceptance(self) -> list[float]:
        return [a / o if o else float("nan") for a, o in zip(self.acc_at_least, self.offered)]


def walk_rounds(
    bs: BlockStats | Callable[[int], tuple[np.ndarray, int]], n: int, num_completion: int, max_tokens: int, gamma: int
) -> RoundStats:
    """T = 0 engine rounds over a greedy completion (module docstring).

    Args:
        bs: per-anchor greedy matches for anchors n … e−1 (row i ↔ position n+i), or a
            function ``i ↦ (match row [γ], proposed)`` evaluated only at the anchors the
            rounds visit.
        n: prompt length (first anchor position).
        num_completion: M, completion tokens of the AR output (e = n + M − 1).
        max_tokens: the request's cap.
    """
    row = bs if callable(bs) else (lambda i: (bs.match[i], int(bs.proposed[i])))
    st = RoundStats(gamma=gamma)
    e = n + num_completion - 1
    p = n
    while p < e:
        i = p - n
        match, proposed = row(i)
        ell = min(int(proposed), gamma, max(0, max_tokens - (p - n + 1) - 1))
        a = 0
        while a < ell and match[a]:
            a += 1
        emitted = min(a + 1, e - p)
        st.rounds += 1
        st.emitted += emitted
        st.accepted += min(a, emitted)
        for k in range(1, ell + 1):
            if a >= k - 1:
                st.offered[k - 1] += 1
            if a >= k:
                st.acc_at_least[k - 1] += 1
        p += emitted
    return st


def slot_valid(n: int, L: int, gamma: int) -> np.ndarray:
    """bool ``[A, γ]``: slot k of the block at anchor p = n+i has a token to compare (p+k ≤ L−1)."""
    p = all_anchors(n, L).numpy()[:, None]
    return p + np.arange(1, gamma + 1)[None] <= L - 1


def expected_tau(alpha: np.ndarray) -> tuple[float, int]:
    """Σ over anchors of 1 + Σ_k Π_{i≤k} α_i, and the number of anchors."""
    if alpha.size == 0:
        return 0.0, 0
    return float((1 + np.cumprod(alpha, axis=1).sum(1)).sum()), alpha.shape[0]


# -- full evaluation ---------------------------------------------------------------------------

@dataclass
class TaskResult:
    task: str
    method: str
    samples: int = 0
    t0: RoundStats = field(default_factory=RoundStats)
    t1_sum: float = 0.0
    t1_n: int = 0
    t1_pos_sum: np.ndarray | None = None
    t1_pos_n: np.ndarray | None = None

    def row(self) -> dict:
        return {
            "task": self.task, "method": self.method, "samples": self.samples,
            "tau_t0": round(self.t0.tau, 4) if self.t0.rounds else None, "rounds_t0": self.t0.rounds,
            "tau_t1": round(self.t1_sum / self.t1_n, 4) if self.t1_n else None,
            "pos_acc_t0": [round(x, 4) for x in self.t0.position_acceptance()] if self.t0.rounds else None,
            "pos_acc_t1": ([round(float(x), 4) for x in self.t1_pos_sum / np.maximum(self.t1_pos_n, 1)]
                           if self.t1_pos_sum is not None else None),
        }  # fmt: skip


def _taps_for(tb_taps: torch.Tensor, union: list[int], layers: list[int]) -> torch.Tensor:
    idx = [union.index(x) for x in layers]
    return tb_taps[:, idx]


def evaluate(
    target,
    tokenizer,
    methods: Sequence,
    prompts: Sequence[EvalPrompt],
    *,
    max_new_tokens: int = 256,
    temperatures: Sequence[float] = (0.0, 1.0),
    seed: int = 0,
    max_batch_size: int = 16,
    progress: bool = True,
) -> dict:
    """τ of every method on every task (module docstring). Returns a JSON-able dict."""
    from training.data import chat_ids

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(prompts) * (len(temperatures) * 2), desc="eval", unit="item", dynamic_ncols=True)
    upd = (lambda k: bar.update(k)) if bar is not None else None
    ids = [chat_ids(tokenizer, p.text) for p in prompts]
    union = sorted({x for m in methods for x in m.tap_layers})
    results: dict[tuple[str, str], TaskResult] = {}
    t_start = time.monotonic()
    gen_seconds = 0.0
    for T in temperatures:
        t0 = time.monotonic()
        gens = run_engine(target, tokenizer, ids, temperature=T, max_new_tokens=max_new_tokens, seed=seed,
                          max_batch_size=max_batch_size, progress=upd)
        gen_seconds += time.monotonic() - t0
        for pr, pid, g in zip(prompts, ids, gens):
            n, M = len(pid), len(g.tokens)
            seq = torch.tensor(pid + g.tokens)
            tb = teacher_forward(target, [seq], [n], union or [0])
            for m in methods:
                r = results.setdefault((pr.task, m.name), TaskResult(pr.task, m.name, t0=RoundStats(gamma=m.gamma)))
                taps = _taps_for(tb.taps[0], union, m.tap_layers) if m.tap_layers else None
                if T == temperatures[0]:
                    r.samples += 1  # prompts, counted once whichever temperatures run
                if T == 0.0:
                    if M >= 2:
                        r.t0.add(walk_rounds(m.round_rows(seq, taps, n), n, M, max_new_tokens, m.gamma))
                else:
                    if M >= 2:
                        al = m.expected_acceptance(seq, taps, tb.hidden[0], n, target)
                        s, k = expected_tau(al)
                        r.t1_sum += s
                        r.t1_n += k
                        r.t1_pos_sum = (r.t1_pos_sum if r.t1_pos_sum is not None else 0) + al.sum(0)
                        r.t1_pos_n = (r.t1_pos_n if r.t1_pos_n is not None else 0) + slot_valid(n, seq.numel(),
                                                                                               m.gamma).sum(0)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    rows = [r.row() for r in results.values()]
    # macro over tasks (pooled rounds per task, then mean of task τ)
    def macro(mine: list[dict], key: str) -> float | None:
        vals = [r[key] for r in mine if r[key] is not None]
        return round(float(np.mean(vals)), 4) if vals else None  # None: that temperature was not run

    summary = {}
    for m in methods:
        mine = [r for r in rows if r["method"] == m.name]
        summary[m.name] = {"tau_t0_macro": macro(mine, "tau_t0"), "tau_t1_macro": macro(mine, "tau_t1")}
    return {"rows": rows, "summary": summary, "max_new_tokens": max_new_tokens, "temperatures": list(temperatures),
            "prompts": len(prompts), "seconds": round(time.monotonic() - t_start, 1),
            "generation_seconds": round(gen_seconds, 1)}


def live_tau(
    target, tokenizer, prompts: Sequence[EvalPrompt], spec_method: str, draft_checkpoint: str | None = None, *,
    temperature: float = 1.0, gamma: int = 7, max_new_tokens: int = 256, seed: int = 0, max_batch_size: int = 16,
) -> dict[str, float]:
    """τ measured by live speculative decoding, per task: Σ emitted / Σ rounds over the task's
    requests (the engine's ``SpecStats``; fixed policy, so every round verifies γ drafts —
    what the T = 1 expectation above assumes). The cross-check of :func:`evaluate`'s
    expected T = 1 τ (a different sample of the target, so they agree up to noise)."""
    from training.data import chat_ids

    ids = [chat_ids(tokenizer, p.text) for p in prompts]
    gens = run_engine(target, tokenizer, ids, temperature=temperature, max_new_tokens=max_new_tokens, seed=seed,
                      max_batch_size=max_batch_size, spec_method=spec_method, spec_policy="fixed",
                      draft_checkpoint=draft_checkpoint, num_speculative_tokens=gamma)
    sums: dict[str, list[int]] = {}
    for p, g in zip(prompts, gens):
        acc = sums.setdefault(p.task, [0, 0])
        if g.spec:
            acc[0] += g.spec["emitted"]
            acc[1] += g.spec["rounds"]
    return {task: round(e / r, 4) for task, (e, r) in sums.items() if r}


# -- report -------------------------------------------------------------------------------------

def write_report(res: dict, out_md: Path, png_prefix: Path, title: str = "Drafter τ (DeepSpec protocol)") -> None:
    """Markdown table + two PNGs (τ per task/method; position-wise conditional acceptance)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {(r["task"], r["method"]): r for r in rows}
    fmt = lambda x: "–" if x is None else f"{x:.2f}"  # noqa: E731
    lines = [f"# {title}", "",
             f"{res['prompts']} prompts, max_new_tokens {res['max_new_tokens']}, temperatures {res['temperatures']}; "
             f"τ = tokens per round incl. the bonus token. T=0: exact simulation of the engine's rounds on the greedy "
             f"output; T=1: expected τ over all anchors of a T=1 sample (training/evaluate.py).", "",
             "| method | " + " | ".join(f"{t} T=0 | {t} T=1" for t in tasks) + " | macro T=0 | macro T=1 |",
             "|---|" + "---|---|" * len(tasks) + "---|---|"]  # fmt: skip
    for m in methods:
        cells = []
        for t in tasks:
            r = by.get((t, m), {})
            cells += [fmt(r.get("tau_t0")), fmt(r.get("tau_t1"))]
        s = res["summary"].get(m, {})
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {fmt(s.get('tau_t0_macro'))} | {fmt(s.get('tau_t1_macro'))} |")
    live = res.get("live_t1")
    if live:
        lines += ["", f"T=1 cross-check: τ measured by live speculative decoding (fixed policy, γ drafts per round) "
                      f"on the first {live['prompts_per_task']} prompts per task, next to the expected T=1 τ above:", "",
                  "| method | " + " | ".join(f"{t} expected | {t} live" for t in tasks) + " |",
                  "|---|" + "---|---|" * len(tasks)]
        for m in methods:
            if m in live["tau"]:
                cells = []
                for t in tasks:
                    cells += [fmt(by.get((t, m), {}).get("tau_t1")), fmt(live["tau"][m].get(t))]
                lines.append(f"| {m} | " + " | ".join(cells) + " |")
    pos = {}
    for m in methods:
        for key, T in (("pos_acc_t0", "0"), ("pos_acc_t1", "1")):
            vals = [by[(t, m)][key] for t in tasks if (t, m) in by and by[(t, m)][key] is not None]
            if vals:
                arr = np.array(vals, dtype=float)
                cnt = (~np.isnan(arr)).sum(0)
                pos[(m, T)] = np.where(cnt > 0, np.nansum(arr, 0) / np.maximum(cnt, 1), np.nan)
    kmax = max((len(v) for v in pos.values()), default=0)  # methods may differ in γ: pad with "–"
    lines += ["", "Position-wise conditional acceptance (all tasks pooled by mean over tasks), k = 1..γ:", "",
              "| method | T | " + " | ".join(f"k={k}" for k in range(1, kmax + 1)) + " |", "|---|---|" + "---|" * kmax]
    for (m, T), v in pos.items():
        cells = ["–" if np.isnan(x) else f"{x:.2f}" for x in v] + ["–"] * (kmax - len(v))
        lines.append(f"| {m} | {T} | " + " | ".join(cells) + " |")
    lines += ["", f"![τ]({png_prefix.name}-tau.png)", f"![position]({png_prefix.name}-position.png)", ""]
    out_md.write_text("\n".join(lines))

    fig, ax = plt.subplots(1, 2, figsize=(12, 4))
    w = 0.8 / max(len(methods), 1)
    x = np.arange(len(tasks))
    for j, m in enumerate(methods):
        for a, key in zip(ax, ("tau_t0", "tau_t1")):
            vals = [by.get((t, m), {}).get(key) or 0 for t in tasks]
            a.bar(x + j * w, vals, w, label=m)
    for a, T in zip(ax, ("T=0 (exact)", "T=1 (expected)")):
        a.set_xticks(x + 0.4 - w / 2, tasks, rotation=20)
        a.set_ylabel("τ (tokens / round)")
        a.set_title(T)
        a.axhline(1.0, color="k", lw=0.5)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(f"{png_prefix}-tau.png", dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for (m, T), v in pos.items():
        ax.plot(range(1, len(v) + 1), v, "o-" if T == "0" else "s--", label=f"{m} T={T}")
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(accept k | 1..k−1 accepted)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(f"{png_prefix}-position.png", dpi=100)
    plt.close(fig)


# -- STS calibration (paper §3.2.1) ---------------------------------------------------------------

def calibrate_sts(
    checkpoint: str | Path,
    data_dir: str | Path,
    *,
    max_samples: int = 100,
    max_new_tokens: int = 256,
    dtype: torch.dtype | str = torch.bfloat16,
    target=None,
    tokenizer=None,
    write: bool = True,
    progress: bool = True,
    completions: Sequence[Sequence[int]] | None = None,
    labels: str = "t0",
) -> dict:
    """Fit Sequential Temperature Scaling on the held-out split and store it in the checkpoint.

    ``labels="t0"``: the target's greedy completions of up to ``max_samples`` held-out
    prompts are generated (engine, no speculation); at EVERY anchor of each completion
    the drafter's T = 0 block (served dtype, its own Markov chain) gives the confidence
    logits z_k (with the drafter's own previous tokens, as served) and the accepted
    prefix length a (leading d_k = y_{p+k}); ℓ = the positions that exist before the
    completion ends. :func:`runtime.speculation.sts.survival_labels` (a, γ, ℓ) gives 0/1
    survival labels.

    ``labels="t1"``: the completions are T = 1 samples (seed 0); at every anchor the
    label of position k is the expected survival Π_{i≤k} α_i with α_i = 1 − ½‖p_d,i −
    p_t,i‖₁ (the exact T = 1 acceptance probability, teacher forced as in training and
    in the T = 1 τ of :func:`evaluate`), and z_k comes from the same blocks. Soft labels
    have the same per-bin expectation as sampled 0/1 outcomes, with less noise.

    :func:`runtime.speculation.sts.fit_sts` then gives T_1..T_γ, written into
    ``config.json``'s ``drafter.sts_temperatures`` (weights untouched) with a
    ``calibration.json`` report next to it.

    ``completions`` (completions of those prompts at the labels' temperature, in
    held-out order) skips the generation.

    Raises:
        ValueError: ``labels`` not "t0" or "t1".

    Returns:
        the report dict (temperatures, ECE before/after per position, counts).
    """
    from runtime.speculation.checkpoint import load_drafter
    from runtime.speculation.sts import fit_sts, survival_labels
    from training.data import load_data

    if labels not in ("t0", "t1"):
        raise ValueError(f"labels must be 't0' or 't1', got {labels!r}")
    if target is None or tokenizer is None:
        from runtime.engine.llm_engine import load_tokenizer
        from runtime.models.llama import load_llama
        from runtime.models.loader import ensure_converted

        mdir = ensure_converted()
        target = target or load_llama(mdir, dtype)
        tokenizer = tokenizer or load_tokenizer(mdir)
    ckpt = Path(checkpoint)
    drafter = load_drafter(ckpt, target)
    method = DrafterMethod("dspark", drafter)
    g = drafter.block_size
    data = load_data(data_dir)
    rows = data.indices("heldout")[:max_samples]
    prompts = [data.sequence(int(i))[: int(data.prompt_lens[i])].tolist() for i in rows]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=2 * len(prompts), desc="calibrate", unit="item", dynamic_ncols=True)
    if completions is None:
        gens = run_engine(target, tokenizer, prompts, temperature=0.0 if labels == "t0" else 1.0,
                          max_new_tokens=max_new_tokens, progress=(lambda k: bar.update(k)) if bar is not None else None)
        completions = [g.tokens for g in gens]
    logits, survived, mask = [], [], []
    for pid, comp in zip(prompts, completions):
        n, M = len(pid), len(comp)
        if M >= 2:
            seq = torch.tensor(pid + list(comp))
            tb = teacher_forward(target, [seq], [n], drafter.tap_layers)
            valid = slot_valid(n, seq.numel(), g)
            if labels == "t0":
                bs = method.greedy_blocks(seq, tb.taps[0], n, want_conf=True)
                ell = valid.sum(1)
                a = np.array([int(np.argmin(np.append(m[:l], False))) for m, l in zip(bs.match, ell)])
                s_k, m_k = survival_labels(a, g, ell)
                logits.append(bs.conf_logits)
            else:
                z_k = np.zeros(valid.shape, dtype=np.float32)
                al = method.expected_acceptance(seq, tb.taps[0], tb.hidden[0], n, target, conf_out=z_k)
                s_k, m_k = np.cumprod(al.astype(np.float64), axis=1), valid
                logits.append(z_k)
            survived.append(s_k)
            mask.append(m_k)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    z = np.concatenate(logits)
    s_all = np.concatenate(survived)
    res = fit_sts(z, s_all, np.concatenate(mask))
    report = {
        "checkpoint": str(ckpt), "heldout_prompts": len(prompts), "anchors": int(z.shape[0]),
        "temperatures": [round(t, 5) for t in res.temperatures],
        "ece_before": [round(x, 5) for x in res.ece_before], "ece_after": [round(x, 5) for x in res.ece_after],
        "n_valid": list(res.n_valid), "mean_accepted_per_anchor": round(float(s_all.sum(1).mean()), 4),
        "labels": "T=0 greedy, all anchors" if labels == "t0" else "T=1 expected survival (soft), all anchors",
        "max_new_tokens": max_new_tokens, "dtype": target.serving_dtype,
    }  # fmt: skip
    if write:
        cfg_path = ckpt / "config.json"
        meta = json.loads(cfg_path.read_text())
        meta["drafter"]["sts_temperatures"] = [float(t) for t in res.temperatures]
        cfg_path.write_text(json.dumps(meta, indent=2) + "\n")
        on_disk = {k: v for k, v in report.items() if k != "checkpoint"}  # the file sits in it: no path recorded
        (ckpt / "calibration.json").write_text(json.dumps(on_disk, indent=2) + "\n")
    return report
