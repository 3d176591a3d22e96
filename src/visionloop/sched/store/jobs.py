"""The job store's jobs: submitting them, reading them (one, a list, the scheduler's cached
view) and moving them from state to state, each change with its transition row."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from sqlalchemy import Table, bindparam, func, insert, or_, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from visionloop.core.errors import NotFoundError, StoreError
from visionloop.sched.db import AttemptRow, JobRow, TeamRow, TransitionRow
from visionloop.sched.history import (
    SAMPLES_PER_SHAPE,
    Estimate,
    RuntimeHistory,
    RuntimeKey,
    Sample,
    runtime_key,
)
from visionloop.sched.records import Job, Transition, ViewJob
from visionloop.sched.states import ACTIVE, JobState
from visionloop.sched.store.base import (
    _JOB_COLUMNS,
    _LIGHT_COLUMNS,
    ConflictError,
    StoreBase,
    TeamQueueFullError,
    _job,
    _job_from_values,
    _plain_json,
    _rowcount,
)
from visionloop.sched.workload import workload_of
from visionloop.specs import JobSpec, TrainSpec

_SET_RUN_DIR = (
    update(cast(Table, JobRow.__table__))
    .where(cast(Table, JobRow.__table__).c.id == bindparam("b_id"))
    .values(run_dir=bindparam("b_run_dir"))
)


def _history_key(train: TrainSpec, workload_doc: dict[str, Any] | None, gpus: int, nodes: int) -> RuntimeKey:
    """The job's keys into the runtime history (sched/history.py)."""
    return runtime_key(workload_of(train, workload_doc).runtime_profile(), gpus, nodes)


