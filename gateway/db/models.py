"""SQLAlchemy 2 typed ORM models. The schema itself is created by the Alembic
revisions in ``migrations/versions`` (``0001_initial``, ``0002_tenancy``; ``0003_billed_usage``
only recomputes rollup token sums; ``0004_responses``: stored Responses API responses;
``0005_record_constraint`` adds the records' constraint and grammar-mask time and the rollups'
constrained speculation sums), never by ``create_all``.

Tenancy (``0002``): every tenant has an optional :class:`SlaTier` (none → the tier
named by ``Settings.default_tier``); every served request leaves one
:class:`RequestRecord`; :class:`UsageRollup` holds per-minute aggregates per
(tenant, user, tier, model) for charts.
"""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import (JSON, BigInteger, Boolean, DateTime, Float, ForeignKey, Index, Integer, MetaData, String,
                        TypeDecorator, UniqueConstraint, func)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_name)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC datetimes on every backend (SQLite stores naive text:
    values are converted to UTC on the way in and tagged UTC on the way out)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(timezone.utc)
            if dialect.name == "sqlite":
                value = value.replace(tzinfo=None)
        return value

    def process_result_value(self, value, dialect):
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, server_default=func.now())
    tier_id: Mapped[int | None] = mapped_column(ForeignKey("sla_tiers.id", ondelete="SET NULL"), index=True)

    keys: Mapped[list[ApiKey]] = relationship(back_populates="tenant", passive_deletes=True)
    tier: Mapped[SlaTier | None] = relationship(lazy="joined")


class SlaTier(Base):
    """What a tenant is promised and allowed. ``None`` limits mean unlimited.

    Attributes:
        min_tokens_per_s: decode speed promised to each user (tokens/s; the median of
            the user's per-request decode tok/s, :func:`gateway.observability.stats.user_tokens_per_s`).
        max_concurrent: requests of one tenant in the engine at once.
        rpm, tpm: requests per minute and tokens per minute per tenant.
        priority: larger is more important (admission order, runtime scheduling).
        max_queue_wait_s: longest a request may wait for admission before 429 (seconds).
    """

    __tablename__ = "sla_tiers"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    min_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    max_concurrent: Mapped[int | None] = mapped_column(Integer)
    rpm: Mapped[int | None] = mapped_column(Integer)
    tpm: Mapped[int | None] = mapped_column(BigInteger)
    priority: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    max_queue_wait_s: Mapped[float] = mapped_column(Float, default=10.0, server_default="10")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, server_default=func.now())


