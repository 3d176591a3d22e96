"""A discrete-event simulation of the queue in simulated time, driving the same policy
function the control plane calls (`schedule` or the `fifo` baseline) with a `ClusterView`
built from the simulated state, and applying its `Decision` as the control plane would.

What it models, and why each matters to the policy:
  - a job runs at full speed on its GPUs for `duration_s` of progress; it checkpoints every
    `checkpoint_every_s` of progress (the victim choice prefers recent checkpoints);
  - an eviction gives the victim `grace_s` with its GPUs (the GPUs are not free at once),
    then requeues it with the progress of its last checkpoint: work since then is lost;
  - a spot interruption takes a spot node's GPUs away at once and stops its jobs the same
    way (they lose the work since their last checkpoint);
  - a restart costs `restart_overhead_s` (process start, data loader warm-up, checkpoint load);
  - a running job's expected end is what its reported pace says, with an error (`pace_error`),
    once it has reported (`pace_after_s`); the policy never sees the trace's durations;
  - scheduling cycles run at every event and every `tick_s` while jobs wait (back-offs and
    minimum runtimes expire between events).
The simulator checks every decision (free, up, right spot class, right count) and raises
`SimError` on a bad one: it doubles as a test harness for the policy.
"""

from __future__ import annotations

import heapq
import math
import random

from visionloop.sched.sim.cluster import ClusterSpec
from visionloop.sched.sim.config import Scheduler, SimConfig, SimError
from visionloop.sched.sim.observe import cluster_view, history_key, last_checkpoint
from visionloop.sched.sim.quota import QuotaMeter
from visionloop.sched.sim.result import WASTED_AFTER_S, JobRecord, SimResult
from visionloop.sched.sim.trace import TraceJob
from visionloop.sched.view import (
    Decision,
    Freed,
    Gpu,
    PriceClass,
)

_FINISH, _RELEASE, _SPOT, _ARRIVE, _TICK = range(5)  # processing order at equal times


class _Job:
    __slots__ = (
        "attained",
        "epoch",
        "gpus",
        "kept",
        "last_cause",
        "leaving_for",
        "overhead",
        "p0",
        "pace",
        "progress",
        "queued_since",
        "rank",
        "rec",
        "restarts",
        "spec",
        "state",
        "t0",
    )  # fmt: skip

    def __init__(self, spec: TraceJob, rank: int) -> None:
        self.spec, self.rank = spec, rank
        self.rec = JobRecord(
            spec.id, spec.team, spec.priority, spec.gpus, spec.spot, spec.submit_time, spec.duration_s
        )
        self.state = "future"
        self.progress = 0.0  # progress kept (checkpointed) before the current allocation
        self.t0 = self.p0 = self.overhead = self.queued_since = self.kept = 0.0
        self.gpus: tuple[str, ...] = ()
        self.epoch = self.restarts = 0
        self.attained = 0.0
        self.leaving_for: str | None = None  # the job it steps aside for, while stopping
        self.last_cause = ""
        self.pace = 1.0  # this allocation's error on its reported pace (see SimConfig)


