"""The job store's schema (SQLAlchemy 2 ORM models) and its engines, for SQLite and PostgreSQL.

Only the `sched/store/` package uses these models; everything else sees the store's frozen records.
The schema is created and upgraded by the Alembic migrations in `sched/migrations/` (run by
`migrate`, never by `metadata.create_all`), so a database made by any release can be opened
by a later one. Changing a model here means adding a migration: `new_revision` writes one.
Their revision is kept in `visionloop_alembic_version` (VERSION_TABLE), not Alembic's default
`alembic_version`, which Optuna's RDB storage uses for its own history on the same database
(tune/study.py); `migrate` moves it out of there on a database from a release before 0002.

Times are float seconds since the epoch, the clock the scheduler and the simulator share.

Concurrency model:
- SQLite: WAL journal (readers never block the writer), `busy_timeout`, foreign keys on, and
  every write transaction starts with `BEGIN IMMEDIATE`. Taking the write lock up front is
  what makes concurrent writers queue on the busy timeout instead of failing: with
  SQLite's default deferred BEGIN, two transactions that both read and then write deadlock
  on the lock upgrade and one gets "database is locked" at once, whatever the timeout.
- PostgreSQL: READ COMMITTED with `SELECT ... FOR UPDATE` on the job row for every state
  change, and unique indexes as the last word on races (idempotency keys, GPUs held).

The package: `models` (the tables), `engine` (URLs and engines), `migrate` (Alembic).
"""

from __future__ import annotations

from visionloop.sched.db.engine import SQLITE_BUSY_TIMEOUT_S, WRITE_OPTION, make_engine, parse_url
from visionloop.sched.db.migrate import (
    LEGACY_REVISIONS,
    LEGACY_VERSION_TABLE,
    MIGRATIONS_DIR,
    VERSION_TABLE,
    alembic_config,
    current_revision,
    downgrade,
    head_revision,
    migrate,
    new_revision,
)
from visionloop.sched.db.models import (
    JOB_STATES,
    NAMING_CONVENTION,
    OUTCOMES,
    PRICE_CLASSES,
    SPOT_POLICIES,
    AllocationRow,
    AttemptRow,
    Base,
    CheckpointRow,
    GpuRow,
    JobRow,
    LabellingCostRow,
    TeamRow,
    TokenRow,
    TransitionRow,
)

__all__ = [
    "JOB_STATES",
    "LEGACY_REVISIONS",
    "LEGACY_VERSION_TABLE",
    "MIGRATIONS_DIR",
    "NAMING_CONVENTION",
    "OUTCOMES",
    "PRICE_CLASSES",
    "SPOT_POLICIES",
    "SQLITE_BUSY_TIMEOUT_S",
    "VERSION_TABLE",
    "WRITE_OPTION",
    "AllocationRow",
    "AttemptRow",
    "Base",
    "CheckpointRow",
    "GpuRow",
    "JobRow",
    "LabellingCostRow",
    "TeamRow",
    "TokenRow",
    "TransitionRow",
    "alembic_config",
    "current_revision",
    "downgrade",
    "head_revision",
    "make_engine",
    "migrate",
    "new_revision",
    "parse_url",
]
