"""What polling every running attempt costs the control plane on Slurm, each cycle: the Slurm
executor reading the whole queue once per second (`queue_ttl_s = 1`, the default) against
asking squeue about each job (`queue_ttl_s = 0`, the baseline), in the same run, rounds
alternating, on a real Slurm cluster.

    bash .ci/slurm.sh   # as root: a two-node test cluster on this machine
    python benchmarks/sched/slurm_poll.py [--jobs 48] [--rounds 5] [--slurm-conf PATH]

`--jobs` sleeping CPU jobs are submitted through the executor (those that do not fit wait in
Slurm's queue and are polled all the same), then each round polls all of them as one
scheduling cycle does, once per configuration. Prints the median cycle of each and the ratio;
results go to `benchmarks/results/sched_slurm_poll.json`. The jobs are cancelled at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import machine, write_result
from visionloop.sched.executors.base import LaunchRequest
from visionloop.sched.executors.slurm import SlurmExecutor

DEFAULT_CONF = "/tmp/visionloop-slurm/slurm.conf"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--partition", default="vltest")
    ap.add_argument("--slurm-conf", default=os.environ.get("SLURM_CONF", DEFAULT_CONF))
    args = ap.parse_args()
    if args.jobs < 1 or args.rounds < 1:
        ap.error("--jobs and --rounds must be at least 1")
    prefix = f"vlbench-{os.getpid()}"
    snapshot = SlurmExecutor(args.partition, prefix=prefix, slurm_conf=args.slurm_conf)
    per_job = SlurmExecutor(args.partition, prefix=prefix, slurm_conf=args.slurm_conf, queue_ttl_s=0)
    work = Path(tempfile.mkdtemp(prefix="vl-slurm-poll-"))
    handles = []
    try:
        for i in range(1, args.jobs + 1):
            request = LaunchRequest(
                job_id=i,
                attempt=1,
                command=[sys.executable, "-c", "import time; time.sleep(3600)"],
                gpus=[],
                attempt_dir=work / f"job-{i}" / "attempt-1",
                cpus=1,
                memory_gb=0.0,
            )
            handles.append(snapshot.launch(request))
        time.sleep(3)  # let Slurm start what fits
        cycles: dict[str, list[float]] = {"snapshot": [], "per_job": []}
        for _ in range(args.rounds):
            for name, ex in (("per_job", per_job), ("snapshot", snapshot)):
                time.sleep(1.1)  # a cycle later: the snapshot is read again, as in a real cycle
                t0 = time.perf_counter()
                states = [ex.poll(h).state for h in handles]
                cycles[name].append(time.perf_counter() - t0)
                assert states.count("running") == len(handles), states
        base, ours = statistics.median(cycles["per_job"]), statistics.median(cycles["snapshot"])
        print(f"{args.jobs} attempts polled once, median of {args.rounds} cycles:")
        print(f"  squeue per job (baseline): {base * 1000:8.1f} ms")
        print(f"  one squeue a second:       {ours * 1000:8.1f} ms")
        print(f"  ratio: {ours / base:.3f} ({base / ours:.1f}x faster)")
        path = write_result(
            "sched_slurm_poll",
            {
                "machine": machine(),
                "jobs": args.jobs,
                "rounds": args.rounds,
                "per_job_cycle_s": [round(x, 4) for x in cycles["per_job"]],
                "snapshot_cycle_s": [round(x, 4) for x in cycles["snapshot"]],
                "ratio": round(ours / base, 4),
            },
        )
        print(f"results: {path}")
    finally:
        for h in handles:
            snapshot.kill(h)


if __name__ == "__main__":
    main()
