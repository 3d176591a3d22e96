"""The Tiresias baseline checked against the authors' own simulator.

`visionloop.sched.sim.tiresias` re-implements Tiresias' discretized 2D-LAS from the paper and
from its simulator's `dlas-gpu` policy (SymbioticLab/Tiresias, `simulator/run_sim.py`,
Apache-2.0). This script runs both on the same traces, in the conditions the authors'
simulator assumes: every GPU always up (no spot), preemption free and instant (no grace
period, no restart cost, no work lost), GPUs counted rather than placed (`--scheme=count`).
It prints each one's average JCT, their ratio per trace and how many jobs' JCTs agree
within 5%. With `TiresiasConfig.reference_rounds` (the default) ours decides exactly when
the authors' does, and every job's JCT agrees to the second (2026-11-29: 1,280 of 1,280);
`--every-cycle` decides at every cycle of our simulator (`--tick` seconds) instead.

The authors' simulator needs Python 2.7 with numpy (< 1.17) and a copy of the repository,
which this script does not fetch:

    git clone https://github.com/SymbioticLab/Tiresias /tmp/Tiresias
    ~/.pyenv/versions/2.7.18/bin/python -m pip install "numpy<1.17"
    python benchmarks/sched/tiresias_crosscheck.py --tiresias /tmp/Tiresias/simulator \\
        --python2 ~/.pyenv/versions/2.7.18/bin/python [--traces 1,2] [--queues 2]

`--queues 2` (the default) is the issue's configuration, one threshold of 3,250 GPU-s; with 3
the authors' simulator's default, thresholds 3,250 and 7,200 GPU-s.
"""

from __future__ import annotations

import argparse
import csv
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import write_result
from visionloop.sched.sim import SimConfig, default_cluster, load_trace, simulate
from visionloop.sched.sim.tiresias import Tiresias, TiresiasConfig
from visionloop.sched.sim.trace import TraceJob

REPO = Path(__file__).resolve().parents[2]
THRESHOLDS = (3250.0, 7200.0)  # the authors' `queue_limit` (its third value is never read with 3 queues)


def write_authors_trace(trace: list[TraceJob], path: Path) -> list[str]:
    """The trace in the authors' CSV format (job_id, num_gpu, submit_time, iterations,
    model_name, duration, interval), times rounded to whole seconds as it reads them; returns
    our job ids in its job_id order (it numbers jobs by position)."""
    jobs = sorted(trace, key=lambda j: (j.submit_time, j.id))
    t0 = jobs[0].submit_time
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["job_id", "num_gpu", "submit_time", "iterations", "model_name", "duration", "interval"])
        for i, j in enumerate(jobs):
            nxt = jobs[i + 1].submit_time if i + 1 < len(jobs) else j.submit_time
            # The model only sizes memory, which the count scheme ignores.
            w.writerow(
                [
                    i,
                    j.gpus,
                    int(j.submit_time - t0),
                    1,
                    "resnet50",
                    int(j.duration_s),
                    int(nxt - j.submit_time),
                ]
            )
    return [j.id for j in jobs]