class Simulation:
    def __init__(
        self,
        trace: list[TraceJob],
        cluster: ClusterSpec,
        scheduler: Scheduler,
        config: SimConfig | None = None,
    ) -> None:
        self.cfg = config or SimConfig()
        self.cluster, self.scheduler = cluster, scheduler
        unknown = sorted({j.priority for j in trace} - set(self.cfg.priorities))
        if unknown:
            raise SimError(
                f"trace uses priority class(es) {', '.join(unknown)}; known: {dict(self.cfg.priorities)}"
            )
        self.jobs = {j.id: _Job(j, self.cfg.priorities[j.priority]) for j in trace}
        if len(self.jobs) != len(trace):
            raise SimError("job ids in the trace are not unique")
        self.teams = {t.name: t for t in cluster.teams}
        # The run times of the finished jobs by application and GPU count (SimConfig.history).
        self.history: dict[tuple[str, int], list[float]] = {}
        self.node_of: dict[str, str] = {}
        self.gpu_meta: dict[str, tuple[str, PriceClass]] = {}
        for node in cluster.nodes:
            for g in node.gpu_list():
                self.node_of[g.id] = node.name
                self.gpu_meta[g.id] = (g.type, g.price_class)
        self.node_up = {n.name: n.spot_trace is None or n.spot_trace.up_at(0.0) for n in cluster.nodes}
        self.holder: dict[str, _Job] = {}
        self.events: list[tuple[float, int, int, str, int]] = []
        self.seq = 0
        self.next_tick = -math.inf
        self.cycles = 0
        self.busy: dict[tuple[str, PriceClass], float] = {}
        self.team_busy: dict[str, float] = {}
        self.lost = {"preempted": 0.0, "interrupted": 0.0}
        self.useful = 0.0
        self.contended: dict[str, float] = {}
        self.contended_s = 0.0
        self.quota = QuotaMeter(self.teams, self.cfg.tick_s + self.cfg.grace_s)
        self.evicted_for: dict[str, list[float]] = {}  # job -> when evictions were made for it
        self.freed_for: dict[str, Freed] = {}  # GPU -> the job its last holder stepped aside for
        self.named_evictions = 0
        self.wasted_evictions = 0
        self._gpus_cache: list[Gpu] | None = None
        self.rng = random.Random(self.cfg.seed)

    # ----------------------------------------------------------------- events

    def _push(self, t: float, kind: int, key: str = "", epoch: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, kind, self.seq, key, epoch))

    def run(self) -> SimResult:
        for j in self.jobs.values():
            self._push(j.spec.submit_time, _ARRIVE, j.spec.id)
        for node in self.cluster.nodes:
            if node.spot_trace is not None:
                nxt = node.spot_trace.next_change(0.0)
                if math.isfinite(nxt):
                    self._push(nxt, _SPOT, node.name)
        start = min((j.spec.submit_time for j in self.jobs.values()), default=0.0)
        done = 0
        t = stop = start
        contended = False
        while self.events and done < len(self.jobs):
            last, t = t, self.events[0][0]
            if t > self.cfg.max_time_s:
                break
            stop = t
            if contended:
                self.contended_s += t - last
                for j in self.holder.values():
                    self.contended[j.spec.team] = self.contended.get(j.spec.team, 0.0) + (t - last)
            while self.events and self.events[0][0] == t:
                _, kind, _, key, epoch = heapq.heappop(self.events)
                done += self._handle(t, kind, key, epoch)
            if done == len(self.jobs):
                break
            contended = False
            if any(j.state == "queued" for j in self.jobs.values()):
                decision = self._cycle(t)
                waiting_teams = {j.spec.team for j in self.jobs.values() if j.state == "queued"}
                contended = bool(self.teams) and waiting_teams >= set(self.teams)
                if self._stuck(decision):
                    break
                if self.next_tick <= t:
                    self.next_tick = t + self.cfg.tick_s
                    self._push(self.next_tick, _TICK)
            # After this cycle's decision: the time a team's fitting job waits from here on is
            # where the quota guarantee is not kept (at once).
            queued = (j.spec for j in self.jobs.values() if j.state == "queued")
            held = {g: j.spec.team for g, j in self.holder.items()}
            self.quota.update(t, ((s.id, s.team, s.gpus, s.spot) for s in queued), self._gpus(), held)
        self.quota.close(stop)  # what the run saw: not past max_time_s
        return self._result(start, t)

    def _handle(self, t: float, kind: int, key: str, epoch: int) -> int:
        if kind == _ARRIVE:
            j = self.jobs[key]
            j.state, j.queued_since = "queued", t
        elif kind == _FINISH:
            j = self.jobs[key]
            if j.epoch == epoch and (
                j.state == "running" or (j.state == "stopping" and j.last_cause == "preempted")
            ):
                # A victim may finish inside its grace period: that allocation lost nothing.
                self._free_for(j)
                j.state = "running"
                self._end_allocation(j, t, kept=j.spec.duration_s)
                j.state, j.rec.finish = "done", t
                self.history.setdefault(history_key(j.spec), []).append(j.attained / j.spec.gpus)
                return 1
        elif kind == _RELEASE:
            j = self.jobs[key]
            if j.epoch == epoch and j.state == "stopping":
                self._free_for(j)
                self._end_allocation(j, t, kept=j.kept)
                j.progress, j.state, j.queued_since = j.kept, "queued", t
                j.restarts += 1
        elif kind == _SPOT:
            node = next(n for n in self.cluster.nodes if n.name == key)
            assert node.spot_trace is not None
            up = node.spot_trace.up_at(t)
            self.node_up[key] = up
            self._gpus_cache = None
            if not up:
                for j in {h for g, h in self.holder.items() if self.node_of[g] == key}:
                    if j.state == "running":
                        self._stop(j, t, "interrupted")
            nxt = node.spot_trace.next_change(t)
            if math.isfinite(nxt):
                self._push(nxt, _SPOT, key)
        return 0

    # ----------------------------------------------------------------- job life

    def _start(self, j: _Job, gpus: tuple[str, ...], t: float) -> None:
        j.rec.queued_s += t - j.queued_since
        if j.rec.first_start is None:
            j.rec.first_start = t
        late = t - self.cfg.grace_s - WASTED_AFTER_S
        self.wasted_evictions += sum(1 for at in self.evicted_for.pop(j.spec.id, ()) if at < late)
        j.state, j.gpus, j.t0, j.p0 = "running", gpus, t, j.progress
        j.overhead = self.cfg.restart_overhead_s if j.restarts else 0.0
        j.epoch += 1
        j.pace = math.exp(self.rng.gauss(0.0, self.cfg.pace_error)) if self.cfg.pace_error > 0 else 1.0
        for g in gpus:
            self.holder[g] = j
        self._push(t + j.overhead + (j.spec.duration_s - j.p0), _FINISH, j.spec.id, j.epoch)

    def _stop(self, j: _Job, t: float, cause: str) -> None:
        j.kept, _ = last_checkpoint(j, t, self.cfg.checkpoint_every_s)
        if cause == "preempted" and self.cfg.sigterm_checkpoint:
            j.kept = j.p0 + max(0.0, t - j.t0 - j.overhead)
        j.kept = min(j.kept, j.spec.duration_s)
        j.state, j.last_cause = "stopping", cause
        if cause == "preempted":
            j.rec.preemptions += 1
        else:
            j.rec.interruptions += 1
        self._push(t + self.cfg.grace_s, _RELEASE, j.spec.id, j.epoch)

    def _free_for(self, j: _Job) -> None:
        """A victim leaves: its GPUs are the job's it stepped aside for, in the next cycle
        (`ClusterView.freed_for`), if it wrote a checkpoint at SIGTERM."""
        if j.leaving_for is not None and self.cfg.sigterm_checkpoint:
            self.freed_for.update(dict.fromkeys(j.gpus, Freed(j.leaving_for, j.spec.team)))
        j.leaving_for = None

    def _end_allocation(self, j: _Job, t: float, kept: float) -> None:
        held = t - j.t0
        n = len(j.gpus)
        useful = max(0.0, kept - j.p0)
        self.useful += n * useful
        if j.state == "stopping":
            self.lost[j.last_cause] += n * (held - useful)
        elif j.restarts:  # restart overhead of a finished job, charged to what stopped it
            self.lost[j.last_cause] += n * j.overhead
        j.attained += n * held
        self.team_busy[j.spec.team] = self.team_busy.get(j.spec.team, 0.0) + n * held
        for g in j.gpus:
            meta = self.gpu_meta[g]
            self.busy[meta] = self.busy.get(meta, 0.0) + held
            del self.holder[g]
        j.gpus = ()

    # ----------------------------------------------------------------- cycles

    def _gpus(self) -> list[Gpu]:
        if self._gpus_cache is None:
            self._gpus_cache = [g for n in self.cluster.nodes for g in n.gpu_list(self.node_up[n.name])]
        return self._gpus_cache

    def _cycle(self, t: float) -> Decision:
        self.cycles += 1
        view = cluster_view(self, t)
        decision = self.scheduler(view)
        up = {g.id for g in view.gpus if g.up}
        spot_ids = {g.id for g in view.gpus if g.spot}
        seen: set[str] = set()
        for p in decision.placements:
            j = self.jobs.get(p.job_id)
            if j is None or j.state != "queued":
                raise SimError(f"t={t}: placed job {p.job_id}, which is not queued")
            bad = [g for g in p.gpu_ids if g not in up or g in self.holder or g in seen]
            if bad or len(p.gpu_ids) != j.spec.gpus:
                raise SimError(
                    f"t={t}: job {p.job_id} placed on {p.gpu_ids}: busy, down or wrong count {bad}"
                )
            if j.spec.spot == "never" and spot_ids.intersection(p.gpu_ids):
                raise SimError(f"t={t}: job {p.job_id} (spot: never) placed on spot GPUs")
            seen.update(p.gpu_ids)
        for e in decision.evictions:
            j = self.jobs.get(e.job_id)
            if j is None or j.state != "running":
                raise SimError(f"t={t}: evicted job {e.job_id}, which is not running")
        self.freed_for = {}  # for one cycle only
        for e in decision.evictions:
            self._stop(self.jobs[e.job_id], t, "preempted")
            self.jobs[e.job_id].leaving_for = e.for_job
            if e.for_job is not None:
                self.evicted_for.setdefault(e.for_job, []).append(t)
                self.named_evictions += 1
        for p in decision.placements:
            self._start(self.jobs[p.job_id], p.gpu_ids, t)
        placed = {p.job_id for p in decision.placements}
        silent = [j.spec.id for j in self.jobs.values() if j.state == "queued" and j.spec.id not in placed]
        silent = [i for i in silent if i not in decision.waiting]
        if silent:
            raise SimError(f"t={t}: queued job(s) {silent[:5]} neither placed nor given a reason")
        return decision

    def _stuck(self, decision: Decision) -> bool:
        """Nothing running, nothing coming, every node up, and the policy placed nothing:
        the remaining jobs can never run (the policy reported them as impossible)."""
        if decision.placements or decision.evictions:
            return False
        if any(j.state in ("running", "stopping", "future") for j in self.jobs.values()):
            return False
        return all(self.node_up.values())

    def _result(self, start: float, end: float) -> SimResult:
        up: dict[tuple[str, PriceClass], float] = {}
        for node in self.cluster.nodes:
            span = end - start if node.spot_trace is None else node.spot_trace.uptime(start, end)
            key = (node.gpu_type, node.price_class)
            up[key] = up.get(key, 0.0) + node.gpus * span
        return SimResult(
            jobs=[j.rec for j in self.jobs.values()],
            start=start,
            end=end,
            busy_gpu_s=self.busy,
            team_gpu_s=self.team_busy,
            up_gpu_s=up,
            lost_gpu_s=self.lost,
            useful_gpu_s=self.useful,
            cycles=self.cycles,
            unfinished=[j.spec.id for j in self.jobs.values() if j.state != "done"],
            contended_team_gpu_s=self.contended,
            contended_s=self.contended_s,
            quota_wait_s=self.quota.every.total_s,
            quota_wait_longest_s=self.quota.every.longest_s,
            quota_wait_late=self.quota.every.late,
            quota_wait_late_short=self.quota.every.late_short,
            quota_wait_late_reclaimable=self.quota.reclaimable.late,
            quota_wait_late_reclaimable_short=self.quota.reclaimable.late_short,
            quota_wait_longest_reclaimable_s=self.quota.reclaimable.longest_s,
            quota_jobs_late=self.quota.jobs.late,
            quota_jobs_late_short=self.quota.jobs.late_short,
            quota_job_longest_s=max(self.quota.jobs.longest_s.values(), default=0.0),
            named_evictions=self.named_evictions,
            # Those whose job never started count as wasted too.
            wasted_evictions=self.wasted_evictions + sum(len(v) for v in self.evicted_for.values()),
        )


def simulate(
    trace: list[TraceJob], cluster: ClusterSpec, scheduler: Scheduler, config: SimConfig | None = None
) -> SimResult:
    """Run `trace` on `cluster` under `scheduler` until every job has finished."""
    return Simulation(trace, cluster, scheduler, config).run()
