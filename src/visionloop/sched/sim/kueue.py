"""Kueue as a baseline for the simulator: one ClusterQueue per team in one cohort, quota
admission with borrowing, BestEffortFIFO queues, and preemption (withinClusterQueue:
LowerPriority, reclaimWithinCohort: Any), optionally with fair sharing.

A re-implementation from Kueue's documentation (cluster_queue, preemption, fair sharing) and
source (pkg/scheduler/scheduler.go's entry ordering, pkg/scheduler/preemption's candidate
ordering and minimal set):

- **Quota**: a team's ClusterQueue has its nominal quota of GPUs and may borrow up to its
  borrowing limit from the cohort while the cohort has unused quota. Kueue admits by quota;
  pods then need free GPUs (here: a placement on free GPUs, honouring spot policies).
- **Cycle**: each round takes the head of every ClusterQueue (BestEffortFIFO: higher
  priority, then earlier submission; a head that cannot be admitted steps aside for the next
  one), and considers the heads in entry order: those that do not borrow first, then higher
  priority, then earlier submission; with fair sharing, lower dominant resource share first.
  Rounds repeat until every queued job has been a head once, as Kueue's continuous cycles
  would within one instant of the simulation.
- **Preemption** for a head that does not fit: candidates are lower-priority jobs of its own
  ClusterQueue, and, if its ClusterQueue is under its nominal quota, jobs of any priority in
  other ClusterQueues that are borrowing; taking those, it must then fit within its own
  nominal quota (borrowWithinCohort: Never, the default). Ordered as `CandidatesOrdering`: other queues'
  first, then lower priority, then the most recently admitted. Removed in that order (an
  other queue's job only while its queue still borrows) until the head fits, then every one
  it can do without is restored. With fair sharing, another queue's job is a candidate when
  the preemptor's queue's share with the head is at most the target queue's share without
  that job (LessThanOrEqualToFinalShare).

Kueue has no notion of how long a job runs, keeps no reservation and does no backfill beyond
BestEffortFIFO. It honours spot policies, down GPUs and retry back-off, as any scheduler must.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from visionloop.sched.placement import capacities, free_pool, held_by, merge, pick, take
from visionloop.sched.reasons import backoff_reason, impossible_reason, n_gpus
from visionloop.sched.view import ActiveJob, ClusterView, Decision, Eviction, PendingJob, Placement, Team


@dataclass(frozen=True)
class KueueConfig:
    fair_sharing: bool = False
    same_node: bool = False


class Kueue:
    """A scheduler for `visionloop.sched.sim.simulate`. It remembers the jobs admitted by
    quota whose pods wait for GPUs (Kueue's QuotaReserved), so one instance serves one
    simulation."""

    def __init__(self, config: KueueConfig | None = None) -> None:
        self.cfg = config or KueueConfig()
        self.reserved: dict[str, None] = {}  # admitted, pods pending, in admission order

    def __call__(self, view: ClusterView) -> Decision:
        return _Cycle(view, self.cfg, self.reserved).run()


class _Cycle:
    def __init__(self, view: ClusterView, cfg: KueueConfig, reserved: dict[str, None]) -> None:
        self.view, self.cfg = view, cfg
        self.decision = Decision()
        self.free = free_pool(view)
        self.caps = capacities(view.gpus)
        self.gpu = {g.id: g for g in view.gpus}
        self.total = len(view.gpus)
        # Quota in use per ClusterQueue: the admitted jobs. A job already evicted and on its
        # way out counts no more: Kueue takes workloads marked for preemption as the first
        # candidates of the next attempt, so a preemptor waiting for its victims to stop
        # counts their quota as its own and evicts nobody else. Their GPUs stay busy (the
        # `releasing` pool) until they have stopped.
        self.used: dict[str, int] = {}
        for j in view.running:
            if j.preemptible:
                self.used[j.team] = self.used.get(j.team, 0) + len(j.gpu_ids)
        # Jobs admitted in an earlier cycle whose pods still wait for GPUs hold their quota.
        queued = {j.id: j for j in view.queued}
        for i in [i for i in reserved if i not in queued]:
            del reserved[i]
        self.reserved = reserved
        for i in reserved:
            self.used[queued[i].team] = self.used.get(queued[i].team, 0) + queued[i].gpus
        # What preemption sees: the usage of the jobs admitted before this cycle, less the
        # victims chosen in it (Kueue computes preemption targets on the cycle's snapshot).
        self.before = dict(self.used)
        self.borrowed = False  # a job of the cohort was admitted by borrowing in this cycle
        self.admitted = [j for j in view.running if j.preemptible]
        self.evicted: set[str] = set()
        self.releasing = held_by((j for j in view.running if not j.preemptible), self.gpu)

    # ----------------------------------------------------------------- quota

    def _team(self, name: str) -> Team:
        return self.view.teams.get(name) or Team(name, 0, 0)

    def _borrows(self, job: PendingJob) -> bool:
        return self.used.get(job.team, 0) + job.gpus > self._team(job.team).nominal_gpus

    def _quota_fits(self, team: str, n: int, used: Mapping[str, int]) -> bool:
        t = self._team(team)
        cohort = sum(t.nominal_gpus for t in self.view.teams.values()) or self.total
        return used.get(team, 0) + n <= t.nominal_gpus + t.borrow_limit and sum(used.values()) + n <= cohort

    def _share(self, team: str, used: Mapping[str, int]) -> float:
        """Dominant resource share: GPUs borrowed over the cohort's, divided by the weight."""
        t = self._team(team)
        borrowed = max(0, used.get(team, 0) - t.nominal_gpus)
        return borrowed / max(1, self.total) / (t.weight if t.weight > 0 else 1.0)

    # ----------------------------------------------------------------- the cycle

    def run(self) -> Decision:
        queued = {j.id: j for j in self.view.queued}
        for i in list(self.reserved):  # admitted jobs' pods take GPUs as they come free
            job = queued[i]
            got = pick(self.free, job.gpus, job.spot, self.cfg.same_node, None, job.nodes)
            if got is None:
                self.decision.waiting[i] = f"admitted; its pods wait for {n_gpus(job.gpus)} to come free"
                continue
            take(self.free, got)
            del self.reserved[i]
            self.decision.placements.append(Placement(i, tuple(g.id for g in got)))
        placed = {p.job_id for p in self.decision.placements}
        queues: dict[str, list[PendingJob]] = {}
        for job in sorted(self.view.queued, key=lambda j: (-j.priority, j.submitted_at, j.id)):
            if job.id in self.reserved or job.id in placed:
                continue
            if job.not_before > self.view.now:
                self.decision.waiting[job.id] = backoff_reason(job, self.view.now)
            elif (why := impossible_reason(job, self.caps, self.cfg.same_node)) is not None:
                self.decision.waiting[job.id] = why
            else:
                queues.setdefault(job.team, []).append(job)
        while any(queues.values()):
            heads = [h for h in (self._nominate(q) for q in queues.values()) if h is not None]
            if self.cfg.fair_sharing:
                after = {
                    h.id: self._share(h.team, {**self.used, h.team: self.used.get(h.team, 0) + h.gpus})
                    for h in heads
                }
                heads.sort(key=lambda h: (after[h.id], -h.priority, h.submitted_at, h.id))
            else:
                heads.sort(key=lambda h: (self._borrows(h), -h.priority, h.submitted_at, h.id))
            for job in heads:
                self._admit_or_preempt(job)
        return self.decision

    def _nominate(self, queue: list[PendingJob]) -> PendingJob | None:
        """The ClusterQueue's head: its first job that fits or could preempt its way in.
        Those before it cannot do either (BestEffortFIFO sets them aside) and wait."""
        while queue:
            job = queue.pop(0)
            fits = self._quota_fits(job.team, job.gpus, self.used)
            if fits or (not self.borrowed and self._targets(job) is not None):
                return job
            self.decision.waiting[job.id] = self._quota_reason(job)
        return None

    def _quota_reason(self, job: PendingJob) -> str:
        t = self._team(job.team)
        return (
            f"waiting for {n_gpus(job.gpus)}: ClusterQueue {job.team} uses {self.used.get(job.team, 0)} "
            f"of {t.nominal_gpus} + {t.borrow_limit} borrowable"
        )

    def _admit_or_preempt(self, job: PendingJob) -> None:
        if self._quota_fits(job.team, job.gpus, self.used):
            self.borrowed = self.borrowed or self._borrows(job)
            self.used[job.team] = self.used.get(job.team, 0) + job.gpus
            got = pick(self.free, job.gpus, job.spot, self.cfg.same_node, None, job.nodes)
            if got is not None:
                take(self.free, got)
                self.decision.placements.append(Placement(job.id, tuple(g.id for g in got)))
            else:
                # Admitted by quota, but its pods find no free GPUs yet (they are being
                # released by victims, or a spot node is down): it keeps its quota, and its
                # pods start as GPUs come free, before any new admission.
                self.reserved[job.id] = None
                self.decision.waiting[job.id] = f"admitted; its pods wait for {n_gpus(job.gpus)} to come free"
            return
        # Kueue skips preemption in a cohort where a job was admitted by borrowing in this
        # cycle (its targets were computed before that admission); it tries again next cycle.
        victims = None if self.borrowed else self._targets(job)
        if victims is None:
            self.decision.waiting[job.id] = self._quota_reason(job)
            return
        pool = merge(self.free, self.releasing, held_by(victims, self.gpu))
        got = pick(pool, job.gpus, job.spot, self.cfg.same_node, None, job.nodes) or []
        take(self.free, got)
        take(self.releasing, got)
        for v in victims:
            self.evicted.add(v.id)
            self.used[v.team] -= len(v.gpu_ids)
            self.before[v.team] -= len(v.gpu_ids)
            self.decision.evictions.append(Eviction(v.id, f"preempted by Kueue for job {job.id}", job.id))
        self.used[job.team] = self.used.get(job.team, 0) + job.gpus
        self.decision.waiting[job.id] = f"preempting {len(victims)} job(s) to be admitted"

    def _targets(self, job: PendingJob) -> list[ActiveJob] | None:
        """The minimal set of victims that lets `job` be admitted and placed, or None."""
        before = self.before
        under_nominal = before.get(job.team, 0) < self._team(job.team).nominal_gpus
        with_job = {**before, job.team: before.get(job.team, 0) + job.gpus}
        cands = []
        for v in self.admitted:
            if v.id in self.evicted:
                continue
            if v.team == job.team:
                if v.priority < job.priority:
                    cands.append(v)
            elif self.cfg.fair_sharing:
                without = {**before, v.team: before[v.team] - len(v.gpu_ids)}
                if self._share(v.team, before) > 0 and self._share(job.team, with_job) <= self._share(
                    v.team, without
                ):
                    cands.append(v)
            elif under_nominal and before[v.team] > self._team(v.team).nominal_gpus:
                cands.append(v)
        # CandidatesOrdering: other ClusterQueues first, lower priority, most recently admitted.
        cands.sort(key=lambda v: (v.team == job.team, v.priority, -v.started_at, v.id))
        used = dict(before)
        chosen: list[ActiveJob] = []
        for v in cands:
            if (
                v.team != job.team
                and not self.cfg.fair_sharing
                and used[v.team] <= self._team(v.team).nominal_gpus
            ):
                continue  # its queue no longer borrows once earlier victims are gone
            chosen.append(v)
            used[v.team] -= len(v.gpu_ids)
            if self._fits_without(job, chosen, used):
                break
        else:
            return None
        for v in list(reversed(chosen[:-1])):  # restore the ones it can do without
            rest = [c for c in chosen if c is not v]
            back = {**used, v.team: used[v.team] + len(v.gpu_ids)}
            if self._fits_without(job, rest, back):
                chosen, used = rest, back
        return chosen

    def _fits_without(self, job: PendingJob, victims: list[ActiveJob], used: Mapping[str, int]) -> bool:
        if not self._quota_fits(job.team, job.gpus, used):
            return False
        # borrowWithinCohort: Never (the default): a job that takes other queues' GPUs must
        # then fit within its own queue's nominal quota, not borrow.
        if (
            not self.cfg.fair_sharing
            and any(v.team != job.team for v in victims)
            and used.get(job.team, 0) + job.gpus > self._team(job.team).nominal_gpus
        ):
            return False
        pool = merge(self.free, self.releasing, held_by(victims, self.gpu))
        return pick(pool, job.gpus, job.spot, self.cfg.same_node, None, job.nodes) is not None
