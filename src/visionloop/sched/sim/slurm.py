"""Slurm as a baseline for the simulator: the multifactor priority, the main scheduler, EASY
backfill from users' time limits, and preempt/qos with PreemptMode=REQUEUE.

A re-implementation from Slurm's documentation (priority_multifactor, sched_config, preempt)
and source (plugins/preempt/qos, plugins/sched/backfill), of what a team running Slurm on
the same cluster would get. It sees what Slurm sees: each job's QOS (its priority class),
team (account), GPUs, submission time and the time limit its user gave, and the running jobs'
start times; never how far a job has got.

- **Priority** (priority/multifactor): `w_age * age + w_fairshare * F + w_size * size +
  w_qos * qos`, where age is the time since submission over `PriorityMaxAge` (capped at 1),
  F = 2^(-U/S) the classic fair-share factor (U: the team's share of all usage, decayed
  with `PriorityDecayHalfLife`; S: its share of the shares, from the team weights), size the
  job's GPUs over the cluster's (`PriorityFavorSmall=NO`), qos the class's rank over the
  highest rank.
- **Main scheduler**: jobs in priority order start while they fit. A job that does not fit
  may preempt (requeue) running jobs of a lower QOS, candidates ordered as preempt/qos
  orders them (lowest QOS first, then the smallest); the free GPUs it will use are held
  for it while its victims leave. The first job that cannot start even so blocks the main
  scheduler (Slurm schedules a partition in strict priority order).
- **EASY backfill**: the blocked job gets a reservation at the earliest time enough GPUs are
  free, computed from the running jobs' start times plus their time limits. A later job
  starts now if it ends (by its own limit) before that time, or only uses GPUs the
  reservation does not need.

Not modelled: killing a job at its time limit (a job resumed from a checkpoint can run past
a limit set to its true duration, by the restart overhead; here it runs on, and its expected
end is taken as now), partitions, and Slurm's 30 s / 5 min scheduling intervals (the policy
runs at every event, as visionloop's does in the simulator).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from visionloop.sched.placement import capacities, free_pool, held_by, merge, pick, take, usable
from visionloop.sched.reasons import backoff_reason, clock, impossible_reason, n_gpus
from visionloop.sched.view import (
    DEFAULT_PRIORITIES,
    ActiveJob,
    ClusterView,
    Decision,
    Eviction,
    Gpu,
    PendingJob,
    Placement,
    SpotPolicy,
)

_DAY = 86400.0


@dataclass(frozen=True)
class SlurmConfig:
    """slurm.conf, as far as the simulation needs it. The weights follow the documentation's
    example (fair share ten times age and size), with the QOS weight as large as fair
    share's, so the priority class counts as much as the team's usage."""

    weight_age: float = 1000.0
    weight_fairshare: float = 10000.0
    weight_job_size: float = 1000.0
    weight_qos: float = 10000.0
    max_age_s: float = 7 * _DAY  # PriorityMaxAge
    decay_half_life_s: float = 7 * _DAY  # PriorityDecayHalfLife
    preemption: bool = True  # PreemptType=preempt/qos, PreemptMode=REQUEUE
    preempt_exempt_s: float = 0.0  # PreemptExemptTime (Slurm's default: none)
    backfill: bool = True  # SchedulerType=sched/backfill (EASY: one reservation)
    # Real Slurm's backfill also starts a job by preempting lower-QOS jobs (`_try_sched`
    # hands the preemptable jobs to the select plugin: BENCHMARKS.md, "Slurm checked
    # against a real Slurm 22.05"). Here only for a job whose limit ends before the blocked
    # job's reservation starts, which can never delay it.
    backfill_preemption: bool = False
    grace_s: float = 60.0  # a requeued job's GPUs come free this long after the signal
    same_node: bool = False  # the simulator's jobs may span nodes
    priorities: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_PRIORITIES))


class Slurm:
    """A scheduler for `visionloop.sched.sim.simulate`: `Slurm(limits)(view) -> Decision`.
    `time_limits` maps job id to the time limit its user asked for (seconds). It keeps the
    fair-share usage between calls, so one instance serves one simulation."""

    def __init__(self, time_limits: Mapping[str, float], config: SlurmConfig | None = None) -> None:
        self.cfg = config or SlurmConfig()
        self.limits = time_limits
        self.usage: dict[str, float] = {}  # team -> decayed GPU-seconds
        self._last: float | None = None
        self._holding: dict[str, tuple[str, int]] = {}  # job -> (team, GPUs) since the last call
        self._top_qos = max(self.cfg.priorities.values(), default=1) or 1

    # ----------------------------------------------------------------- priority

    def _account(self, now: float) -> None:
        if self._last is not None and now > self._last:
            dt = now - self._last
            decay = 0.5 ** (dt / self.cfg.decay_half_life_s)
            for team in self.usage:
                self.usage[team] *= decay
            for team, n in self._holding.values():
                self.usage[team] = self.usage.get(team, 0.0) + n * dt
        self._last = now

    def fairshare(self, team: str, view: ClusterView) -> float:
        """F = 2^(-U/S) (classic fair share, no dampening)."""
        shares = sum(t.weight for t in view.teams.values())
        s = view.teams[team].weight / shares if team in view.teams and shares > 0 else 0.0
        total = sum(self.usage.values())
        u = self.usage.get(team, 0.0) / total if total > 0 else 0.0
        if s <= 0:
            return 0.0
        return float(2.0 ** (-u / s))

    def priority(self, job: PendingJob | ActiveJob, gpus: int, view: ClusterView) -> float:
        c = self.cfg
        submitted = job.submitted_at if job.submitted_at is not None else view.now
        age = min(1.0, max(0.0, view.now - submitted) / c.max_age_s) if c.max_age_s > 0 else 0.0
        size = gpus / max(1, len(view.gpus))
        qos = job.priority / self._top_qos
        return (
            c.weight_age * age
            + c.weight_fairshare * self.fairshare(job.team, view)
            + c.weight_job_size * size
            + c.weight_qos * qos
        )

    # ----------------------------------------------------------------- one cycle

    def __call__(self, view: ClusterView) -> Decision:
        self._account(view.now)
        decision = Decision()
        free = free_pool(view)
        caps = capacities(view.gpus)
        prio = {j.id: self.priority(j, j.gpus, view) for j in view.queued}
        order = sorted(view.queued, key=lambda j: (-prio[j.id], j.submitted_at, j.id))
        gpu_by_id = {g.id: g for g in view.gpus}
        releasing = held_by((j for j in view.running if not j.preemptible), gpu_by_id)
        victims_taken: set[str] = set()
        blocked: PendingJob | None = None
        rest: list[PendingJob] = []
        for job in order:
            if blocked is not None:
                rest.append(job)
            elif job.not_before > view.now:
                decision.waiting[job.id] = backoff_reason(job, view.now)
            elif (why := impossible_reason(job, caps, self.cfg.same_node)) is not None:
                decision.waiting[job.id] = why
            elif (got := pick(free, job.gpus, job.spot, self.cfg.same_node, None, job.nodes)) is not None:
                take(free, got)
                decision.placements.append(Placement(job.id, tuple(g.id for g in got)))
            elif self._preempt_for(job, view, gpu_by_id, free, releasing, victims_taken, decision):
                pass  # its victims are leaving; the free GPUs it needs are held for it
            else:
                blocked = job
                n_free = sum(1 for gs in free.values() for g in gs if usable(g, job.spot))
                decision.waiting[job.id] = f"waiting for {n_gpus(job.gpus)}: {n_free} free (highest priority)"
        if blocked is not None:

            def preempt(job: PendingJob) -> bool:
                return self._preempt_for(job, view, gpu_by_id, free, releasing, victims_taken, decision)

            self._backfill(blocked, rest, view, free, caps, decision, preempt)
        self._holding = {j.id: (j.team, len(j.gpu_ids)) for j in view.running}
        teams = {j.id: j.team for j in view.queued}
        for p in decision.placements:
            self._holding[p.job_id] = (teams[p.job_id], len(p.gpu_ids))
        return decision

    def _preempt_for(
        self,
        job: PendingJob,
        view: ClusterView,
        gpu_by_id: Mapping[str, Gpu],
        free: dict[str, list[Gpu]],
        releasing: dict[str, list[Gpu]],
        victims_taken: set[str],
        decision: Decision,
    ) -> bool:
        """preempt/qos: requeue lower-QOS jobs so that `job` fits on free + released GPUs.
        True if the job will start once they leave (or GPUs already being released suffice)."""
        soon = merge(free, releasing)

        def fit(victims: Sequence[ActiveJob]) -> list[Gpu] | None:
            pool = merge(soon, held_by(victims, gpu_by_id))
            return pick(pool, job.gpus, job.spot, self.cfg.same_node, None, job.nodes)

        got = fit(())
        if got is not None:
            take(free, got)
            take(releasing, got)
            decision.waiting[job.id] = f"waiting for {n_gpus(job.gpus)} being released by requeued jobs"
            return True
        if not self.cfg.preemption:
            return False
        candidates = [
            r
            for r in view.running
            if r.preemptible
            and r.id not in victims_taken
            and r.priority < job.priority
            and view.now - r.started_at >= self.cfg.preempt_exempt_s
        ]
        # preempt/qos's order: (QOS priority << 16) + size, ascending.
        candidates.sort(key=lambda r: (r.priority, len(r.gpu_ids), r.id))
        chosen: list[ActiveJob] = []
        for r in candidates:
            chosen.append(r)
            got = fit(chosen)
            if got is not None:
                break
        else:
            return False
        # Drop the victims that turn out not to be needed (the latest added first).
        for r in list(reversed(chosen[:-1])):
            trial = [c for c in chosen if c is not r]
            if (smaller := fit(trial)) is not None:
                chosen, got = trial, smaller
        assert got is not None
        take(free, got)
        take(releasing, got)
        for r in chosen:
            victims_taken.add(r.id)
            decision.evictions.append(Eviction(r.id, f"requeued by job {job.id} (preempt/qos)", job.id))
        decision.waiting[job.id] = f"waiting for {len(chosen)} lower-QOS job(s) to be requeued"
        return True

    def _expected_end(self, job: ActiveJob, now: float) -> float:
        if not job.preemptible:
            return now + self.cfg.grace_s
        return max(now, job.started_at + self.limits.get(job.id, self.cfg.max_age_s))

    def _backfill(
        self,
        head: PendingJob,
        rest: list[PendingJob],
        view: ClusterView,
        free: dict[str, list[Gpu]],
        caps: Mapping[SpotPolicy, tuple[int, int]],
        decision: Decision,
        preempt: Callable[[PendingJob], bool],
    ) -> None:
        """EASY backfill around the blocked job `head` (`preempt`: `_preempt_for` this cycle,
        for `backfill_preemption`)."""
        now = view.now
        gpu = {g.id: g for g in view.gpus}
        avail = sum(1 for gs in free.values() for g in gs if usable(g, head.spot))
        shadow, extra = float("inf"), float("inf")
        if avail < head.gpus:
            for r in sorted(view.running, key=lambda r: (self._expected_end(r, now), r.id)):
                avail += sum(1 for g in r.gpu_ids if g in gpu and usable(gpu[g], head.spot))
                if avail >= head.gpus:
                    shadow, extra = self._expected_end(r, now), float(avail - head.gpus)
                    break
        for job in rest:
            if job.not_before > now:
                decision.waiting[job.id] = backoff_reason(job, now)
                continue
            if (why := impossible_reason(job, caps, self.cfg.same_node)) is not None:
                decision.waiting[job.id] = why
                continue
            got = (
                pick(free, job.gpus, job.spot, self.cfg.same_node, None, job.nodes)
                if self.cfg.backfill
                else None
            )
            behind = f"waiting behind job {head.id} (higher priority)"
            ends = now + self.limits.get(job.id, self.cfg.max_age_s)
            if got is None:
                if not (
                    self.cfg.backfill and self.cfg.backfill_preemption and ends <= shadow and preempt(job)
                ):
                    decision.waiting[job.id] = behind
                continue
            needed = sum(1 for g in got if usable(g, head.spot))
            if ends <= shadow:
                pass
            elif needed <= extra:
                extra -= needed
            else:
                decision.waiting[job.id] = f"{behind}: it would delay its start at {clock(shadow)}"
                continue
            take(free, got)
            decision.placements.append(Placement(job.id, tuple(g.id for g in got)))
