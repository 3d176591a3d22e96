"""What a simulation hands back: each job's record and the run's measures (GPU-time, lost
work, the quota guarantee, wasted evictions); `metrics.summarize` turns them into figures."""

from __future__ import annotations

from dataclasses import dataclass, field

from visionloop.sched.view import PriceClass

# An eviction is wasted when the job it was for has not started this long after the grace.
WASTED_AFTER_S = 300.0


@dataclass
class JobRecord:
    id: str
    team: str
    priority: str
    gpus: int
    spot: str
    submit: float
    duration_s: float
    first_start: float | None = None
    finish: float | None = None
    queued_s: float = 0.0  # total time waiting in the queue (first wait and after stops)
    preemptions: int = 0
    interruptions: int = 0

    @property
    def jct(self) -> float | None:
        return None if self.finish is None else self.finish - self.submit


@dataclass
class SimResult:
    jobs: list[JobRecord]
    start: float  # first submission
    end: float  # last completion (or when the simulation gave up)
    busy_gpu_s: dict[tuple[str, PriceClass], float]  # (gpu type, price class) -> GPU-seconds allocated
    team_gpu_s: dict[str, float]  # team -> GPU-seconds allocated
    up_gpu_s: dict[tuple[str, PriceClass], float]  # (gpu type, price class) -> GPU-seconds available
    lost_gpu_s: dict[str, float]  # "preempted" / "interrupted" -> GPU-seconds that produced nothing kept
    useful_gpu_s: float
    cycles: int
    unfinished: list[str]
    # GPU-seconds held per team while every team of the cluster had jobs waiting: the share a
    # policy gives each team under contention (over a whole run it is fixed by the workload).
    contended_team_gpu_s: dict[str, float] = field(default_factory=dict)
    contended_s: float = 0.0  # how long that was
    # The quota guarantee: seconds per team during which one of its queued jobs would have
    # fit in the team's unused nominal quota, yet waited.
    quota_wait_s: dict[str, float] = field(default_factory=dict)
    # ...its longest unbroken stretch per team, and how many stretches lasted longer than the
    # guarantee allows: a cycle (`tick_s`) plus the grace period that a reclaim waits for.
    quota_wait_longest_s: dict[str, float] = field(default_factory=dict)
    quota_wait_late: int = 0
    # ...of which began while fewer GPUs were up than the nominal quotas add up to (a spot
    # node down): then not every team can have its quota, whatever the policy.
    quota_wait_late_short: int = 0
    # The same, counting only while the GPUs existed: free, or lent to teams beyond their
    # nominal quota, of a kind the job accepts (`quota.waiting_in_quota`). What remains
    # is what the policy, not the cluster, failed to give.
    quota_wait_late_reclaimable: int = 0
    quota_wait_late_reclaimable_short: int = 0  # ...of which began short of GPUs, as above
    quota_wait_longest_reclaimable_s: dict[str, float] = field(default_factory=dict)
    # The guarantee job by job, while the GPUs existed: jobs that waited longer than it
    # allows in their team's unused quota (a job may do so more than once), of which begun
    # short of GPUs, and the longest such wait.
    quota_jobs_late: int = 0
    quota_jobs_late_short: int = 0
    quota_job_longest_s: float = 0.0
    # Evictions that named the job they were for, and those of them after which that job
    # did not start within the grace period plus WASTED_AFTER_S: the victim lost its place
    # for nothing (a scheduler whose evictions name no job counts none).
    named_evictions: int = 0
    wasted_evictions: int = 0