class JobsMixin(StoreBase):
    """Jobs and their transitions."""

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
        max_queued: int | None = None,
    ) -> Job:
        """Queue a job. With an idempotency key, a retried submit returns the job the first
        one created (never a duplicate), and a key reused for a different spec is refused.
        With `max_queued`, a team that already has that many jobs queued is refused
        (TeamQueueFullError); a retry of a job it queued before still gets that job.

        The id is allocated inside the transaction, so the default run folder
        `<runs_dir>/job-<id>` is stored with the job in the same commit."""
        doc = _plain_json(spec_doc)
        if idempotency_key is not None and not 0 < len(idempotency_key) <= 200:
            raise StoreError("an idempotency key is 1-200 characters, e.g. a UUID.")
        res = job.resources
        workload_doc = None if job.trial is None else {"kind": "trial", **job.trial.model_dump()}
        # Everything is computed before the transaction: SQLite's write lock is held only for
        # the statements (plain Core ones: the ORM's unit of work costs milliseconds here).
        values: dict[str, Any] = {
            "name": job.name,
            "team": team,
            "priority": job.priority,
            "priority_rank": priority_rank,
            "spot": job.spot,
            "gpus": res.gpus,
            "nodes": res.nodes,
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
            "pace_step": None,
            "pace_total": None,
            "pace_rate": None,
            "pace_at": None,
            "max_runtime_s": job.max_runtime,
            "leaving_for": None,
            "workload_doc": workload_doc,
            "spec_doc": doc,
            "train_spec": job.train.model_dump(mode="json"),
        }
        key = _history_key(job.train, workload_doc, res.gpus, res.nodes)
        values.update(spec_key=key.spec, shape_key=key.shape, run_length=key.length)
        jobs = cast(Table, JobRow.__table__)
        try:
            with self._session(write=True) as s:
                if idempotency_key is not None:
                    found = self._by_key(s, team, idempotency_key, doc)
                    if found is not None:
                        return found
                # The team's row locked (PostgreSQL; SQLite's write lock is already the whole
                # database's): two submits of one team count its queue one after the other, so
                # the limit is never passed by a race. FOR NO KEY UPDATE, not FOR UPDATE: rows
                # that only reference the team (a ledger entry, another team's job) need not wait.
                lock = {"key_share": True} if max_queued is not None else None
                if s.get(TeamRow, team, with_for_update=lock) is None:
                    raise NotFoundError(
                        f"no team {team!r}; an admin creates it with "
                        f"`visionloop admin team set {team} --nominal N`."
                    )
                if max_queued is not None:
                    queued = s.execute(
                        select(func.count())
                        .select_from(JobRow)
                        .where(JobRow.team == team, JobRow.state == JobState.QUEUED.value)
                    ).scalar_one()
                    if queued >= max_queued:
                        raise TeamQueueFullError(team, queued, max_queued)
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

    def runtime_samples(self, shape_keys: Iterable[str]) -> tuple[Sample, ...]:
        """The runtime history of these shapes (sched/history.py): per shape, the latest
        SAMPLES_PER_SHAPE jobs that ran their whole length (succeeded, or a trial paused at
        its rung), newest first. One indexed query per 500 shapes."""
        table = cast(Table, JobRow.__table__)
        c = table.c
        keys = sorted(set(shape_keys))
        out: list[Sample] = []
        for i in range(0, len(keys), 500):  # within every backend's bound-parameter limit
            newest = (
                func.row_number().over(partition_by=c.shape_key, order_by=(c.state_since.desc(), c.id.desc()))
            ).label("newest")
            inner = (
                select(c.spec_key, c.shape_key, c.run_length, c.ran_s, c.state_since, c.id, newest)
                .where(c.shape_key.in_(keys[i : i + 500]))
                .where(c.state.in_([JobState.SUCCEEDED.value, JobState.PAUSED.value]))
                .where(c.ran_s.is_not(None), c.run_length.is_not(None), c.spec_key.is_not(None))
                .subquery()
            )
            q = (
                select(inner.c.spec_key, inner.c.shape_key, inner.c.run_length, inner.c.ran_s)
                .where(inner.c.newest <= SAMPLES_PER_SHAPE)
                .order_by(inner.c.shape_key, inner.c.state_since.desc(), inner.c.id.desc())
            )
            with self._session(write=False) as s:
                out.extend(Sample(*r) for r in s.execute(q))
        return tuple(out)

    def runtime_estimate(self, job_id: int) -> Estimate | None:
        """What the runs before it say of a queued or running job's run time (history.py):
        what reservations plan it with when it gave no time limit. None for a job that
        ended or paused (it is a sample itself) or that nothing like ran before."""
        c = cast(Table, JobRow.__table__).c
        with self._session(write=False) as s:
            self._exists(s, job_id)
            state, spec, shape, length = s.execute(
                select(c.state, c.spec_key, c.shape_key, c.run_length).where(c.id == job_id)
            ).one()
        if shape is None or not (state == JobState.QUEUED.value or JobState(state) in ACTIVE):
            return None
        return RuntimeHistory(self.runtime_samples([shape])).estimate(spec, shape, length)

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
        leaving_for: int | None = None,
    ) -> Job:
        """Change a job's state, atomically with its transition row and the given fields
        (None leaves a field as it is). `leaving_for`: entering PREEMPTING, the job it steps
        aside for (kept until it leaves that state).

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
            if leaving_for is not None and dst is JobState.PREEMPTING:
                row.leaving_for = leaving_for
            s.flush()
            return _job(row, specs=False)

    # ------------------------------------------------------------------ paused tuning trials

    def resume_paused(self, job_id: int, until_epoch: int | None, reason: str, *, now: float) -> Job:
        """Queue a paused trial again (its study promoted it), heading for `until_epoch` (its
        next rung; None: the end), in one transaction with its new workload document. Its next
        attempt resumes from the checkpoint it paused at.

        TransitionError if it is not paused (another actor moved it first); StoreError if it
        is not a tuning trial, or `until_epoch` is not past the rung it paused at."""
        with self._job_session(job_id) as s:
            row = self._lock_job(s, job_id)
            src = self._check(row, JobState.QUEUED, JobState.PAUSED)
            doc = dict(row.workload_doc or {})
            if doc.get("kind") != "trial":
                raise StoreError(f"job {job_id} is not a tuning trial, so it has no rung to go on to.")
            paused_at = doc.get("until_epoch")
            if until_epoch is not None and paused_at is not None and until_epoch <= int(paused_at):
                raise StoreError(
                    f"job {job_id} paused after epoch {paused_at}; promote it to a later epoch "
                    f"(e.g. {int(paused_at) + 1}), or to the end (no epoch)."
                )
            doc["until_epoch"] = until_epoch
            row.workload_doc = doc  # a new object, so the JSON column is written
            # Heading for another rung: another length, so other history keys.
            key = _history_key(TrainSpec.model_validate(row.train_spec), doc, row.gpus, row.nodes)
            row.spec_key, row.shape_key, row.run_length = key.spec, key.shape, key.length
            self._enter(s, row, src, JobState.QUEUED, reason, now)
            s.flush()
            return _job(row, specs=False)

    def prune(self, job_id: int, reason: str, *, now: float) -> Job:
        """End a paused trial for good (its study pruned it at the rung it paused at). Its last
        attempt's outcome turns from "paused" to "pruned": that stop was final, and the
        GPU-hours it spent are the search's, not a stop that was later resumed.

        TransitionError if it is not paused (another actor moved it first)."""
        with self._job_session(job_id) as s:
            row = self._lock_job(s, job_id)
            src = self._check(row, JobState.PRUNED, JobState.PAUSED)
            s.execute(
                update(AttemptRow)
                .where(AttemptRow.job_id == job_id, AttemptRow.number == row.attempt)
                .where(AttemptRow.outcome == "paused")
                .values(outcome="pruned")
            )
            self._enter(s, row, src, JobState.PRUNED, reason, now)
            s.flush()
            return _job(row, specs=False)

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
