"""Usage bills served requests only: recompute the token sums of the rollups already written.

Up to ``0002`` the rollups' ``prompt_tokens``/``completion_tokens`` summed every record,
refused requests included. From now on they sum served requests only
(:func:`gateway.observability.observe.is_served`; the rule is frozen here as this revision knows it:
``finished``, or ``failed``/``cancelled`` after at least one completion token). No schema
change. Upgrade recomputes, from the records still kept, the rollup rows of every
(minute, tenant) that holds a record that was not served; rollups of minutes whose
records were already pruned (``record_retention_days``) keep their old sums. Downgrade
puts back the all-records sums the same way.

Revision ID: 0003_billed_usage
Revises: 0002_tenancy
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections import defaultdict
from datetime import timedelta

import sqlalchemy as sa
from alembic import op

revision = "0003_billed_usage"
down_revision = "0002_tenancy"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)
BUCKET = ("tenant", "user", "tier", "model")
records = sa.table("request_records", *[sa.column(c) for c in BUCKET], sa.column("status"),
                   sa.column("finished_at", TS), sa.column("prompt_tokens"), sa.column("completion_tokens"))
rollups = sa.table("usage_rollups", sa.column("minute", TS), *[sa.column(c) for c in BUCKET],
                   sa.column("prompt_tokens"), sa.column("completion_tokens"))
NOT_SERVED = sa.or_(records.c.status == "rejected",
                    sa.and_(records.c.status.in_(["failed", "cancelled"]), records.c.completion_tokens == 0))


def _served(status: str, completion_tokens: int) -> bool:
    return status == "finished" or (status in ("failed", "cancelled") and completion_tokens > 0)


def _resum(billed_only: bool) -> None:
    """Rewrite the token sums of the rollup rows of each (minute, tenant) with a
    not-served record, from that minute's records (all of them, or the served ones)."""
    if op.get_context().as_sql:  # offline (``alembic upgrade --sql``): there is no data to read
        return
    conn = op.get_bind()
    touched = {(ts.replace(second=0, microsecond=0), tenant) for tenant, ts in conn.execute(
        sa.select(records.c.tenant, records.c.finished_at).where(NOT_SERVED))}
    for minute, tenant in sorted(touched):
        sums: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
        for r in conn.execute(sa.select(records).where(records.c.tenant == tenant, records.c.finished_at >= minute,
                                                       records.c.finished_at < minute + timedelta(minutes=1))):
            total = sums[(r.user or "", r.tier or "", r.model)]
            if not billed_only or _served(r.status, r.completion_tokens):
                total[0] += r.prompt_tokens
                total[1] += r.completion_tokens
        for group, (prompt, completion) in sums.items():
            bucket = [rollups.c[c] == v for c, v in zip(BUCKET, (tenant, *group))]
            conn.execute(rollups.update().where(rollups.c.minute == minute, *bucket)
                         .values(prompt_tokens=prompt, completion_tokens=completion))


def upgrade() -> None:
    _resum(billed_only=True)


def downgrade() -> None:
    _resum(billed_only=False)