def run_authors(
    sim_dir: Path, python2: str, trace_csv: Path, gpus: int, queues: int, work: Path
) -> list[float]:
    """Run the authors' simulator (`dlas-gpu`, count scheme) on a copy of it with `queues`
    queues; the JCT of each job, in its job_id order."""
    copy = work / "simulator"
    shutil.copytree(sim_dir, copy)
    jobs_py = copy / "jobs.py"
    text = jobs_py.read_text()
    # TFJobs' own queue count (the first one in the file belongs to a commented-out class).
    text, n = re.subn(r"(self\.num_queue = )3\n", rf"\g<1>{queues}\n", text, count=1)
    if n != 1:
        raise SystemExit(f"{jobs_py}: no 'self.num_queue = 3' to set; is this SymbioticLab/Tiresias?")
    jobs_py.write_text(text)
    nodes = gpus // 8
    (copy / "spec.csv").write_text(
        f"num_switch,num_node_p_switch,num_gpu_p_node,num_cpu_p_node,mem_p_node\n1,{nodes},8,128,1024\n"
    )
    log = work / "log"
    done = subprocess.run(
        [
            python2,
            "run_sim.py",
            "--cluster_spec=spec.csv",
            "--scheme=count",
            "--schedule=dlas-gpu",
            f"--trace_file={trace_csv}",
            f"--log_path={log}",
        ],
        cwd=copy,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise SystemExit(
            f"the authors' simulator failed ({python2}, exit {done.returncode}):\n{tail}\n"
            "It needs Python 2.7 with numpy < 1.17 (pip install 'numpy<1.17')."
        )
    jct: dict[int, float] = {}
    with (log / "job.csv").open() as f:
        for row in csv.DictReader(f):
            jct[int(row["job_id"])] = float(row["JCT"])
    return [jct[i] for i in sorted(jct)]


def run_ours(
    trace: list[TraceJob], queues: int, tick_s: float, reference_rounds: bool = True
) -> dict[str, float]:
    """Our Tiresias in our simulator, in the authors' conditions."""
    cluster = default_cluster((None, None))  # 64 GPUs, spot nodes never interrupted
    cfg = SimConfig(grace_s=0.0, restart_overhead_s=0.0, sigterm_checkpoint=True, tick_s=tick_s)
    # Whole seconds, as the authors' simulator reads the trace; any GPU for any job, as it
    # has no spot classes.
    rounded = [
        TraceJob(
            j.id, float(int(j.submit_time)), j.gpus, float(int(j.duration_s)), j.team, j.priority, "allowed"
        )
        for j in trace
    ]
    sched = Tiresias(
        TiresiasConfig(thresholds_gpu_s=THRESHOLDS[: queues - 1], reference_rounds=reference_rounds)
    )
    result = simulate(rounded, cluster, sched, cfg)
    if result.unfinished:
        raise SystemExit(f"our Tiresias left {len(result.unfinished)} jobs unfinished")
    return {j.id: float(j.jct) for j in result.jobs if j.jct is not None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiresias", type=Path, required=True, help="the authors' simulator/ folder")
    ap.add_argument(
        "--python2", required=True, help="a Python 2.7 interpreter (the authors' simulator needs it)"
    )
    ap.add_argument("--traces", default="1,2,3,4,5,6,7,8", help="comma-separated trace numbers")
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data", help="shared data folder")
    ap.add_argument("--queues", type=int, choices=(2, 3), default=2, help="LAS queues (2: one threshold)")
    ap.add_argument("--tick", type=float, default=1.0, help="our simulator's cycle while jobs wait (s)")
    ap.add_argument(
        "--every-cycle",
        action="store_true",
        help="our Tiresias decides every cycle and demotes at the threshold (reference_rounds off)",
    )
    ap.add_argument("--name", default="sched_tiresias_crosscheck", help="results file name")
    args = ap.parse_args()
    if not (args.tiresias / "run_sim.py").is_file():
        raise SystemExit(
            f"{args.tiresias}: no run_sim.py; pass the simulator/ folder of SymbioticLab/Tiresias"
        )
    rows = []
    all_theirs: list[float] = []
    all_ours: list[float] = []
    print(
        f"{'trace':>5} {'jobs':>5} {'authors avg JCT h':>18} {'ours avg JCT h':>15} "
        f"{'ours / authors':>15} {'jobs within 5%':>15}"
    )
    for n in (int(x) for x in args.traces.split(",")):
        trace = load_trace(args.data / "sched" / "traces" / f"trace-{n}.csv")
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            ids = write_authors_trace(trace, work / "trace.csv")
            theirs = run_authors(args.tiresias, args.python2, work / "trace.csv", 64, args.queues, work)
        ours_by_id = run_ours(trace, args.queues, args.tick, not args.every_cycle)
        ours = [ours_by_id[i] for i in ids]
        close = sum(abs(a - b) <= 0.05 * max(a, b, 60.0) for a, b in zip(ours, theirs, strict=True))
        a_t, a_o = sum(theirs) / len(theirs), sum(ours) / len(ours)
        rows.append(
            {
                "trace": n,
                "jobs": len(ids),
                "authors_avg_jct_s": a_t,
                "ours_avg_jct_s": a_o,
                "ratio": a_o / a_t,
                "jobs_within_5pct": close,
            }
        )
        all_theirs += theirs
        all_ours += ours
        print(
            f"{n:>5} {len(ids):>5} {a_t / 3600:>18.3f} {a_o / 3600:>15.3f} {a_o / a_t:>15.3f} "
            f"{close:>11} of {len(ids)}"
        )
    total = sum(all_ours) / sum(all_theirs)
    print(f"all traces: ours / authors = {total:.3f}")
    path = write_result(
        args.name,
        {
            "config": {
                "queues": args.queues,
                "thresholds_gpu_s": THRESHOLDS[: args.queues - 1],
                "tick_s": args.tick,
                "reference_rounds": not args.every_cycle,
            },
            "per_trace": rows,
            "ratio_all_jobs": total,
        },
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
