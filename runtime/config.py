"""Engine configuration: one plain dataclass (nano-vllm style).

The gateway maps its pydantic settings onto this; the runtime never reads
environment variables itself except the cache dir (see ``models/loader.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    """Knobs of the embedded engine.

    Attributes:
        dtype: serving dtype of the target model, ``"bfloat16"`` (default, ~2× faster
            on these CPUs) or ``"float32"`` (bit-stable tests).
        max_batch_size: max concurrently running sequences (= KV-cache slots).
        max_context: tokens per sequence (prompt + completion); KV slots are this long.
        max_waiting: bounded waiting queue; beyond it ``QueueFullError`` (HTTP 503).
        prefill_chunk_tokens: long prompts are prefilled in chunks of this many tokens
            so running streams keep flowing.
        max_step_tokens: max tokens in one ragged forward (prefill chunks + decode).
        request_timeout_s: per-request wall-clock limit.
        num_threads: torch intra-op threads (0 → torch default).
        spec_method: ``"none"`` (AR), ``"dspark"``, ``"parallel"`` (rank-0 ablation),
            ``"prompt_lookup"`` (n-gram baseline).
        spec_policy: verification-budget policy: ``fixed``, ``mtp1``, ``threshold``,
            ``dspark``, ``dspark-sla`` (default).
        draft_checkpoint: path of a drafter checkpoint dir (safetensors + JSON);
            ``None`` → the committed default (or random init if none exists).
        num_speculative_tokens: block size γ used when serving (≤ the checkpoint's γ).
        seed: seed for random drafter init / engine-level randomness.
        sps_table_path: JSON SPS table (``runtime.dspark.sps.SpsTable.save``) to use as
            is for the ``dspark`` policies — no cache lookup, no profiling (e.g. the
            committed ``tests/data/sps_table.json``). ``None`` → the cached profile
            matching this engine, else the fallback table.
        profile_on_start: when no cached profile matches, profile the SPS table at
            start-up (bounded: ~10–20 s on the 2-core CPU, see
            ``runtime.dspark.profile_engine``) and cache it. ``False`` (default; tests)
            never profiles: cached profile or fallback table.
    """

    dtype: str = "bfloat16"
    max_batch_size: int = 16
    max_context: int = 2048
    max_waiting: int = 256
    prefill_chunk_tokens: int = 256
    max_step_tokens: int = 512
    request_timeout_s: float = 600.0
    num_threads: int = 0
    spec_method: str = "none"
    spec_policy: str = "dspark-sla"
    draft_checkpoint: str | None = None
    num_speculative_tokens: int = 7
    seed: int = 0
    sps_table_path: str | None = None
    profile_on_start: bool = False
