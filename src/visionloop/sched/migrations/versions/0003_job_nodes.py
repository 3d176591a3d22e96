"""A job across nodes: `jobs.nodes`, how many nodes its one process group spans (1 for every
job before; `resources.nodes` in a job spec, placed by the Ray executor).

Revision ID: 0003
Revises: 0002
Created: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # A plain ADD COLUMN with a default on both backends: no table copy on SQLite.
    op.add_column("jobs", sa.Column("nodes", sa.Integer(), nullable=False, server_default="1"))


def downgrade() -> None:
    bind = op.get_bind()
    if bind.execute(sa.text("SELECT COUNT(*) FROM jobs WHERE nodes > 1")).scalar():
        from visionloop.core.errors import ConfigError

        raise ConfigError(
            "jobs span several nodes; the release before 0003 would run them on one. Cancel and "
            "delete them, or stay on this release."
        )
    # SQLite (3.35+) drops a plain column in place: no batch copy, which would reset the jobs
    # table's AUTOINCREMENT counter and hand a deleted job's id out again.
    op.drop_column("jobs", "nodes")
