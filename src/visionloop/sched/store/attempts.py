"""The job store's attempts: starting one (booking its GPUs) and ending it (freeing them),
the handle that finds its process again, and the heartbeats and checkpoints it reports."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from sqlalchemy import Table, bindparam, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from visionloop.core.errors import NotFoundError, StoreError
from visionloop.sched import db
from visionloop.sched.db import AllocationRow, AttemptRow, CheckpointRow, GpuRow, JobRow
from visionloop.sched.records import Allocation, Attempt, Checkpoint, GpuLike, Job, Outcome
from visionloop.sched.states import JobState, TransitionError
from visionloop.sched.store.base import ConflictError, StoreBase, _job, _natural, _plain_json, _rowcount
from visionloop.sched.view import PriceClass


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


class AttemptsMixin(StoreBase):
    """Attempts, the GPU allocations they hold, and what their processes report."""

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

    def record_pace(self, job_id: int, step: int, total: int, rate: float, at: float) -> None:
        """The pace a running job reported (its latest: step of total at rate steps/s, as of
        `at`), from which its expected end is shown. Advisory: no state change, no version
        bump (a client's ETag is about what the job is, not how far it has got)."""
        with self._job_session(job_id) as s:
            row = self._lock_job(s, job_id)
            if row.pace_at is None or at >= row.pace_at:
                row.pace_step, row.pace_total, row.pace_rate, row.pace_at = step, total, rate, at

    def checkpoints(self, job_id: int) -> list[Checkpoint]:
        with self._session(write=False) as s:
            self._exists(s, job_id)
            rows = s.scalars(
                select(CheckpointRow)
                .where(CheckpointRow.job_id == job_id)
                .order_by(CheckpointRow.at, CheckpointRow.id)
            )
            return [Checkpoint(r.job_id, r.attempt, r.step, r.at) for r in rows]
