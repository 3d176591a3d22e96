"""The queue policy: which queued jobs start now, on which GPUs, and which running jobs are
asked to checkpoint and step aside. `schedule(view, config)` is a pure function of a
`ClusterView`: it keeps no state between cycles, and what it must remember is re-derived
from the view (a job with `preemptible=False` is on its way out; its GPUs are coming).

Order of standing, in one cycle:
  1. Priority class, higher first. Waiting `aging_s` lifts a job one class for ordering
     (never into the top class, never for the right to preempt), so low classes move.
  2. Entitlement before borrowing: jobs that keep their team within its nominal quota go
     in a first pass; jobs that would take their team beyond it (up to nominal + borrow)
     in a second, on what is left. A team's lower classes never jump its own waiting job.
  3. Within a class and pass, teams take turns by weighted dominant-resource share (GPUs,
     CPUs or memory, whichever the team uses most of, divided by its weight).
  4. Within a team, least attained GPU-service first ("las", the default: jobs that already
     ran, and were preempted or interrupted, go behind fresh ones), or least remaining
     GPU-time by their time limits ("srpt"), or submission order.
A job starts on free GPUs if it fits (spot policy, one GPU type if possible, one node or
the fewest nodes). If not, it claims GPUs still being released; else it may preempt lower
classes, a job of its own team and class that has had `las_threshold_gpu_s` of GPU-time
while it has not ("las" preemption, on by default; with "srpt" preemption, also one with
more than twice its remaining time), or, under its nominal quota, reclaim borrowed GPUs
(see `preemption.py`); the GPUs
it frees are claimed for it, so a backfilled job cannot take them. A job that preemption
will let in once its victims pass `min_runtime_s` holds the free GPUs it will use. Anything
else waits, with a reason. Later, smaller jobs backfill around waiting ones.
The first blocked job of each class (and a long-waiting job beyond its team's quota) gets a
reservation from the running jobs' expected ends, and its reason says when it should start;
with `easy_backfill` the reservation also holds its GPUs (see `reservation.py`).

`fifo(view)` is the baseline the benchmark compares against: strict arrival order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from visionloop.core.errors import ConfigError
from visionloop.sched.cycle import Cycle
from visionloop.sched.placement import capacities, free_pool, pick, take, usable
from visionloop.sched.reasons import backoff_reason, impossible_reason, n_gpus
from visionloop.sched.view import DEFAULT_PRIORITIES, ClusterView, Decision, PendingJob, Placement

Order = Literal["fifo", "las", "srpt"]
VictimOrder = Literal["least_lost", "smallest"]


@dataclass(frozen=True)
class PolicyConfig:
    """How the queue is run. The defaults are what the benchmark found best on the Philly-
    derived traces (see BENCHMARKS.md, "Scheduler"); `same_node=True` because the local
    executor runs a job's processes on one machine."""

    # A job that has run less than this in its current allocation is never a victim: a
    # restart costs minutes, so younger jobs would only thrash...
    min_runtime_s: float = 600.0
    # ...except for a job of the top class (the highest rank in `priorities`), which evicts
    # lower classes however young, as Slurm's QOS preemption does (its PreemptExemptTime is
    # off by default): it is rare, and never evicted by a lower class, so it cannot start a
    # thrash. The high class otherwise waited up to 10 minutes behind jobs that had just
    # started (BENCHMARKS.md, "The high class without a wait").
    top_class_preempts_young: bool = True
    # A team under its nominal quota takes back its borrowed GPUs from jobs however young
    # (but the top class), as Kueue's reclaimWithinCohort does, from those that write a
    # checkpoint at SIGTERM (`ActiveJob.checkpoints_at_stop`: every visionloop training job),
    # which lose only the grace period. BENCHMARKS.md, "Reclaiming from young borrowers": with
    # SIGTERM checkpoints a team's fitting job waited longer than a cycle plus the grace 36
    # times instead of 44 and avg JCT fell 1%; reclaiming young jobs that do not checkpoint
    # too made the high class wait 0.95 min against Slurm's 0.43 and avg JCT rise 1.5%.
    reclaim_preempts_young: bool = True
    # A team's lower-class job that fits in the team's unused nominal quota while its head
    # (a higher class) must borrow: it goes right after its team's jobs of the next class
    # up, takes what idle GPUs are left, and reclaims its team's quota from borrowers of
    # lower classes than those (and of that class from teams whose share stays larger), as
    # its head's tenant (the head evicts it, however young, once that lets it start: no
    # class jumping). Without it such a job waits for idle GPUs while its team's quota stays
    # lent out. None (the default): on, but with easy_backfill, where the livelock fuzz
    # found a thrash. BENCHMARKS.md, "The quota under a borrowing head": over 64 jittered
    # runs of the shared traces, late quota stretches with the GPUs there 200 -> 110 with
    # SIGTERM checkpoints (286 -> 177 without), average JCT within 0.3%.
    quota_under_head: bool | None = None
    # With `quota_under_head`: free GPUs held idle (`_hold`, while the holder waits for
    # victims to become preemptible) for a job whose team borrows with it yield to such a
    # lower-class job that fits in its own team's unused nominal quota: another team's
    # borrower's hold (a borrower never keeps a team from its quota), and its own head's (it
    # starts there as the head's tenant, the head's GPUs not counted against the quota while
    # it does); if it checkpoints at SIGTERM (`PendingJob.checkpoints_at_stop`), its team's
    # other borrowers' too, as theirs. The free part of a borrower's claim (free GPUs with
    # GPUs being released, `_claim`) is such a hold too, but the top class's. Not the
    # starvation guard's hold. BENCHMARKS.md, "Holds
    # yield to the quota, and freed GPUs stay with their reclaim": over 64 jittered runs,
    # late quota stretches with the GPUs there 110 -> 76 with SIGTERM checkpoints (177 -> 152
    # without), average JCT +0.3% (-0.5% without); "The guarantee job by job": the other
    # borrowers' holds, 75 -> 59 late job waits with SIGTERM checkpoints; "Claims that yield
    # to the quota": claims, and GPUs owed only where the job runs, 41 -> 29.
    holds_yield_to_quota: bool = True
    # The GPUs another team's victim frees stay the job's it stepped aside for, while that job
    # fits in its team's unused nominal quota (a reclaim) and the victim wrote a checkpoint at
    # SIGTERM (`ActiveJob.leaving_for`, `ClusterView.freed_for`): no job ahead of it in the
    # cycle's order takes them, which made it reclaim again, a grace period later each time.
    # Only then: a team's fitting job that took such GPUs could not have reclaimed young
    # borrowers that lose all they did (`reclaim_preempts_young`), and waited longer without
    # them. BENCHMARKS.md, "Holds yield to the quota, and freed GPUs stay with their
    # reclaim": over 64 jittered runs with SIGTERM checkpoints, late quota stretches with
    # the GPUs there 76 -> 59, average JCT -0.4%. Such a victim cannot take its GPUs back, so
    # a job behind its borrowing head may also reclaim it from a team with a smaller share
    # (preemption.py's `_after_head`; not the top class): 59 -> 49 late job waits.
    hold_freed_for_job: bool = True
    # A job within its team's nominal quota that writes a checkpoint at SIGTERM
    # (`ActiveJob.checkpoints_at_stop`) keeps its GPUs against other teams' higher classes,
    # but the top class: another team reclaims borrowed GPUs, not its quota (Kueue's
    # reclaimWithinCohort; Slurm's preempt/qos takes any lower QOS). Where jobs checkpoint at
    # SIGTERM, a team's reclaim gets borrowed GPUs back at once (`reclaim_preempts_young`), so
    # taking another team's quota only moved the wait there. BENCHMARKS.md, "Another team's
    # quota is not a higher class's": over 128 jittered runs with SIGTERM checkpoints, late job
    # waits in the quota 83 -> 41, avg JCT -0.2%. A job that does not checkpoint stays a victim
    # of higher classes: its team's borrowers are reclaimed only after `min_runtime_s`, and
    # without that way average JCT rose 1.2% and late waits 225 -> 246.
    quota_keeps_lower_classes: bool = True
    # Free GPUs are held idle for a blocked job (`_hold`: the job would fit once its victims
    # may be preempted, and a job started there meanwhile would be evicted again) only when
    # those victims become preemptible within this many seconds; else other jobs use them
    # meanwhile (None: hold however long, as before). Not for the top class. A victim too
    # young (`min_runtime_s`) kept its GPUs up to 10 minutes, and the free ones beside them
    # stayed idle as long, while the team's other jobs that fitted in its quota waited behind
    # the hold. BENCHMARKS.md, "Holds of a minute at most": over 128 jittered runs with
    # SIGTERM checkpoints, late job waits in the quota 41 -> 23, avg JCT level.
    hold_within_s: float | None = 60.0
    # Within a team and class: "las" (least attained GPU-service first: jobs that were
    # preempted or ran long wait behind fresh ones, which shortens completion times when job
    # lengths are heavy-tailed), "srpt" (least remaining GPU-time first, counted from the
    # time limits jobs give, `max_runtime`: GPUs x limit - GPU-time received; a job without a
    # limit, or past its limit, counts what it has received, as under "las": with heavy-tailed
    # lengths a job's expected remaining time grows with what it has run) or "fifo".
    # "srpt" is "las" exactly when no job gives a limit; with limits it is better
    # (BENCHMARKS.md, "Shortest remaining limit first"). Not the default: a fresh job without
    # a limit goes before every job with one, so a team whose jobs give limits should use it
    # with all of them giving one.
    order: Order = "las"
    # With order "srpt": a waiting job may also preempt a job of its own team and class whose
    # remaining GPU-time by its limit is more than twice its own (shortest remaining time
    # first, with preemption). A preempted job's remaining time only falls as it runs, so two
    # jobs never take turns evicting each other.
    srpt_preemption: bool = False  # BENCHMARKS.md: "Shortest remaining limit first, with preemption"
    # Least attained service with preemption, discretized as Tiresias does (Gu et al.,
    # NSDI'19): a waiting job that has received less than `las_threshold_gpu_s` GPU-seconds
    # may preempt a running job of its own team and class that has received at least that
    # much (and ran `min_runtime_s` in this allocation). Two jobs never take turns: the
    # victim has crossed the threshold for good, and the job that evicted it can evict
    # nothing more once it crosses it too. BENCHMARKS.md: "Fresh jobs first, with preemption".
    las_preemption: bool = True
    las_threshold_gpu_s: float = 3250.0
    # Later jobs may start on GPUs an earlier, bigger job cannot use yet.
    backfill: bool = True
    preemption: bool = True
    # Multi-GPU jobs on one node (local executor). Off: span nodes, packed onto the fewest.
    same_node: bool = True
    # Victims within a class: "least_lost" (least GPU-time since their last checkpoint) or
    # "smallest" (fewest GPUs, then youngest: Slurm's preempt/qos order). A trainer that
    # checkpoints at SIGTERM loses the same per freed GPU whichever it is, and then size is
    # what is left to choose by; see BENCHMARKS.md ("Victims") for what each measured.
    victim_order: VictimOrder = "least_lost"
    # Evictions issued in one cycle at most (a burst of preemptions is usually a mistake).
    max_evictions_per_cycle: int = 8
    # Waiting this long promotes a queued job one priority class for ordering (never for the
    # right to preempt), up to the class below the top; a job that started after such a wait
    # defends its GPUs with the aged class, so it is not preempted straight back. Without it
    # the low class ended up worse off than under FIFO in one benchmark trace. None: off.
    aging_s: float | None = 3600.0
    # Starvation guard for big jobs: the job blocked longest past this goes first in its class
    # and gets the free GPUs it can use held for it. Off by default: since reservations from
    # progress it no longer pays in the benchmark (4 h, SIGTERM checkpoints, 2026-11-29: avg
    # JCT 3.30 h against 2.92 h without it, longest wait 33.0 h against 28.6 h). None: off.
    reserve_after_s: float | None = None
    # Reservations from progress (`reservation.py`): the first blocked job of each class, and
    # a job beyond its team's nominal quota that waited `aging_s`, get a planned start from
    # the running jobs' expected ends (shown to users as its expected start).
    reservations: bool = True
    # EASY backfill around them: a reservation holds its free GPUs, and a later job may use
    # them only if its time limit (`max_runtime_s`) ends before the reservation starts. Off
    # by default: it pays only where most jobs give a time limit (BENCHMARKS.md, "Reservations
    # from progress": every job with a limit of 2x its duration, avg JCT -8.5%; half of them,
    # one trace +10%); with no limits at all it changes nothing, as nothing could backfill.
    easy_backfill: bool = False
    # With EASY backfill: a job whose end is unknown or late may still start on reserved
    # GPUs, as a preemptible tenant that steps aside when the reservation falls due.
    reservation_tenants: bool = False
    # Reservations made per cycle at most (each one walks the running jobs).
    max_reservations: int = 8
    # The end a reservation assumes for a running job that has reported no pace and has no
    # time limit, and for a job started this cycle without one: late, so that a reservation
    # is never promised GPUs on the strength of a guess.
    default_runtime_s: float = 86400.0
    # Class names by rank, used in the reasons shown to users.
    priorities: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_PRIORITIES))

    def __post_init__(self) -> None:
        if self.order not in ("fifo", "las", "srpt"):
            raise ConfigError(
                f"scheduler order must be 'fifo', 'las' or 'srpt', not {self.order!r}; e.g. order = 'las'."
            )
        if self.srpt_preemption and self.order != "srpt":
            raise ConfigError(
                'srpt_preemption preempts by what order "srpt" ranks by: set order = "srpt" too.'
            )
        if self.las_threshold_gpu_s <= 0:
            raise ConfigError(
                f"las_threshold_gpu_s must be > 0 GPU-seconds, not {self.las_threshold_gpu_s}; e.g. 3250."
            )
        if self.victim_order not in ("least_lost", "smallest"):
            raise ConfigError(
                f"victim_order must be 'least_lost' or 'smallest', not {self.victim_order!r}; "
                "e.g. victim_order = 'smallest'."
            )
        if self.quota_under_head is None:  # frozen: set once, here
            object.__setattr__(self, "quota_under_head", not self.easy_backfill)
        if self.quota_under_head and self.easy_backfill:
            raise ConfigError(
                "quota_under_head and easy_backfill do not go together (a head's reservation comes "
                "and goes as its tenants start and leave, and they thrash): turn one off."
            )
        if self.min_runtime_s < 0:
            raise ConfigError(f"min_runtime_s must be >= 0 seconds, not {self.min_runtime_s}; e.g. 600.")
        if self.max_evictions_per_cycle < 0:
            raise ConfigError(
                f"max_evictions_per_cycle must be >= 0, not {self.max_evictions_per_cycle}; "
                "e.g. 8 (set preemption = false to turn preemption off)."
            )
        if self.max_reservations < 0 or self.default_runtime_s <= 0:
            raise ConfigError(
                "max_reservations must be >= 0 and default_runtime_s > 0, not "
                f"{self.max_reservations} and {self.default_runtime_s}; e.g. 8 and 86400."
            )
        for name in ("reserve_after_s", "aging_s"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(f"{name} must be a positive number of seconds or None, not {v}; e.g. 3600.")


def schedule(view: ClusterView, config: PolicyConfig | None = None) -> Decision:
    """Decide one scheduling cycle. Never raises on odd input (unknown teams, jobs bigger
    than the cluster): every queued job that is not placed gets a reason in `waiting`."""
    cycle = Cycle(view, config or PolicyConfig())
    cycle.run()
    return cycle.decision


def fifo(view: ClusterView, *, same_node: bool = True) -> Decision:
    """Strict first-come-first-served: no backfill, no preemption, no quotas, no fair share.
    The first job that does not fit blocks everything behind it. The benchmark's baseline;
    it still honours spot policies, down GPUs and retry back-off, as any scheduler must."""
    decision = Decision()
    free = free_pool(view)
    caps = capacities(view.gpus)
    blocker: PendingJob | None = None
    for job in sorted(view.queued, key=lambda j: (j.submitted_at, j.id)):
        if blocker is not None:
            decision.waiting[job.id] = f"waiting behind job {blocker.id} (first come, first served)"
        elif job.not_before > view.now:
            decision.waiting[job.id] = backoff_reason(job, view.now)
        elif (why := impossible_reason(job, caps, same_node)) is not None:
            decision.waiting[job.id] = why
        elif (got := pick(free, job.gpus, job.spot, same_node, None, job.nodes)) is not None:
            take(free, got)
            decision.placements.append(Placement(job.id, tuple(g.id for g in got)))
        else:
            n_free = sum(1 for gs in free.values() for g in gs if usable(g, job.spot))
            decision.waiting[job.id] = f"waiting for {n_gpus(job.gpus)}: {n_free} free"
            blocker = job
    return decision
