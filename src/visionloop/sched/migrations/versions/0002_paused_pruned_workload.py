"""Pausing tuning trials: the job states and attempt outcomes "paused" and "pruned", and
`jobs.workload_doc` (what a job runs; NULL: a training job, from its train spec).

The revision is recorded in `visionloop_alembic_version` from this one on (`db.migrate`
moves a release's 0001 out of `alembic_version`, which Optuna's history uses).

SQLite cannot change a CHECK constraint in place: batch mode copies `jobs` and `attempts`
into new tables (`db.migrate` turns foreign keys off for it, or dropping the old `jobs`
would cascade-delete every attempt). The value lists are written out here, not imported
from sched/db: a migration must keep meaning what it meant when it was released.

Revision ID: 0002
Revises: 0001
Created: 2026-12-08
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_STATES = ("queued", "running", "preempting", "cancelling", "succeeded", "failed", "cancelled")
NEW_STATES = (*OLD_STATES, "paused", "pruned")
OLD_OUTCOMES = ("succeeded", "failed", "preempted", "interrupted", "lost", "cancelled")
NEW_OUTCOMES = (*OLD_OUTCOMES, "paused", "pruned")


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def _alter(states: tuple[str, ...], outcomes: tuple[str, ...], *, workload_doc: bool) -> None:
    bind = op.get_bind()
    sqlite = bind.dialect.name == "sqlite"
    # Copying `jobs` on SQLite resets its AUTOINCREMENT counter to the largest id left, which
    # would hand a deleted job's id out again: keep the counter.
    seq = (
        bind.execute(sa.text("SELECT seq FROM sqlite_sequence WHERE name = 'jobs'")).scalar()
        if sqlite
        else None
    )
    # sqlite_autoincrement is not reflected: the copy must be told, or ids lose AUTOINCREMENT.
    with op.batch_alter_table("jobs", table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.drop_constraint(op.f("ck_jobs_state"), type_="check")
        batch.create_check_constraint(op.f("ck_jobs_state"), _one_of("state", states))
        if workload_doc:
            batch.add_column(sa.Column("workload_doc", sa.JSON(), nullable=True))
        else:
            batch.drop_column("workload_doc")
    if seq is not None:
        bind.execute(
            sa.text("UPDATE sqlite_sequence SET seq = MAX(seq, :seq) WHERE name = 'jobs'"), {"seq": seq}
        )
    with op.batch_alter_table("attempts") as batch:
        batch.drop_constraint(op.f("ck_attempts_outcome"), type_="check")
        batch.create_check_constraint(
            op.f("ck_attempts_outcome"), f"outcome IS NULL OR {_one_of('outcome', outcomes)}"
        )


def upgrade() -> None:
    _alter(NEW_STATES, NEW_OUTCOMES, workload_doc=True)


def downgrade() -> None:
    bind = op.get_bind()
    used = bind.execute(
        sa.text(
            # A JSON null (written without none_as_null) means a training job too.
            "SELECT (SELECT count(*) FROM jobs WHERE state IN ('paused', 'pruned') "
            "OR (workload_doc IS NOT NULL AND CAST(workload_doc AS TEXT) != 'null')), "
            "(SELECT count(*) FROM attempts WHERE outcome IN ('paused', 'pruned'))"
        )
    ).one()
    if any(used):
        # Imported here: migrations otherwise depend on nothing of visionloop's that may change.
        from visionloop.core.errors import ConfigError

        raise ConfigError(
            f"cannot go back to schema 0001: {used[0]} job(s) are paused or pruned or run a workload "
            f"other than training, and {used[1]} attempt(s) ended paused or pruned, which 0001 cannot "
            "hold. Delete those jobs (tuning trials) first, or stay on this release; nothing was changed."
        )
    _alter(OLD_STATES, OLD_OUTCOMES, workload_doc=False)
