"""A job's keys into the runtime history (sched/history.py), and its run time once it ran its
whole length: reservations plan a job without a reported pace or a time limit with the
runs of the same spec or architecture before it, rather than the conservative default.

Revision ID: 0007
Revises: 0006
Created: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS: tuple[tuple[str, sa.types.TypeEngine[Any]], ...] = (
    ("spec_key", sa.String(length=32)),
    ("shape_key", sa.String(length=32)),
    ("run_length", sa.Integer()),
    ("ran_s", sa.Double()),
)


def upgrade() -> None:
    # Plain nullable ADD COLUMNs on both backends: no table copy on SQLite. Jobs from before
    # have no keys (NULL): they neither get an estimate nor give one. Computing keys for them
    # here would freeze today's key function into the migration.
    for name, kind in COLUMNS:
        op.add_column("jobs", sa.Column(name, kind, nullable=True))
    op.create_index(op.f("ix_jobs_shape_key_state"), "jobs", ["shape_key", "state"], unique=False)


def downgrade() -> None:
    # Planning data only: nothing to refuse over. SQLite (3.35+) drops a plain column in
    # place: no batch copy, which would reset the jobs table's AUTOINCREMENT counter.
    op.drop_index(op.f("ix_jobs_shape_key_state"), table_name="jobs")
    for name, _ in reversed(COLUMNS):
        op.drop_column("jobs", name)
