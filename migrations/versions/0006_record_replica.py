"""Request records name the replica that served them, and may be ``running`` or ``incomplete``.

* ``request_records.replica`` (``String(128)``, nullable): the gateway process
  (``Settings.replica_id``) that admitted the request; NULL for records written before this
  revision.
* index ``ix_request_records_status_replica`` (``status``, ``replica``): the sweep that marks
  the ``running`` rows of a dead replica ``incomplete``
  (:meth:`gateway.observability.records.RecordWriter.sweep`).

Statuses ``running`` (admitted, not ended yet) and ``incomplete`` (its replica died before the
end) are new values of the existing ``String(16)`` column: no data migration.

Revision ID: 0006_record_replica
Revises: 0005_record_constraint
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_record_replica"
down_revision = "0005_record_constraint"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("request_records", sa.Column("replica", sa.String(length=128), nullable=True))
    op.create_index("ix_request_records_status_replica", "request_records", ["status", "replica"])


def downgrade() -> None:
    op.drop_index("ix_request_records_status_replica", table_name="request_records")
    op.drop_column("request_records", "replica")
