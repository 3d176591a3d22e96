"""The labelling ledger: `labelling_costs`, what labelling the images of one dataset version
cost (`visionloop data add --cost-per-image`), against the team that paid and that version.

Revision ID: 0004
Revises: 0003
Created: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "labelling_costs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("team", sa.String(length=64), nullable=False),
        sa.Column("dataset_version", sa.String(length=64), nullable=False),
        sa.Column("dataset_path", sa.Text(), nullable=False),
        sa.Column("parent_version", sa.String(length=64), nullable=True),
        sa.Column("images", sa.Integer(), nullable=False),
        sa.Column("cost", sa.Double(), nullable=False),
        sa.Column("recorded_at", sa.Double(), nullable=False),
        sa.Column("recorded_by", sa.String(length=128), nullable=False),
        sa.CheckConstraint("images >= 0 AND cost >= 0", name=op.f("ck_labelling_costs_nonnegative")),
        sa.ForeignKeyConstraint(["team"], ["teams.name"], name=op.f("fk_labelling_costs_team_teams")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_labelling_costs")),
        # A version is labelled once: recording it again is the same entry, not a second bill.
        sa.UniqueConstraint("dataset_version", name=op.f("uq_labelling_costs_dataset_version")),
    )
    op.create_index(
        op.f("ix_labelling_costs_team_recorded_at"), "labelling_costs", ["team", "recorded_at"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_labelling_costs_team_recorded_at"), table_name="labelling_costs")
    op.drop_table("labelling_costs")
