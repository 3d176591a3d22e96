"""The job state machine. Every change of a job's state goes through `check_transition`
inside a store transaction, and is stored with its time and reason.

    queued ──▶ running ──▶ succeeded
      ▲  │        │  │
      │  │        │  └──▶ failed            (exit code other than 0/75, restarts used up)
      │  │        ├──▶ preempting ──▶ queued (exit 75 after SIGTERM: resumes from its checkpoint)
      │  │        ├──▶ queued                (retry after a failure, or the process vanished)
      │  │        └──▶ paused ──▶ queued      (a tuning trial stopped at a rung, exit 76; promoted)
      │  │               └──▶ pruned        (the study stopped it there for good)
      │  └──▶ cancelled
      └────── cancelling ──▶ cancelled       (a running job asked to stop for good)

A paused job holds no GPUs and is not scheduled: it waits, with its checkpoint, for its
study to decide (sched/workload.py `TrialWorkload`, tune/tuner.py).
"""

from __future__ import annotations

from enum import StrEnum

from visionloop.core.errors import VisionloopError


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    PREEMPTING = "preempting"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PAUSED = "paused"  # a tuning trial stopped at a rung, checkpointed; waits to be promoted or pruned
    PRUNED = "pruned"  # a tuning trial its study stopped for good at a rung

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    @property
    def holds_resources(self) -> bool:
        """States whose process may still be alive on its GPUs."""
        return self in ACTIVE


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.PRUNED})
ACTIVE = frozenset({JobState.RUNNING, JobState.PREEMPTING, JobState.CANCELLING})

_ALLOWED: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.CANCELLED, JobState.FAILED}),
    JobState.RUNNING: frozenset(
        {
            JobState.PREEMPTING,
            JobState.CANCELLING,
            JobState.SUCCEEDED,
            JobState.FAILED,
            JobState.QUEUED,
            JobState.PAUSED,
        }
    ),
    # A victim may finish (0), fail, or reach its rung (a trial) during its grace period
    # instead of exiting 75.
    JobState.PREEMPTING: frozenset(
        {JobState.QUEUED, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLING, JobState.PAUSED}
    ),
    JobState.CANCELLING: frozenset({JobState.CANCELLED, JobState.SUCCEEDED, JobState.FAILED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
    JobState.PAUSED: frozenset({JobState.QUEUED, JobState.PRUNED, JobState.CANCELLED}),
    JobState.PRUNED: frozenset(),
}


class TransitionError(VisionloopError):
    """A state change the state machine does not allow (usually a race lost to another
    actor: the caller should re-read the job and decide again)."""

    exit_code = 3


def allowed(src: JobState, dst: JobState) -> bool:
    return dst in _ALLOWED[src]


def check_transition(job_id: str, src: JobState, dst: JobState) -> None:
    if not allowed(src, dst):
        options = ", ".join(sorted(_ALLOWED[src])) or "none (terminal)"
        raise TransitionError(
            f"job {job_id} cannot go from {src} to {dst}; from {src} it can go to: {options}."
        )
