"""visionloop's queue policy against the schedulers a team would otherwise run, in the same
simulation: the same traces, cluster, spot interruptions and job behaviour at eviction.

Schedulers (every one in `visionloop.sched.sim`; the baselines keep their own state, so each
trace gets fresh instances):
  - fifo: strict first-come-first-served (`visionloop.sched.policy.fifo`);
  - visionloop: `visionloop.sched.policy.schedule` with the defaults, jobs spanning nodes;
  - slurm: multifactor priority (QOS, fair share 2^(-U/S) with a 7-day half-life, age over
    7 days, size), EASY backfill, preempt/qos REQUEUE, time limits = the true durations
    (`visionloop.sched.sim.slurm`);
  - slurm-2x: the same with time limits twice the true durations (users ask for more);
  - kueue: a ClusterQueue per team in one cohort (nominal quota, borrowing limit),
    BestEffortFIFO, preemption withinClusterQueue LowerPriority and reclaimWithinCohort Any
    (`visionloop.sched.sim.kueue`); kueue-fair: the same with fair sharing (DRS);
  - tiresias: discretized 2D-LAS, two queues split at 3,250 GPU-seconds
    (`visionloop.sched.sim.tiresias`).

Printed: avg and p95 JCT per trace and over all jobs, visionloop's ratio to each baseline
(target <= 0.95 over all traces, no trace above 1.05), waits per priority class, makespan,
preemptions, GPU-hours lost, the waits of jobs larger than their team's nominal quota, and
the hours a team had a waiting job that fit in its unused nominal quota.

    python benchmarks/sched/baselines.py [--traces 1,2] [--data ../shared/data] [--sigterm-checkpoint]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from simulate import hours as h
from simulate import mean, table

from _common import write_result
from visionloop.sched.policy import PolicyConfig, fifo, schedule
from visionloop.sched.prices import load_catalog
from visionloop.sched.sim import (
    JobRecord,
    SimConfig,
    default_cluster,
    default_spot_traces,
    load_trace,
    simulate,
    summarize,
)
from visionloop.sched.sim.cluster import ClusterSpec
from visionloop.sched.sim.config import Scheduler
from visionloop.sched.sim.kueue import Kueue, KueueConfig
from visionloop.sched.sim.slurm import Slurm, SlurmConfig
from visionloop.sched.sim.tiresias import Tiresias, TiresiasConfig
from visionloop.sched.sim.trace import TraceJob
from visionloop.sched.view import Team

REPO = Path(__file__).resolve().parents[2]
CLASSES = ("low", "normal", "high")
ONE_TEAM = "all"
BASELINES = ("fifo", "slurm", "slurm-2x", "kueue", "kueue-fair", "tiresias")


def schedulers(
    trace: list[TraceJob],
    grace_s: float,
    policy: PolicyConfig | None = None,
    tiresias: TiresiasConfig | None = None,
    slurm_backfill_preemption: bool = False,
) -> dict[str, Scheduler]:
    exact = {j.id: j.duration_s for j in trace}
    twice = {j.id: 2 * j.duration_s for j in trace}
    slurm = SlurmConfig(grace_s=grace_s, backfill_preemption=slurm_backfill_preemption)
    return {
        "visionloop": partial(schedule, config=policy or PolicyConfig(same_node=False)),
        "fifo": partial(fifo, same_node=False),
        "slurm": Slurm(exact, slurm),
        "slurm-2x": Slurm(twice, slurm),
        "kueue": Kueue(),
        "kueue-fair": Kueue(KueueConfig(fair_sharing=True)),
        "tiresias": Tiresias(tiresias),
    }


def flatten(trace: list[TraceJob], one_team: bool, one_class: bool) -> list[TraceJob]:
    """The trace with every job in one team (`ONE_TEAM`) and/or the normal class: the same jobs
    with the constraints that Tiresias ignores taken away, for every scheduler alike."""
    return [
        replace(
            j,
            team=ONE_TEAM if one_team else j.team,
            priority="normal" if one_class else j.priority,
        )
        for j in trace
    ]


def p95(xs: list[float]) -> float | None:
    s = sorted(xs)
    return s[int(0.95 * (len(s) - 1))] if s else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default="1,2,3,4,5,6,7,8", help="comma-separated trace numbers")
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data", help="shared data folder")
    ap.add_argument("--grace", type=float, default=60.0, help="grace period of a preempted job (s)")
    ap.add_argument(
        "--sigterm-checkpoint",
        action="store_true",
        help="a preempted job keeps its progress up to the eviction (it checkpoints at SIGTERM, as "
        "visionloop's trainer does), under every scheduler; default: its last periodic checkpoint",
    )
    ap.add_argument("--name", default="sched_baselines", help="results file name")
    ap.add_argument("--time-limit-share", type=float, default=1.0, help="the share of jobs that give one")
    ap.add_argument(
        "--victims",
        choices=("least_lost", "smallest"),
        default="least_lost",
        help="visionloop's victim order",
    )
    ap.add_argument(
        "--easy-backfill", action="store_true", help="visionloop's reservations hold GPUs (EASY backfill)"
    )
    ap.add_argument(
        "--tenants", action="store_true", help="with --easy-backfill: preemptible tenants on reserved GPUs"
    )
    ap.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="jobs give visionloop a max_runtime of this multiple of their true duration (default: none)",
    )
    ap.add_argument(
        "--history",
        action="store_true",
        help="visionloop plans a job without a time limit with the median run time of the finished "
        "jobs of the same application and GPU count (the control plane's runtime history)",
    )
    ap.add_argument(
        "--min-runtime",
        type=float,
        default=600.0,
        help="visionloop's min_runtime_s: younger jobs are no victims (but for the top class)",
    )
    ap.add_argument("--order", choices=("las", "fifo", "srpt"), default="las", help="within a team and class")
    ap.add_argument(
        "--srpt-preemption", action="store_true", help="with --order srpt: preempt within a class"
    )
    ap.add_argument(
        "--las-preemption",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a job below the threshold of attained GPU-service preempts one of its team and class above "
        "it (the default; --no-las-preemption: the policy before it)",
    )
    ap.add_argument(
        "--las-threshold", type=float, default=3250.0, help="that threshold, GPU-seconds (Tiresias': 3,250)"
    )
    ap.add_argument(
        "--one-team",
        action="store_true",
        help="every job in one team owning the whole cluster, under every scheduler: no quotas (to "
        "measure what the teams' quotas cost; Tiresias knows none)",
    )
    ap.add_argument(
        "--one-class",
        action="store_true",
        help="every job in the normal class, under every scheduler (what the priority classes cost)",
    )
    ap.add_argument(
        "--reclaim-young",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="visionloop's reclaim_preempts_young (on by default): a team takes back borrowed GPUs "
        "from jobs however young (but the top class) that checkpoint at SIGTERM",
    )
    ap.add_argument(
        "--quota-under-head",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="visionloop's quota_under_head (on by default, but with --easy-backfill): a team's "
        "lower-class job reclaims the team's unused quota while its higher-class head must "
        "borrow, as the head's tenant",
    )
    ap.add_argument(
        "--holds-yield",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="visionloop's holds_yield_to_quota (on by default): with quota_under_head, such a "
        "lower-class job may take free GPUs held idle for its own head or another team's borrower",
    )
    ap.add_argument(
        "--hold-freed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="visionloop's hold_freed_for_job (on by default): the GPUs a victim that checkpointed "
        "at SIGTERM frees stay the job's it stepped aside for, while that job fits in its team's quota",
    )
    ap.add_argument(
        "--quota-keeps-lower-classes",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="visionloop's quota_keeps_lower_classes (on by default): a job within its team's "
        "nominal quota that checkpoints at SIGTERM keeps its GPUs against other teams' higher "
        "classes, but the top class",
    )
    ap.add_argument(
        "--slurm-backfill-preemption",
        action="store_true",
        help="Slurm's backfill also requeues lower-QOS jobs for a job that ends before the "
        "blocked job's reservation, as real Slurm's does (slurm_crosscheck.py)",
    )
    ap.add_argument(
        "--tiresias-every-cycle",
        action="store_true",
        help="Tiresias decides every cycle and demotes at the threshold, as the paper describes; "
        "default: when its authors' simulator does, which it reproduces job for job "
        "(tiresias_crosscheck.py)",
    )
    args = ap.parse_args()
    tiresias = TiresiasConfig(reference_rounds=not args.tiresias_every_cycle)
    policy = PolicyConfig(
        order=args.order,
        srpt_preemption=args.srpt_preemption,
        las_preemption=args.las_preemption,
        las_threshold_gpu_s=args.las_threshold,
        same_node=False,
        easy_backfill=args.easy_backfill,
        reservation_tenants=args.tenants,
        victim_order=args.victims,
        min_runtime_s=args.min_runtime,
        reclaim_preempts_young=args.reclaim_young,
        quota_under_head=args.quota_under_head,
        holds_yield_to_quota=args.holds_yield,
        hold_freed_for_job=args.hold_freed,
        quota_keeps_lower_classes=args.quota_keeps_lower_classes,
    )
    traces = [int(x) for x in args.traces.split(",")]
    sim_cfg = SimConfig(
        grace_s=args.grace,
        sigterm_checkpoint=args.sigterm_checkpoint,
        time_limit=args.time_limit,
        time_limit_share=args.time_limit_share,
        history=args.history,
    )
    cluster = default_cluster(default_spot_traces(args.data))
    if args.one_team:
        cluster = ClusterSpec(cluster.nodes, (Team(ONE_TEAM, cluster.total_gpus, 0),))
    catalog = load_catalog(None)
    names = ["visionloop", *BASELINES]
    per: dict[int, dict[str, dict[str, Any]]] = {}
    jobs: dict[str, list[JobRecord]] = {n: [] for n in names}
    wall = dict.fromkeys(names, 0.0)
    for n in traces:
        trace = flatten(
            load_trace(args.data / "sched" / "traces" / f"trace-{n}.csv"), args.one_team, args.one_class
        )
        per[n] = {}
        for name, fn in schedulers(
            trace, args.grace, policy, tiresias, args.slurm_backfill_preemption
        ).items():
            t0 = time.perf_counter()
            result = simulate(trace, cluster, fn, sim_cfg)
            wall[name] += time.perf_counter() - t0
            per[n][name] = summarize(result, cluster, catalog)
            jobs[name] += [j for j in result.jobs if j.finish is not None]
            if result.unfinished:
                print(f"trace {n}, {name}: {len(result.unfinished)} jobs unfinished", file=sys.stderr)
        print(f"trace {n}: " + ", ".join(f"{k} {h(per[n][k]['avg_jct_s'])} h" for k in names), flush=True)

    jct: Callable[[str], list[float]] = lambda k: [j.jct for j in jobs[k] if j.jct is not None]  # noqa: E731
    ratio = {b: per_ratio(per, traces, b) for b in BASELINES}
    overall = {b: statistics.fmean(jct("visionloop")) / statistics.fmean(jct(b)) for b in BASELINES}
    table(
        "average JCT (h) per trace, and visionloop / baseline",
        ["trace", *names, *(f"vl/{b}" for b in BASELINES)],
        [
            [str(n), *(h(per[n][k]["avg_jct_s"]) for k in names), *(f"{ratio[b][n]:.3f}" for b in BASELINES)]
            for n in traces
        ],
    )
    table(
        "over all traces",
        ["scheduler", "avg JCT h", "p95 JCT h", "vl / it", "traces vl worse", "worst trace", "> 1.05"],
        [
            [
                k,
                h(mean(jct(k))),
                h(p95(jct(k))),
                "-" if k == "visionloop" else f"{overall[k]:.3f}",
                "-" if k == "visionloop" else f"{sum(r > 1.0 for r in ratio[k].values())} of {len(traces)}",
                "-" if k == "visionloop" else worst(ratio[k]),
                "-" if k == "visionloop" else str(sum(r > 1.05 for r in ratio[k].values())),
            ]
            for k in names
        ],
    )
    table(
        "mean wait in the queue by priority class, all traces (h)",
        ["class", "jobs", *names],
        [
            [c, str(sum(j.priority == c for j in jobs["fifo"]))]
            + [h(mean([j.queued_s for j in jobs[k] if j.priority == c])) for k in names]
            for c in CLASSES
        ],
    )
    over = {k: [j for j in jobs[k] if j.gpus > cluster.nominal_gpus(j.team)] for k in names}
    table(
        "per scheduler, all traces: makespan (mean h), preemptions, of them wasted (the job they were "
        "for did not start within the grace + 5 min; '-': its evictions name no job), GPU-h lost to "
        "preemption / spot, jobs over their team's quota: mean and max wait (h), team-hours a fitting "
        "job waited in unused quota, and of those stretches how many lasted longer than a cycle plus "
        "the grace period (the guarantee; in brackets: begun with fewer GPUs up than the quotas add "
        "up to) and the longest (min); then the same counting only while the GPUs existed, free or "
        "lent beyond a nominal quota, of a kind the job accepts (what a policy could have given; in "
        "brackets again those begun short of GPUs, when giving it to one team may take it from another); "
        "and the same job by job: waits of one job in its team's unused quota, GPUs there, longer than "
        "the guarantee (a team's stretch may span several jobs, each served in time)",
        [
            "scheduler",
            "makespan",
            "preemptions",
            "wasted",
            "lost GPU-h",
            "over-quota jobs",
            "wait",
            "max",
            "quota h",
            "late",
            "longest",
            "late, GPUs there",
            "longest",
            "jobs late",
            "longest",
        ],
        [
            [
                k,
                f"{statistics.fmean(per[n][k]['makespan_s'] for n in traces) / 3600:.1f}",
                str(sum(per[n][k]["preemptions"] for n in traces)),
                str(sum(per[n][k]["wasted_evictions"] for n in traces))
                if any(per[n][k]["named_evictions"] for n in traces)
                else "-",
                f"{sum(per[n][k]['lost_gpu_h']['preempted'] for n in traces):.0f} / "
                f"{sum(per[n][k]['lost_gpu_h']['interrupted'] for n in traces):.0f}",
                str(len(over[k])),
                h(mean([j.queued_s for j in over[k]])),
                h(max((j.queued_s for j in over[k]), default=None)),
                f"{sum(sum(per[n][k]['quota_wait_h'].values()) for n in traces):.1f}",
                f"{sum(per[n][k]['quota_wait_late'] for n in traces)} "
                f"({sum(per[n][k]['quota_wait_late_short'] for n in traces)})",
                f"{max(longest(per[n][k]) for n in traces) / 60:.0f}",
                f"{sum(per[n][k]['quota_wait_late_reclaimable'] for n in traces)} "
                f"({sum(per[n][k]['quota_wait_late_reclaimable_short'] for n in traces)})",
                f"{max(longest(per[n][k], 'quota_wait_longest_reclaimable_s') for n in traces) / 60:.0f}",
                f"{sum(per[n][k]['quota_jobs_late'] for n in traces)} "
                f"({sum(per[n][k]['quota_jobs_late_short'] for n in traces)})",
                f"{max(per[n][k]['quota_job_longest_s'] for n in traces) / 60:.0f}",
            ]
            for k in names
        ],
    )
    high = {k: mean([j.queued_s for j in jobs[k] if j.priority == "high"]) or 0.0 for k in names}
    worse_than_fifo = [
        c
        for c in CLASSES
        if (mean([j.jct for j in jobs["visionloop"] if j.priority == c and j.jct is not None]) or 0.0)
        > (mean([j.jct for j in jobs["fifo"] if j.priority == c and j.jct is not None]) or 0.0)
    ]
    print("\ntargets:")
    for b in BASELINES:
        met = overall[b] <= 0.95 and max(ratio[b].values()) <= 1.05
        print(
            f"  vs {b}: avg JCT {overall[b]:.3f} (<= 0.95), worst trace {worst(ratio[b])} (<= 1.05): "
            f"{'met' if met else 'NOT met'}"
        )
    print(
        f"  high class waits {high['visionloop'] / 60:.1f} min against Slurm's {high['slurm'] / 60:.1f} min: "
        f"{'met' if high['visionloop'] <= high['slurm'] else 'NOT met'}"
    )
    print(f"  classes worse off than under FIFO: {worse_than_fifo or 'none'}")
    print("simulation wall time (s): " + ", ".join(f"{k} {v:.1f}" for k, v in wall.items()))
    path = write_result(
        args.name,
        {
            "config": {
                "traces": traces,
                "one_team": args.one_team,
                "one_class": args.one_class,
                "tiresias_reference_rounds": tiresias.reference_rounds,
                "visionloop": {
                    k: getattr(policy, k)
                    for k in (
                        "order",
                        "easy_backfill",
                        "reservation_tenants",
                        "victim_order",
                        "reclaim_preempts_young",
                        "quota_under_head",
                        "holds_yield_to_quota",
                        "hold_freed_for_job",
                        "quota_keeps_lower_classes",
                    )
                },
                "sim": {k: v for k, v in vars(sim_cfg).items() if k != "priorities"},
                "slurm": {
                    k: v
                    for k, v in vars(
                        SlurmConfig(grace_s=args.grace, backfill_preemption=args.slurm_backfill_preemption)
                    ).items()
                    if k != "priorities"
                },
            },
            "jct_ratio_all_jobs": overall,
            "jct_ratio_per_trace": {b: {str(n): r for n, r in ratio[b].items()} for b in BASELINES},
            "high_class_wait_s": high,
            "classes_worse_than_fifo": worse_than_fifo,
            "traces": {str(n): per[n] for n in traces},
            "wall_s": wall,
        },
    )
    print(f"results: {path}")


def longest(summary: dict[str, Any], key: str = "quota_wait_longest_s") -> float:
    """The longest stretch a team's fitting job waited in unused quota in one run (s)."""
    return max(summary[key].values(), default=0.0)


def per_ratio(per: dict[int, dict[str, dict[str, Any]]], traces: list[int], b: str) -> dict[int, float]:
    return {n: per[n]["visionloop"]["avg_jct_s"] / per[n][b]["avg_jct_s"] for n in traces}


def worst(r: dict[int, float]) -> str:
    n = max(r, key=lambda k: r[k])
    return f"{r[n]:.3f} (trace {n})"


if __name__ == "__main__":
    main()
