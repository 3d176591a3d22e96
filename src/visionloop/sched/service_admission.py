"""Admission: what a caller may do, and whether a job may enter the queue. A submitted spec
is checked for everything it will need (its team, priority class, paths under the team's
allowed roots, a readable dataset, GPUs the cluster could ever give it) so that nothing
waits forever in the queue for a reason nobody sees."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from visionloop.core.errors import DataError, NotFoundError, VisionloopError
from visionloop.data.shardcheck import check_dataset
from visionloop.sched.config import DEFAULT_TEAM
from visionloop.sched.executors.base import multi_node
from visionloop.sched.placement import capacities
from visionloop.sched.service_base import PlaneBase
from visionloop.sched.store import Job
from visionloop.spec_errors import format_validation_error
from visionloop.spec_files import spec_paths
from visionloop.specs import JobSpec, TrainSpec


class SubmitError(VisionloopError):
    """A submission the control plane refuses (the API answers 4xx with this message)."""

    exit_code = 2

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Principal:
    """Who is calling: a team's token, or an admin token (team None)."""

    team: str | None
    admin: bool

    def may_see(self, job: Job) -> bool:
        return self.admin or job.team == self.team


def _under(path: Path, real_roots: list[Path]) -> bool:
    try:
        real = Path(os.path.realpath(path))
    except (OSError, ValueError):  # a NUL byte, say: never a path a job may use
        return False
    return any(real.is_relative_to(root) for root in real_roots)


class AdmissionMixin(PlaneBase):
    """Submitting a job, the checks it passes first, and which jobs a caller may see."""

    def submit(
        self,
        principal: Principal,
        doc: Mapping[str, Any],
        *,
        team: str | None = None,
        priority: str | None = None,
        gpus: int | None = None,
        spot: str | None = None,
        max_runtime: str | float | None = None,
        idempotency_key: str | None = None,
    ) -> Job:
        """Validate everything a job needs *now*, so nothing waits forever in the queue for a
        reason nobody sees: the spec, the team, the priority class, and that the cluster
        could ever hold it."""
        job_doc = dict(doc) if "train" in doc else {"train": dict(doc)}
        overrides: dict[str, Any] = {}
        if priority is not None:
            overrides["priority"] = priority
        if spot is not None:
            overrides["spot"] = spot
        if team is not None:
            overrides["team"] = team
        if max_runtime is not None:
            overrides["max_runtime"] = max_runtime  # validated with the spec: one error format
        job_doc.update(overrides)
        if gpus is not None:
            job_doc["resources"] = {**dict(job_doc.get("resources") or {}), "gpus": gpus}
        from pydantic import ValidationError

        try:
            job = JobSpec.model_validate(job_doc)
        except ValidationError as e:
            raise SubmitError(format_validation_error(e, JobSpec, "the job spec")) from e
        team_name = job.team or principal.team or DEFAULT_TEAM
        if not principal.admin and team_name != principal.team:
            raise SubmitError(
                f"your token belongs to team {principal.team!r}; it cannot submit for team {team_name!r}.",
                status=403,
            )
        if self.store.get_team(team_name) is None:
            known = ", ".join(t.name for t in self.store.list_teams()) or "none"
            raise SubmitError(
                f"unknown team {team_name!r}; known teams: {known}. An admin adds one with "
                f"`visionloop admin team set {team_name} --nominal N`.",
                status=404,
            )
        try:
            rank = self.config.priority_rank(job.priority)
        except VisionloopError as e:
            raise SubmitError(str(e)) from e
        self._check_fits(job)
        if job.resources.nodes > 1 and not multi_node(self.executor):
            raise SubmitError(
                f"resources.nodes: {job.resources.nodes} runs one job across machines, which needs the Ray "
                f'or Slurm executor ([executor] kind = "ray" or "slurm" in cluster.toml); the '
                f"{self.executor.name} executor runs a job on one machine: use nodes: 1 "
                f"(e.g. resources: {{gpus: {job.resources.gpus}}})."
            )
        self.check_paths(job.train, team_name)
        self._check_dataset(job.train)
        return self.store.submit(
            dict(doc),
            job,
            team=team_name,
            priority_rank=rank,
            run_dir=None,
            idempotency_key=idempotency_key,
            now=self.clock(),
            max_queued=self.config.max_queued_per_team,
        )

    def _check_fits(self, job: JobSpec) -> None:
        # The same capacity the policy judges "never fits" by, so submit refuses exactly
        # what the queue could never place.
        total, biggest = capacities(self.store.list_gpus())[job.spot]
        need = job.resources.gpus
        if need > biggest:
            where = "non-spot " if job.spot == "never" else ""
            raise SubmitError(
                f"the job asks for {need} GPUs but the largest machine has {biggest} {where}GPUs "
                f"({total} in all). Ask for at most {biggest} (--gpus {biggest})"
                + (" or allow spot capacity (--spot allowed)." if job.spot == "never" else "."),
            )

    def allowed_roots(self, team: str) -> tuple[Path, ...]:
        """The folders `team`'s jobs may read (cluster.toml's `allowed_roots`, else the home's
        datasets/ and weights/)."""
        roots = self.config.roots_for(team)
        return roots if roots is not None else (self.settings.datasets_dir, self.settings.weights_dir)

    def check_paths(self, train: TrainSpec, team: str) -> None:
        """Every path in the spec is absolute and, with symbolic links and `..` resolved, lies
        under one of the team's allowed roots. Admins submitting for a team are bound by that
        team's roots too. Called at submit and again before every launch (a path may have been
        re-pointed meanwhile). The refusal is the same whether the path exists or not, and
        names the path as given, never what it resolved to."""
        roots = self.allowed_roots(team)
        real_roots = [Path(os.path.realpath(r)) for r in roots]
        for field, path in spec_paths(train):
            if not path.is_absolute():
                raise SubmitError(
                    f"{field} {path} is relative; the control plane cannot know relative to what. "
                    "Submit with `visionloop submit` (it resolves paths against the spec file) or give an "
                    "absolute path."
                )
            if not _under(path, real_roots):
                where = self.config.source or "the cluster config (cluster.toml)"
                raise SubmitError(
                    f"{field} {path} is outside the allowed roots of team {team!r}: "
                    f"{', '.join(str(r) for r in roots)}. Every path in a job spec must lie under one of "
                    "them once symbolic links and '..' are resolved. Put the file there, or ask an admin "
                    f"to add its folder to the team's allowed_roots in {where}.",
                    status=403,
                )

    def _check_dataset(self, train: TrainSpec) -> None:
        # Runs after check_paths, which has refused a relative or out-of-roots data.dataset.
        dataset = Path(train.data.dataset)
        if not (dataset / "dataset.json").is_file():
            raise SubmitError(
                f"data.dataset {dataset} is not a dataset folder (no dataset.json). "
                "Make one with `visionloop data ingest SOURCE --out DIR`."
            )
        try:
            # Its manifest and shard indexes, exactly as ingest writes them: a dataset that would
            # be refused when the job starts (or that tries to run code) is refused now.
            check_dataset(dataset)
        except DataError as e:
            raise SubmitError(f"data.dataset: {e}") from e

    def visible_job(self, principal: Principal, job_id: int) -> Job:
        try:
            job = self.store.get_job(job_id)
        except NotFoundError:
            job = None
        if job is None or not principal.may_see(job):
            # The same answer for "absent" and "another team's": ids leak nothing.
            raise NotFoundError(f"no job {job_id} visible to you; `visionloop jobs list` shows yours.")
        return job

    @staticmethod
    def _who(principal: Principal) -> str:
        return "an admin" if principal.admin else f"team {principal.team}"
