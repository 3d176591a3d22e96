"""What the policy may know of the simulated cluster at a time: the `ClusterView` the engine
hands it. Each running job's last checkpoint, and the end its reported pace implies (with
the allocation's seeded error, never the trace's true duration); each job's time limit, if
the configuration has users give one. Kept apart from the engine, which alone knows the
truth, so that what leaks into the view is in one short place."""

from __future__ import annotations

import math
import statistics
import zlib
from typing import TYPE_CHECKING

from visionloop.sched.view import ActiveJob, ClusterView, PendingJob

if TYPE_CHECKING:
    from visionloop.sched.sim.config import SimConfig
    from visionloop.sched.sim.engine import Simulation, _Job
    from visionloop.sched.sim.trace import TraceJob


def last_checkpoint(j: _Job, t: float, every_s: float) -> tuple[float, float | None]:
    """Progress of the job's last checkpoint at time t, and when it was taken."""
    ran = max(0.0, t - j.t0 - j.overhead)
    k = math.floor(ran / every_s) if every_s > 0 else 0
    if k == 0:
        return j.p0, None
    return j.p0 + k * every_s, j.t0 + j.overhead + k * every_s


def expected_end(j: _Job, t: float, cfg: SimConfig) -> float | None:
    """What the job's reported pace says of its end (see SimConfig), or None before its
    first report in this allocation."""
    ran = t - j.t0 - j.overhead
    if j.state != "running" or ran < cfg.pace_after_s:
        return None
    return t + max(0.0, j.spec.duration_s - j.p0 - ran) * j.pace


def time_limit(s: TraceJob, cfg: SimConfig) -> float | None:
    """The `max_runtime` its user gave: `time_limit` x its duration (users overestimate), for
    the share `time_limit_share` of jobs picked by a hash of their id (stable across runs)."""
    if cfg.time_limit is None or zlib.crc32(s.id.encode()) % 1000 >= 1000 * cfg.time_limit_share:
        return None
    return s.duration_s * cfg.time_limit


def history_key(s: TraceJob) -> tuple[str, int]:
    """What counts as the same work in a trace (SimConfig.history): the application the job
    id names ("cifar10-12": cifar10), on the same number of GPUs."""
    return s.id.rsplit("-", 1)[0], s.gpus


def expected_runtime(sim: Simulation, s: TraceJob) -> float | None:
    """The median run time of the finished jobs of the same work, or None (SimConfig.history)."""
    if not sim.cfg.history:
        return None
    runs = sim.history.get(history_key(s))
    return statistics.median(runs) if runs else None


def cluster_view(sim: Simulation, t: float) -> ClusterView:
    cfg = sim.cfg
    running, queued = [], []
    for j in sim.jobs.values():
        s = j.spec
        if j.state in ("running", "stopping"):
            _, ckpt_at = last_checkpoint(j, t, cfg.checkpoint_every_s)
            running.append(
                ActiveJob(
                    s.id,
                    s.team,
                    j.rank,
                    j.gpus,
                    j.t0,
                    s.spot,
                    last_checkpoint_at=ckpt_at,
                    attained_gpu_s=j.attained + len(j.gpus) * (t - j.t0),
                    preemptible=j.state == "running",
                    submitted_at=s.submit_time,
                    expected_end=expected_end(j, t, cfg),
                    max_runtime_s=time_limit(s, cfg),
                    expected_runtime_s=expected_runtime(sim, s),
                    checkpoints_at_stop=cfg.sigterm_checkpoint,
                    leaving_for=j.leaving_for if j.state == "stopping" else None,
                )
            )
        elif j.state == "queued":
            queued.append(
                PendingJob(
                    s.id,
                    s.team,
                    j.rank,
                    s.gpus,
                    s.submit_time,
                    s.spot,
                    attained_gpu_s=j.attained,
                    max_runtime_s=time_limit(s, cfg),
                    expected_runtime_s=expected_runtime(sim, s),
                    checkpoints_at_stop=cfg.sigterm_checkpoint,
                )
            )
    freed_for = {g: job for g, job in sim.freed_for.items() if g not in sim.holder}
    return ClusterView(t, sim._gpus(), sim.teams, running, queued, freed_for=freed_for)
