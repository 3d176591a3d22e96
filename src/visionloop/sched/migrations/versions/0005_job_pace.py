"""A job's pace: the step of total and the steps per second its trainer last reported
(visionloop.train.progress), from which `jobs list` and `jobs show` give a running job's
expected end, and reservations will.

Revision ID: 0005
Revises: 0004
Created: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS: tuple[tuple[str, sa.types.TypeEngine[Any]], ...] = (
    ("pace_step", sa.Integer()),
    ("pace_total", sa.Integer()),
    ("pace_rate", sa.Double()),
    ("pace_at", sa.Double()),
)


def upgrade() -> None:
    # Plain nullable ADD COLUMNs on both backends: no table copy on SQLite.
    for name, kind in COLUMNS:
        op.add_column("jobs", sa.Column(name, kind, nullable=True))


def downgrade() -> None:
    # Advisory data only, so nothing to refuse over. SQLite (3.35+) drops a plain column in
    # place: no batch copy, which would reset the jobs table's AUTOINCREMENT counter.
    for name, _ in reversed(COLUMNS):
        op.drop_column("jobs", name)
