"""Records mark constrained requests: ``request_records.constraint`` and ``mask_ms_per_token``;
rollups sum the speculation of constrained requests apart.

* ``request_records.constraint`` (``String(16)``, nullable): ``"json_object"``,
  ``"json_schema"``, ``"tools"`` or NULL (free text);
* ``request_records.mask_ms_per_token`` (``Float``, nullable): mean milliseconds of grammar
  masks (xgrammar bitmask fill and apply) per generated token;
* ``usage_rollups.constrained_spec_rounds``, ``…_drafted``, ``…_accepted``, ``…_emitted``
  (``BigInteger``, not null, default 0): the ``spec_*`` sums of the minute's records with a
  constraint.

Records written before this revision had no constraint column, so they read as free text,
and the rollups' constrained sums start at 0 — which is what a recompute of those minutes
gives (no data migration). Plain ``ALTER TABLE ADD/DROP COLUMN`` on both backends (SQLite
≥ 3.35 drops columns in place).

Revision ID: 0005_record_constraint
Revises: 0004_responses
Create Date: 2026-12-12
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005_record_constraint"
down_revision = "0004_responses"
branch_labels = None
depends_on = None

ROLLUP_COLUMNS = ("constrained_spec_rounds", "constrained_spec_drafted", "constrained_spec_accepted",
                  "constrained_spec_emitted")


def upgrade() -> None:
    op.add_column("request_records", sa.Column("constraint", sa.String(length=16), nullable=True))
    op.add_column("request_records", sa.Column("mask_ms_per_token", sa.Float(), nullable=True))
    for column in ROLLUP_COLUMNS:
        op.add_column("usage_rollups", sa.Column(column, sa.BigInteger(), server_default="0", nullable=False))


def downgrade() -> None:
    for column in reversed(ROLLUP_COLUMNS):
        op.drop_column("usage_rollups", column)
    op.drop_column("request_records", "mask_ms_per_token")
    op.drop_column("request_records", "constraint")
