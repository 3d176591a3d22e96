"""How much of a policy comparison on the shared traces is luck: the same traces with every
submission time moved by up to ±`--jitter` seconds (seeded), several times over.

A scheduler is a chaotic system. One job starting a minute earlier changes which GPUs free
first, so every later decision can differ. On the 8 fixed traces a change to the policy that
leaves its average behaviour alone still moves single traces by several per cent, either way.
This script runs visionloop's policy (one or more configurations, in the same run) and the
baselines it is compared with on `--variants` versions of each trace (variant 0 is the trace
itself) and prints, per configuration:

- avg JCT over all jobs of all variants against each baseline's;
- per trace, the mean and the worst ratio to Tiresias over the variants (the issue's per-trace
  target, taken where it is not luck), and the ratio on the unjittered trace;
- the quota guarantee: stretches a team's fitting job waited longer than a cycle plus the
  grace period, all of them and those with the GPUs there to give; and job by job, each
  job's own such waits.

    python benchmarks/sched/jitter.py [--variants 8] [--jitter 60] [--sigterm-checkpoint] \\
        [--config '{}' --config '{"quota_under_head": false}']

Each `--config` is a JSON object of `PolicyConfig` fields (`same_node` is false, as in
`baselines.py`). Runs in parallel over `--workers` processes; results go to
`benchmarks/results/sched_jitter[_sigterm].json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from baselines import schedulers

from _common import write_result
from visionloop.sched.policy import PolicyConfig
from visionloop.sched.sim import SimConfig, default_cluster, default_spot_traces, load_trace, simulate
from visionloop.sched.sim.trace import TraceJob

REPO = Path(__file__).resolve().parents[2]
BASELINES = ("slurm", "slurm-2x", "kueue", "kueue-fair", "tiresias")


def jittered(trace: list[TraceJob], n: int, variant: int, jitter_s: float) -> list[TraceJob]:
    """Variant 0 is the trace; the others move each submission by U(-jitter, +jitter), seeded
    by trace and variant (never before 0)."""
    if variant == 0:
        return trace
    rng = random.Random(variant * 1000 + n)
    return [
        dataclasses.replace(j, submit_time=max(0.0, j.submit_time + rng.uniform(-jitter_s, jitter_s)))
        for j in trace
    ]


def run_one(args: tuple[Path, int, int, float, bool, list[dict[str, Any]]]) -> dict[str, Any]:
    """One variant of one trace: every baseline's and every configuration's average JCT, and
    the configurations' late quota stretches."""
    data, n, variant, jitter_s, sigterm, configs = args
    cluster = default_cluster(default_spot_traces(data))
    trace = jittered(load_trace(data / "sched" / "traces" / f"trace-{n}.csv"), n, variant, jitter_s)
    sim = SimConfig(grace_s=60.0, sigterm_checkpoint=sigterm)
    base = schedulers(trace, 60.0)
    out: dict[str, Any] = {"trace": n, "variant": variant, "jobs": len(trace), "baselines": {}, "configs": []}
    high = [j.id for j in trace if j.priority == "high"]
    out["high_jobs"] = len(high)
    for name in BASELINES:
        r = simulate(trace, cluster, base[name], sim)
        out["baselines"][name] = statistics.fmean(j.jct for j in r.jobs if j.jct is not None)
        if name == "slurm":  # the target: the high class waits no longer than under Slurm
            out["slurm_high_wait_s"] = sum(j.queued_s for j in r.jobs if j.priority == "high")
    for cfg in configs:
        policy = PolicyConfig(**{"same_node": False, **cfg})
        r = simulate(trace, cluster, schedulers(trace, 60.0, policy)["visionloop"], sim)
        out["configs"].append(
            {
                "avg_jct_s": statistics.fmean(j.jct for j in r.jobs if j.jct is not None),
                "high_wait_s": sum(j.queued_s for j in r.jobs if j.priority == "high"),
                "quota_wait_late": r.quota_wait_late,
                "quota_wait_late_reclaimable": r.quota_wait_late_reclaimable,
                "quota_wait_late_reclaimable_short": r.quota_wait_late_reclaimable_short,
                "quota_jobs_late": r.quota_jobs_late,
                "quota_jobs_late_short": r.quota_jobs_late_short,
                "quota_job_longest_s": r.quota_job_longest_s,
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", default="1,2,3,4,5,6,7,8", help="comma-separated trace numbers")
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    ap.add_argument("--variants", type=int, default=8, help="versions of each trace (the first unjittered)")
    ap.add_argument("--jitter", type=float, default=60.0, help="largest move of a submission time (s)")
    ap.add_argument("--sigterm-checkpoint", action="store_true", help="jobs checkpoint at SIGTERM")
    ap.add_argument(
        "--config",
        action="append",
        default=None,
        help="a JSON object of PolicyConfig fields; repeat to compare (default: one, the defaults)",
    )
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    if args.variants < 1 or args.jitter < 0:
        ap.error("--variants must be >= 1 and --jitter >= 0")
    try:
        configs = [json.loads(c) for c in (args.config or ["{}"])]
        for c in configs:
            PolicyConfig(**{"same_node": False, **c})  # refuse a bad one before hours of runs
    except (json.JSONDecodeError, TypeError) as e:
        ap.error(f"--config must be a JSON object of PolicyConfig fields: {e}")
    traces = [int(x) for x in args.traces.split(",")]
    work = [
        (args.data, n, v, args.jitter, args.sigterm_checkpoint, configs)
        for n in traces
        for v in range(args.variants)
    ]
    with ProcessPoolExecutor(args.workers) as pool:
        runs = list(pool.map(run_one, work))

    summary = []
    for i, cfg in enumerate(configs):
        jct = {
            n: [r["configs"][i]["avg_jct_s"] / r["baselines"]["tiresias"] for r in runs if r["trace"] == n]
            for n in traces
        }
        weights = [r["jobs"] for r in runs]
        total = sum(r["configs"][i]["avg_jct_s"] * w for r, w in zip(runs, weights, strict=True))
        overall = {
            b: total / sum(r["baselines"][b] * w for r, w in zip(runs, weights, strict=True))
            for b in BASELINES
        }
        high_jobs = sum(r["high_jobs"] for r in runs) or 1
        row = {
            "config": cfg,
            "avg_jct_ratio": overall,
            "high_wait_min": sum(r["configs"][i]["high_wait_s"] for r in runs) / high_jobs / 60,
            "slurm_high_wait_min": sum(r["slurm_high_wait_s"] for r in runs) / high_jobs / 60,
            "tiresias_per_trace_mean": {n: statistics.fmean(v) for n, v in jct.items()},
            "tiresias_per_trace_worst": {n: max(v) for n, v in jct.items()},
            "tiresias_per_trace_unjittered": {n: v[0] for n, v in jct.items()},
            "quota_wait_late": sum(r["configs"][i]["quota_wait_late"] for r in runs),
            "quota_wait_late_reclaimable": sum(r["configs"][i]["quota_wait_late_reclaimable"] for r in runs),
            "quota_wait_late_reclaimable_short": sum(
                r["configs"][i]["quota_wait_late_reclaimable_short"] for r in runs
            ),
            "quota_jobs_late": sum(r["configs"][i]["quota_jobs_late"] for r in runs),
            "quota_jobs_late_short": sum(r["configs"][i]["quota_jobs_late_short"] for r in runs),
            "quota_job_longest_min": max(r["configs"][i]["quota_job_longest_s"] for r in runs) / 60,
        }
        summary.append(row)
        print(
            f"config {json.dumps(cfg)}: {len(traces)} traces x {args.variants} variants, "
            f"jitter ±{args.jitter:.0f} s"
        )
        print("  avg JCT / baseline: " + ", ".join(f"{b} {r:.3f}" for b, r in overall.items()))
        print(f"  high class waits {row['high_wait_min']:.2f} min (Slurm {row['slurm_high_wait_min']:.2f})")
        print("  per trace / Tiresias  " + " ".join(f"{n:>6}" for n in traces))
        for label, key in (
            ("mean", "tiresias_per_trace_mean"),
            ("worst", "tiresias_per_trace_worst"),
            ("unjittered", "tiresias_per_trace_unjittered"),
        ):
            print(f"  {label:>20} " + " ".join(f"{row[key][n]:6.3f}" for n in traces))
        print(
            f"  quota guarantee: {row['quota_wait_late']} stretches longer than a cycle + the grace period, "
            f"{row['quota_wait_late_reclaimable']} with the GPUs there "
            f"({row['quota_wait_late_reclaimable_short']} of them begun short of GPUs: a spot node down)"
        )
        print(
            f"  job by job: {row['quota_jobs_late']} waits of a job in its team's unused quota, the GPUs "
            f"there, longer than the guarantee ({row['quota_jobs_late_short']} begun short of GPUs); "
            f"the longest {row['quota_job_longest_min']:.1f} min"
        )
    name = "sched_jitter" + ("_sigterm" if args.sigterm_checkpoint else "")
    path = write_result(
        name,
        {
            "traces": traces,
            "variants": args.variants,
            "jitter_s": args.jitter,
            "sigterm_checkpoint": args.sigterm_checkpoint,
            "summary": summary,
            "runs": runs,
        },
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
