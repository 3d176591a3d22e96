"""Engines for the job store: its URL checked, and the connection settings its guarantees
rely on (SQLite: WAL, busy timeout, BEGIN IMMEDIATE for writes; PostgreSQL: psycopg 3).
See the package docstring for the concurrency model."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from visionloop.core.errors import ConfigError

# How long a SQLite writer waits for the lock before giving up (seconds). Transactions are
# short (milliseconds); a long wait means another process is stuck holding the lock.
SQLITE_BUSY_TIMEOUT_S = 30.0

# The execution option that marks a connection's next transaction as a write (SQLite only:
# it decides between BEGIN IMMEDIATE and a plain deferred BEGIN for readers).
WRITE_OPTION = "visionloop_write"

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
