"""The job a preempted job steps aside for, while it is on its way out (PREEMPTING): the GPUs
it releases stay that job's (`hold_freed_for_job`, sched/owed.py). Stored, not kept in the
control plane's memory, so that a restart during a grace period keeps them for it.

Revision ID: 0008
Revises: 0007
Created: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A plain nullable ADD COLUMN on both backends: no table copy on SQLite. A job already
    # on its way out when the schema is upgraded steps aside for no job in particular (NULL),
    # as an older control plane restarted then would have had it.
    op.add_column("jobs", sa.Column("leaving_for", sa.Integer(), nullable=True))


def downgrade() -> None:
    # Scheduling hints only. SQLite (3.35+) drops a plain column in place: no batch copy,
    # which would reset the jobs table's AUTOINCREMENT counter.
    op.drop_column("jobs", "leaving_for")
