"""The job store's cost ledger: the GPU allocations, with their job's team and their
attempt's outcome, that `cost report` prices."""

from __future__ import annotations

from typing import cast

from sqlalchemy import or_, select

from visionloop.sched.db import AllocationRow, AttemptRow, JobRow
from visionloop.sched.records import LedgerRow, Outcome
from visionloop.sched.store.base import StoreBase
from visionloop.sched.view import PriceClass


class LedgerMixin(StoreBase):
    """Reads of the allocations, for the cost ledger."""

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
