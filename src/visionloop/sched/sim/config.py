"""What a simulation is given: how jobs behave at eviction, spot interruptions and restarts,
what the policy may know of their ends, and the error it raises on a bad decision."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from visionloop.core.errors import VisionloopError
from visionloop.sched.view import DEFAULT_PRIORITIES, ClusterView, Decision

Scheduler = Callable[[ClusterView], Decision]


class SimError(VisionloopError):
    """The policy under simulation made a decision the cluster cannot carry out."""


@dataclass(frozen=True)
class SimConfig:
    checkpoint_every_s: float = 600.0
    grace_s: float = 60.0
    restart_overhead_s: float = 60.0
    tick_s: float = 60.0
    max_time_s: float = 60 * 86400.0  # give up (and report unfinished jobs) past this
    priorities: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_PRIORITIES))
    # What the policy may know of a running job's end: its pace, first reported once an
    # allocation has made `pace_after_s` of progress, as the remaining time times a per-
    # allocation error exp(N(0, pace_error)) (a rate measured over evaluations, data stalls
    # and a shared machine), never the trace's duration itself. Seeded: runs repeat.
    # A preempted job checkpoints at SIGTERM, within its grace period (what visionloop's
    # trainer does): it keeps its progress up to the eviction. Off: it keeps only its last
    # periodic checkpoint (the figures recorded before 2026-11-28). A spot interruption with
    # no notice always loses the work since the last periodic checkpoint.
    sigterm_checkpoint: bool = False
    # Time limits users give (`max_runtime` in the job spec), as a multiple of each job's true
    # duration (2.0: users ask for twice what they need, as in the Slurm 2x baseline). None:
    # no job gives one, so the policy knows ends only from reported paces.
    time_limit: float | None = None
    time_limit_share: float = 1.0  # the share of jobs that give one (chosen by their id's CRC)
    # Runtime history (sched/history.py): a job is planned with the median run time of the
    # jobs of the same application (its id's prefix, e.g. "cifar10") and GPU count that
    # finished before, as the control plane plans with the runs of the same spec. The run time
    # counted is the time a job held GPUs, lost work included, as the control plane counts it.
    history: bool = False
    pace_after_s: float = 60.0
    pace_error: float = 0.2
    seed: int = 0
