"""Disk cache of the frozen target's teacher features for drafter training (paper §3.3).

Online training (:func:`training.features.teacher_forward` every micro-batch) spends
~75 % of a step in the frozen target: the 30-layer forward over the whole sequences and the
full-vocabulary LM head for p_t (measured on a 2-core AMD EPYC, 4 sequences, one thread:
target 3.5 s, p_t 2.7 s, drafter forward + loss + backward 2.0 s). The features do not depend
on the drafter or on the random anchors, so they are computed ONCE per sequence and stored:

* ``taps`` — the tapped residual streams ``[L, m, d]`` of every position (the drafter's
  context features), **bf16** (what the served drafter gets from the bf16-activation target);
* ``hidden`` — the final-normed target hidden state ``[d]``, **fp32**, of every position
  that can be a block slot's p_t row: positions ``[prompt_len, L−1)`` (the anchors lie in
  ``[prompt_len, L−2]``, slot k of anchor p reads row ``p+k−1``);
* ``lse`` — ``logsumexp`` of the target's fp32 logits at those rows (fp32), so that
  ``log p_t(v) = h·W[v] − lse`` is exact for any subset of the vocabulary: with a draft
  vocabulary D only ``|D|`` columns of the head are computed per slot, not all 49,152, and
  the mass off D, ``p_t(V∖D) = 1 − Σ_D p_t``, still counts in the L1 term.

Layout of a cache directory (raw little-endian arrays, shapes in ``manifest.json``):

* ``manifest.json`` — format/version, the key (data fingerprint, tap layers, ``max_len``,
  teacher dtype, model file) and the array shapes;
* ``taps.bin`` uint16 (bf16 bit patterns) ``[Σ L_i, m, d]``;
* ``hidden.bin`` fp32 ``[Σ R_i, d]`` and ``lse.bin`` fp32 ``[Σ R_i]``,
  ``R_i = max(0, L_i − 1 − prompt_len_i)``;
* ``done.bin`` uint8 ``[n]`` — 1 once sequence i's rows are written and flushed.

``L_i`` / ``prompt_len_i`` are the lengths after the ``max_len`` cut that training applies
(:func:`training.train._cut`). The build is resumable (done sequences are skipped) and
runs in ``workers`` processes of one torch thread each, writing disjoint rows of the same
memory-mapped files. Size: ~7 KB per token (taps 5.8 KB, hidden 2.3 KB per response token):
~10 GB for the committed 5,500 sequences.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from training.features import TeacherBatch, teacher_forward

FORMAT = "sparkgate-dspark-features"
VERSION = 1


@dataclass
class CacheLayout:
    """Row offsets of every sequence in the cache arrays.

    Attributes:
        lengths, prompt_lens: int64 ``[n]`` after the ``max_len`` cut.
        tok_off: int64 ``[n+1]`` — sequence i's taps are rows ``tok_off[i]:tok_off[i+1]``.
        resp_off: int64 ``[n+1]`` — its hidden / lse rows (positions ``prompt_len_i …
            L_i−2``) are ``resp_off[i]:resp_off[i+1]``.
    """

    lengths: np.ndarray
    prompt_lens: np.ndarray
    tok_off: np.ndarray
    resp_off: np.ndarray

    @classmethod
    def of(cls, data, max_len: int) -> "CacheLayout":
        lens = np.minimum(np.diff(data.offsets), max_len).astype(np.int64)
        plens = np.minimum(data.prompt_lens.astype(np.int64), max_len)
        resp = np.maximum(lens - 1 - plens, 0)
        cum = lambda a: np.concatenate([[0], np.cumsum(a)]).astype(np.int64)  # noqa: E731
        return cls(lens, plens, cum(lens), cum(resp))


def data_fingerprint(data) -> str:
    """sha1 of the sequences' token ids, offsets and prompt lengths (the cache key's data part)."""
    h = hashlib.sha1()
    for a in (data.tokens.astype(np.uint16), data.offsets.astype(np.int64), data.prompt_lens.astype(np.int32)):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def cache_key(data, tap_layers: Sequence[int], max_len: int, teacher_dtype: str) -> dict:
    """What a cache's features depend on; :meth:`FeatureCache.open` refuses a mismatch."""
    from runtime.models.loader import find_gguf

    gguf = find_gguf()
    return {
        "data_sha1": data_fingerprint(data), "num_sequences": len(data), "tap_layers": [int(t) for t in tap_layers],
        "max_len": int(max_len), "teacher_dtype": teacher_dtype,
        "model": {"file": gguf.name, "bytes": gguf.stat().st_size},
    }  # fmt: skip


