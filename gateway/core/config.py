"""Gateway settings (pydantic-settings): environment variables ``SPARKGATE_*`` and ``.env``.

Example: ``SPARKGATE_PORT=9000 SPARKGATE_CORS_ORIGINS=http://localhost:3000 sparkgate serve``.
List values accept JSON (``["a","b"]``) or a comma-separated string.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from runtime.config import EngineConfig


def default_database_url() -> str:
    """``sqlite+aiosqlite:///<cache_dir>/sparkgate.db`` (cache dir: ``$SPARKGATE_CACHE_DIR``
    or ``~/.cache/sparkgate``)."""
    from runtime.models.loader import cache_dir  # only reads the environment

    return f"sqlite+aiosqlite:///{cache_dir() / 'sparkgate.db'}"


class Settings(BaseSettings):
    """Every knob of the gateway and the embedded engine it builds.

    Attributes:
        host, port: where ``sparkgate serve`` listens.
        metrics_port: unset (default) → ``GET /metrics`` on the API port, admin token
            required; set → served without auth on ``metrics_host:metrics_port`` only
            (keep that port off the public network).
        metrics_host: address of that separate metrics listener.
        metrics_max_tenants: distinct tenants named in metric labels; later ones → ``other``.
        database_url: SQLAlchemy async URL (``sqlite+aiosqlite://`` or
            ``postgresql+asyncpg://``) holding tenants and API keys.
        dtype, max_batch_size, max_context, max_waiting, request_timeout_s (seconds),
        spec_method, spec_policy, draft_checkpoint, num_speculative_tokens, draft_fused, sps_table_path,
        profile_on_start, spec_gate: passed to :class:`runtime.config.EngineConfig` (see its docstring);
            serving profiles the SPS table at start-up only when speculating and no
            cached profile matches (``profile_on_start``, default on for the server).
            ``spec_gate`` (``SPARKGATE_SPEC_GATE``, default on): speculate only on steps
            where measured speed says it beats plain decoding (``runtime.dspark.gate``).
        prefix_cache_blocks: capacity of the automatic prefix cache in 16-token blocks
            (``runtime.prefix_cache``; 256 blocks = 180 MiB in fp32, 90 MiB in bf16, with
            the drafter's context cache on top when speculating); 0 disables it.
        prefix_cache_scope: ``tenant`` (default): cached prompt KV is reused only within
            a tenant (no cross-tenant timing side channel); ``global``: across tenants.
        cors_origins: browser origins allowed by CORS; empty → CORS disabled.
        admin_token: optional extra bearer token accepted on every route (tenant ``admin``).
        model_name: public name of the served model (accepted as ``model`` alias).
        auth_cache_ttl_s: how long a successful key lookup is cached in-process (seconds);
            a revoked key keeps working for at most this long in a running server. The
            tenant/tier/key-limit cache uses the same TTL. While the database is down,
            known keys keep working on their last cached values.
        default_tier: the SLA tier of tenants without one (a missing tier = unlimited).
        redis_url: optional ``redis://host:port/db`` sharing the rate-limit buckets between
            replicas; unset → per-replica buckets.
        record_buffer_max: request records buffered in memory while the database is slow
            or down; beyond it records are dropped and counted (``RecordWriter.dropped``).
        record_batch_size, record_flush_interval_s: records per insert, seconds between flushes.
        record_retention_days: request records older than this are pruned (days).
        rollup_retention_days: per-minute rollups older than this are pruned (days).
        rollup_interval_s: how often touched minutes are re-aggregated (seconds).
        sla_admission: hold requests that would push a higher-priority tier below its target.
        admission_step_s: prior per-token decode step time (seconds) of the SLA speed model
            before the engine has been measured.
        max_body_bytes: largest accepted request body (bytes); larger → 413 before it is
            read (``gateway.bodylimit``). 0 disables the limit.
        shutdown_timeout_s: on SIGTERM, ``sparkgate serve`` stops accepting and lets
            in-flight requests finish for at most this long (uvicorn
            ``timeout_graceful_shutdown``), then flushes request records and exits.
        backend: ``embedded`` (this process's engine) or ``sglang`` (stream from SGLang
            servers, see docs/deploy-gpu.md); the ``sglang_*`` fields configure the latter.
    """

    model_config = SettingsConfigDict(env_prefix="SPARKGATE_", env_file=".env", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8000
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    metrics_max_tenants: int = 20
    database_url: str = Field(default_factory=default_database_url)
    # runtime.config.resolve_dtype: gguf where its kernels run, else bf16 on CPUs with native bf16, else fp32
    dtype: Literal["auto", "gguf", "bfloat16", "bf16", "float32", "fp32", "int8"] = "auto"
    max_batch_size: int = 16
    max_context: int = 2048
    max_waiting: int = 256
    request_timeout_s: float = 600.0
    spec_method: str = "none"
    spec_policy: str = "dspark-sla"
    draft_checkpoint: str | None = None
    num_speculative_tokens: int = 7
    draft_fused: bool = True
    sps_table_path: str | None = None
    profile_on_start: bool = True
    spec_gate: bool = True
    prefix_cache_blocks: int = Field(default=256, ge=0)  # blocks of 16 tokens; 0 disables prefix caching
    prefix_cache_scope: Literal["tenant", "global"] = "tenant"
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    admin_token: str | None = None
    model_name: str = "SmolLM2-135M-Instruct"
    auth_cache_ttl_s: float = 5.0
    default_tier: str = "default"
    redis_url: str | None = None
    record_buffer_max: int = 10_000
    record_batch_size: int = 500
    record_flush_interval_s: float = 0.5
    record_retention_days: float = 7.0
    rollup_retention_days: float = 90.0
    rollup_interval_s: float = 10.0
    sla_admission: bool = True
    admission_step_s: float = 0.02
    max_body_bytes: int = 2_000_000
    shutdown_timeout_s: float = 30.0
    backend: Literal["embedded", "sglang"] = "embedded"
    sglang_urls: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["http://127.0.0.1:30000"])
    sglang_tokenizer_path: str | None = None
    sglang_api_key: str | None = None
    sglang_send_priority: bool = False
    sglang_priority_low_values_first: bool = False
    sglang_sla_max_weight: float = 4.0
    sglang_incremental_streaming_output: bool | None = None
    sglang_health_path: str = "/health"
    sglang_health_interval_s: float = 10.0
    sglang_max_in_flight_per_upstream: int | None = None

    @field_validator("cors_origins", "sglang_urls", mode="before")
    @classmethod
    def _split_origins(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                import json

                return json.loads(text)
            return [part.strip() for part in text.split(",") if part.strip()]
        return value

    def engine_config(self) -> EngineConfig:
        """The :class:`EngineConfig` for the embedded engine (other fields keep their defaults)."""
        return EngineConfig(
            dtype=self.dtype,
            max_batch_size=self.max_batch_size,
            max_context=self.max_context,
            max_waiting=self.max_waiting,
            request_timeout_s=self.request_timeout_s,
            spec_method=self.spec_method,
            spec_policy=self.spec_policy,
            draft_checkpoint=self.draft_checkpoint,
            num_speculative_tokens=self.num_speculative_tokens,
            draft_fused=self.draft_fused,
            sps_table_path=self.sps_table_path,
            profile_on_start=self.profile_on_start,
            spec_gate=self.spec_gate,
            prefix_cache_blocks=self.prefix_cache_blocks,
        )

    def backend_config(self):
        """:class:`EngineConfig` (embedded) or ``runtime.sglang.client.SGLangConfig``."""
        if self.backend != "sglang":
            return self.engine_config()
        from runtime.sglang.client import SGLangConfig

        return SGLangConfig(
            urls=tuple(self.sglang_urls),
            model_name=self.model_name,
            max_context=self.max_context,
            tokenizer_path=self.sglang_tokenizer_path,
            api_key=self.sglang_api_key,
            send_priority=self.sglang_send_priority,
            priority_low_values_first=self.sglang_priority_low_values_first,
            sla_max_weight=self.sglang_sla_max_weight,
            incremental_streaming_output=self.sglang_incremental_streaming_output,
            request_timeout_s=self.request_timeout_s,
            health_path=self.sglang_health_path,
            health_interval_s=self.sglang_health_interval_s,
            max_in_flight_per_upstream=self.sglang_max_in_flight_per_upstream,
        )
