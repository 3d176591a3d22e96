"""`quota_under_head` (policy.py): while a team's head, a higher class, must borrow, its
lower-class jobs that fit in its unused nominal quota go in the borrowing pass right after
the team's jobs of the next class up, take what idle GPUs are left there and reclaim the
team's quota from borrowers of classes below that, or of that class from teams whose share
stays larger (`Preemption._after_head`), as the head's tenants. `Cycle.run` marks them
(`_under`) and calls `_consider_unders` at that point."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from visionloop.sched.cycle_state import TeamState
from visionloop.sched.reasons import n_gpus
from visionloop.sched.reservation import Reservations
from visionloop.sched.view import Gpu, PendingJob


class UnderHead(Reservations):
    """The jobs behind a borrowing head that may take their team's quota."""

    def _consider(self, job: PendingJob, prio: int) -> None:
        """Place, claim, preempt or give a reason (`Cycle._consider`)."""
        raise NotImplementedError

    def _wait(self, jobs: Iterable[PendingJob], prio: int) -> None:
        """The reasons of jobs that cannot start (`Waiting._wait`)."""
        raise NotImplementedError

    def _under(self, job: PendingJob, prio: int) -> None:
        """`job` waits behind its team's higher-class head that must borrow, yet fits in its
        team's unused nominal quota: with `quota_under_head` it goes after its team's jobs of
        the next class up (`_consider_unders`)."""
        self.unders.setdefault(job.team, []).append((job, prio))

    def _unders_after(
        self, borrowers: dict[int, dict[str, list[PendingJob]]], key: Callable[[PendingJob], tuple[Any, ...]]
    ) -> dict[int, list[str]]:
        """Per class of the borrowing pass, the teams with jobs behind their head (`_under`)
        that go right after the team's jobs of that class: the lowest of its classes there
        above theirs. Once per cycle, before the pass (which adds no job to it); each
        team's jobs for each such class are sorted here, once: class, then the team's order."""
        out: dict[int, list[str]] = {}
        for team, unders in self.unders.items():
            above = sorted(p for p, per_team in borrowers.items() if per_team.get(team))
            groups: dict[int, list[tuple[PendingJob, int]] | None] = {}  # by the jobs' class
            for job, q in unders:
                if q in groups:
                    group = groups[q]
                else:
                    after = next((p for p in above if p > q), None)
                    group = None
                    if after is not None:
                        group = self.under_after.get((team, after))
                        if group is None:
                            group = self.under_after[(team, after)] = []
                            out.setdefault(after, []).append(team)
                    groups[q] = group
                if group is not None:
                    group.append((job, q))
        for group in self.under_after.values():
            group.sort(key=lambda jp: (-jp[1], key(jp[0])))
        return out

    def _saturated(self) -> bool:
        """No GPU free and none being released (`Cycle._saturated`)."""
        raise NotImplementedError

    def _consider_unders(self, team: str, after: int) -> None:
        """Right after its last job of class `after`, the next class up, a team's lower-class
        jobs that fit in its unused nominal quota take it, reclaiming it from borrowers of
        classes below `after`, or of `after` from teams whose share stays larger (back in
        the queue, those come after them and cannot take it straight back), as the head's
        tenants: it evicts them, however young, once that lets it start. A borrower ahead
        of them is never their victim, nor is the GPU it takes, but the free GPUs it holds
        idle are theirs (`_open_holds`). With them in the entitled pass instead, ahead of
        the borrowers, a higher-class borrower took back what they took, and the head and
        they took turns (the livelock fuzz: 121 of 1,800 runs thrashed or never finished);
        reclaiming from the class of the jobs they follow, ordered by fair share, one was
        taken back over a thousand times (another job's held GPUs counted in its team's
        share); right after the head, they jumped their team's classes between theirs and
        the head's."""
        ts = self._team(team)
        opened: list[Gpu] = []
        own_gpus = 0
        if self.cfg.holds_yield_to_quota:
            group = self.under_after.get((team, after), ())
            opened, own_gpus = self._open_holds(team, all(job.checkpoints_at_stop for job, _ in group))
        if not opened and not own_gpus:
            self._consider_team_unders(team, after, ts)
            return
        ts.used -= own_gpus  # its borrowers' GPUs do not count against the quota their tenants take
        try:
            self._consider_team_unders(team, after, ts)
        finally:
            ts.used += own_gpus
            self._close_holds(opened, team)

    def _open_holds(self, team: str, checkpoint: bool) -> tuple[list[Gpu], int]:
        """Put back in the free pool, for `team`'s jobs behind their head, the free GPUs held
        idle for jobs whose teams borrow with them (`holds_yield_to_quota`): other teams'
        borrowers' holds, and its own head's, whose tenants they become; with `checkpoint`
        (they write a checkpoint when asked to stop), those of its other borrowers too. Those
        GPUs, and the GPUs its own borrowers count against the team (0 when they hold none)."""
        head = self.heads.get(team)
        opened: list[Gpu] = []
        own_gpus = 0
        for job, held in self.borrower_holds:
            if job.team == team:
                # Another borrower of its own team (of the head's class or the next class
                # up): a 12-GPU one holding 1 GPU counted all 12 against the quota and kept
                # a 1-GPU job that fitted out for 10 minutes. Only a tenant that checkpoints
                # at SIGTERM, which loses nothing when it steps aside: without, such tenants,
                # evicted young, made more late waits than they saved (BENCHMARKS.md).
                if not (checkpoint or (head is not None and head[0] is job)):
                    continue
                own_gpus += job.gpus
            opened.extend(g for g in held if g.id not in self.holds_taken)
        if not opened:
            return [], own_gpus
        self._unreserve(opened)
        self._pools_grew()
        return opened, own_gpus

    def _close_holds(self, opened: list[Gpu], team: str) -> None:
        """Hold again what `_open_holds` opened and nobody took; the jobs whose holds `team`'s
        jobs took from are told so (their reasons were written when they held them)."""
        free_ids = self._free_ids()
        still = [g for g in opened if g.id in free_ids]
        taken = {g.id for g in opened if g.id not in free_ids}
        self.holds_taken.update(taken)
        self._reserve_free(still)
        if not taken:
            return
        lost: Counter[str] = Counter()  # job -> how many of its held GPUs were taken
        holders: dict[str, PendingJob] = {}
        for job, held in self.borrower_holds:
            if k := sum(1 for g in held if g.id in taken):
                lost[job.id] += k
                holders[job.id] = job
        for job_id, k in lost.items():
            job = holders[job_id]
            why = self.decision.waiting.get(job.id)
            if why is None:
                continue
            to = (
                f"team {team}'s jobs within its nominal quota (a team's quota comes before another "
                "team's borrowing)"
                if job.team != team
                else "its team's lower-class jobs within the team's nominal quota, as its tenants"
            )
            self.decision.waiting[job.id] = f"{why}; {n_gpus(k)} of those held for it went to {to}"

    def _consider_team_unders(self, team: str, after: int, ts: TeamState) -> None:
        """`_consider_unders` for one team's group, with `ts` its standing."""
        # In a saturated cluster, those no eviction can help (known from the first of their
        # shape) only need their reasons: the fast path, in runs of one class (ten thousand
        # queued jobs made a cycle twice as long without it).
        fast: list[PendingJob] = []
        fast_prio = 0
        for job, prio in self.under_after.pop((team, after), ()):
            if ts.used + job.gpus > ts.team.nominal_gpus:
                continue  # behind its head, in its own class: idle GPUs only
            self.under_done.add(job.id)
            self.under_head[job.id] = after
            if (self.saturated or self._saturated()) and self._cannot_preempt(job, ts):
                if fast and fast_prio != prio:
                    self._wait(fast, fast_prio)
                    fast = []
                fast.append(job)
                fast_prio = prio
                continue
            if fast:
                self._wait(fast, fast_prio)
                fast = []
            self._consider(job, prio)
        if fast:
            self._wait(fast, fast_prio)
