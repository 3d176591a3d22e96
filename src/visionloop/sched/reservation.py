"""Reservations from progress, with EASY-style backfill around them.

A blocked job that its team has room for (the first blocked job of each class, and a job
beyond its team's nominal quota once it has waited `aging_s`) gets a reservation: the
earliest time at which the GPUs free now, those being released, and those of the running
jobs taken in the order of their expected ends fit it, and which GPUs those are. A running
job's end is what its reported pace says (`ActiveJob.expected_end`), else its start plus
its time limit, else `default_runtime_s` from now; never the true duration, which nobody
knows. Every GPU is promised to one reservation at most.

Free GPUs that a reservation needs are lent, not idled: a later job may start on them if its
own time limit ends before the reservation starts (Slurm's EASY backfill), or, with
`reservation_tenants`, as a preemptible tenant that steps aside when the reservation falls
due. A tenant is a job queued behind the reservation's owner (a lower class, or the same
class and submitted later) that started while the owner waited; "falls due" means the owner
would fit once its tenants left.

Nothing is stored: the plan is derived from the view each cycle, in the cycle's own order,
so a control-plane restart keeps it and a job ahead in the order (an entitled job of another
team, a higher class) may still take GPUs a later reservation would have had.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from visionloop.sched.cycle_state import TeamState
from visionloop.sched.placement import group_by_node, merge, pick, take, usable
from visionloop.sched.preemption import Preemption
from visionloop.sched.reasons import clock, n_gpus, plural
from visionloop.sched.view import ActiveJob, Gpu, PendingJob, planned_runtime_s


class Reservations(Preemption):
    """Reservation planning and backfill on top of the cycle's state and preemption."""

    def _wants_reservation(self, job: PendingJob, ts: TeamState, prio: int) -> bool:
        """Cheap: does this blocked job get a reservation? The first of its (effective)
        class, and any job bigger than its team's nominal quota that has waited `aging_s`
        (the jobs that otherwise starve: smaller ones keep taking what frees up)."""
        cfg = self.cfg
        if not cfg.reservations or job.gpus <= 0:
            return False
        if prio in self.reserved_for:  # hot: most of a long queue stops here
            aging = cfg.aging_s
            if aging is None or job.gpus <= ts.team.nominal_gpus or self.now - job.submitted_at < aging:
                return False
        return (
            job.id not in self.behind
            and sum(self.reserved_for.values()) < cfg.max_reservations
            and ts.used + job.gpus <= ts.limit
        )

    def _end_of(self, j: ActiveJob) -> tuple[float, bool]:
        """When a running job is expected to free its GPUs, and whether that is known (from
        its pace or time limit) rather than the conservative default."""
        if j.expected_end is not None:
            return max(self.now, j.expected_end), True
        if (runtime := planned_runtime_s(j)) is not None:  # its limit, else its history
            return max(self.now, j.started_at + runtime), True
        return self.now + self.cfg.default_runtime_s, False

    def _is_tenant(self, v: ActiveJob, job: PendingJob) -> bool:
        """Did `v` start on GPUs while `job` waited, though queued behind it? Its own class
        is what `job` goes by (aging never gives the right to preempt)."""
        if not v.preemptible or v.id in self.evicted or v.started_at < job.submitted_at:
            return False
        held = self._held_rank(v)
        if held > job.priority:
            return False
        return held < job.priority or (v.submitted_at is not None and v.submitted_at > job.submitted_at)

    def _plan(
        self, job: PendingJob, ts: TeamState
    ) -> tuple[float, bool, list[Gpu], list[ActiveJob], list[str]] | None:
        """(start, whether it is known rather than resting on a default end, the GPUs, the
        tenants among their holders, the other jobs it waits for), or None when the GPUs it
        could ever use are down or promised."""
        n, spot, gbi, promised = job.gpus, job.spot, self.gpu_by_id, self.promised
        if n >= self.fail_plan.get((spot, job.nodes), n + 1):
            return None
        reclaim = ts.used + n <= ts.team.nominal_gpus
        # Free and releasing GPUs not promised yet (a reservation that holds nothing leaves
        # its promised GPUs in the pools, for the jobs it does not hold them against).
        pool = {
            nd: kept
            for nd, gs in merge(self.free, self.releasing).items()
            if (kept := [g for g in gs if g.id not in promised])
        }
        tenants: list[ActiveJob] = []
        events: list[tuple[float, bool, str, list[Gpu]]] = []
        # Only a reservation within its team's nominal quota has tenants: a borrower's is
        # considered after every entitled job, which takes the GPUs its tenants free, and
        # it found them due again every cycle (a job evicted 32 times in a unit test).
        tenants_on = self.cfg.reservation_tenants and self.cfg.easy_backfill and reclaim
        for v in self.view.running:
            if not v.preemptible or v.id in self.evicted:
                continue  # leaving: its GPUs are in `releasing`, or claimed by the preemptor
            gs = [gbi[g] for g in v.gpu_ids if g in gbi and g not in promised and usable(gbi[g], spot)]
            if not gs:
                continue
            if tenants_on and self._is_tenant(v, job):
                tenants.append(v)
                for g in gs:
                    pool.setdefault(g.node, []).append(g)
            else:
                events.append((*self._end_of(v), v.id, gs))
        for end, vid, known, placed in self.placed_ends:
            kept = [g for g in placed if g.id not in promised and usable(g, spot)]
            if kept:
                events.append((end, known, vid, kept))
        events.sort(key=lambda e: (e[0], e[2]))
        node_cap = self.cfg.same_node and job.nodes == 1
        count = {nd: sum(1 for g in gs if usable(g, spot)) for nd, gs in pool.items()}
        start, known, waits_for = self.now, True, []
        for i in range(-1, len(events)):
            if i >= 0:
                start, known, vid, gs = events[i]
                waits_for.append(vid)
                for g in gs:
                    pool.setdefault(g.node, []).append(g)
                    count[g.node] = count.get(g.node, 0) + 1
            enough = max(count.values(), default=0) >= n if node_cap else sum(count.values()) >= n
            if not enough:
                continue
            got = pick(pool, n, spot, self.cfg.same_node, None, job.nodes)
            if got is not None:
                ids = {g.id for g in got}
                held = [v for v in tenants if ids.intersection(v.gpu_ids)]
                return start, known, got, held, waits_for
        # Whether it fails depends neither on the team nor on which holders are tenants (every
        # event is tried), only on the GPUs left to plan with, which only shrink within a cycle.
        if n % job.nodes == 0:  # else it fails for its split alone (`pick`)
            self.fail_plan[(spot, job.nodes)] = n
        return None

    def _reserve(self, job: PendingJob, ts: TeamState, prio: int) -> bool:
        """Make the job's reservation (or, when it falls due, have its tenants step aside and
        claim the GPUs) and say so in its waiting reason. False: no GPUs it could ever use
        come free (down or promised to others)."""
        plan = self._plan(job, ts)
        if plan is None:
            return False
        start, known, got, tenants, waits_for = plan
        self.reserved_for[prio] = self.reserved_for.get(prio, 0) + 1
        self.fail_lend.clear()  # more GPUs may be lent now
        ids = {g.id for g in got}
        self.decision.reserved[job.id] = tuple(sorted(ids))
        waiting = self.decision.waiting
        if tenants and start <= self.now and len(tenants) <= self.evictions_left:
            self._evict_tenants(tenants, job)
            self._claim(job, ts, [g for g in got if g.id in self._free_ids() or self._releasing(g)])
            self.promised.update(dict.fromkeys(ids, start))
            names = ", ".join(v.id for v in tenants)
            waiting[job.id] = (
                f"its reservation is due: job{plural(len(tenants))} {names}, started on its GPUs "
                "while it waited, step aside; starts once they have checkpointed and stopped"
            )
            self.decision.starts[job.id] = self.now
            return True
        if self._may_hold():
            free_ids = self._free_ids()
            now_free = [g for g in got if g.id in free_ids]
            self._reserve_free(now_free)
            for g in now_free:
                self.lend[g.id] = (start, g, job)
            coming = [g for g in got if self._releasing(g)]
            if coming:  # being released: promised to it, like a claim (not lent)
                before = sum(len(gs) for gs in self.releasing.values())
                take(self.releasing, coming)
                self.releasing_left -= before - sum(len(gs) for gs in self.releasing.values())
        self.promised.update(dict.fromkeys(ids, start))
        self.version += 1
        # Minutes are enough for an estimate, and keep the stored reason from changing
        # every cycle as the running jobs' paces move.
        shown = math.ceil(start / 60.0) * 60.0
        last = ", ".join(waits_for[-3:])
        because = f" as job{plural(len(waits_for))} {last} end" if waits_for else ""
        if len(waits_for) > 3:
            because = f" as {len(waits_for)} running jobs end (the last: {last})"
        if tenants:
            because += f"; tenant{plural(len(tenants))} {', '.join(v.id for v in tenants)} step aside then"
        if known:  # first, where `jobs list` (which cuts reasons short) shows it
            self.decision.starts[job.id] = shown
            held = f"{n_gpus(len(got))} reserved for it{because}"
            waiting[job.id] = f"expected start {clock(shown)}; {waiting[job.id]}; {held}"
        else:  # a guess would mislead: say what it waits for instead
            waiting[job.id] += (
                f"; {n_gpus(len(got))} reserved for it{because}; its start is not known until job "
                f"{waits_for[-1]} reports its pace"
            )
        return True

    def _releasing(self, g: Gpu) -> bool:
        return any(x.id == g.id for x in self.releasing.get(g.node, ()))

    def _evict_tenants(self, tenants: Sequence[ActiveJob], job: PendingJob) -> None:
        for v in tenants:
            reason = (
                f"steps aside for job {job.id}, whose reservation is due (it started on the reserved GPUs)"
            )
            self._evict(v, job, reason)

    def _backfill(self, job: PendingJob) -> tuple[list[Gpu], bool] | None:
        """Start `job` on free GPUs plus lent ones: those whose reservation starts after its
        time limit ends, or, with tenants, any whose owner it is queued behind. (GPUs, as a
        tenant?) or None."""
        n, limit = job.gpus, planned_runtime_s(job)
        shape = (job.team, job.priority, job.spot, job.cpus / n, job.memory_gb / n, limit)
        if n >= self.fail_lend.get(shape, n + 1):
            return None
        end = math.inf if limit is None else self.now + limit
        tenants_on = self.cfg.reservation_tenants
        prio = self._effective_priority(job)
        ok: list[Gpu] = []
        tenant = False
        for start, g, owner in self.lend.values():
            if not usable(g, job.spot):
                continue
            if end <= start:
                ok.append(g)
            elif tenants_on and self._may_be_tenant(job, prio, owner):
                ok.append(g)
                tenant = True
        if not ok or len(ok) + self._usable_free(job.spot) < n:
            self.fail_lend[shape] = n
            return None
        got = pick(
            merge(self.free, group_by_node(ok)),
            n,
            job.spot,
            self.cfg.same_node,
            self._node_cap(job),
            job.nodes,
        )
        if got is None:
            self.fail_lend[shape] = n
            return None
        lent = [g for g in got if g.id in self.lend]
        tenant = tenant and any(end > self.lend[g.id][0] for g in lent)
        for g in lent:
            del self.lend[g.id]
        self._unreserve(lent)  # back into the free pool, so that _place takes them as any free GPU
        return got, tenant

    def _may_be_tenant(self, job: PendingJob, prio: int, owner: PendingJob) -> bool:
        """Would `job`, started now, be `owner`'s tenant (`_is_tenant` next cycle)? Else it
        could not be asked to step aside when the reservation falls due."""
        if prio > owner.priority or (prio == owner.priority and job.submitted_at <= owner.submitted_at):
            return False
        ots = self._team(owner.team)
        return ots.used + owner.gpus <= ots.team.nominal_gpus  # see `_plan`: only entitled owners
