"""Where one trace's gap to a baseline comes from: visionloop's JCT less the baseline's, job by
job, summed over groups of jobs (size and length, class, team), over jittered versions of the
trace (`jitter.py`'s), on the same cluster and spot interruptions.

A per-trace ratio says that visionloop is behind; this says which jobs it is behind on. The
groups' sums add up to the whole difference, so a group whose sum is larger than the whole
is where all of it comes from (and the others gain back the rest).

    python benchmarks/sched/gap_by_job.py [--trace 5] [--variants 16] [--baseline tiresias] \\
        [--sigterm-checkpoint] [--one-team] [--one-class]

`--one-team` / `--one-class` take the teams' quotas / the classes away from every scheduler
alike (as in `baselines.py`), to see whether the gap is what they cost. Results go to
`benchmarks/results/sched_gap_trace<N>[_sigterm].json`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from baselines import ONE_TEAM, flatten, schedulers
from jitter import jittered

from _common import write_result
from visionloop.sched.policy import PolicyConfig
from visionloop.sched.sim import SimConfig, default_cluster, default_spot_traces, load_trace, simulate
from visionloop.sched.sim.cluster import ClusterSpec, Team
from visionloop.sched.sim.result import JobRecord

REPO = Path(__file__).resolve().parents[2]
SHORT_S = 3600.0  # a "short" job runs under an hour, a "long" one over six
LONG_S = 6 * 3600.0


def size_group(job: JobRecord) -> str:
    return "1 GPU" if job.gpus == 1 else "2-8 GPUs" if job.gpus <= 8 else "> 8 GPUs"


def length_group(job: JobRecord) -> str:
    return "< 1 h" if job.duration_s < SHORT_S else "1-6 h" if job.duration_s < LONG_S else "> 6 h"


def groups(job: JobRecord) -> list[tuple[str, str]]:
    return [
        ("size and length", f"{size_group(job)}, {length_group(job)}"),
        ("class", job.priority),
        ("team", job.team),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=int, default=5)
    ap.add_argument("--variants", type=int, default=16, help="versions of the trace (0 is the trace itself)")
    ap.add_argument("--jitter", type=float, default=60.0, help="seconds each submission moves, at most")
    ap.add_argument(
        "--baseline",
        default="tiresias",
        choices=["fifo", "slurm", "slurm-2x", "kueue", "kueue-fair", "tiresias"],
    )
    ap.add_argument("--sigterm-checkpoint", action="store_true", help="jobs write a checkpoint at SIGTERM")
    ap.add_argument("--one-team", action="store_true", help="every job in one team owning the cluster")
    ap.add_argument("--one-class", action="store_true", help="every job in the normal class")
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    args = ap.parse_args()
    if args.variants < 1:
        ap.error("--variants must be at least 1")

    cluster = default_cluster(default_spot_traces(args.data))
    if args.one_team:
        cluster = ClusterSpec(cluster.nodes, (Team(ONE_TEAM, cluster.total_gpus, 0),))
    sim = SimConfig(grace_s=60.0, sigterm_checkpoint=args.sigterm_checkpoint)
    base = load_trace(args.data / "sched" / "traces" / f"trace-{args.trace}.csv")
    diff: dict[tuple[str, str], float] = defaultdict(float)
    count: dict[tuple[str, str], int] = defaultdict(int)
    ratios: list[float] = []
    total_vl = total_base = 0.0
    jobs = 0
    for v in range(args.variants):
        trace = flatten(jittered(base, args.trace, v, args.jitter), args.one_team, args.one_class)
        run = schedulers(trace, 60.0, PolicyConfig(same_node=False))
        ours = {j.id: j for j in simulate(trace, cluster, run["visionloop"], sim).jobs}
        theirs = {j.id: j for j in simulate(trace, cluster, run[args.baseline], sim).jobs}
        done = [i for i in ours if ours[i].jct is not None and theirs[i].jct is not None]
        if len(done) != len(ours):  # an unfinished job would drop out of one side only
            sys.exit(f"version {v}: {len(ours) - len(done)} jobs did not finish under one scheduler")
        vl = sum(ours[i].jct or 0.0 for i in done)
        bl = sum(theirs[i].jct or 0.0 for i in done)
        ratios.append(vl / bl)
        total_vl += vl
        total_base += bl
        jobs += len(done)
        for i in done:
            d = ((ours[i].jct or 0.0) - (theirs[i].jct or 0.0)) / 3600
            for key in groups(ours[i]):
                diff[key] += d
                count[key] += 1

    whole = (total_vl - total_base) / 3600
    print(
        f"trace {args.trace}, {args.variants} versions, "
        f"SIGTERM checkpoints {'on' if args.sigterm_checkpoint else 'off'}"
        f"{', one team' if args.one_team else ''}{', one class' if args.one_class else ''}: "
        f"avg JCT visionloop / {args.baseline} {total_vl / total_base:.3f} "
        f"(per version mean {statistics.fmean(ratios):.3f}, worst {max(ratios):.3f}); "
        f"difference {whole:+.1f} job-hours over {jobs} jobs"
    )
    rows: list[dict[str, Any]] = []
    for kind in ("size and length", "class", "team"):
        head = f"{'jobs':>6} {'sum of JCT difference, h':>26} {'per job, h':>11} {'share of the gap':>17}"
        print(f"\n{kind:<22} {head}")
        for key in sorted((k for k in diff if k[0] == kind), key=lambda k: -diff[k]):
            share = diff[key] / whole if whole else float("nan")
            per_job = diff[key] / count[key]
            print(f"{key[1]:<22} {count[key]:>6} {diff[key]:>+26.1f} {per_job:>+11.2f} {share:>17.0%}")
            rows.append(
                {"group": kind, "value": key[1], "jobs": count[key], "jct_diff_h": round(diff[key], 2)}
            )
    name = f"sched_gap_trace{args.trace}{'_sigterm' if args.sigterm_checkpoint else ''}"
    name += "_one_team" if args.one_team else ""
    name += "_one_class" if args.one_class else ""
    path = write_result(
        name,
        {
            "trace": args.trace,
            "variants": args.variants,
            "baseline": args.baseline,
            "sigterm_checkpoint": args.sigterm_checkpoint,
            "one_team": args.one_team,
            "one_class": args.one_class,
            "ratio": round(total_vl / total_base, 4),
            "ratio_per_version": [round(r, 4) for r in ratios],
            "jct_diff_h": round(whole, 2),
            "groups": rows,
        },
    )
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
