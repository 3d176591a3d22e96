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
"""

from __future__ import annotations

import contextlib
import functools
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    CheckConstraint,
    Double,
    ForeignKey,
    Index,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
    inspect,
    text,
)
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from visionloop.core.errors import ConfigError
from visionloop.core.migration_lock import MIGRATION_LOCK

MIGRATIONS_DIR = Path(__file__).with_name("migrations")

# How long a SQLite writer waits for the lock before giving up (seconds). Transactions are
# short (milliseconds); a long wait means another process is stuck holding the lock.
SQLITE_BUSY_TIMEOUT_S = 30.0

# The execution option that marks a connection's next transaction as a write (SQLite only:
# it decides between BEGIN IMMEDIATE and a plain deferred BEGIN for readers).
WRITE_OPTION = "visionloop_write"

# pg_advisory_xact_lock key that serialises concurrent migrations of one PostgreSQL database.
_PG_MIGRATION_LOCK = 0x766C5F6D6967  # "vl_mig"

# Where the queue's migrations record their revision. Not Alembic's default `alembic_version`:
# Optuna's RDB storage, which the tuner opens on the same database, keeps its own Alembic
# history there, and one table cannot hold two histories.
VERSION_TABLE = "visionloop_alembic_version"
# Where releases before revision 0002 recorded it (`migrate` moves it out), and the
# revisions those releases knew.
LEGACY_VERSION_TABLE = "alembic_version"
LEGACY_REVISIONS = ("0001",)

JOB_STATES = (
    "queued",
    "running",
    "preempting",
    "cancelling",
    "paused",  # a tuning trial stopped at a rung through its checkpoint, until promoted (0002)
    "succeeded",
    "failed",
    "cancelled",
    "pruned",  # a tuning trial its study stopped for good at a rung (0002)
)
# Added in 0002, for tuning trials stopped at a rung through a checkpoint (neither preempted
# nor failed): "paused" when the trial may be promoted and resumed, "pruned" when it is done.
OUTCOMES = ("succeeded", "failed", "preempted", "interrupted", "lost", "cancelled", "paused", "pruned")
PRICE_CLASSES = ("owned", "on_demand", "spot")
SPOT_POLICIES = ("never", "allowed", "preferred")

# Names for every constraint and index, so migrations can refer to them on both backends
# (SQLite's batch mode needs them to alter a table).
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {float: Double(), dict[str, Any]: JSON()}  # noqa: RUF012


class TeamRow(Base):
    __tablename__ = "teams"
    __table_args__ = (
        CheckConstraint("nominal_gpus >= 0", name="nominal_gpus"),
        CheckConstraint("borrow_limit >= 0", name="borrow_limit"),
        CheckConstraint("weight > 0", name="weight"),
    )

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    nominal_gpus: Mapped[int]
    borrow_limit: Mapped[int]
    weight: Mapped[float]
    created_at: Mapped[float]
    updated_at: Mapped[float]


class TokenRow(Base):
    """An API token: only its SHA-256 is stored, so a copy of the database grants nothing."""

    __tablename__ = "api_tokens"
    __table_args__ = (CheckConstraint("admin OR team IS NOT NULL", name="owner"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    team: Mapped[str | None] = mapped_column(String(64), ForeignKey("teams.name"))
    admin: Mapped[bool] = mapped_column(Boolean)
    label: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[float]
    revoked_at: Mapped[float | None]


class JobRow(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        # A client that retries a submit with its key gets the same job back, never a second.
        # NULL keys are distinct on both backends, so jobs without a key never collide.
        UniqueConstraint("team", "idempotency_key"),
        Index(None, "state", "submitted_at"),  # the queue: state = 'queued' in FIFO order
        Index(None, "team", "state"),
        Index(None, "shape_key", "state"),  # the runtime history of a shape (sched/history.py)
        CheckConstraint(_one_of("state", JOB_STATES), name="state"),
        CheckConstraint(_one_of("spot", SPOT_POLICIES), name="spot"),
        CheckConstraint("gpus >= 0", name="gpus"),
        # Ids are shown to users: never hand out a deleted job's id again.
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str | None] = mapped_column(String(200))
    team: Mapped[str] = mapped_column(String(64), ForeignKey("teams.name"))
    priority: Mapped[str] = mapped_column(String(64))  # the class's name, as submitted
    priority_rank: Mapped[int]  # its rank when submitted; larger is more important
    spot: Mapped[str] = mapped_column(String(16))
    gpus: Mapped[int]
    # Nodes its one process group spans (a job across nodes: gpus are spread evenly over them).
    nodes: Mapped[int] = mapped_column(default=1, server_default="1")
    cpus: Mapped[float]
    memory_gb: Mapped[float]
    max_restarts: Mapped[int]
    spec_doc: Mapped[dict[str, Any]]  # the document as submitted, verbatim
    train_spec: Mapped[dict[str, Any]]  # the effective, validated train spec
    run_dir: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16))
    state_since: Mapped[float]
    waiting_reason: Mapped[str | None] = mapped_column(Text)
    restarts: Mapped[int] = mapped_column(default=0)  # failures retried
    preemptions: Mapped[int] = mapped_column(default=0)
    attempt: Mapped[int] = mapped_column(default=0)  # the latest attempt's number (0: none yet)
    not_before: Mapped[float] = mapped_column(default=0.0)  # retry back-off
    attained_gpu_s: Mapped[float] = mapped_column(default=0.0)
    last_checkpoint_at: Mapped[float | None]
    last_heartbeat_at: Mapped[float | None]
    submitted_at: Mapped[float]
    updated_at: Mapped[float]
    started_at: Mapped[float | None]  # first attempt's start
    finished_at: Mapped[float | None]
    exit_code: Mapped[int | None]
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    version: Mapped[int] = mapped_column(default=1)  # +1 on every change: an ETag for clients
    # The latest pace the job reported (visionloop.train.progress): step of total at rate
    # steps/s, as of pace_at. Kept across attempts: a requeued job's remaining work.
    pace_step: Mapped[int | None]
    pace_total: Mapped[int | None]
    pace_rate: Mapped[float | None]
    pace_at: Mapped[float | None]
    # The job spec's `max_runtime` in seconds (None: none given): the time limit reservations
    # and EASY backfill plan with (never enforced). A column, not only in spec_doc, because
    # the scheduler's view reads it for every queued job each cycle.
    max_runtime_s: Mapped[float | None]
    # What the job runs (a typed workload's document); None: a training job, from train_spec.
    # none_as_null: None is stored as SQL NULL, not as the JSON value null, so that SQL can
    # tell training jobs apart (`workload_doc IS NULL`).
    workload_doc: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    # Its keys into the runtime history (sched/history.py): the same work (spec) and the same
    # architecture on the same data and GPUs (shape), and its length in epochs or steps.
    # NULL for jobs from before revision 0007: they neither get nor give an estimate.
    spec_key: Mapped[str | None] = mapped_column(String(32))
    shape_key: Mapped[str | None] = mapped_column(String(32))
    run_length: Mapped[int | None]
    # Seconds its attempts held GPUs, set when it ended after running its whole length
    # (succeeded, or a trial paused at its rung): one sample of the history.
    ran_s: Mapped[float | None]


class TransitionRow(Base):
    """One row per state change, written in the same transaction as the change."""

    __tablename__ = "job_transitions"
    __table_args__ = (Index(None, "job_id", "id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    from_state: Mapped[str | None] = mapped_column(String(16))  # None: the submission
    to_state: Mapped[str] = mapped_column(String(16))
    at: Mapped[float]
    reason: Mapped[str] = mapped_column(Text)


class AttemptRow(Base):
    """One run of a job's process: from placement to its exit (or loss)."""

    __tablename__ = "attempts"
    __table_args__ = (
        UniqueConstraint("job_id", "number"),
        # The reconciler's query after a restart: every attempt still open.
        Index(
            "ix_attempts_open",
            "job_id",
            sqlite_where=text("ended_at IS NULL"),
            postgresql_where=text("ended_at IS NULL"),
        ),
        CheckConstraint(f"outcome IS NULL OR {_one_of('outcome', OUTCOMES)}", name="outcome"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    number: Mapped[int]  # 1, 2, ... per job
    executor: Mapped[str] = mapped_column(String(64))
    # What the executor needs to find the process again after a control-plane restart.
    handle: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    started_at: Mapped[float]
    ended_at: Mapped[float | None]
    exit_code: Mapped[int | None]
    outcome: Mapped[str | None] = mapped_column(String(16))


class AllocationRow(Base):
    """One GPU held by one attempt: the cost ledger's raw data."""

    __tablename__ = "allocations"
    __table_args__ = (
        # Never double-booked, even by two schedulers racing: at most one open row per GPU.
        Index(
            "uq_allocations_gpu_held",
            "gpu_id",
            unique=True,
            sqlite_where=text("ended_at IS NULL"),
            postgresql_where=text("ended_at IS NULL"),
        ),
        Index(None, "job_id"),
        Index(None, "attempt_id"),
        Index(None, "started_at"),
        CheckConstraint(_one_of("price_class", PRICE_CLASSES), name="price_class"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    gpu_id: Mapped[str] = mapped_column(String(128))
    node: Mapped[str] = mapped_column(String(128))
    gpu_type: Mapped[str] = mapped_column(String(64))
    price_class: Mapped[str] = mapped_column(String(16))
    started_at: Mapped[float]
    ended_at: Mapped[float | None]


class LabellingCostRow(Base):
    """What labelling the images of one dataset version cost (`visionloop data add
    --cost-per-image`), against the team that paid: the ledger's other kind of spending."""

    __tablename__ = "labelling_costs"
    __table_args__ = (
        # A version is labelled once: recording it again is the same entry, not a second bill.
        UniqueConstraint("dataset_version"),
        Index(None, "team", "recorded_at"),
        CheckConstraint("images >= 0 AND cost >= 0", name="nonnegative"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    team: Mapped[str] = mapped_column(String(64), ForeignKey("teams.name"))  # a bill outlives no team
    dataset_version: Mapped[str] = mapped_column(String(64))
    dataset_path: Mapped[str] = mapped_column(Text)
    parent_version: Mapped[str | None] = mapped_column(String(64))
    images: Mapped[int]
    cost: Mapped[float]
    recorded_at: Mapped[float]
    recorded_by: Mapped[str] = mapped_column(String(128))


class GpuRow(Base):
    """The inventory. Up/down is durable so that a spot interruption survives a restart."""

    __tablename__ = "gpus"
    __table_args__ = (
        Index(None, "node"),
        CheckConstraint(_one_of("price_class", PRICE_CLASSES), name="price_class"),
    )

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    node: Mapped[str] = mapped_column(String(128))
    type: Mapped[str] = mapped_column(String(64))
    price_class: Mapped[str] = mapped_column(String(16))
    up: Mapped[bool] = mapped_column(Boolean)
    down_reason: Mapped[str | None] = mapped_column(Text)
    updated_at: Mapped[float]


class CheckpointRow(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (Index(None, "job_id", "at"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int | None]
    step: Mapped[int]
    at: Mapped[float]


# --------------------------------------------------------------------------- engines

_URL_EXAMPLES = (
    "sqlite:////home/me/.visionloop/state.db or postgresql+psycopg://user:password@db-host:5432/visionloop"
)


def parse_url(url: str) -> URL:
    """The store's database URL, checked: SQLite, or PostgreSQL through psycopg 3 (the driver
    the `[postgres]` extra installs; `postgresql://` and `postgres://` mean it too)."""
    try:
        parsed = make_url(url)
    except ArgumentError as e:
        raise ConfigError(f"{url!r} is not a database URL. Use e.g. {_URL_EXAMPLES}.") from e
    backend = parsed.get_backend_name()
    if backend == "sqlite" and parsed.get_driver_name() == "pysqlite":
        return parsed
    if backend in ("postgresql", "postgres") and parsed.drivername in (
        "postgresql",
        "postgres",
        "postgresql+psycopg",
    ):
        return parsed.set(drivername="postgresql+psycopg")
    raise ConfigError(
        f"the job store supports SQLite and PostgreSQL (with psycopg 3), not {parsed.drivername!r} "
        f"in {parsed.render_as_string(hide_password=True)}. Use e.g. {_URL_EXAMPLES}."
    )


def make_engine(url: URL) -> Engine:
    """An engine with the connection settings the store's guarantees rely on (see the module
    docstring). It connects lazily: `Store.open` turns connection errors into advice."""
    if url.get_backend_name() == "sqlite":
        return _sqlite_engine(url)
    try:
        return create_engine(url, pool_pre_ping=True, connect_args={"connect_timeout": 10})
    except (NoSuchModuleError, ModuleNotFoundError) as e:
        raise ConfigError(
            "a PostgreSQL job store needs the psycopg driver: pip install 'visionloop[postgres]'."
        ) from e


def _sqlite_engine(url: URL) -> Engine:
    if not url.database or url.database == ":memory:" or url.database.startswith("file:"):
        # Each pooled connection would get its own empty database.
        raise ConfigError(
            "the job store needs a SQLite *file*, e.g. sqlite:////home/me/.visionloop/state.db "
            "(four slashes for an absolute path)."
        )
    url = url.set(database=str(Path(url.database).expanduser()))
    folder = Path(str(url.database)).parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create {folder} for the job store: {e}. Choose a writable place.") from e
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy (below) emit BEGIN: the sqlite3 module would emit a deferred one.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
            _enable_wal(cursor)
            # FULL: a committed transition survives a power cut, not only a process crash.
            cursor.execute("PRAGMA synchronous = FULL")
            cursor.execute("PRAGMA foreign_keys = ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        write = conn.get_execution_options().get(WRITE_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def _enable_wal(cursor: Any) -> None:
    """`PRAGMA journal_mode = WAL`, retried while the database is locked.

    SQLite does not call the busy handler for a journal-mode change: while another connection
    holds a write lock on a database not yet in WAL mode (a fresh one, being created by
    another opener), the pragma fails at once with "database is locked", whatever
    busy_timeout says. Twenty stores opened at once on a new file hit this (CI did)."""
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_S
    delay = 0.002
    while True:
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            if e.sqlite_errorcode & 0xFF not in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
                raise
            if time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


# --------------------------------------------------------------------------- migrations


_script_lock = threading.Lock()


@functools.cache
def _script_unlocked() -> Any:
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(MIGRATIONS_DIR))


def _script() -> Any:
    # Loaded once per process: twenty stores opened at once must not each import the
    # migration files.
    with _script_lock:
        return _script_unlocked()


def alembic_config(connection: Connection | None = None) -> Any:
    """An Alembic config for the packaged migrations (no alembic.ini needed). With a
    connection, `env.py` migrates through it, inside the caller's transaction."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    head = _script().get_current_head()
    assert isinstance(head, str), "the packaged migrations have exactly one head"
    return head


def current_revision(conn: Connection) -> str | None:
    """The queue's schema revision, from its own version table (None: none recorded there)."""
    from alembic.runtime.migration import MigrationContext

    rev = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()
    return None if rev is None else str(rev)


def migrate(engine: Engine, shown_url: str) -> None:
    """Bring the database to the newest schema this code knows, creating it if empty.

    Runs in one write transaction (DDL is transactional on both backends), so a crash
    mid-way leaves the old schema intact, and concurrent openers queue behind each other
    (SQLite: BEGIN IMMEDIATE; PostgreSQL: an advisory lock) instead of racing the DDL.
    A database from a release before 0002 has the queue's revision in `alembic_version`:
    it is moved to VERSION_TABLE in that same transaction (`_adopt_legacy_revision`)."""
    from alembic import command

    head = head_revision()
    # The common case, a database already at head, needs no write lock.
    with engine.connect() as conn, conn.begin():
        if current_revision(conn) == head:
            return
    # Alembic is not thread-safe (core/migration_lock.py): one migration at a time per process.
    with MIGRATION_LOCK, engine.connect() as conn, _locked_migration(conn):
        current = current_revision(conn)
        if current is None:
            current = _adopt_legacy_revision(conn, shown_url)
        if current == head:
            return
        if current is not None and current not in _queue_revisions():
            raise ConfigError(
                f"the job store at {shown_url} has schema revision {current}, newer than this "
                f"visionloop knows (its newest is {head}): it was upgraded by a newer release. "
                "Upgrade visionloop (pip install -U visionloop), or point it at another database."
            )
        command.upgrade(alembic_config(conn), "head")


def downgrade(engine: Engine, revision: str) -> None:
    """Take the queue's schema back to `revision` (for a developer, or to go back to an older
    release). Refused (ConfigError) while rows use what the newer schema added. Going back
    to a revision of a release before 0002 also puts the revision back where that release
    reads it: `alembic_version`, in place of Optuna's, as that release kept it."""
    from alembic import command

    with MIGRATION_LOCK, engine.connect() as conn, _locked_migration(conn):
        command.downgrade(alembic_config(conn), revision)
        if revision not in LEGACY_REVISIONS:
            return
        conn.execute(text(f"DROP TABLE {VERSION_TABLE}"))
        if inspect(conn).has_table(LEGACY_VERSION_TABLE):
            conn.execute(text(f"DELETE FROM {LEGACY_VERSION_TABLE}"))
        else:
            conn.execute(
                text(
                    f"CREATE TABLE {LEGACY_VERSION_TABLE} (version_num VARCHAR(32) NOT NULL, "
                    f"CONSTRAINT {LEGACY_VERSION_TABLE}_pkc PRIMARY KEY (version_num))"
                )
            )
        conn.execute(
            text(f"INSERT INTO {LEGACY_VERSION_TABLE} (version_num) VALUES (:rev)"), {"rev": revision}
        )


@contextlib.contextmanager
def _locked_migration(conn: Connection) -> Iterator[None]:
    """One write transaction that holds the database's migration lock, committed on success.

    SQLite: foreign keys are off for it. Batch mode alters a table by copying it and dropping
    the original, and with foreign keys on, dropping `jobs` deletes its rows first, and with
    them (ON DELETE CASCADE) every attempt, allocation and transition. The pragma is a no-op
    inside a transaction, so it is set before BEGIN and the keys are checked before COMMIT."""
    sqlite = conn.dialect.name == "sqlite"
    if sqlite:
        _sqlite_pragma(conn, "foreign_keys = OFF")  # outside any BEGIN
    try:
        conn.execution_options(**{WRITE_OPTION: True})
        with conn.begin():
            if not sqlite:
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK})
            yield
            if sqlite:
                broken = conn.exec_driver_sql("PRAGMA foreign_key_check").first()
                if broken is not None:
                    raise ConfigError(
                        f"the migration left a row of {broken[0]} pointing at a missing row of {broken[2]}; "
                        "nothing was changed. Report this as a bug, with the revision being migrated."
                    )
    finally:
        if sqlite:
            _sqlite_pragma(conn, "foreign_keys = ON")


def _sqlite_pragma(conn: Connection, pragma: str) -> None:
    # On the sqlite3 connection itself: through SQLAlchemy, any statement would BEGIN first.
    driver = conn.connection.driver_connection
    assert driver is not None, "a connected Connection has its sqlite3 connection"
    driver.execute(f"PRAGMA {pragma}")


def _queue_revisions() -> set[str]:
    return {rev.revision for rev in _script().walk_revisions()}


def _adopt_legacy_revision(conn: Connection, shown_url: str) -> str | None:
    """Move the queue's revision out of `alembic_version`, where releases before 0002 kept it
    (shared with Optuna's history), into VERSION_TABLE, and return it; None if not there.

    Only a revision of the queue's own migrations moves; Optuna's is never touched. The
    emptied `alembic_version` is dropped, unless Optuna's tables are here: then it gets the
    revision Optuna would have stamped itself on a database of its own (`_stamp_optuna`)."""
    from alembic.runtime.migration import MigrationContext

    inspector = inspect(conn)
    if not inspector.has_table(LEGACY_VERSION_TABLE):
        revision = None
    else:
        rows = conn.execute(text(f"SELECT version_num FROM {LEGACY_VERSION_TABLE}")).scalars().all()
        ours = [str(rev) for rev in rows if rev in _queue_revisions()]
        revision = ours[0] if len(ours) == 1 else None
    if revision is None:
        if inspector.has_table("jobs"):  # a queue's tables with no revision anywhere: don't guess
            raise ConfigError(
                f"the job store at {shown_url} has the queue's tables but no schema revision in "
                f"{VERSION_TABLE} or {LEGACY_VERSION_TABLE}, so it cannot be upgraded safely. Restore "
                "the database from a backup, or point visionloop at another database."
            )
        return None
    MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).stamp(_script(), revision)
    conn.execute(text(f"DELETE FROM {LEGACY_VERSION_TABLE} WHERE version_num = :rev"), {"rev": revision})
    if conn.execute(text(f"SELECT count(*) FROM {LEGACY_VERSION_TABLE}")).scalar_one() == 0:
        if inspector.has_table("version_info") and inspector.has_table("trials"):
            _stamp_optuna(conn)
        else:
            conn.execute(text(f"DROP TABLE {LEGACY_VERSION_TABLE}"))
    return revision


def _stamp_optuna(conn: Connection) -> None:
    """Record Optuna's own revision in `alembic_version`, as Optuna does when it finds none
    (`_VersionManager._init_alembic`), so `optuna storage upgrade` works on this database.

    Optuna's tables here were made by `create_all` of the Optuna that wrote `version_info`:
    when that is this Optuna's schema version they are at its Alembic head. Otherwise which
    revision they are at is unknown, and the table stays empty: Optuna stamps its base when it
    next opens them (its own rule for a schema older than its Alembic history)."""
    from alembic.script import ScriptDirectory
    from optuna.storages._rdb import models

    row = conn.execute(text("SELECT schema_version FROM version_info")).first()
    if row is None or int(row[0]) != models.SCHEMA_VERSION:
        return
    optuna_head = ScriptDirectory(str(Path(models.__file__).with_name("alembic"))).get_current_head()
    conn.execute(
        text(f"INSERT INTO {LEGACY_VERSION_TABLE} (version_num) VALUES (:rev)"), {"rev": optuna_head}
    )


def new_revision(message: str) -> None:
    """Write a migration for the difference between the models above and the newest
    migration (autogenerate against a scratch SQLite database), for a developer to review:

        python -c 'from visionloop.sched.db import new_revision; new_revision("add x to jobs")'
    """
    import tempfile

    from alembic import command

    with tempfile.TemporaryDirectory() as tmp:
        engine = make_engine(parse_url(f"sqlite:///{tmp}/scratch.db"))
        try:
            migrate(engine, "a scratch database")
            with engine.begin() as conn:
                rev_id = f"{int(head_revision()) + 1:04d}"  # revisions are numbered in order
                command.revision(alembic_config(conn), message=message, autogenerate=True, rev_id=rev_id)
        finally:
            engine.dispose()
