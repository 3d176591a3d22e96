"""What a queued job that cannot start now is told, and what it holds meanwhile: the reason
shown to its owner (what it waits for, what holds the GPUs, what it is behind), GPUs held
for it until victims can be preempted, or a reservation (`reservation.py`). `_wait` is the
fast path for a saturated cluster, where most of a long queue ends: the same decisions and
reasons as `Cycle._consider`, without the searches that cannot succeed."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from visionloop.sched.cycle_state import TeamState
from visionloop.sched.reasons import backoff_reason, impossible_reason, n_gpus, plural
from visionloop.sched.under_head import UnderHead
from visionloop.sched.view import Gpu, PendingJob


class Waiting(UnderHead):
    """The reasons and holds of jobs that wait."""

    def _wait(self, jobs: Iterable[PendingJob], prio: int) -> None:
        """`_consider` for jobs of one class in a saturated cluster: the same decisions and
        reasons, without the placement and victim searches that cannot succeed (a job that
        might still preempt takes the full path). Reasons that name no position in the queue
        are shared string objects. Hot: ten thousand queued jobs pass through here, so it
        keeps what it reads in locals."""
        now, waiting, reasons, impossible = self.now, self.decision.waiting, self.reasons, self.impossible
        young_min, preemption, backfill = self.young_min, self.cfg.preemption, self.cfg.backfill
        teams, behind = self.teams, self.behind
        resv, under, fail_plan = self.cfg.reservations, self.cfg.quota_under_head, self.fail_plan
        higher = 0
        for p, k in self.blocked.items():
            if p > prio:
                higher += k  # blocked jobs of higher classes: unchanged while this class waits
        same = self.blocked.get(prio, 0)
        version, reserved_by_spot = -1, {}
        for job in jobs:
            if job.not_before > now:
                waiting[job.id] = backoff_reason(job, now)
                continue
            ts = teams.get(job.team) or self._team(job.team)
            n = job.gpus
            head = behind.get(job.id)  # a job behind its team's head never preempts
            if (
                n <= 0
                or self.blocker is not None
                or job.id in self.owed
                or (
                    head is None
                    and self.evictions_left > 0
                    and (self._could_preempt(job, ts) or (under and self._evicts_tenants(job)))
                )
                or (
                    resv
                    and self._wants_reservation(job, ts, prio)
                    # One that cannot be planned (`_plan`'s memo) is told what `_blocked` says.
                    and n < fail_plan.get((job.spot, job.nodes), n + 1)
                )
            ):
                self.blocked[prio] = same
                self._consider(job, prio)
                same = self.blocked.get(prio, 0)
                continue
            why = impossible.get((job.spot, n), "")
            if why == "":
                why = impossible[(job.spot, n)] = impossible_reason(job, self.caps, self.cfg.same_node)
            if why is not None:
                waiting[job.id] = why
                continue
            if ts.used + n > ts.team.nominal_gpus + ts.team.borrow_limit:
                self.blocked[prio] = same
                self._consider(job, prio)  # quota: the full path words it
                same = self.blocked.get(prio, 0)
                continue
            if version != self.version:  # held GPUs change only with claims
                version = self.version
                reserved_by_spot = {s: self._reserved_usable(s) for s in ("never", "allowed", "preferred")}
            reserved = reserved_by_spot[job.spot]
            reserved = reserved if reserved >= n else 0  # held GPUs that would have been enough
            young = preemption and young_min < job.priority < self.top
            key = (
                n,
                job.spot,
                higher,
                0 if higher else same,
                young,
                reserved,
                len(self.claimants),
                None if head is None else head.id,
            )
            reason = reasons.get(key)
            if reason is None:
                reason = f"waiting for {n_gpus(n)}: 0 free" + self._tail(higher, same, young, reserved)
                if head is not None:
                    reason += (
                        f"; behind job {head.id} of team {job.team} (priority {self._prio(head.priority)})"
                    )
                if higher or not same:
                    reasons[key] = reason
            waiting[job.id] = reason
            same += 1
            if not backfill:
                self.blocker = job
        self.blocked[prio] = same

    def _blocked(self, job: PendingJob, ts: TeamState, quota_ok: bool, prio: int) -> None:
        """Say why a job waits. Hot: with a long queue most jobs end here, so the tail of the
        reason (what holds the GPUs, what it is behind) is built once per distinct tail."""
        n = job.gpus
        if not quota_ok:
            self.decision.waiting[job.id] = (
                f"waiting for {n_gpus(n)}: team {job.team} is at its limit {ts.limit} = nominal "
                f"{ts.team.nominal_gpus} + borrow {ts.team.borrow_limit} ({ts.used} in use or reserved)"
            )
            return
        free = self._usable_free(job.spot)
        higher = 0
        for p, k in self.blocked.items():
            if p > prio:
                higher += k
        same = self.blocked.get(prio, 0)
        young = self.cfg.preemption and self.young_min < job.priority < self.top
        reserved = self._reserved_usable(job.spot)
        reserved = reserved if free + reserved >= n else 0  # held GPUs that would have been enough
        key = (higher, 0 if higher else same, young, reserved, len(self.claimants))
        tail = self.tails.get(key)
        if tail is None:
            tail = self._tail(higher, same, young, reserved)
            if higher or not same:
                self.tails[key] = tail
        head = f"waiting for {n} GPU{'' if n == 1 else 's'}: {free} free"
        if job.spot == "never" and self.free_count["spot"]:
            head += f" (not counting {self.free_count['spot']} spot, which this job never uses)"
        if free and free >= n:
            head += f"; no single node has {n} free" if self.cfg.same_node else "; not enough CPU or memory"
        if job.id in self.behind:
            first = self.behind[job.id]
            tail += f"; behind job {first.id} of team {job.team} (priority {self._prio(first.priority)})"
        self.decision.waiting[job.id] = head + tail
        self.blocked[prio] = same + 1
        target = self._soon(job, ts) if free > 0 and job.id not in self.behind else None
        if target is not None and self._hold_too_long(job, target):
            target = None
        if target is not None and (held := self._hold(job, ts, target)):
            self.decision.waiting[job.id] += (
                f"; {held} free GPU{plural(held)} held for it until lower-priority or borrowed jobs "
                "can be preempted"
            )
        elif self._wants_reservation(job, ts, prio) and self._reserve(job, ts, prio) and self._may_hold():
            pass  # a reservation that holds its GPUs (else the starvation guard may still hold some)
        elif job.id == self.starving_id and free > 0 and (held := self._hold(job, ts)):
            self.decision.waiting[job.id] += f"; waiting for a long time, so {held} free GPUs are held for it"
        if not self.cfg.backfill:
            self.blocker = job

    def _hold_too_long(self, job: PendingJob, target: Sequence[Gpu]) -> bool:
        """Would free GPUs held for `job` stay idle past `hold_within_s`, until the youngest
        running job on `target` may be preempted? Then they are not held: other jobs use them
        meanwhile. Not for the top class, which preempts young jobs."""
        limit = self.cfg.hold_within_s
        if limit is None or job.priority >= self.top_rank:
            return False
        ids = {g.id for g in target}
        oldest_start = self.now - self.cfg.min_runtime_s + limit  # younger than this: too long
        return any(
            v.preemptible and v.started_at > oldest_start and not ids.isdisjoint(v.gpu_ids)
            for v in self.view.running
        )

    def _tail(self, higher: int, same: int, young: bool, reserved: int) -> str:
        """The end of a waiting reason: GPUs held for others that would have been enough,
        what the job is behind, and whether preemption may help soon. Only the position
        varies from job to job."""
        key = (reserved, len(self.claimants), young)
        fixed = self.tail_parts.get(key)
        if fixed is None:
            held = ""
            if reserved and self.claimants:
                c = self.claimants[0]
                others = len(self.claimants) - 1
                more = f" and {others} other job{plural(others)}" if others else ""
                verb = "is" if reserved == 1 else "are"
                prio = self._prio(c.priority)
                held = f"; {reserved} more {verb} held for job {c.id} (priority {prio}){more}"
            soon = f"; lower-priority jobs become preemptible after {self.cfg.min_runtime_s:.0f} s of runtime"
            fixed = self.tail_parts[key] = (held, soon if young else "")
        if higher:
            return f"{fixed[0]}; behind {higher} higher-priority job{plural(higher)}{fixed[1]}"
        if same:
            return f"{fixed[0]}; behind {same} job{plural(same)} of equal priority{fixed[1]}"
        return fixed[0] + fixed[1]
