"""Stored Responses API responses (``store``, ``previous_response_id``, ``GET``/``DELETE
/v1/responses/{id}``): one row per response, scoped to the tenant that created it
(:class:`gateway.db.models.StoredResponse`).

Revision ID: 0004_responses
Revises: 0003_billed_usage
Create Date: 2026-12-10
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_responses"
down_revision = "0003_billed_usage"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant", sa.String(length=128), nullable=False),
        sa.Column("created_at", TS, server_default=sa.func.now(), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("previous_response_id", sa.String(length=64), nullable=True),
        sa.Column("input_items", sa.JSON(), nullable=False),
        sa.Column("output_items", sa.JSON(), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_responses"),
    )
    op.create_index("ix_responses_tenant_created", "responses", ["tenant", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_responses_tenant_created", table_name="responses")
    op.drop_table("responses")
