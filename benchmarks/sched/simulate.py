"""Scheduler simulation: visionloop's queue policy against strict FIFO on the same traces,
cluster and spot interruptions, in simulated time.

Workload: `sched/traces/trace-N.csv` under --data (Pollux/Philly arrivals and GPU counts,
Philly GPU-time quantiles, 160 jobs over 8 hours each; see the data folder's README).
Cluster: 64 A100-80GB GPUs in 8 nodes of 8 (32 owned, 16 on-demand, 16 spot); the two spot
nodes follow real AWS spot traces (`visionloop.sched.sim.cluster.DEFAULT_SPOT_TRACES`).
Teams: detection/segmentation/research with nominal quotas 32/19/13 GPUs (50/30/20%),
weights 0.5/0.3/0.2, each may borrow the rest of the cluster while it is idle. Multi-GPU
jobs may span nodes (fewest nodes first) under both policies.

The headline is avg JCT(visionloop) / avg JCT(FIFO) per trace and over all jobs (target
<= 0.6), with no priority class worse off than under FIFO. Also printed per trace: the
"zero-wait bound", avg duration / avg JCT(FIFO): the ratio of a scheduler under which no
job ever waits, which no policy can beat.

    python benchmarks/sched/simulate.py [--traces 1,2] [--data ../shared/data]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import write_result
from visionloop.sched.policy import PolicyConfig, fifo, schedule
from visionloop.sched.prices import load_catalog
from visionloop.sched.sim import (
    DEFAULT_SPOT_TRACES,
    SIZE_BUCKETS,
    JobRecord,
    SimConfig,
    default_cluster,
    default_spot_traces,
    load_trace,
    simulate,
    size_bucket,
    summarize,
)

REPO = Path(__file__).resolve().parents[2]
CLASSES = ("low", "normal", "high")


def hours(x: float | None) -> str:
    return "-" if x is None else f"{x / 3600:.2f}"


def mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


def pooled(jobs: list[JobRecord], key: str, group: str) -> float | None:
    sel = [j for j in jobs if (size_bucket(j.gpus) if key == "size" else j.priority) == group]
    return mean([j.queued_s for j in sel])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default="1,2,3,4,5,6,7,8", help="comma-separated trace numbers")
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data", help="shared data folder")
    ap.add_argument(
        "--tick", type=float, default=60.0, help="seconds between scheduling cycles while jobs wait"
    )
    ap.add_argument("--checkpoint-every", type=float, default=600.0, help="simulated checkpoint interval (s)")
    ap.add_argument("--grace", type=float, default=60.0, help="grace period of a preempted job (s)")
    ap.add_argument("--restart", type=float, default=60.0, help="restart overhead (s)")
    ap.add_argument(
        "--sigterm-checkpoint",
        action="store_true",
        help="a preempted job keeps its progress up to the eviction (it checkpoints at SIGTERM, as "
        "visionloop's trainer does); default: only its last periodic checkpoint",
    )
    ap.add_argument("--name", default="sched_sim", help="results file name (default sched_sim)")
    ap.add_argument("--easy-backfill", action="store_true", help="reservations hold GPUs (EASY backfill)")
    ap.add_argument("--tenants", action="store_true", help="with --easy-backfill: preemptible tenants")
    ap.add_argument(
        "--time-limit", type=float, default=None, help="jobs give a max_runtime of this x their duration"
    )
    ap.add_argument("--time-limit-share", type=float, default=1.0, help="the share of jobs that give one")
    args = ap.parse_args()
    traces = [int(x) for x in args.traces.split(",")]
    sim_cfg = SimConfig(
        checkpoint_every_s=args.checkpoint_every,
        grace_s=args.grace,
        restart_overhead_s=args.restart,
        tick_s=args.tick,
        sigterm_checkpoint=args.sigterm_checkpoint,
        time_limit=args.time_limit,
        time_limit_share=args.time_limit_share,
    )
    # The defaults, with jobs spanning nodes.
    policy = PolicyConfig(same_node=False, easy_backfill=args.easy_backfill, reservation_tenants=args.tenants)
    cluster = default_cluster(default_spot_traces(args.data))
    catalog = load_catalog(None)
    policies = {"fifo": partial(fifo, same_node=False), "visionloop": partial(schedule, config=policy)}

    per_trace: dict[int, dict[str, Any]] = {}
    all_jobs: dict[str, list[JobRecord]] = {name: [] for name in policies}
    wall: dict[str, float] = dict.fromkeys(policies, 0.0)
    for n in traces:
        trace = load_trace(args.data / "sched" / "traces" / f"trace-{n}.csv")
        per_trace[n] = {"jobs": len(trace), "avg_duration_s": statistics.fmean(j.duration_s for j in trace)}
        for name, fn in policies.items():
            t0 = time.perf_counter()
            result = simulate(trace, cluster, fn, sim_cfg)
            wall[name] += time.perf_counter() - t0
            per_trace[n][name] = summarize(result, cluster, catalog)
            all_jobs[name] += [j for j in result.jobs if j.finish is not None]
        f, v = per_trace[n]["fifo"], per_trace[n]["visionloop"]
        per_trace[n]["jct_ratio"] = v["avg_jct_s"] / f["avg_jct_s"]
        per_trace[n]["zero_wait_bound"] = per_trace[n]["avg_duration_s"] / f["avg_jct_s"]
        per_trace[n]["class_jct_ratio"] = {
            c: v["by_priority"][c]["avg_jct_s"] / f["by_priority"][c]["avg_jct_s"]
            for c in CLASSES
            if c in v["by_priority"] and c in f["by_priority"]
        }
        per_trace[n]["starved"] = sorted(
            [c for c, x in per_trace[n]["class_jct_ratio"].items() if x > 1.0]
            + (["unfinished"] if v["unfinished"] else [])
        )

    def row(n: int, key: str, fmt: Any) -> list[str]:
        return [str(n), fmt(per_trace[n]["fifo"][key]), fmt(per_trace[n]["visionloop"][key])]

    table(
        "average job completion time (h)",
        ["trace", "FIFO", "visionloop", "ratio", "zero-wait bound", "classes worse than FIFO"],
        [
            [
                *row(n, "avg_jct_s", hours),
                f"{per_trace[n]['jct_ratio']:.2f}",
                f"{per_trace[n]['zero_wait_bound']:.2f}",
                ",".join(per_trace[n]["starved"]) or "none",
            ]
            for n in traces
        ],
    )
    table("makespan (h)", ["trace", "FIFO", "visionloop"], [row(n, "makespan_s", hours) for n in traces])
    pct = lambda x: f"{100 * x:.0f}%"  # noqa: E731
    table(
        "GPU utilisation: allocated (useful) / available GPU-time",
        ["trace", "FIFO", "visionloop"],
        [
            [
                str(n),
                *(
                    f"{pct(per_trace[n][p]['utilisation'])} ({pct(per_trace[n][p]['useful_utilisation'])})"
                    for p in policies
                ),
            ]
            for n in traces
        ],
    )
    table(
        "queueing delay by job size, all traces (h, mean over jobs)",
        ["GPUs", "jobs", "FIFO", "visionloop"],
        [
            [b, str(sum(size_bucket(j.gpus) == b for j in all_jobs["fifo"]))]
            + [hours(pooled(all_jobs[p], "size", b)) for p in policies]
            for b, _, _ in SIZE_BUCKETS
        ],
    )
    table(
        "by priority class, all traces (h, mean over jobs)",
        ["class", "jobs", "queue FIFO", "queue visionloop", "JCT FIFO", "JCT visionloop"],
        [
            [c, str(sum(j.priority == c for j in all_jobs["fifo"]))]
            + [hours(pooled(all_jobs[p], "class", c)) for p in policies]
            + [
                hours(mean([j.jct for j in all_jobs[p] if j.priority == c and j.jct is not None]))
                for p in policies
            ]
            for c in CLASSES
        ],
    )
    team_rows = []
    for team in cluster.teams:
        shares = {
            p: [per_trace[n][p]["teams"][team.name]["share_contended"] or 0.0 for n in traces]
            for p in policies
        }
        team_rows.append(
            [team.name, pct(team.nominal_gpus / cluster.total_gpus)]
            + [
                f"{pct(statistics.fmean(shares[p]))} ({pct(min(shares[p]))}-{pct(max(shares[p]))})"
                for p in policies
            ]
        )
    contended = {p: statistics.fmean(per_trace[n][p]["contended_h"] for n in traces) for p in policies}
    table(
        "share of GPU-time per team while all three teams had jobs waiting: mean (range) over traces; "
        f"that was {contended['fifo']:.1f} h per trace under FIFO, "
        f"{contended['visionloop']:.1f} h under visionloop",
        ["team", "entitlement", "FIFO", "visionloop"],
        team_rows,
    )
    table(
        "GPU-hours lost (preempted / spot-interrupted), preemptions, interruptions",
        ["trace", "FIFO", "visionloop"],
        [
            [str(n)]
            + [
                f"{per_trace[n][p]['lost_gpu_h']['preempted']:.0f} / "
                f"{per_trace[n][p]['lost_gpu_h']['interrupted']:.0f} "
                f"({per_trace[n][p]['preemptions']}, {per_trace[n][p]['interruptions']})"
                for p in policies
            ]
            for n in traces
        ],
    )
    table(
        "cost, USD: GPU-time used by jobs / whole fleet over the makespan; spot savings",
        ["trace", "FIFO", "visionloop"],
        [
            [str(n)]
            + [
                f"{per_trace[n][p]['cost_usd']:,.0f} / {per_trace[n][p]['fleet_cost_usd']:,.0f}; "
                f"{per_trace[n][p]['spot_savings_usd']:,.0f}"
                for p in policies
            ]
            for n in traces
        ],
    )
    fifo_all = statistics.fmean(j.jct for j in all_jobs["fifo"] if j.jct is not None)
    vl_all = statistics.fmean(j.jct for j in all_jobs["visionloop"] if j.jct is not None)
    ratios = [per_trace[n]["jct_ratio"] for n in traces]
    geo = math.exp(statistics.fmean(math.log(x) for x in ratios))
    starved = {n: per_trace[n]["starved"] for n in traces if per_trace[n]["starved"]}
    print(
        f"\navg JCT visionloop/FIFO over all {len(all_jobs['fifo'])} jobs: {vl_all / fifo_all:.3f} "
        f"(target <= 0.6); per trace: {', '.join(f'{x:.2f}' for x in ratios)}; geometric mean {geo:.3f}"
    )
    print(f"priority classes worse off than under FIFO: {starved or 'none'}")
    print(f"simulation wall time: FIFO {wall['fifo']:.1f} s, visionloop {wall['visionloop']:.1f} s")
    path = write_result(
        args.name,
        {
            "config": {
                "traces": traces,
                "data": str(args.data),
                "sim": {k: v for k, v in vars(sim_cfg).items() if k != "priorities"},
                "policy": repr(policy),
                "cluster": [
                    {"node": nd.name, "gpus": nd.gpus, "type": nd.gpu_type, "class": nd.price_class}
                    for nd in cluster.nodes
                ],
                "spot_traces": [{"file": f, "offset_s": o} for f, o in DEFAULT_SPOT_TRACES],
                "teams": [dataclasses.asdict(t) for t in cluster.teams],
            },
            "jct_ratio_all_jobs": vl_all / fifo_all,
            "jct_ratio_per_trace": {str(n): per_trace[n]["jct_ratio"] for n in traces},
            "jct_ratio_geometric_mean": geo,
            "target": 0.6,
            "starved": {str(k): v for k, v in starved.items()},
            "traces": {str(n): per_trace[n] for n in traces},
            "wall_s": wall,
        },
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
