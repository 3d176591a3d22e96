"""Scheduling cycle time: one `schedule()` call with 10,000 queued jobs on a busy 64-GPU
cluster, against the 50 ms target, with the strict-FIFO baseline (`fifo()`) timed on the
same views for comparison.

The view is what the control plane sees at a bad moment: every GPU busy (a mix of jobs
past their minimum runtime and young ones, some already preempting), three teams with
quotas, a queue of 10,000 jobs drawn from the benchmark traces' size/priority/spot mix,
some in retry back-off, a few bigger than the cluster. Three views (full cluster; 6 GPUs
free; a spot node down) under two configurations: the control plane's defaults (jobs on
one node, so sizes up to 8 GPUs) and the simulator's (jobs span nodes, trace sizes up to
48). Each is repeated, alternating with the baseline. Wall-clock and CPU time are both
reported: on a shared machine the CPU time is the steadier of the two.

    python benchmarks/sched/cycle_time.py [--queued 10000] [--repeat 30]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import pct, write_result
from visionloop.sched.policy import PolicyConfig, fifo, schedule
from visionloop.sched.sim import default_cluster
from visionloop.sched.view import ActiveJob, ClusterView, Decision, Gpu, PendingJob, SpotPolicy

SIZES = [1] * 40 + [2, 4] * 3 + [6] * 14 + [8] * 13 + [12] * 15 + [16] * 10 + [24, 32, 48]
PRIORITIES = [10] * 2 + [50] * 7 + [100]
SPOT: list[SpotPolicy] = ["never"] * 3 + ["allowed"] * 4 + ["preferred"] * 3
TEAMS = ["detection"] * 5 + ["segmentation"] * 3 + ["research"] * 2


def make_view(queued: int, free: int, spot_down: bool, seed: int = 0, max_gpus: int = 48) -> ClusterView:
    rng = random.Random(seed)
    cluster = default_cluster()
    now = 1_800_000_000.0
    gpus = [g for n in cluster.nodes for g in n.gpu_list()]
    if spot_down:
        gpus = [Gpu(g.id, g.node, g.type, g.price_class, up=g.node != "node7") for g in gpus]
    busy = [g for g in gpus if g.up][: len([g for g in gpus if g.up]) - free]
    running: list[ActiveJob] = []
    i = 0
    while i < len(busy):
        n = min(rng.choice([1, 1, 2, 4, 8]), len(busy) - i)
        started = now - rng.uniform(60, 20_000)
        running.append(
            ActiveJob(
                f"r{i}",
                rng.choice(TEAMS),
                rng.choice(PRIORITIES),
                tuple(g.id for g in busy[i : i + n]),
                started,
                rng.choice(SPOT) if not any(g.spot for g in busy[i : i + n]) else "allowed",
                last_checkpoint_at=started + 600 if now - started > 700 else None,
                attained_gpu_s=n * (now - started),
                preemptible=rng.random() > 0.05,
                submitted_at=started - rng.uniform(0, 7200),
                checkpoints_at_stop=True,  # the trainer does, as the control plane tells the policy
            )
        )
        i += n
    jobs = [
        PendingJob(
            f"q{k}",
            rng.choice(TEAMS),
            rng.choice(PRIORITIES),
            200 if k % 997 == 0 else min(max_gpus, rng.choice(SIZES)),  # a few can never fit
            now - rng.uniform(0, 86_400),
            rng.choice(SPOT),
            attained_gpu_s=0.0 if rng.random() < 0.8 else rng.uniform(0, 1e5),
            not_before=now + 120 if k % 50 == 0 else 0.0,
        )
        for k in range(queued)
    ]
    return ClusterView(now, gpus, {t.name: t for t in cluster.teams}, running, jobs)


def time_calls(fn: Callable[[], Decision], repeat: int) -> tuple[list[float], list[float]]:
    """Wall-clock and CPU milliseconds of `repeat` calls."""
    wall, cpu = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append((time.perf_counter() - t0) * 1000)
        cpu.append((time.process_time() - c0) * 1000)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queued", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument(
        "--easy-backfill",
        action="store_true",
        help="reservations hold GPUs (EASY backfill) and every other queued job gives a time limit",
    )
    ap.add_argument(
        "--srpt",
        action="store_true",
        help='order = "srpt" with srpt_preemption, and every other queued and running job gives a time limit',
    )
    args = ap.parse_args()
    easy, srpt = args.easy_backfill, args.srpt
    order: dict[str, Any] = {"order": "srpt", "srpt_preemption": True} if srpt else {}
    configs = {
        "one node (control plane)": (PolicyConfig(easy_backfill=easy, **order), 8),
        "spanning nodes (simulator)": (PolicyConfig(same_node=False, easy_backfill=easy, **order), 48),
    }
    results: dict[str, Any] = {}
    print(f"one scheduling cycle, {args.queued} queued jobs, 64 GPUs, {args.repeat} repetitions (ms)")
    print(
        f"{'config':27s} {'view':15s} {'wall median':>11s} {'p99':>6s} {'CPU median':>10s} "
        f"{'fifo wall':>9s} {'placed':>6s} {'evicted':>7s}"
    )
    for cname, (cfg, max_gpus) in configs.items():
        scenarios = {
            "full cluster": make_view(args.queued, free=0, spot_down=False, max_gpus=max_gpus),
            "6 GPUs free": make_view(args.queued, free=6, spot_down=False, seed=1, max_gpus=max_gpus),
            "spot node down": make_view(args.queued, free=2, spot_down=True, seed=2, max_gpus=max_gpus),
        }
        for name, view in scenarios.items():
            if easy or srpt:  # what EASY backfill and "srpt" read: the queued jobs' limits (1-5 h)
                limited = [
                    dataclasses.replace(j, max_runtime_s=3600.0 * (1 + k % 5)) if k % 2 else j
                    for k, j in enumerate(view.queued)
                ]
                view = dataclasses.replace(view, queued=limited)
            if srpt:  # and the running jobs' (1-5 h beyond what they ran)
                running = [
                    dataclasses.replace(j, max_runtime_s=view.now - j.started_at + 3600.0 * (1 + k % 5))
                    if k % 2
                    else j
                    for k, j in enumerate(view.running)
                ]
                view = dataclasses.replace(view, running=running)
            wall: list[float] = []
            cpu: list[float] = []
            base: list[float] = []
            for _ in range(2):  # alternate, so drift in machine load hits both alike
                w, c = time_calls(lambda v=view, cfg=cfg: schedule(v, cfg), args.repeat // 2)
                wall, cpu = wall + w, cpu + c
                base += time_calls(
                    lambda v=view, cfg=cfg: fifo(v, same_node=cfg.same_node), args.repeat // 2
                )[0]
            d = schedule(view, cfg)
            assert len(d.waiting) + len(d.placements) == len(view.queued), "a queued job got no reason"
            r = results[f"{cname} / {name}"] = {
                "wall_ms": wall,
                "cpu_ms": cpu,
                "fifo_wall_ms": base,
                "wall_median_ms": statistics.median(wall),
                "wall_p99_ms": pct(wall, 0.99),
                "cpu_median_ms": statistics.median(cpu),
                "fifo_wall_median_ms": statistics.median(base),
                "placed": len(d.placements),
                "evicted": len(d.evictions),
                "running": len(view.running),
            }
            print(
                f"{cname:27s} {name:15s} {r['wall_median_ms']:11.1f} {r['wall_p99_ms']:6.1f} "
                f"{r['cpu_median_ms']:10.1f} {r['fifo_wall_median_ms']:9.1f} "
                f"{r['placed']:6d} {r['evicted']:7d}"
            )
    worst_median = max(r["wall_median_ms"] for r in results.values())
    worst_p99 = max(r["wall_p99_ms"] for r in results.values())
    print(
        f"worst median {worst_median:.1f} ms, worst p99 {worst_p99:.1f} ms against the 50 ms target "
        f"(ratio {worst_median / 50:.2f} / {worst_p99 / 50:.2f}); load average at the end "
        f"{os.getloadavg()[0]:.1f} on {len(os.sched_getaffinity(0))} cores"
    )
    path = write_result(
        "sched_cycle" + ("_easy" if easy else "") + ("_srpt" if srpt else ""),
        {
            "config": vars(args) | {"gpus": 64, "policies": {k: repr(c) for k, (c, _) in configs.items()}},
            "target_ms": 50.0,
            "load_average_1min_at_end": os.getloadavg()[0],
            "scenarios": results,
        },
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
