"""Preemption within a team and class: a waiting job may evict a running job of its own team
and class only by one of two rules. "srpt" (`srpt_preemption`): the victim has more than
twice the GPU-time left by its limit that the waiting job has by its own (its remaining time
only falls as it runs, so two jobs never take turns evicting each other). "las"
(`las_preemption`): the victim has received the threshold's GPU-time and the waiting job has
not. Never a job the starvation guard would start first again. `Preemption` asks these."""

from __future__ import annotations

import math

from visionloop.sched.cycle_state import CycleState
from visionloop.sched.view import ActiveJob, PendingJob, planned_runtime_s, remaining_gpu_s

# "srpt" preemption: a victim must have more than this many times the waiting job's
# remaining GPU-time, so that a restart is paid only for a large gain.
SRPT_FACTOR = 2.0


class WithinClass(CycleState):
    """The rules by which a job of a team and class may step aside for another of both."""

    def _srpt_yields(self, v: ActiveJob, job: PendingJob) -> bool:
        """ "srpt" preemption: `v`, of `job`'s team and class, has more than twice the GPU-time
        left by its limit that `job` has by its own."""
        left = self.srpt_left.get(v.id)
        own = remaining_gpu_s(job.gpus, planned_runtime_s(job), job.attained_gpu_s)
        if left is None or own is None or self._held_rank(v) != job.priority:
            return False
        return left > SRPT_FACTOR * own

    def _las_yields(self, v: ActiveJob, job: PendingJob) -> bool:
        """ "las" preemption: `v`, of `job`'s team and class, may step aside for it
        (`_las_victim`), and `job` has received less than the threshold."""
        return (
            self.cfg.las_preemption
            and job.attained_gpu_s < self.cfg.las_threshold_gpu_s
            and v.priority == job.priority
            and self._las_victim(v)
        )

    def _starved(self, v: ActiveJob) -> bool:
        """Was `v` submitted longer ago than the starvation guard's `reserve_after_s`? Back in
        the queue, the guard would start it first again, on the GPUs its evictor waits for."""
        after = self.cfg.reserve_after_s
        return after is not None and v.submitted_at is not None and self.now - v.submitted_at >= after

    def _las_could(self, job: PendingJob) -> bool:
        return job.attained_gpu_s < self.cfg.las_threshold_gpu_s and (job.team, job.priority) in self.las_old

    def _srpt_could(self, job: PendingJob) -> bool:
        own = remaining_gpu_s(job.gpus, planned_runtime_s(job), job.attained_gpu_s)
        if not self.srpt_most or own is None:
            return False
        return self.srpt_most.get((job.team, job.priority), -math.inf) > SRPT_FACTOR * own
