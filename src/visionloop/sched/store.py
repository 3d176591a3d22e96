"""The job store: the queue's durable state (teams, tokens, jobs, their transitions and
attempts, GPU allocations, the inventory), on SQLite or PostgreSQL.

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
import hashlib
import hmac
import json
import re
import secrets
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, cast

from sqlalchemy import CursorResult, Table, bindparam, insert, or_, select, text, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Session

from visionloop.core.errors import ConfigError, NotFoundError, StoreError, VisionloopError
from visionloop.core.settings import Settings, load_settings
from visionloop.sched import db
from visionloop.sched.db import (
    AllocationRow,
    AttemptRow,
    CheckpointRow,
    GpuRow,
    JobRow,
    TeamRow,
    TokenRow,
    TransitionRow,
)
from visionloop.sched.records import (
    Allocation,
    Attempt,
    Checkpoint,
    GpuLike,
    GpuRecord,
    Job,
    LedgerRow,
    Outcome,
    Principal,
    TeamRecord,
    TokenRecord,
    Transition,
    ViewJob,
)
from visionloop.sched.states import ACTIVE, JobState, TransitionError, check_transition
from visionloop.sched.view import PriceClass
from visionloop.specs import JobSpec

_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
TOKEN_PREFIX = "vl_"  # lets secret scanners and people recognise a visionloop token


class ConflictError(StoreError):
    """A write lost to another one: a GPU already held, an idempotency key reused for a
    different job. Re-read and decide again."""

    exit_code = 3


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
# The two documents come last, so a row without them fills the other fields.
_JOB_COLUMNS = tuple("train_spec" if f.name == "train_doc" else f.name for f in dataclasses.fields(Job))
_LIGHT_COLUMNS = _JOB_COLUMNS[:-2]
assert _JOB_COLUMNS[-2:] == ("spec_doc", "train_spec")
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


_SET_RUN_DIR = (
    update(cast(Table, JobRow.__table__))
    .where(cast(Table, JobRow.__table__).c.id == bindparam("b_id"))
    .values(run_dir=bindparam("b_run_dir"))
)


def _allocation(r: AllocationRow) -> Allocation:
    return Allocation(r.gpu_id, r.node, r.gpu_type, cast(PriceClass, r.price_class), r.started_at, r.ended_at)


def _attempt(r: AttemptRow, allocations: Iterable[AllocationRow]) -> Attempt:
    return Attempt(
        job_id=r.job_id,
        number=r.number,
        executor=r.executor,
        handle=r.handle,
        started_at=r.started_at,
        ended_at=r.ended_at,
        exit_code=r.exit_code,
        outcome=cast("Outcome | None", r.outcome),
        allocations=tuple(_allocation(a) for a in sorted(allocations, key=lambda a: a.id)),
    )


def _gpu(r: GpuRow) -> GpuRecord:
    return GpuRecord(
        id=r.id,
        node=r.node,
        type=r.type,
        price_class=cast(PriceClass, r.price_class),
        up=r.up,
        down_reason=r.down_reason,
        updated_at=r.updated_at,
    )


def _team(r: TeamRow) -> TeamRecord:
    return TeamRecord(r.name, r.nominal_gpus, r.borrow_limit, r.weight, r.created_at, r.updated_at)


def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def _rowcount(result: Any) -> int:
    return int(cast(CursorResult[Any], result).rowcount)


# --------------------------------------------------------------------------- the store

# Why a GPU is down when the executor stopped listing it (its node left the cluster).
GONE_REASON = "no longer reported by the executor (its node left?)"


class Store:
    """The job store. Thread-safe: each call is its own transaction on a pooled connection.
    Open it with `Store.open(url)`; close it with `close()` (or use it as a context manager)."""

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
    def open(cls, url: str, *, runs_dir: Path | None = None) -> Store:
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

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    @contextmanager
    def _session(self, *, write: bool) -> Iterator[Session]:
        """One transaction. Writes take SQLite's lock up front (BEGIN IMMEDIATE, see db.py);
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

    @staticmethod
    def _lock_job(s: Session, job_id: int) -> JobRow:
        """The job's row, locked until the transaction ends (PostgreSQL: FOR UPDATE; SQLite
        already holds the database's write lock)."""
        row = s.scalars(select(JobRow).where(JobRow.id == job_id).with_for_update()).one_or_none()
        if row is None:
            raise NotFoundError(f"no job {job_id}; `visionloop jobs list` shows the jobs you can see.")
        return row

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
        if dst is not JobState.QUEUED:
            row.waiting_reason = None
        elif src is not JobState.QUEUED and row.waiting_reason is None:
            # Until the scheduler says more, why it is back in the queue is why it waits.
            row.waiting_reason = reason
        if dst.terminal:
            row.finished_at = now
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

    # ------------------------------------------------------------------ teams and tokens

    def upsert_team(
        self,
        name: str,
        nominal_gpus: int,
        borrow_limit: int = 0,
        weight: float = 1.0,
        *,
        now: float | None = None,
    ) -> TeamRecord:
        """Create a team or change its quota; its jobs and tokens stay."""
        if not _NAME.fullmatch(name):
            raise ConfigError(
                f"team name {name!r}: use 1-64 letters, digits, '-', '_' or '.', e.g. 'vision'."
            )
        if nominal_gpus < 0 or borrow_limit < 0 or not weight > 0:
            raise ConfigError(
                f"team {name}: nominal_gpus ({nominal_gpus}) and borrow_limit ({borrow_limit}) must be "
                f">= 0 and weight ({weight}) > 0, e.g. nominal_gpus=4, borrow_limit=2, weight=1."
            )
        now = time.time() if now is None else now
        values = {
            "name": name,
            "nominal_gpus": nominal_gpus,
            "borrow_limit": borrow_limit,
            "weight": float(weight),
            "created_at": now,
            "updated_at": now,
        }
        changed = {k: values[k] for k in ("nominal_gpus", "borrow_limit", "weight", "updated_at")}
        with self._session(write=True) as s:
            # An upsert, so two admins creating one team at once cannot collide.
            if self.backend == "postgresql":
                s.execute(
                    pg_insert(TeamRow)
                    .values(values)
                    .on_conflict_do_update(index_elements=["name"], set_=changed)
                )
            else:
                stmt = sqlite_insert(TeamRow).values(values)
                s.execute(stmt.on_conflict_do_update(index_elements=["name"], set_=changed))
            return _team(s.get_one(TeamRow, name, populate_existing=True))

    def get_team(self, name: str) -> TeamRecord | None:
        with self._session(write=False) as s:
            row = s.get(TeamRow, name)
            return None if row is None else _team(row)

    def list_teams(self) -> list[TeamRecord]:
        with self._session(write=False) as s:
            return [_team(r) for r in s.scalars(select(TeamRow).order_by(TeamRow.name))]

    def create_token(self, team: str | None, admin: bool, label: str, *, now: float | None = None) -> str:
        """A new API token. The plaintext is returned once and never stored (only its SHA-256):
        whoever loses it makes a new one."""
        if team is None and not admin:
            raise ConfigError("a token belongs to a team, or is an admin token: give a team or admin=True.")
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        with self._session(write=True) as s:
            if team is not None and s.get(TeamRow, team) is None:
                raise NotFoundError(
                    f"no team {team!r}; create it first (Store.upsert_team / `visionloop admin team set`)."
                )
            s.add(
                TokenRow(
                    token_hash=_token_hash(token),
                    team=team,
                    admin=admin,
                    label=label,
                    created_at=time.time() if now is None else now,
                )
            )
        return token

    def authenticate(self, token: str) -> Principal | None:
        """The token's owner, or None for an unknown or revoked token.

        The lookup is by SHA-256, so timing reveals at most how much of a *hash* matched,
        which does not help forge a token; the final comparison is constant-time anyway."""
        digest = _token_hash(token)
        with self._session(write=False) as s:
            row = s.scalars(select(TokenRow).where(TokenRow.token_hash == digest)).one_or_none()
            if row is None or not hmac.compare_digest(row.token_hash, digest) or row.revoked_at is not None:
                return None
            return Principal(token_id=row.id, team=row.team, admin=row.admin, label=row.label)

    def list_tokens(self, team: str | None = None) -> list[TokenRecord]:
        with self._session(write=False) as s:
            q = select(TokenRow).order_by(TokenRow.id)
            if team is not None:
                q = q.where(TokenRow.team == team)
            return [
                TokenRecord(r.id, r.team, r.admin, r.label, r.created_at, r.revoked_at) for r in s.scalars(q)
            ]

    def revoke_token(self, token_id: int, *, now: float | None = None) -> None:
        """Revoke a token by its id (`list_tokens`); revoking twice keeps the first time."""
        with self._session(write=True) as s:
            row = s.get(TokenRow, token_id)
            if row is None:
                raise NotFoundError(f"no token {token_id}; `visionloop admin token list` shows them.")
            if row.revoked_at is None:
                row.revoked_at = time.time() if now is None else now

    # ------------------------------------------------------------------ jobs

    def submit(
        self,
        spec_doc: Mapping[str, Any],
        job: JobSpec,
        *,
        team: str,
        priority_rank: int,
        run_dir: Path | None,
        idempotency_key: str | None,
        now: float,
    ) -> Job:
        """Queue a job. With an idempotency key, a retried submit returns the job the first
        one created (never a duplicate), and a key reused for a different spec is refused.

        The id is allocated inside the transaction, so the default run folder
        `<runs_dir>/job-<id>` is stored with the job in the same commit."""
        doc = _plain_json(spec_doc)
        if idempotency_key is not None and not 0 < len(idempotency_key) <= 200:
            raise StoreError("an idempotency key is 1-200 characters, e.g. a UUID.")
        res = job.resources
        # Everything is computed before the transaction: SQLite's write lock is held only for
        # the statements (plain Core ones: the ORM's unit of work costs milliseconds here).
        values: dict[str, Any] = {
            "name": job.name,
            "team": team,
            "priority": job.priority,
            "priority_rank": priority_rank,
            "spot": job.spot,
            "gpus": res.gpus,
            "cpus": res.cpus,
            "memory_gb": res.memory_gb,
            "max_restarts": job.max_restarts,
            "run_dir": "" if run_dir is None else str(run_dir),
            "state": JobState.QUEUED.value,
            "state_since": now,
            "waiting_reason": "waiting for the scheduler",
            "restarts": 0,
            "preemptions": 0,
            "attempt": 0,
            "not_before": 0.0,
            "attained_gpu_s": 0.0,
            "last_checkpoint_at": None,
            "last_heartbeat_at": None,
            "submitted_at": now,
            "updated_at": now,
            "started_at": None,
            "finished_at": None,
            "exit_code": None,
            "idempotency_key": idempotency_key,
            "version": 1,
            "spec_doc": doc,
            "train_spec": job.train.model_dump(mode="json"),
        }
        jobs = cast(Table, JobRow.__table__)
        try:
            with self._session(write=True) as s:
                if idempotency_key is not None:
                    found = self._by_key(s, team, idempotency_key, doc)
                    if found is not None:
                        return found
                if s.get(TeamRow, team) is None:
                    raise NotFoundError(
                        f"no team {team!r}; an admin creates it with "
                        f"`visionloop admin team set {team} --nominal N`."
                    )
                # Parameters apart from the statements, so SQLAlchemy compiles each one once.
                values["id"] = s.execute(insert(jobs).returning(jobs.c.id), values).scalar_one()
                if run_dir is None:
                    values["run_dir"] = str(self.runs_dir / f"job-{values['id']}")
                    s.execute(_SET_RUN_DIR, {"b_id": values["id"], "b_run_dir": values["run_dir"]})
                s.execute(
                    insert(cast(Table, TransitionRow.__table__)),
                    {
                        "job_id": values["id"],
                        "from_state": None,
                        "to_state": "queued",
                        "at": now,
                        "reason": "submitted",
                    },
                )
            self._touched(values["id"])
            return _job_from_values([values[c] for c in _JOB_COLUMNS])
        except IntegrityError:
            if idempotency_key is None:
                raise
            # PostgreSQL: a concurrent submit with the same key committed first.
            with self._session(write=False) as s:
                found = self._by_key(s, team, idempotency_key, doc)
            if found is None:
                raise
            return found

    @staticmethod
    def _by_key(s: Session, team: str, key: str, doc: dict[str, Any]) -> Job | None:
        row = s.scalars(
            select(JobRow).where(JobRow.team == team, JobRow.idempotency_key == key)
        ).one_or_none()
        if row is None:
            return None
        if row.spec_doc != doc:
            raise ConflictError(
                f"idempotency key {key!r} was already used by team {team} for job {row.id}, with a "
                "different spec. Use a new key for a new job."
            )
        return _job(row, specs=True)

    def get_job(self, job_id: int) -> Job:
        """The job with its spec documents; NotFoundError if there is none."""
        with self._session(write=False) as s:
            row = s.get(JobRow, job_id)
            if row is None:
                raise NotFoundError(f"no job {job_id}; `visionloop jobs list` shows the jobs you can see.")
            return _job(row, specs=True)

    def list_jobs(
        self,
        team: str | None = None,
        states: Iterable[JobState] | None = None,
        limit: int | None = None,
        offset: int = 0,
        *,
        with_specs: bool = False,
        newest_first: bool = False,
    ) -> list[Job]:
        """Jobs in submission order (one indexed query; without their spec documents unless
        `with_specs`, which keeps listing 10,000 queued jobs cheap)."""
        table = cast(Table, JobRow.__table__)
        q = select(*(table.c[name] for name in (_JOB_COLUMNS if with_specs else _LIGHT_COLUMNS)))
        if team is not None:
            q = q.where(table.c.team == team)
        if states is not None:
            q = q.where(table.c.state.in_([JobState(x).value for x in states]))
        q = q.order_by(table.c.id.desc() if newest_first else table.c.id).offset(offset)
        if limit is not None:
            q = q.limit(limit)
        with self._session(write=False) as s:
            return [_job_from_values(r) for r in s.execute(q)]

    def view_jobs(self) -> tuple[ViewJob, ...]:
        """Every queued or active job, in submission order, as the scheduler's view needs it:
        only those columns, as plain rows.

        What each cycle reads, so it is cached: a full read (one indexed query) at most every
        VIEW_FULL_READ_S, and in between only the rows of the jobs changed through this Store
        since the last call. With 10,000 queued jobs this is the difference between ~40 ms and
        well under 1 ms a cycle. The same tuple comes back until something changes, so a
        caller can tell an unchanged queue by identity."""
        with self._view_lock:
            with self._dirty_lock:
                dirty, self._view_dirty = self._view_dirty, set()
            stale = time.monotonic() - self._view_read_at > self.VIEW_FULL_READ_S
            if self._view_rows is None or stale:
                self._view_read_at = time.monotonic()
                self._view_rows = {r.id: r for r in self._read_view()}
                self._view_list = tuple(self._view_rows.values())
            elif dirty:
                rows = self._view_rows
                for job_id in dirty:
                    rows.pop(job_id, None)
                ids = sorted(dirty)
                for i in range(0, len(ids), 500):  # within every backend's bound-parameter limit
                    for r in self._read_view(ids[i : i + 500]):
                        rows[r.id] = r
                self._view_list = tuple(rows[k] for k in sorted(rows))
            return self._view_list

    def _read_view(self, ids: Sequence[int] | None = None) -> list[ViewJob]:
        table = cast(Table, JobRow.__table__)
        states = [s.value for s in JobState if s == JobState.QUEUED or s in ACTIVE]
        q = select(*(table.c[name] for name in ViewJob._fields)).where(table.c.state.in_(states))
        if ids is not None:
            q = q.where(table.c.id.in_(ids))
        with self._session(write=False) as s:
            return [ViewJob(*r) for r in s.execute(q.order_by(table.c.id))]

    def _touched(self, *job_ids: int) -> None:
        """These jobs' rows changed (committed, or perhaps not): view_jobs re-reads them."""
        with self._dirty_lock:
            self._view_dirty.update(job_ids)

    def transitions(self, job_id: int) -> list[Transition]:
        with self._session(write=False) as s:
            self._exists(s, job_id)
            rows = s.scalars(
                select(TransitionRow).where(TransitionRow.job_id == job_id).order_by(TransitionRow.id)
            )
            return [
                Transition(
                    r.job_id,
                    None if r.from_state is None else JobState(r.from_state),
                    JobState(r.to_state),
                    r.at,
                    r.reason,
                )
                for r in rows
            ]

    @staticmethod
    def _exists(s: Session, job_id: int) -> None:
        if s.get(JobRow, job_id) is None:
            raise NotFoundError(f"no job {job_id}; `visionloop jobs list` shows the jobs you can see.")

    def transition(
        self,
        job_id: int,
        dst: JobState,
        reason: str,
        *,
        expect: JobState | Iterable[JobState] | None = None,
        now: float,
        waiting_reason: str | None = None,
        not_before: float | None = None,
        exit_code: int | None = None,
        restarts: int | None = None,
        preemptions: int | None = None,
    ) -> Job:
        """Change a job's state, atomically with its transition row and the given fields
        (None leaves a field as it is).

        `expect`: the state(s) the caller saw; if the job has moved since, TransitionError
        (a lost race: re-read and decide again). Entering RUNNING is `start_attempt`'s job and
        leaving the states that hold GPUs is `end_attempt`'s, so the attempts and allocations
        always match the job's state; this method refuses both (StoreError)."""
        with self._job_session(job_id) as s:
            row = self._lock_job(s, job_id)
            src = self._check(row, dst, expect)
            if dst is JobState.RUNNING:
                raise StoreError(f"job {job_id}: start it with Store.start_attempt, which books its GPUs.")
            if src.holds_resources and not dst.holds_resources:
                raise StoreError(
                    f"job {job_id} is {src} and holds GPUs: end its attempt with Store.end_attempt, "
                    f"which frees them and moves it to {dst}."
                )
            self._set_fields(row, waiting_reason, not_before, exit_code, restarts, preemptions)
            self._enter(s, row, src, dst, reason, now)
            s.flush()
            return _job(row, specs=False)

    # ------------------------------------------------------------------ attempts

    def start_attempt(
        self,
        job_id: int,
        executor: str,
        gpus: Sequence[GpuLike],
        *,
        now: float,
        reason: str | None = None,
    ) -> Attempt:
        """QUEUED -> RUNNING with a new attempt holding `gpus`, in one transaction.

        Refused (ConflictError, nothing written) if any of the GPUs is held by another open
        attempt or is down: re-checked inside the transaction, and enforced by a unique index
        for two schedulers racing on PostgreSQL."""
        ids = [g.id for g in gpus]
        if len(set(ids)) != len(ids):
            raise StoreError(f"job {job_id}: GPU ids {ids} repeat; each GPU is booked once.")
        for g in gpus:
            if g.price_class not in db.PRICE_CLASSES:
                raise StoreError(
                    f"GPU {g.id}: price class {g.price_class!r} is not one of {db.PRICE_CLASSES}."
                )
        try:
            with self._job_session(job_id) as s:
                row = self._lock_job(s, job_id)
                src = self._check(row, JobState.RUNNING, JobState.QUEUED)
                if len(ids) != row.gpus:
                    raise StoreError(
                        f"job {job_id} needs {row.gpus} GPU(s), not the {len(ids)} given: {ids}."
                    )
                if ids:
                    self._check_free(s, job_id, ids)
                number = row.attempt + 1
                att = AttemptRow(job_id=job_id, number=number, executor=executor, handle=None, started_at=now)
                s.add(att)
                s.flush()
                # Booked in one global order (natural GPU id), so two transactions booking
                # overlapping GPUs on PostgreSQL wait for each other instead of deadlocking.
                allocs = [
                    AllocationRow(
                        attempt_id=att.id,
                        job_id=job_id,
                        gpu_id=g.id,
                        node=g.node,
                        gpu_type=g.type,
                        price_class=g.price_class,
                        started_at=now,
                    )
                    for g in sorted(gpus, key=lambda g: _natural(g.id))
                ]
                s.add_all(allocs)
                row.attempt = number
                if row.started_at is None:
                    row.started_at = now
                where = ", ".join(ids) if ids else "CPU only"
                self._enter(s, row, src, JobState.RUNNING, reason or f"attempt {number} on {where}", now)
                s.flush()
                return _attempt(att, allocs)
        except IntegrityError as e:
            raise ConflictError(
                f"job {job_id} was not started: one of GPUs {ids} was booked by another scheduler at the "
                "same moment. Re-read the cluster and place it again."
            ) from e

    @staticmethod
    def _check_free(s: Session, job_id: int, ids: list[str]) -> None:
        held = s.execute(
            select(AllocationRow.gpu_id, AllocationRow.job_id).where(
                AllocationRow.gpu_id.in_(ids), AllocationRow.ended_at.is_(None)
            )
        ).all()
        if held:
            taken = ", ".join(f"{g} (job {j})" for g, j in sorted(held))
            raise ConflictError(
                f"job {job_id} was not started: GPU(s) already held: {taken}. Place it elsewhere."
            )
        down = s.execute(
            select(GpuRow.id, GpuRow.down_reason).where(GpuRow.id.in_(ids), GpuRow.up.is_(False))
        ).all()
        if down:
            shown = ", ".join(f"{g} ({why or 'down'})" for g, why in sorted(down))
            raise ConflictError(f"job {job_id} was not started: GPU(s) down: {shown}. Place it elsewhere.")

    def set_attempt_handle(self, job_id: int, attempt: int, handle: Mapping[str, Any]) -> None:
        """Store what the executor needs to find the attempt's process after a restart."""
        with self._session(write=True) as s:
            result = s.execute(
                update(AttemptRow)
                .where(
                    AttemptRow.job_id == job_id, AttemptRow.number == attempt, AttemptRow.ended_at.is_(None)
                )
                .values(handle=_plain_json(handle))
            )
            if _rowcount(result) == 0:
                raise NotFoundError(
                    f"job {job_id} has no open attempt {attempt}; it may have ended meanwhile."
                )

    def end_attempt(
        self,
        job_id: int,
        attempt: int,
        outcome: Outcome | str,
        exit_code: int | None,
        now: float,
        next_state: JobState,
        reason: str,
        *,
        expect: JobState | Iterable[JobState] | None = None,
        waiting_reason: str | None = None,
        not_before: float | None = None,
        restarts: int | None = None,
        preemptions: int | None = None,
    ) -> Job:
        """Close an attempt and its allocations and move the job on (QUEUED to run again, or a
        terminal state), in one transaction. attained_gpu_s grows by GPUs x duration.

        An attempt that has already ended raises TransitionError (another actor recorded it)."""
        if outcome not in db.OUTCOMES:
            raise StoreError(f"outcome {outcome!r} is not one of {db.OUTCOMES}.")
        if next_state.holds_resources:
            raise StoreError(
                f"job {job_id}: an ended attempt frees its GPUs, so the job cannot be {next_state}."
            )
        with self._job_session(job_id) as s:
            row = self._lock_job(s, job_id)
            att = s.scalars(
                select(AttemptRow).where(AttemptRow.job_id == job_id, AttemptRow.number == attempt)
            ).one_or_none()
            if att is None:
                raise NotFoundError(f"job {job_id} has no attempt {attempt} (its latest is {row.attempt}).")
            if att.ended_at is not None:
                raise TransitionError(
                    f"attempt {attempt} of job {job_id} already ended ({att.outcome}); another actor "
                    "recorded it first. Re-read the job."
                )
            src = self._check(row, next_state, expect)
            att.ended_at = now
            att.exit_code = exit_code
            att.outcome = outcome
            allocs = s.scalars(
                select(AllocationRow).where(
                    AllocationRow.attempt_id == att.id, AllocationRow.ended_at.is_(None)
                )
            ).all()
            for a in allocs:
                a.ended_at = now
                row.attained_gpu_s += max(0.0, now - a.started_at)
            row.exit_code = exit_code
            self._set_fields(row, waiting_reason, not_before, None, restarts, preemptions)
            self._enter(s, row, src, next_state, reason, now)
            s.flush()
            return _job(row, specs=False)

    def attempts(self, job_id: int) -> list[Attempt]:
        """The job's attempts, oldest first, each with its GPU allocations."""
        with self._session(write=False) as s:
            self._exists(s, job_id)
            atts = s.scalars(
                select(AttemptRow).where(AttemptRow.job_id == job_id).order_by(AttemptRow.number)
            ).all()
            allocs = s.scalars(select(AllocationRow).where(AllocationRow.job_id == job_id)).all()
            return self._with_allocations(atts, allocs)

    def active_attempts(self) -> list[Attempt]:
        """Every attempt not ended, with its GPUs: what the reconciler re-adopts after a
        restart, and what holds the cluster's GPUs. Two indexed queries."""
        with self._session(write=False) as s:
            atts = s.scalars(
                select(AttemptRow).where(AttemptRow.ended_at.is_(None)).order_by(AttemptRow.job_id)
            ).all()
            allocs = s.scalars(select(AllocationRow).where(AllocationRow.ended_at.is_(None))).all()
            return self._with_allocations(atts, allocs)

    @staticmethod
    def _with_allocations(atts: Sequence[AttemptRow], allocs: Sequence[AllocationRow]) -> list[Attempt]:
        by_attempt: dict[int, list[AllocationRow]] = {}
        for a in allocs:
            by_attempt.setdefault(a.attempt_id, []).append(a)
        return [_attempt(a, by_attempt.get(a.id, [])) for a in atts]

    def heartbeat(self, job_id: int, now: float) -> None:
        with self._session(write=True) as s:
            result = s.execute(update(JobRow).where(JobRow.id == job_id).values(last_heartbeat_at=now))
            if _rowcount(result) == 0:
                raise NotFoundError(f"no job {job_id}.")

    def heartbeats(self, beats: Mapping[int, float]) -> int:
        """Record many jobs' last heartbeats (job id → time) in one statement: the reconciler
        writes a cycle's beats together. Unknown ids are skipped; returns the rows updated."""
        if not beats:
            return 0
        table = cast(Table, JobRow.__table__)
        many = (
            update(table).where(table.c.id == bindparam("b_id")).values(last_heartbeat_at=bindparam("b_at"))
        )
        params = [{"b_id": int(i), "b_at": float(at)} for i, at in beats.items()]
        with self._session(write=True) as s:
            return _rowcount(s.connection().execute(many, params))

    def record_checkpoint(self, job_id: int, step: int, now: float, *, attempt: int | None = None) -> None:
        """A checkpoint the job reported: listed by `jobs show`, and used by the cost ledger
        to tell the work a preemption lost from the work it kept."""
        with self._job_session(job_id) as s:
            row = self._lock_job(s, job_id)
            s.add(CheckpointRow(job_id=job_id, attempt=attempt, step=step, at=now))
            if row.last_checkpoint_at is None or now > row.last_checkpoint_at:
                row.last_checkpoint_at = now

    def checkpoints(self, job_id: int) -> list[Checkpoint]:
        with self._session(write=False) as s:
            self._exists(s, job_id)
            rows = s.scalars(
                select(CheckpointRow)
                .where(CheckpointRow.job_id == job_id)
                .order_by(CheckpointRow.at, CheckpointRow.id)
            )
            return [Checkpoint(r.job_id, r.attempt, r.step, r.at) for r in rows]

    def set_waiting_reasons(self, reasons: Mapping[int, str]) -> int:
        """Store why each queued job is waiting, in one statement. Only rows whose reason
        changed are written, so a scheduler repeating itself every cycle is cheap. Returns
        the number changed; jobs no longer queued are left alone."""
        if not reasons:
            return 0
        ids = [int(k) for k in reasons]
        texts = [str(v) for v in reasons.values()]
        with self._session(write=True) as s:
            if self.backend == "postgresql":
                # One statement for 10,000 jobs: the pairs travel as two arrays.
                stmt = text(
                    "UPDATE jobs SET waiting_reason = v.reason "
                    "FROM unnest(CAST(:ids AS integer[]), CAST(:reasons AS text[])) AS v(id, reason) "
                    "WHERE jobs.id = v.id AND jobs.state = 'queued' "
                    "AND jobs.waiting_reason IS DISTINCT FROM v.reason"
                )
                return _rowcount(s.execute(stmt, {"ids": ids, "reasons": texts}))
            table = cast(Table, JobRow.__table__)
            many = (
                update(table)
                .where(
                    table.c.id == bindparam("b_id"),
                    table.c.state == JobState.QUEUED.value,
                    or_(table.c.waiting_reason.is_(None), table.c.waiting_reason != bindparam("b_reason")),
                )
                .values(waiting_reason=bindparam("b_reason"))
            )
            params = [{"b_id": i, "b_reason": r} for i, r in zip(ids, texts, strict=True)]
            return _rowcount(s.connection().execute(many, params))

    # ------------------------------------------------------------------ inventory

    def sync_gpus(
        self,
        gpus: Iterable[GpuLike],
        *,
        now: float | None = None,
        missing: Literal["remove", "down"] = "remove",
    ) -> list[GpuRecord]:
        """Make the inventory match discovery (or the configured list): new GPUs are added
        (up, unless they say otherwise), changed ones updated, and a known GPU keeps its
        up/down state, so a spot interruption survives a control-plane restart.

        GPUs no longer listed: "remove" deletes them (their allocations stay in the ledger),
        as the start-up sync does; "down" marks them down with GONE_REASON — what a periodic
        re-sync does, since a Ray node that left may hold attempts still being settled — and a
        GPU down for that reason alone comes back up when it is listed again (one down for a
        spot interruption stays down)."""
        now = time.time() if now is None else now
        wanted = {g.id: g for g in gpus}
        for g in wanted.values():
            if g.price_class not in db.PRICE_CLASSES:
                raise ConfigError(
                    f"GPU {g.id}: price class {g.price_class!r} is not one of {db.PRICE_CLASSES}."
                )
        with self._session(write=True) as s:
            existing = {r.id: r for r in s.scalars(select(GpuRow).with_for_update())}
            for gid, g in wanted.items():
                row = existing.get(gid)
                if row is None:
                    up = bool(getattr(g, "up", True))
                    s.add(
                        GpuRow(
                            id=gid,
                            node=g.node,
                            type=g.type,
                            price_class=g.price_class,
                            up=up,
                            down_reason=None if up else "down when discovered",
                            updated_at=now,
                        )
                    )
                    continue
                if (row.node, row.type, row.price_class) != (g.node, g.type, g.price_class):
                    row.node, row.type, row.price_class, row.updated_at = g.node, g.type, g.price_class, now
                if not row.up and row.down_reason == GONE_REASON:
                    row.up, row.down_reason, row.updated_at = True, None, now
            for gid in existing.keys() - wanted.keys():
                row = existing[gid]
                if missing == "remove":
                    s.delete(row)
                elif missing == "down" and row.up:
                    row.up, row.down_reason, row.updated_at = False, GONE_REASON, now
            s.flush()
            rows = s.scalars(select(GpuRow)).all()
            return sorted((_gpu(r) for r in rows), key=lambda g: (_natural(g.node), _natural(g.id)))

    def list_gpus(self) -> list[GpuRecord]:
        """The inventory, by node and GPU id in natural order (node2/9 before node2/10)."""
        with self._session(write=False) as s:
            rows = s.scalars(select(GpuRow)).all()
            return sorted((_gpu(r) for r in rows), key=lambda g: (_natural(g.node), _natural(g.id)))

    def set_gpus_up(
        self, target: str | Sequence[str], *, up: bool, reason: str | None = None, now: float
    ) -> list[str]:
        """Mark GPUs up or down (a spot interruption takes a GPU or a whole node away).

        `target`: a GPU id or a node name, or a list of GPU ids. Returns the ids matched
        (whether or not they changed), empty if none: the caller decides if that is an error."""
        with self._session(write=True) as s:
            q = select(GpuRow).with_for_update()
            if isinstance(target, str):
                q = q.where(or_(GpuRow.id == target, GpuRow.node == target))
            else:
                q = q.where(GpuRow.id.in_(list(target)))
            rows = s.scalars(q).all()
            for row in rows:
                if row.up != up:
                    row.up = up
                    row.down_reason = None if up else (reason or "marked down")
                    row.updated_at = now
            return sorted((r.id for r in rows), key=_natural)

    # ------------------------------------------------------------------ the cost ledger

    def allocations(
        self, team: str | None = None, since: float | None = None, job_id: int | None = None
    ) -> list[LedgerRow]:
        """GPU allocations, with their job's team and their attempt's outcome; `since` keeps
        those still open or ended at or after it."""
        q = (
            select(
                AllocationRow.job_id,
                JobRow.team,
                AttemptRow.number,
                AllocationRow.gpu_id,
                AllocationRow.node,
                AllocationRow.gpu_type,
                AllocationRow.price_class,
                AllocationRow.started_at,
                AllocationRow.ended_at,
                AttemptRow.outcome,
            )
            .join(AttemptRow, AttemptRow.id == AllocationRow.attempt_id)
            .join(JobRow, JobRow.id == AllocationRow.job_id)
            .order_by(AllocationRow.started_at, AllocationRow.id)
        )
        if team is not None:
            q = q.where(JobRow.team == team)
        if job_id is not None:
            q = q.where(AllocationRow.job_id == job_id)
        if since is not None:
            q = q.where(or_(AllocationRow.ended_at.is_(None), AllocationRow.ended_at >= since))
        with self._session(write=False) as s:
            return [
                LedgerRow(
                    job_id=r.job_id,
                    team=r.team,
                    attempt=r.number,
                    gpu_id=r.gpu_id,
                    node=r.node,
                    gpu_type=r.gpu_type,
                    price_class=cast(PriceClass, r.price_class),
                    start=r.started_at,
                    end=r.ended_at,
                    outcome=cast("Outcome | None", r.outcome),
                )
                for r in s.execute(q)
            ]


__all__ = [
    "Allocation",
    "Attempt",
    "Checkpoint",
    "ConflictError",
    "GpuLike",
    "GpuRecord",
    "Job",
    "LedgerRow",
    "Outcome",
    "Principal",
    "Store",
    "TeamRecord",
    "TokenRecord",
    "Transition",
    "default_url",
]
