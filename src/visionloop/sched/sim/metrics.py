"""What a simulation run says about a policy: completion times, waiting by job size and
priority class, utilisation, each team's share against its entitlement, GPU-time lost to
preemptions and spot interruptions, and what the run cost (priced by the catalog).

All figures are plain floats in a JSON-ready dict, so benchmarks and tests read the same
numbers."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

from visionloop.sched.prices import PriceCatalog
from visionloop.sched.sim.cluster import ClusterSpec
from visionloop.sched.sim.result import JobRecord, SimResult

SIZE_BUCKETS: tuple[tuple[str, int, int], ...] = (
    ("1", 1, 1),
    ("2-4", 2, 4),
    ("5-8", 5, 8),
    (">8", 9, 1 << 30),
)


def size_bucket(gpus: int) -> str:
    return next(name for name, lo, hi in SIZE_BUCKETS if lo <= gpus <= hi)


def _mean(xs: Iterable[float]) -> float | None:
    xs = list(xs)
    return statistics.fmean(xs) if xs else None


def _group(jobs: list[JobRecord]) -> dict[str, Any]:
    done = [j for j in jobs if j.jct is not None]
    waits = [j.queued_s for j in jobs]
    return {
        "jobs": len(jobs),
        "avg_jct_s": _mean(j.jct for j in done if j.jct is not None),
        "avg_queue_s": _mean(waits),
        "max_queue_s": max(waits, default=None),
    }


def summarize(result: SimResult, cluster: ClusterSpec, catalog: PriceCatalog) -> dict[str, Any]:
    jobs = result.jobs
    jcts = sorted(j.jct for j in jobs if j.jct is not None)
    busy = sum(result.busy_gpu_s.values())
    up = sum(result.up_gpu_s.values())
    total_busy_team = sum(result.team_gpu_s.values()) or 1.0
    total_gpus = cluster.total_gpus or 1
    contended = sum(result.contended_team_gpu_s.values())
    teams: dict[str, dict[str, float | None]] = {}
    for name in [t.name for t in cluster.teams] + sorted(
        set(result.team_gpu_s) - {t.name for t in cluster.teams}
    ):
        nominal = cluster.nominal_gpus(name)
        teams[name] = {
            "gpu_h": result.team_gpu_s.get(name, 0.0) / 3600,
            "share": result.team_gpu_s.get(name, 0.0) / total_busy_team,
            "share_contended": result.contended_team_gpu_s.get(name, 0.0) / contended if contended else None,
            "entitlement": nominal / total_gpus,
        }

    cost_by_class: dict[str, float] = {}
    spot_savings = 0.0
    for (gpu_type, cls), gpu_s in result.busy_gpu_s.items():
        price = catalog.per_gpu_hour(gpu_type, cls)
        cost_by_class[cls] = cost_by_class.get(cls, 0.0) + gpu_s / 3600 * price
        if cls == "spot":
            spot_savings += gpu_s / 3600 * (catalog.per_gpu_hour(gpu_type, "on_demand") - price)
    fleet_cost = sum(
        gpu_s / 3600 * catalog.per_gpu_hour(gpu_type, cls)
        for (gpu_type, cls), gpu_s in result.up_gpu_s.items()
    )
    return {
        "jobs": len(jobs),
        "finished": len(jcts),
        "unfinished": result.unfinished,
        "avg_jct_s": _mean(jcts),
        "median_jct_s": statistics.median(jcts) if jcts else None,
        "p95_jct_s": jcts[int(0.95 * (len(jcts) - 1))] if jcts else None,
        "makespan_s": result.end - result.start,
        "utilisation": busy / up if up else 0.0,
        "useful_utilisation": result.useful_gpu_s / up if up else 0.0,
        "by_size": {
            name: _group([j for j in jobs if size_bucket(j.gpus) == name]) for name, _, _ in SIZE_BUCKETS
        },
        "by_priority": {
            p: _group([j for j in jobs if j.priority == p]) for p in sorted({j.priority for j in jobs})
        },
        "teams": teams,
        "contended_h": result.contended_s / 3600,  # hours in which every team had jobs waiting
        # Hours a team had a waiting job that fit in its unused nominal quota (the guarantee).
        "quota_wait_h": {t: s / 3600 for t, s in sorted(result.quota_wait_s.items())},
        "quota_wait_longest_s": dict(sorted(result.quota_wait_longest_s.items())),
        "quota_wait_late": result.quota_wait_late,
        "quota_wait_late_short": result.quota_wait_late_short,
        "quota_wait_late_reclaimable": result.quota_wait_late_reclaimable,
        "quota_wait_late_reclaimable_short": result.quota_wait_late_reclaimable_short,
        "quota_wait_longest_reclaimable_s": dict(sorted(result.quota_wait_longest_reclaimable_s.items())),
        # The same job by job (`SimResult.quota_jobs_late`).
        "quota_jobs_late": result.quota_jobs_late,
        "quota_jobs_late_short": result.quota_jobs_late_short,
        "quota_job_longest_s": result.quota_job_longest_s,
        # Jobs larger than their team's nominal quota: how long they waited.
        "over_quota": _group([j for j in jobs if j.gpus > cluster.nominal_gpus(j.team)]),
        "preemptions": sum(j.preemptions for j in jobs),
        # Evictions naming the job they were for, and those after which it did not start
        # within the grace period plus result.WASTED_AFTER_S.
        "named_evictions": result.named_evictions,
        "wasted_evictions": result.wasted_evictions,
        "interruptions": sum(j.interruptions for j in jobs),
        "lost_gpu_h": {cause: gpu_s / 3600 for cause, gpu_s in result.lost_gpu_s.items()},
        "cost_usd": sum(cost_by_class.values()),
        "cost_by_class_usd": cost_by_class,
        "spot_gpu_h": sum(s for (_, c), s in result.busy_gpu_s.items() if c == "spot") / 3600,
        "spot_savings_usd": spot_savings,
        "fleet_cost_usd": fleet_cost,
        "cycles": result.cycles,
    }
