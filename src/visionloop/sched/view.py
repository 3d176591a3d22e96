"""What the scheduling policy sees and what it decides: plain frozen data, no database, no
processes. The control plane builds a `ClusterView` from its store and executor; the
simulator builds one from a trace in simulated time. Both hand it to the same policy.

Times are seconds on one clock (wall-clock epoch seconds in the control plane, simulated
seconds in the simulator); the policy never reads a clock itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

SpotPolicy = Literal["never", "allowed", "preferred"]
PriceClass = Literal["owned", "on_demand", "spot"]

# Priority classes by rank: a larger rank is more important. The control plane reads the
# user's classes from its config; these are the defaults (and the traces' classes).
DEFAULT_PRIORITIES: Mapping[str, int] = {"low": 10, "normal": 50, "high": 100}


@dataclass(frozen=True, slots=True)
class Gpu:
    id: str  # unique, e.g. "node0/3"
    node: str
    type: str  # e.g. "A100-80GB", matched against the price catalog
    price_class: PriceClass = "owned"
    up: bool = True  # False while a spot interruption has taken it away

    @property
    def spot(self) -> bool:
        return self.price_class == "spot"


@dataclass(frozen=True, slots=True)
class Team:
    name: str
    nominal_gpus: int  # the team's entitlement: what it can always reclaim
    borrow_limit: int = 0  # GPUs it may use beyond nominal while others leave them idle
    weight: float = 1.0  # fair-share weight


def remaining_gpu_s(gpus: int, limit_s: float | None, attained_gpu_s: float) -> float | None:
    """The GPU-time a queued job has left by its time limit ("srpt"): GPUs x limit - GPU-time
    received. None without a limit. A job that has received its whole limit and is not done
    said nothing true about its length: it counts what it has received, as a job without a
    limit does under "las" (limits are never enforced, so an understated one must not keep a
    job first in line for ever). Running jobs are judged as victims otherwise (cycle_state.py)."""
    if limit_s is None:
        return None
    budget = gpus * limit_s
    return budget - attained_gpu_s if attained_gpu_s < budget else attained_gpu_s


def planned_runtime_s(job: PendingJob | ActiveJob) -> float | None:
    """How long a job is planned to run: the time limit its owner gave, else what the runs
    of the same spec or architecture before it took; None when neither is known."""
    return job.max_runtime_s if job.max_runtime_s is not None else job.expected_runtime_s


def planned_runtime(
    max_runtime_s: float | None, expected_runtime_s: float | None
) -> tuple[float, Literal["max_runtime", "history"]] | None:
    """`planned_runtime_s`'s rule on a job's two fields, with which one it used (what
    `jobs show` tells a user)."""
    if max_runtime_s is not None:
        return max_runtime_s, "max_runtime"
    if expected_runtime_s is not None:
        return expected_runtime_s, "history"
    return None


@dataclass(frozen=True, slots=True)
class PendingJob:
    id: str
    team: str
    priority: int  # rank of its priority class (DEFAULT_PRIORITIES)
    gpus: int
    submitted_at: float
    spot: SpotPolicy = "allowed"
    cpus: float = 0.0
    memory_gb: float = 0.0
    attained_gpu_s: float = 0.0  # GPU-seconds received so far (least-attained-service order)
    not_before: float = 0.0  # retry back-off: not placeable before this time
    nodes: int = 1  # one process group over this many nodes, gpus / nodes on each
    # The time limit its owner gave (`max_runtime` in the job spec; None: none given). What
    # backfill judges it by: it may start on GPUs a reservation needs only if it ends first.
    max_runtime_s: float | None = None
    # How long the runs of the same spec or architecture before it took (sched/history.py;
    # None: none ran). Planned with where no limit was given (`planned_runtime_s`).
    expected_runtime_s: float | None = None
    # Will it write a checkpoint when asked to stop, once running (as `ActiveJob`'s)? Then
    # starting it as a tenant that may have to step aside costs it almost nothing.
    checkpoints_at_stop: bool = False


@dataclass(frozen=True, slots=True)
class ActiveJob:
    id: str
    team: str
    priority: int
    gpu_ids: tuple[str, ...]
    started_at: float  # start of the current allocation
    spot: SpotPolicy = "allowed"
    cpus: float = 0.0
    memory_gb: float = 0.0
    last_checkpoint_at: float | None = None
    # GPU-seconds received so far, this allocation included (what "las" and "srpt" judge).
    attained_gpu_s: float = 0.0
    # False once the job is already on its way out (preempting, cancelling): it still holds
    # its GPUs but must not be chosen as a victim again.
    preemptible: bool = True
    # When it was first submitted (None: unknown). With priority aging, a job that started
    # after a long wait keeps its aged class against preemption; without it, it is ignored.
    submitted_at: float | None = None
    # When it should end at the pace it reported in this allocation (None: not known yet).
    # An estimate from the job's own progress, never a promise: what reservations plan with.
    expected_end: float | None = None
    # Its owner's time limit for one allocation (None: none given): the end a reservation
    # plans with until the job reports a pace.
    max_runtime_s: float | None = None
    # ...else what the runs of the same spec or architecture before it took (history.py).
    expected_runtime_s: float | None = None
    # It writes a checkpoint when asked to stop (SIGTERM), so an eviction loses only the
    # grace period, not the work since `last_checkpoint_at` ("las" preemption reads it).
    checkpoints_at_stop: bool = False
    # The queued job it steps aside for, once on its way out (the eviction's `for_job`): the
    # policy may keep the GPUs it releases for that job (`ClusterView.freed_for`).
    leaving_for: str | None = None


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    cpus: float | None = None  # None: not limited by the policy
    memory_gb: float | None = None


@dataclass(frozen=True)
class ClusterView:
    now: float
    gpus: Sequence[Gpu]
    teams: Mapping[str, Team]
    running: Sequence[ActiveJob]
    queued: Sequence[PendingJob]
    nodes: Mapping[str, Node] = field(default_factory=dict)
    # Free GPUs that a job just released stepping aside for a queued job, having written a
    # checkpoint at SIGTERM (GPU id -> `Freed`), for the first cycle after: the policy may
    # keep them for that job (`PolicyConfig.hold_freed_for_job`), so that no job ahead of it
    # takes what it evicted for and it must evict again.
    freed_for: Mapping[str, Freed] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Freed:
    """A GPU a job just released stepping aside for a queued job (`ClusterView.freed_for`)."""

    for_job: str
    by_team: str  # the team of the job that released it


@dataclass(frozen=True, slots=True)
class Placement:
    job_id: str
    gpu_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Eviction:
    job_id: str
    reason: str  # stored as the transition reason, e.g. "preempted by job 42 (priority high)"
    for_job: str | None = None


@dataclass
class Decision:
    placements: list[Placement] = field(default_factory=list)
    evictions: list[Eviction] = field(default_factory=list)
    # Every queued job that was not placed, with the reason shown to its owner
    # ("waiting for 4 GPUs: 2 free, team quota 2 + borrow 0 used"), so nothing waits silently.
    waiting: dict[str, str] = field(default_factory=dict)
    # Waiting jobs holding a reservation: when it is expected to start (the running jobs'
    # expected ends; see `reservation.py`). An estimate shown to users, re-derived each cycle.
    starts: dict[str, float] = field(default_factory=dict)
    # ...and the GPUs promised to it (free ones may be lent to jobs that end before it starts).
    reserved: dict[str, tuple[str, ...]] = field(default_factory=dict)
