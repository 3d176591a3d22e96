"""The job store: the queue's durable state (teams, tokens, jobs, their transitions and
attempts, GPU allocations, the inventory), on SQLite or PostgreSQL. This module holds what
every part of the store shares: the connection, the transaction, locking a job's row and
entering a new state; the parts (teams.py, jobs.py, attempts.py, inventory.py, ledger.py)
build on it and `Store` (in __init__.py) composes them.

Why it is shaped this way:
- **One transaction per change.** A state change locks the job row, checks the state machine
  (`check_transition`), updates the job and appends its transition row, all or nothing. A
  caller that lost a race (the job moved since it looked) gets `TransitionError` and should
  re-read and decide again; nothing is half-written, even if the process is SIGKILLed.
- **An open attempt iff the job holds resources.** Only `start_attempt` enters RUNNING (and
  books the GPUs in the same transaction), and only `end_attempt` leaves the states that
  hold GPUs (and frees them). So after a control-plane restart, `active_attempts()` is the
  complete list of processes to re-adopt, and the allocations are a true cost ledger.
- **GPUs are never double-booked**: checked inside the booking transaction, and enforced by
  a unique index on open allocations, which decides even between two racing schedulers.
- **Plain records out.** Every method returns frozen dataclasses, never ORM objects, so
  callers cannot change state behind the store's back or touch a closed session.

Times are float seconds on the caller's clock (`now`): the store never invents the time of
an event it records, so tests and the simulator control it fully.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self, cast

from sqlalchemy import CursorResult, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Session

from visionloop.core.errors import ConfigError, NotFoundError, QueueFullError, StoreError, VisionloopError
from visionloop.core.settings import Settings, load_settings
from visionloop.sched import db
from visionloop.sched.db import AttemptRow, JobRow, TransitionRow
from visionloop.sched.records import Job, ViewJob
from visionloop.sched.states import JobState, TransitionError, check_transition


class ConflictError(StoreError):
    """A write lost to another one: a GPU already held, an idempotency key reused for a
    different job. Re-read and decide again."""

    exit_code = 3


class TeamQueueFullError(StoreError, QueueFullError):
    """The store refused a submission: its team already has as many jobs waiting as the
    cluster allows a team (`[jobs] max_queued_per_team`). The API answers 429."""

    exit_code = 2

    def __init__(self, team: str, queued: int, limit: int) -> None:
        super().__init__(
            f"team {team!r} already has {queued:,} job{'' if queued == 1 else 's'} waiting, the most a "
            "team may have queued "
            f"([jobs] max_queued_per_team = {limit:,} in cluster.toml); nothing was submitted. Submit "
            "again once some have started, or cancel some with `visionloop jobs cancel ID`."
        )
        self.team, self.queued, self.limit = team, queued, limit


def default_url(settings: Settings) -> str:
    """The default store: a SQLite file in the visionloop home."""
    return f"sqlite:///{settings.home / 'state.db'}"


def _natural(text: str) -> list[Any]:
    """Sort key: node2/10 after node2/9."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def _plain_json(value: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON-safe copy (YAML dates, paths become strings), so what is stored is exactly
    what is read back."""
    out: dict[str, Any] = json.loads(json.dumps(dict(value), default=str))
    return out


# The Job's fields in order, as columns of the jobs table (train_doc is stored as train_spec).
# The three documents come last, so a row without them fills the other fields.
_JOB_COLUMNS = tuple("train_spec" if f.name == "train_doc" else f.name for f in dataclasses.fields(Job))
_LIGHT_COLUMNS = _JOB_COLUMNS[:-3]
assert _JOB_COLUMNS[-3:] == ("workload_doc", "spec_doc", "train_spec")
_RUN_DIR, _STATE = _JOB_COLUMNS.index("run_dir"), _JOB_COLUMNS.index("state")


def _job_from_values(values: Sequence[Any]) -> Job:
    """A Job from its column values in `_JOB_COLUMNS` order (positional: listing 10,000
    jobs spends its time here)."""
    v = list(values)
    v[_RUN_DIR] = Path(v[_RUN_DIR])
    v[_STATE] = JobState(v[_STATE])
    return Job(*v)


def _job(row: JobRow, specs: bool) -> Job:
    return _job_from_values([getattr(row, c) for c in (_JOB_COLUMNS if specs else _LIGHT_COLUMNS)])


def _rowcount(result: Any) -> int:
    return int(cast(CursorResult[Any], result).rowcount)


class StoreBase:
    """The connection and the transaction that every part of the store works through.
    Thread-safe: each call is its own transaction on a pooled connection."""

    # The queue view (`view_jobs`) is read in full at most this often; in between, only the
    # jobs this Store changed are re-read. The full read is the safety net for a change made
    # through another connection (a second process, an operator's SQL).
    VIEW_FULL_READ_S = 30.0

    def __init__(self, engine: Engine, shown_url: str, runs_dir: Path) -> None:
        self._engine = engine
        self.url = shown_url  # with the password hidden, for messages
        self.runs_dir = runs_dir
        self.backend = engine.dialect.name  # "sqlite" or "postgresql"
        # view_jobs' cache: job id → its view row, for queued and active jobs. Writers add the
        # ids they changed to _view_dirty *after* their commit, so a reader that misses one
        # this time re-reads it next time, never keeping a stale row for good.
        self._view_rows: dict[int, ViewJob] | None = None
        self._view_list: tuple[ViewJob, ...] = ()
        self._view_read_at = 0.0
        self._view_dirty: set[int] = set()
        self._dirty_lock = threading.Lock()
        self._view_lock = threading.Lock()

    @classmethod
    def open(cls, url: str, *, runs_dir: Path | None = None) -> Self:
        """Connect, and create or upgrade the schema to this code's (Alembic migrations).

        `runs_dir` is where jobs submitted without a run folder get one (`job-<id>`);
        default: the settings' `<home>/runs`."""
        parsed = db.parse_url(url)
        shown = parsed.render_as_string(hide_password=True)
        engine = db.make_engine(parsed)
        try:
            db.migrate(engine, shown)
        except VisionloopError:
            engine.dispose()
            raise
        except DBAPIError as e:
            engine.dispose()
            if parsed.get_backend_name() == "sqlite":
                advice = "Check that the file's folder exists and is writable, and the disk is not full."
            else:
                advice = (
                    "Check that the server is running and reachable, and that the user, password and "
                    "database exist (create the database first, e.g. `createdb visionloop`)."
                )
            why = " ".join(str(e.orig).split()).rstrip(".")
            raise ConfigError(f"cannot open the job store at {shown}: {why}. {advice}") from e
        return cls(engine, shown, runs_dir if runs_dir is not None else load_settings().runs_dir)

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    @contextmanager
    def _session(self, *, write: bool) -> Iterator[Session]:
        """One transaction. Writes take SQLite's lock up front (BEGIN IMMEDIATE, see sched/db/engine.py);
        commit on success, roll back on any exception."""
        try:
            with self._engine.connect() as conn:
                if write:
                    conn.execution_options(**{db.WRITE_OPTION: True})
                with Session(bind=conn, expire_on_commit=False, autoflush=False) as s, s.begin():
                    yield s
        except IntegrityError:
            raise  # the callers turn these into conflicts
        except DBAPIError as e:
            if getattr(e.orig, "sqlstate", None) in ("40001", "40P01"):  # serialization, deadlock
                raise ConflictError(
                    f"the job store aborted a change that raced another ({e.orig}); re-read and try again."
                ) from e
            why = " ".join(str(e.orig).split()).rstrip(".")
            raise StoreError(
                f"the job store at {self.url} failed: {why}. If this persists, check the database "
                "is reachable and not locked by a stuck process; the change was not made."
            ) from e

    @contextmanager
    def _job_session(self, job_id: int) -> Iterator[Session]:
        """A write transaction that changes this job's row: view_jobs re-reads the row after."""
        try:
            with self._session(write=True) as s:
                yield s
        finally:
            self._touched(job_id)

    def _touched(self, *job_ids: int) -> None:
        """These jobs' rows changed (committed, or perhaps not): view_jobs re-reads them."""
        with self._dirty_lock:
            self._view_dirty.update(job_ids)

    @staticmethod
    def _lock_job(s: Session, job_id: int) -> JobRow:
        """The job's row, locked until the transaction ends (PostgreSQL: FOR UPDATE; SQLite
        already holds the database's write lock)."""
        row = s.scalars(select(JobRow).where(JobRow.id == job_id).with_for_update()).one_or_none()
        if row is None:
            raise NotFoundError(f"no job {job_id}; `visionloop jobs list` shows the jobs you can see.")
        return row

    @staticmethod
    def _exists(s: Session, job_id: int) -> None:
        if s.get(JobRow, job_id) is None:
            raise NotFoundError(f"no job {job_id}; `visionloop jobs list` shows the jobs you can see.")

    @staticmethod
    def _check(row: JobRow, dst: JobState, expect: JobState | Iterable[JobState] | None) -> JobState:
        src = JobState(row.state)
        if expect is not None:
            expected = {expect} if isinstance(expect, JobState) else set(expect)
            if src not in expected:
                shown = " or ".join(sorted(expected))
                raise TransitionError(
                    f"job {row.id} is {src}, not {shown}: another actor changed it first. "
                    "Re-read the job and decide again."
                )
        check_transition(str(row.id), src, dst)
        return src

    @staticmethod
    def _enter(s: Session, row: JobRow, src: JobState, dst: JobState, reason: str, now: float) -> None:
        """Apply a checked state change to the row and append its transition row."""
        row.state = dst.value
        row.state_since = now
        row.updated_at = now
        row.version += 1
        if dst is not JobState.PREEMPTING:
            row.leaving_for = None  # only a job on its way out steps aside for one
        if dst is not JobState.QUEUED:
            row.waiting_reason = None
        elif src is not JobState.QUEUED and row.waiting_reason is None:
            # Until the scheduler says more, why it is back in the queue is why it waits.
            row.waiting_reason = reason
        if dst.terminal:
            row.finished_at = now
        if dst in (JobState.SUCCEEDED, JobState.PAUSED):
            # It ran its whole length (a trial: to its rung): a sample of the runtime history.
            # The attempts come from the session's identity map, so one closed in this
            # transaction counts with its end (autoflush is off).
            atts = s.scalars(select(AttemptRow).where(AttemptRow.job_id == row.id)).all()
            row.ran_s = sum(a.ended_at - a.started_at for a in atts if a.ended_at is not None) or None
        s.add(TransitionRow(job_id=row.id, from_state=src.value, to_state=dst.value, at=now, reason=reason))

    @staticmethod
    def _set_fields(
        row: JobRow,
        waiting_reason: str | None,
        not_before: float | None,
        exit_code: int | None,
        restarts: int | None,
        preemptions: int | None,
    ) -> None:
        if waiting_reason is not None:
            row.waiting_reason = waiting_reason
        if not_before is not None:
            row.not_before = not_before
        if exit_code is not None:
            row.exit_code = exit_code
        if restarts is not None:
            row.restarts = restarts
        if preemptions is not None:
            row.preemptions = preemptions
