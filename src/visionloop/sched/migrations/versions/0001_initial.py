"""The job store's first schema: teams, API tokens, jobs and their transitions, attempts
with their GPU allocations (the cost ledger), the GPU inventory, and checkpoints.

Revision ID: 0001
Revises: (none)
Created: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "gpus",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("node", sa.String(length=128), nullable=False),
        sa.Column("type", sa.String(length=64), nullable=False),
        sa.Column("price_class", sa.String(length=16), nullable=False),
        sa.Column("up", sa.Boolean(), nullable=False),
        sa.Column("down_reason", sa.Text(), nullable=True),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.CheckConstraint("price_class IN ('owned', 'on_demand', 'spot')", name=op.f("ck_gpus_price_class")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gpus")),
    )
    op.create_index(op.f("ix_gpus_node"), "gpus", ["node"], unique=False)

    op.create_table(
        "teams",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("nominal_gpus", sa.Integer(), nullable=False),
        sa.Column("borrow_limit", sa.Integer(), nullable=False),
        sa.Column("weight", sa.Double(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.CheckConstraint("borrow_limit >= 0", name=op.f("ck_teams_borrow_limit")),
        sa.CheckConstraint("nominal_gpus >= 0", name=op.f("ck_teams_nominal_gpus")),
        sa.CheckConstraint("weight > 0", name=op.f("ck_teams_weight")),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_teams")),
    )
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("team", sa.String(length=64), nullable=True),
        sa.Column("admin", sa.Boolean(), nullable=False),
        sa.Column("label", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("revoked_at", sa.Double(), nullable=True),
        sa.CheckConstraint("admin OR team IS NOT NULL", name=op.f("ck_api_tokens_owner")),
        sa.ForeignKeyConstraint(["team"], ["teams.name"], name=op.f("fk_api_tokens_team_teams")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_tokens")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_api_tokens_token_hash")),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=True),
        sa.Column("team", sa.String(length=64), nullable=False),
        sa.Column("priority", sa.String(length=64), nullable=False),
        sa.Column("priority_rank", sa.Integer(), nullable=False),
        sa.Column("spot", sa.String(length=16), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("cpus", sa.Double(), nullable=False),
        sa.Column("memory_gb", sa.Double(), nullable=False),
        sa.Column("max_restarts", sa.Integer(), nullable=False),
        sa.Column("spec_doc", sa.JSON(), nullable=False),
        sa.Column("train_spec", sa.JSON(), nullable=False),
        sa.Column("run_dir", sa.Text(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("state_since", sa.Double(), nullable=False),
        sa.Column("waiting_reason", sa.Text(), nullable=True),
        sa.Column("restarts", sa.Integer(), nullable=False),
        sa.Column("preemptions", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("not_before", sa.Double(), nullable=False),
        sa.Column("attained_gpu_s", sa.Double(), nullable=False),
        sa.Column("last_checkpoint_at", sa.Double(), nullable=True),
        sa.Column("last_heartbeat_at", sa.Double(), nullable=True),
        sa.Column("submitted_at", sa.Double(), nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.Column("started_at", sa.Double(), nullable=True),
        sa.Column("finished_at", sa.Double(), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("idempotency_key", sa.String(length=200), nullable=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.CheckConstraint("spot IN ('never', 'allowed', 'preferred')", name=op.f("ck_jobs_spot")),
        sa.CheckConstraint(
            "state IN ('queued', 'running', 'preempting', 'cancelling', 'succeeded', 'failed', 'cancelled')",
            name=op.f("ck_jobs_state"),
        ),
        sa.CheckConstraint("gpus >= 0", name=op.f("ck_jobs_gpus")),
        sa.ForeignKeyConstraint(["team"], ["teams.name"], name=op.f("fk_jobs_team_teams")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
        sa.UniqueConstraint("team", "idempotency_key", name=op.f("uq_jobs_team_idempotency_key")),
        sqlite_autoincrement=True,
    )
    op.create_index(op.f("ix_jobs_state_submitted_at"), "jobs", ["state", "submitted_at"], unique=False)
    op.create_index(op.f("ix_jobs_team_state"), "jobs", ["team", "state"], unique=False)

    op.create_table(
        "attempts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("executor", sa.String(length=64), nullable=False),
        sa.Column("handle", sa.JSON(), nullable=True),
        sa.Column("started_at", sa.Double(), nullable=False),
        sa.Column("ended_at", sa.Double(), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("outcome", sa.String(length=16), nullable=True),
        sa.CheckConstraint(
            "outcome IS NULL OR "
            "outcome IN ('succeeded', 'failed', 'preempted', 'interrupted', 'lost', 'cancelled')",
            name=op.f("ck_attempts_outcome"),
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_attempts_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_attempts")),
        sa.UniqueConstraint("job_id", "number", name=op.f("uq_attempts_job_id_number")),
    )
    op.create_index(
        "ix_attempts_open",
        "attempts",
        ["job_id"],
        unique=False,
        sqlite_where=sa.text("ended_at IS NULL"),
        postgresql_where=sa.text("ended_at IS NULL"),
    )

    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=True),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("at", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_checkpoints_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
    )
    op.create_index(op.f("ix_checkpoints_job_id_at"), "checkpoints", ["job_id", "at"], unique=False)

    op.create_table(
        "job_transitions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("from_state", sa.String(length=16), nullable=True),
        sa.Column("to_state", sa.String(length=16), nullable=False),
        sa.Column("at", sa.Double(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_job_transitions_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_job_transitions")),
    )
    op.create_index(op.f("ix_job_transitions_job_id_id"), "job_transitions", ["job_id", "id"], unique=False)

    op.create_table(
        "allocations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("attempt_id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("gpu_id", sa.String(length=128), nullable=False),
        sa.Column("node", sa.String(length=128), nullable=False),
        sa.Column("gpu_type", sa.String(length=64), nullable=False),
        sa.Column("price_class", sa.String(length=16), nullable=False),
        sa.Column("started_at", sa.Double(), nullable=False),
        sa.Column("ended_at", sa.Double(), nullable=True),
        sa.CheckConstraint(
            "price_class IN ('owned', 'on_demand', 'spot')", name=op.f("ck_allocations_price_class")
        ),
        sa.ForeignKeyConstraint(
            ["attempt_id"],
            ["attempts.id"],
            name=op.f("fk_allocations_attempt_id_attempts"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_allocations_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_allocations")),
    )
    op.create_index(op.f("ix_allocations_attempt_id"), "allocations", ["attempt_id"], unique=False)
    op.create_index(op.f("ix_allocations_job_id"), "allocations", ["job_id"], unique=False)
    op.create_index(op.f("ix_allocations_started_at"), "allocations", ["started_at"], unique=False)
    op.create_index(
        "uq_allocations_gpu_held",
        "allocations",
        ["gpu_id"],
        unique=True,
        sqlite_where=sa.text("ended_at IS NULL"),
        postgresql_where=sa.text("ended_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index(
        "uq_allocations_gpu_held",
        table_name="allocations",
        sqlite_where=sa.text("ended_at IS NULL"),
        postgresql_where=sa.text("ended_at IS NULL"),
    )
    op.drop_index(op.f("ix_allocations_started_at"), table_name="allocations")
    op.drop_index(op.f("ix_allocations_job_id"), table_name="allocations")
    op.drop_index(op.f("ix_allocations_attempt_id"), table_name="allocations")

    op.drop_table("allocations")
    op.drop_index(op.f("ix_job_transitions_job_id_id"), table_name="job_transitions")

    op.drop_table("job_transitions")
    op.drop_index(op.f("ix_checkpoints_job_id_at"), table_name="checkpoints")

    op.drop_table("checkpoints")
    op.drop_index(
        "ix_attempts_open",
        table_name="attempts",
        sqlite_where=sa.text("ended_at IS NULL"),
        postgresql_where=sa.text("ended_at IS NULL"),
    )

    op.drop_table("attempts")
    op.drop_index(op.f("ix_jobs_team_state"), table_name="jobs")
    op.drop_index(op.f("ix_jobs_state_submitted_at"), table_name="jobs")

    op.drop_table("jobs")
    op.drop_table("api_tokens")
    op.drop_table("teams")
    op.drop_index(op.f("ix_gpus_node"), table_name="gpus")

    op.drop_table("gpus")