class ApiKey(Base):
    """An API key, stored as its SHA-256 digest (see :mod:`gateway.core.security`)."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(primary_key=True)
    digest: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    prefix: Mapped[str] = mapped_column(String(16), index=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    user_label: Mapped[str | None] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, server_default=func.now())
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    token_budget: Mapped[int | None] = mapped_column(BigInteger)
    tokens_used: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    rpm_limit: Mapped[int | None] = mapped_column(Integer)
    tpm_limit: Mapped[int | None] = mapped_column(BigInteger)

    tenant: Mapped[Tenant] = relationship(back_populates="keys", lazy="joined")

    def status(self, now: datetime | None = None) -> str:
        """``"active"``, ``"revoked"`` or ``"expired"``."""
        now = now or utcnow()
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= now:
            return "expired"
        return "active"


class RequestRecord(Base):
    """One row per request the gateway accepted for generation or refused at admission
    (status ``finished``/``failed``/``cancelled``/``rejected``). Written in batches by
    :class:`gateway.observability.records.RecordWriter`; pruned after ``record_retention_days``.
    An admitted request is first written ``running`` (``finished_at`` = ``queued_at`` until it
    ends) and updated in place when it ends; if its ``replica`` dies first, a sweep marks it
    ``incomplete`` (error code ``replica_lost``). Rollups count only the four final statuses.

    Times are UTC; durations in seconds; speeds in tokens/s (decode tok/s is
    :func:`runtime.interface.decode_tokens_per_s`). ``sla_met`` is None when the request
    had no target or no measurable decode speed.

    ``constraint``: what the request constrained its output to — ``"json_object"``,
    ``"json_schema"``, ``"tools"`` or ``None`` (free text;
    :func:`gateway.openai.translate.constraint_kind`). ``mask_ms_per_token``: the mean
    milliseconds the engine spent computing and applying the request's grammar masks per
    generated token (``Finished.grammar_mask_s`` / completion tokens); ``None`` for free text,
    requests without a token and backends that do not measure it (SGLang).
    """

    __tablename__ = "request_records"
    __table_args__ = (
        Index("ix_request_records_tenant_finished", "tenant", "finished_at"),
        Index("ix_request_records_tenant_user_finished", "tenant", "user", "finished_at"),
        Index("ix_request_records_tier_finished", "tier", "finished_at"),
        Index("ix_request_records_status_replica", "status", "replica"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128))
    key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"), index=True)
    user: Mapped[str | None] = mapped_column(String(256))
    tier: Mapped[str | None] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(256))
    endpoint: Mapped[str] = mapped_column(String(16))
    stream: Mapped[bool] = mapped_column(Boolean)
    status: Mapped[str] = mapped_column(String(16))
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(String(512))
    queued_at: Mapped[datetime] = mapped_column(UTCDateTime())
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    first_token_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    max_tokens: Mapped[int] = mapped_column(Integer, default=0)
    ttft_s: Mapped[float | None] = mapped_column(Float)
    admission_wait_s: Mapped[float | None] = mapped_column(Float)
    decode_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    predicted_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    spec_rounds: Mapped[int | None] = mapped_column(Integer)
    spec_drafted: Mapped[int | None] = mapped_column(Integer)
    spec_verified: Mapped[int | None] = mapped_column(Integer)
    spec_accepted: Mapped[int | None] = mapped_column(Integer)
    spec_emitted: Mapped[int | None] = mapped_column(Integer)
    spec_tau: Mapped[float | None] = mapped_column(Float)
    accepted_per_position: Mapped[list | None] = mapped_column(JSON)
    sla_target_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    sla_met: Mapped[bool | None] = mapped_column(Boolean)
    constraint: Mapped[str | None] = mapped_column(String(16))
    mask_ms_per_token: Mapped[float | None] = mapped_column(Float)
    replica: Mapped[str | None] = mapped_column(String(128))


class UsageRollup(Base):
    """Per-minute aggregate of the :class:`RequestRecord` rows that ended in ``minute``
    for one (tenant, user, tier, model); ``""`` stands for no user / no tier.

    Recomputed from the records (idempotent, so replicas agree). ``decode_tps_median``
    is the user's tok/s in that minute by the one definition (median of per-request
    decode tok/s); ``sla_*`` count requests with a target and a measured speed.
    ``requests`` and the per-status counts cover every record; ``prompt_tokens`` and
    ``completion_tokens`` are billed tokens, of served requests only
    (:func:`gateway.observability.observe.is_served`). ``constrained_spec_*`` are the
    ``spec_*`` sums of the records with a ``constraint`` (JSON or tools: grammar-masked
    verification); the plain requests' are the difference.
    """

    __tablename__ = "usage_rollups"
    __table_args__ = (
        UniqueConstraint("minute", "tenant", "user", "tier", "model", name="uq_usage_rollups_bucket"),
        Index("ix_usage_rollups_tenant_minute", "tenant", "minute"),
        Index("ix_usage_rollups_tier_minute", "tier", "minute"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    minute: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    tenant: Mapped[str] = mapped_column(String(128))
    user: Mapped[str] = mapped_column(String(256), default="")
    tier: Mapped[str] = mapped_column(String(64), default="")
    model: Mapped[str] = mapped_column(String(256))
    requests: Mapped[int] = mapped_column(Integer, default=0)
    finished: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    cancelled: Mapped[int] = mapped_column(Integer, default=0)
    rejected: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    decode_tps_median: Mapped[float | None] = mapped_column(Float)
    decode_tps_samples: Mapped[int] = mapped_column(Integer, default=0)
    ttft_median_s: Mapped[float | None] = mapped_column(Float)
    sla_target_tokens_per_s: Mapped[float | None] = mapped_column(Float)
    sla_requests: Mapped[int] = mapped_column(Integer, default=0)
    sla_met: Mapped[int] = mapped_column(Integer, default=0)
    spec_rounds: Mapped[int] = mapped_column(BigInteger, default=0)
    spec_drafted: Mapped[int] = mapped_column(BigInteger, default=0)
    spec_accepted: Mapped[int] = mapped_column(BigInteger, default=0)
    spec_emitted: Mapped[int] = mapped_column(BigInteger, default=0)
    accepted_per_position: Mapped[list | None] = mapped_column(JSON)
    constrained_spec_rounds: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    constrained_spec_drafted: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    constrained_spec_accepted: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    constrained_spec_emitted: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class StoredResponse(Base):
    """A Responses API response stored for ``previous_response_id`` and ``GET``/``DELETE
    /v1/responses/{id}`` (``store``, default true; :mod:`gateway.crud.responses`).

    Attributes:
        id: the response id (``resp_…``, also its request record's id).
        tenant: the tenant whose key created it; only that tenant can read, continue or
            delete it (others get 404).
        input_items: the whole conversation the model was given, normalised
            (:func:`gateway.openai.responses_input.conversation_items`: the continued
            response's conversation and output, then this request's input; instructions
            are not part of it).
        output_items: the response's ``output``.
        body: the rest of the response object, as it was returned.
    """

    __tablename__ = "responses"
    __table_args__ = (Index("ix_responses_tenant_created", "tenant", "created_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow, server_default=func.now())
    model: Mapped[str] = mapped_column(String(256))
    status: Mapped[str] = mapped_column(String(16))
    previous_response_id: Mapped[str | None] = mapped_column(String(64))
    input_items: Mapped[list] = mapped_column(JSON)
    output_items: Mapped[list] = mapped_column(JSON)
    body: Mapped[dict] = mapped_column(JSON)
