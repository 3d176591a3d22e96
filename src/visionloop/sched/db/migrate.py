"""The job store's schema migrations: Alembic, run from the packaged `sched/migrations/`,
one write transaction under a lock per database, with the queue's revision in its own
version table (VERSION_TABLE) beside Optuna's history."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection, Engine

from visionloop.core.errors import ConfigError
from visionloop.core.migration_lock import MIGRATION_LOCK
from visionloop.sched.db.engine import WRITE_OPTION, make_engine, parse_url

MIGRATIONS_DIR = Path(__file__).parent.parent / "migrations"

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
    """Write a migration for the difference between the models (`db/models.py`) and the newest
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