def _bf16_bits(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def _from_bf16_bits(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a, dtype=np.uint16).view(np.int16)).view(torch.bfloat16).float()


class FeatureCache:
    """A feature cache directory (module docstring), memory-mapped.

    Use :meth:`create` (new, empty) or :meth:`open` (existing, key checked), then
    :meth:`write` (build) or :meth:`batch` (training).
    """

    def __init__(self, path: str | Path, manifest: dict, layout: CacheLayout, mode: str) -> None:
        self.path = Path(path)
        self.manifest = manifest
        self.layout = layout
        m, d = len(manifest["key"]["tap_layers"]), int(manifest["hidden_size"])
        n, T, R = len(layout.lengths), int(layout.tok_off[-1]), int(layout.resp_off[-1])
        mm = lambda name, dt, shape: np.memmap(self.path / name, dtype=dt, mode=mode, shape=shape)  # noqa: E731
        self.taps = mm("taps.bin", np.uint16, (max(T, 1), m, d))
        self.hidden = mm("hidden.bin", np.float32, (max(R, 1), d))
        self.lse = mm("lse.bin", np.float32, (max(R, 1),))
        self.done = mm("done.bin", np.uint8, (n,))

    @staticmethod
    def create(path: str | Path, data, key: dict, hidden_size: int) -> "FeatureCache":
        """Create the (sparse) files of an empty cache for ``data`` under ``key``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        lay = CacheLayout.of(data, key["max_len"])
        m, d = len(key["tap_layers"]), hidden_size
        T, R = int(lay.tok_off[-1]), int(lay.resp_off[-1])
        sizes = {"taps.bin": max(T, 1) * m * d * 2, "hidden.bin": max(R, 1) * d * 4, "lse.bin": max(R, 1) * 4,
                 "done.bin": len(data)}  # fmt: skip
        for name, size in sizes.items():
            with open(path / name, "wb") as f:
                f.truncate(size)
        manifest = {"format": FORMAT, "version": VERSION, "key": key, "hidden_size": d, "tokens": T,
                    "response_rows": R, "bytes": sum(sizes.values())}  # fmt: skip
        (path / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        return FeatureCache(path, manifest, lay, "r+")

    @staticmethod
    def open(path: str | Path, data, key: dict | None = None, mode: str = "r") -> "FeatureCache":
        """Open an existing cache for ``data``.

        Raises:
            FileNotFoundError: no ``manifest.json`` under ``path``.
            ValueError: another format/version, or ``key`` (when given) differs from the
                cache's — e.g. other data, other tap layers or another ``max_len``.
        """
        path = Path(path)
        mf = path / "manifest.json"
        if not mf.exists():
            raise FileNotFoundError(f"{path}: no feature cache (build it with `build-features`)")
        manifest = json.loads(mf.read_text())
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            raise ValueError(f"{path}: not a {FORMAT} v{VERSION} cache")
        if key is not None and manifest["key"] != key:
            diff = sorted(k for k in set(key) | set(manifest["key"]) if key.get(k) != manifest["key"].get(k))
            raise ValueError(f"{path}: feature cache was built for other settings ({', '.join(diff)} differ); "
                             "rebuild it or pass another --feature-cache dir")
        return FeatureCache(path, manifest, CacheLayout.of(data, manifest["key"]["max_len"]), mode)

    def check(self, data, tap_layers: Sequence[int], max_len: int) -> None:
        """Raise ``ValueError`` unless this cache was built for ``data`` with these tap layers and
        ``max_len`` (the teacher dtype may differ from the trainer's: it only decided how the
        features were computed)."""
        k = self.manifest["key"]
        want = {"data_sha1": data_fingerprint(data), "tap_layers": [int(t) for t in tap_layers], "max_len": int(max_len)}
        diff = [n for n, v in want.items() if k.get(n) != v]
        if diff:
            raise ValueError(f"{self.path}: feature cache was built for other settings ({', '.join(diff)} differ)")

    @property
    def tap_layers(self) -> list[int]:
        return list(self.manifest["key"]["tap_layers"])

    def missing(self, rows: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
        """Indices (of ``rows``, default all) whose features are not written yet."""
        rows = np.arange(len(self.done)) if rows is None else np.asarray(rows, dtype=np.int64)
        return rows[np.asarray(self.done[rows]) == 0]

    def write(self, i: int, taps: torch.Tensor, hidden: torch.Tensor, lse: torch.Tensor) -> None:
        """Store sequence i: taps ``[L_i, m, d]``, hidden ``[R_i, d]`` and lse ``[R_i]`` (any float
        dtype). Call :meth:`flush` before :meth:`mark_done`."""
        lay = self.layout
        t0, t1, r0, r1 = lay.tok_off[i], lay.tok_off[i + 1], lay.resp_off[i], lay.resp_off[i + 1]
        if taps.shape[0] != t1 - t0 or hidden.shape[0] != r1 - r0 or lse.shape[0] != r1 - r0:
            raise ValueError(f"sequence {i}: got {taps.shape[0]}/{hidden.shape[0]} rows, want {t1 - t0}/{r1 - r0}")
        self.taps[t0:t1] = _bf16_bits(taps)
        if r1 > r0:
            self.hidden[r0:r1] = hidden.float().numpy()
            self.lse[r0:r1] = lse.float().numpy()

    def flush(self) -> None:
        for a in (self.taps, self.hidden, self.lse):
            a.flush()

    def mark_done(self, rows: Sequence[int]) -> None:
        self.done[np.asarray(rows, dtype=np.int64)] = 1
        self.done.flush()

    def batch(self, rows: Sequence[int], tokens: Sequence[np.ndarray]) -> TeacherBatch:
        """The :class:`TeacherBatch` of sequences ``rows`` (their cut token ids ``tokens``), as
        :func:`teacher_forward` would give it, with ``lse`` set and ``hidden`` / ``lse`` filled
        only at positions ``[prompt_len, L−1)`` (0 elsewhere; no block slot reads them).

        Raises:
            ValueError: a row is not in the cache yet, or its tokens do not match the layout.
        """
        rows = [int(i) for i in rows]
        if len(self.missing(rows)):
            raise ValueError(f"sequences {self.missing(rows)[:5].tolist()} are not in the feature cache yet")
        lay = self.layout
        lens = [int(lay.lengths[i]) for i in rows]
        N, L = len(rows), max(lens)
        m, d = self.taps.shape[1], self.taps.shape[2]
        taps = torch.zeros(N, L, m, d)
        hidden = torch.zeros(N, L, d)
        lse = torch.zeros(N, L)
        toks = torch.zeros(N, L, dtype=torch.long)
        for b, i in enumerate(rows):
            n, p = lens[b], int(lay.prompt_lens[i])
            if len(tokens[b]) != n:
                raise ValueError(f"sequence {i}: {len(tokens[b])} tokens, the cache has {n}")
            toks[b, :n] = torch.as_tensor(np.asarray(tokens[b], dtype=np.int64))
            taps[b, :n] = _from_bf16_bits(self.taps[lay.tok_off[i] : lay.tok_off[i + 1]])
            r0, r1 = lay.resp_off[i], lay.resp_off[i + 1]
            if r1 > r0:
                hidden[b, p : p + (r1 - r0)] = torch.from_numpy(np.array(self.hidden[r0:r1]))
                lse[b, p : p + (r1 - r0)] = torch.from_numpy(np.array(self.lse[r0:r1]))
        plens = torch.as_tensor([int(lay.prompt_lens[i]) for i in rows], dtype=torch.long)
        return TeacherBatch(toks, torch.tensor(lens), plens, taps, hidden, lse)


# -- building -------------------------------------------------------------------------------

def compute_features(target, seqs: Sequence[np.ndarray], prompt_lens: Sequence[int], tap_layers: Sequence[int],
                     lse_chunk: int = 512) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Teacher features of a few sequences: per sequence ``(taps [L, m, d] fp32, hidden [R, d],
    lse [R] fp32)`` with R = rows ``[prompt_len, L−1)`` (module docstring)."""
    tb = teacher_forward(target, seqs, prompt_lens, tap_layers)
    out = []
    for b, s in enumerate(seqs):
        n, p = len(s), int(prompt_lens[b])
        h = tb.hidden[b, p : max(n - 1, p)]
        lse = torch.cat([torch.logsumexp(target.lm_head(h[j : j + lse_chunk]), -1)
                         for j in range(0, h.shape[0], lse_chunk)]) if h.shape[0] else torch.zeros(0)  # fmt: skip
        out.append((tb.taps[b, :n], h.float(), lse))
    return out


