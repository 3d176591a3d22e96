"""The job store's cost ledger: the GPU allocations, with their job's team and their
attempt's outcome, that `cost report` prices; and what labelling each dataset version cost."""

from __future__ import annotations

import math
from typing import cast

from sqlalchemy import or_, select

from visionloop.core.errors import StoreError
from visionloop.sched.db import AllocationRow, AttemptRow, JobRow, LabellingCostRow
from visionloop.sched.records import LabellingCost, LedgerRow, Outcome
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

    def record_labelling(self, entry: LabellingCost) -> tuple[LabellingCost, bool]:
        """Record what labelling `entry.dataset_version` cost; (the entry stored, True if this
        call stored it). A version is billed once: recording the same figures again returns
        the stored entry; different figures (another team, images or cost) are a StoreError."""
        if entry.images < 0 or not (math.isfinite(entry.cost) and entry.cost >= 0):
            raise StoreError(f"a labelling cost needs images >= 0 and a finite cost >= 0, got {entry}")
        with self._session(write=True) as s:
            row = s.scalar(
                select(LabellingCostRow).where(LabellingCostRow.dataset_version == entry.dataset_version)
            )
            if row is not None:
                stored = _labelling(row)
                same = (stored.team, stored.images, stored.cost) == (entry.team, entry.images, entry.cost)
                if not same:
                    raise AlreadyBilledError(
                        f"dataset version {entry.dataset_version[:12]} is already in the ledger with "
                        f"{stored.images} images for {stored.cost:g} (team {stored.team}); a version is "
                        "billed once."
                    )
                return stored, False
            s.add(
                LabellingCostRow(
                    team=entry.team,
                    dataset_version=entry.dataset_version,
                    dataset_path=entry.dataset_path,
                    parent_version=entry.parent_version,
                    images=entry.images,
                    cost=entry.cost,
                    recorded_at=entry.recorded_at,
                    recorded_by=entry.recorded_by,
                )
            )
        return entry, True

    def labelling_costs(self, team: str | None = None, since: float | None = None) -> list[LabellingCost]:
        """The labelling ledger, oldest first; `since` keeps the entries recorded at or after it."""
        q = select(LabellingCostRow).order_by(LabellingCostRow.recorded_at, LabellingCostRow.id)
        if team is not None:
            q = q.where(LabellingCostRow.team == team)
        if since is not None:
            q = q.where(LabellingCostRow.recorded_at >= since)
        with self._session(write=False) as s:
            return [_labelling(r) for r in s.scalars(q)]


class AlreadyBilledError(StoreError):
    """The dataset version is in the labelling ledger with other figures."""


def _labelling(row: LabellingCostRow) -> LabellingCost:
    return LabellingCost(
        team=row.team,
        dataset_version=row.dataset_version,
        dataset_path=row.dataset_path,
        parent_version=row.parent_version,
        images=row.images,
        cost=row.cost,
        recorded_at=row.recorded_at,
        recorded_by=row.recorded_by,
    )
