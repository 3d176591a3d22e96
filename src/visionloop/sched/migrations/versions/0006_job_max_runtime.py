"""A job's time limit: the job spec's `max_runtime` in seconds, which reservations plan with
until the job reports a pace and EASY backfill judges a job by (see sched/reservation.py).
A planning estimate: nothing stops a job at it.

Revision ID: 0006
Revises: 0005
Created: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A plain nullable ADD COLUMN on both backends: no table copy on SQLite. Jobs submitted
    # before it have no limit (NULL), as if none had been given, which is what happened.
    op.add_column("jobs", sa.Column("max_runtime_s", sa.Double(), nullable=True))


def downgrade() -> None:
    # Nothing to refuse over: planning data only (the older schema plans with the default
    # end instead). SQLite (3.35+) drops a plain column in place: no batch copy, which would
    # reset the jobs table's AUTOINCREMENT counter.
    op.drop_column("jobs", "max_runtime_s")
