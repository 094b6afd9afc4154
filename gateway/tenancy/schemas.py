"""Admin and usage API bodies (tiers, tenants, keys, request records). Units: tokens/s,
requests/min, tokens/min, seconds; ``null`` limits mean unlimited.

Tenant and tier names go through the one name check (:func:`gateway.core.text.name_problem`):
:data:`Name` where a name is created (new tier, tenant, or key of a new tenant),
:data:`NameRef` where it looks up an existing row; user labels are :data:`Label`."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from gateway.core.text import Label, Name, NameRef


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Out(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class TierLimits(_In):
    min_tokens_per_s: float | None = Field(None, gt=0, description="decode tokens/s promised per user")
    max_concurrent: int | None = Field(None, gt=0, description="requests in the engine per tenant")
    rpm: int | None = Field(None, gt=0, description="requests per minute per tenant")
    tpm: int | None = Field(None, gt=0, description="tokens (prompt + max_tokens) per minute per tenant")
    priority: int | None = Field(None, description="larger = admitted first, protected by SLA admission")
    max_queue_wait_s: float | None = Field(None, ge=0, description="seconds a request may wait before 429")


class TierCreate(TierLimits):
    name: Name


class TierOut(_Out):
    name: str
    min_tokens_per_s: float | None
    max_concurrent: int | None
    rpm: int | None
    tpm: int | None
    priority: int
    max_queue_wait_s: float
    created_at: datetime


class TenantCreate(_In):
    name: Name
    tier: NameRef | None = None


class TenantPatch(_In):
    tier: NameRef | None = Field(description="tier name; null → the default tier")


class TenantOut(BaseModel):
    name: str
    tier: str | None
    effective_tier: str
    created_at: datetime


class KeyCreate(_In):
    tenant: Name = Field(description="created when it does not exist yet")
    user: Label | None = Field(None, description="user label stored with the key")
    expires_at: datetime | None = None
    token_budget: int | None = Field(None, gt=0, description="total tokens (prompt + completion) allowed")
    rpm_limit: int | None = Field(None, gt=0, description="requests per minute for this key")
    tpm_limit: int | None = Field(None, gt=0, description="tokens per minute for this key")


class KeyPatch(_In):
    user: Label | None = None
    expires_at: datetime | None = None
    token_budget: int | None = Field(None, gt=0)
    rpm_limit: int | None = Field(None, gt=0)
    tpm_limit: int | None = Field(None, gt=0)


class KeyOut(BaseModel):
    id: int
    prefix: str
    tenant: str
    user: str | None
    status: str
    created_at: datetime
    last_used_at: datetime | None
    expires_at: datetime | None
    revoked_at: datetime | None
    token_budget: int | None
    tokens_used: int
    rpm_limit: int | None
    tpm_limit: int | None


class KeyCreated(KeyOut):
    key: str = Field(description="the plaintext key; shown only in this response")


class RecordOut(_Out):
    id: str
    tenant: str
    key_id: int | None
    user: str | None
    tier: str | None
    model: str
    endpoint: str
    stream: bool
    status: str
    finish_reason: str | None
    error_code: str | None
    error_message: str | None
    queued_at: datetime
    started_at: datetime | None
    first_token_at: datetime | None
    finished_at: datetime
    prompt_tokens: int
    completion_tokens: int
    max_tokens: int
    ttft_s: float | None
    admission_wait_s: float | None
    decode_tokens_per_s: float | None
    predicted_tokens_per_s: float | None
    spec_rounds: int | None
    spec_drafted: int | None
    spec_verified: int | None
    spec_accepted: int | None
    spec_emitted: int | None
    spec_tau: float | None
    accepted_per_position: list[int] | None
    sla_target_tokens_per_s: float | None
    sla_met: bool | None
    constraint: str | None
    mask_ms_per_token: float | None
    replica: str | None = None  # the gateway process that served it (Settings.replica_id)


class RecordPage(BaseModel):
    object: str = "list"
    data: list[RecordOut]
    has_more: bool
    next_cursor: str | None