def _worker(path: str, data_dir: str, part: int, parts: int, teacher_dtype: str, seqs_per_batch: int,
            threads: int, limit: int | None) -> int:
    """Fill the missing sequences ``i ≡ part (mod parts)`` of the cache at ``path``; returns how many."""
    from training.data import load_data
    from training.features import build_target

    data = load_data(data_dir)
    cache = FeatureCache.open(path, data, mode="r+")
    todo = [int(i) for i in cache.missing() if int(i) % parts == part]
    if limit is not None:
        todo = todo[: max(0, limit // parts + (1 if part < limit % parts else 0))]
    if not todo:
        return 0
    target = build_target(threads, getattr(torch, teacher_dtype))
    lay = cache.layout
    todo.sort(key=lambda i: int(lay.lengths[i]))  # similar lengths per batch: less padding
    for j in range(0, len(todo), seqs_per_batch):
        rows = todo[j : j + seqs_per_batch]
        seqs = [data.sequence(i)[: int(lay.lengths[i])] for i in rows]
        feats = compute_features(target, seqs, [int(lay.prompt_lens[i]) for i in rows], cache.tap_layers)
        for i, (taps, hidden, lse) in zip(rows, feats):
            cache.write(i, taps, hidden, lse)
        cache.flush()
        cache.mark_done(rows)
    return len(todo)


def build_feature_cache(
    path: str | Path,
    data_dir: str | Path,
    tap_layers: Sequence[int],
    max_len: int = 768,
    teacher_dtype: str = "float32",
    workers: int = 2,
    seqs_per_batch: int = 4,
    limit: int | None = None,
    progress: bool = True,
) -> dict:
    """Build (or continue) the feature cache of ``data_dir`` at ``path``.

    Args:
        tap_layers: the drafter's target layer ids (its ``target_layer_ids``).
        max_len: the training cut (``TrainConfig.max_len``).
        teacher_dtype: ``"float32"`` (default; the closest to the served gguf target and
            the fastest on CPUs without AMX) or ``"bfloat16"``.
        workers: processes of one torch thread each (2 on a 2-core box).
        seqs_per_batch: sequences per target forward.
        limit: fill at most this many more sequences (tests, throughput runs).

    Returns:
        ``{"sequences", "done", "new", "seconds", "tokens_per_s", "bytes", "path"}``.

    Raises:
        ValueError: ``path`` holds a cache built for other settings.
    """
    import multiprocessing as mp

    from training.data import load_data

    data = load_data(data_dir)
    key = cache_key(data, tap_layers, max_len, teacher_dtype)
    if (Path(path) / "manifest.json").exists():
        cache = FeatureCache.open(path, data, key, mode="r")
    else:
        from runtime.models.loader import ensure_converted

        hidden_size = json.loads((ensure_converted() / "config.json").read_text())["hidden_size"]
        cache = FeatureCache.create(path, data, key, hidden_size)
    missing_before = cache.missing()
    before = len(data) - len(missing_before)
    t0 = time.monotonic()
    args = [(str(path), str(data_dir), k, workers, teacher_dtype, seqs_per_batch, 1, limit) for k in range(workers)]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(data), initial=before, desc="features", unit="seq", dynamic_ncols=True)
    if workers == 1:
        _worker(*args[0])
    else:
        with mp.get_context("spawn").Pool(workers) as pool:
            res = pool.starmap_async(_worker, args)
            while not res.ready():
                res.wait(2.0)
                if bar is not None:
                    bar.n = len(data) - len(FeatureCache.open(path, data).missing())
                    bar.refresh()
            res.get()
    done = len(data) - len(FeatureCache.open(path, data).missing())
    if bar is not None:
        bar.n = done
        bar.close()
    dt = time.monotonic() - t0
    final = FeatureCache.open(path, data)
    new = missing_before[np.asarray(final.done[missing_before]) == 1]
    new_tokens = int(final.layout.lengths[new].sum())
    return {"sequences": len(data), "done": done, "new": int(len(new)), "new_tokens": new_tokens,
            "seconds": round(dt, 1), "tokens_per_s": round(new_tokens / max(dt, 1e-9), 1),
            "bytes": cache.manifest["bytes"], "path": str(path)}  # fmt: skip
