"""Tiresias as a baseline for the simulator: discretized two-dimensional least-attained-
service (2D-LAS; Gu et al., "Tiresias: A GPU Cluster Manager for Distributed Deep
Learning", NSDI 2019), re-implemented from the paper and its simulator's `dlas-gpu` policy
(SymbioticLab/Tiresias, simulator/run_sim.py).

- Every job starts in queue 0. A job whose attained service (GPUs x seconds it has run)
  reaches a queue's threshold moves to the end of the next queue: with the default one
  threshold of 3,250 GPU-seconds, two queues.
- Each cycle allocates from scratch: queues in order, and in a queue the jobs that ran in
  the last round first, then the others in the order they entered it (so a job demoted
  while it runs goes behind the next queue's waiting jobs); a job that fits in the GPUs
  not yet allocated runs (later, smaller jobs may pass a bigger one), one that does not is
  preempted if it was running. GPUs are counted, not placed (the simulator's `count`
  scheme), so a job given GPUs that are still being released starts once they are.
- Starvation: the simulator's `solve_starvation` knob (a waiting job whose pending time
  exceeds knob x its executed time returns to queue 0) is off by default, as there.

Tiresias knows no priority classes, teams or quotas: it sees sizes and attained service.
It honours what any scheduler must here: spot policies, down GPUs and retry back-off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from visionloop.sched.placement import capacities, free_pool, pick, take, usable
from visionloop.sched.reasons import backoff_reason, impossible_reason, n_gpus
from visionloop.sched.view import ClusterView, Decision, Eviction, Placement


@dataclass(frozen=True)
class TiresiasConfig:
    thresholds_gpu_s: tuple[float, ...] = (3250.0,)  # queue limits in GPU-seconds: N limits, N+1 queues
    starvation: float = 0.0  # solve_starvation; 0: off
    same_node: bool = False
    # Decide only when run_sim.py would: at an arrival, a completion, a change of the GPUs up,
    # and at the next demotion check it schedules, (limit - executed seconds) // GPUs after
    # a round, in whole seconds. That check mixes seconds and GPU-seconds and rounds down, so
    # a multi-GPU job is demoted up to twice its threshold late unless another event comes
    # first (a 16-GPU job checked at 203 s has 3,248 GPU-s, and next at 393 s). Off: every
    # cycle, demoted at the threshold, as the paper describes.
    reference_rounds: bool = True


class Tiresias:
    """A scheduler for `visionloop.sched.sim.simulate`; it keeps its queues between calls, so
    one instance serves one simulation."""

    def __init__(self, config: TiresiasConfig | None = None) -> None:
        self.cfg = config or TiresiasConfig()
        self.queues: list[list[str]] = [[] for _ in range(len(self.cfg.thresholds_gpu_s) + 1)]
        self.queue_of: dict[str, int] = {}
        self.executed: dict[str, float] = {}  # attained service counted for the queue (reset on promotion)
        self.base: dict[str, float] = {}  # attained service at the last promotion
        self.pending_since: dict[str, float] = {}
        # reference_rounds: what the last round saw and decided, and when the next is due.
        self.seen: tuple[frozenset[str], int] | None = None
        self.next_round = math.inf
        self.reasons: dict[str, str] = {}
        self.starting: set[str] = set()  # given GPUs in the last round, not started yet

    def _update(self, view: ClusterView) -> None:
        attained = {j.id: j.attained_gpu_s for j in view.running}
        attained.update({j.id: j.attained_gpu_s for j in view.queued})
        for q in self.queues:
            q[:] = [i for i in q if i in attained]
        for i in [i for i in self.queue_of if i not in attained]:
            for d in (self.queue_of, self.executed, self.base, self.pending_since):
                d.pop(i, None)
        submitted = {j.id: j.submitted_at for j in view.queued}
        # Jobs seen for the first time enter queue 0: those already running first, as if they
        # had run in the last round (the simulator shows every job queued first; a scheduler
        # started beside running jobs does not), then the rest in arrival order.
        running_now = {j.id for j in view.running}
        for i in sorted(
            (i for i in attained if i not in self.queue_of),
            key=lambda i: (i not in running_now, submitted.get(i, 0.0), i),
        ):
            self.queues[0].append(i)
            self.queue_of[i] = 0
            self.base[i] = 0.0
        for i, a in attained.items():
            self.executed[i] = a - self.base[i]
            k = self.queue_of[i]
            while k < len(self.cfg.thresholds_gpu_s) and self.executed[i] >= self.cfg.thresholds_gpu_s[k]:
                self.queues[k].remove(i)
                k += 1
                self.queues[k].append(i)
                self.queue_of[i] = k
        running = {j.id for j in view.running}
        for i in attained:
            if i in running:
                self.pending_since.pop(i, None)
            else:
                self.pending_since.setdefault(i, view.now)
        knob = self.cfg.starvation
        if knob > 0:
            for i, since in list(self.pending_since.items()):
                k = self.queue_of[i]
                if k > 0 and self.executed[i] > 0 and view.now - since >= knob * self.executed[i]:
                    self.queues[k].remove(i)
                    self.queues[0].append(i)
                    self.queue_of[i] = 0
                    self.base[i] = attained[i]
                    self.executed[i] = 0.0

    def __call__(self, view: ClusterView) -> Decision:
        if not self.cfg.reference_rounds:
            return self._round(view)
        seen = self._events_seen(view)
        if not self._round_due(view, seen):
            # Between run_sim.py's events nothing changes: the same reasons, no new decision.
            return Decision(waiting={j.id: self.reasons.get(j.id, "waiting") for j in view.queued})
        decision = self._round(view)
        self._after_round(view, decision, seen)
        return decision

    @staticmethod
    def _events_seen(view: ClusterView) -> tuple[frozenset[str], int]:
        """What run_sim.py's events change: the jobs present (arrivals, completions) and the
        GPUs up."""
        ids = frozenset(j.id for j in view.running) | frozenset(j.id for j in view.queued)
        return ids, sum(1 for g in view.gpus if g.up)

    def _round_due(self, view: ClusterView, seen: tuple[frozenset[str], int]) -> bool:
        if seen != self.seen or view.now >= self.next_round:
            return True
        queued = {j.id for j in view.queued}
        return any(i in queued for i in self.starting)

    def _after_round(self, view: ClusterView, decision: Decision, seen: tuple[frozenset[str], int]) -> None:
        """Remember what this round saw, and schedule run_sim.py's next demotion check."""
        self.seen = seen
        self.reasons = dict(decision.waiting)
        evicted = {e.job_id for e in decision.evictions}
        gpus = {j.id: len(j.gpu_ids) for j in view.running if j.id not in evicted}
        gpus.update({j.id: j.gpus for j in view.queued if j.id in self.starting})
        last = len(self.cfg.thresholds_gpu_s)
        self.next_round = math.inf
        for i, n in gpus.items():
            k = self.queue_of.get(i, last)
            if k < last and n > 0:
                executed_s = int(self.executed[i] / n)  # run_sim.py's executed_time: seconds
                step = int(self.cfg.thresholds_gpu_s[k] - executed_s) // n
                self.next_round = min(self.next_round, view.now + step)

    def _round(self, view: ClusterView) -> Decision:
        self._update(view)
        decision = Decision()
        running = {j.id: j for j in view.running}
        queued = {j.id: j for j in view.queued}
        caps = capacities(view.gpus)
        left = sum(1 for g in view.gpus if g.up)
        runs: list[str] = []
        for q in self.queues:
            # In the queue's order, as run_sim.py walks it: the jobs that ran in the last
            # round first (waiting jobs go behind them after each round, below), then the
            # others in the order they entered the queue, a job demoted into it since last.
            for i in q:
                n = len(running[i].gpu_ids) if i in running else queued[i].gpus
                if n <= left:
                    left -= n
                    runs.append(i)
                elif i in running and running[i].preemptible:
                    decision.evictions.append(
                        Eviction(i, f"preempted: queue {self.queue_of[i]} job after higher-queue jobs")
                    )
        free = free_pool(view)
        self.starting = set()
        for i in runs:
            job = queued.get(i)
            if job is None:
                continue  # running (kept), or on its way out after an earlier preemption
            self.starting.add(i)
            if job.not_before > view.now:
                decision.waiting[i] = backoff_reason(job, view.now)
            elif (why := impossible_reason(job, caps, self.cfg.same_node)) is not None:
                decision.waiting[i] = why
            elif (got := pick(free, job.gpus, job.spot, self.cfg.same_node, None, job.nodes)) is not None:
                take(free, got)
                decision.placements.append(Placement(i, tuple(g.id for g in got)))
            else:
                n_free = sum(1 for gs in free.values() for g in gs if usable(g, job.spot))
                decision.waiting[i] = (
                    f"given {n_gpus(job.gpus)} in queue {self.queue_of[i]}: {n_free} free yet"
                )
        for i, job in queued.items():
            if i not in decision.waiting and i not in {p.job_id for p in decision.placements}:
                if (why := impossible_reason(job, caps, self.cfg.same_node)) is not None:
                    decision.waiting[i] = why
                else:
                    decision.waiting[i] = (
                        f"waiting in queue {self.queue_of[i]} (least attained service first)"
                    )
        # Waiting jobs go behind the running ones in each queue (run_sim.py's reordering),
        # a job given GPUs still being released counting as running, as there.
        placed = {p.job_id for p in decision.placements}
        evicted = {e.job_id for e in decision.evictions}
        given = {i for i in self.starting if decision.waiting.get(i, "").startswith("given ")}
        self.starting = placed | given
        for q in self.queues:
            on = [
                i
                for i in q
                if (i in running and i not in evicted and running[i].preemptible) or i in self.starting
            ]
            q[:] = on + [i for i in q if i not in on]
        return decision
