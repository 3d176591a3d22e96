"""Preemption: which running jobs step aside for a waiting one, and only when that makes
it fit. A job may preempt lower classes (within its team always; across teams only jobs
on borrowed GPUs, unless it stays within its own nominal quota), with `srpt_preemption` a
job of its own team and class whose GPU-time left by its limit is more than twice its own
(shortest remaining time first: the victim's remaining time only falls as it runs, so two
jobs never take turns evicting each other), with `las_preemption` a job of its own team and
class that has received the threshold's GPU-time while it has not, and a team under its
nominal quota reclaims borrowed GPUs whatever their class: those of the lender's lowest
classes, as its nominal covers its highest classes first (`_borrowing`). Victims lose the
least work: lowest class first, then the least GPU-time since their last checkpoint; never a
job that is already leaving or has run less than `min_runtime_s` — except for a job of the
top class (`top_class_preempts_young`), for a reclaim, a borrower that writes a checkpoint
at SIGTERM (`reclaim_preempts_young`), and a tenant: a job of a lower class that started
while its own team's head waited for the team's limit (no class jumping: it may use the
idle GPUs meanwhile, and steps aside as soon as they let the head start), or, with
`quota_under_head`, while the head had to borrow. Such a job behind its head reclaims only
borrowers of classes below those it follows, or of that class from a team with a larger
share (`_after_head`).
Greedy in that order until the job fits, then every victim it can do without is dropped
again.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence

from visionloop.sched.cycle_state import TeamState
from visionloop.sched.placement import held_by, merge, pick, usable
from visionloop.sched.reasons import n_gpus, plural
from visionloop.sched.view import (
    ActiveJob,
    Eviction,
    Gpu,
    PendingJob,
    SpotPolicy,
    planned_runtime_s,
)
from visionloop.sched.within_class import WithinClass


class Preemption(WithinClass):
    """Victim selection on top of the cycle's state."""

    def _try_preempt(self, job: PendingJob, ts: TeamState) -> bool:
        """Evict the fewest, cheapest victims that let `job` fit, claim the GPUs for it, and
        say so in its waiting reason. False (and nothing evicted) when no set of allowed
        victims makes it fit, or the cycle's eviction budget is too small for the set."""
        n = job.gpus
        reclaim = ts.used + n <= ts.team.nominal_gpus
        quota_gap = ts.used + n - ts.limit  # GPUs its own team must give up first
        shape = self._evict_shape(job, ts)
        if n >= self.fail_evict.get(shape, n + 1):
            return False
        tenants: list[ActiveJob] = []
        head = quota_gap > 0 or (self.cfg.quota_under_head and not reclaim)
        if head and job.team not in self.tenant_teams:
            # The team's first job over its limit (its highest class, as jobs are considered)
            # may take back the GPUs its lower classes started on since it came; only the
            # first, so the shape memo above stays true for the team's other jobs. With
            # `quota_under_head`, so may its first job that must borrow: its lower classes
            # reclaimed the team's quota as its tenants.
            self.tenant_teams.add(job.team)
            tenants = self._tenants(job)
        # The top class may also evict lower-class jobs too young to be victims, after
        # the others (policy.py's `top_class_preempts_young`).
        extra = (
            [v for v in self.young if self._held_rank(v) < job.priority] if job.priority >= self.top else []
        )
        victims: Sequence[ActiveJob] = self.victims
        if reclaim and self.cfg.reclaim_preempts_young and (young := self._young_borrowers(job.team)):
            # Borrowed GPUs go back to their owner at once, however young the borrower (as
            # Kueue's reclaimWithinCohort): the quota guarantee is a cycle plus the grace. In
            # the victim order, not after the others: a young job has the least to lose.
            victims = list(heapq.merge(self.victims, young, key=self._victim_order))
            extra = [v for v in extra if v not in young]
        if quota_gap > 0 and quota_gap > sum(
            len(v.gpu_ids)
            for v in {v.id: v for v in itertools.chain(tenants, victims, extra)}.values()
            if v.team == job.team and v.id not in self.evicted and self._may_evict(v, job, reclaim)
        ):
            self.fail_evict[shape] = n
            return False
        cands = tenants + [
            v
            for v in itertools.chain(victims, extra)
            if v.id not in self.evicted
            and v not in tenants
            and self._may_evict(v, job, reclaim)
            and self._usable_gpus(v, job.spot)
        ]
        pool = merge(self.free, self.releasing)
        cap = self._node_cap(job)
        found = None
        if job.spot == "never":
            # Victims wholly on GPUs it can use first: one mostly on spot used up what its
            # team could give (a reclaim stops at the team's nominal) and freed nothing this
            # job runs on (a 4-minute wait in the jittered runs). If those are not enough, the
            # rest by the share of their GPUs it can use, most first, for the same reason (a
            # borrower on 1 fixed and 5 spot GPUs, first in the victim order, left a 6-GPU
            # reclaim 5 minutes late).
            whole = [v for v in cands if self._usable_gpus(v, job.spot) == len(v.gpu_ids)]
            if len(whole) < len(cands):
                found = self._greedy(job, ts, pool, whole, reclaim, cap)
                if found is None:
                    cands = sorted(cands, key=lambda v: -self._usable_gpus(v, job.spot) / len(v.gpu_ids))
        if found is None:
            found = self._greedy(job, ts, pool, cands, reclaim, cap)
        if found is None:
            self.fail_evict[shape] = n
            return False
        chosen = found
        for v in reversed(chosen[:-1]):  # never evict more than needed
            rest = [c for c in chosen if c is not v]
            if self._fits(job, ts, pool, rest, cap):
                chosen = rest
        if not self._starts_first(job, ts, chosen):
            self.fail_evict[shape] = n
            return False
        if len(chosen) > self.evictions_left:
            return False
        got = self._fits(job, ts, pool, chosen, cap)
        assert got is not None
        for v in chosen:
            self._evict(v, job, self._eviction_reason(v, job, ts))
        victim_ids = {gid for v in chosen for gid in v.gpu_ids}
        pending = [g for g in got if g.id not in victim_ids]
        self._claim(job, ts, pending)
        ids = ", ".join(v.id for v in chosen)
        why = [f"to free {n_gpus(len(got) - len(pending))}"] if len(got) > len(pending) else []
        if quota_gap > 0:
            # Evicted to make room in the team's limit, not (only) for their GPUs.
            why.append(f"to bring team {job.team} within its limit of {ts.limit}")
        held = f"; {n_gpus(len(pending))} held for it" if pending else ""
        self.decision.waiting[job.id] = (
            f"preempting {len(chosen)} job{plural(len(chosen))} ({ids}) {' and '.join(why)}{held}; "
            "starts once they have checkpointed and stopped"
        )
        return True

    def _greedy(
        self,
        job: PendingJob,
        ts: TeamState,
        pool: Mapping[str, list[Gpu]],
        cands: Sequence[ActiveJob],
        reclaim: bool,
        cap: Mapping[str, int] | None,
    ) -> list[ActiveJob] | None:
        """Victims from `cands`, in their order, until `job` fits (None: it never does)."""
        chosen: list[ActiveJob] = []
        taken: dict[str, int] = {}
        for v in cands:
            if not self._may_evict(v, job, reclaim, taken.get(v.team, 0)):
                continue  # its team is no longer above nominal once earlier victims leave
            chosen.append(v)
            taken[v.team] = taken.get(v.team, 0) + len(v.gpu_ids)
            if self._fits(job, ts, pool, chosen, cap):
                return chosen
        return None

    def _evict_shape(self, job: PendingJob, ts: TeamState) -> tuple[object, ...]:
        """What decides whether some victims make `job` fit, but for its size: a job of the
        same shape and at least as many GPUs fails where this one failed (`fail_evict`).
        One behind its head reclaims from fewer victims (`_after_head`)."""
        n = job.gpus
        reclaim = ts.used + n <= ts.team.nominal_gpus
        return (
            job.team,
            job.priority,
            reclaim,
            job.spot,
            job.cpus / n,
            job.memory_gb / n,
            job.id in self.under_head,
        )

    def _cannot_preempt(self, job: PendingJob, ts: TeamState) -> bool:
        """Known already this cycle: no eviction can make `job` fit."""
        if self.evictions_left <= 0:
            return True
        return job.gpus >= self.fail_evict.get(self._evict_shape(job, ts), job.gpus + 1)

    def _starts_first(self, job: PendingJob, ts: TeamState, chosen: Sequence[ActiveJob]) -> bool:
        """Will `job` start before its victims of its own team and class start again? Back in
        the queue they go in the pass their team's quota puts them in: a victim that fits in
        the team's nominal quota goes in the entitled pass, before `job` if `job` would
        borrow, and takes back the GPUs it was evicted for. (In the benchmark a 32-GPU job
        evicted 129 jobs that way before it started, 21 hours late.)"""
        same = [v for v in chosen if v.team == job.team and self._held_rank(v) >= job.priority]
        if not same:
            return True
        nominal = ts.team.nominal_gpus
        rest = ts.used - sum(len(v.gpu_ids) for v in chosen if v.team == job.team)
        return rest + job.gpus <= nominal or all(rest + len(v.gpu_ids) > nominal for v in same)

    def _eviction_reason(self, v: ActiveJob, job: PendingJob, ts: TeamState) -> str:
        """Why `v` steps aside for `job`, in the words its owner reads in `jobs show`."""
        if self._held_rank(v) < job.priority:
            return f"preempted for job {job.id} (priority {self._prio(job.priority)})"
        if v.team != job.team:
            nominal = ts.team.nominal_gpus
            return f"team {job.team} reclaims its nominal quota ({nominal} GPUs) for job {job.id}"
        if self._srpt_yields(v, job):
            return f"preempted for job {job.id} of its team and class, with less GPU-time left by its limit"
        hours = self.cfg.las_threshold_gpu_s / 3600
        return (
            f"preempted for job {job.id} of its team and class: this job has had over {hours:.2g} "
            "GPU-hours and that one less (least attained service first); it resumes from its checkpoint"
        )

    def _evict(self, v: ActiveJob, job: PendingJob, reason: str) -> None:
        """Take running job `v` off its GPUs for `job`: its team's standing gives back what it
        held, and the decision says why."""
        self.evicted.add(v.id)
        gone = self.evicted_use.setdefault(v.team, [0.0, 0.0, 0.0])
        gone[0] += len(v.gpu_ids)
        gone[1] += v.cpus
        gone[2] += v.memory_gb
        self.evictions_left -= 1
        self.version += 1
        vt = self._team(v.team)
        vt.used -= len(v.gpu_ids)
        vt.cpus -= v.cpus
        vt.memory_gb -= v.memory_gb
        self.decision.evictions.append(Eviction(v.id, reason, for_job=job.id))

    def _tenants(self, job: PendingJob) -> list[ActiveJob]:
        """The job's own team's lower-class jobs that started after it was submitted, young
        ones included: they started on GPUs of the team's limit that `job` was waiting for,
        as tenants (no class jumping), and step aside once their GPUs let it start."""
        return sorted(
            (
                v
                for v in self.view.running
                if v.team == job.team
                and v.preemptible
                and v.id not in self.evicted
                and v.started_at >= job.submitted_at
                and self._held_rank(v) < job.priority
            ),
            key=self._victim_order,
        )

    def _after_head(self, v: ActiveJob, job: PendingJob, taken: int) -> bool:
        """May `job`, behind its team's head, reclaim `v` (`quota_under_head`)? Only a job on
        borrowed GPUs of a class below the one `job` went right after (`_consider_unders`),
        or of that class from a team that, without `v`, still comes after `job`'s team in the
        class's fair-share order next cycle: back in the queue, `v` then comes after `job`
        and cannot take its GPUs straight back; or, with `hold_freed_for_job`, one of that
        class (not the top one) that checkpoints at SIGTERM, whose GPUs stay `job`'s. (Any
        borrower of that class, or one counted with the GPUs held for its team's waiting
        jobs, which are gone by the next cycle: the livelock fuzz found jobs evicted up to
        7,481 times for the same job.) Not with the starvation guard: its job goes first in
        its class whatever the shares."""
        vt = self._team(v.team)
        rank, after = self._held_rank(v), self.under_head[job.id]
        if rank > after or not (vt.over_nominal(taken) and self._borrowing(v, job.spot)):
            return False
        if rank < after:
            return True
        if self.cfg.reserve_after_s is not None:
            return False
        if self.cfg.hold_freed_for_job and v.checkpoints_at_stop and rank < self.top_rank:
            # What `v` frees stays `job`'s while it leaves and for the cycle after (owed.py):
            # back in the queue, it cannot take it back, whatever the shares. Not the top
            # class: ahead of every other, it took the free GPUs `job` had claimed besides
            # its victims' at once, and the livelock fuzz found `job` evicting it 17 times.
            return True
        ours = (job.gpus, job.cpus, job.memory_gb)
        theirs = (-taken - len(v.gpu_ids), -v.cpus, -v.memory_gb)  # `taken`: its GPUs only, a bound
        # Strictly larger, beyond rounding: on a tie the order falls to the jobs' own keys.
        return self._next_share(v.team, theirs) - self._next_share(job.team, ours) > 1e-9

    def _next_share(self, team: str, more: tuple[float, float, float]) -> float:
        """A team's dominant share over its weight as the next cycle starts (as `_share`
        orders teams), with `more` (GPUs, CPUs, memory): what its running jobs that stay
        hold, not `TeamState`'s standing, which also counts what is held for its waiting
        jobs this cycle."""
        if self.running_use is None:
            self.running_use = {}
            for j in self.view.running:
                if j.preemptible:
                    use = self.running_use.setdefault(j.team, [0.0, 0.0, 0.0])
                    use[0] += len(j.gpu_ids)
                    use[1] += j.cpus
                    use[2] += j.memory_gb
        use = self.running_use.get(team, [0.0, 0.0, 0.0])
        gone = self.evicted_use.get(team, [0.0, 0.0, 0.0])
        gpus, cpus, mem = (use[i] - gone[i] + more[i] for i in range(3))
        return self._dominant_share(gpus, cpus, mem, self._team(team).team.weight)

    def _evicts_tenants(self, job: PendingJob) -> bool:
        """Is `job` its team's head that must borrow, with tenants to evict (however young)?"""
        head = self.heads.get(job.team)
        if not self.cfg.quota_under_head or head is None or head[0] is not job:
            return False
        return job.team not in self.tenant_teams and bool(self._tenants(job))

    def _may_evict(self, v: ActiveJob, job: PendingJob, reclaim: bool, taken: int = 0) -> bool:
        """May `v` step aside for `job` (`taken`: GPUs of `v`'s team already chosen)?
        - same team: only for a higher class;
        - `job` stays within its team's nominal quota (`reclaim`): any class while `v`'s team
          is above its nominal (reclaiming borrowed GPUs); a lower class also within `v`'s
          team's nominal, unless `v` keeps it (`quota_keeps_lower_classes`);
        - `job` would borrow: a lower class, and only if `v`'s team stays at or above its
          nominal without it; else `v` would be entitled to reclaim at once (a livelock)."""
        if job.id in self.under_head:  # its team's quota only: borrowed GPUs of other teams
            return reclaim and v.team != job.team and self._after_head(v, job, taken)
        lower = self._held_rank(v) < job.priority
        if v.team == job.team:
            # Within a class, never a job the starvation guard would start first again.
            return lower or (not self._starved(v) and (self._srpt_yields(v, job) or self._las_yields(v, job)))
        vt = self._team(v.team)
        if reclaim:
            if vt.over_nominal(taken) and self._borrowing(v, job.spot):
                return True
            return lower and (
                not self._keeps_quota(v, job) or vt.used - taken - len(v.gpu_ids) >= vt.team.nominal_gpus
            )
        return lower and vt.used - taken - len(v.gpu_ids) >= vt.team.nominal_gpus

    def _keeps_quota(self, v: ActiveJob, job: PendingJob) -> bool:
        """Does `v`, of another team, keep the GPUs its team's nominal quota covers against
        `job`'s higher class (`quota_keeps_lower_classes`)? Not against the top class."""
        return self.cfg.quota_keeps_lower_classes and v.checkpoints_at_stop and job.priority < self.top_rank

    def _borrowing(self, v: ActiveJob, spot: SpotPolicy = "allowed") -> bool:
        """Does `v` hold borrowed GPUs? A team's nominal quota covers its highest classes
        first: `v` borrows if its team's jobs of its class and above hold more than the
        nominal (which of a class's jobs step aside is the victim order's choice: the least
        work lost). So a reclaim takes back borrowed GPUs from a team's lowest classes, never
        from its high-class job that the nominal covers (a reclaim evicted one five times in
        one trace while a low-class job of its team, too young to preempt, kept its GPUs).
        For a job that never runs on spot (`spot`), the lender's spot GPUs cover its nominal
        before the rest: a team borrowing only on paper through a low-class job on spot GPUs
        lent nothing such a job could take back, and its quota stayed with the lender."""
        stack = self.team_stacks.get(v.team)
        if stack is None:
            stack = self.team_stacks[v.team] = [
                j for j in self.view.running if j.team == v.team and j.preemptible
            ]
        rank = self._held_rank(v)
        held = 0
        for j in stack:
            if j.id in self.evicted:
                continue
            if self._held_rank(j) >= rank:
                held += len(j.gpu_ids)
            elif spot == "never":
                held += len(j.gpu_ids) - self._usable_gpus(j, spot)
        return held > self._team(v.team).team.nominal_gpus

    def _usable_gpus(self, v: ActiveJob, spot: SpotPolicy) -> int:
        return sum(1 for gid in v.gpu_ids if gid in self.gpu_by_id and usable(self.gpu_by_id[gid], spot))

    def _fits(
        self,
        job: PendingJob,
        ts: TeamState,
        pool: Mapping[str, list[Gpu]],
        victims: Sequence[ActiveJob],
        cap: Mapping[str, int] | None,
    ) -> list[Gpu] | None:
        own = sum(len(v.gpu_ids) for v in victims if v.team == job.team)
        if ts.used - own + job.gpus > ts.limit:
            return None
        freed = merge(pool, self._victim_gpus(victims, job))
        return pick(freed, job.gpus, job.spot, self.cfg.same_node, cap, job.nodes)

    def _victim_gpus(self, victims: Iterable[ActiveJob], job: PendingJob) -> dict[str, list[Gpu]]:
        """The GPUs evicting `victims` frees for `job`, by node. Where reservations hold GPUs
        (EASY backfill), not those an earlier job's reservation is promised, unless `job`
        would end before that reservation starts: held for it once free, they would go to a
        job that may backfill there, very likely the victim itself, to be evicted again (found
        in the simulator: one job evicted 53 times by the same job, which never started)."""
        held = held_by(victims, self.gpu_by_id)
        if self.promised and self._may_hold():
            runtime = planned_runtime_s(job)
            end = math.inf if runtime is None else self.now + runtime
            promised = self.promised
            held = {n: [g for g in gs if promised.get(g.id, math.inf) >= end] for n, gs in held.items()}
        return held

    def _soon(self, job: PendingJob, ts: TeamState) -> list[Gpu] | None:
        """Where the job would run if every job it may preempt (young ones included) were
        gone: free and releasing GPUs plus those victims'. Its free GPUs there are held for
        it, because a job backfilled into them now would only be preempted again once the
        victims are old enough. None when preemption cannot make it fit."""
        if not self.cfg.preemption:
            return None
        reclaim = ts.used + job.gpus <= ts.team.nominal_gpus
        shape = (job.team, job.priority, reclaim, job.spot)
        if job.gpus >= self.fail_soon.get(shape, job.gpus + 1):
            return None
        victims = (
            v
            for v in self.view.running
            if v.preemptible and v.id not in self.evicted and self._may_evict(v, job, reclaim)
        )
        pool = merge(self.free, self.releasing, self._victim_gpus(victims, job))
        got = pick(pool, job.gpus, job.spot, self.cfg.same_node, None, job.nodes)
        if got is None:
            self.fail_soon[shape] = job.gpus
        return got

    def _young_borrowers(self, team: str | None = None) -> list[ActiveJob]:
        """Jobs too young to be victims, of teams above their nominal quota (other than
        `team`), that write a checkpoint when asked to stop, but for the top class: it keeps
        `min_runtime_s`, as no lower class evicts it young either. A young job that does not
        checkpoint at SIGTERM keeps it too: evicted, it would lose all it has done."""
        return [
            v
            for v in self.young
            if v.team != team
            and v.checkpoints_at_stop
            and v.id not in self.evicted
            and self._held_rank(v) < self.top_rank
            and self._team(v.team).over_nominal()
        ]

    def _victim_summary(self) -> tuple[float, bool]:
        """The lowest class among victims left, and whether any of them (or, for a reclaim,
        a young job) is borrowed."""
        if self.version != self.victim_cache[0]:
            left = [v for v in self.victims if v.id not in self.evicted]
            young = self._young_borrowers() if self.cfg.reclaim_preempts_young else []
            lowest = min((self._held_rank(v) for v in left), default=math.inf)
            borrowed = any(self._team(v.team).over_nominal() for v in itertools.chain(left, young))
            self.victim_cache = (self.version, lowest, borrowed)
        return self.victim_cache[1], self.victim_cache[2]

    def _could_preempt(self, job: PendingJob, ts: TeamState) -> bool:
        """Cheap upper bound of `_try_preempt`: is there any victim this job may take?"""
        if self.evictions_left <= 0:
            return False
        lowest, borrowed = self._victim_summary()
        return (
            lowest < job.priority
            or (borrowed and ts.used + job.gpus <= ts.team.nominal_gpus)
            or self._srpt_could(job)
            or self._las_could(job)
        )

    def _preemption_possible(self, prio: int) -> bool:
        """Could any job of (effective) class `prio` or below still preempt?"""
        if self.evictions_left <= 0:
            return False
        lowest, borrowed = self._victim_summary()
        return lowest < prio or borrowed or bool(self.srpt_most) or bool(self.las_old)
