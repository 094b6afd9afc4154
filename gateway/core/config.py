"""Gateway settings (pydantic-settings): environment variables ``SPARKGATE_*`` and ``.env``.

Example: ``SPARKGATE_PORT=9000 SPARKGATE_CORS_ORIGINS=http://localhost:3000 sparkgate serve``.
List values accept JSON (``["a","b"]``) or a comma-separated string. Each field of
:class:`runtime.config.EngineConfig` is the setting of the same name, each field of
:class:`runtime.sglang.client.SGLangConfig` the setting ``sglang_<field>`` and each field of
:class:`runtime.upstream.config.UpstreamConfig` the setting ``upstream_<field>`` (except
:data:`SHARED`). The table of every ``SPARKGATE_*`` variable, ``docs/configuration.md``, is
generated from these classes' docstrings (``python -m tests.support.configuration_doc --write``).
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, fields
from typing import Annotated, Any, Literal

from pydantic import Field, create_model, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from runtime.config import DTYPE_NAMES, SPEC_METHODS, EngineConfig
from runtime.sglang.client import SGLangConfig
from runtime.speculation.budget import POLICIES
from runtime.upstream.config import UpstreamConfig

#: ``SGLangConfig`` / ``UpstreamConfig`` fields taken from the unprefixed setting of the same name.
SHARED = ("model_name", "max_context", "request_timeout_s")


def default_database_url() -> str:
    """``sqlite+aiosqlite:///<cache_dir>/sparkgate.db`` (cache dir: ``$SPARKGATE_CACHE_DIR``
    or ``~/.cache/sparkgate``)."""
    from runtime.config import cache_dir  # only reads the environment

    return f"sqlite+aiosqlite:///{cache_dir() / 'sparkgate.db'}"


def _fields_of(config: type, prefix: str = "") -> dict[str, Any]:
    """Pydantic field definitions ``prefix + name → (type, default)`` of dataclass ``config``
    (the :data:`SHARED` names left out when prefixed)."""
    hints = typing.get_type_hints(config)
    return {prefix + f.name: (hints[f.name], f.default if f.default is not MISSING else
                              Field(default_factory=f.default_factory))
            for f in fields(config) if not (prefix and f.name in SHARED)}


_Derived = create_model("_Derived", __base__=BaseSettings, **_fields_of(EngineConfig),
                        **_fields_of(SGLangConfig, "sglang_"), **_fields_of(UpstreamConfig, "upstream_"))


class Settings(_Derived):
    """Every knob of the gateway and of the backend it builds: the embedded engine's
    (:class:`EngineConfig`'s fields), SGLang's (``sglang_`` + :class:`SGLangConfig`'s) or the
    OpenAI-compatible upstreams' (``upstream_`` + :class:`UpstreamConfig`'s).

    Attributes:
        host, port: where ``sparkgate serve`` listens.
        metrics_port: unset (default) → ``GET /metrics`` on the API port, admin token
            required; set → served without auth on ``metrics_host:metrics_port`` only
            (keep that port off the public network).
        metrics_host: address of that separate metrics listener.
        metrics_max_tenants: distinct tenants named in metric labels; later ones → ``other``.
        database_url: SQLAlchemy async URL (``sqlite+aiosqlite://`` or
            ``postgresql+asyncpg://``) holding tenants and API keys.
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
        redis_url: optional ``redis://host:port/db`` sharing the rate-limit buckets, the
            ``max_concurrent`` leases and the live admin state between replicas; unset →
            per-replica state.
        redis_prefix: prefix of every Redis key the gateway writes (several deployments may
            share one Redis with different prefixes).
        replica_id: this process's name in the live admin state and in request records
            (``request_records.replica``); unset → ``<hostname>-<pid>-<4 hex>``, new at
            each start.
        record_buffer_max: request records buffered in memory while the database is slow
            or down; beyond it records are dropped and counted (``RecordWriter.dropped``).
        record_batch_size: request records per insert.
        record_flush_interval_s: seconds between two flushes of the buffered records.
        record_retention_days: request records older than this are pruned (days).
        rollup_retention_days: per-minute rollups older than this are pruned (days).
        rollup_interval_s: how often touched minutes are re-aggregated (seconds).
        sla_admission: hold requests that would push a higher-priority tier below its target.
        admission_step_s: prior per-token decode step time (seconds) of the SLA speed model
            before the engine has been measured.
        max_body_bytes: largest accepted request body (bytes); larger → 413 before it is
            read (``gateway.api.bodylimit``). 0 disables the limit.
        shutdown_timeout_s: on SIGTERM, ``sparkgate serve`` stops accepting and lets
            in-flight requests finish for at most this long (uvicorn
            ``timeout_graceful_shutdown``), then flushes request records and exits.
        backend: ``embedded`` (this process's engine), ``sglang`` (stream from SGLang servers'
            native API, see docs/deploy-gpu.md; the ``sglang_*`` fields) or ``openai`` (stream
            from OpenAI-compatible servers' ``/v1/completions``: vLLM, SGLang, llama-server, see
            docs/deploy.md; the ``upstream_*`` fields).
    """

    model_config = SettingsConfigDict(env_prefix="SPARKGATE_", env_file=".env", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8000
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    metrics_max_tenants: int = 20
    database_url: str = Field(default_factory=default_database_url)
    prefix_cache_scope: Literal["tenant", "global"] = "tenant"
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    admin_token: str | None = None
    model_name: str = "SmolLM2-135M-Instruct"
    auth_cache_ttl_s: float = 5.0
    default_tier: str = "default"
    redis_url: str | None = None
    redis_prefix: str = "sparkgate:"
    replica_id: str | None = None
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
    backend: Literal["embedded", "sglang", "openai"] = "embedded"
    # Derived fields the gateway narrows: the dtypes, speculation methods and verification
    # policies the engine accepts (a typo fails at start-up, naming the setting, instead of
    # leaving /readyz at 503), start-up profiling on when serving, no negative cache, URLs as
    # a comma-separated list.
    dtype: Literal[("auto", *DTYPE_NAMES)] = "auto"
    spec_method: Literal[("auto", *SPEC_METHODS)] = "auto"
    spec_policy: Literal[POLICIES] = "dspark-sla"
    profile_on_start: bool = True
    prefix_cache_blocks: int = Field(default=EngineConfig.prefix_cache_blocks, ge=0)
    sglang_urls: Annotated[list[str], NoDecode] = Field(default_factory=lambda: list(SGLangConfig.urls))
    upstream_urls: Annotated[list[str], NoDecode] = Field(default_factory=lambda: list(UpstreamConfig.urls))
    upstream_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)

    @field_validator("cors_origins", "sglang_urls", "upstream_urls", "upstream_keys", mode="before")
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
        """The :class:`EngineConfig` for the embedded engine: the settings of its fields."""
        return EngineConfig(**{f.name: getattr(self, f.name) for f in fields(EngineConfig)})

    def backend_config(self) -> EngineConfig | SGLangConfig | UpstreamConfig:
        """:class:`EngineConfig` (embedded), :class:`SGLangConfig` (``sglang_<field>``) or
        :class:`UpstreamConfig` (``upstream_<field>``; the :data:`SHARED` ones unprefixed)."""
        if self.backend == "sglang":
            values = {f.name: getattr(self, f.name if f.name in SHARED else f"sglang_{f.name}")
                      for f in fields(SGLangConfig)}
            return SGLangConfig(**values | {"urls": tuple(self.sglang_urls)})
        if self.backend == "openai":
            values = {f.name: getattr(self, f.name if f.name in SHARED else f"upstream_{f.name}")
                      for f in fields(UpstreamConfig)}
            return UpstreamConfig(**values | {"urls": tuple(self.upstream_urls), "keys": tuple(self.upstream_keys)})
        return self.engine_config()
