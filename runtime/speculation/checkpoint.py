"""Drafter checkpoints: a directory with ``config.json`` + ``model.safetensors``.

``config.json``::

    {"format": "sparkgate-dspark", "version": 1, "architecture": "dspark-llama",
     "drafter": {target_layer_ids, block_size (γ), num_layers, markov_rank,
                 markov_variant, sts_temperatures, init_seed},
     "target": {vocab_size, hidden_size, num_layers, num_heads, num_kv_heads,
                head_dim, intermediate_size}}

``model.safetensors`` holds the drafter's own weights only (``fc``, norms, draft
layers, ``mask_embedding``, ``markov.*``, ``confidence.*``); the embeddings and LM
head are the target's and are never stored. Backbone tensors are saved in the
drafter's dtype, heads in fp32; loading casts the backbone to the target's dtype.
"""

from __future__ import annotations

import json
from pathlib import Path

from runtime.models.llama import LlamaModel
from runtime.speculation.config import DrafterConfig
from runtime.speculation.drafter import DSparkDrafter

FORMAT = "sparkgate-dspark"
VERSION = 1
ARCHITECTURE = "dspark-llama"
_TARGET_KEYS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")


def _target_geometry(target: LlamaModel) -> dict:
    return {k: getattr(target.cfg, k) for k in _TARGET_KEYS}


def save_drafter(drafter: DSparkDrafter, path: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into directory ``path`` (created).

    Returns:
        The directory path.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "architecture": ARCHITECTURE,
        "drafter": drafter.cfg.to_dict(),
        "target": _target_geometry(drafter.target),
    }
    sd = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(sd, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    return path


def read_config(path: str | Path) -> DrafterConfig:
    """The :class:`DrafterConfig` of a checkpoint directory (no weights loaded).

    Raises:
        ValueError: not a sparkgate DSpark checkpoint.
    """
    meta = json.loads((Path(path) / "config.json").read_text())
    if meta.get("format") != FORMAT or meta.get("architecture") != ARCHITECTURE:
        raise ValueError(f"{path}: not a {FORMAT}/{ARCHITECTURE} checkpoint")
    if meta.get("version") != VERSION:
        raise ValueError(f"{path}: unsupported checkpoint version {meta.get('version')}")
    return DrafterConfig.from_dict(meta["drafter"])


def load_drafter(path: str | Path, target: LlamaModel) -> DSparkDrafter:
    """Load a drafter checkpoint bound to ``target``.

    Raises:
        ValueError: wrong format, a target-geometry mismatch (the checkpoint was
            trained for another model), or missing/unexpected weights.
    """
    from safetensors.torch import load_file

    path = Path(path)
    cfg = read_config(path)
    meta = json.loads((path / "config.json").read_text())
    want, have = meta["target"], _target_geometry(target)
    if want != have:
        raise ValueError(f"{path}: drafter was built for target {want}, got {have}")
    drafter = DSparkDrafter(target, cfg)
    sd = load_file(str(path / "model.safetensors"))
    own = drafter.state_dict()
    missing, unexpected = set(own) - set(sd), set(sd) - set(own)
    if missing or unexpected:
        raise ValueError(f"{path}: missing weights {sorted(missing)}, unexpected {sorted(unexpected)}")
    for k, v in own.items():
        if v.shape != sd[k].shape:
            raise ValueError(f"{path}: weight {k} has shape {tuple(sd[k].shape)}, expected {tuple(v.shape)}")
        v.copy_(sd[k].to(v.dtype))
    return drafter


def export_checkpoint(src: str | Path, dst: str | Path, dtype: str = "bfloat16") -> dict:
    """Copy a checkpoint for serving/committing: every floating tensor cast to ``dtype``.

    Training writes fp32 master weights (and heads in fp32, ~60 MB for γ 7 / 2 layers /
    rank 64); the served model runs the backbone in the target's dtype anyway and the
    heads only add a low-rank bias and a confidence logit, so a bf16 copy (~30 MB) is
    what ``runtime/speculation/checkpoints/default/`` holds. ``config.json`` (with its STS
    temperatures), ``calibration.json`` and ``draft_vocab.json`` (the fused drafter's
    vocabulary) are copied unchanged; optimizer state and training logs are not.

    Returns:
        ``{"tensors", "bytes", "dtype"}`` of the written ``model.safetensors``.

    Raises:
        FileNotFoundError: ``src`` has no ``config.json`` / ``model.safetensors``.
    """
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    for name in ("config.json", "model.safetensors"):
        if not (src / name).exists():
            raise FileNotFoundError(f"{src / name} not found")
    dst.mkdir(parents=True, exist_ok=True)
    want = getattr(torch, dtype)
    sd = {k: (v.to(want) if v.is_floating_point() else v).contiguous() for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(sd, str(dst / "model.safetensors"))
    for name in ("config.json", "calibration.json", "draft_vocab.json"):
        if (src / name).exists() and src.resolve() != dst.resolve():
            shutil.copyfile(src / name, dst / name)
    return {"tensors": len(sd), "bytes": (dst / "model.safetensors").stat().st_size, "dtype": dtype}
