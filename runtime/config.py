"""Engine configuration: one plain dataclass (nano-vllm style), and the runtime's own
environment variables.

The gateway derives its pydantic settings (``SPARKGATE_<FIELD>``) from the dataclass
fields; the runtime reads only the variables of :data:`ENV`, and only via :func:`env`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: Variables the runtime reads itself (also without the gateway): name → (default, meaning).
ENV = {
    "SPARKGATE_CACHE_DIR": ("~/.cache/sparkgate", "root of the caches: converted model, SPS profiles, "
                            "compiled kernels, default database (``runtime.config.cache_dir``)."),
    "SPARKGATE_KERNELS": ("auto", "verification kernels: ``auto`` (Triton for CUDA tensors; on the CPU the C++ "
                          "twin where the gguf extension is loaded, else the torch reference), ``reference`` or "
                          "``triton`` forced (``runtime.kernels.dispatch``)."),
}


def env(name: str) -> str:
    """The value of ``name`` (a key of :data:`ENV`), stripped; unset or empty → its default."""
    return os.environ.get(name, "").strip() or ENV[name][0]


#: ``EngineConfig.spec_method`` values ("none": plain decoding); the gateway's settings accept
#: exactly these (torch-free, so it lives here rather than in the speculator)
SPEC_METHODS = ("none", "dspark", "parallel", "prompt_lookup", "hybrid")

#: ``EngineConfig.dtype`` values besides ``"auto"`` (:func:`resolve_dtype`): what the engine
#: loads the target as (``runtime.engine.llm_engine.DTYPES`` maps each to its torch dtype or
#: weight format); the gateway's settings accept exactly these and ``"auto"``
DTYPE_NAMES = ("gguf", "gguf-a8", "bfloat16", "bf16", "float32", "fp32", "int8")


@dataclass
class EngineConfig:
    """Knobs of the embedded engine.

    Attributes:
        dtype: serving dtype of the target model: ``"auto"`` (default,
            :func:`resolve_dtype`), ``"gguf"`` (the shipped GGUF's own Q4_1/Q8_0 blocks
            with exact weights over bf16 activations, ``runtime.models.gguf_weights``;
            needs AVX512-BF16), ``"gguf-a8"`` (opt-in: the same with the Q4_1 projections'
            activations quantised to int8 per row and 32-group, W4A8 on VNNI: cheaper
            verified rows and batches, and it changes the target — agreement and speed in
            ``docs/benchmarks.md``, "int8 activations"), ``"bfloat16"``, ``"float32"`` (the
            GGUF dequantised exactly; bit-stable tests) or ``"int8"`` (opt-in weight-only
            int8 linears over fp32 activations, ``runtime.models.quant``: it changes the
            target — top-1 agreement vs fp32 in ``docs/benchmarks.md``).
        max_batch_size: max concurrently running sequences (= KV-cache slots).
        max_context: tokens per sequence (prompt + completion); KV slots are this long.
            Default: the served model's full context (SmolLM2: 8,192). Slots commit memory
            as tokens are cached (:mod:`runtime.engine.kv_cache`), so an idle server does
            not pay for ``max_batch_size × max_context``.
        max_waiting: bounded waiting queue; beyond it ``QueueFullError`` (HTTP 503).
        prefill_chunk_tokens: long prompts are prefilled in chunks of this many tokens
            so running streams keep flowing.
        max_step_tokens: max tokens in one ragged forward (prefill chunks + decode).
        request_timeout_s: per-request wall-clock limit (seconds).
        num_threads: torch intra-op threads (0 → torch default).
        spec_method: ``"none"`` (AR, the engine's default), ``"dspark"``, ``"parallel"``
            (rank-0 ablation), ``"prompt_lookup"`` (n-gram baseline), ``"hybrid"`` (n-gram draft
            where it is likely accepted, else DSpark: :mod:`runtime.speculation.speculator`) or
            ``"auto"`` (the server's default: ``"hybrid"`` on the ``gguf`` path of a CPU with
            AMX, else ``"none"``; :func:`resolve_spec_method`).
        spec_policy: verification-budget policy: ``fixed``, ``mtp1``, ``threshold``,
            ``dspark``, ``dspark-sla`` (default).
        draft_checkpoint: path of a drafter checkpoint dir (safetensors + JSON);
            ``None`` → the committed one for the method (``checkpoints/default`` for
            ``dspark`` and ``hybrid``, ``checkpoints/parallel`` for ``parallel``); a missing or
            mismatched checkpoint is a start-up error naming this setting, never a random init.
        num_speculative_tokens: block size γ used when serving (≤ the checkpoint's γ).
        draft_fused: draft over the checkpoint's draft vocabulary: with
            :class:`runtime.speculation.fast_drafter.FastDrafter` (fused C++ backbone) where the
            target is on the fused ``gguf`` path, else on the CPU with
            :class:`runtime.speculation.vocab_drafter.VocabDrafter` (torch backbone);
            ``False`` → always the reference full-vocabulary drafter (A/B benchmarks).
        seed: seed for random drafter init / engine-level randomness.
        sps_table_path: JSON SPS table (``runtime.speculation.sps.SpsTable.save``) to use as
            is for the ``dspark`` policies — no cache lookup, no profiling (e.g. the
            committed ``tests/data/sps_table.json``). ``None`` → the cached profile
            matching this engine, else the fallback table.
        profile_on_start: when speculating and no cached profile matches, profile the SPS
            tables at start-up (bounded: about a minute each for T = 1 and T = 0 on the 2-core
            CPUs, see ``runtime.engine.profile``) and cache them. ``False`` (the engine's default;
            tests) never profiles: cached profile or fallback table. The server's default is on.
        prefix_cache_blocks: capacity of the automatic prefix cache
            (:mod:`runtime.engine.prefix_cache`) in blocks of ``prefix_block_size`` tokens;
            0 disables it. Default 512 × 16 = 8192 tokens (one full-context prompt)
            ≈ 360 MiB in fp32 (180 MiB in bf16) of target KV at most, plus the drafter's
            context K/V when speculating; pages are committed as blocks are filled.
        prefix_block_size: tokens per prefix-cache block (reuse is block-granular).
        spec_gate: when speculating, decide before drafting — from past steps only — whether
            to draft (lossless). ``dspark``: per request, inside the verification budget
            (``Speculator._worth_drafting``: the budget's ℓ = 0 case on the request's measured
            yield of a draft so far, the SPS table and the measured drafting cost);
            ``parallel``/``prompt_lookup``: per step, by measured speed
            (:class:`runtime.speculation.gate.SpecGate`). ``False`` → every step with
            decoding sequences drafts (the behaviour before the gate). Ignored when
            ``spec_method`` is ``"none"`` or ``"hybrid"`` (which always decides per request).
    """

    dtype: str = "auto"
    max_batch_size: int = 16
    max_context: int = 8192
    max_waiting: int = 256
    prefill_chunk_tokens: int = 256
    max_step_tokens: int = 512
    request_timeout_s: float = 600.0
    num_threads: int = 0
    spec_method: str = "none"
    spec_policy: str = "dspark-sla"
    draft_checkpoint: str | None = None
    num_speculative_tokens: int = 7
    draft_fused: bool = True
    seed: int = 0
    sps_table_path: str | None = None
    profile_on_start: bool = False
    prefix_cache_blocks: int = 512
    prefix_block_size: int = 16
    spec_gate: bool = True


#: /proc/cpuinfo flags the kernel needs, and those of the AMX tile unit it uses where present.
#: (Every CPU with AVX512-BF16 — Cooper Lake, Sapphire Rapids, Zen 4 — also has AVX512-VNNI,
#: which the int8-activation kernel of ``dtype="gguf-a8"`` uses.)
KERNEL_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "f16c"})
AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The ``flags`` (aarch64: ``Features``) of the first CPU in ``/proc/cpuinfo`` (empty if unreadable)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):  # x86, aarch64
            return set(line.split(":", 1)[-1].split())
    return set()


def cpu_supports_kernel(cpuinfo: str | None = None) -> bool:
    """True on x86 CPUs with AVX512F/BW/VL, AVX512-BF16, AVX512-VNNI and F16C (the kernel's ISA)."""
    return KERNEL_FLAGS <= cpu_flags(cpuinfo)


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 natively (x86 ``avx512_bf16`` or ``amx_bf16``
    flags in ``/proc/cpuinfo``; aarch64 ``bf16``). ``cpuinfo``: the file's text (tests).

    Measured on two 2-core machines of this project (``docs/benchmarks.md``): with
    AVX512-BF16 a bf16 decode step is ~2× faster than fp32; on an AVX2-only AMD EPYC a
    batch-16 step takes 732 ms in bf16 vs 271 ms in fp32 (1 thread) — oneDNN then
    converts bf16 to fp32 in software.
    """
    return bool(cpu_flags(cpuinfo) & {"avx512_bf16", "amx_bf16", "bf16"})


def cache_dir() -> Path:
    """Root cache dir: ``$SPARKGATE_CACHE_DIR`` or ``~/.cache/sparkgate`` (:data:`ENV`)."""
    return Path(env("SPARKGATE_CACHE_DIR")).expanduser()


def resolve_spec_method(name: str, dtype: str, cpuinfo: str | None = None) -> str:
    """``"auto"`` (the server's default) → ``"hybrid"`` where a verified row is near-free —
    the target on the ``gguf`` path of a CPU with AMX-BF16, whose tiles multiply up to 16
    rows for about the price of one — else ``"none"`` (plain decoding: on CPUs without
    AMX a verified row costs ~0.12–0.18 decode steps and speculation measured 0.95–1.14×
    AR). Measured, served over HTTP: ``docs/benchmarks.md``, "Speculation by default on
    AMX". Any other name is returned unchanged (validated by the engine).

    Args:
        name: ``EngineConfig.spec_method``.
        dtype: the resolved serving dtype (:func:`resolve_dtype`).
        cpuinfo: ``/proc/cpuinfo``'s text (tests); ``None`` reads this machine's.
    """
    if name != "auto":
        return name
    return "hybrid" if dtype == "gguf" and AMX_FLAGS <= cpu_flags(cpuinfo) else "none"


def resolve_dtype(name: str, cpuinfo: str | None = None) -> str:
    """``"auto"`` → ``"gguf"`` where the GGUF kernels run (x86 with AVX512-BF16:
    3.6× faster than bf16 at batch 1 and closer to the exact fp32 model — 99.5 % vs
    98.8 % top-1 agreement, ``docs/benchmarks.md``), else ``"bfloat16"`` if
    :func:`cpu_has_native_bf16`, else ``"float32"``; any other name is returned
    unchanged (validated by the engine). ``cpuinfo``: ``/proc/cpuinfo``'s text (tests)."""
    if name != "auto":
        return name
    if cpu_supports_kernel(cpuinfo):
        return "gguf"
    return "bfloat16" if cpu_has_native_bf16(cpuinfo) else "float32"
