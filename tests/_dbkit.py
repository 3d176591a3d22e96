"""Real databases for tests: a fresh SQLite file, or a fresh PostgreSQL database, per test.

PostgreSQL comes from VISIONLOOP_TEST_PG_URL (a role allowed to CREATE DATABASE); without
it, `.ci/postgres.sh` is run once to install (if missing) and start a local test server. If
PostgreSQL still cannot be had, its tests FAIL under CI (CI=true), saying how to provide
one, and skip elsewhere with the same explanation.

Use it from a test module:

    @pytest.fixture(params=BACKENDS)
    def db_url(request, tmp_path):
        with fresh_database(request.param, tmp_path) as url:
            yield url
"""

from __future__ import annotations

import functools
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ("sqlite", "postgresql")
DB_PREFIX = "vl_t_"

HOW_TO_PROVIDE = (
    "Provide a server: `bash .ci/postgres.sh` installs (apt-get, as root) and starts a local test "
    "server and prints its URL; or export VISIONLOOP_TEST_PG_URL=postgresql+psycopg://USER:PASS@HOST:PORT/DB "
    "for a role with CREATEDB."
)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@functools.cache
def _pg_server() -> tuple[str | None, str]:
    """(admin URL, None) or (None, why not). Cached: the script runs once per session."""
    url = os.environ.get("VISIONLOOP_TEST_PG_URL", "").strip()
    if url:
        return url, ""
    script = REPO / ".ci" / "postgres.sh"
    try:
        proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=900, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{script} could not run: {e}"
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return None, f"{script} failed (exit {proc.returncode}):\n{proc.stderr.strip()[-3000:]}"
    return lines[-1], ""


def pg_admin_url() -> str:
    """The PostgreSQL server's URL, or fail (CI) / skip (elsewhere) with how to provide one."""
    url, why = _pg_server()
    if url is None:
        message = f"PostgreSQL is not available for these tests. {why}\n{HOW_TO_PROVIDE}"
        if in_ci():
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return url


def _libpq_url(url: str) -> str:
    """The same URL in the form psycopg itself takes (no SQLAlchemy driver suffix)."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@contextmanager
def fresh_database(backend: str, tmp_path: Path) -> Iterator[str]:
    """A URL to an empty database of its own, removed afterwards."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'state.db'}"
        return
    assert backend == "postgresql", backend
    import psycopg
    from psycopg import sql

    admin = pg_admin_url()
    name = f"{DB_PREFIX}{os.getpid()}_{secrets.token_hex(4)}"
    with psycopg.connect(_libpq_url(admin), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield make_url(admin).set(database=name).render_as_string(hide_password=False)
    finally:
        _drop(psycopg, sql, admin, name)


def _drop(psycopg: Any, sql: Any, admin: str, name: str) -> None:
    """DROP ... WITH (FORCE), retried: FORCE may not end a backend of another role (an
    autovacuum worker on the new database, under load: "must be a member of the role whose
    process is being terminated", seen in CI), which is gone a moment later."""
    deadline = time.monotonic() + 30
    while True:
        try:
            with psycopg.connect(_libpq_url(admin), autocommit=True) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
            return
        except (psycopg.errors.InsufficientPrivilege, psycopg.errors.ObjectInUse):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def submit_doc(
    store: Any, doc: dict[str, Any], *, now: float, team: str = "vision", key: str | None = None
) -> Any:
    """Queue a job spec document straight through the store (no control plane), as the
    admission path would after validating it: the job (a `visionloop.sched.store.Job`)."""
    from visionloop.specs import JobSpec

    return store.submit(
        doc,
        JobSpec.model_validate(doc),
        team=team,
        priority_rank=50,
        run_dir=None,
        idempotency_key=key,
        now=now,
    )
