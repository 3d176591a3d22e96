"""Run the scheduler simulator on one trace and print what the policy did.

    python -m visionloop.sched.sim --trace 3 [--policy visionloop|fifo] [--data DIR] [--json]

The job and spot traces are read from DIR (`sched/traces/trace-N.csv`, `spot/...`); by
default `../shared/data` next to a source checkout. For the side-by-side comparison with
FIFO over all traces, use `benchmarks/sched/simulate.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

from visionloop.core.errors import VisionloopError
from visionloop.sched.policy import PolicyConfig, fifo, schedule
from visionloop.sched.prices import load_catalog
from visionloop.sched.sim.cluster import default_cluster, default_spot_traces
from visionloop.sched.sim.config import Scheduler, SimConfig
from visionloop.sched.sim.engine import simulate
from visionloop.sched.sim.metrics import summarize
from visionloop.sched.sim.trace import load_trace

# src/visionloop/sched/sim/__main__.py -> the repository root is five levels up
DEFAULT_DATA = Path(__file__).resolve().parents[4].parent / "shared" / "data"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m visionloop.sched.sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=int, default=1, help="trace number N of sched/traces/trace-N.csv")
    ap.add_argument("--policy", choices=["visionloop", "fifo"], default="visionloop")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help=f"data folder (default {DEFAULT_DATA})")
    ap.add_argument("--prices", type=Path, default=None, help="price catalog TOML (default: the shipped one)")
    ap.add_argument("--json", action="store_true", help="print every metric as JSON")
    args = ap.parse_args(argv)
    try:
        if not args.data.is_dir():
            raise VisionloopError(f"data folder {args.data} does not exist; pass --data DIR")
        cluster = default_cluster(default_spot_traces(args.data))
        trace = load_trace(args.data / "sched" / "traces" / f"trace-{args.trace}.csv")
        scheduler: Scheduler = (
            partial(schedule, config=PolicyConfig(same_node=False))
            if args.policy == "visionloop"
            else partial(fifo, same_node=False)
        )
        result = simulate(trace, cluster, scheduler, SimConfig())
        metrics = summarize(result, cluster, load_catalog(args.prices))
    except VisionloopError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    if args.json:
        print(json.dumps(metrics, indent=2))
        return 0
    h = 3600.0
    print(f"trace {args.trace}, policy {args.policy}: {metrics['finished']}/{metrics['jobs']} jobs finished")
    print(f"  avg JCT {metrics['avg_jct_s'] / h:.2f} h, makespan {metrics['makespan_s'] / h:.1f} h")
    print(f"  utilisation {metrics['utilisation']:.0%} (useful {metrics['useful_utilisation']:.0%})")
    for cls, g in metrics["by_priority"].items():
        jct, wait = g["avg_jct_s"] / h, g["avg_queue_s"] / h
        print(f"  {cls:8s} {g['jobs']:4d} jobs, avg JCT {jct:6.2f} h, avg wait {wait:6.2f} h")
    lost = metrics["lost_gpu_h"]
    print(
        f"  lost {lost['preempted']:.0f} GPU-h to {metrics['preemptions']} preemptions, "
        f"{lost['interrupted']:.0f} GPU-h to {metrics['interruptions']} spot interruptions"
    )
    print(f"  cost {metrics['cost_usd']:,.0f} USD; spot saved {metrics['spot_savings_usd']:,.0f} USD")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
