"""Tenancy: SLA tiers (tenant → tier), key budgets/limits, request records, per-minute rollups.

Seeds one tier named ``default`` with no limits (the tier of tenants without one,
``Settings.default_tier``).

Revision ID: 0002_tenancy
Revises: 0001_initial
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_tenancy"
down_revision = "0001_initial"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    tiers = op.create_table(
        "sla_tiers",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("min_tokens_per_s", sa.Float(), nullable=True),
        sa.Column("max_concurrent", sa.Integer(), nullable=True),
        sa.Column("rpm", sa.Integer(), nullable=True),
        sa.Column("tpm", sa.BigInteger(), nullable=True),
        sa.Column("priority", sa.Integer(), server_default="0", nullable=False),
        sa.Column("max_queue_wait_s", sa.Float(), server_default="10", nullable=False),
        sa.Column("created_at", TS, server_default=sa.func.now(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_sla_tiers"),
        sa.UniqueConstraint("name", name="uq_sla_tiers_name"),
    )
    op.bulk_insert(tiers, [{"id": 1, "name": "default", "priority": 0, "max_queue_wait_s": 10.0}])
    if not _sqlite():  # the explicit id above does not advance the sequence
        op.execute("SELECT setval(pg_get_serial_sequence('sla_tiers', 'id'), 1)")

    # Plain ALTER TABLE only: on SQLite a batch "copy and move" of tenants would drop the
    # old table, and with foreign keys on that cascades to api_keys (every key deleted).
    # So SQLite gets no database-level FK here; crud.tiers.delete_tier clears tier_id itself.
    op.add_column("tenants", sa.Column("tier_id", sa.Integer(), nullable=True))
    if not _sqlite():
        op.create_foreign_key("fk_tenants_tier_id_sla_tiers", "tenants", "sla_tiers", ["tier_id"], ["id"],
                              ondelete="SET NULL")
    op.create_index("ix_tenants_tier_id", "tenants", ["tier_id"])
    op.add_column("api_keys", sa.Column("tokens_used", sa.BigInteger(), server_default="0", nullable=False))
    op.add_column("api_keys", sa.Column("rpm_limit", sa.Integer(), nullable=True))
    op.add_column("api_keys", sa.Column("tpm_limit", sa.BigInteger(), nullable=True))

    op.create_table(
        "request_records",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("key_id", sa.Integer(), nullable=True),
        sa.Column("user", sa.String(length=256), nullable=True),
        sa.Column("tier", sa.String(length=64), nullable=True),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("endpoint", sa.String(length=16), nullable=False),
        sa.Column("stream", sa.Boolean(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("finish_reason", sa.String(length=16), nullable=True),
        sa.Column("error_code", sa.String(length=64), nullable=True),
        sa.Column("error_message", sa.String(length=512), nullable=True),
        sa.Column("queued_at", TS, nullable=False),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("first_token_at", TS, nullable=True),
        sa.Column("finished_at", TS, nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("max_tokens", sa.Integer(), nullable=False),
        sa.Column("ttft_s", sa.Float(), nullable=True),
        sa.Column("admission_wait_s", sa.Float(), nullable=True),
        sa.Column("decode_tokens_per_s", sa.Float(), nullable=True),
        sa.Column("predicted_tokens_per_s", sa.Float(), nullable=True),
        sa.Column("spec_rounds", sa.Integer(), nullable=True),
        sa.Column("spec_drafted", sa.Integer(), nullable=True),
        sa.Column("spec_verified", sa.Integer(), nullable=True),
        sa.Column("spec_accepted", sa.Integer(), nullable=True),
        sa.Column("spec_emitted", sa.Integer(), nullable=True),
        sa.Column("spec_tau", sa.Float(), nullable=True),
        sa.Column("accepted_per_position", sa.JSON(), nullable=True),
        sa.Column("sla_target_tokens_per_s", sa.Float(), nullable=True),
        sa.Column("sla_met", sa.Boolean(), nullable=True),
        sa.ForeignKeyConstraint(["key_id"], ["api_keys.id"], name="fk_request_records_key_id_api_keys",
                                ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name="pk_request_records"),
    )
    op.create_index("ix_request_records_finished_at", "request_records", ["finished_at"])
    op.create_index("ix_request_records_key_id", "request_records", ["key_id"])
    op.create_index("ix_request_records_tenant_finished", "request_records", ["tenant", "finished_at"])
    op.create_index("ix_request_records_tenant_user_finished", "request_records", ["tenant", "user", "finished_at"])
    op.create_index("ix_request_records_tier_finished", "request_records", ["tier", "finished_at"])

    big = sa.BigInteger()
    op.create_table(
        "usage_rollups",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("minute", TS, nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("user", sa.String(length=256), nullable=False),
        sa.Column("tier", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        *[sa.Column(c, sa.Integer(), nullable=False) for c in ("requests", "finished", "failed", "cancelled", "rejected")],
        sa.Column("prompt_tokens", big, nullable=False),
        sa.Column("completion_tokens", big, nullable=False),
        sa.Column("decode_tps_median", sa.Float(), nullable=True),
        sa.Column("decode_tps_samples", sa.Integer(), nullable=False),
        sa.Column("ttft_median_s", sa.Float(), nullable=True),
        sa.Column("sla_target_tokens_per_s", sa.Float(), nullable=True),
        sa.Column("sla_requests", sa.Integer(), nullable=False),
        sa.Column("sla_met", sa.Integer(), nullable=False),
        *[sa.Column(c, big, nullable=False) for c in ("spec_rounds", "spec_drafted", "spec_accepted", "spec_emitted")],
        sa.Column("accepted_per_position", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_usage_rollups"),
        sa.UniqueConstraint("minute", "tenant", "user", "tier", "model", name="uq_usage_rollups_bucket"),
    )
    op.create_index("ix_usage_rollups_minute", "usage_rollups", ["minute"])
    op.create_index("ix_usage_rollups_tenant_minute", "usage_rollups", ["tenant", "minute"])
    op.create_index("ix_usage_rollups_tier_minute", "usage_rollups", ["tier", "minute"])


def downgrade() -> None:
    op.drop_table("usage_rollups")  # its indexes go with it
    op.drop_table("request_records")
    for column in ("tpm_limit", "rpm_limit", "tokens_used"):  # ALTER TABLE DROP COLUMN (SQLite >= 3.35)
        op.drop_column("api_keys", column)
    op.drop_index("ix_tenants_tier_id", table_name="tenants")
    if not _sqlite():
        op.drop_constraint("fk_tenants_tier_id_sla_tiers", "tenants", type_="foreignkey")
    op.drop_column("tenants", "tier_id")
    op.drop_table("sla_tiers")


def _sqlite() -> bool:
    return op.get_bind().dialect.name == "sqlite"
