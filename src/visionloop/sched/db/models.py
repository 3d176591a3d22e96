"""The job store's tables as SQLAlchemy 2 ORM models, and the values their check
constraints allow. A change here needs a migration (`visionloop.sched.db.new_revision`)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    CheckConstraint,
    Double,
    ForeignKey,
    Index,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

JOB_STATES = (
    "queued",
    "running",
    "preempting",
    "cancelling",
    "paused",  # a tuning trial stopped at a rung through its checkpoint, until promoted (0002)
    "succeeded",
    "failed",
    "cancelled",
    "pruned",  # a tuning trial its study stopped for good at a rung (0002)
)
# Added in 0002, for tuning trials stopped at a rung through a checkpoint (neither preempted
# nor failed): "paused" when the trial may be promoted and resumed, "pruned" when it is done.
OUTCOMES = ("succeeded", "failed", "preempted", "interrupted", "lost", "cancelled", "paused", "pruned")
PRICE_CLASSES = ("owned", "on_demand", "spot")
SPOT_POLICIES = ("never", "allowed", "preferred")

# Names for every constraint and index, so migrations can refer to them on both backends
# (SQLite's batch mode needs them to alter a table).
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {float: Double(), dict[str, Any]: JSON()}  # noqa: RUF012


class TeamRow(Base):
    __tablename__ = "teams"
    __table_args__ = (
        CheckConstraint("nominal_gpus >= 0", name="nominal_gpus"),
        CheckConstraint("borrow_limit >= 0", name="borrow_limit"),
        CheckConstraint("weight > 0", name="weight"),
    )

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    nominal_gpus: Mapped[int]
    borrow_limit: Mapped[int]
    weight: Mapped[float]
    created_at: Mapped[float]
    updated_at: Mapped[float]


class TokenRow(Base):
    """An API token: only its SHA-256 is stored, so a copy of the database grants nothing."""

    __tablename__ = "api_tokens"
    __table_args__ = (CheckConstraint("admin OR team IS NOT NULL", name="owner"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    team: Mapped[str | None] = mapped_column(String(64), ForeignKey("teams.name"))
    admin: Mapped[bool] = mapped_column(Boolean)
    label: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[float]
    revoked_at: Mapped[float | None]


class JobRow(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        # A client that retries a submit with its key gets the same job back, never a second.
        # NULL keys are distinct on both backends, so jobs without a key never collide.
        UniqueConstraint("team", "idempotency_key"),
        Index(None, "state", "submitted_at"),  # the queue: state = 'queued' in FIFO order
        Index(None, "team", "state"),
        Index(None, "shape_key", "state"),  # the runtime history of a shape (sched/history.py)
        CheckConstraint(_one_of("state", JOB_STATES), name="state"),
        CheckConstraint(_one_of("spot", SPOT_POLICIES), name="spot"),
        CheckConstraint("gpus >= 0", name="gpus"),
        # Ids are shown to users: never hand out a deleted job's id again.
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str | None] = mapped_column(String(200))
    team: Mapped[str] = mapped_column(String(64), ForeignKey("teams.name"))
    priority: Mapped[str] = mapped_column(String(64))  # the class's name, as submitted
    priority_rank: Mapped[int]  # its rank when submitted; larger is more important
    spot: Mapped[str] = mapped_column(String(16))
    gpus: Mapped[int]
    # Nodes its one process group spans (a job across nodes: gpus are spread evenly over them).
    nodes: Mapped[int] = mapped_column(default=1, server_default="1")
    cpus: Mapped[float]
    memory_gb: Mapped[float]
    max_restarts: Mapped[int]
    spec_doc: Mapped[dict[str, Any]]  # the document as submitted, verbatim
    train_spec: Mapped[dict[str, Any]]  # the effective, validated train spec
    run_dir: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16))
    state_since: Mapped[float]
    waiting_reason: Mapped[str | None] = mapped_column(Text)
    restarts: Mapped[int] = mapped_column(default=0)  # failures retried
    preemptions: Mapped[int] = mapped_column(default=0)
    attempt: Mapped[int] = mapped_column(default=0)  # the latest attempt's number (0: none yet)
    not_before: Mapped[float] = mapped_column(default=0.0)  # retry back-off
    attained_gpu_s: Mapped[float] = mapped_column(default=0.0)
    last_checkpoint_at: Mapped[float | None]
    last_heartbeat_at: Mapped[float | None]
    submitted_at: Mapped[float]
    updated_at: Mapped[float]
    started_at: Mapped[float | None]  # first attempt's start
    finished_at: Mapped[float | None]
    exit_code: Mapped[int | None]
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    version: Mapped[int] = mapped_column(default=1)  # +1 on every change: an ETag for clients
    # The latest pace the job reported (visionloop.train.progress): step of total at rate
    # steps/s, as of pace_at. Kept across attempts: a requeued job's remaining work.
    pace_step: Mapped[int | None]
    pace_total: Mapped[int | None]
    pace_rate: Mapped[float | None]
    pace_at: Mapped[float | None]
    # The job spec's `max_runtime` in seconds (None: none given): the time limit reservations
    # and EASY backfill plan with (never enforced). A column, not only in spec_doc, because
    # the scheduler's view reads it for every queued job each cycle.
    max_runtime_s: Mapped[float | None]
    # What the job runs (a typed workload's document); None: a training job, from train_spec.
    # none_as_null: None is stored as SQL NULL, not as the JSON value null, so that SQL can
    # tell training jobs apart (`workload_doc IS NULL`).
    workload_doc: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    # Its keys into the runtime history (sched/history.py): the same work (spec) and the same
    # architecture on the same data and GPUs (shape), and its length in epochs or steps.
    # NULL for jobs from before revision 0007: they neither get nor give an estimate.
    spec_key: Mapped[str | None] = mapped_column(String(32))
    shape_key: Mapped[str | None] = mapped_column(String(32))
    run_length: Mapped[int | None]
    # Seconds its attempts held GPUs, set when it ended after running its whole length
    # (succeeded, or a trial paused at its rung): one sample of the history.
    ran_s: Mapped[float | None]
    # While it is PREEMPTING, the job it steps aside for (None: none in particular, or not on
    # its way out): the GPUs it releases stay that job's (sched/owed.py). Revision 0008.
    leaving_for: Mapped[int | None]


class TransitionRow(Base):
    """One row per state change, written in the same transaction as the change."""

    __tablename__ = "job_transitions"
    __table_args__ = (Index(None, "job_id", "id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    from_state: Mapped[str | None] = mapped_column(String(16))  # None: the submission
    to_state: Mapped[str] = mapped_column(String(16))
    at: Mapped[float]
    reason: Mapped[str] = mapped_column(Text)


class AttemptRow(Base):
    """One run of a job's process: from placement to its exit (or loss)."""

    __tablename__ = "attempts"
    __table_args__ = (
        UniqueConstraint("job_id", "number"),
        # The reconciler's query after a restart: every attempt still open.
        Index(
            "ix_attempts_open",
            "job_id",
            sqlite_where=text("ended_at IS NULL"),
            postgresql_where=text("ended_at IS NULL"),
        ),
        CheckConstraint(f"outcome IS NULL OR {_one_of('outcome', OUTCOMES)}", name="outcome"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    number: Mapped[int]  # 1, 2, ... per job
    executor: Mapped[str] = mapped_column(String(64))
    # What the executor needs to find the process again after a control-plane restart.
    handle: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    started_at: Mapped[float]
    ended_at: Mapped[float | None]
    exit_code: Mapped[int | None]
    outcome: Mapped[str | None] = mapped_column(String(16))


class AllocationRow(Base):
    """One GPU held by one attempt: the cost ledger's raw data."""

    __tablename__ = "allocations"
    __table_args__ = (
        # Never double-booked, even by two schedulers racing: at most one open row per GPU.
        Index(
            "uq_allocations_gpu_held",
            "gpu_id",
            unique=True,
            sqlite_where=text("ended_at IS NULL"),
            postgresql_where=text("ended_at IS NULL"),
        ),
        Index(None, "job_id"),
        Index(None, "attempt_id"),
        Index(None, "started_at"),
        CheckConstraint(_one_of("price_class", PRICE_CLASSES), name="price_class"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    attempt_id: Mapped[int] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    gpu_id: Mapped[str] = mapped_column(String(128))
    node: Mapped[str] = mapped_column(String(128))
    gpu_type: Mapped[str] = mapped_column(String(64))
    price_class: Mapped[str] = mapped_column(String(16))
    started_at: Mapped[float]
    ended_at: Mapped[float | None]


class LabellingCostRow(Base):
    """What labelling the images of one dataset version cost (`visionloop data add
    --cost-per-image`), against the team that paid: the ledger's other kind of spending."""

    __tablename__ = "labelling_costs"
    __table_args__ = (
        # A version is labelled once: recording it again is the same entry, not a second bill.
        UniqueConstraint("dataset_version"),
        Index(None, "team", "recorded_at"),
        CheckConstraint("images >= 0 AND cost >= 0", name="nonnegative"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    team: Mapped[str] = mapped_column(String(64), ForeignKey("teams.name"))  # a bill outlives no team
    dataset_version: Mapped[str] = mapped_column(String(64))
    dataset_path: Mapped[str] = mapped_column(Text)
    parent_version: Mapped[str | None] = mapped_column(String(64))
    images: Mapped[int]
    cost: Mapped[float]
    recorded_at: Mapped[float]
    recorded_by: Mapped[str] = mapped_column(String(128))


class GpuRow(Base):
    """The inventory. Up/down is durable so that a spot interruption survives a restart."""

    __tablename__ = "gpus"
    __table_args__ = (
        Index(None, "node"),
        CheckConstraint(_one_of("price_class", PRICE_CLASSES), name="price_class"),
    )

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    node: Mapped[str] = mapped_column(String(128))
    type: Mapped[str] = mapped_column(String(64))
    price_class: Mapped[str] = mapped_column(String(16))
    up: Mapped[bool] = mapped_column(Boolean)
    down_reason: Mapped[str | None] = mapped_column(Text)
    updated_at: Mapped[float]


class CheckpointRow(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (Index(None, "job_id", "at"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int | None]
    step: Mapped[int]
    at: Mapped[float]
