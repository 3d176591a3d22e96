"""The job store's records: plain frozen data that `Store` returns, detached from any
database session, so a caller can keep, compare or serialise them (`dataclasses.asdict`)
and can never change state behind the store's back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

from visionloop.core.errors import SpecError, StoreError
from visionloop.sched.states import JobState
from visionloop.sched.view import Gpu, PriceClass, SpotPolicy, Team
from visionloop.specs import TrainSpec

if TYPE_CHECKING:
    from visionloop.sched.workload import Workload

# How an attempt ended: preempted (by the scheduler, exit 75 after SIGTERM), interrupted (a
# spot GPU went away), lost (the process vanished or stopped heart-beating).
# "paused": a tuning trial stopped at a rung through its checkpoint, and later promoted (it
# went on); "pruned": such a stop its study made final (see sched/workload.py TrialWorkload).
Outcome = Literal["succeeded", "failed", "preempted", "interrupted", "lost", "cancelled", "paused", "pruned"]


class GpuLike(Protocol):
    """What the store needs to know of a GPU (view.Gpu, an executor's discovery, ...)."""

    @property
    def id(self) -> str: ...
    @property
    def node(self) -> str: ...
    @property
    def type(self) -> str: ...
    @property
    def price_class(self) -> str: ...


@dataclass(frozen=True, slots=True)
class TeamRecord:
    name: str
    nominal_gpus: int
    borrow_limit: int
    weight: float
    created_at: float
    updated_at: float

    def as_view(self) -> Team:
        return Team(self.name, self.nominal_gpus, self.borrow_limit, self.weight)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a token belongs to: a team, or an admin (team None or not)."""

    token_id: int
    team: str | None
    admin: bool
    label: str


@dataclass(frozen=True, slots=True)
class TokenRecord:
    id: int
    team: str | None
    admin: bool
    label: str
    created_at: float
    revoked_at: float | None


def pace_end(
    step: int | None, total: int | None, rate: float | None, at: float | None, since: float, now: float
) -> float | None:
    """When a job that reported `step` of `total` at `rate` steps/s at time `at` should end
    (never before `now`); None without a pace told since `since` (its attempt's start: a pace
    from an earlier attempt says nothing of this one's)."""
    if step is None or total is None or rate is None or at is None or at < since or rate <= 0:
        return None
    return max(now, at + (total - step) / rate)


class ViewJob(NamedTuple):
    """The columns of a job the scheduler's view needs (`Store.view_jobs`): a plain row, so
    that reading 10,000 queued jobs every cycle converts nothing it does not use."""

    id: int
    team: str
    state: str  # a JobState value
    priority_rank: int
    gpus: int
    submitted_at: float
    spot: SpotPolicy
    cpus: float
    memory_gb: float
    attained_gpu_s: float
    not_before: float | None
    last_checkpoint_at: float | None
    nodes: int
    pace_step: int | None
    pace_total: int | None
    pace_rate: float | None
    pace_at: float | None
    max_runtime_s: float | None
    # Its keys into the runtime history (sched/history.py); None for jobs from before them.
    spec_key: str | None
    shape_key: str | None
    run_length: int | None
    leaving_for: int | None  # while PREEMPTING, the job it steps aside for


@dataclass(frozen=True, slots=True)
class Job:
    id: int
    name: str | None
    team: str
    priority: str
    priority_rank: int
    spot: SpotPolicy
    gpus: int
    nodes: int  # nodes its one process group spans (gpus spread evenly over them)
    cpus: float
    memory_gb: float
    max_restarts: int
    run_dir: Path
    state: JobState
    state_since: float  # when it entered `state` (grace periods count from here)
    waiting_reason: str | None  # why a queued job is not running, shown to its owner
    restarts: int  # failures retried
    preemptions: int
    attempt: int  # the latest attempt's number; 0 before the first start
    not_before: float  # retry back-off: not placeable before this time
    attained_gpu_s: float  # GPU-seconds of all ended attempts
    last_checkpoint_at: float | None
    last_heartbeat_at: float | None
    submitted_at: float
    updated_at: float
    started_at: float | None  # the first attempt's start
    finished_at: float | None
    exit_code: int | None  # the latest attempt's
    idempotency_key: str | None
    version: int  # +1 on every change
    # The latest pace it reported: step of total at rate steps/s, as of pace_at (None: none yet).
    pace_step: int | None = None
    pace_total: int | None = None
    pace_rate: float | None = None
    pace_at: float | None = None
    # Its spec's `max_runtime` in seconds (None: none given): planning only, never enforced.
    max_runtime_s: float | None = None
    # While PREEMPTING, the job it steps aside for (None otherwise): its GPUs stay that job's.
    leaving_for: int | None = None
    # The documents are loaded by get_job and submit (and list_jobs(with_specs=True)) only:
    # a scheduler listing 10,000 queued jobs does not need them.
    # What it runs, when not plain training (a tuning trial): sched/workload.py's document.
    workload_doc: dict[str, Any] | None = field(default=None, repr=False)
    spec_doc: dict[str, Any] | None = field(default=None, repr=False)  # verbatim, as submitted
    train_doc: dict[str, Any] | None = field(default=None, repr=False)  # the effective train spec

    def expected_end(self, now: float) -> float | None:
        """When a running job should finish at its reported pace (never before `now`), or
        None: not running, or no pace reported in this attempt yet."""
        if self.state != JobState.RUNNING:
            return None
        return pace_end(self.pace_step, self.pace_total, self.pace_rate, self.pace_at, self.state_since, now)

    @property
    def train_spec(self) -> TrainSpec:
        """The effective train spec, validated again (so a spec the current code cannot read
        fails here, with a message, rather than in a training process)."""
        if self.train_doc is None:
            raise StoreError(f"job {self.id} was listed without its spec; read it with Store.get_job.")
        try:
            return TrainSpec.model_validate(self.train_doc)
        except ValueError as e:
            raise SpecError(f"job {self.id}'s stored train spec is no longer valid: {e}") from e

    @property
    def workload(self) -> Workload:
        """What the job runs: a tuning trial when its workload document says so, else the
        training of its stored train spec."""
        from visionloop.sched.workload import workload_of  # it imports this module

        return workload_of(self.train_spec, self.workload_doc)


@dataclass(frozen=True, slots=True)
class Transition:
    job_id: int
    from_state: JobState | None  # None: the submission
    to_state: JobState
    at: float
    reason: str


@dataclass(frozen=True, slots=True)
class Allocation:
    gpu_id: str
    node: str
    gpu_type: str
    price_class: PriceClass
    started_at: float
    ended_at: float | None


@dataclass(frozen=True, slots=True)
class Attempt:
    job_id: int
    number: int
    executor: str
    handle: dict[str, Any] | None  # what the executor needs to find the process again
    started_at: float
    ended_at: float | None
    exit_code: int | None
    outcome: Outcome | None
    allocations: tuple[Allocation, ...]

    @property
    def gpu_ids(self) -> tuple[str, ...]:
        return tuple(a.gpu_id for a in self.allocations)


@dataclass(frozen=True, slots=True)
class LedgerRow:
    """One GPU held by one attempt: the cost ledger's raw data (priced in sched/cost.py)."""

    job_id: int
    team: str
    attempt: int
    gpu_id: str
    node: str
    gpu_type: str
    price_class: PriceClass
    start: float
    end: float | None  # None while it runs
    outcome: Outcome | None


@dataclass(frozen=True, slots=True)
class LabellingCost:
    """What labelling one dataset version's images cost, against the team that paid."""

    team: str
    dataset_version: str
    dataset_path: str
    parent_version: str | None
    images: int
    cost: float
    recorded_at: float
    recorded_by: str


@dataclass(frozen=True, slots=True)
class Checkpoint:
    job_id: int
    attempt: int | None
    step: int
    at: float


@dataclass(frozen=True, slots=True)
class GpuRecord(Gpu):
    down_reason: str | None = None
    updated_at: float = 0.0
